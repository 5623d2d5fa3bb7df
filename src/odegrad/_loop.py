"""The forward integration loops.

Both loops control time in forward time ``tau = s * t`` (``s = -1`` integrates backwards) but call
the solver in real time with a signed step, so ``f`` itself is never wrapped.

* :func:`scan_loop` — a step grid whose length is known at trace time: one ``lax.scan``, no
  per-step control flow, differentiable by JAX itself.
* :func:`while_loop` — error-controlled (or runtime-length) stepping in one ``lax.while_loop``;
  its reverse pass is a custom VJP defined by the adjoints, never a differentiated loop.

Saving at given times reads the solver's interpolant inside the step that contains them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._batching import any_member
from ._events import EventLog, EventSet, step_events
from ._progress import chunked_scan
from ._solution import Result
from ._step import adapt_step
from ._tree import tree_all_finite, tree_bytes, tree_where
from ._tuning import tuning

PyTree = Any


@dataclass(frozen=True)
class SavePlan:
    """What the loop stores, in forward time. ``fn(tau, y, args)`` maps a state to a saved value."""

    fn: Any
    ts: Any = None  # sorted save times (tau), or None
    steps: bool = False
    dense: bool = False
    slots: int = 1  # saves per step the scan reserves (static); only for scan_loop with ts
    #: optional ``accumulate(t, dt, dense, args) -> pytree`` summed over accepted steps (while
    #: loop only; real time, signed ``dt``); the quadrature adjoint integrates with it.
    accumulate: Any = None
    #: False when ``fn`` ignores ``args`` (the default, the state itself): reverse passes then
    #: skip the saves' parameter cotangent (under vmap, one per member and per save)
    fn_reads_args: bool = True
    #: how many copies of each saved row a batching transform around the loop will carry (the
    #: forward-sensitivity adjoint's tangent directions); sizes the save buffer's chunks.
    lanes: int = 1


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


def _fill(tree, n, value=jnp.inf):
    return jax.tree.map(lambda x: jnp.full((n, *jnp.shape(x)), value, jnp.result_type(x)), tree)


def _set_row(buf, i, row):
    """``buf[i] = row`` leafwise; an index out of range drops the write."""
    return jax.tree.map(lambda b, r: b.at[i].set(r, mode="drop"), buf, row)


def rows_per_chunk(row, n: int, lanes: int = 1) -> int:
    """Rows per chunk of an ``n``-row save buffer of ``row``s, so that each chunk stays under
    ``tuning().small_buffer_bytes`` even with ``lanes`` batched copies; ``n`` means one chunk."""
    small, max_chunks = tuning().small_buffer_bytes, tuning().max_chunks
    leaf_bytes = [
        lanes * int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(row)
    ]
    widest = max(leaf_bytes, default=0)
    if n * widest <= small or widest > small // 2:
        return max(n, 1)  # already small, or rows too wide for chunks to help
    rows = small // widest
    return rows if -(-n // rows) <= max_chunks else max(n, 1)


def chunked_fill(row, n: int, rows: int, value=jnp.inf) -> tuple:
    """An ``n``-row buffer of ``row``s as a tuple of chunks of ``rows`` rows."""
    return tuple(_fill(row, min(rows, n - k), value) for k in range(0, n, rows))


def chunked_write(chunks: tuple, i, row, rows: int, valid=True) -> tuple:
    """``buffer[i] = row`` where ``valid``, for an in-range ``i`` (a dynamic-update-slice in one
    chunk; an invalid write rewrites the old row, cheaper on CPU than a dropped scatter)."""

    def write(c):
        def put(x, r):
            k = i - c * rows
            if valid is not True:
                r = jnp.where(valid, r, lax.dynamic_index_in_dim(x, k, 0, keepdims=False))
            return lax.dynamic_update_index_in_dim(x, r, k, 0)

        def branch(cs):
            return (*cs[:c], jax.tree.map(put, cs[c], row), *cs[c + 1 :])

        return branch

    if len(chunks) == 1:
        return write(0)(chunks)
    branches = [write(c) for c in range(len(chunks))]
    return lax.switch(jnp.minimum(i // rows, len(chunks) - 1), branches, chunks)


def chunked_join(chunks: tuple):
    """The buffer as one array per leaf."""
    if len(chunks) == 1:
        return chunks[0]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *chunks)


def _count_at_or_before(ts, t):
    """How many of the sorted save times ``ts`` are ``<= t``."""
    # one vectorised comparison, not a binary-search loop, for the usual few save times
    method = "compare_all" if ts.shape[0] <= 1024 else "scan"
    return jnp.searchsorted(ts, t, side="right", method=method)


def saves_in_step(ts, k, t_start, t_end):
    """Indices ``[j0, j1)`` of the save times in step ``k``, which spans ``(t_start, t_end]``
    (step 0 also holds ``t_start`` itself): the one rule every loop and reverse pass uses."""
    j0 = jnp.where(k == 0, 0, _count_at_or_before(ts, t_start))
    return j0, _count_at_or_before(ts, t_end)


def save_slots(grid, ts, n_steps: int):
    """For each step ``k`` of ``grid``: the first save index and how many save times fall in it.

    A save time belongs to the step ``(t_k, t_{k+1}]``; ``t0`` itself belongs to step 0.
    """
    k_of_save = jnp.clip(jnp.searchsorted(grid, ts, side="left") - 1, 0, n_steps - 1)
    ks = jnp.arange(n_steps)
    start = jnp.searchsorted(k_of_save, ks, side="left")
    count = jnp.searchsorted(k_of_save, ks, side="right") - start
    return start, count


def static_slot_count(grid, ts) -> int | None:
    """The largest number of save times in one step, when grid and ts are concrete."""
    try:
        g, s = np.asarray(grid), np.asarray(ts)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
    k = np.clip(np.searchsorted(g, s, side="left") - 1, 0, len(g) - 2)
    return max(int(np.bincount(k).max()) if k.size else 0, 1)


def save_in_step(plan: SavePlan, solver, args, t0, dt, dense, buf, j, j_end, rows):
    """Write the saves ``j <= i < j_end`` that fall in one step into ``buf`` (a while loop).

    ``buf`` is chunked by :func:`chunked_fill` with ``rows`` rows per chunk. ``t0``, ``dt`` and
    ``plan.ts`` are in forward time ``tau``.
    """
    ts = plan.ts

    def cond(c):
        return any_member(c[0] < j_end)

    def body(c):
        i, b = c
        # under vmap the loop runs for the member with the most saves here; the others write
        # their old row back and stay put
        valid = i < j_end
        k = jnp.minimum(i, ts.shape[0] - 1)
        theta = (ts[k] - t0) / dt
        val = plan.fn(ts[k], solver.interpolate(dense, theta), args)
        # k is in range: a dynamic-update-slice, much cheaper than a scatter on CPU
        return i + valid, chunked_write(b, k, val, rows, valid=valid)

    return lax.while_loop(cond, body, (j, buf))


def scan_loop(solver, f, args, grid, y0, plan: SavePlan, s=1.0, progress=None) -> LoopOutput:
    """Integrate over a grid (in ``tau``) of ``len(grid) - 1`` steps known at trace time."""
    n_steps = grid.shape[0] - 1
    t_real = grid if isinstance(s, float) and s == 1.0 else s * grid
    st0 = solver.init(f, t_real[0], y0, args)
    xs = {"t0": t_real[:-1], "t1": t_real[1:]}
    ts_buf, stacked = None, False
    if plan.ts is not None:
        n_ts = plan.ts.shape[0]
        row_bytes = tree_bytes(jax.eval_shape(lambda: (y0, st0)))
        stacked = n_steps * row_bytes * plan.lanes <= tuning().stacked_save_bytes
        if not stacked:
            xs["start"], xs["count"] = save_slots(grid, plan.ts, n_steps)
            row = jax.eval_shape(plan.fn, grid[0], y0, args)
            ts_rows = rows_per_chunk(row, n_ts, plan.lanes)
            ts_buf = chunked_fill(row, n_ts, ts_rows)

    def body(carry, x):
        y, st, buf = carry
        dt = x["t1"] - x["t0"]
        res = solver.step(f, x["t0"], dt, y, args, st)
        if buf is not None:
            for slot in range(plan.slots):
                i = jnp.minimum(x["start"] + slot, n_ts - 1)
                theta = (s * plan.ts[i] - x["t0"]) / dt
                val = plan.fn(plan.ts[i], solver.interpolate(res.dense, theta), args)
                buf = chunked_write(buf, i, val, ts_rows, valid=slot < x["count"])
        out = {}
        if stacked:
            out["start"] = (y, st)
        if plan.steps:
            out["y"] = plan.fn(s * x["t1"], res.y1, args)
        if plan.dense:
            out["dense"] = res.dense
        if res.evals is not None:  # solvers with a run-time stage count report it (stabilized.py)
            out["evals"] = res.evals
        return (res.y1, res.state, buf), out

    if progress is None:
        (y1, _, ts_buf), out = lax.scan(body, (y0, st0, ts_buf), xs)
    else:
        (y1, _, ts_buf), out = chunked_scan(body, (y0, st0, ts_buf), xs, n_steps, progress)
    if stacked:
        ts_buf = _saves_from_starts(solver, f, args, grid, t_real, s, plan, out.pop("start"))
    elif ts_buf is not None:
        ts_buf = chunked_join(ts_buf)
    # No per-step finiteness test (it would cost a pass over the state every step): a non-finite
    # value propagates to the end, and the saved rows locate where it first appeared, computed
    # only when the solve failed (see locate_failure).
    failed = ~tree_all_finite((y1, out.get("y"), ts_buf))
    n = jnp.asarray(n_steps)
    evals = solver.init_evals + (
        jnp.sum(out["evals"]) if "evals" in out else n_steps * solver.step_evals
    )
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


def _saves_from_starts(solver, f, args, grid, t_real, s, plan: SavePlan, starts):
    """The saves of a static grid, by re-taking (batched) the step that holds each save time
    from its stacked starting ``(y, solver state)``."""
    n_steps = grid.shape[0] - 1
    k = jnp.clip(jnp.searchsorted(grid, plan.ts, side="left") - 1, 0, n_steps - 1)

    def one(k_, tau):
        y, st = jax.tree.map(lambda a: a[k_], starts)
        t0, dt = t_real[k_], t_real[k_ + 1] - t_real[k_]
        dense = solver.step(f, t0, dt, y, args, st).dense
        return plan.fn(tau, solver.interpolate(dense, (s * tau - t0) / dt), args)

    return jax.vmap(one)(k, plan.ts)


def locate_failure(out: LoopOutput, grid, save_times):
    """Forward time and step of a failure: the while loop stops there; a static grid's scan runs
    on, and the first saved row holding a non-finite value locates it (the end otherwise)."""
    if out.fail_t is not None:
        return out.fail_t, out.fail_step
    first_bad, fail_t = _first_nonfinite(out.steps_ys, grid[1:], out.ts_ys, save_times)
    n_steps = grid.shape[0] - 1
    return (
        jnp.where(jnp.isfinite(fail_t), fail_t, grid[-1]),
        jnp.where(first_bad >= 0, first_bad, n_steps),
    )


def _first_nonfinite(steps_rows, step_times, ts_rows, save_times):
    """Index (or -1) and time (tau, or inf) of the first saved row holding a non-finite value."""
    if steps_rows is not None:
        rows, times, is_step = steps_rows, step_times, True
    elif ts_rows is not None:
        rows, times, is_step = ts_rows, save_times, False
    else:
        return jnp.asarray(-1), jnp.asarray(jnp.inf, step_times.dtype)
    ok = jax.vmap(tree_all_finite)(rows)
    first = jnp.argmin(ok)
    bad = ~ok[first]
    idx = jnp.where(bad & is_step, first, -1)
    return idx, jnp.where(bad, times[first], jnp.inf)


class RuntimeGrid(NamedTuple):
    """Steps fixed in advance, taken by the while loop: ``n`` equal steps over the span (a count
    known only at run time), or the points of ``grid`` (forward time) when given, which a solve
    with events steps through (an event ends a step early; the next one resumes the grid)."""

    n: Any
    grid: Any = None


def while_loop(
    solver,
    control,
    f,
    args,
    tau0,
    tau1,
    y0,
    plan: SavePlan,
    max_steps: int,
    record: str = "none",
    s=1.0,
    progress=None,
    record_rows: int | None = None,
    events: EventSet | None = None,
) -> LoopOutput:
    """Integrate from ``tau0`` to ``tau1 > tau0`` in one ``lax.while_loop``.

    ``control`` is an :class:`~odegrad.Adaptive` or a :class:`RuntimeGrid`. ``record`` keeps what
    an adjoint needs: ``"times"`` (every accepted step's start and size), ``"y"`` (also the
    starting state of every accepted step, or of the first ``record_rows``) or ``"all"`` (also
    its solver state). ``events``: see :mod:`odegrad._events`; with a record, each step also
    records the event log row it ended with (``-1``: none) and where in the step (``theta``).
    """
    tdtype = jnp.result_type(tau0)
    adaptive = not isinstance(control, RuntimeGrid)
    st0 = solver.init(f, s * tau0, y0, args)
    span = tau1 - tau0
    if adaptive:
        f0 = st0 if jax.tree.structure(st0) == jax.tree.structure(y0) else f(s * tau0, y0, args)
        f0 = jax.tree.map(lambda d: s * d, f0)
        f_tau = lambda tau, y, a: jax.tree.map(lambda d: s * d, f(s * tau, y, a))
        order = solver.embedded_order + 1 if solver.embedded_order is not None else solver.order
        h0 = lax.stop_gradient(control.initial_step(f_tau, tau0, y0, f0, args, order, span))
        init_evals = solver.init_evals + (0 if control.dt0 is not None else 1)
    else:
        h0 = span / control.n
        init_evals = solver.init_evals
    eps = jnp.finfo(tdtype).eps
    floor = 4 * eps * jnp.maximum(jnp.abs(tau0), jnp.abs(tau1))
    if adaptive and control.dtmin is not None:
        floor = jnp.maximum(floor, control.dtmin)

    c = {
        "t": tau0,
        "y": y0,
        "st": st0,
        "h": jnp.asarray(h0, tdtype),
        "ratio_prev": jnp.asarray(1.0, tdtype),
        "n": jnp.asarray(0),
        "acc": jnp.asarray(0),
        "evals": jnp.asarray(0),  # rhs evaluations of all attempted steps
        "result": jnp.asarray(int(Result.success), jnp.int32),
    }
    if not adaptive:
        c["grid_k"] = jnp.asarray(1)  # the grid point the next step aims at
    if events is not None:
        n_ev = events.max_events
        c["ev_c"] = events.values(s * tau0, y0, args)
        c["ev_ts"] = jnp.full((n_ev,), jnp.inf, tdtype)
        c["ev_which"] = jnp.full((n_ev,), -1, jnp.int32)
        c["ev_ys"] = _fill(y0, n_ev)
        c["ev_count"] = jnp.asarray(0)
        c["done"] = jnp.asarray(False)  # a terminal event fired
    if plan.ts is not None:
        n_ts = plan.ts.shape[0]
        row = jax.eval_shape(plan.fn, tau0, y0, args)
        ts_rows = rows_per_chunk(row, n_ts, plan.lanes)
        c["ts_buf"] = chunked_fill(row, n_ts, ts_rows)
        c["j"] = jnp.asarray(0)
    if plan.steps:
        c["steps_t"] = jnp.full((max_steps,), jnp.inf, tdtype)
        c["steps_y"] = _fill(jax.eval_shape(plan.fn, tau0, y0, args), max_steps)
    if plan.dense or record != "none":
        c["starts"] = jnp.full((max_steps + 1,), jnp.inf, tdtype).at[0].set(tau0)
        c["sizes"] = jnp.ones((max_steps,), tdtype)
    if plan.dense:
        dense_shape = jax.eval_shape(
            lambda: solver.step(f, s * tau0, jnp.asarray(s, tdtype), y0, args, st0).dense
        )
        c["dense"] = _fill(dense_shape, max_steps, 0.0)
    if plan.accumulate is not None:
        c["acc_sum"] = jax.tree.map(
            jnp.zeros_like,
            jax.eval_shape(
                lambda: plan.accumulate(
                    s * tau0,
                    jnp.asarray(s, tdtype),
                    solver.step(f, s * tau0, jnp.asarray(s, tdtype), y0, args, st0).dense,
                    args,
                )
            ),
        )
    rows = max_steps if record_rows is None else min(record_rows, max_steps)
    if record in ("y", "all"):
        c["rec_y"] = _fill(y0, rows, 0.0)
    if record == "all":
        c["rec_st"] = _fill(solver.compact_state(st0), rows, 0.0)
    if events is not None and record != "none":
        c["rec_ev"] = jnp.full((max_steps,), -1, jnp.int32)
        c["rec_theta"] = jnp.ones((max_steps,), tdtype)
    if progress is not None:
        c["reported"] = jnp.asarray(-1, jnp.int32)

    def running(c):
        go = (c["t"] < tau1) & (c["result"] == Result.success) & (c["n"] < max_steps)
        return go if events is None else go & ~c["done"]

    def target(k):
        """The grid point a fixed step aims at."""
        if control.grid is not None:
            return jnp.where(k >= control.n, tau1, control.grid[jnp.minimum(k, control.n)])
        return jnp.where(k >= control.n, tau1, tau0 + k * h0)

    # Under vmap the loop runs while any member runs (an unbatched predicate), and a finished
    # member's body changes nothing: a batched predicate would make JAX select between the old
    # and the new carry, every buffer of max_steps rows included, on every step.
    def cond(c):
        return any_member(running(c))

    def body(c):
        t, y, st = c["t"], c["y"], c["st"]
        active = running(c)
        remaining = tau1 - t
        if adaptive:
            cap = solver.max_step(st)  # a solver's stable step limit (stabilized.py), or None
            h = jnp.minimum(c["h"] if cap is None else jnp.minimum(c["h"], cap), remaining)
        else:
            h = jnp.where(c["grid_k"] >= control.n, remaining, target(c["grid_k"]) - t)
        last = h >= remaining
        res = solver.step(f, s * t, s * h, y, args, st)
        finite = tree_all_finite(res.y1)
        if adaptive:
            decision = adapt_step(
                control,
                res.error,
                y,
                res.y1,
                finite,
                h,
                c["ratio_prev"],
                solver.embedded_order,
                solver.prev_ratio_floor,
                floor,
            )
            accept = decision.accept & active
            h_next = jnp.where((accept & last) | ~active, c["h"], decision.h_next)
            ratio_prev = jnp.where(active, decision.ratio, c["ratio_prev"])
        else:
            accept = finite & active
            h_next, ratio_prev = c["h"], c["ratio_prev"]
        t_new = jnp.where(last, tau1, t + h)
        y1, st1 = res.y1, res.state
        new = dict(c)
        if events is not None:
            ev = step_events(
                events, solver, f, args, s, t, h, t_new, res, c["ev_c"], c["ev_count"], accept
            )
            accept = accept & ~ev.overflow
            t_new = jnp.where(ev.fired, ev.tau, t_new)
            y1 = tree_where(ev.fired, ev.y_plus, y1)
            st1 = tree_where(ev.fired, ev.state, st1)
            row = jnp.where(ev.fired, c["ev_count"], n_ev)  # out of range: no write
            new["ev_ts"] = c["ev_ts"].at[row].set(ev.t_star, mode="drop")
            new["ev_which"] = c["ev_which"].at[row].set(ev.which, mode="drop")
            new["ev_ys"] = _set_row(c["ev_ys"], row, ev.y_minus)
            new["ev_count"] = c["ev_count"] + ev.fired
            new["ev_c"] = jnp.where(accept, ev.values, c["ev_c"])
            new["done"] = c["done"] | (ev.fired & ev.terminal)
            saved_y = tree_where(ev.fired, ev.y_minus, res.y1)
        else:
            saved_y = res.y1
        if not adaptive:
            # an event ends a step early (the next resumes the grid) unless it fell on its end
            on_grid = accept if events is None else accept & ~(ev.fired & (ev.theta < 1))
            new["grid_k"] = c["grid_k"] + on_grid
        acc = c["acc"]
        drop = jnp.where(accept, acc, max_steps)  # row index, out of range when rejected
        if plan.ts is not None:
            j_end = jnp.where(accept, _count_at_or_before(plan.ts, t_new), c["j"])
            new["j"], new["ts_buf"] = save_in_step(
                plan, solver, args, t, h, res.dense, c["ts_buf"], c["j"], j_end, ts_rows
            )
        if plan.steps:
            new["steps_t"] = c["steps_t"].at[drop].set(t_new, mode="drop")
            new["steps_y"] = _set_row(c["steps_y"], drop, plan.fn(t_new, saved_y, args))
        if "starts" in c:
            new["starts"] = (
                c["starts"].at[jnp.where(accept, acc + 1, max_steps + 1)].set(t_new, mode="drop")
            )
            new["sizes"] = c["sizes"].at[drop].set(h, mode="drop")
        if plan.dense:
            new["dense"] = _set_row(c["dense"], drop, res.dense)
        if plan.accumulate is not None:
            contrib = plan.accumulate(s * t, s * h, res.dense, args)
            new["acc_sum"] = jax.tree.map(
                lambda a, b: a + jnp.where(accept, b, 0), c["acc_sum"], contrib
            )
        if "rec_y" in c:
            new["rec_y"] = _set_row(c["rec_y"], drop, y)
        if "rec_st" in c:
            new["rec_st"] = _set_row(c["rec_st"], drop, solver.compact_state(st))
        if "rec_ev" in c:
            new["rec_ev"] = c["rec_ev"].at[drop].set(jnp.where(ev.fired, row, -1), mode="drop")
            new["rec_theta"] = c["rec_theta"].at[drop].set(ev.theta, mode="drop")
        new["t"] = jnp.where(accept, t_new, t)
        new["y"] = tree_where(accept, y1, y)
        new["st"] = tree_where(accept, st1, st)
        new["h"] = h_next
        new["ratio_prev"] = ratio_prev
        new["n"] = c["n"] + active
        new["acc"] = acc + accept.astype(acc.dtype)
        evals = solver.step_evals if res.evals is None else res.evals
        if events is not None:  # the solver restarts after a jump (FSAL: one evaluation)
            evals = evals + jnp.where(ev.fired & ~ev.terminal, solver.init_evals, 0)
        new["evals"] = c["evals"] + jnp.where(active, evals, 0)
        if adaptive:
            underflow = active & decision.underflow
            failure = jnp.where(finite, Result.step_size_underflow, Result.nonfinite)
        else:
            underflow = active & ~accept
            failure = jnp.asarray(Result.nonfinite)
        if events is not None:
            underflow = underflow | ev.overflow
            failure = jnp.where(ev.overflow, Result.max_events_reached, failure)
        new["result"] = jnp.where(underflow, failure, c["result"]).astype(jnp.int32)
        if progress is not None:
            new["reported"] = progress.forward.advance((new["t"] - tau0) / span, c["reported"])
        return new

    c = lax.while_loop(cond, body, c)
    unfinished = (c["result"] == Result.success) & (c["t"] < tau1)
    t1 = c["t"]
    log = None
    if events is not None:
        unfinished = unfinished & ~c["done"]
        log = EventLog(c["ev_ts"], c["ev_which"], c["ev_ys"], c["ev_count"])
        # a terminal event's time, differentiable (the carried time is a constant)
        last = c["ev_ts"][jnp.maximum(c["ev_count"] - 1, 0)]
        t1 = jnp.where(c["done"], s * last, t1)
    result = jnp.where(unfinished, Result.max_steps_reached, c["result"]).astype(jnp.int32)
    stats = {
        "steps": c["n"],
        "accepted": c["acc"],
        "rejected": c["n"] - c["acc"],
        "rhs_evals": init_evals + c["evals"],
    }
    dense = None
    if plan.dense:
        dense = (c["starts"][:-1], c["sizes"], c["dense"], c["acc"])
    rec = {}
    if record != "none":
        rec = {"starts": c["starts"], "sizes": c["sizes"], "n": c["acc"]}
    if "rec_y" in c:
        rec["y"] = c["rec_y"]
    if "rec_st" in c:
        rec["st"] = c["rec_st"]
    if "rec_ev" in c:
        rec["ev"], rec["theta"] = c["rec_ev"], c["rec_theta"]
    return LoopOutput(
        y1=c["y"],
        t1=t1,
        ts_ys=None if plan.ts is None else chunked_join(c["ts_buf"]),
        steps_ts=c.get("steps_t"),
        steps_ys=c.get("steps_y"),
        dense=dense,
        stats=stats,
        result=result,
        fail_t=c["t"],
        fail_step=c["n"],
        record=rec,
        accumulated=c.get("acc_sum"),
        events=log,
    )


def dense_evaluate(solver, dense, tau, side: str = "right", toward=None):
    """The state at forward time ``tau`` from a loop's dense output ``(starts, sizes, data, n)``.

    At a step boundary it reads the step that starts there (``side="right"``) or ends there
    (``"left"``: the state just before an event's jump); with ``toward``, the step on the side
    of that time (an integration over an interval passes its midpoint)."""
    starts, sizes, data, n = dense
    if toward is None:
        k = jnp.searchsorted(starts, tau, side=side) - 1
    else:
        k = (
            jnp.where(
                toward < tau,
                jnp.searchsorted(starts, tau, side="left"),
                jnp.searchsorted(starts, tau, side="right"),
            )
            - 1
        )
    k = jnp.clip(k, 0, n - 1)
    theta = (tau - starts[k]) / sizes[k]
    return solver.interpolate(jax.tree.map(lambda x: x[k], data), theta)
