"""The exact gradient of the discretised solution ("discretise-then-optimise").

Step sizes are taken as constants, so the gradient is that of the numbers the solver computed.
A grid known at trace time with every step kept is left to JAX's own differentiation of
``lax.scan`` (nothing recomputed, the same program a hand-written scan gives). Everything else
has a custom VJP that replays the recorded steps backwards under a binomial checkpointing
schedule (:mod:`odegrad.adjoint.checkpointing`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from .._loop import LoopOutput, save_slots
from .._tree import tree_add, tree_zeros_like
from .base import AbstractAdjoint, Problem, call_custom_vjp
from .checkpointing import reverse_steps

#: Memory that ``checkpoints=None`` lets the stored states take before it recomputes instead.
DEFAULT_MEMORY_BUDGET = 256 * 2**20
#: An adaptive ``checkpoints=None`` keeps every step (a buffer of ``max_steps`` states, allocated
#: whatever the step count) only while that buffer is at most this big: measured on a 64x64
#: diffusion (Tsit5), a 256 MiB buffer made the gradient 18 ms against 1.2 ms with 64 slots.
ADAPTIVE_ALL_BYTES = 8 * 2**20
#: Otherwise it keeps at most this many states: the forward pass fills them (a solve of no
#: more steps recomputes nothing), and the binomial schedule reverses ~2000 steps with 64 slots
#: in two recomputing sweeps, so more slots would mostly cost allocation.
ADAPTIVE_SLOTS = 64
#: ... and at most this many bytes of them, but at least :data:`ADAPTIVE_MIN_SLOTS` states
#: (within ``memory_budget``). The buffer is allocated and zeroed whole on every gradient call,
#: used or not, and on CPU memory that fresh costs a page fault per 4 KiB when first touched:
#: measured ~0.4 ms per MiB, as much as a 96^3 float32 ROCK2 gradient's forward pass for 64
#: states of 3.4 MiB. So large states get fewer slots (18 of 3.4 MiB); a longer solve
#: recomputes under the binomial schedule.
ADAPTIVE_PREFIX_BYTES = 64 * 2**20
#: A step recomputed costs far more than a zeroed row, so a solve of the 10-30 steps typical of
#: stabilised methods should not recompute: 96^3 float64 ROCK2 (13 steps of 6.8 MiB) took 3.9x
#: its forward time with 9 slots, 3.5x with 18.
ADAPTIVE_MIN_SLOTS = 16


@dataclass(frozen=True)
class Discrete(AbstractAdjoint):
    """Differentiate the solver's own steps, exactly.

    Args:
        checkpoints: ``"all"`` keeps every step (nothing is recomputed); an int ``c`` keeps at most
            ``c`` states and recomputes the rest under Griewank's binomial (revolve) schedule,
            for fixed and adaptive solves alike (adaptive solves record their step sizes and the
            schedule is made at run time once the step count is known; the forward pass keeps
            the first ``c`` states, so a solve of at most ``c`` steps recomputes nothing).
            ``None`` (default) keeps everything while that fits in ``memory_budget`` bytes (fixed
            grids: every step's stages; adaptive: ``max_steps`` states, up to 8 MiB) and
            otherwise as many checkpoints as fit (adaptive: at most 64, in at most 64 MiB unless
            that leaves fewer than 16).
        memory_budget: bytes for ``checkpoints=None``.

    Example:
        >>> jax.grad(lambda p: og.solve(f, y0, (0., 1.), p, adjoint=og.Discrete(8)).ys[-1].sum())
    """

    checkpoints: int | Literal["all"] | None = None
    memory_budget: int = DEFAULT_MEMORY_BUDGET

    def __post_init__(self):
        c = self.checkpoints
        if not (c is None or c == "all" or (isinstance(c, int) and c >= 1)):
            raise ValueError(
                f"Discrete(checkpoints={c!r}): use None, 'all' or a positive int (the number "
                "of stored states)."
            )

    def resolve(self, problem: Problem) -> int | Literal["all"]:
        """The concrete checkpoint setting this problem gets."""
        if self.checkpoints is not None:
            return self.checkpoints
        per_state = problem.state_bytes()
        n = problem.static_steps
        if n is not None:
            stages = getattr(problem.solver, "step_evals", 1) + 2
            if n * stages * per_state <= self.memory_budget:
                return "all"
            return max(2, min(n, self.memory_budget // per_state))
        if problem.max_steps * per_state <= min(self.memory_budget, ADAPTIVE_ALL_BYTES):
            return "all"
        row = max(problem.checkpoint_bytes(), 1)
        slots = max(ADAPTIVE_PREFIX_BYTES // row, ADAPTIVE_MIN_SLOTS)
        return max(2, min(ADAPTIVE_SLOTS, problem.max_steps, slots, self.memory_budget // row))

    def describe(self, problem: Problem) -> str:
        return f"Discrete(checkpoints={self.resolve(problem)!r})"

    def run(self, problem: Problem) -> LoopOutput:
        checkpoints = self.resolve(problem)
        if problem.static_steps is not None and (
            checkpoints == "all" or checkpoints >= problem.static_steps
        ):
            return problem.forward()
        return _checkpointed(problem, checkpoints)


def _checkpointed(problem: Problem, checkpoints) -> LoopOutput:
    """The solve with a custom VJP that reverses the steps under binomial checkpointing."""
    solver, plan = problem.solver, problem.plan
    fixed = problem.static_steps is not None
    store_all = checkpoints == "all"
    # keep (y, solver state) pairs unless the state can be recomputed from y
    keep_state = store_all or not problem.solver.state_from_y
    need_dense = plan.ts is not None or plan.dense
    # adaptive solves keep their first `checkpoints` states while running forward: a solve that
    # took no more steps needs no recomputation, and a longer one uses them as the workspace
    prefix = not fixed and not store_all
    record = "all" if store_all or (prefix and keep_state) else "y" if prefix else "times"
    record_rows = int(checkpoints) if prefix else None

    def strip(out: LoopOutput) -> LoopOutput:
        return out._replace(record={})

    problem = problem.without_scan_tap()

    @jax.custom_vjp
    def solve(y0, args_diff):
        return strip(problem.forward(y0, problem.with_args(args_diff)))

    def solve_fwd(y0, args_diff):
        out = problem.forward(y0, problem.with_args(args_diff), record, record_rows)
        return strip(out), (y0, args_diff, out.record)

    def solve_bwd(res, ct: LoopOutput):
        y0, args_diff, rec = res
        args = problem.with_args(args_diff)
        if fixed:
            starts = problem.grid
            sizes = problem.grid[1:] - problem.grid[:-1]
            n = problem.static_steps
        else:
            starts, sizes, n = rec["starts"], rec["sizes"], rec["n"]
        n_rows = sizes.shape[0]
        if plan.ts is not None:
            j_start, j_count = save_slots(starts, plan.ts, n_rows)
            j_start = jnp.where(jnp.arange(n_rows) < n, j_start, 0)

        # With int checkpoints, f's internals are recomputed inside each reverse step rather
        # than held as residuals (memory is what the user asked to save), and only y is kept:
        step_problem = (
            problem
            if store_all
            else dataclasses.replace(
                problem, f=_rematerialized(problem.f, problem.solver.partitioned)
            )
        )

        # the solver's carried state: the solver's carried state (the FSAL stage
        # f(t, y), or Leapfrog's acceleration) is a function of (t, y) and is recomputed, which
        # halves the checkpoint memory for one extra f evaluation per reverse step.
        def step_fn(k, y, st, a_diff):
            a = problem.with_args(a_diff)
            if st is None:
                st = problem.init_state(y, a, starts[k])
            res_ = step_problem.step(starts[k], sizes[k], y, a, st)
            # the dense output is an output of the step only when saves read it: otherwise the
            # reverse step would push zero cotangents through every stage
            return res_.y1, (res_.state if keep_state else None), (res_.dense if need_dense else ())

        def advance(k, x):
            if keep_state:
                y1, st1, _ = step_fn(k, x[0], x[1], args_diff)
                return (y1, st1)
            return step_fn(k, x, None, args_diff)[0]

        def backward(k, x, adj):
            a_y, a_st, a_args = adj
            if problem.progress is not None:
                problem.progress.backward.every(k, n, 1 - k / n)
            if keep_state:
                (y1, _, dense), vjp = jax.vjp(lambda y, s, a: step_fn(k, y, s, a), *x, args_diff)
            else:
                (y1, _, dense), vjp_y = jax.vjp(lambda y, a: step_fn(k, y, None, a), x, args_diff)

                def vjp(c):
                    # one call: each call is a whole reverse pass of the step, which XLA does
                    # not merge with another (calling it per output doubled the stage transposes)
                    cy, ca = vjp_y(c)
                    return cy, None, ca

            ct_dense = tree_zeros_like(dense)
            if plan.dense:
                ct_dense = tree_add(ct_dense, jax.tree.map(lambda c: c[k], ct.dense[2]))
            if plan.steps:
                row = jax.tree.map(lambda c: c[k], ct.steps_ys)
                _, vjp_fn = jax.vjp(
                    lambda y, a: plan.fn(starts[k + 1], y, problem.with_args(a)), y1, args_diff
                )
                cy, ca = vjp_fn(row)
                a_y, a_args = tree_add(a_y, cy), tree_add(a_args, ca)
            if plan.ts is not None:

                def save_ct(i, acc):
                    cd, ca = acc
                    theta = (plan.ts[i] - starts[k]) / sizes[k]
                    _, vjp_save = jax.vjp(
                        lambda d, a: plan.fn(
                            plan.ts[i], solver.interpolate(d, theta), problem.with_args(a)
                        ),
                        dense,
                        args_diff,
                    )
                    dcd, dca = vjp_save(jax.tree.map(lambda c: c[i], ct.ts_ys))
                    return tree_add(cd, dcd), tree_add(ca, dca)

                j0 = j_start[k]
                ct_dense, a_args = lax.fori_loop(j0, j0 + j_count[k], save_ct, (ct_dense, a_args))
            cy0, cst0, ca0 = vjp((a_y, a_st, ct_dense))
            return cy0, cst0, tree_add(a_args, ca0)

        if keep_state:
            st0 = problem.init_state(y0, args)
            adj = (ct.y1, tree_zeros_like(st0), tree_zeros_like(args_diff))
            stored, kept, slots = None, None, int(checkpoints) if not store_all else 0
            if store_all:
                stored, slots = ((rec["y"], rec["st"]), n), problem.max_steps
            elif prefix:
                kept = (rec["y"], rec["st"])
            a_y, a_st, a_args = reverse_steps(
                advance, backward, n, (y0, st0), adj, slots, stored, kept
            )
            # the solver's initial state (e.g. k1 = f(t0, y0)) depends on y0 and args too
            _, vjp_init = jax.vjp(
                lambda y, a: problem.init_state(y, problem.with_args(a)), y0, args_diff
            )
            cy, ca = vjp_init(a_st)
            return tree_add(a_y, cy), tree_add(a_args, ca)
        adj = (ct.y1, None, tree_zeros_like(args_diff))
        kept = rec["y"] if prefix else None
        a_y, _, a_args = reverse_steps(advance, backward, n, y0, adj, int(checkpoints), prefix=kept)
        return a_y, a_args

    solve.defvjp(solve_fwd, solve_bwd)
    plain = lambda y0, args_diff: strip(problem.forward(y0, problem.with_args(args_diff)))
    return call_custom_vjp(solve, plain, problem.y0, problem.args_diff)


def _rematerialized(f, partitioned: bool):
    """``f`` under ``jax.checkpoint``: its reverse pass recomputes its internals."""
    if partitioned:
        return tuple(jax.checkpoint(g) for g in f)
    return jax.checkpoint(f)
