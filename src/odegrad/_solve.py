"""``og.solve``: check the inputs, put the problem in forward time, run the adjoint's loop."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._batching import vmap_batch_size
from ._checks import (
    as_state,
    called_as,
    check_complex_state,
    check_precision,
    check_rhs,
    check_t_span,
    check_times_constant,
    check_types,
)
from ._eager import cached_solve, is_eager
from ._event_jump import SECOND_DERIVATIVES_THROUGH_EVENTS
from ._events import Event, EventSet
from ._events import check_shapes as check_event_shapes
from ._events import prepare as prepare_events
from ._initial import (
    check_concrete_state,
    describe,
    failure_locator,
    refined_result,
    state_names,
)
from ._kinks import describe_kinks, find_kinks
from ._loop import RuntimeGrid
from ._saveat import SaveAt, check_save_times, save_times_valid
from ._saving import SavePlan, assemble, static_slot_count
from ._scaleout import explicit_mesh, on_auto_axes, solve_scope
from ._solution import Result, Solution, check_result
from ._step import AbstractStep, Adaptive, Fixed, StepTo, _as_time, _is_concrete
from ._switches import may_lie_on_moved_switch, moved_time_switches, switch_holder
from ._times import may_differentiate_times, solve_with_time_derivatives
from ._tracers import derivative_levels, differentiated
from ._tree import hoist_closure, hoist_rhs, partition_args, split_arrays, tree_size
from ._warn import warn_user
from .adjoint.auto import Auto
from .adjoint.base import AbstractAdjoint, Problem
from .solvers.base import AbstractSolver
from .solvers.explicit_rk import Tsit5

PyTree = Any


def solve(
    f: Callable | tuple[Callable, Callable],
    y0: PyTree,
    t_span: tuple[Any, Any],
    args: PyTree = None,
    *,
    solver: AbstractSolver | None = None,
    step: AbstractStep | None = None,
    saveat: SaveAt | None = None,
    adjoint: AbstractAdjoint | None = None,
    max_steps: int = 4096,
    progress: bool = False,
    throw: bool = True,
    events: Event | Sequence[Event] | None = None,
    max_events: int = 64,
) -> Solution:
    """Solve ``dy/dt = f(t, y, args)`` from ``t_span[0]`` to ``t_span[1]``.

    Args:
        f: ``f(t, y, args) -> dy/dt`` with the pytree structure of ``y``; for partitioned
            solvers a pair ``(f_u, f_v)`` with ``du/dt = f_u(t, v, args)``,
            ``dv/dt = f_v(t, u, args)`` and ``y0 = (u0, v0)``.
        y0: the initial state, any pytree of floating arrays (scalars and vectors may mix), of
            one dtype: real, or complex (a Schrödinger equation) with an explicit or
            partitioned solver and the ``og.Discrete`` adjoint (``og.Auto()`` picks it).
        t_span: ``(t0, t1)`` (or an array of the two); ``t1 < t0`` integrates backwards.
            ``jax.grad``, ``jax.jvp`` and ``jax.jacfwd`` reach ``t0``, ``t1`` and
            ``SaveAt(ts)`` too (the ODE's derivatives, ``d y(s) / d s = f(s, y(s))``, for the
            states saved at ``t0``, ``ts`` and ``t1``; see the docs' adjoints page).
        args: any pytree passed to ``f``; gradients flow to its floating arrays and to arrays
            that ``f`` closes over.
        solver: default ``og.Tsit5()``.
        step: ``og.Adaptive()`` (default), ``og.Fixed(dt)`` or ``og.StepTo(ts)``.
        saveat: default ``og.SaveAt(t1=True)``.
        adjoint: how ``jax.grad`` differentiates the solve; default ``og.Auto()``.
        max_steps: the most steps (accepted and rejected) an adaptive solve may take; the size
            of the buffers for ``SaveAt(steps=True)`` and dense output.
        progress: show a progress bar (tqdm) for the forward solve and the reverse pass.
        throw: raise on failure; ``False`` returns ``sol.result`` instead, keeping what was
            saved before the failure.
        events: an :class:`~odegrad.Event` or a sequence of them: zero crossings located on
            the dense output that end the solve or make the state jump (``sol.events``).
        max_events: rows of ``sol.events``; more events are a failure (``throw``).

    Returns:
        A :class:`~odegrad.Solution`.

    Called outside ``jax.jit``, ``jax.grad`` and ``jax.vmap``, the solve is compiled once per
    configuration and reused from its second call on (a changed closure or global recompiles;
    see the docs' internals page, "Eager calls").

    Example:
        >>> import jax, jax.numpy as jnp, odegrad as og
        >>> def f(t, y, k):
        ...     return -k * y
        >>> sol = og.solve(f, jnp.ones(3), (0.0, 1.0), 2.0)
        >>> sol.ys.shape
        (1, 3)
        >>> grad = jax.grad(lambda k: og.solve(f, jnp.ones(3), (0.0, 1.0), k).ys.sum())(2.0)
    """
    options = dict(solver=solver, step=step, saveat=saveat, adjoint=adjoint, max_steps=max_steps)
    options.update(throw=throw, events=events, max_events=max_events)
    if isinstance(t_span, jax.Array | np.ndarray) and jnp.shape(t_span) == (2,):
        t_span = (t_span[0], t_span[1])  # an array [t0, t1], as scipy's solve_ivp takes
    mesh = explicit_mesh((y0, args, t_span))
    if mesh is not None:  # sharded over a mesh with Explicit axes: see _scaleout.py
        run = lambda y, a, ts: solve(f, y, ts, a, progress=progress, **options)
        return on_auto_axes(run, mesh, y0, args, t_span)
    if differentiated((t_span, getattr(saveat, "ts", None))) or may_differentiate_times(
        t_span, saveat, options
    ):
        # d/dt0, d/dt1, d/dts around the solve, whose adjoint holds the times constant
        options["progress"] = progress
        ts, ys, stats, result = solve_with_time_derivatives(
            _solve_at_times, f, y0, t_span, args, options
        )
        return Solution(ts, ys, stats, result)
    return _solve_at_times(f, y0, t_span, args, progress=progress, **options)


def _solve_at_times(f, y0, t_span, args, *, progress=False, **options) -> Solution:
    """:func:`solve` with the times held constant."""
    # an eager call: compiled once per configuration (see _eager.py)
    if not progress and is_eager(y0, args, t_span):
        if options["throw"]:  # the traced path skips this check: run it on the concrete state here
            check_concrete_state(as_state(y0), state_names(y0))
        sol = cached_solve(_solve, f, y0, t_span, args, options)
        if sol is not None:
            return sol
    return _solve(f, y0, t_span, args, progress=progress, **options)


@solve_scope()
def _solve(
    f, y0, t_span, args, *, solver, step, saveat, adjoint, max_steps, throw, events, max_events,
    progress=False,
):  # fmt: skip
    """:func:`solve` once the inputs are on one device (or traced)."""
    adjoint = Auto() if adjoint is None else adjoint
    y0_user = y0
    # (jump_ts ends steps at a switch and adds no derivative term; an event elsewhere neither)
    jump_ts, listed = getattr(step, "jump_ts", None), prepare_events(events, max_events)
    _warn_moved_time_switches(f, y0, t_span, args, solver, jump_ts, listed)
    problem, ctx = _build_problem(
        f, y0, t_span, args, solver, step, saveat, adjoint, max_steps, events, max_events
    )
    saveat, s, t0, args_ext, y0, ts_valid, span_valid = ctx
    if throw:
        check_concrete_state(y0, state_names(y0_user))
    problem = dataclasses.replace(problem, throw=bool(throw))
    if progress:
        from ._progress import bars

        problem = dataclasses.replace(problem, progress=bars())
    out = adjoint.run(problem)
    if ts_valid is not None:  # traced save times, out of order or outside the span
        out = out._replace(result=jnp.where(ts_valid, out.result, Result.invalid_save_times))
    if span_valid is not None:  # (valid, the result otherwise)
        out = out._replace(result=jnp.where(span_valid[0], out.result, span_valid[1]))

    ts, ys = assemble(saveat, problem.plan, s, t0, problem.tau0, y0, args_ext, out)
    # A while loop that failed at t0 never moved: its final state is y0, and reading it rather
    # than y0 keeps y0's buffer free for the loop to update in place.
    y_start = y0 if problem.runs_on else out.y1
    dense = None if out.dense is None else (*out.dense, y_start)  # y0 for an empty span
    if throw:
        gather, locate = failure_locator(problem, out, y_start, t0)
        outputs = (ts, ys, out.stats, out.result, dense, out.events)
        words = describe(problem, y0_user, args, saveat.fn is not None)
        outputs = check_result(outputs, out.result, gather, locate, words)
    else:
        outputs = (ts, ys, out.stats, refined_result(problem, out, y_start), dense, out.events)
    *outputs, log = outputs
    return Solution(*outputs, problem.solver, s, log)


def _closure_values(f) -> list:
    """What ``f`` closes over directly (empty cells, not yet assigned, skipped)."""
    values = []
    for cell in getattr(f, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # "Cell is empty"
            pass
    return values


def _warn_kinked_second_derivatives(f, t0, y0, args) -> None:
    """Warn at trace time of a second derivative through a solve whose ``f`` has kinks.

    Where a trajectory crosses a kink, the flow's first derivative is continuous but its second
    jumps: the crossing adds a term that no pointwise second derivative of ``f`` holds (relu in
    ``y' = -k relu(y - a) - c y``: jax.hessian gave 0.0 for -0.019, with every adjoint). Events,
    which would locate the crossing, refuse second derivatives. A kink no trajectory crosses
    costs nothing, so this warns rather than refuses."""
    try:
        kinks = find_kinks(f, t0, y0, args)
    except Exception:  # a reader's limit is no reason to refuse the solve: none found
        return
    if kinks:
        warn_user(
            f"og.solve: a second derivative (jax.hessian, jax.jacfwd of jax.grad, ...) through "
            f"a solve whose f has kinks ({describe_kinks(kinks)}): wherever the trajectory "
            "crosses one, the second derivative misses the crossing's term and is wrong by "
            "O(1) (the first derivative is right). Smooth the switch for second derivatives "
            "(jax.nn.softplus for relu, a steep tanh for a sign), or take finite differences of "
            "the gradient; a kink no trajectory crosses is harmless."
        )


def _warn_moved_time_switches(f, y0, t_span, args, solver, jump_ts=None, events=()) -> None:
    """Warn at trace time where ``f`` switches branch at a time that a differentiated value
    moves (``where(t < tau, rate, 0)``, ``tau`` differentiated) and the solve has no event
    there: every adjoint differentiates ``f`` pointwise, and ``d/dtau`` misses the jump.

    Surfaces that ``og.switching_events`` entries among ``events`` cover are not named; an
    event of the user's own whose ``cond`` reads ``t`` and a moved value (``t - tau``) is
    taken to lie on them, one that reads neither (``y - 5``) cannot silence it."""
    if solver is not None and getattr(solver, "partitioned", False):
        return
    if differentiated(jump_ts):  # refused with its own message (_checks.check_times_constant)
        return
    cells = _closure_values(f)
    if not differentiated((y0, args, t_span, cells)):
        return
    try:
        t0 = jnp.asarray(t_span[0], jnp.result_type(float))
        labels = moved_time_switches(f, t0, y0, args, differentiated)
    except Exception:  # a reader's limit is no reason to refuse the solve: none found
        return
    if labels and events:
        entry = lambda e: getattr(e.cond, "is_surface_entry", False)
        found = [e.cond.label for e in events if entry(e)]
        labels = [s for s in labels if not any(x == s or x.startswith(s + "[") for x in found)]
        own = [e.cond for e in events if not entry(e)]
        if labels and any(may_lie_on_moved_switch(c, t0, y0, args, differentiated) for c in own):
            return  # (an event of the user's on t and the moved value: taken to lie on it)
    if labels:
        jumps = (
            ""
            if jump_ts is None
            else " (Adaptive(jump_ts=) ends the steps there, with the "
            "times held constant: it adds no such term)"
        )
        warn_user(
            f"og.solve: f switches branch at a time that a differentiated value moves "
            f"({', '.join(labels)}), and the solve has no event there{jumps}: no pointwise "
            "derivative of f holds the jump's term, so the derivative with respect to that "
            "value misses it (exactly 0 for where(t < tau, rate, 0)). Pass "
            "events=og.switching_events(f, t0, y0, args): each crossing is then located and "
            "its term added, by every adjoint."
        )


def _build_problem(
    f, y0, t_span, args, solver, step, saveat, adjoint, max_steps, events=None, max_events=64
):
    """Check every input and normalise the solve into a :class:`Problem` in forward time."""
    solver = Tsit5() if solver is None else solver
    step = Adaptive() if step is None else step
    saveat = SaveAt(t1=True) if saveat is None else saveat
    check_types(f, solver, step, saveat, adjoint, max_steps)
    events = prepare_events(events, max_events)
    if events and derivative_levels((y0, args, t_span)) > 1:
        # the event time's derivative is a first-order rule; its derivative, taken inside the
        # adjoints' control flow, would silently miss the second-order terms
        raise NotImplementedError(SECOND_DERIVATIVES_THROUGH_EVENTS)
    first_order = not getattr(solver, "second_derivatives", True)
    if first_order and derivative_levels((y0, args, t_span)) > 1:
        raise NotImplementedError(
            f"og.solve: second derivatives (jax.hessian, jax.jacfwd of jax.grad, jax.jacfwd of "
            f"jax.jacfwd) through {type(solver).__name__}'s steps are not supported: its stage "
            "recurrence has a first-order derivative rule only. Use finite differences of the "
            "gradient, or a Runge-Kutta or implicit solver."
        )

    y0 = as_state(y0)
    if jnp.iscomplexobj(jax.tree.leaves(y0)[0]):
        check_complex_state(solver, adjoint)
    # times are real: a complex state's real counterpart
    tdtype = jnp.finfo(jnp.result_type(*jax.tree.leaves(y0))).dtype
    if isinstance(step, Adaptive):
        check_precision(step, tdtype)
    t0, t1 = check_t_span(t_span, tdtype)
    check_times_constant(t_span, step, saveat)
    s = _direction(t0, t1)
    tau0, tau1 = s * t0, s * t1
    # a traced span is checked when the solve runs (a concrete one was, above): one that holds
    # inf or nan takes no step (a nan t1 "succeeded" with y0; an inf one ran max_steps) and
    # the result says so (Result.invalid_t_span)
    span_valid, t1_run = None, t1
    if not (_is_concrete(t0) and _is_concrete(t1)):
        span_valid = jnp.isfinite(t0) & jnp.isfinite(t1)
        tau1, t1_run = jnp.where(span_valid, tau1, tau0), jnp.where(span_valid, t1, t0)
    # Only the array leaves of args are traced; the rest (an equinox module's activation
    # function, strings, Python numbers) are put back around them inside f and fn.
    arrays, user_args, arrays_of = split_arrays(args)
    cells = _closure_values(f)
    f = _with_user_args(f, user_args, solver.partitioned)
    check_rhs(f, solver, t0, y0, arrays)
    if not (events or solver.partitioned) and derivative_levels((y0, args, t_span, cells)) > 1:
        _warn_kinked_second_derivatives(f, t0, y0, arrays)

    grid, control = _grid(step, solver, t0, t1_run, s, tdtype, max_steps)
    if events and grid is not None:  # an event ends a step early: the while loop's grid
        control, grid = RuntimeGrid(grid.shape[0] - 1, jnp.asarray(grid, tdtype)), None
    ts_tau = None if saveat.ts is None else check_save_times(saveat.ts, t0, t1, s, tdtype)

    # Move arrays that f and fn close over into args, so that every adjoint sees them.
    f_args, f_consts = _closure_convert_rhs(f, solver, t0, y0, arrays)
    fn = saveat.fn if saveat.fn is not None else (lambda t, y, a: y)
    hoisted = lambda: hoist_closure(_with_user_args(fn, user_args), t0, y0, arrays)
    fn_conv, fn_consts = called_as("SaveAt(fn)", "(t, y, args)", hoisted, "fn(y)")
    event_fns, ev_consts = _closure_convert_events(events, user_args, t0, y0, arrays)
    args_ext = (arrays, f_consts, fn_consts, ev_consts)

    def fn_tau(tau, y, a):
        return fn_conv(s * tau, y, a[0], *a[2])

    args_diff, args_static, combine = partition_args(args_ext)
    batch = vmap_batch_size((y0, arrays, t_span, saveat.ts))
    slots = 1
    if ts_tau is not None and grid is not None:
        slots = static_slot_count(grid, ts_tau) or ts_tau.shape[0]

    # concrete times were kept as numpy for the checks above; from here on they are arrays
    # concrete times stay concrete arrays (constants): a jnp array made under jax.jit is that
    # trace's tracer, which the adjoints' custom VJPs would close over, and
    # jax.grad(jax.jit(loss)) traces their rules in another trace (a leaked tracer)
    def to_jnp(x):
        if x is None:
            return None
        if _is_concrete(x):  # (a device_put: jnp.asarray of a 0-d array compiles a program)
            with jax.ensure_compile_time_eval():
                return jax.device_put(np.asarray(x, tdtype))
        return jnp.asarray(x, tdtype)

    grid, ts_tau, t0, tau0, tau1 = map(to_jnp, (grid, ts_tau, t0, tau0, tau1))
    plan = SavePlan(
        fn=fn_tau,
        ts=ts_tau,
        steps=saveat.steps,
        dense=saveat.dense,
        slots=slots,
        fn_reads_args=saveat.fn is not None,
        fn_is_state=saveat.fn is None,
        lanes=batch,
    )
    if isinstance(step, Adaptive) and hasattr(solver, "with_tolerances"):
        # implicit solvers stop their Newton iterations relative to the controller's tolerances
        solver = solver.with_tolerances(step.rtol, step.atol)
    # og.switching_events' switches are held for each step (partitioned f: not read)
    hold = None if solver.partitioned else switch_holder(events, f_args, t0, y0, args_ext)
    problem = Problem(
        solver=solver.with_user_args(lambda a: user_args(a[0])),
        f=f_args,
        direction=s,
        y0=y0,
        args=args_ext,
        args_diff=args_diff,
        combine=combine,
        args_static=args_static,
        save_fn=lambda t, y, a: fn_conv(t, y, a[0], *a[2]),
        tau0=tau0,
        tau1=tau1,
        grid=grid,
        control=control,
        plan=plan,
        max_steps=max_steps,
        batch=batch,
        user_args=lambda a: user_args(a[0]),
        user_arrays=arrays_of,
        events=EventSet.build(
            events,
            event_fns,
            f_args,
            solver.partitioned,
            max_events,
            hold,
            (tree_size(y0), isinstance(step, Adaptive)),
        ),
    )
    ts_valid = save_times_valid(ts_tau, tau0, tau1)
    if isinstance(step, StepTo) and not all(map(_is_concrete, (grid, tau0, tau1))):
        # a traced StepTo(ts) off the span or out of order would step y0 from ts[0] and call
        # the state at ts[-1] the one at t1 (a success), so the result says so
        order = jnp.all(grid[1:] > grid[:-1])
        valid = order & (grid[0] == tau0) & (grid[-1] == tau1)
        span_valid = valid if span_valid is None else span_valid & valid
        span_valid = (span_valid, Result.invalid_step_times)
    elif span_valid is not None:
        span_valid = (span_valid, Result.invalid_t_span)
    return problem, (saveat, s, t0, args_ext, y0, ts_valid, span_valid)


def explain_adjoint(
    f: Callable | tuple[Callable, Callable],
    y0: PyTree,
    t_span: tuple[Any, Any],
    args: PyTree = None,
    **solve_kwargs,
) -> str:
    """Say which adjoint ``og.solve`` would use for this problem, and why, with the numbers.

    Takes the arguments of :func:`solve` (``adjoint`` defaults to ``og.Auto()``), and explains
    a gradient with respect to ``y0`` and every inexact leaf of ``args``, a Python float
    included (under ``jax.grad`` it is traced). A solve under ``jax.grad`` counts only what is
    traced: with a ``y0`` closed over as a constant it may choose otherwise.

    Example:
        >>> print(og.explain_adjoint(f, y0, (0.0, 10.0), args, step=og.Fixed(0.01)))
    """
    unknown = set(solve_kwargs) - {
        "solver",
        "step",
        "saveat",
        "adjoint",
        "max_steps",
        "progress",
        "throw",
        "events",
        "max_events",
    }
    if unknown:
        raise TypeError(f"explain_adjoint: unexpected arguments {sorted(unknown)}.")
    adjoint = solve_kwargs.get("adjoint") or Auto()
    # A Python float in args is a constant to og.solve, and a traced parameter under jax.grad,
    # which is what this explains: count it as one (else 32 state entries and a float would
    # be explained as Forward's 32 inputs, and solved under grad as Discrete's 33).
    args = jax.tree.map(lambda x: jnp.asarray(x) if type(x) in (float, complex) else x, args)
    problem, _ = _build_problem(
        f,
        y0,
        t_span,
        args,
        solve_kwargs.get("solver"),
        solve_kwargs.get("step"),
        solve_kwargs.get("saveat"),
        adjoint,
        solve_kwargs.get("max_steps", 4096),
        solve_kwargs.get("events"),
        solve_kwargs.get("max_events", 64),
    )
    return adjoint.describe(problem)


# --- input checks, each raising at trace time with the argument and the fix ---------------------


def _direction(t0, t1):
    if _is_concrete(t0) and _is_concrete(t1):
        return 1.0 if float(t1) >= float(t0) else -1.0
    return jnp.where(t1 >= t0, 1.0, -1.0).astype(t0.dtype)


FIXED_SLACK = 1e-6


def _grid(step, solver, t0, t1, s, tdtype, max_steps):
    """A static-length grid in forward time, or (None, control) for while-loop stepping."""
    if _is_concrete(t0) and _is_concrete(t1) and float(t0) == float(t1):
        # an empty span takes no step (y0 is the solution), as a traced one does: in the
        # while loop, which tests t < t1 before a first step (a grid's scan would take one)
        return None, RuntimeGrid(1)
    if isinstance(step, Fixed):
        if _is_concrete(t0) and _is_concrete(t1) and _is_concrete(step.dt):
            span = abs(float(t1) - float(t0))
            n = max(1, math.ceil(span / float(step.dt) * (1 - FIXED_SLACK)))
            if n > max_steps:
                raise ValueError(
                    f"Fixed(dt={step.dt}) over t_span=({float(t0)}, {float(t1)}) takes {n} steps "
                    f"but max_steps={max_steps}: pass max_steps>={n} or a larger dt."
                )
            tau0, tau1 = (np.asarray(s * np.asarray(t), tdtype) for t in (t0, t1))
            # in numpy: eager jnp operations compile an XLA program each at their first use
            # (0.2 s of a process's first solve); k * (1 / n) is what XLA made of k / n
            k = np.arange(n + 1, dtype=tdtype)
            grid = tau0 + (tau1 - tau0) * (k * np.asarray(1.0 / n, tdtype))
            grid[-1] = tau1
            return grid, None
        n = jnp.ceil(jnp.abs(t1 - t0) / step.dt * (1 - FIXED_SLACK))
        n = jnp.maximum(1, n).astype(jnp.int32)
        return None, RuntimeGrid(n)
    if isinstance(step, StepTo):
        ts = _as_time(step.ts, tdtype)
        n = ts.shape[0] - 1
        if n > max_steps:
            raise ValueError(
                f"StepTo(ts) takes {n} steps but max_steps={max_steps}: pass max_steps>={n}."
            )
        if _is_concrete(ts):
            tsn = np.asarray(ts)
            if not np.all(np.diff(s * tsn) > 0) if _is_concrete(s) else False:
                raise ValueError(
                    "StepTo(ts): ts must be strictly monotonic in the direction of t_span."
                )
            if _is_concrete(t0) and _is_concrete(t1):
                if tsn[0] != float(t0) or tsn[-1] != float(t1):
                    raise ValueError(
                        f"StepTo(ts): ts must start at t0={float(t0)} and end at t1={float(t1)}, "
                        f"got ts[0]={tsn[0]}, ts[-1]={tsn[-1]}."
                    )
        return s * ts, None
    return None, step


def _with_user_args(f, user_args, partitioned=False):
    """``f(t, y, args)`` called with the array leaves of ``args`` only."""
    if partitioned:
        return tuple(_with_user_args(g, user_args) for g in f)
    return lambda t, y, arrays: f(t, y, user_args(arrays))


def _closure_convert_rhs(f, solver, t0, y0, args):
    """``f`` with closed-over arrays hoisted into an explicit tuple of constants."""
    conv, consts = hoist_rhs(f, solver.partitioned, t0, y0, args)
    if solver.partitioned:
        (fu, fv), (cu, cv) = conv, consts
        nu = len(cu)

        def f_u(t, v, a):
            return fu(t, v, a[0], *a[1][:nu])

        def f_v(t, u, a):
            return fv(t, u, a[0], *a[1][nu:])

        return (f_u, f_v), (*cu, *cv)
    return (lambda t, y, a: conv(t, y, a[0], *a[1])), tuple(consts)


def _closure_convert_events(events, user_args, t0, y0, arrays):
    """Each event's ``cond`` and ``update`` on the solve's ``args``, with the arrays they close
    over hoisted into ``args[3]`` (so that every adjoint sees them)."""
    check_event_shapes(events, t0, y0, arrays, user_args)
    fns, consts = [], []
    for i, ev in enumerate(events):
        pair, pair_consts = [], []
        for k, fun in enumerate((ev.cond, ev.update)):
            if fun is None:
                pair.append(None)
                pair_consts.append(())
                continue
            conv, cs = hoist_closure(_with_user_args(fun, user_args), t0, y0, arrays)
            pair.append(lambda t, y, a, conv=conv, i=i, k=k: conv(t, y, a[0], *a[3][i][k]))
            pair_consts.append(tuple(cs))
        fns.append(tuple(pair))
        consts.append(tuple(pair_consts))
    return tuple(fns), tuple(consts)
