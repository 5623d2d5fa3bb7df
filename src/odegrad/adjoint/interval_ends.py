"""The ends of a continuous adjoint's backward interval that are events: the points a few
ulps inside the interval that stand in for them (see :class:`IntervalEnds`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._batching import member_cond
from .._events import EventLog, EventSet


class IntervalEnds(NamedTuple):
    """A backward interval ``[lo, hi]`` (forward time) whose ends may be events: the points
    a few ulps inside it (:meth:`EventSet.beside`) that stand in for its ends. The backward
    solve's first stage sits on ``hi`` and an explicit step's last on ``lo``; at an event
    those states lie on the surface, where a ``where`` in ``f`` takes either side, so ``f`` and
    its Jacobian there would be the other side's for a whole stage (5 % of ``dL/dp`` in
    ``tests/test_kinks.py::test_value_jump_with_an_event``, Interpolating: Tsit5's first
    stage weight 0.0965 times a backward step of ~1)."""

    hi: Any
    lo: Any
    hi_event: Any
    lo_event: Any
    hi_point: Any  # (forward time, state) just inside hi
    lo_point: Any

    @staticmethod
    def find(events: EventSet, log: EventLog, s, hi, lo, args) -> IntervalEnds:
        tau = jnp.where(jnp.isfinite(log.ts), s * log.ts, jnp.inf)

        def end(p, before):
            hit = tau == p
            row = jnp.argmax(hit)
            which, t = log.which[row], log.ts[row]
            z = jax.tree.map(lambda x: x[row], log.ys)

            def inside(_):
                y = z if before else events.jump(which, t, z, args, s)[2]
                t_in, y_in = events.beside(which, t, y, args, s, before)
                return s * t_in, y_in

            return jnp.any(hit), member_cond(jnp.any(hit), inside, lambda _: (p, z), None)

        (hi_event, hi_point), (lo_event, lo_point) = end(hi, True), end(lo, False)
        return IntervalEnds(hi, lo, hi_event, lo_event, hi_point, lo_point)

    @staticmethod
    def inside(ends: IntervalEnds | None, rates: Callable) -> Callable:
        """``rates(y, p, ...)`` with the interval's event ends (if any) moved inside it."""
        if ends is None:
            return rates
        return lambda y, p, *rest: rates(ends.state(p, y), ends.time(p), *rest)

    def _masks(self, p):
        # a backward step's last stage lands on lo to an ulp or so, not exactly
        tol = 16 * jnp.finfo(jnp.result_type(p)).eps * (jnp.abs(self.hi) + self.hi - self.lo)
        return (
            self.hi_event & (jnp.abs(p - self.hi) <= tol),
            self.lo_event & (jnp.abs(p - self.lo) <= tol),
        )

    def time(self, p):
        at_hi, at_lo = self._masks(p)
        return jnp.where(at_hi, self.hi_point[0], jnp.where(at_lo, self.lo_point[0], p))

    def state(self, p, y):
        """``y`` read at times ``p`` (leading axes of ``y``'s leaves, if ``p`` has any)."""
        at_hi, at_lo = self._masks(p)

        def pick(mask, new, old):
            mask = mask.reshape(mask.shape + (1,) * (old.ndim - mask.ndim))
            return jnp.where(mask, new.astype(old.dtype), old)

        y = jax.tree.map(lambda n, o: pick(at_lo, n, o), self.lo_point[1], y)
        return jax.tree.map(lambda n, o: pick(at_hi, n, o), self.hi_point[1], y)
