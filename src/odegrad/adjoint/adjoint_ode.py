"""The continuous adjoints' shared mechanism: the adjoint ODE integrated backwards.

For ``dy/dt = f(t, y, p)`` and a loss of saved values, the adjoint ``a = dL/dy`` obeys
``da/dt = -(df/dy)^T a`` between save times and jumps by each saved value's cotangent at its time;
``dL/dp = int a^T (df/dp) dt`` and ``dL/dy0 = a(t0)`` (Pontryagin; Chen et al., NeurIPS 2018).
The methods (:mod:`~odegrad.adjoint.continuous`) differ only in where the backward pass gets
``y(t)`` and how it integrates ``dL/dp``:

* :class:`Interpolating` — from the forward dense output; with ``checkpoints=c`` the forward keeps
  nothing but step sizes, and the backward pass gets the forward states step by step, last first,
  from ``c`` checkpoints under the binomial schedule of :mod:`~odegrad.adjoint.checkpointing`,
  re-taking each step to read its dense output: memory ``c`` states plus one step;
* :class:`Quadrature` — like Interpolating, but ``dL/dp`` is a Gauss–Legendre quadrature on each
  backward step, so the backward ODE carries only ``a`` (the "Gauss adjoint");
* :class:`Backsolve` — ``y`` re-integrated backwards together with ``a``; O(1) memory but unstable
  on dissipative problems, so the re-integrated state is reset to, and checked against, the stored
  forward state at every save time.

All times inside are forward time ``p = s t`` (``s = -1`` for backward solves). The backward solve
stops at every grid point for fixed grids, at events and at checkpoint-segment ends. The adjoint
jumps at every save time: with an adaptive explicit backward solver the saves inside a backward
step ride in it (:mod:`~odegrad.adjoint.columns`), through the adjoint's propagator for small
states (Backsolve included, for an ``f`` with many parameters), as extra columns otherwise
where ``y`` is readable anywhere (not Backsolve); otherwise the backward solve stops at each.
Backward error control leaves ``dL/dp`` out of the norm (the seminorm of Kidger, Chen and
Lyons, "Hey, that's not an ODE", ICML 2021).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._batching import any_member, max_member, member_cond
from .._failure import locate_failure
from .._loop import LoopOutput, RuntimeGrid, while_loop
from .._recorders import Accumulate
from .._saving import SavePlan
from .._solution import Result, host_check
from .._step import AbstractStep, Adaptive, Fixed, jump_times
from .._tree import (
    tree_add,
    tree_all_finite,
    tree_scale,
    tree_size,
    tree_where,
    tree_zeros_like,
)
from .backward_pieces import report_backward_failure, unknown_resume, vjps, warn_unseen_switches
from .backward_times import Seminorm, backward_control, breakpoints, gauss_legendre
from .base import (
    AbstractAdjoint,
    CustomRule,
    Problem,
    custom_vjp_solve,
    instantiate_zeros,
    primal_values,
    refuse_dense_cotangent,
)
from .columns import ColumnSolver, PropagatorSolver, save_columns, save_path
from .interval_ends import IntervalEnds
from .sources import Pass, StateSource


@dataclass(frozen=True)
class _Continuous(AbstractAdjoint):
    """The shared mechanism of the continuous adjoints; see the module docstring."""

    # keyword-only, so that a subclass's first field is its first positional argument
    # (Interpolating(3) is checkpoints=3, as Discrete(3) is)
    vjp: Callable | None = field(default=None, kw_only=True)
    solver: Any = field(default=None, kw_only=True)
    step: AbstractStep | None = field(default=None, kw_only=True)

    quadrature = False  # dL/dp by quadrature on each backward step instead of as a state

    def __post_init__(self):
        name = type(self).__name__
        if self.vjp is not None and not callable(self.vjp):
            raise TypeError(
                f"{name}(vjp={self.vjp!r}): vjp is a function "
                "vjp(t, y, args, cotangent) -> (ct_y, ct_args), or None for jax.vjp of f."
            )
        if self.step is not None and not isinstance(self.step, AbstractStep):
            raise TypeError(
                f"{name}(step={self.step!r}): the backward step control is an og.Adaptive(...) "
                "or og.Fixed(dt) instance, or None for the forward one."
            )
        if self.step is not None and not isinstance(self.step, Adaptive | Fixed):
            raise ValueError(
                f"{name}(step={self.step!r}): the backward solve takes og.Adaptive(...) "
                "or og.Fixed(dt) steps between the times where it stops (saves, forward steps); "
                "leave step=None to follow the forward solve."
            )

    @property
    def source(self) -> StateSource:
        """Where this adjoint's backward pass gets the forward state ``y(t)``."""
        raise NotImplementedError

    # -- forward ----------------------------------------------------------------------------------
    def run(self, problem: Problem) -> LoopOutput:
        if self.vjp is not None and problem.solver.partitioned:
            raise ValueError(
                f"{type(self).__name__}(vjp=...) is for a single f(t, y, args); partitioned "
                "solvers use the default jax.vjp."
            )
        solver_b, control = self._backward_solver(problem)
        if isinstance(control, Adaptive | Seminorm) and not solver_b.adaptive:
            raise ValueError(
                f"{type(self).__name__}() would integrate the adjoint with {solver_b!r} and "
                "adaptive steps (step=og.Adaptive(...)), which need an error estimate that "
                f"{solver_b!r} does not have: pass solver= an embedded method such as og.BS3() "
                f"or og.Tsit5(), or step=og.Fixed(dt)."
            )
        warn_unseen_switches(type(self).__name__, problem)
        return custom_vjp_solve(problem, self._rule, symbolic_zeros=True)

    def _rule(self, problem: Problem) -> CustomRule:
        plan, src = problem.plan, self.source
        fwd_problem = replace(problem.without_scan_tap(), plan=src.forward_plan(plan))

        def split(out: LoopOutput):
            out, keep = src.split(out, plan)
            keep.update(dense=out.dense, t1=out.t1, y1=out.y1, events=out.events)
            if not plan.dense:
                out = out._replace(dense=None)
            keep.update(out.record)
            return out._replace(record={}), keep

        def primal(y0, args_diff):
            record = src.step_record(problem)
            out = fwd_problem.forward(y0, problem.with_args(args_diff), record=(record,))
            return split(out)

        def solve_fwd(y0, args_diff):
            # (symbolic zeros: so that the reverse pass sees which outputs are differentiated)
            y0, args_diff = primal_values((y0, args_diff))
            out, keep = primal(y0, args_diff)
            return out, (y0, args_diff, keep)

        def solve_bwd(res, ct: LoopOutput):
            refuse_dense_cotangent(f"og.{type(self).__name__}()", ct.dense)
            return self._backward(problem, *res, instantiate_zeros(ct))

        return CustomRule(lambda y0, args_diff: primal(y0, args_diff)[0], solve_fwd, solve_bwd)

    # -- the right-hand side's VJP: jax.vjp of f, or the user's ---------------------------------
    def _rhs_and_vjp(self, problem: Problem, f=None):
        """``(f, vjp, vjp_columns, vjp_state)``: ``f`` (``problem.f``, a partitioned pair as one
        ``f``; or the given one, in that form) and its products."""
        if f is not None:
            return vjps(f, problem)
        f = problem.f
        if problem.solver.partitioned:
            f_u, f_v = f
            f = lambda t, y, a: (f_u(t, y[1], a), f_v(t, y[0], a))
        if self.vjp is None:
            return vjps(f, problem)
        if any(isinstance(c, jax.core.Tracer) for c in jax.tree.leaves(problem.args[1:])):
            raise ValueError(
                f"{type(self).__name__}(vjp=...): f (or SaveAt.fn) closes over arrays; pass them "
                "through args so that the vjp can return their cotangent."
            )
        user_vjp = self.vjp

        def vjp(t, y, args_diff, ct):
            ct_y, ct_user = user_vjp(t, y, problem.user_args(problem.with_args(args_diff)), ct)
            # place the cotangent of the user's args on our differentiable leaves
            _, pull = jax.vjp(lambda a_: problem.with_args(a_)[0], args_diff)
            (ct_args,) = pull(problem.user_arrays(ct_user))
            return ct_y, ct_args

        def vjp_columns(t, y, args_diff, ct):
            cy, ca = jax.vmap(vjp, in_axes=(0, 0, None, 0))(t, y, args_diff, ct)
            return cy, jax.tree.map(lambda x: jnp.sum(x, 0), ca)

        def vjp_state(t, y, args_diff, cts):
            out = f(t, y, problem.with_args(args_diff))
            return out, jax.vmap(vjp, in_axes=(None, None, None, 0))(t, y, args_diff, cts)[0]

        return f, vjp, vjp_columns, vjp_state

    # -- the backward pass ------------------------------------------------------------------------
    def _backward_solver(self, problem: Problem):
        """The backward pass's solver and its step-size control."""
        solver_b = problem.solver.adjoint_solver() if self.solver is None else self.solver
        if solver_b.partitioned:  # the backward state is not a (u, v) pair
            solver_b = _default_explicit()
        solver_b = solver_b.with_user_args(None)  # user callbacks describe the forward system
        control = backward_control(self.step, problem)
        if isinstance(control, Adaptive | Seminorm) and hasattr(solver_b, "with_tolerances"):
            solver_b = solver_b.with_tolerances(control.rtol, control.atol)
        return solver_b, control

    def saves_text(self, problem: Problem) -> str:
        """How the save times enter the backward solve (for ``explain_adjoint``)."""
        ts = problem.plan.ts
        if ts is None:
            return ""
        f, vjp, *_ = self._rhs_and_vjp(problem)
        solver_b, control = self._backward_solver(problem)
        adaptive = isinstance(control, Adaptive | Seminorm)
        path = save_path(problem, f, vjp, self.source, solver_b, adaptive, problem.y0)
        n, size = ts.shape[0], tree_size(problem.y0)
        if not (path.propagator or path.columns):
            return f"; the backward solve stops at each of the {n} saves"
        m = size // path.rows
        how = (
            f"up to {path.n_columns} as columns per step"
            if not path.propagator
            else f"in the {m} x {m} propagator"
            if path.rows == 1
            else f"in one {m} x {m} propagator per row of the state's {path.rows} independent rows"
        )
        return f"; the {n} saves ride inside the backward steps, {how}"

    def _backward(self, problem: Problem, y0, args_diff, keep, ct: LoopOutput):
        plan, s, src = problem.plan, problem.direction, self.source
        pointwise = self._rhs_and_vjp(problem)
        f, vjp = pointwise[:2]
        solver_b, control = self._backward_solver(problem)
        # the saves ride in the backward steps (columns.py) or stop the backward solve
        adaptive = adaptive_loop = isinstance(control, Adaptive | Seminorm)
        path = save_path(problem, f, vjp, src, solver_b, adaptive, ct.y1)
        propagator, columns = path.propagator, path.columns
        points, labels, count = breakpoints(problem, keep, with_ts=not columns)
        tdtype = points.dtype
        y_at = partial(src.y, problem, keep)
        saves, g0 = None, tree_zeros_like(args_diff)
        # dL/dp summed from each step's own sum, not a state of the backward ODE: the
        # quadrature's, and the propagator's (whose sum is the same for both adjoints)
        g_by_steps = self.quadrature or propagator
        reintegrate = None
        if propagator and src.reintegrates:
            ctrl = problem.control if isinstance(problem.control, Adaptive) else Adaptive()
            reintegrate = (ctrl.rtol, ctrl.atol)
        # a span traced to t1 == t0 takes no step: no dense output holds the saves' states,
        # which are y0 (a concrete span always moves, and pays nothing for this)
        moved = None if problem.always_moves else keep["t1"] > problem.tau0

        def y_at_save(c, p):
            return y_at(c, p) if moved is None else tree_where(moved, y_at(c, p), y0)

        if columns:
            ys = src.states_at_saves(problem, keep)
            if moved is not None:
                y0_rows = jax.tree.map(lambda x, y: jnp.broadcast_to(x, y.shape), y0, ys)
                ys = tree_where(moved, ys, y0_rows)
            saves, g0 = save_columns(problem, keep, ys, args_diff, ct, src.reintegrates)

        def rhs_for(c, within, ends, fns):
            """d(state)/dp for the backward state z = (a, g, src.carries) in forward time p."""
            f, vjp = fns[:2]

            def rhs(p, z, a_diff):
                y = y_at({**c, **z}, p, within)  # z's own components are the ones at p
                if ends is not None:  # (a select on the stages at the interval's ends)
                    p, y = ends.time(p), ends.state(p, y)
                cy, ca = vjp(s * p, y, a_diff, z["a"])
                out = {"a": tree_scale(-s, cy)}
                if not g_by_steps:
                    out["g"] = tree_scale(-s, ca)
                return {**out, **src.rhs(f, problem, p, y, a_diff)}

            return rhs

        def rates_for(fns):
            def rates(y, p, a, w, a_diff, with_g):
                """The columns' rates (see :class:`ColumnSolver`) at forward times ``p``."""
                ct_ = jax.tree.map(lambda x: x * w.reshape((-1,) + (1,) * (x.ndim - 1)), a)
                cy, ca = fns[2](s * p, y, a_diff, ct_)
                return tree_scale(-s, cy), tree_scale(-s, ca) if with_g else None

            def state_rates(y, p, a, w, a_diff):
                """``dy/dp`` and the propagator's columns' rates (see
                :class:`PropagatorSolver`) at time ``p``."""
                dy, da = fns[3](s * p, y, a_diff, a)
                return tree_scale(s, dy), tree_scale(-s * w, da)

            return rates, state_rates

        # the propagator's step sums over accepted steps: dL/dp adds up, the drift is the worst
        # save's (known zeros: the recorder need not trace a step to find their shape)
        zeros = {"g": tree_zeros_like(args_diff)}
        zeros.update({"drift": jnp.zeros((), tdtype)} if reintegrate else {})

        def combine(total, new):
            out = {"g": tree_add(total["g"], new["g"])}
            return (
                {**out, "drift": jnp.maximum(total["drift"], new["drift"])} if reintegrate else out
            )

        summed = Accumulate(lambda t, dt, dense, a: dense, combine, zeros)

        def quadrature_for(c, within, fns):
            nodes, weights = gauss_legendre(self._nodes(solver_b))
            vjp = fns[1]

            def accumulate(t, dt, dense, a_diff):
                total = tree_zeros_like(args_diff)
                for x, w in zip(nodes, weights, strict=True):
                    z = solver_b.interpolate(dense, x)
                    p = t + x * dt  # the backward loop runs in forward time p
                    _, ca = vjp(s * p, y_at(c, p, within), a_diff, z["a"])
                    total = tree_add(total, tree_scale(-s * w * dt, ca))
                return total

            return accumulate

        def jump(i, c, on=True):
            """At breakpoint i: the source's reset, then the saved value's cotangent."""
            return jump_at(points[i], jnp.where(on, labels[i], -1), c)

        def event_at(row, c):
            """The adjoint's jump condition at the event of ``sol.events`` row ``row``: the
            transpose of :func:`~odegrad._event_jump.jump` (Backsolve resumes from ``y-``)."""
            log = keep["events"]
            which, z = log.which[row], jax.tree.map(lambda x: x[row], log.ys)
            ct_t, ct_y = problem.event_cotangent(row, log.which, ct)
            _, pull = jax.vjp(
                lambda z_, a_: problem.events.jump(
                    which, log.ts[row], z_, problem.with_args(a_), problem.direction
                ),
                z,
                args_diff,
            )
            cz, ca = pull((ct_t, ct_y, c["a"]))
            return src.at_event({**c, "a": cz, "g": tree_add(c["g"], ca)}, z)

        def jump_at(p, label, c):
            if problem.events is not None:  # labels -2 - row mark events
                c = member_cond(label <= -2, lambda c_: event_at(-2 - label, c_), lambda c_: c_, c)
            c = src.at_breakpoint(problem, keep, c, label)
            ts_labels = plan.ts is not None and not columns  # (columns: none are breakpoints)
            if not ts_labels and not plan.steps:
                return c
            rows = ct.ts_ys if ts_labels else ct.steps_ys
            y = y_at_save(c, p)
            row = jax.tree.map(lambda r: r[jnp.maximum(label, 0)], rows)
            _, pull = jax.vjp(lambda y_, a_: plan.fn(p, y_, problem.with_args(a_)), y, args_diff)
            cy, ca = pull(row)
            w = (label >= 0).astype(tdtype)
            return {
                **c,
                "a": tree_add(c["a"], tree_scale(w, cy)),
                "g": tree_add(c["g"], tree_scale(w, ca)),
            }

        def held_inside(c, hi, lo, within, with_args):
            """``f`` held as inside ``[lo, hi]``: read just below ``hi`` (a surface's jump in
            time, as ``rem(t, P)`` makes, lands on an end to the ulp), arriving from below
            where a surface is that near. Backsolve's state is known at ``hi`` alone: it is
            moved back along ``f``, which on either side of a crossing moves toward it."""
            p_in = hi - (hi - lo) / 1024
            if src.reads_anywhere:
                y_in = y_at(c, p_in, within)
            else:
                y_hi = y_at(c, hi, within)
                back = tree_scale(-(hi - p_in) * s, f(s * hi, y_hi, with_args))
                y_in = tree_add(y_hi, back)
            return problem.events.held(f, s * p_in, y_in, with_args, -s)

        def integrate(c, hi, lo):
            z = {"a": c["a"], **{k: c[k] for k in src.carries}}
            if not g_by_steps:
                z["g"] = c["g"]
            # (only events make the sides of a step boundary differ)
            within = ends = None
            fns = pointwise
            if problem.events is not None:
                # the interval itself: y is read from its steps alone (see sources._from_dense)
                within = (lo, hi)
                with_args = problem.with_args(args_diff)
                ends = IntervalEnds.find(problem.events, keep["events"], s, hi, lo, with_args)
                if problem.events.hold is not None and self.vjp is None:
                    # f's switches held inside this interval as the forward steps held them
                    # (none changes between breakpoints): on an end f itself may take the
                    # other side (t0 on `t > 0`, or rem(t, P) < d at t = P)
                    fns = self._rhs_and_vjp(problem, held_inside(c, hi, lo, within, with_args))
            rates, state_rates = rates_for(fns)
            rhs = rhs_for(c, within, ends, fns)
            acc = quadrature_for(c, within, fns) if self.quadrature else None
            solver = solver_b
            if columns:
                # (the jumps in the backward loop's time, -p)
                jumps = jump_times(control, -1.0, tdtype) if adaptive_loop else None
                reader = partial(src.reader, problem, keep, c, within=within)
                nodes = gauss_legendre(self._nodes(solver_b)) if self.quadrature else None
                if propagator:
                    solver = PropagatorSolver(
                        solver_b,
                        saves,
                        path.n_saves,
                        reader,
                        IntervalEnds.inside(ends, rates),
                        IntervalEnds.inside(ends, state_rates),
                        lo,
                        reintegrate,
                        path.rows,
                        jumps=jumps,
                    )
                else:
                    solver = ColumnSolver(
                        solver_b,
                        saves,
                        path.n_columns,
                        reader,
                        IntervalEnds.inside(ends, rates),
                        lo,
                        nodes,
                        jumps=jumps,
                    )
                # the column step computes its quadrature: its "dense output" is that sum
                acc = (lambda t, dt, dense, a: dense) if g_by_steps else None
            adaptive = isinstance(control, Adaptive | Seminorm)
            # Each backward step ends on the forward steps under it. The error norm leaves
            # dL/dp out (a seminorm), so a step sized for the adjoint alone integrates
            # a^T df/dp(y) across y's fast changes unseen (on y' = A y with a -30 mode,
            # Interpolating's dL/dA was 1e-3 off at rtol 1e-8): on the forward steps y is
            # resolved as the forward solve resolved it (3e-8).
            starts = src.step_starts(keep, c) if adaptive else None
            stops = None if starts is None else lax.stop_gradient(-starts[::-1])
            if adaptive or isinstance(control, Fixed):
                # (a user's Fixed(dt): equal steps of at most dt across the interval)
                n = jnp.maximum(jnp.ceil((hi - lo) / control.dt), 1) if not adaptive else None
                out = while_loop(
                    solver,
                    rhs,
                    args_diff,
                    z,
                    tau0=-hi,
                    tau1=-lo,
                    control=control if adaptive else RuntimeGrid(n.astype(jnp.int32)),
                    plan=SavePlan(fn=lambda t, y, a: y),
                    # (its landings on the forward steps come on top of the steps it chooses)
                    max_steps=problem.max_steps + (0 if stops is None else stops.shape[0]),
                    record=() if acc is None else (summed if propagator else Accumulate(acc),),
                    s=-1.0,
                    h_guess=c["h"] if adaptive else None,
                    resume=c["st"],  # (None for fixed steps: a fresh state per interval)
                    stops=stops,
                )
                z1, quad = out.y1, out.accumulated
                c = {**c, "h": out.h, "st": out.resume} if adaptive else {**c, "st": out.resume}
                # the first interval whose backward solve failed (max_steps, non-finite):
                # the gradient is nan then, and an error with throw (see _backward)
                first = (c["failed"] == 0) & (out.result != 0)
                c["failed"] = jnp.where(first, out.result, c["failed"])
                fail_t = locate_failure(out, None, None)[0]
                c["failed_p"] = jnp.where(first, -fail_t, c["failed_p"])
            else:  # fixed grids: one backward step per forward step
                # (c["st"] is None here: a fresh state each step, see carry["st"])
                st, _ = solver_b.init_from(rhs, hi, z, args_diff, c["st"])
                z1 = (res := solver_b.step(rhs, hi, lo - hi, z, args_diff, st)).y1
                quad = None if acc is None else acc(hi, lo - hi, res.dense, args_diff)
            c = {**c, "a": z1["a"], **{k: z1[k] for k in src.carries}}
            if propagator:  # its sums: dL/dp, and Backsolve's worst drift
                if reintegrate:
                    c["drift"] = jnp.maximum(c["drift"], quad["drift"])
                quad = quad["g"]
            c["g"] = tree_add(c["g"], quad) if g_by_steps else z1["g"]
            return c

        def absorb(i, c, on=True):
            """With columns: the saves at breakpoint ``i``, once per distinct time (the top of a
            run of equal breakpoints), after its jumps."""
            if saves is None:
                return c
            top = (i == count - 1) | (points[jnp.minimum(i + 1, points.shape[0] - 1)] > points[i])
            return absorb_at(points[i], c, top & on)

        def absorb_at(p, c, when=True):
            return {**c, "a": tree_where(when, saves.absorb(c["a"], p), c["a"])}

        def intervals(c):
            """The whole backward pass: every interval, top down, and the jumps at t0."""
            return span(c, points[0], points[count - 1], True, report=True)

        def span(c, lo, hi, first, report=False):
            # the intervals i (from points[i - 1] up to points[i]) that reach into (lo, hi]
            last = jnp.searchsorted(points, hi, side="right") - 1  # the last point <= hi
            top = jnp.minimum(last + 1, count - 1)
            bottom = jnp.where(first, 0, jnp.searchsorted(points, lo, side="right") - 1)
            if saves is not None:  # saves at hi inside an interval: no breakpoint takes them in
                inner = (last < 0) | (points[jnp.maximum(last, 0)] < hi)
                c = absorb_at(hi, c, inner)

            def piece(k, c):
                if report and problem.progress is not None:
                    problem.progress.backward.every(k + 1, count - 1, (k + 1) / (count - 1))
                i = jnp.maximum(top - k, 1)
                on = k < top - bottom
                mine = on & (points[i] <= hi)
                c = absorb(i, jump(i, c, mine), mine)
                b_hi = jnp.where(on, jnp.minimum(points[i], hi), lo)
                b_lo = jnp.maximum(points[i - 1], lo)
                return member_cond(
                    b_hi > b_lo, lambda c_: integrate(c_, b_hi, b_lo), lambda c_: c_, c
                )

            c = lax.fori_loop(0, max_member(top - bottom), piece, c)
            if first is True:  # the whole pass
                return absorb(0, jump(0, c))
            return member_cond(first, lambda c_: absorb(0, jump(0, c_)), lambda c_: c_, c)

        bwd = Pass(
            problem,
            keep,
            y0,
            args_diff,
            jump_at,
            integrate,
            intervals,
            absorb_at if columns else None,
            span,
        )
        carry = {"a": ct.y1, "g": g0, "st": None}
        # (adaptive steps only: without rejections nothing refreshes an estimate that went
        # stale, and fixed steps with too few stages diverge; those re-estimate per interval)
        if not columns and isinstance(control, Adaptive | Seminorm):
            # what each interval's backward solve leaves of its solver's state for the next
            # (a stabilised solver's spectral-radius estimate, init_from), not a fresh init:
            # seed 001's own gradient (ROCK2, 465 intervals) made 20 power-iteration JVPs each
            z_like = {"a": ct.y1, **{k: keep["y1"] for k in src.carries}}  # (Backsolve's y)
            carry["st"] = unknown_resume(
                solver_b, z_like if g_by_steps else {**z_like, "g": g0}, args_diff, tdtype
            )
        if isinstance(control, Adaptive | Seminorm):
            # each interval's backward solve starts with the step size the one before it ended
            # with, not a fresh pick (one evaluation of f, and often a step too small): on the
            # neural ODE as one (256, 2) state, 100 saves, ~20 % of the backward pass
            carry["h"] = jnp.full((), jnp.nan, tdtype)
        carry["failed"] = jnp.zeros((), jnp.int32)
        carry["failed_p"] = jnp.zeros((), tdtype)
        carry = src.sweep(bwd, carry)
        failed = carry["failed"] != 0
        grads = jax.tree.map(lambda x: jnp.where(failed, jnp.nan, x), (carry["a"], carry["g"]))
        # A non-finite adjoint from a nan in the loss (any save's cotangent: columns take them
        # in inside a backward step) shows as nan, as in Discrete's gradient; a backward solve
        # that went non-finite on finite cotangents raises with throw (float32 Robertson with
        # Kvaerno5, Interpolating: Newton failed at every step size, and the gradient was nan
        # without a word). Backsolve's re-integrated state, which may overflow backwards, is
        # its drift check's to report (on_drift); with that state finite, the adjoint's own
        # failure is reported here (float32 Robertson, Backsolve: nan gradients, no word).
        made_here = tree_all_finite((ct.y1, ct.ts_ys, ct.steps_ys))
        if src.reintegrates:
            made_here = made_here & tree_all_finite(carry["y"])
        raises = failed & ((carry["failed"] != Result.nonfinite) | made_here)
        if problem.throw:
            report = partial(report_backward_failure, type(self).__name__, problem.max_steps)
            where = (jnp.where(raises, carry["failed"], 0), s * carry["failed_p"])
            grads = host_check(report, grads, any_member(raises), *where)
        return grads

    @staticmethod
    def _nodes(solver) -> int:
        """Gauss–Legendre nodes per backward step: exact to the solver's order."""
        return max(1, -(-(solver.order + 1) // 2))


def _default_explicit():
    from ..solvers.explicit_rk import Tsit5

    return Tsit5()
