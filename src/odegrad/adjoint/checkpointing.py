"""Reverse a chain of steps under a memory bound: binomial checkpointing (revolve).

:func:`reverse_steps` runs ``backward(k, x_k, adjoint)`` for ``k = n-1, ..., 0``, where the states
``x_k`` come from ``x_0`` by ``advance``. It keeps at most ``slots`` states and recomputes the
rest. Each time it must split an unreversed range of ``l`` steps while ``s`` slots are free
besides the range's first state, it advances by the split of revolve (:func:`binomial_advance`),
which reverses ``l`` steps in the fewest forward steps any schedule takes,
``t l - beta(s + 2, t - 1)`` with ``t`` the least integer such that
``beta(s + 1, t) = C(s + 1 + t, t) >= l`` (:func:`revolve_steps`; A. Griewank and A. Walther,
"Algorithm 799: revolve", ACM TOMS 26, 2000).

``n`` may be a traced integer, so the same schedule serves step counts known only at run time
(adaptive solves record their step sizes and replay them here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._batching import max_member, member_where

PyTree = Any


def _sweeps(length, free):
    """``(lf, snaps, r, range)``: the float length, ``snaps = free + 1`` (at most ``length + 1``),
    and the least ``r`` with ``range = beta(snaps, r) = C(snaps + r, r) >= length``, by the
    recurrence ``beta(snaps, r) = beta(snaps, r - 1) (snaps + r) / r`` (each division exact, up to
    rounding; float32 is exact below 2^24)."""
    lf = jnp.asarray(length).astype(jnp.float32)
    snaps = jnp.minimum(jnp.asarray(free).astype(jnp.float32), lf) + 1.0

    def grow(c):
        r, rng = c
        return r + 1.0, jnp.round(rng * (r + 1.0 + snaps) / (r + 1.0))

    r, rng = lax.while_loop(lambda c: c[1] < lf, grow, (jnp.float32(0), jnp.float32(1)))
    return lf, snaps, r, rng


def revolve_steps(length, free):
    """The fewest forward steps that reverse ``length`` steps with ``free`` slots besides the
    first state, ``r length - beta(free + 2, r - 1)`` with ``r`` as in :func:`_sweeps` (Griewank
    and Walther), which :func:`reverse_steps` takes."""
    lf, snaps, r, rng = _sweeps(length, free)
    return r * lf - jnp.round(rng * r / (snaps + 1.0))  # C(snaps + r, r - 1)


def binomial_advance(length, free):
    """How far to advance before taking a checkpoint: revolve's split of ``length`` steps with
    ``free`` slots besides the first state, which takes the fewest forward steps (Griewank and
    Walther's Algorithm 799, its ``advance`` decision, with ``snaps = free + 1``). With ``r``
    and ``range = beta(snaps, r)`` as in :func:`_sweeps`, ``b1 = beta(snaps, r - 1)``,
    ``b2 = beta(snaps - 1, r - 1)``, ``b3 = beta(snaps - 2, r - 1)``, ``b4 = beta(snaps, r - 2)``,
    ``b5 = beta(snaps - 3, r)``: ``b4`` if ``length <= b1 + b3``, ``b1`` if
    ``length >= range - b5``, else ``length - b2 - b3`` (near optimal beyond 2^24 steps; any
    split in ``[1, length - 1]`` reverses correctly)."""
    length = jnp.asarray(length)
    lf, snaps, r, rng = _sweeps(length, free)
    # binomial identities: each division is exact, up to rounding
    div = lambda a, b: jnp.round(a / jnp.maximum(b, 1.0))
    b1 = div(rng * r, snaps + r)
    b2 = jnp.where(snaps > 1, div(b1 * snaps, snaps + r - 1), 1.0)
    b3 = jnp.where(snaps == 1, 0.0, jnp.where(snaps > 2, div(b2 * (snaps - 1), snaps + r - 2), 1.0))
    b4 = div(b2 * (r - 1), snaps)
    b5 = jnp.where(snaps < 3, 0.0, jnp.where(snaps > 3, div(b3 * (snaps - 2), r), 1.0))
    adv = jnp.where(lf <= b1 + b3, b4, jnp.where(lf >= rng - b5, b1, lf - b2 - b3))
    return jnp.clip(adv.astype(length.dtype), 1, jnp.maximum(length - 1, 1))


def reverse_steps(
    advance: Callable[[Any, PyTree], PyTree],
    backward: Callable[[Any, PyTree, PyTree], PyTree],
    n,
    x0: PyTree,
    adjoint: PyTree,
    slots: int,
    stored: tuple[PyTree, Any] | None = None,
    prefix: PyTree | None = None,
) -> PyTree:
    """Run ``backward`` over steps ``n-1 .. 0`` keeping at most ``slots`` states.

    Args:
        advance: ``advance(k, x_k) -> x_{k+1}``.
        backward: ``backward(k, x_k, adjoint) -> adjoint``.
        n: number of steps (int or traced int).
        x0: the state before step 0.
        adjoint: the adjoint after the last step.
        slots: checkpoint slots, including the one holding ``x0`` (>= 1).
        stored: optionally ``(buffer, count)``: states ``x_0 .. x_{count-1}`` already kept by the
            forward pass in a buffer with ``slots`` rows, so no recomputation is needed.
        prefix: optionally a buffer with ``slots`` rows whose first ``min(n, slots)`` rows the
            forward pass filled with ``x_0, x_1, ...``: when ``n <= slots`` (known at run time)
            they are the checkpoints and nothing is recomputed. A short tail past them, whose
            ``l = n - slots + 1`` steps re-taken from the last kept state cost ``l (l - 1) / 2``
            steps, no more than the schedule below (:func:`revolve_steps`), is reversed that
            way, then the kept states. Otherwise the schedule starts from ``x_0`` with the
            buffer as its workspace (no separate allocation).

    Returns:
        The adjoint before step 0.
    """
    n_own = jnp.asarray(n, jnp.int32)
    # Under vmap every member follows the schedule of the longest one (unbatched control flow:
    # no cond runs both branches, no loop selects the whole carry); a member's steps past its
    # own count leave its state and adjoint as they are.
    n = max_member(n_own)
    _advance, _backward = advance, backward

    def advance(k, x):
        return member_where(k < n_own, _advance(k, x), x)

    def backward(k, x, adj):
        return member_where(k < n_own, _backward(k, x, adj), adj)

    def sweep(buf, adj, count, top=None):
        # steps top, top - 1, ... (default n - 1) whose states are kept: a plain reverse sweep
        # reading a loop-invariant buffer
        top = n - 1 if top is None else top

        def one(j, adj):
            k = top - j
            return backward(k, jax.tree.map(lambda b: b[jnp.clip(k, 0, n_own - 1)], buf), adj)

        return lax.fori_loop(0, count, one, adj)

    def advance_to(k_from, k_to, x):
        return lax.fori_loop(k_from, k_to, lambda k, xk: advance(k, xk), x)

    fine = n
    if stored is not None:
        return sweep(stored[0], adjoint, n)
    if prefix is not None:
        # Each path below runs with a zero count unless taken (not a cond between them, which
        # would copy the buffer). All n states kept: a plain sweep over them.
        full = n <= slots
        adjoint = sweep(prefix, adjoint, jnp.where(full, n, 0))
        # A short tail past the kept states: each of its states re-taken from the last kept
        # one, then the kept ones swept (96^3 ROCK2, 13 adaptive steps, 12 slots: the restart
        # below re-took every step, 23 % of the gradient)
        tail = n - slots + 1
        tail_f = tail.astype(jnp.float32)  # (int32 would overflow l (l - 1) / 2)
        short = ~full & (tail_f * (tail_f - 1) / 2 <= revolve_steps(n, slots - 1))
        last = jax.tree.map(lambda b: b[slots - 1], prefix)

        def tail_step(j, adj):
            k = n - 1 - j
            return backward(k, advance_to(slots - 1, k, last), adj)

        adjoint = lax.fori_loop(0, jnp.where(short, tail, 0), tail_step, adjoint)
        adjoint = sweep(prefix, adjoint, jnp.where(short, slots - 1, 0), top=slots - 2)
        # otherwise the schedule starts from x0 alone, the buffer's other rows free workspace
        fine = jnp.where(full | short, 0, n)
        buf = prefix
        height, pos = jnp.asarray(1, jnp.int32), jnp.zeros((slots,), jnp.int32)
        cur, x = jnp.asarray(0, jnp.int32), x0
    else:
        buf = jax.tree.map(lambda x: jnp.zeros((slots, *jnp.shape(x)), jnp.result_type(x)), x0)
        buf = jax.tree.map(lambda b, x: b.at[0].set(x), buf, x0)
        height, pos = jnp.asarray(1, jnp.int32), jnp.zeros((slots,), jnp.int32)
        cur, x = jnp.asarray(0, jnp.int32), x0
    carry = {
        "buf": buf,
        "pos": pos,
        "height": height,
        "x": x,
        "cur": cur,
        "fine": fine,
        "adj": adjoint,
    }

    # The branches see only small values; the checkpoint buffer is read and written outside the
    # conditional so that XLA updates it in place instead of copying it every iteration.
    def step_back(small):
        x, cur, _, adj, _ = small
        return x, cur, cur, backward(cur, x, adj), jnp.asarray(False)

    def move_forward(small):
        x, cur, fine, adj, free = small
        length = fine - cur
        target = jnp.where(free > 0, cur + binomial_advance(length, free), fine - 1)
        return advance_to(cur, target, x), target, fine, adj, free > 0

    def body(c):
        free = slots - c["height"]
        small = (c["x"], c["cur"], c["fine"], c["adj"], free)
        back = c["fine"] - c["cur"] == 1
        x, cur, fine, adj, push = lax.cond(back, step_back, move_forward, small)
        # push the new checkpoint (an out-of-range index writes nothing)
        idx = jnp.where(push, c["height"], slots)
        buf = jax.tree.map(lambda b, xi: b.at[idx].set(xi, mode="drop"), c["buf"], x)
        pos = c["pos"].at[idx].set(cur, mode="drop")
        height = c["height"] + push.astype(jnp.int32)
        # after a reverse step: drop the checkpoint at `fine`, restore from the top one
        drop = back & (pos[height - 1] >= fine)
        height = jnp.maximum(jnp.where(drop, height - 1, height), 1)
        top = height - 1
        x = jax.tree.map(lambda b, xi: jnp.where(back, b[top], xi), buf, x)
        cur = jnp.where(back, pos[top], cur)
        return {
            "buf": buf,
            "pos": pos,
            "height": height,
            "x": x,
            "cur": cur,
            "fine": fine,
            "adj": adj,
        }

    carry = lax.while_loop(lambda c: c["fine"] > 0, body, carry)
    return carry["adj"]
