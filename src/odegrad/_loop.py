"""The forward integration loops: stepping and accepting, nothing else.

Both loops control time in forward time ``tau = s * t`` (``s = -1`` integrates backwards) but call
the solver in real time with a signed step, so ``f`` itself is never wrapped.

* :func:`scan_loop` — a step grid whose length is known at trace time: one ``lax.scan``, no
  per-step control flow, differentiable by JAX itself.
* :func:`while_loop` — error-controlled (or runtime-length) stepping in one ``lax.while_loop``;
  its reverse pass is a custom VJP defined by the adjoints, never a differentiated loop. What it
  keeps besides the state (saves, dense output, event log, an adjoint's record) is a list of
  recorders (:mod:`~odegrad._recorders`); whether a step is accepted is
  :func:`~odegrad._step.adapt_step`'s answer.

Saving (which step holds a save time, and its value) is :mod:`~odegrad._saving`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ._batching import any_member, member_where, run_if
from ._events import EventLogRecorder, EventSet, EventState, step_events
from ._progress import chunked_scan
from ._recorders import DenseRows, LoopSetup, Recorder, StepRecord, StepTaken, StepTimes
from ._saving import SaveAtTimes, SavePlan, SaveSteps, ScanSaves
from ._solution import Result
from ._step import Adaptive, adapt_step, between_jumps, control_times, jump_times, next_jump
from ._tree import tree_all_finite, tree_bytes, tree_where
from ._tuning import tuning

PyTree = Any


class LoopOutput(NamedTuple):
    y1: PyTree
    t1: Any
    ts_ys: PyTree | None  # one row per save time
    steps_ts: Any  # one row per step
    steps_ys: PyTree | None
    dense: tuple | None  # (step starts, step sizes, per-step dense data, step count)
    stats: dict
    result: Any
    fail_t: Any
    fail_step: Any
    record: dict  # what the adjoint asked the loop to keep
    accumulated: Any = None
    events: Any = None  # an EventLog (real time), when the solve has events
    h: Any = None  # adaptive: the step size the controller would try next (in tau)
    resume: Any = None  # with while_loop(resume=...): solver.resume_state of the final state


def _unroll(n_steps: int, y0) -> int:
    """All ``n_steps`` as straight-line code when they are few and the state large: a scan
    stacks each step's residuals for its reverse pass and reads them back, a copy of several
    fields per step (``Tuning.unrolled_steps``)."""
    t = tuning()
    if n_steps <= t.unrolled_steps and tree_bytes(y0) >= t.unrolled_state_bytes:
        return max(n_steps, 1)  # lax.scan rejects unroll=0 (an empty grid)
    return 1


def scan_loop(solver, f, args, grid, y0, *, plan: SavePlan, s=1.0, progress=None) -> LoopOutput:
    """Integrate over a grid (in ``tau``) of ``len(grid) - 1`` steps known at trace time."""
    n_steps = grid.shape[0] - 1
    t_real = grid if isinstance(s, float) and s == 1.0 else s * grid
    st0, init_evals = solver.init_from(f, t_real[0], y0, args, None)
    saves = ScanSaves.make(plan, grid, y0, st0)
    xs = {"t0": t_real[:-1], "t1": t_real[1:]}
    if saves is not None:
        xs.update(saves.xs())

    def body(carry, x):
        y, st, buf = carry
        dt = x["t1"] - x["t0"]
        res = solver.step(f, x["t0"], dt, y, args, st)
        st1, hook_evals = solver.after_step(f, x["t0"] + dt, res.y1, args, res.state, True, False)
        out = {}
        if saves is not None:
            step = (y, st, res.dense, s * x["t0"], s * dt)
            buf = saves.update(buf, x, step, solver, args, out)
        if plan.steps:
            out["y"] = plan.fn(s * x["t1"], res.y1, args)
        if plan.dense:
            out["dense"] = res.dense
        # solvers with a run-time stage count report it (stabilized.py), hooks their own
        if res.evals is not None or not (isinstance(hook_evals, int) and hook_evals == 0):
            out["evals"] = (solver.step_evals if res.evals is None else res.evals) + hook_evals
        return (res.y1, st1, buf), out

    carry = (y0, st0, None if saves is None else saves.init(grid[0], y0, args))
    if progress is None:
        (y1, _, ts_buf), out = lax.scan(body, carry, xs, unroll=_unroll(n_steps, y0))
    else:
        (y1, _, ts_buf), out = chunked_scan(body, carry, xs, n_steps, progress)
    if saves is not None:

        def step_dense(k, y, st):
            return solver.step(f, t_real[k], t_real[k + 1] - t_real[k], y, args, st).dense

        ts_buf = saves.finish(ts_buf, out, solver, args, step_dense)
    # No per-step finiteness test (it would cost a pass over the state every step): a non-finite
    # value propagates to the end, and the saved rows locate where it first appeared, computed
    # only when the solve failed (see locate_failure).
    failed = ~tree_all_finite((y1, out.get("y"), ts_buf))
    n = jnp.asarray(n_steps)
    evals = init_evals + (jnp.sum(out["evals"]) if "evals" in out else n_steps * solver.step_evals)
    stats = {"steps": n, "accepted": n, "rejected": jnp.asarray(0), "rhs_evals": jnp.asarray(evals)}
    dense = (grid[:-1], grid[1:] - grid[:-1], out["dense"], n_steps) if plan.dense else None
    return LoopOutput(
        y1=y1,
        t1=grid[-1],
        ts_ys=ts_buf,
        steps_ts=grid[1:] if plan.steps else None,
        steps_ys=out.get("y"),
        dense=dense,
        stats=stats,
        result=jnp.where(failed, Result.nonfinite, Result.success).astype(jnp.int32),
        fail_t=None,
        fail_step=None,
        record={},
    )


def _saves_at_start(rows, plan: SavePlan, c: LoopState, setup: LoopSetup):
    """The saves at ``tau0`` when the loop accepted no step (a span traced to ``t1 == t0``, or a
    failure at the start), which no step wrote: the state there is ``y0``. (The loop's time
    moves with each accepted step: asking it rather than the count of accepted steps spares
    the loop that counter where nothing else reads it.)"""
    none_taken = c.t == setup.tau0

    def fill(rows):
        at_start = (plan.ts <= setup.tau0) & none_taken
        value = plan.fn(setup.tau0, setup.y0, setup.args)
        pick = lambda r, v: jnp.where(at_start.reshape(at_start.shape + (1,) * (r.ndim - 1)), v, r)
        return jax.tree.map(pick, rows, value)

    return run_if(any_member(none_taken), fill, rows)


def _saved_rows_finite(outs: dict, plan: SavePlan, t_end):
    """Whether every row an unchecked while loop saved (at or before ``t_end``) is finite."""
    ok = jnp.asarray(True)
    for rows, times in ((outs.get("steps_ys"), outs.get("steps_ts")), (outs.get("ts_ys"), plan.ts)):
        if rows is not None:
            ok = ok & jnp.all(jax.vmap(tree_all_finite)(rows) | ~(times <= t_end))
    return ok


class RuntimeGrid(NamedTuple):
    """Steps fixed in advance, taken by the while loop: ``n`` equal steps over the span (a count
    known only at run time), or the points of ``grid`` (forward time) when given, which a solve
    with events steps through (an event ends a step early; the next one resumes the grid)."""

    n: Any
    grid: Any = None


def checks_each_step(control, events) -> bool:
    """Whether the while loop tests each step's state for inf and nan (and stops there).

    An adaptive step's error ratio does (its acceptance depends on it), and so does a solve with
    events (their root finding must not run on non-finite values). A grid without events
    decides nothing from the state: like the scan, it runs on, a non-finite value reaches the
    end, and the saved rows locate it (:func:`~odegrad._failure.locate_failure`). The test is a
    reduction over the state every step: seed 004's wave with a traced span (64^2 fields, 2000
    steps) spent 35 ms of its 71 ms forward in it on XLA:CPU.
    """
    return not isinstance(control, RuntimeGrid) or events is not None


class LoopState(NamedTuple):
    """The while loop's carry (forward time)."""

    t: Any
    y: PyTree
    st: PyTree  # the solver's state
    h: Any  # the step size to try next
    ratio_prev: Any  # the last accepted step's error ratio (PI control)
    n: Any  # steps attempted
    acc: Any  # steps accepted; None where every step taken is (an unchecked loop: ``n``)
    evals: Any  # rhs evaluations of all attempted steps
    result: Any
    grid_k: Any = None  # a checked fixed grid: the point the next step aims at (else n + 1)
    events: EventState | None = None
    reported: Any = None  # the progress bar's last report
    records: tuple = ()  # one carry per recorder

    @property
    def accepted(self):
        """Steps accepted. An unchecked loop accepts every step it takes, and counts them once:
        XLA keeps each carried counter, and its update is a kernel of its own on every step."""
        return self.n if self.acc is None else self.acc

    @property
    def grid_point(self):
        """The fixed grid's point the next step aims at."""
        return self.n + 1 if self.grid_k is None else self.grid_k


def _first_step(solver, control, f, args, s, tau0, tau1, y0, st0, st_evals, h_guess=None):
    """The first step size to try, rhs evaluations of the start (``st_evals`` those of the
    solver's state), and the smallest step, a function of where a step starts.

    ``h_guess``: a step size carried over from a solve that ended where this one starts (the
    continuous adjoints' previous interval); where it is not finite, Hairer & Wanner's choice.
    """
    span = tau1 - tau0
    if isinstance(control, RuntimeGrid):
        h0, init_evals, floor_ = span / control.n, st_evals, None
    else:
        # the initial-step rule evaluates f once past y0, and f(y0) too unless the state is it
        fsal = jax.tree.structure(st0) == jax.tree.structure(y0)
        pick_evals = 1 if fsal else 2

        def pick():
            f0 = st0 if fsal else f(s * tau0, y0, args)
            f0 = jax.tree.map(lambda d: s * d, f0)
            f_tau = lambda tau, y, a: jax.tree.map(lambda d: s * d, f(s * tau, y, a))
            order = solver.order if solver.embedded_order is None else solver.embedded_order + 1
            h = control.initial_step(f_tau, tau0, y0, f0, args, order, span)
            return lax.stop_gradient(jnp.asarray(h, jnp.result_type(span)))

        init_evals = st_evals + (0 if control.dt0 is not None else pick_evals)
        if h_guess is None or control.dt0 is not None:
            h0 = pick()
        else:
            # the pick's evaluation of f only while some member has no guess (an unbatched
            # conditional: under vmap a batched one would take both branches)
            guess = lax.stop_gradient(jnp.asarray(h_guess, jnp.result_type(span)))
            known = jnp.isfinite(guess) & (guess > 0)
            # (not capped at the span: the loop caps each step at what remains, and keeps a
            # last step's uncapped size for the next solve)
            missing = any_member(~known)
            h0 = lax.cond(missing, lambda: jnp.where(known, guess, pick()), lambda: guess)
            init_evals = st_evals + pick_evals * missing.astype(jnp.int32)
        floor_ = control.dtmin
    eps = jnp.finfo(jnp.result_type(tau0)).eps
    # the smallest step is relative to where the step starts (a step below ~eps |t| does not
    # move t; one relative to the span's ends refused a stiff start at t = 0 on a long float32
    # span), and at least eps^2 of the span there (t = 0)
    span_floor = 4 * eps * eps * jnp.abs(tau1 - tau0)
    dtmin = span_floor if floor_ is None else jnp.maximum(span_floor, floor_)

    def floor(tau):
        return jnp.maximum(4 * eps * jnp.abs(tau), dtmin)

    if not isinstance(control, RuntimeGrid):
        # A first step below the spacing of the floats at t0 does not move t (t + h rounds
        # to t, and the loop steps by the time taken): an implicit stage then divides by 0
        # (Kvaerno5 in float32 from t0 = 100 at atol 1e-8 reported "non-finite" at its first
        # step). eps |t0| is at least that spacing; not the rejection floor (4 eps |t|),
        # under which a first step that fails would end the solve (y' = -y from t0 = 1e6 in
        # float32 starts below it, and grows).
        h0 = jnp.maximum(h0, eps * jnp.abs(tau0))
        if control.dtmax is not None:
            h0 = jnp.minimum(h0, jnp.asarray(control.dtmax, h0.dtype))
    return h0, init_evals, floor


def while_loop(
    solver,
    f,
    args,
    y0,
    *,
    tau0,
    tau1,
    control,
    plan: SavePlan,
    max_steps: int,
    record: tuple[Recorder, ...] = (),
    s=1.0,
    progress=None,
    events: EventSet | None = None,
    h_guess=None,
    resume=None,
    stops=None,
) -> LoopOutput:
    """Integrate from ``tau0`` to ``tau1 > tau0`` in one ``lax.while_loop``.

    ``control`` is an :class:`~odegrad.Adaptive` or a :class:`RuntimeGrid`. ``plan``'s saves
    and ``record`` (what an adjoint asks to keep, e.g. a
    :class:`~odegrad._recorders.StepRecord`) are recorders; ``events``: see
    :mod:`odegrad._events`; ``h_guess``: see :func:`_first_step`. ``resume``: what a solve
    that ended at ``tau0`` left of its solver's state (``LoopOutput.resume``; see
    :meth:`~odegrad.solvers.base.AbstractSolver.init_from`), its own returned likewise.
    ``stops``: more times (ascending, in ``tau``; ``-inf`` pads) that adaptive steps end on,
    as ``Adaptive(step_ts=)``'s.
    """
    tdtype = jnp.result_type(tau0)
    adaptive = not isinstance(control, RuntimeGrid)
    jumps = jump_times(control, s, tdtype) if adaptive else None
    # where steps end: the jumps (first: a step ending on one restarts), step_ts and the
    # given stops, each ascending
    stops = [jumps, control_times(control, "step_ts", s, tdtype), stops] if adaptive else []
    stops = [x for x in stops if x is not None]
    held_ = (lambda t, y: f) if events is None else (lambda t, y: events.held(f, t, y, args, s))
    # (the stages of a step read time strictly between the jumps around its start)
    held = held_ if jumps is None else (lambda t, y: between_jumps(held_(t, y), jumps, s * t, s))
    st0, st_evals = solver.init_from(held(s * tau0, y0), s * tau0, y0, args, resume)
    h0, init_evals, floor = _first_step(
        solver, control, f, args, s, tau0, tau1, y0, st0, st_evals, h_guess
    )
    setup = LoopSetup(solver, f, args, s, tau0, y0, st0, max_steps, events)
    recorders = _recorders_for(plan, record, events)
    checked = checks_each_step(control, events)
    c = LoopState(
        t=tau0,
        y=y0,
        st=st0,
        h=jnp.asarray(h0, tdtype),
        ratio_prev=jnp.asarray(1.0, tdtype),
        n=jnp.asarray(0),
        acc=jnp.asarray(0) if checked else None,
        evals=jnp.asarray(0),
        result=jnp.asarray(int(Result.success), jnp.int32),
        grid_k=None if adaptive or not checked else jnp.asarray(1),
        events=None if events is None else EventState.init(events, s * tau0, y0, args),
        reported=None if progress is None else jnp.asarray(-1, jnp.int32),
        records=tuple(r.init(setup) for r in recorders),
    )

    def running(c):
        go = (c.t < tau1) & (c.result == Result.success) & (c.n < max_steps)
        return go if events is None else go & ~c.events.done

    def grid_step(c):
        """A fixed step: to the grid point it aims at (the end past the last one)."""
        if control.grid is not None:
            target = control.grid[jnp.minimum(c.grid_point, control.n)]
        else:
            target = tau0 + c.grid_point * h0
        return jnp.where(c.grid_point >= control.n, tau1 - c.t, target - c.t)

    # Under vmap the loop runs while any member runs (an unbatched predicate), and a finished
    # member's body changes nothing: a batched predicate would make JAX select between the old
    # and the new carry, every buffer of max_steps rows included, on every step.
    def cond(c):
        return any_member(running(c))

    ratio_sees_y1 = adaptive and type(control).error_ratio is Adaptive.error_ratio
    # unchecked, a step is accepted wherever the loop runs: ``member_where`` is then free
    # outside vmap, and selects per member under it
    select = tree_where if checked else member_where
    # a record that keeps each step's VJP takes the step itself (StepRecord.take)
    take = next((r.take for r in recorders if isinstance(r, StepRecord) and r.take), None)

    def _restart(x):
        where, tau, y, st = x
        fresh = solver.restart(held(s * tau, y), s * tau, y, args, st)
        return where, tau, y, tree_where(where, fresh, st)

    def body(c: LoopState) -> LoopState:
        active = running(c)
        remaining = tau1 - c.t
        if adaptive:
            cap = solver.max_step(c.st)  # a solver's stable step limit (stabilized.py), or None
            h = jnp.minimum(c.h if cap is None else jnp.minimum(c.h, cap), remaining)
        else:
            h = grid_step(c)
        lands = False
        if stops:  # a step that would reach the next stop (a jump) ends on it
            nexts = [next_jump(x, c.t) for x in stops]
            stop = functools.reduce(jnp.minimum, nexts)
            lands = (stop <= tau1) & (c.t + h >= stop)
            h = jnp.where(lands, stop - c.t, h)
        last = h >= remaining
        t_new = jnp.where(last, tau1, c.t + h)
        if stops:
            t_new = jnp.where(lands & ~last, stop, t_new)
            lands = lands & ~last
        if adaptive:
            # the step the time took: t + h rounds (float32 at t = 1e6 by up to 0.03), and y
            # stepped by h while t moved by another amount drifts from the solution (5 % at
            # t0 = 1e6 over 0.5); a grid's t + h lands on its point already
            h = t_new - c.t
        if take is None:
            res = solver.step(held(s * c.t, c.y), s * c.t, s * h, c.y, args, c.st)
            pullback = None
        else:
            res, pullback = take(c.t, h, t_new, c.y, c.st)
        # Adaptive's own error ratio is nan where y1 is not finite (rms_error_ratio): no pass
        # of its own over y1 then, and the nan says which failure it was (a conditional on
        # every step that asked y1 once a step failed cost Lotka-Volterra's 119 steps ~13 us)
        finite = None if ratio_sees_y1 or not checked else tree_all_finite(res.y1)
        if adaptive:
            decision = adapt_step(
                control,
                res.error,
                c.y,
                res.y1,
                finite,
                h,
                c.ratio_prev,
                solver.embedded_order,
                solver.prev_ratio_floor,
                floor(c.t),
                solver.pi_gains,
            )
            accept = decision.accept & active
            h_next = jnp.where((accept & last) | ~active, c.h, decision.h_next)
            # past a stop, the size the controller wanted before the stop cut the step short
            if stops:
                h_next = jnp.where(accept & lands, jnp.maximum(h_next, c.h), h_next)
            ratio_prev = jnp.where(active, decision.ratio, c.ratio_prev)
            failed = active & decision.underflow
            # (where the ratio is nan, f gave an inf or a nan in a stage the error estimate
            # reads, which y1 may not: "non-finite" names that too)
            failure = jnp.where(
                decision.nonfinite, Result.nonfinite, Result.step_size_underflow
            ).astype(jnp.int32)
        else:
            accept = finite & active if checked else active
            h_next, ratio_prev = c.h, c.ratio_prev
            failed, failure = active & ~accept, jnp.asarray(Result.nonfinite)
        y1, st1, y_end = res.y1, res.state, res.y1
        evals = solver.step_evals if res.evals is None else res.evals
        ev = ev_row = None
        ev_state = c.events
        if events is not None:
            ev = step_events(events, solver, f, args, s, c.t, h, t_new, res, c.events, accept)
            accept = accept & ~ev.overflow
            t_new = jnp.where(ev.fired, ev.tau, t_new)
            y1 = tree_where(ev.fired, ev.y_plus, y1)
            st1 = tree_where(ev.fired, ev.state, st1)
            y_end = tree_where(ev.fired, ev.y_minus, y_end)
            ev_row = jnp.where(ev.fired, c.events.count, events.max_events)  # out of range: none
            ev_state = c.events.after(ev, accept)
            evals = evals + ev.evals  # the solver's restart at the event, and its cond's rate
            failed = failed | ev.overflow
            failure = jnp.where(ev.overflow, Result.max_events_reached, failure)
        restart = None
        if jumps is not None:  # a fresh first stage past the jump (FSAL: one evaluation)
            restart = accept & lands & (stop == nexts[0])  # (nexts[0]: the next jump)
            restart = restart if events is None else restart & ~ev.fired
            st1 = run_if(any_member(restart), _restart, (restart, t_new, y1, st1))[3]
            evals = evals + jnp.where(restart, solver.restart_evals, 0)
        grid_k = c.grid_k
        if grid_k is not None:
            # an event ends a step early (the next resumes the grid) unless it fell on its end
            on_grid = accept if events is None else accept & ~(ev.fired & (ev.theta < 1))
            grid_k = c.grid_k + on_grid
        y_next = select(accept, y1, c.y)
        # The solver revises the state the next attempt starts from (a fresh spectral-radius
        # estimate): at the step's end once accepted, where the retry starts once rejected.
        # After the select, so that what the step passed through is not selected over. The
        # end as tau + h, as replays compute it (Problem.step); a jump restarts the solver.
        quiet = accept if events is None else accept & ~ev.fired
        quiet = quiet if restart is None else quiet & ~restart
        st_next, hook_evals = solver.after_step(
            f,
            s * jnp.where(accept, c.t + h, c.t),
            y_next,
            args,
            select(accept, st1, c.st),
            quiet,
            ~accept & active if adaptive else False,
        )
        evals = evals + hook_evals
        row = jnp.where(accept, c.accepted, max_steps)  # out of range when rejected: no write
        step = StepTaken(c.t, h, t_new, c.y, c.st, res, y_end, accept, row, ev, ev_row, pullback)
        t = jnp.where(accept, t_new, c.t)
        reported = c.reported
        if progress is not None:
            reported = progress.forward.advance((t - tau0) / (tau1 - tau0), c.reported)
        return LoopState(
            t=t,
            y=y_next,
            st=st_next,
            h=h_next,
            ratio_prev=ratio_prev,
            n=c.n + active,
            acc=None if c.acc is None else c.acc + accept.astype(c.acc.dtype),
            evals=c.evals + jnp.where(active, evals, 0),
            result=jnp.where(failed, failure, c.result).astype(jnp.int32),
            grid_k=grid_k,
            events=ev_state,
            reported=reported,
            records=tuple(
                r.update(r_c, step, setup) for r, r_c in zip(recorders, c.records, strict=True)
            ),
        )

    c = lax.while_loop(cond, body, c)
    outs = {}
    for r, r_c in zip(recorders, c.records, strict=True):
        outs.update(r.finish(r_c, c))
    if "ts_ys" in outs:
        outs["ts_ys"] = _saves_at_start(outs["ts_ys"], plan, c, setup)
    result = c.result
    if not checked:
        ok = tree_all_finite(c.y) & _saved_rows_finite(outs, plan, c.t)
        result = jnp.where(ok, result, Result.nonfinite)
    unfinished = (result == Result.success) & (c.t < tau1)
    t1 = c.t
    if events is not None:
        unfinished = unfinished & ~c.events.done
        # a terminal event's time, differentiable (the carried time is a constant)
        last_event = outs["events"].ts[jnp.maximum(c.events.count - 1, 0)]
        t1 = jnp.where(c.events.done, s * last_event, t1)
    dense = None
    if plan.dense:
        dense = (outs["starts"][:-1], outs["sizes"], outs["dense"], c.accepted)
    kept = {}
    if "record" in outs:  # an adjoint's record: step times, and what it asked for
        kept = {"starts": outs["starts"], "sizes": outs["sizes"], **outs["record"]}
    return LoopOutput(
        y1=c.y,
        t1=t1,
        ts_ys=outs.get("ts_ys"),
        steps_ts=outs.get("steps_ts"),
        steps_ys=outs.get("steps_ys"),
        dense=dense,
        stats={
            "steps": c.n,
            "accepted": c.accepted,
            "rejected": c.n - c.accepted,
            "rhs_evals": init_evals + c.evals,
        },
        result=jnp.where(unfinished, Result.max_steps_reached, result).astype(jnp.int32),
        # unchecked: the loop's end, or the first non-finite saved row (locate_failure)
        fail_t=c.t if checked else None,
        fail_step=c.n if checked else None,
        record=kept,
        accumulated=outs.get("accumulated"),
        events=outs.get("events"),
        h=c.h if adaptive else None,
        resume=None if resume is None else solver.resume_state(c.st),
    )


def _recorders_for(plan: SavePlan, record: tuple[Recorder, ...], events) -> list[Recorder]:
    """The saves ``plan`` asks for, the dense output, the event log, then ``record``."""
    recorders: list[Recorder] = []
    if plan.ts is not None:
        recorders.append(SaveAtTimes(plan))
    if plan.steps:
        recorders.append(SaveSteps(plan))
    if plan.dense or any(isinstance(r, StepRecord) for r in record):
        recorders.append(StepTimes())
    if plan.dense:
        recorders.append(DenseRows())
    if events is not None:
        recorders.append(EventLogRecorder(events.max_events))
    return [*recorders, *record]


def dense_evaluate(solver, dense, tau, side: str = "right", toward=None, at=None):
    """The state at forward time ``tau`` from a loop's dense output ``(starts, sizes, data, n)``
    (no step taken, ``n = 0``: meaningless, and finite).

    At a step boundary it reads the step that starts there (``side="right"``) or ends there
    (``"left"``: the state just before an event's jump); with ``toward``, the step on the side
    of that time (an integration over an interval passes its midpoint). With ``at``, the step
    is the one at ``at`` (by the same rules), its interpolant evaluated at ``tau``."""
    starts, sizes, data, n = dense[:4]
    loc = tau if at is None else at
    # a few rows (a window of steps): one comparison each, no binary-search loop to compile
    method = "compare_all" if starts.shape[0] <= 16 else "scan"
    search = lambda side_: jnp.searchsorted(starts, loc, side=side_, method=method)
    if toward is None:
        k = search(side) - 1
    else:
        k = jnp.where(toward < loc, search("left"), search("right")) - 1
    # row 0 (zeros, size 1) where no step was taken: finite, so that the caller's select of
    # y0 there (Solution.evaluate) passes no nan to a gradient
    k = jnp.clip(k, 0, jnp.maximum(n - 1, 0))
    theta = (tau - starts[k]) / sizes[k]
    return solver.interpolate(jax.tree.map(lambda x: x[k], data), theta)
