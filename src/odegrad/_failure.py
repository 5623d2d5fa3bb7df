"""Where a failed solve failed: the step and time a checked loop stopped at, else the first
saved row holding a non-finite value (:func:`locate_failure`), on the device or, member by
member, on the host (the error's callback)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._tree import tree_all_finite

#: how :func:`locate_failure` located a failure: where the loop stopped (or the first saved step
#: holding a non-finite value), at the first save time holding one, or only at the end
AT_STEP, AT_SAVE, AT_END = 0, 1, 2


def locate_failure(out, grid, save_times, tau0=None, xp=jnp):
    """``(tau, step, how)`` of a failure of the loop whose output (a
    :class:`~odegrad._loop.LoopOutput`) is ``out``, as a checked while loop reports where it
    stopped: the failing step's start and its number (from 1). Else (a static grid's scan, an
    unchecked while loop, see :func:`~odegrad._loop.checks_each_step`) the first saved step
    holding a non-finite value gives them, or the first save time holding one (its step is not
    known: -1), or the end of what ran; ``how`` says which (``AT_STEP``, ``AT_SAVE``,
    ``AT_END``). ``grid``: the static grid, or None; ``tau0``: the start (for a step that
    failed first). ``xp=np`` locates one member on the host, from NumPy arrays (the error's
    callback: reductions traced into the program cost XLA:CPU ~30 ms of compile time each, even
    in a branch that never runs)."""
    if out.fail_t is not None:
        return out.fail_t, out.fail_step, xp.asarray(AT_STEP)
    if grid is not None:
        step_ends, end_t, end_step, tau0 = grid[1:], grid[-1], grid.shape[0] - 1, grid[0]
    else:  # (rows past the last step hold inf times)
        step_ends, end_t, end_step = out.steps_ts, out.t1, out.stats["steps"]
    first_bad, fail_t = _first_nonfinite(out.steps_ys, step_ends, out.ts_ys, save_times, end_t, xp)
    found, at_step = xp.isfinite(fail_t), first_bad >= 0
    if out.steps_ys is not None:  # the step that made the row: its start
        fail_t = xp.where(first_bad > 0, step_ends[xp.maximum(first_bad - 1, 0)], tau0)
    how = xp.where(found, xp.where(at_step, AT_STEP, AT_SAVE), AT_END)
    return (
        xp.where(found, fail_t, end_t),
        xp.where(at_step, first_bad + 1, xp.where(found, -1, end_step)),
        how,
    )


def _first_nonfinite(steps_rows, step_times, ts_rows, save_times, end_t, xp):
    """Index (or -1) and time (tau, or inf) of the first saved row, among those at or before
    ``end_t``, holding a non-finite value."""
    none = xp.asarray(-1), xp.asarray(xp.inf, xp.asarray(end_t).dtype)
    if steps_rows is not None:
        rows, times, is_step = steps_rows, step_times, True
    elif ts_rows is not None:
        rows, times, is_step = ts_rows, save_times, False
    else:
        return none
    if xp is jnp:
        finite = jax.vmap(tree_all_finite)(rows)
    else:
        finite = np.logical_and.reduce(
            [np.isfinite(x).reshape(len(x), -1).all(1) for x in jax.tree.leaves(rows)]
        )
    bad = ~finite & (times <= end_t)
    if xp is np and not bad.any():
        return none
    first = xp.argmax(bad)
    found = bad[first]
    idx = xp.where(found & is_step, first, -1)
    return idx, xp.where(found, times[first], xp.inf)
