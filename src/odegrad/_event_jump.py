"""An event's jump ``(t*, y-, y+)`` and its derivative.

The event time ``t*`` solves ``g(t*, y(t*), p) = 0``, so by the implicit function
theorem ``dt* = -(g_y dy + g_p dp) / gdot`` with ``gdot = g_t + g_y f(t*, y-)``. ``jump`` is
the map from the state just before the event, *at the located time held fixed*, to ``(t*, y-,
y+)`` where ``y+`` is the state just after, again at fixed time; its JVP carries the event time's
derivative::

    dy- = dz + f- dt*,     dy+ = u_t dt* + u_y dy- + u_p dp - f+ dt*

(``f+ dt*`` moves the reference time back: a later event leaves the post-event solution less
time; without ``update``, ``u`` is the identity). ``f-`` and ``f+`` are ``f`` on either side of
the surface, evaluated a few ulps away from it along the solution (:func:`beside_surface`): where
``f`` itself jumps across the surface (``sign``, ``floor``, a ``where`` whose branches differ
there), ``(f- - f+) dt*`` is the jump's saltation term, which ``f``'s pointwise derivative
misses; an event placed on the surface is how a solve learns where it is. Its transpose is
the adjoint's jump condition at the event, the same one that SciMLSensitivity applies at a
``ContinuousCallback``; every adjoint differentiates this one function, forward (``jax.jvp``)
or backward (``jax.vjp``). The continuous adjoints' backward solves also read ``f`` just
inside each interval at its event ends
(:class:`odegrad.adjoint.interval_ends.IntervalEnds`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

if TYPE_CHECKING:
    from ._events import EventSet

SECOND_DERIVATIVES_THROUGH_EVENTS = (
    "og.solve: second derivatives (jax.hessian, jax.jacfwd or jax.jvp of jax.grad, jax.jacfwd "
    "of jax.jacfwd) through a solve with events are not supported: the event time has a "
    "first-order derivative rule only. Use finite differences of the gradient."
)


@jax.custom_jvp
def _first_order_only(x):
    """The identity, refusing to be differentiated: applied to the primals a first-order
    derivative rule reads, it makes a second derivative of that rule raise wherever it is
    taken (``og.solve`` refuses one it can see; ``jax.hessian(jax.jit(loss))`` it cannot)."""
    return x


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    raise NotImplementedError(SECOND_DERIVATIVES_THROUGH_EVENTS)


def jump(events: EventSet, i: int, t, z, args, s):
    """``(t, z, y+)`` with the derivative of the module docstring (``t`` is held fixed)."""
    update = events.updates[i]
    terminal = events.terminal[i]

    @jax.custom_jvp
    def jump(t, z, args, s):
        return t, z, (z if update is None else update(t, z, args))

    @jump.defjvp
    def jump_jvp(primals, tangents):
        t, z, args, s = jax.tree.map(
            lambda x: (
                _first_order_only(x) if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x
            ),
            primals,
        )
        _, dz, dargs, _ = tangents
        cond = events._cond(i)
        f_minus = events.f(*beside_surface(events.f, cond, t, z, args, s, before=True), args)
        g, dg = jax.jvp(lambda y, a: cond(t, y, a), (z, args), (dz, dargs))
        # gdot = g_t + g_y f-: the rate at which cond crosses zero along the arriving solution
        _, gdot = jax.jvp(lambda t_, y: cond(t_, y, args), (t, z), (jnp.ones_like(t), f_minus))
        if not (events.surfaces and events.surfaces[i] is not None):
            dg, gdot = _timed_by_its_jump(cond, t, z, args, dz, dargs, f_minus, g, dg, gdot)
        # a grazing crossing (gdot = 0) has no finite sensitivity; the guard keeps members of a
        # batch that did not fire (evaluated, then discarded) from putting nan into gradients
        dt = (-dg / jnp.where(gdot == 0, 1, gdot)).astype(jnp.result_type(t))
        dz_minus = jax.tree.map(lambda a, b: a + b * dt.astype(b.dtype), dz, f_minus)
        if terminal:
            return (t, z, z), (dt, dz_minus, dz_minus)
        if update is None:
            y_plus, dy_jump = z, dz_minus  # the solution passes through unchanged
        else:
            y_plus, dy_jump = jax.jvp(update, (t, z, args), (dt, dz_minus, dargs))
        f_plus = events.f(*beside_surface(events.f, cond, t, y_plus, args, s, before=False), args)
        dy_plus = jax.tree.map(lambda a, b: a - b * dt.astype(b.dtype), dy_jump, f_plus)
        return (t, z, y_plus), (dt, dz_minus, dy_plus)

    return jump(t, z, args, s)


def _timed_by_its_jump(cond, t, z, args, dz, dargs, f_minus, g, dg, gdot):
    """``(dg, gdot)`` of the function whose zero the event time is: ``cond``'s own, or where
    ``cond`` changed sign by a jump of a ``rem``/``floor``/... in it (``rem(t, P) - d`` at
    ``t = P``), that jump's surface (the nearer zero in time), whose derivative the event time
    then has: ``d(t*)/dP = 1``, ``d(t*)/dd = 0`` there, where ``cond``'s would give ``0, 1``."""
    from ._switches import jump_surfaces  # (which builds on this module)

    if jump_surfaces(cond, t, z, args) is None:  # (trace time: cond has no such jump)
        return dg, gdot
    jumps = lambda t_, y_, a_: jump_surfaces(cond, t_, y_, a_)
    j, dj = jax.jvp(lambda y, a: jumps(t, y, a), (z, args), (dz, dargs))
    _, jdot = jax.jvp(lambda t_, y: jumps(t_, y, args), (t, z), (jnp.ones_like(t), f_minus))
    away = lambda v, rate: jnp.abs(v) / jnp.where(rate == 0, 1, jnp.abs(rate))
    k = jnp.argmin(jnp.where(jdot == 0, jnp.inf, away(j, jdot)))
    by_jump = (jdot[k] != 0) & ((gdot == 0) | (away(j[k], jdot[k]) < away(g, gdot)))
    return jnp.where(by_jump, dj[k], dg), jnp.where(by_jump, jdot[k], gdot)


def beside_surface(f, cond, t, y, args, s, before: bool):
    """``(t', y')``: a point on the solution a few ulps before (``before``) or after the
    crossing of ``cond`` at ``(t, y)``, strictly on that side of the surface.

    It is ``(t -+ s d, y -+ s d f(t, y))`` for the smallest ``d`` of ``d0 2^k`` (``d0`` a few
    ulps of the time and of the state's scale over its speed, or the linearised distance to
    the surface if that is more) at which ``cond`` is strictly on the wanted side: before, the
    side the solution arrives from (``cond``'s sign is minus that of its rate in the solve's
    direction ``s``); after, the side it leaves to (its rate's sign, as the loop restarts after
    an event). A ``cond`` far from zero at ``(t, y)`` changed sign by a jump: before is where
    its sign is the opposite of the one it has there, after where it is the same. Where no
    ``d`` up to ``sqrt(eps)`` of the scale reaches that side (a grazing or sliding crossing,
    an update that moves ``y`` off the surface), ``(t, y)``. ``f`` there is
    ``f``'s value on that side, which a ``where`` on the surface itself cannot tell apart.
    """
    t, y = lax.stop_gradient((t, y))
    v = lax.stop_gradient(f(t, y, args))
    g0, rate = jax.jvp(lambda t_, y_: cond(t_, y_, args), (t, y), (jnp.ones_like(t), v))
    along = jnp.sign(s * rate)
    dtype = jnp.result_type(t)
    eps = jnp.finfo(dtype).eps
    y_max, v_max = (
        jnp.max(jnp.stack([jnp.max(jnp.abs(x)).astype(dtype) for x in jax.tree.leaves(u)]))
        for u in (y, v)
    )
    scale = jnp.abs(t) + y_max / jnp.where(v_max > 0, v_max, 1)
    scale = jnp.where(scale > 0, scale, 1)

    def probe(d):
        dt = ((-1 if before else 1) * s * d).astype(dtype)
        return t + dt, jax.tree.map(lambda a, b: a + b * dt.astype(b.dtype), y, v)

    def beside(d):
        g = cond(*probe(d), args)
        return (g != 0) & (jnp.sign(g) == want)

    # from at least the linearised distance to the surface: a state away from it (a member of
    # a batch that did not fire, evaluated and discarded) starts past the cap and stops at once
    cap = jnp.sqrt(eps) * scale
    to_surface = jnp.where(rate != 0, jnp.abs(g0) / jnp.where(rate != 0, jnp.abs(rate), 1), jnp.inf)
    start = jnp.maximum(4 * eps * scale, to_surface.astype(dtype))
    # a cond that changed sign by a jump (rem(t, P) - d at t = P) is far from zero at the
    # crossing: its sides are the signs it has there and just before, whatever its rate
    # (a few ulps away: the located crossing is the end of a bracket that narrow)
    far = (g0 != 0) & ~(to_surface <= cap)
    want = jnp.where(far, jnp.sign(g0), along) * (-1 if before else 1)
    start = jnp.where(far, 4 * eps * scale, start)
    cap = jnp.where(far, 64 * start, cap)
    d = lax.while_loop(lambda d: ~beside(d) & (d < cap), lambda d: 2 * d, start)
    found = beside(d) & (d <= 2 * cap) & (want != 0)
    return jax.tree.map(lambda a, b: jnp.where(found, a, b), probe(d), (t, y))
