"""Where and how the continuous adjoints' backward solve steps
(:mod:`~odegrad.adjoint.adjoint_ode`): the times it stops at (forward steps, saves, events),
its step control (the adjoint's error alone: a seminorm), and the quadrature rule of
:class:`~odegrad.adjoint.continuous.Quadrature`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import jax.numpy as jnp
import numpy as np

from .._loop import RuntimeGrid
from .._step import Adaptive, Fixed
from .._tree import tightest_tolerance
from .base import Problem


def gauss_legendre(n: int):
    """Nodes and weights of ``n``-point Gauss–Legendre quadrature on ``[0, 1]`` (exact to degree
    ``2n - 1``; numpy's ``leggauss`` mapped from ``[-1, 1]``)."""
    x, w = np.polynomial.legendre.leggauss(n)
    # Python floats, which JAX treats as weakly typed: numpy's float64 scalars would promote a
    # float32 solve to float64 under jax_enable_x64
    return tuple(float(v) for v in 0.5 * (x + 1)), tuple(float(v) for v in 0.5 * w)


@dataclass(frozen=True)
class Seminorm:
    """An :class:`~odegrad.Adaptive` controller whose error norm sees only the adjoint part."""

    base: Adaptive
    pick: Callable

    def __getattr__(self, name):
        return getattr(self.base, name)

    def error_ratio(self, err, y0, y1):
        return self.base.error_ratio(self.pick(err), self.pick(y0), self.pick(y1))


def breakpoints(problem: Problem, keep, with_ts: bool = True):
    """Times where the backward solve stops (ascending forward time), the save index at each
    (-1: none), and how many there are."""
    plan = problem.plan
    if problem.grid is not None:
        base = problem.grid
        lab = (jnp.arange(base.shape[0]) - 1) if plan.steps else jnp.full(base.shape, -1)
    elif plan.steps or not isinstance(problem.control, Adaptive):
        # every recorded step end (a runtime fixed grid, or saves at every step)
        base = keep["starts"]
        lab = jnp.arange(base.shape[0]) - 1 if plan.steps else jnp.full(base.shape, -1)
    else:
        base = jnp.stack([problem.tau0, keep["t1"]])
        lab = jnp.array([-1, -1])
    pieces = [(base, lab)]
    if plan.ts is not None and with_ts:
        pieces.append((plan.ts, jnp.arange(plan.ts.shape[0])))
    if problem.events is not None:  # last: at an equal time the jump comes first, backwards
        log = keep["events"]
        tau = jnp.where(jnp.isfinite(log.ts), problem.direction * log.ts, jnp.inf)
        pieces.append((tau, -2 - jnp.arange(log.ts.shape[0])))
    padded = problem.grid is None and (plan.steps or not isinstance(problem.control, Adaptive))
    padded = padded or problem.events is not None
    if len(pieces) == 1 and not padded:
        return base, lab, base.shape[0]
    if padded:
        # padded step buffer: push the unused (inf) entries to the end
        n = keep["n"] + 1
        base = jnp.where(jnp.arange(base.shape[0]) < n, base, jnp.inf)
    pts = jnp.concatenate([p for p, _ in pieces])
    labs = jnp.concatenate([lb for _, lb in pieces])
    order = jnp.argsort(pts, stable=True)
    count = pts.shape[0]
    if padded:
        count = jnp.sum(jnp.isfinite(pts))
    # nothing past where the solve stopped (a terminal event, a failure): the adjoint
    # starts there, and the saves after it (inf rows) take no part
    pts, labs = pts[order], labs[order]
    past = pts > keep["t1"]
    return jnp.where(past, keep["t1"], pts), jnp.where(past, -1, labs), count


def backward_control(step: Adaptive | Fixed | None, problem: Problem):
    """The backward solve's step control: ``step`` (an adjoint's own, checked when the adjoint
    is made, or None to follow the forward solve's), made to stop where the forward's ``f``
    jumps and to measure the error of the adjoint alone (:class:`Seminorm`), at the forward's
    tightest tolerance."""
    base = step
    if base is None:
        base = problem.control if problem.grid is None else "grid"
    if isinstance(base, RuntimeGrid):  # fixed steps: one backward step per forward step
        base = "grid"
    if isinstance(base, Adaptive):
        # f jumps there backwards too, and steps land there; the loop's time is tau
        for name in ("jump_ts", "step_ts"):
            ts = getattr(base, name)
            ts = getattr(problem.control, name, None) if ts is None else ts
            if ts is not None:
                base = replace(base, **{name: problem.direction * jnp.asarray(ts)})
        # tolerances per entry are the state's; the adjoint state has its own scale
        tol = {k: tightest_tolerance(getattr(base, k)) for k in ("rtol", "atol")}
        base = replace(base, **tol)
        return Seminorm(base, lambda z: {k: v for k, v in z.items() if k != "g"})
    return base
