"""The earliest zero crossing of several event functions in one step, by one bracketing search."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._batching import any_member

#: Illinois iterations at most; each halves the bracket at worst, and it converges
#: superlinearly on a smooth ``cond``, so 64 reach the roundoff of ``theta``.
ROOT_MAX_ITERATIONS = 64


def common_root(values_at, g0, g1, crossed, tol, crossing, start=0.0, end=1.0):
    """The bracket ``(lo, hi, g(lo), g(hi), crossed)``, at most ``tol`` wide, around the
    earliest crossing in ``[start, end]`` of the events ``crossed`` (``g(start) = g0``,
    ``g(end) = g1``;
    ``values_at`` gives every event's ``cond`` at one ``theta``; ``crossing(ga, gb)``: which
    events cross between two such values). One secant point per iteration for all events, the
    earliest of their estimates, with the Illinois weight ``alpha`` on the end kept twice (the
    root finder of CVODE, Hiebert & Shampine, "Implicitly defined output points for solutions
    of ODEs", Sandia report SAND80-0180, 1980): one evaluation of the dense output and of every
    ``cond`` per iteration, one loop however many events.

    An event that crossed and came back within the step shows no sign change over it, but does
    over ``[0, hi]`` once another event's crossing has pulled ``hi`` below its return (a ball's
    height through 1.1 and back within a step its apex, another event, cuts): that crossing
    came first, perhaps below ``lo``, so it joins ``crossed`` and the search restarts from
    ``start``.
    ``crossed`` only grows, so there are at most as many restarts as events."""
    one = jnp.ones((), g1.dtype)
    zero = jnp.zeros((), jnp.int32)
    start, end = jnp.asarray(start, g1.dtype), jnp.asarray(end, g1.dtype)

    def cond(c):
        lo, hi, k, active = c[0], c[1], c[5], c[7]
        return any_member(jnp.any(active) & (hi - lo > tol) & (k < ROOT_MAX_ITERATIONS))

    def body(c):
        lo, hi, glo, ghi, alpha, k, side, active = c
        inside = active & crossing(glo, ghi)
        # the fraction of the bracket below hi where each crossing event's secant lands
        back = jnp.where(inside, ghi / (ghi - alpha * glo), 0.0)
        back = jnp.where(jnp.isfinite(back), jnp.clip(back, 0.0, 1.0), 0.5)
        width = hi - lo
        x = hi - jnp.max(back) * width
        # at least half the tolerance inside each end (CVODE's guard; a resolvable time): the
        # bracket always shrinks
        room = jnp.minimum(0.5 * tol, 0.25 * width)
        x = jnp.clip(x, lo + room, hi - room)
        gx = values_at(x)
        below = jnp.any(active & crossing(glo, gx))  # the earliest crossing is in [lo, x]
        lo = jnp.where(below & jnp.any(inside & (gx == 0)), x, lo)  # on it: done
        new_side = jnp.where(below, 1, 2)
        # the same end kept twice: weight it (alpha) so that the next secant reaches past
        alpha = jnp.where(new_side == side, jnp.where(new_side == 2, 2 * alpha, 0.5 * alpha), one)
        run = jnp.any(active) & (width > tol)
        new = run & below & crossing(g0, gx) & ~active
        restart = jnp.any(new)
        lo, glo = (
            jnp.where(restart, start, jnp.where(below, lo, x)),
            jnp.where(restart, g0, jnp.where(below, glo, gx)),
        )
        pick = lambda a, b: jnp.where(run, a, b)
        return (
            pick(lo, c[0]),
            pick(jnp.where(below, x, hi), hi),
            pick(glo, c[2]),
            pick(jnp.where(below, gx, ghi), ghi),
            pick(jnp.where(restart, one, alpha), c[4]),
            jnp.where(restart, zero, k + 1),
            pick(jnp.where(restart, zero, new_side), side),
            active | new,
        )

    init = (start, end, g0, g1, one, zero, zero, crossed)
    init = jax.tree.map(lax.stop_gradient, init)
    lo, hi, glo, ghi, *_, active = lax.while_loop(cond, body, init)
    return lo, hi, glo, ghi, active


def earliest_piece(points, values, crossing):
    """``(crossed, lo, hi, g(lo), g(hi))``: the earliest piece ``[points[k], points[k + 1]]``
    over which some event crosses (``values[k]``: every event's ``cond`` at ``points[k]``, one
    row per point; ``crossing(ga, gb)``: which events cross between two such rows), the events
    that cross in it, and their values at its ends; the whole span, none crossed, when none
    does."""
    pieces = crossing(values[:-1], values[1:])  # (pieces, events)
    any_piece = jnp.any(pieces, axis=1)
    found, k = jnp.any(any_piece), jnp.argmax(any_piece)
    pick = lambda x, first, last: jnp.where(found, x[k + first], x[last])
    crossed = pieces[k] & found
    return (crossed, pick(points, 0, 0), pick(points, 1, -1), pick(values, 0, 0),
            pick(values, 1, -1))  # fmt: skip
