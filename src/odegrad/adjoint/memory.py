"""How many states an adjoint keeps: one policy, whose text ``og.explain_adjoint`` prints.

Every reverse pass needs the forward states, last first. It either keeps each step's record
(``"all"``: no step re-taken) or keeps ``c`` checkpoints and recomputes the rest on a binomial
schedule (:mod:`~odegrad.adjoint.checkpointing`). :func:`checkpoint_policy` decides between them
from the bytes one step's record takes, the step count (static, or at most ``max_steps``), the
memory budget and the vmap batch: a batched solve holds one copy per member, so the budget is
for the whole batch.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from .._tuning import tuning
from .base import Problem


class CheckpointPolicy(NamedTuple):
    """The decision (``"all"`` or a number of checkpoints) and the sentence that explains it;
    ``pullbacks``: every step's VJP is kept rather than its state (``Discrete``'s
    :func:`~odegrad.adjoint.discrete.keeps_pullbacks`)."""

    checkpoints: int | Literal["all"]
    text: str
    pullbacks: bool = False


def checkpoint_policy(
    problem: Problem,
    step_record_bytes: int,
    budget: int | None = None,
    adaptive_all: int | None = None,
) -> CheckpointPolicy:
    """Keep every step's record of ``step_record_bytes`` (per member) while it fits, else
    checkpoints.

    * A grid known at trace time keeps all ``n`` records while ``n * record * batch <= budget``;
      otherwise ``budget // (state * batch)`` checkpoints, at most ``n`` and at least
      ``Tuning.min_checkpoints`` unless a budget was given (then at least 2).
    * An adaptive solve allocates ``max_steps`` rows whatever it takes, and fresh memory costs
      (page faults on CPU), so it keeps all only while that buffer is at most ``adaptive_all``
      (default ``tuning().adaptive_all_bytes``) and the budget. Otherwise its forward pass keeps its
      first ``c`` states: ``c`` at most ``adaptive_slots``, within ``adaptive_prefix_bytes``
      unless that leaves fewer than ``adaptive_min_slots``, and within the budget (the same
      floor as above).
    """
    t = tuning()
    floor = 2 if budget is not None else max(2, t.min_checkpoints)
    budget = t.memory_budget if budget is None else budget
    batch = max(problem.batch, 1)
    per_member = "" if batch == 1 else f" per member, x{batch} batch members"
    n = problem.static_steps
    if n is not None:
        need = n * step_record_bytes * batch
        if need <= budget:
            return CheckpointPolicy(
                "all",
                f"keeping every step ({n} x {_mib(step_record_bytes)}{per_member}) fits the "
                f"{_mib(budget)} budget, so nothing is recomputed",
            )
        state = max(problem.state_bytes(), 1) * batch
        fit = budget // state
        c = int(min(n, max(floor, fit)))
        if c > fit:
            return CheckpointPolicy(
                "all" if c == n else c,
                f"keeping every step ({_mib(need)}) would exceed the {_mib(budget)} budget, "
                f"which holds {fit} checkpoints of {_mib(problem.state_bytes())}{per_member}; "
                + _below_floor(floor, "every step is kept" if c == n else f"{c} are kept"),
            )
        return CheckpointPolicy(
            c,
            f"keeping every step ({_mib(need)}) would exceed the {_mib(budget)} budget, so {c} "
            f"checkpoints of {_mib(problem.state_bytes())}{per_member} are kept and the rest "
            "recomputed on a binomial (revolve) schedule",
        )
    rows = problem.max_steps * step_record_bytes * batch
    keep_all = min(budget, t.adaptive_all_bytes if adaptive_all is None else adaptive_all)
    if rows <= keep_all:
        return CheckpointPolicy(
            "all",
            f"a buffer for all max_steps={problem.max_steps} steps takes {_mib(rows)} (at most "
            f"{_mib(keep_all)}), so every step's state is kept and no step is re-taken from "
            "an earlier one",
        )
    row = max(problem.checkpoint_bytes(), 1) * batch
    slots = max(t.adaptive_prefix_bytes // row, t.adaptive_min_slots)
    fit = budget // row
    c = int(max(2, min(t.adaptive_slots, problem.max_steps, slots, max(floor, fit))))
    over = ""
    if c > fit:
        over = f" (the {_mib(budget)} budget holds {fit}; {_below_floor(floor, f'{c} are kept')})"
    return CheckpointPolicy(
        c,
        f"a buffer for all max_steps={problem.max_steps} steps would take {_mib(rows)} (more "
        f"than {_mib(keep_all)}), so the forward pass keeps its first {c} states of "
        f"{_mib(problem.checkpoint_bytes())}{per_member}{over}: a solve of at most {c} steps "
        "recomputes nothing, a few steps more are re-taken from the last kept state, and a "
        "longer one recomputes on a binomial (revolve) schedule",
    )


def _below_floor(floor: int, kept: str) -> str:
    """Why the default budget was exceeded: revolve with ``s`` checkpoints re-takes each step
    about ``r`` times where ``binomial(s + r, s) >= n`` (2 checkpoints, 25 steps: 6 times)."""
    return (
        f"fewer than Tuning.min_checkpoints = {floor} would re-take steps many times over, so "
        f"{kept} (pass memory_budget= to hold to a budget)"
    )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3g} MiB"
