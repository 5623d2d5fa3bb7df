"""Explicit Runge–Kutta methods: one stepping routine fed by a Butcher tableau.

Every method carries ``k1 = f(t, y)`` from step to step. For first-same-as-last (FSAL) tableaus
it is the last stage of the previous step; for the others it is evaluated at the end of the step
instead of the start of the next, so the count of evaluations is the same and the cubic Hermite
interpolant gets its end slope for free.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._tree import tree_lincomb, tree_size
from .._tuning import tuning
from . import tableaus
from .base import AbstractSolver, StepResult
from .tableaus import ButcherTableau


def hermite(y0, y1, f0, f1, dt, theta):
    """Cubic Hermite interpolation between ``(y0, f0)`` and ``(y1, f1)`` at ``t0 + theta*dt``."""
    t2, t3 = theta * theta, theta * theta * theta
    h00 = 2 * t3 - 3 * t2 + 1
    h10 = t3 - 2 * t2 + theta
    h01 = -2 * t3 + 3 * t2
    h11 = t3 - t2
    return jax.tree.map(
        lambda a, b, fa, fb: h00 * a + h01 * b + dt * (h10 * fa + h11 * fb), y0, y1, f0, f1
    )


def dense_weights(coefficients, theta) -> list:
    """The continuous extension's stage weights ``b_i(theta)`` (row ``i`` of ``coefficients``:
    the polynomial ``b_i(theta) / theta`` in increasing powers); ``theta`` may be an array."""
    weights = []
    for coeffs in coefficients:
        acc = jnp.zeros_like(theta)
        for c in reversed(coeffs):  # Horner in theta, then one more theta: b_i(0) = 0
            acc = acc * theta + c
        weights.append(acc * theta)
    return weights


def stage_interpolant(coefficients, dense, theta):
    """A Runge–Kutta method's dense output at ``t0 + theta * dt``.

    With ``coefficients`` (row ``i``: the polynomial ``b_i(theta) / theta`` in increasing
    powers), ``dense = (y0, dt, stages)`` and the value is ``y0 + dt * sum_i b_i(theta) k_i``;
    with ``None``, ``dense = (y0, y1, f0, f1, dt)`` and the value is cubic Hermite.
    """
    if coefficients is None:
        return hermite(*dense, theta)
    y0, dt, ks = dense
    weights = dense_weights(coefficients, theta)
    return jax.tree.map(
        lambda y, *k: y + dt * sum(w * ki for w, ki in zip(weights, k, strict=True)), y0, *ks
    )


def _materialize(tree, dt):
    """``tree``, written to memory before its consumers run.

    Otherwise XLA fuses a stage's linear combination into ``f`` and, for a stencil ``f``,
    recomputes it at every neighbour it reads (measured: Tsit5 on a 32^3 Laplacian 6x slower).
    A conditional is a fusion boundary XLA keeps (an optimization barrier is expanded before
    fusion on CPU). Small states skip it: there the boundary costs more than the recomputation.
    """
    if tree_size(tree) < tuning().materialize_size:
        return tree
    return lax.cond(
        jnp.isfinite(dt), lambda x: x, lambda x: jax.tree.map(lambda v: v * jnp.nan, x), tree
    )


class ExplicitRK(AbstractSolver):
    """An explicit Runge–Kutta method given by a :class:`~odegrad.solvers.tableaus.ButcherTableau`.

    Example:
        >>> solver = og.ExplicitRK(og.solvers.tableaus.RK4)   # same as og.RK4()
    """

    tableau: ButcherTableau
    #: DOPRI5's controller (Hairer, Nørsett & Wanner I, II.4: beta = 0.04, expo1 = 0.2 - 0.75
    #: beta at q = 4): on float32 neural fields, whose error estimates sit far below the
    #: tolerance, PI.3.4's damping held the step's growth back (see ``og.Adaptive``)
    pi_gains = (0.2, 0.65)

    def __init__(self, tableau: ButcherTableau | None = None):
        if tableau is not None:
            self.tableau = tableau
        tab = self.tableau
        self.order = tab.order
        self.embedded_order = tab.embedded_order if tab.b_error is not None else None
        self.init_evals = 1
        self.step_evals = tab.stages - 1 if tab.fsal else tab.stages

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def init(self, f, t0, y0, args):
        return f(t0, y0, args)

    def step(self, f, t0, dt, y0, args, k1):
        tab = self.tableau
        ks = [k1]
        yi = y0
        for i in range(1, tab.stages):
            yi = _materialize(tree_lincomb(y0, dt, tab.a[i - 1], ks), dt)
            # the stage derivative too: in the reverse pass its cotangent, a linear combination,
            # would otherwise be fused into the transposed stencil in the same way
            ks.append(_materialize(f(t0 + tab.c[i] * dt, yi, args), dt))
        if tab.fsal:
            y1, k_next = yi, ks[-1]
        else:
            y1 = _materialize(tree_lincomb(y0, dt, tab.b, ks), dt)
            k_next = f(t0 + dt, y1, args)
        error = None if tab.b_error is None else tree_lincomb(None, dt, tab.b_error, ks)
        if tab.dense is not None:
            dense = (y0, dt, tuple(ks))
        else:
            dense = (y0, y1, k1, k_next, dt)
        return StepResult(y1, error, dense, k_next)

    def interpolate(self, dense, theta):
        return stage_interpolant(self.tableau.dense, dense, theta)


def _named(name: str, tab: ButcherTableau, doc: str) -> type[ExplicitRK]:
    cls = type(name, (ExplicitRK,), {"tableau": tab, "__doc__": doc})
    cls.__module__ = __name__
    return cls


Euler = _named("Euler", tableaus.EULER, "Forward Euler, order 1, fixed steps only.")
Heun = _named("Heun", tableaus.HEUN, "Heun's method, order 2 with an embedded Euler estimate.")
Midpoint = _named("Midpoint", tableaus.MIDPOINT, "Explicit midpoint rule, order 2.")
Ralston = _named("Ralston", tableaus.RALSTON, "Ralston's method, order 2 (minimal error bound).")
RK4 = _named("RK4", tableaus.RK4, "The classic fourth-order Runge–Kutta method.")
BS3 = _named("BS3", tableaus.BS3, "Bogacki–Shampine 3(2), FSAL; good at loose tolerances.")
Tsit5 = _named(
    "Tsit5", tableaus.TSIT5, "Tsitouras 5(4), FSAL, free 4th-order interpolant; the default."
)
Dopri5 = _named("Dopri5", tableaus.DOPRI5, "Dormand–Prince 5(4), FSAL, free 4th-order interpolant.")
Dopri8 = _named("Dopri8", tableaus.DOPRI8, "Prince–Dormand 8(7) (13 stages) for tight tolerances.")
