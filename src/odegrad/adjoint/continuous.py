"""Continuous adjoints ("optimise-then-discretise"): the adjoint ODE integrated backwards.

The three methods share one backward pass (:mod:`~odegrad.adjoint.adjoint_ode`) and differ in
where it gets the forward state ``y(t)`` (a source of :mod:`~odegrad.adjoint.sources`) and in how
it integrates ``dL/dp``:

* :class:`Interpolating` — ``y`` from the forward dense output: every step's, blocks of steps'
  (under ``jax.vmap``), or re-taken step by step from checkpoints;
* :class:`Quadrature` — as Interpolating, with ``dL/dp`` by Gauss–Legendre quadrature on each
  backward step;
* :class:`Backsolve` — ``y`` re-integrated backwards with the adjoint, reset at every save.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax

from .._loop import LoopOutput
from .._step import Adaptive
from .._tree import tree_bytes
from .._tuning import tuning
from .adjoint_ode import _Continuous
from .base import Problem
from .memory import CheckpointPolicy, checkpoint_policy
from .sources import DenseBlocks, ForwardDense, RecomputedSteps, Reintegrated, StateSource


@dataclass(frozen=True)
class Interpolating(_Continuous):
    """Continuous adjoint on the forward dense output — the robust continuous choice.

    Args:
        checkpoints: ``None`` keeps the dense output of every forward step while that fits in
            ``memory_budget`` (fixed grids: every step; adaptive: ``max_steps`` rows, up to 8
            MiB, or under ``jax.vmap`` without events up to 2 MiB for the batch; beyond that,
            without events, in blocks of steps (``dense_rows``) while two blocks fit 32 MiB,
            or the budget under vmap; with events up to 128 MiB), and otherwise behaves as an
            int (adaptive: at most 64). An int ``c`` keeps only the step sizes in the forward
            pass; the backward pass obtains the forward states last-first from ``c``
            checkpoints on a binomial (revolve) schedule and re-takes each step for its dense
            output: memory ``c`` states plus one step, whatever the step count.
        memory_budget: bytes for ``checkpoints=None``, for the whole ``jax.vmap`` batch;
            default the backend's tuning table (256 MiB).
        dense_rows: adaptive solves without events: the forward pass keeps the dense output of
            this many steps at a time (the last block's) and the state at each block's start;
            the backward pass re-takes each earlier block's steps once. ``None`` (default):
            every step's while ``max_steps`` rows take at most 8 MiB (under ``jax.vmap``: 2
            MiB for the whole batch), else blocks of at least 64 steps (in 2 MiB under vmap).
        vjp: ``vjp(t, y, args, cotangent) -> (ct_y, ct_args)``; default ``jax.vjp`` of ``f``.
        solver: the backward solver; default the forward one.
        step: the backward step control; default the forward one.

    Example:
        >>> jax.grad(loss)(params)   # loss calls og.solve(..., adjoint=og.Interpolating())
    """

    checkpoints: int | None = None
    memory_budget: int | None = None
    dense_rows: int | None = None

    def policy(self, problem: Problem) -> CheckpointPolicy:
        """Keep the dense output of every step, of blocks of steps, or checkpoints (see
        :func:`checkpoint_policy`)."""
        return self._policy(problem, None)

    def _policy(self, problem: Problem, row: int | None) -> CheckpointPolicy:
        if self.checkpoints is not None:
            return CheckpointPolicy(self.checkpoints, f"checkpoints={self.checkpoints!r} as given")
        row = self._row_bytes(problem) if row is None else row
        rows = self.dense_rows or self._block_rows(problem, row)
        if rows is not None:
            batch = max(problem.batch, 1)
            per_member = "" if batch == 1 else f" per member, x{batch} batch members"
            return CheckpointPolicy(
                "all",
                f"a buffer for all max_steps={problem.max_steps} steps' dense output would take "
                f"{problem.max_steps * row * batch / 2**20:.3g} MiB, so the forward pass keeps "
                f"that of {rows} steps at a time ({rows * row / 2**20:.3g} MiB{per_member}) and "
                f"the state at each block's start: a solve of at most {rows} steps recomputes "
                "nothing, a longer one re-takes each earlier block's steps once",
            )
        adaptive_all = tuning().adaptive_dense_bytes
        return checkpoint_policy(problem, row, self.memory_budget, adaptive_all)

    def describe(self, problem: Problem) -> str:
        return (
            f"{type(self).__name__}(): the continuous adjoint, reading y(t) from the forward "
            f"pass's dense output; {self.policy(problem).text}{self.saves_text(problem)}"
        )

    @staticmethod
    def _row_bytes(problem: Problem) -> int:
        dense = jax.eval_shape(
            lambda y, a: (
                problem.step(
                    problem.tau0, 1.0, y, a, problem.init_state(y, a), None, problem.tau0 + 1.0
                ).dense
            ),
            problem.y0,
            problem.args,
        )
        return tree_bytes(dense)

    def _block_rows(self, problem: Problem, row: int) -> int | None:
        """Steps per block of dense output (:class:`~odegrad.adjoint.sources.DenseBlocks`) for
        an adaptive solve without events whose ``max_steps`` rows pass
        ``Tuning.adaptive_all_bytes`` (one trajectory) or ``Tuning.dense_block_bytes`` for the
        whole vmapped batch: at least ``adaptive_slots``, as many as the latter holds, if two
        blocks and the states at their starts fit the memory budget (one trajectory: also
        ``Tuning.single_blocks_bytes``), else ``None``."""
        t = tuning()
        if problem.grid is not None or problem.events is not None:
            return None
        if not isinstance(problem.control, Adaptive):
            return None
        batch = max(problem.batch, 1)
        # every step's dense output, in one block, while it fits (Tuning.adaptive_all_bytes for
        # one trajectory, as Discrete keeps every step's state)
        every = t.adaptive_all_bytes if batch == 1 else t.dense_block_bytes
        if problem.max_steps * row * batch <= every:
            return None
        rows = max(t.adaptive_slots, t.dense_block_bytes // (row * batch))
        if 2 * rows >= problem.max_steps:  # (two blocks hold as much as every step's)
            return None
        starts = -(-problem.max_steps // rows) * max(problem.checkpoint_bytes(), 1)
        budget = t.memory_budget if self.memory_budget is None else self.memory_budget
        if batch == 1:  # one trajectory: see Tuning.single_blocks_bytes
            budget = min(budget, t.single_blocks_bytes)
        # two blocks and the starts: as measured when the backward pass re-took blocks into
        # a buffer of its own; it now writes over the forward pass's (one block allocated),
        # and the thresholds were tuned (Tuning.single_blocks_bytes) with two
        return rows if (2 * rows * row + starts) * batch <= budget else None

    def run(self, problem: Problem) -> LoopOutput:
        if self.dense_rows is not None and (
            self.checkpoints is not None
            or problem.grid is not None
            or problem.events is not None
            or not isinstance(problem.control, Adaptive)
        ):
            raise ValueError(
                f"{type(self).__name__}(dense_rows={self.dense_rows}) is for adaptive solves "
                "without events and without checkpoints=...; drop dense_rows."
            )
        if self.checkpoints is None and self.dense_rows is None:
            row = self._row_bytes(problem)
            rows = self._block_rows(problem, row)
            if rows is not None:
                return replace(self, dense_rows=rows).run(problem)
            checkpoints = self._policy(problem, row).checkpoints
            if checkpoints != "all":
                return replace(self, checkpoints=int(checkpoints)).run(problem)
        return super().run(problem)

    def __post_init__(self):
        super().__post_init__()
        if self.checkpoints is not None and not (
            isinstance(self.checkpoints, int) and self.checkpoints >= 1
        ):
            raise ValueError(
                f"Interpolating(checkpoints={self.checkpoints!r}): use None or a positive int."
            )
        if self.dense_rows is not None and not (
            isinstance(self.dense_rows, int) and self.dense_rows >= 1
        ):
            raise ValueError(
                f"Interpolating(dense_rows={self.dense_rows!r}): use None or a positive int."
            )

    @property
    def source(self) -> StateSource:
        if self.checkpoints is not None:
            return RecomputedSteps(self.checkpoints)
        return ForwardDense() if self.dense_rows is None else DenseBlocks(self.dense_rows)


@dataclass(frozen=True)
class Quadrature(Interpolating):
    """Adjoint ODE for the state only; ``dL/dp`` by Gauss–Legendre quadrature on every backward
    step (with ``ceil((order + 1) / 2)`` nodes), reading ``y`` and ``a`` from the two dense
    outputs. No parameter-sized state is integrated, so it suits many parameters.

    Example:
        >>> og.solve(f, y0, (0.0, 1.0), params, adjoint=og.Quadrature())
    """

    quadrature = True


@dataclass(frozen=True)
class Backsolve(_Continuous):
    """Continuous adjoint that re-integrates the state backwards with the adjoint: O(1) memory.

    At every save time the re-integrated state is compared with the stored forward state and
    reset to it. If it drifted by more than 1e6 tolerances or 10 % of the state
    (``sources.drift_limit``) — the signature of a problem that is unstable backwards
    (diffusion, damping, stiffness, an attracting limit cycle) — the reverse pass raises
    (``on_drift="raise"``, default) or warns (``"warn"``) and recommends ``og.Interpolating()``.

    Example:
        >>> og.solve(f, y0, (0.0, 1.0), params, adjoint=og.Backsolve())
    """

    on_drift: str = "raise"

    def __post_init__(self):
        super().__post_init__()
        if self.on_drift not in ("raise", "warn"):
            raise ValueError(f"Backsolve(on_drift={self.on_drift!r}): use 'raise' or 'warn'.")

    @property
    def source(self) -> StateSource:
        return Reintegrated(self.on_drift)
