"""Tableaus of the ESDIRK methods, as data.

Each method is one :class:`ESDIRKTableau`; :mod:`odegrad.solvers.implicit` feeds it to the
single ESDIRK stepping routine. Coefficients carry over from their published sources, named
beside each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ESDIRKTableau:
    """A stiffly accurate ESDIRK method with ``s`` stages and an explicit first stage.

    Stage ``i >= 1`` (0-based) solves ``z_i = y0 + dt (sum_{j<i} a[i-1][j] k_j + gamma k_i)``
    with ``k_i = f(t0 + c[i] dt, z_i)``; ``y1 = z_{s-1}``; the error estimate is
    ``dt sum_i b_error[i] k_i``. ``predictor[i-1]`` gives the first Newton guess
    ``k_i ~ sum_j predictor[i-1][j] k_j``.
    """

    gamma: float
    c: tuple[float, ...]
    a: tuple[tuple[float, ...], ...]
    b_error: tuple[float, ...]
    predictor: tuple[tuple[float, ...], ...]
    order: int
    embedded_order: int
    #: ``dense[i][m]``: the continuous extension ``y(t0 + theta dt) = y0 + dt sum_i b_i(theta)
    #: k_i`` with ``b_i(theta) = sum_m dense[i][m] theta**(m + 1)``; ``None``: cubic Hermite.
    dense: tuple[tuple[float, ...], ...] | None = None
    dense_order: int = 3

    @property
    def stages(self) -> int:
        return len(self.c)


def continuous_extension(tab: ESDIRKTableau, order: int) -> tuple[tuple[float, ...], ...]:
    """Weights ``b_i(theta)`` (polynomials of degree ``order``) with ``b_i(1) = b_i`` that
    satisfy the order conditions up to ``order`` at every ``theta`` (Hairer, Nørsett & Wanner,
    Solving ODEs I, II.6), as the minimum-norm solution of that linear system.

    The residual is checked to be roundoff.
    """
    s = tab.stages
    a = np.zeros((s, s))
    for i in range(1, s):
        a[i, :i] = tab.a[i - 1]
        a[i, i] = tab.gamma
    c = np.asarray(tab.c)
    # (elementary weight, order rho, density gamma) of every tree up to order 4
    trees = [
        (np.ones(s), 1, 1),
        (c, 2, 2),
        (c**2, 3, 3),
        (a @ c, 3, 6),
        (c**3, 4, 4),
        (c * (a @ c), 4, 8),
        (a @ c**2, 4, 12),
        (a @ a @ c, 4, 24),
    ]
    rows, rhs = [], []
    for phi, rho, dens in (t for t in trees if t[1] <= order):
        for m in range(1, order + 1):
            row = np.zeros((s, order))
            row[:, m - 1] = phi
            rows.append(row.ravel())
            rhs.append(1.0 / dens if m == rho else 0.0)
    # Stiff components: in the stiff limit the implicit stage values lie on the slow manifold
    # g(t), z_i = g(t0 + c_i dt), and k_1 = g'(t0); the interpolant is then
    # y0 (1 - sum w) + sum_i w_i z_i + dt v k_1 with w = b~(theta)^T A~^{-1} (A~: the implicit
    # block) and v = b_1(theta) - w . a_{:,1}. Ask it to reproduce cubic g exactly (the
    # conditions q = 1, 2 follow from the classical ones; q = 3 is new), so that stiff
    # components are interpolated as well as smooth ones.
    a_inv = np.linalg.inv(a[1:, 1:])
    for q in range(1, 4):
        for m in range(1, order + 1):
            row = np.zeros((s, order))
            row[1:, m - 1] = a_inv @ c[1:] ** q
            if q == 1:
                row[0, m - 1] += 1.0
                row[1:, m - 1] -= a_inv @ a[1:, 0]
            rows.append(row.ravel())
            rhs.append(1.0 if m == q else 0.0)
    for i in range(s):  # b_i(1) = b_i: the interpolant ends on y1
        row = np.zeros((s, order))
        row[i, :] = 1
        rows.append(row.ravel())
        rhs.append(a[-1, i])
    mat, vec = np.array(rows), np.array(rhs)
    sol = np.linalg.lstsq(mat, vec, rcond=None)[0]
    if np.abs(mat @ sol - vec).max() > 1e-12:
        raise ValueError("no continuous extension of that order for this tableau")
    return tuple(tuple(float(x) for x in r) for r in sol.reshape(s, order))


# Implicit Euler as a 2-stage ESDIRK: k_1 = f(t0, y0) explicit, z = y0 + dt f(t1, z). The error
# estimate is the difference to the trapezoidal rule, dt (k_2 - k_1) / 2 = O(dt^2), the standard
# estimate for backward Euler (Hairer & Wanner, Solving ODEs II, IV.8).
IMPLICIT_EULER = ESDIRKTableau(
    gamma=1.0,
    c=(0.0, 1.0),
    a=((0.0,),),
    b_error=(-0.5, 0.5),
    predictor=((1.0,),),
    order=1,
    embedded_order=1,
)


def _kvaerno3() -> ESDIRKTableau:
    # Source: A. Kværnø, "Singly diagonally implicit Runge-Kutta methods with an explicit first
    # stage", BIT 44 (2004) 489-502, the 4-stage order-3(2) method; closed forms in gamma as in
    # diffrax 0.7 (_solver/kvaerno3.py), which also supplies the predictor coefficients.
    g = 0.43586652150
    a31 = (-4 * g**2 + 6 * g - 1) / (4 * g)
    a32 = (-2 * g + 1) / (4 * g)
    a41 = (6 * g - 1) / (12 * g)
    a42 = -1 / ((24 * g - 12) * g)
    a43 = (-6 * g**2 + 6 * g - 1) / (6 * g - 3)
    th = 1 / (2 * g)
    return ESDIRKTableau(
        gamma=g,
        c=(0.0, 2 * g, 1.0, 1.0),
        a=((g,), (a31, a32), (a41, a42, a43)),
        # b - b_embedded: the embedded solution is stage 3 (also stiffly accurate)
        b_error=(a41 - a31, a42 - a32, a43 - g, g),
        predictor=((1.0,), (1.0 - th, th), (a31, a32, g)),
        order=3,
        embedded_order=2,
    )


def _kvaerno5() -> ESDIRKTableau:
    # Source: A. Kværnø, BIT 44 (2004) 489-502, the 7-stage order-5(4) method (gamma = 0.26),
    # coefficients as carried by diffrax 0.7 (_solver/kvaerno5.py), with its stage predictor.
    g = 0.26
    a = (
        (g,),
        (0.13, 0.84033320996790809),
        (0.22371961478320505, 0.47675532319799699, -0.06470895363112615),
        (0.16648564323248321, 0.10450018841591720, 0.03631482272098715, -0.13090704451073998),
        (0.13855640231268224, 0.0, -0.04245337201752043, 0.02446657898003141, 0.61943039072480676),
        (
            0.13659751177640291,
            0.0,
            -0.05496908796538376,
            -0.04118626728321046,
            0.62993304899016403,
            0.06962479448202728,
        ),
    )
    pred = (
        (1.0,),
        (-1.366025403784441, 2.3660254037844357),
        (-0.19650552613122207, 0.8113579546496623, 0.38514757148155954),
        (0.10375304369958693, 0.937994698066431, -0.04174774176601781, 0.0),
        (-0.17281112873898072, 0.6235784481025847, 0.5492326806363959, 0.0, 0.0),
        (*a[4], g),
    )
    last, prev = a[5] + (g,), a[4] + (g, 0.0)
    return ESDIRKTableau(
        gamma=g,
        c=(0.0, 0.52, 1.230333209967908, 0.8957659843500759, 0.43639360985864756, 1.0, 1.0),
        a=a,
        b_error=tuple(x - y for x, y in zip(last, prev, strict=True)),
        predictor=pred,
        order=5,
        embedded_order=4,
    )


KVAERNO3 = _kvaerno3()
KVAERNO5 = _kvaerno5()
# Kvaerno5's stages admit a 4th-order continuous extension (cubic Hermite on the end slopes
# would be of order 3 only, too coarse for saves between its long steps at tight tolerances).
KVAERNO5 = dataclasses.replace(KVAERNO5, dense=continuous_extension(KVAERNO5, 4), dense_order=4)
