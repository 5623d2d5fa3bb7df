"""Save-time cotangents as extra columns of a backward step, so the adjoint steps across saves.

The adjoint ``a`` of a loss on saved values jumps by each save's cotangent ``c_j`` at its time
``s_j``. A backward solve that stops at every save restarts there and pays at least one full
step per save: with 100 saves and a smooth field, a hundred steps where the forward pass took
five. The adjoint ODE is linear in ``a``, so over a backward step from ``hi`` down to ``lo``
the jumps inside it superpose::

    a(lo) = Phi(lo, hi) a(hi) + sum over lo < s_j < hi of Phi(lo, s_j) c_j

Each term is the homogeneous adjoint ODE over its own span, ``[lo, hi]`` or ``[lo, s_j]``. A
:class:`ColumnSolver` step integrates them together: column ``j`` runs in the step's variable
``theta`` in ``[0, 1]``, at forward time ``s_j - theta (s_j - lo)``. One explicit Runge–Kutta
step of size 1 in ``theta`` on the stacked columns evaluates every column's right-hand side in
one vector-Jacobian product of ``f``, whose parameter cotangent is summed over the columns
inside the product (for a dense layer a matrix product, not a parameter-sized array per
column). ``dL/dp`` is one state of the backward ODE (``Interpolating``) with that sum as its
rate, or a Gauss–Legendre quadrature in ``theta`` over the columns (``Quadrature``). The error
estimate is the largest of the columns'.

A step holds at most ``columns`` saves (``Tuning.adjoint_columns``, fewer for a large state:
``Tuning.column_entries``); the loop's step is capped (:meth:`ColumnSolver.max_step`) so that no
more fall inside. A step with fewer saves inside still pays for every column: a branch to a
one-column step for the steps without saves made sparse saves (Lotka–Volterra, 20 saves in ~120
steps) 1.3x faster but doubled the compile time. A save at a step's end enters the next step as
a column of its full length; one at the start of a backward interval is added to ``a``
beforehand (:meth:`SaveColumns.absorb`), after that breakpoint's own jumps (an event's). Saves
at equal times are merged.

The sources that can read ``y`` anywhere in the interval have ``reads_anywhere``: the forward
dense output (``Interpolating()``, ``Quadrature()``) and the re-taken step
(``Interpolating(checkpoints=c)``). ``Backsolve`` re-integrates ``y`` along one path only and
stops at every save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..solvers.base import AbstractSolver, StepResult

PyTree = Any


class SaveColumns(NamedTuple):
    """The saves' a-jumps, merged per distinct time (ascending; unused rows at ``+inf``)."""

    times: Any  # (N,)
    jumps: PyTree  # rows (N, ...) shaped like a

    @classmethod
    def merge(cls, times, jumps, valid) -> SaveColumns:
        """Sort, drop invalid saves (their jump becomes zero, their time ``+inf``) and sum the
        jumps of equal times into the group's first row."""
        order = jnp.argsort(jnp.where(valid, times, jnp.inf), stable=True)
        times = jnp.where(valid, times, jnp.inf)[order]
        valid = valid[order]
        rows = jax.tree.map(
            lambda r: jnp.where(valid.reshape((-1,) + (1,) * (r.ndim - 1)), r[order], 0), jumps
        )
        first = jnp.concatenate([jnp.ones((1,), bool), times[1:] != times[:-1]])
        group = jnp.cumsum(first) - 1
        n = times.shape[0]
        merged = jax.tree.map(lambda r: jax.ops.segment_sum(r, group, num_segments=n), rows)
        utimes = jnp.full((n,), jnp.inf, times.dtype).at[group].set(times)
        return cls(utimes, merged)

    def below(self, p):
        """The index of the last save strictly before ``p`` (-1: none)."""
        return (jnp.searchsorted(self.times, p, side="left") - 1).astype(jnp.int32)

    def absorb(self, a, p):
        """``a`` plus the jump of a save at exactly ``p``, if any."""
        hit = self.times == p
        return jax.tree.map(
            lambda x, r: x + jnp.sum(jnp.where(hit.reshape((-1,) + (1,) * x.ndim), r, 0), 0),
            a,
            self.jumps,
        )


class ColumnSolver(AbstractSolver):
    """A backward solver whose step also carries the saves inside it as columns (see the module
    docstring). The backward state is ``{"a": ..., "g": ...}`` (``"g"``: ``dL/dp``, absent for
    the quadrature adjoint); ``rates(read, p, A, weights, args, with_g)`` gives the columns'
    ``da/dp`` at forward times ``p`` (one per column; ``read(p)`` the forward state), each times
    its weight, and the weighted sum of their ``dg/dp`` (``None`` unless ``with_g``).

    ``reader(hi)`` gives ``(read, reach)`` for a step from ``hi`` (see
    :meth:`~odegrad.adjoint.sources.StateSource.reader`). Its carried state is
    ``(k, hi, reach)``: the index of the last save not yet taken in, the start of the next step
    and how far below it the reader reaches. ``f`` (the main column's rate) serves only the
    loop's first-step guess.
    """

    def __init__(
        self,
        inner: AbstractSolver,
        saves: SaveColumns,
        columns: int,
        reader: Callable,
        rates: Callable,
        floor,
        quadrature: tuple | None = None,
    ):
        self.inner, self.saves, self.columns = inner, saves, columns
        self.reader, self.rates = reader, rates
        self.floor = floor  # the backward interval's end: a save there is not this loop's
        self.quadrature = quadrature  # (nodes, weights) on [0, 1] for dL/dp, or None
        self.order = inner.order
        self.embedded_order = inner.embedded_order
        self.prev_ratio_floor, self.pi_gains = inner.prev_ratio_floor, inner.pi_gains
        self.init_evals = 0
        self.step_evals = inner.init_evals + inner.step_evals

    def init(self, f, t0, y0, args):
        return (self.saves.below(t0), t0, self.reader(t0)[1])

    def max_step(self, state):
        """At most ``columns`` saves inside a step (it may reach down to the next one after),
        and no further than the reader reaches."""
        k, hi, reach = state
        j = k - self.columns
        cap = jnp.where(j >= 0, hi - self.saves.times[jnp.maximum(j, 0)], jnp.inf)
        return jnp.minimum(cap, hi - reach)

    def _columns(self, t0, dt, y0, k):
        lo = t0 + dt
        idx = k - jnp.arange(self.columns)
        times = self.saves.times[jnp.maximum(idx, 0)]
        inside = (idx >= 0) & (times > jnp.maximum(lo, self.floor))
        start = jnp.concatenate([t0[None], jnp.where(inside, times, lo)])
        first = jax.tree.map(lambda a: a[None], y0["a"])
        jumps = jax.tree.map(
            lambda r: jnp.where(
                inside.reshape((-1,) + (1,) * (r.ndim - 1)), r[jnp.maximum(idx, 0)], 0
            ),
            self.saves.jumps,
        )
        cols = jax.tree.map(lambda x, r: jnp.concatenate([x, r]), first, jumps)
        return start, start - lo, cols, jnp.sum(inside)

    def rhs_theta(self, read, start, length):
        """d/dtheta of the stacked state: column ``j`` at forward time ``start_j - theta
        length_j``, its rate times ``-length_j``."""

        def rhs(theta, z, args):
            p = start - theta * length
            da, dg = self.rates(read, p, z["a"], -length, args, "g" in z)
            return {"a": da} if dg is None else {"a": da, "g": dg}

        return rhs

    def _stacked(self, read, start, length, cols, y0, args):
        """One step of size 1 in theta on the stacked columns: the new state (columns summed),
        its error (the worst column's; ``dL/dp`` left out) and the quadrature's ``dL/dp``."""
        z0 = {**y0, "a": cols}
        rhs = self.rhs_theta(read, start, length)
        one = jnp.ones((), start.dtype)
        res = self.inner.step(rhs, 0 * one, one, z0, args, self.inner.init(rhs, 0 * one, z0, args))
        y1 = {**res.y1, "a": jax.tree.map(lambda x: jnp.sum(x, 0), res.y1["a"])}
        # zeros for dL/dp make its error estimate dead code
        error = {name: jax.tree.map(jnp.zeros_like, v) for name, v in y0.items()}
        error["a"] = jax.tree.map(lambda e: jnp.max(jnp.abs(e), 0), res.error["a"])
        quad = ()
        if self.quadrature is not None:  # Gauss–Legendre in theta over every column at once
            quad = None
            for x, w in zip(*self.quadrature, strict=True):
                a = self.inner.interpolate(res.dense, x)["a"]
                _, dg = self.rates(read, start - x * length, a, -length, args, True)
                dg = jax.tree.map(lambda v: w * v, dg)
                quad = dg if quad is None else jax.tree.map(jnp.add, quad, dg)
        return y1, error, quad

    def step(self, f, t0, dt, y0, args, state):
        k = state[0]
        t0 = jnp.asarray(t0)
        start, length, cols, taken = self._columns(t0, dt, y0, k)
        y1, error, quad = self._stacked(self.reader(t0)[0], start, length, cols, y0, args)
        lo = t0 + dt
        state = ((k - taken).astype(k.dtype), lo, self.reader(lo)[1])
        return StepResult(y1, error, quad, state)

    def interpolate(self, dense, theta):
        raise NotImplementedError("the column steps keep no dense output")
