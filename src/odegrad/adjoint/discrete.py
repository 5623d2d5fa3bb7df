"""The exact gradient of the discretised solution ("discretise-then-optimise").

Step sizes are taken as constants, so the gradient is that of the numbers the solver computed.
That is the ODE's own gradient up to the tolerance when ``f`` is smooth. It is not where ``f``'s
Jacobian jumps (``abs``, ``max``, ``relu``, ``where`` on the state: "kinks"): the step that
crosses a kink has a state error of ``O(h^2)`` but a derivative error of ``O(h)``, which the
controller never sees, so the gradient is off by about ``sqrt(tol)`` (seed 000 at tol 1e-10:
1.7e-3 against CVODES, diffrax's recursive checkpointing 6.4e-4). Loose tolerances widen the gap
the same way. ``og.Auto`` therefore avoids this method on adaptive solves of kinked ``f``
(``og.Forward`` with error-controlled sensitivities, or ``og.Interpolating``), and says so.
Differentiating through the step-size choice as well does not help: the controller's output is
piecewise constant in the inputs where it matters (accept/reject), and the state error it sees
is still ``O(h^2)``.
A grid known at trace time with every step kept is left to JAX's own differentiation of
``lax.scan`` (nothing recomputed, the same program a hand-written scan gives). Everything else
has a custom VJP that replays the recorded steps backwards under a binomial checkpointing
schedule (:mod:`odegrad.adjoint.checkpointing`).
"""

from __future__ import annotations

import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from .._batching import any_member
from .._kinks import jacobian_jumps
from .._loop import LoopOutput
from .._recorders import StepRecord
from .._saving import saved_value, saves_gathered, saves_in_step
from .._tree import Packed, tightest_tolerance, tree_add, tree_bytes, tree_zeros_like
from .._tuning import tuning
from .._warn import warn_user
from ..solvers.base import AbstractSolver
from .base import AbstractAdjoint, CustomRule, Problem, custom_vjp_solve
from .checkpointing import reverse_steps
from .memory import CheckpointPolicy, checkpoint_policy

KEPT = "every step's VJP (its residuals) kept"


@dataclass(frozen=True)
class Discrete(AbstractAdjoint):
    """Differentiate the solver's own steps, exactly, with the step sizes held fixed.

    The gradient of the computed solution: on a smooth ``f`` the ODE's gradient to the
    tolerance; across kinks of ``f`` (``abs``, ``relu``, ...) off by about ``sqrt(tol)`` (see
    the module docstring; ``og.Auto`` then picks an error-controlled method).

    Args:
        checkpoints: ``"all"`` keeps every step (on a grid known at trace time JAX's reverse
            pass keeps what each step needs and nothing is recomputed; ``Fixed`` on a traced
            span keeps each step's residuals likewise where they are few
            (:func:`keeps_pullbacks`); otherwise, and on an adaptive solve, every step's
            state is kept, and each step's VJP re-evaluates that step's stages, none re-taken
            from an earlier state); an int ``c`` keeps at most ``c`` states
            and recomputes the rest under Griewank's binomial (revolve) schedule,
            for fixed and adaptive solves alike (adaptive solves record their step sizes and the
            schedule is made at run time once the step count is known; the forward pass keeps
            the first ``c`` states, so a solve of at most ``c`` steps recomputes nothing).
            ``None`` (default) keeps everything while that fits in ``memory_budget`` bytes (fixed
            grids: every step's stages; adaptive: ``max_steps`` states, up to 8 MiB) and
            otherwise as many checkpoints as fit (adaptive: at most 64, in at most 64 MiB unless
            that leaves fewer than 16).
        memory_budget: bytes for ``checkpoints=None``, for the whole ``jax.vmap`` batch;
            default the backend's tuning table (256 MiB).

    Example:
        >>> jax.grad(lambda p: og.solve(f, y0, (0., 1.), p, adjoint=og.Discrete(8)).ys[-1].sum())
    """

    checkpoints: int | Literal["all"] | None = None
    memory_budget: int | None = None

    def __post_init__(self):
        c = self.checkpoints
        if not (c is None or c == "all" or (isinstance(c, int) and c >= 1)):
            raise ValueError(
                f"Discrete(checkpoints={c!r}): use None, 'all' or a positive int (the number "
                "of stored states)."
            )

    def resolve(self, problem: Problem) -> int | Literal["all"]:
        """The concrete checkpoint setting this problem gets."""
        return self.policy(problem).checkpoints

    def policy(self, problem: Problem) -> CheckpointPolicy:
        """The checkpoint decision and the sentence that explains it."""
        budget = tuning().memory_budget if self.memory_budget is None else self.memory_budget
        run_time = problem.static_steps is None
        if self.checkpoints is not None:
            # "all" asked for: the VJPs' rows may take the budget
            pullbacks = self.checkpoints == "all" and run_time and keeps_pullbacks(problem, budget)
            text = f"checkpoints={self.checkpoints!r} as given"
            return CheckpointPolicy(self.checkpoints, text, pullbacks)
        per_step = problem.state_bytes()
        if not run_time:  # what JAX's scan keeps of every step
            per_step *= problem.solver.step_residuals
        policy = checkpoint_policy(problem, per_step, self.memory_budget)
        if not run_time:
            return policy
        if policy.checkpoints == "all":
            # chosen for a buffer of states: the VJPs' rows may take what those may, since
            # rows cost whether used or not (Tuning.adaptive_all_bytes)
            if keeps_pullbacks(problem, min(budget, tuning().adaptive_all_bytes)):
                return CheckpointPolicy("all", f"{policy.text}; {KEPT}, few per step", True)
            return policy
        if keeps_pullbacks(problem, budget):
            # The step count is known at run time only, and the max_steps rows cost whether
            # used or not (wave 64 x 64, 100 steps of 4096 rows: 13 -> 38 ms), so only the
            # user can say that they are used (seed 004, 2000 of 2000: 289 -> 152 ms)
            return policy._replace(
                text=f"{policy.text}; where max_steps is near the step count, "
                f"Discrete('all') keeps every step's VJP instead (few residuals per step), "
                "and no step is re-taken"
            )
        return policy

    def describe(self, problem: Problem) -> str:
        policy = self.policy(problem)
        text = f"Discrete(checkpoints={policy.checkpoints!r}): step sizes held fixed"
        if policy.pullbacks:
            text += f"; {KEPT}, no stage evaluated again"
        if problem.kinks and problem.static_steps is None:
            text += (
                f"; {jacobian_jumps(problem.kinks, problem.events)}, so this gradient of "
                "the adaptive solve may be off from the ODE's by about sqrt(tol): og.Auto() "
                "would choose an error-controlled method"
            )
        return text

    def run(self, problem: Problem) -> LoopOutput:
        policy = self.policy(problem)
        hand_picked = not CHOSEN_BY_AUTO.get()
        checkpoints = policy.checkpoints
        if problem.static_steps is not None and (
            checkpoints == "all" or checkpoints >= problem.static_steps
        ):
            return problem.forward()
        # a count the user gave bounds the states kept; one of the policy's may keep the
        # solver's state beside each when that is small
        keep_state = checkpoints == "all" or not problem.solver.state_from_y
        if self.checkpoints is None and not keep_state:
            keep_state = problem.checkpoints_keep_state(int(checkpoints))
        return _checkpointed(problem, checkpoints, keep_state, policy.pullbacks, hand_picked)


#: true while ``og.Auto`` runs the adjoint it chose (it weighed the kinks of ``f`` itself)
CHOSEN_BY_AUTO = contextvars.ContextVar("odegrad_chosen_by_auto", default=False)

#: below this ``rtol`` a hand-picked Discrete adjoint warns of kinks (``og.Auto``'s default
#: ``kink_rtol``: above it the kinks' error is within a small factor of the tolerance)
KINK_RTOL = 1e-3


def _warn_kinks(problem: Problem) -> None:
    """Warn when the reverse pass of a hand-picked Discrete adjoint is traced for an adaptive
    solve of an ``f`` with kinks, at ``rtol < KINK_RTOL``."""
    rtol = getattr(problem.control, "rtol", None)
    try:
        loose = rtol is not None and float(tightest_tolerance(rtol)) >= KINK_RTOL
    except (TypeError, jax.errors.ConcretizationTypeError):
        loose = False  # a traced tolerance: the kinks decide
    if problem.static_steps is not None or loose or not problem.kinks:
        return
    warn_user(
        f"og.Discrete() on an adaptive solve: {jacobian_jumps(problem.kinks, problem.events)}. "
        "It differentiates the steps the controller chose for the state alone; across a kink "
        "a step's derivative errs by O(h), which that controller does not see, so this "
        "gradient may be off from the ODE's by far more than the tolerance (8.6e-4 at rtol "
        "1e-10 for y' = -k|y| - c with Tsit5). og.Auto() picks an error-controlled adjoint "
        "there (og.Interpolating() or og.Forward(), 1e-8 on the same problem); events at the "
        "kinks (og.switching_events(f, t0, y0, args, kinks=True)) make Discrete exact too."
    )


def keeps_pullbacks(problem: Problem, limit: int) -> bool:
    """Whether ``checkpoints="all"`` on a fixed grid whose step count is known only at run
    time (``og.Fixed`` on a traced span) keeps each step's VJP (its residuals: what JAX's
    reverse pass of a scan keeps) rather than its state, so that no step's stages are
    evaluated again in the reverse pass. It does where

    * the residuals take at most ``Tuning.pullback_states`` states: a step of FFTs, stencils or
      linear maps keeps few, while an elementwise step keeps every operation's output, which
      a replay recomputes for less than storing it;
    * the state takes at least ``Tuning.pullback_min_bytes`` (the whole batch);
    * ``max_steps`` rows of them (and of the dense output the saves at ``SaveAt(ts)`` read)
      take at most ``limit`` bytes (the whole batch);
    * the solver's step alone makes the next state (no ``after_step`` revision, nothing
      dropped by ``compact_state``) and the solve has no events (a step an event ends is
      re-taken to its jump).

    Adaptive solves keep states: their ``max_steps`` rows are mostly unused (fresh memory
    costs), and the step inside ``jax.vjp`` compiles to other roundings, which may move the
    step sizes the controller picks between a solve and its gradient.

    Seed 004's wave, 64 x 64 float32, 2000 steps of a traced span: the gradient took 1.32x a
    hand-written scan's replaying each step, 1.05-1.06x keeping the residuals."""
    from .._loop import RuntimeGrid

    solver = type(problem.solver)
    if (
        not isinstance(problem.control, RuntimeGrid)
        or problem.events is not None
        or solver.after_step is not AbstractSolver.after_step
        or solver.compact_state is not AbstractSolver.compact_state
    ):
        return False
    need_dense = problem.plan.ts is not None or problem.plan.dense
    take = step_with_pullback(problem, problem.args_diff, need_dense)

    def first_step(y0, tau0):
        st0 = problem.solver.init(problem.f, problem.direction * tau0, y0, problem.args)
        res, pullback = take(tau0, tau0 - tau0 + 1, tau0 + 1, y0, st0)
        return Packed.pack(pullback), (res.dense if problem.plan.ts is not None else ())

    tau0 = jnp.asarray(problem.tau0, jnp.result_type(problem.tau0))
    packed, dense = jax.eval_shape(first_step, problem.y0, tau0)
    nbytes = tree_bytes(packed.arrays)
    t, batch, state = tuning(), max(problem.batch, 1), problem.state_bytes()
    return (
        nbytes <= t.pullback_states * state
        and t.pullback_min_bytes <= state * batch
        and problem.max_steps * (nbytes + tree_bytes(dense)) * batch <= limit
    )


def step_with_pullback(problem: Problem, args_diff, need_dense: bool):
    """``take(tau, h, tau_new, y, st) -> (StepResult, pullback)``: one step of ``problem`` and
    the VJP of ``(y, st, args_diff) -> (y1, st1, dense, save)``, where ``dense`` is the step's
    dense output when ``need_dense`` (else ``()``) and ``save`` is ``SaveAt(steps=True)``'s
    ``fn(tau_new, y1)`` (else ``()``)."""
    plan, s = problem.plan, problem.direction

    def take(tau, h, tau_new, y, st):
        def step(y, st, a_diff):
            args = problem.with_args(a_diff)
            res = problem.solver.step(problem.f, s * tau, s * h, y, args, st)
            save = plan.fn(tau_new, res.y1, args) if plan.steps else ()
            return (res.y1, res.state, res.dense if need_dense else (), save), res

        _, pullback, res = jax.vjp(step, y, st, args_diff, has_aux=True)
        return res, pullback

    return take


def _checkpointed(
    problem: Problem, checkpoints, keep_state: bool, pullbacks: bool = False, warn: bool = False
) -> LoopOutput:
    """The solve with a custom VJP that reverses the steps under binomial checkpointing, or
    applies every step's kept VJP (``pullbacks``, see :func:`keeps_pullbacks`). ``warn``:
    :func:`_warn_kinks` when the reverse pass is traced (a hand-picked adjoint)."""
    plan = problem.plan
    fixed = problem.static_steps is not None
    store_all = checkpoints == "all"
    # keep_state: (y, solver state) pairs are kept, else y alone
    need_dense = plan.ts is not None or plan.dense
    # saves whose cotangents one reverse step differentiates together (at least one)
    gather = 1 if plan.ts is None else saves_gathered(plan.ts.shape[0], problem.y0)
    # adaptive solves keep their first `checkpoints` states while running forward: a solve that
    # took no more steps needs no recomputation, and a longer one uses them as the workspace
    prefix = not fixed and not store_all
    record = StepRecord(
        states=(store_all and not pullbacks) or prefix,
        solver_states=(store_all and not pullbacks) or (prefix and keep_state),
        rows=int(checkpoints) if prefix else None,
        # every step's solver state kept as the loop left it (after_step applied): only
        # a replay that recomputes states from checkpoints needs the flags
        retries=problem.replays_retries and not store_all,
        # the saves at plan.ts read each step's dense output
        dense_rows=problem.max_steps if pullbacks and plan.ts is not None else None,
    )

    def strip(out: LoopOutput) -> LoopOutput:
        return out._replace(record={})

    def rule(problem: Problem) -> CustomRule:
        solver, plan = problem.solver, problem.plan

        def primal(y0, args_diff):
            return strip(problem.forward(y0, problem.with_args(args_diff)))

        def solve_fwd(y0, args_diff):
            if warn:
                _warn_kinks(problem)
            rec = record
            if pullbacks:
                take = step_with_pullback(problem, args_diff, need_dense)
                rec = dataclasses.replace(record, take=take, _pullback_layout=[])
            out = problem.forward(y0, problem.with_args(args_diff), (rec,))
            rec = out.record
            if out.events is not None:
                rec = {**rec, "which": out.events.which}
            return strip(out), (y0, args_diff, rec)

        def solve_bwd(res, ct: LoopOutput):
            y0, args_diff, rec = res
            args = problem.with_args(args_diff)
            if fixed:
                starts = problem.grid
                sizes = problem.grid[1:] - problem.grid[:-1]
                n = problem.static_steps
            else:
                starts, sizes, n = rec["starts"], rec["sizes"], rec["n"]

            # With int checkpoints, f's internals are recomputed inside each reverse step rather
            # than held as residuals (memory is what the user asked to save), and only y is kept:
            step_problem = (
                problem
                if store_all
                else dataclasses.replace(
                    problem, f=_rematerialized(problem.f, problem.solver.partitioned)
                )
            )

            # without keep_state the solver's carried state (the FSAL stage f(t, y), or Leapfrog's
            # acceleration), a function of (t, y), is recomputed: half the checkpoint memory for
            # one extra f evaluation per reverse step.
            def step_fn(k, y, st, a_diff):
                a = problem.with_args(a_diff)
                if st is None:
                    st = problem.init_state(y, a, starts[k])
                res_ = step_problem.step(
                    starts[k], sizes[k], y, a, st, StepRecord.retried_at(rec, k), starts[k + 1]
                )
                # the dense output is an output of the step only when saves read it: otherwise the
                # reverse step would push zero cotangents through every stage
                dense = res_.dense if need_dense else ()
                y1, st1 = res_.y1, res_.state
                if problem.events is None:
                    return y1, (st1 if keep_state else None), dense, ()
                y1, st1, event = problem.replay_event(rec, k, starts, res_, a)
                return y1, (st1 if keep_state else None), dense, event

            def advance(k, x):
                if keep_state:
                    y1, st1, *_ = step_fn(k, x[0], x[1], args_diff)
                    return (y1, st1)
                return step_fn(k, x, None, args_diff)[0]

            def backward(k, x, adj):
                a_y, a_st, a_args = adj
                if problem.progress is not None:
                    problem.progress.backward.every(k, n, 1 - k / n)
                if pullbacks:
                    # the step's VJP from the forward pass; saves at plan.ts read its dense output
                    pullback, dense, event = x["pullback"].unpack(), x.get("dense", ()), ()
                    if need_dense and "dense" not in x:  # (no save reads it: its shape alone)
                        dense = jax.tree.map(lambda c: c[k], ct.dense[2])
                    save_row = jax.tree.map(lambda c: c[k], ct.steps_ys) if plan.steps else ()
                    vjp = lambda c: pullback((*c[:3], save_row))
                elif keep_state:
                    (y1, _, dense, event), vjp = jax.vjp(
                        lambda y, s, a: step_fn(k, y, s, a), *x, args_diff
                    )
                else:
                    (y1, _, dense, event), vjp_y = jax.vjp(
                        lambda y, a: step_fn(k, y, None, a), x, args_diff
                    )

                    def vjp(c):
                        # one call: each call is a whole reverse pass of the step, which XLA
                        # does not merge with another (calling it per output doubled the stage
                        # transposes)
                        cy, ca = vjp_y(c)
                        return cy, None, ca

                ct_dense = tree_zeros_like(dense)
                ct_event = ()
                if problem.events is not None:
                    ct_event = problem.event_cotangent(rec["ev"][k], rec["which"], ct)
                    y1 = event[1]  # the state a step's saved row holds: just before its event
                if plan.dense:
                    ct_dense = tree_add(ct_dense, jax.tree.map(lambda c: c[k], ct.dense[2]))
                if plan.steps and not pullbacks:  # (a kept VJP differentiates the save too)
                    row = jax.tree.map(lambda c: c[k], ct.steps_ys)
                    _, vjp_fn = jax.vjp(
                        lambda y, a: plan.fn(starts[k + 1], y, problem.with_args(a)), y1, args_diff
                    )
                    cy, ca = vjp_fn(row)
                    a_args = tree_add(a_args, ca)
                    if problem.events is None:
                        a_y = tree_add(a_y, cy)
                    else:
                        a_y_row = cy
                if plan.ts is not None:
                    j0, j1 = saves_in_step(plan.ts, k, starts[k], starts[k + 1])

                    def save_ct(c):
                        # the step's saves `gather` at a time: one loop iteration per save cost the
                        # vmapped neural ODE's backward pass (100 saves, 5 steps) more than its
                        # stages. Under vmap the loop runs for the member with the most saves in
                        # step k; rows past a member's j1 add nothing.
                        i, cd, ca = c
                        idx = i + jnp.arange(gather)
                        valid = idx < j1
                        idx = jnp.minimum(idx, plan.ts.shape[0] - 1)
                        rows = jax.tree.map(lambda c: c[idx], ct.ts_ys)

                        def one(j, row):
                            save = lambda d, a: saved_value(
                                plan, solver, d, j, starts[k], sizes[k], problem.with_args(a)
                            )
                            if not plan.fn_reads_args:
                                return jax.vjp(lambda d: save(d, args_diff), dense)[1](row)[0], ()
                            return jax.vjp(save, dense, args_diff)[1](row)

                        # each save's own cotangents, summed by a product with the mask: XLA:CPU
                        # ran the reduction of a vmapped VJP's transpose 100x slower (its YNN
                        # reduce fusion on a (32, 256, 2) stack: 350 us against 3 us as a dot)
                        dcd, dca = jax.vmap(one)(idx, rows)
                        total = lambda x: jnp.tensordot(valid.astype(x.dtype), x, axes=1)
                        ca = (
                            ca if not plan.fn_reads_args else tree_add(ca, jax.tree.map(total, dca))
                        )
                        return i + gather, tree_add(cd, jax.tree.map(total, dcd)), ca

                    _, ct_dense, a_args = lax.while_loop(
                        lambda c: any_member(c[0] < j1), save_ct, (j0, ct_dense, a_args)
                    )
                if plan.steps and problem.events is not None:
                    # the row's cotangent reached y-, an output of its own
                    ct_event = (ct_event[0], tree_add(ct_event[1], a_y_row))
                cy0, cst0, ca0 = vjp((a_y, a_st, ct_dense, ct_event))
                return cy0, cst0, tree_add(a_args, ca0)

            def start_saves(a_y, a_args):
                """The saves at tau0 of a solve that took no step (a span traced to t1 == t0):
                the loop wrote them as fn(tau0, y0, args), no step holds them."""
                if fixed or plan.ts is None or problem.always_moves:
                    return a_y, a_args

                def pull():
                    at_start = (plan.ts <= problem.tau0) & (n == 0)
                    mask = lambda c: jnp.tensordot(at_start.astype(c.dtype), c, axes=1)
                    row = jax.tree.map(mask, ct.ts_ys)
                    save = lambda y, a: plan.fn(problem.tau0, y, problem.with_args(a))
                    return jax.vjp(save, y0, args_diff)[1](row)

                zeros = lambda: (tree_zeros_like(y0), tree_zeros_like(args_diff))
                cy, ca = lax.cond(any_member(n == 0), pull, zeros)
                return tree_add(a_y, cy), tree_add(a_args, ca)

            if keep_state:
                st0 = problem.init_state(y0, args)
                adj = (ct.y1, tree_zeros_like(st0), tree_zeros_like(args_diff))
                stored, kept, slots = None, None, int(checkpoints) if not store_all else 0
                if pullbacks:
                    kept_steps = {"pullback": rec["pullback"]}
                    if "ring" in rec:
                        kept_steps["dense"] = rec["ring"]
                    stored, slots = (kept_steps, n), problem.max_steps
                elif store_all:
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
                return start_saves(tree_add(a_y, cy), tree_add(a_args, ca))
            adj = (ct.y1, None, tree_zeros_like(args_diff))
            kept = rec["y"] if prefix else None
            a_y, _, a_args = reverse_steps(
                advance, backward, n, y0, adj, int(checkpoints), prefix=kept
            )
            return start_saves(a_y, a_args)

        return CustomRule(primal, solve_fwd, solve_bwd)

    return custom_vjp_solve(problem.without_scan_tap(), rule)


def _rematerialized(f, partitioned: bool):
    """``f`` under ``jax.checkpoint``: its reverse pass recomputes its internals."""
    if partitioned:
        return tuple(jax.checkpoint(g) for g in f)
    return jax.checkpoint(f)
