"""Saving: what a solve stores, where in the loop each saved value is computed, and how the rows
become ``sol.ts`` / ``sol.ys``.

* :class:`SavePlan` — the normalised :class:`~odegrad.SaveAt`, in forward time ``tau``.
* :func:`saves_in_step` — the one rule for which save times a step holds: step ``k`` spans
  ``(t_k, t_{k+1}]``, and step 0 also holds ``t0``.
* :func:`saved_value` — the one function computing a saved value from a step's dense output;
  the loops call it and the reverse passes differentiate it.
* Save buffers are chunked (:func:`chunked_fill`): XLA:CPU runs a loop body back to back only
  while every buffer it touches is small (see ``Tuning.small_buffer_bytes``).
* :class:`SaveAtTimes` and :class:`SaveSteps` record saves in the while loop;
  :class:`ScanSaves` in the scan over a static grid; :func:`assemble` makes ``sol.ts/ys``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._batching import any_member
from ._recorders import Recorder
from ._tree import tree_bytes, tree_fill_rows, tree_set_row, tree_size
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
    #: False when ``fn`` ignores ``args`` (the default, the state itself): reverse passes then
    #: skip the saves' parameter cotangent (under vmap, one per member and per save)
    fn_reads_args: bool = True
    #: ``fn`` returns the state itself (no ``SaveAt(fn=...)``)
    fn_is_state: bool = False
    #: how many copies of each saved row a batching transform around the loop will carry (the
    #: forward-sensitivity adjoint's tangent directions); sizes the save buffer's chunks.
    lanes: int = 1


def saved_value(plan: SavePlan, solver, dense, i, start, size, args):
    """Save ``i``: ``plan.fn`` of the state at ``plan.ts[i]`` read from the dense output of the
    step that holds it, which starts at ``start`` and has size ``size`` (forward time)."""
    tau = plan.ts[i]
    return plan.fn(tau, solver.interpolate(dense, (tau - start) / size), args)


# -- which step holds which save
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


def saves_gathered(n_saves: int, y0) -> int:
    """How many saves a loop iteration handles together (at most ``n_saves``): up to
    ``Tuning.saves_gathered``, fewer for a large state, whose saved values it holds at once."""
    t = tuning()
    return int(max(1, min(n_saves, t.saves_gathered, t.save_gather_entries // tree_size(y0))))


def step_of_save(grid, ts):
    """For each save time, the step of ``grid`` that holds it: the inverse of
    :func:`saves_in_step` (a save on a grid point ends the step before it)."""
    n_steps = grid.shape[0] - 1
    return jnp.clip(jnp.searchsorted(grid, ts, side="left") - 1, 0, n_steps - 1)


def save_slots(grid, ts):
    """For each step ``k`` of ``grid``: the first save index and how many save times fall in it."""
    j0, j1 = saves_in_step(ts, jnp.arange(grid.shape[0] - 1), grid[:-1], grid[1:])
    return j0, j1 - j0


def static_slot_count(grid, ts) -> int | None:
    """The largest number of save times in one step, when grid and ts are concrete."""
    try:
        g, s = np.asarray(grid), np.asarray(ts)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
    # step_of_save's rule in numpy: jnp would be staged into an enclosing jit
    k = np.clip(np.searchsorted(g, s, side="left") - 1, 0, len(g) - 2)
    return max(int(np.bincount(k).max()) if k.size else 0, 1)


# -- chunked save buffers
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
    return tuple(tree_fill_rows(row, min(rows, n - k), value) for k in range(0, n, rows))


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


def _ts_buffer(plan: SavePlan, tau0, y0, args) -> tuple:
    """The chunked buffer of the saves at ``plan.ts``."""
    n_ts = plan.ts.shape[0]
    row = jax.eval_shape(plan.fn, tau0, y0, args)
    return chunked_fill(row, n_ts, rows_per_chunk(row, n_ts, plan.lanes))


def _chunk_rows(chunks: tuple) -> int:
    """Rows per chunk of a buffer from :func:`chunked_fill` (its first chunk is full)."""
    leaves = jax.tree.leaves(chunks[0])
    return leaves[0].shape[0] if leaves else 1


# -- the while loop's save recorders
@dataclass(frozen=True)
class SaveAtTimes(Recorder):
    """The saves at ``plan.ts``: after each accepted step, those it holds, from its dense output."""

    plan: SavePlan

    def init(self, setup):
        return jnp.asarray(0), _ts_buffer(self.plan, setup.tau0, setup.y0, setup.args)

    def update(self, state, step, setup):
        plan, (j, buf) = self.plan, state
        ts = plan.ts
        j_end = jnp.where(step.accept, _count_at_or_before(ts, step.t_new), j)
        rows = _chunk_rows(buf)

        # under vmap the loop runs for the member with the most saves here; the others write
        # their old row back and stay put
        def body(c):
            i, b = c
            valid = i < j_end
            k = jnp.minimum(i, ts.shape[0] - 1)
            val = saved_value(plan, setup.solver, step.res.dense, k, step.t, step.h, setup.args)
            # k is in range: a dynamic-update-slice, much cheaper than a scatter on CPU
            return i + valid, chunked_write(b, k, val, rows, valid=valid)

        return lax.while_loop(lambda c: any_member(c[0] < j_end), body, (j, buf))

    def finish(self, state, final):
        return {"ts_ys": chunked_join(state[1])}


@dataclass(frozen=True)
class SaveSteps(Recorder):
    """A save at the end of every accepted step (before an event's jump there)."""

    plan: SavePlan

    def init(self, setup):
        row = jax.eval_shape(self.plan.fn, setup.tau0, setup.y0, setup.args)
        n = setup.max_steps
        return jnp.full((n,), jnp.inf, setup.tdtype), tree_fill_rows(row, n)

    def update(self, state, step, setup):
        ts, ys = state
        row = self.plan.fn(step.t_new, step.y_end, setup.args)
        return ts.at[step.row].set(step.t_new, mode="drop"), tree_set_row(ys, step.row, row)

    def finish(self, state, final):
        return {"steps_ts": state[0], "steps_ys": state[1]}


# -- the scan's saves
@dataclass(frozen=True)
class ScanSaves:
    """The saves at ``plan.ts`` of a scan over a static grid (forward time ``tau``).

    While the stack of every step's starting ``(y, solver state)`` is small
    (``Tuning.stacked_save_bytes``), the scan only stacks those and the saves are computed after
    it by re-taking (batched) the step that holds each: the loop body stays one fused kernel.
    Otherwise each step writes its ``plan.slots`` saves into a chunked buffer in the carry.
    """

    plan: SavePlan
    grid: Any
    stacked: bool

    @staticmethod
    def make(plan: SavePlan, grid, y0, st0) -> ScanSaves | None:
        if plan.ts is None:
            return None
        n_steps = grid.shape[0] - 1
        row_bytes = tree_bytes(jax.eval_shape(lambda: (y0, st0)))
        stacked = n_steps * row_bytes * plan.lanes <= tuning().stacked_save_bytes
        return ScanSaves(plan, grid, stacked)

    def xs(self) -> dict:
        """Per-step inputs of the scan: the first save of each step and how many it holds."""
        if self.stacked:
            return {}
        start, count = save_slots(self.grid, self.plan.ts)
        return {"start": start, "count": count}

    def init(self, tau0, y0, args):
        return None if self.stacked else _ts_buffer(self.plan, tau0, y0, args)

    def update(self, buf, x, step, solver, args, out: dict):
        """After ``step``, the solver's step from ``(y, st)`` over ``x`` (the step's row of
        :meth:`xs`, ``start`` and ``size`` in forward time): its saves into ``buf``, or its
        start onto ``out``'s stack."""
        y, st, dense, start, size = step
        if self.stacked:
            out["start"] = (y, st)
            return buf
        plan, rows = self.plan, _chunk_rows(buf)
        for slot in range(plan.slots):
            i = jnp.minimum(x["start"] + slot, plan.ts.shape[0] - 1)
            val = saved_value(plan, solver, dense, i, start, size, args)
            buf = chunked_write(buf, i, val, rows, valid=slot < x["count"])
        return buf

    def finish(self, buf, out: dict, solver, args, step_dense):
        """The saves: from the buffer, or by re-taking each save's step from the stacked starts
        (``step_dense(k, y, st)``: step ``k``'s dense output)."""
        if not self.stacked:
            return chunked_join(buf)
        starts, grid, plan = out.pop("start"), self.grid, self.plan

        def one(i, k):
            y, st = jax.tree.map(lambda a: a[k], starts)
            size = grid[k + 1] - grid[k]
            return saved_value(plan, solver, step_dense(k, y, st), i, grid[k], size, args)

        return jax.vmap(one)(jnp.arange(plan.ts.shape[0]), step_of_save(grid, plan.ts))


# -- sol.ts / sol.ys
def assemble(saveat, plan: SavePlan, s, t0, tau0, y0, args, out) -> tuple:
    """``(sol.ts, sol.ys)`` in real time: rows at ``t0``, then ``ts`` (or every step, ``inf``
    after the last), then the end, as ``saveat`` asks; ``(None, None)`` when it saves no rows.
    ``out``: the loop's output."""
    fn = plan.fn
    ts_rows, ys_rows = [], []
    if saveat.t0:
        ts_rows.append(t0[None])
        ys_rows.append(jax.tree.map(lambda x: x[None], fn(tau0, y0, args)))
    if plan.ts is not None:
        ts_rows.append(s * plan.ts)
        ys_rows.append(out.ts_ys)
    if saveat.steps:
        # rows after the last step hold inf in forward time; keep them +inf after the flip
        ts_rows.append(jnp.where(jnp.isfinite(out.steps_ts), s * out.steps_ts, jnp.inf))
        ys_rows.append(out.steps_ys)
    if saveat.t1:
        ts_rows.append((s * out.t1)[None])
        ys_rows.append(jax.tree.map(lambda x: x[None], fn(out.t1, out.y1, args)))
    if not ts_rows:
        return None, None
    ys = jax.tree.map(lambda *rows: jnp.concatenate(rows), *ys_rows)
    return jnp.concatenate(ts_rows), ys
