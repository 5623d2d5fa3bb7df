"""Implicit solvers for stiff problems: the ESDIRK methods (Newton), and what they share with
the Rosenbrock method of :mod:`odegrad.solvers.rosenbrock` (options, linear algebra, tolerances).

Each method is data — an :class:`ESDIRKTableau` or a
:class:`~odegrad.solvers.rosenbrock.RosenbrockTableau` — fed to one stepping routine per family:

* ESDIRK (:class:`ImplicitEuler`, :class:`Kvaerno3`, :class:`Kvaerno5`): an explicit first stage
  ``k_1 = f(t0, y0)`` (carried from the previous step: first-same-as-last), then stages
  ``z_i = psi_i + gamma dt f(t0 + c_i dt, z_i)`` with ``psi_i = y0 + dt sum_{j<i} a_ij k_j``,
  each solved by simplified Newton iterations with ``M = I - gamma dt J(t0, y0)``; the stage
  derivative is ``k_i = (z_i - psi_i) / (gamma dt)`` (no extra evaluation of ``f``, which would
  amplify the Newton error by the stiffness). All three are stiffly accurate: ``y1 = z_s``.
* Rosenbrock (:class:`~odegrad.solvers.rosenbrock.Rodas5P`, ``Rodas5``): linearly implicit,
  ``k_i = gamma dt M^{-1} (f(u_i) + d_i dt df/dt + sum_j C_ij k_j / dt)`` with the exact
  Jacobian at the step start; no Newton iterations, one LU (or GMRES solves) per step.

Linear algebra (:mod:`odegrad.solvers._linear`): ``linear_solver="dense"`` (LU of ``M`` from
:func:`jax.jacfwd`), ``"gmres"`` (matrix-free Newton–Krylov with JVPs and an optional
``preconditioner``), or ``"auto"`` (dense up to ``Tuning.dense_max`` = 256 state entries).
States may be any pytree: the solvers work on the flattened vector
(:func:`jax.flatten_util.ravel_pytree`).
Dense (small) systems unroll the stages; GMRES (large) systems run them in one
:func:`jax.lax.fori_loop`, so the Newton–Krylov solve is compiled once, not once per stage.

Tolerances. Inside ``og.Adaptive(rtol, atol)`` (``with_tolerances``, called by ``og.solve``)
Newton stops at ``NEWTON_KAPPA`` times the controller's tolerances, and GMRES inside Newton at
what that test can resolve (inexact Newton). Linear solves that define derivatives keep the
tight ``gmres_tol``.

Failures. When Newton iterations diverge or do not converge in ``max_newton_iters`` iterations,
the step returns an infinite error estimate and a non-finite ``y1``: the adaptive loop rejects
the step and shrinks ``dt`` (it reports ``step_size_underflow`` only if ``dt`` reaches its floor).
With fixed steps (``og.Fixed``/``og.StepTo``) nothing can shrink the step, so the non-finite
state propagates and the solve reports ``Result.nonfinite`` (raising with ``throw=True``) at the
first failing step, instead of silently continuing from an unconverged iterate: pass a smaller
``dt`` or a larger ``max_newton_iters``.

Gradients. Each stage's root is a :func:`jax.lax.custom_root` (:mod:`odegrad.solvers._newton`):
its derivative is the implicit-function-theorem one, with the exact Jacobian at the root, so
``og.Discrete`` differentiates each implicit step by one transposed linear solve per stage and
``og.Forward`` by one linear solve per stage and direction; the Newton iterations are never
differentiated. Rosenbrock steps are explicit functions of ``J``, so their exact derivative
includes second derivatives of ``f`` (JAX differentiates ``jacfwd``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .._batching import member_cond
from .._tree import tightest_tolerance
from . import _linear
from ._newton import stage_root
from .base import AbstractSolver, StepResult
from .explicit_rk import stage_interpolant

#: Newton stops at this fraction of the adaptive controller's tolerances (Hairer & Wanner's
#: ``kappa``, Solving ODEs II, IV.8: 1e-2..1e-1); without a controller at ``1e-10`` (float64).
NEWTON_KAPPA = 1e-2
#: GMRES inside Newton: the increment's scaled error below this (relative to the Newton
#: tolerance), or the linear residual below ``NEWTON_GMRES_RTOL`` of the right-hand side.
GMRES_KAPPA = 0.1
NEWTON_GMRES_RTOL = 1e-3

# ---------------------------------------------------------------------------------------------
# Tableaus, as data.
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# The solvers.
# ---------------------------------------------------------------------------------------------


def _flat_rhs(f, y0, args):
    """``(x0, unravel, fx)``: the state as one vector and ``fx(t, x, args) -> flat dy/dt``."""
    x0, unravel = ravel_pytree(y0)

    def fx(t, x, a):
        return ravel_pytree(f(t, unravel(x), a))[0]

    return x0, unravel, fx


def _lincomb(coeffs, vecs, scale=None):
    """``scale * sum_j coeffs[j] vecs[j]`` over the nonzero coefficients (Python floats)."""
    acc = None
    for cj, v in zip(coeffs, vecs, strict=False):
        if cj == 0:
            continue
        term = v if cj == 1 else cj * v
        acc = term if acc is None else acc + term
    if acc is None:
        acc = jnp.zeros_like(vecs[0])
    return acc if scale is None else scale * acc


class _Implicit(AbstractSolver):
    """What the implicit solvers share: linear algebra options and the Newton settings."""

    tableau: object
    #: an implicit (stiff) solver: og.Auto picks an adjoint that differentiates its steps
    implicit = True
    #: Hairer & Wanner's 1e-4: with 1e-2 the steps grow faster, and Kvaerno5 on Van der Pol
    #: (mu = 1000, rtol 1e-8) took 22 steps for 27 but erred 1.3e-5 for under 1e-5
    prev_ratio_floor = 1e-4

    def __init__(
        self,
        linear_solver: str = "auto",
        *,
        preconditioner: Callable | None = None,
        newton_rtol: float | None = None,
        newton_atol: float | None = None,
        max_newton_iters: int = 10,
        jacobian_reuse_rate: float = 1e-3,
        gmres_tol: float | None = None,
        gmres_restart: int = 20,
        gmres_maxiter: int = 20,
    ):
        name = type(self).__name__
        self.linear_solver = _linear.check_linear_solver(linear_solver, name)
        if preconditioner is not None and not callable(preconditioner):
            raise TypeError(
                f"{name}(preconditioner={preconditioner!r}): pass a function "
                "preconditioner(t, y, args, c) returning v -> (approximately) (I - c J)^{-1} v, "
                "or None."
            )
        if preconditioner is not None and linear_solver == "dense":
            raise ValueError(
                f"{name}(preconditioner=...) is for linear_solver='gmres' (or 'auto' on large "
                "states); the dense LU needs none."
            )
        if not (isinstance(max_newton_iters, int) and max_newton_iters >= 1):
            raise ValueError(f"{name}(max_newton_iters={max_newton_iters!r}): use an int >= 1.")
        for arg, v in (("newton_rtol", newton_rtol), ("newton_atol", newton_atol)):
            if v is not None and not v > 0:
                raise ValueError(f"{name}({arg}={v!r}): use a positive tolerance or None.")
        self.preconditioner = preconditioner
        self.newton_rtol = newton_rtol
        self.newton_atol = newton_atol
        self.max_newton_iters = max_newton_iters
        if gmres_tol is not None and not 0 < gmres_tol < 1:
            raise ValueError(
                f"{name}(gmres_tol={gmres_tol!r}): a relative tolerance in (0, 1), or None "
                "(1e-8; float32 1.2e-6). The Rosenbrock stages and every derivative solve "
                "use it as their accuracy."
            )
        for arg, v in (("gmres_restart", gmres_restart), ("gmres_maxiter", gmres_maxiter)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name}({arg}={v!r}): use an int >= 1.")
        rate = jacobian_reuse_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < 1:
            raise ValueError(
                f"{name}(jacobian_reuse_rate={rate!r}): use a float in [0, 1): the Newton "
                "contraction rate below which the dense Jacobian is kept for the next step "
                "(1e-3 default; about 0.1 when Jacobians are costly; 0 computes one every step)."
            )
        self.jacobian_reuse_rate = float(rate)
        self.gmres_tol = gmres_tol
        self.gmres_restart = gmres_restart
        self.gmres_maxiter = gmres_maxiter
        tab = self.tableau
        self.order = tab.order
        self.embedded_order = tab.embedded_order

    def __repr__(self) -> str:
        return f"{type(self).__name__}(linear_solver={self.linear_solver!r})"

    def with_user_args(self, user_args):
        if self.preconditioner is None:
            return self
        new = dataclasses.replace(self) if dataclasses.is_dataclass(self) else _copy(self)
        if user_args is None:  # another system (a backward adjoint): the user's P does not apply
            new.preconditioner = None
        else:
            p = self.preconditioner
            new.preconditioner = lambda t, y, a, c: p(t, y, user_args(a), c)
        return new

    def with_tolerances(self, rtol, atol):
        """This solver inside ``og.Adaptive(rtol, atol)``: Newton stops at ``NEWTON_KAPPA``
        times the controller's tolerances (unless ``newton_rtol``/``newton_atol`` were given),
        and its GMRES solves at what that Newton test can see. Traced tolerances are ignored
        (the float defaults apply)."""
        try:  # (tolerances per entry: the tightest)
            rtol, atol = float(tightest_tolerance(rtol)), float(tightest_tolerance(atol))
        except (TypeError, jax.errors.ConcretizationTypeError):
            return self
        new = _copy(self)
        new.controller_tol = (rtol, atol)
        return new

    # -- pieces of a step ------------------------------------------------------------------------
    def _gmres_kw(self, dtype):
        """GMRES settings of the exact linear solves (Rosenbrock stages, derivatives)."""
        tol = self.gmres_tol
        if tol is None:
            tol = max(1e-8, 10 * float(jnp.finfo(dtype).eps))
        return {"tol": tol, "restart": self.gmres_restart, "maxiter": self.gmres_maxiter}

    def _precond(self, t, y0, args, c, unravel):
        """The user's preconditioner on flat vectors, or None."""
        if self.preconditioner is None:
            return None
        apply = self.preconditioner(t, y0, args, c)
        return lambda v: ravel_pytree(apply(unravel(v)))[0]

    def _newton_tols(self, dtype) -> tuple[float, float]:
        eps = float(jnp.finfo(dtype).eps)
        ctrl = getattr(self, "controller_tol", None)
        if ctrl is None:
            rtol = max(1e-10, 1e3 * eps)
            atol = 1e-2 * rtol
        else:
            rtol = max(NEWTON_KAPPA * ctrl[0], 1e3 * eps)
            atol = NEWTON_KAPPA * ctrl[1] if ctrl[1] > 0 else 1e-2 * rtol
        if self.newton_rtol is not None:
            rtol = self.newton_rtol
        if self.newton_atol is not None:
            atol = self.newton_atol
        return rtol, atol

    def _newton_scale(self, x0):
        rtol, atol = self._newton_tols(x0.dtype)
        return jax.lax.stop_gradient(atol + rtol * jnp.abs(x0))

    def _newton_gmres_kw(self, scale, gmres_kw):
        """GMRES inside Newton (inexact Newton): the increment need only be accurate to a
        fraction of the Newton tolerance, ``||error||_2 <= GMRES_KAPPA sqrt(n) min(scale)``
        (then its scaled RMS error is below ``GMRES_KAPPA``), or ``NEWTON_GMRES_RTOL`` of the
        right-hand side (a forcing term: early iterations need no exact increments); the
        user's ``gmres_tol``, when given, replaces the latter."""
        kw = dict(gmres_kw)
        if self.gmres_tol is None:
            kw["tol"] = NEWTON_GMRES_RTOL
        kw["atol"] = GMRES_KAPPA * jnp.sqrt(scale.size) * jnp.min(scale)
        return kw


def _copy(obj):
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


class _ESDIRK(_Implicit):
    """An ESDIRK method from an :class:`ESDIRKTableau`; see the module docstring."""

    tableau: ESDIRKTableau
    init_evals = 1
    #: the carried first stage is ``(z_s - psi_s) / (gamma dt)`` from the Newton root, equal to
    #: ``f(t1, y1)`` only to the Newton tolerance, so checkpoints keep it with ``y``
    state_from_y = False

    @property
    def step_evals(self) -> int:
        # a nominal count, one per implicit stage: step() reports the Newton iterations made
        return self.tableau.stages - 1

    def _carries_jacobian(self, n: int) -> bool:
        return self.jacobian_reuse_rate > 0 and _linear.resolve(self.linear_solver, n) == "dense"

    def init(self, f, t0, y0, args):
        """``(k_1, reuse)``: the first stage ``f(t0, y0)`` and, for the dense linear solver with
        Jacobian reuse, ``(J, keep)``: the last Jacobian and whether the next step may keep it
        (a float flag; 0 here, so the first step computes one). ``reuse = ()`` (GMRES, no
        reuse, or an adjoint's replay: :meth:`compact_state`) builds a Jacobian every step."""
        k_first = f(t0, y0, args)
        x = ravel_pytree(y0)[0]
        if not self._carries_jacobian(x.size):
            return k_first, ()
        return k_first, (jnp.zeros((x.size, x.size), x.dtype), jnp.zeros((), x.dtype))

    def compact_state(self, state):
        """What the adjoints checkpoint: the carried stage alone. The Jacobian is a cache, and
        an n x n one per checkpoint would cost far more memory than the state; a replayed
        step from ``(k_1, ())`` builds its own (Newton reaches the same root, to its
        tolerance)."""
        return state[0], ()

    def step(self, f, t0, dt, y0, args, state):
        tab = self.tableau
        k_first, reuse = state
        x0, unravel, fx = _flat_rhs(f, y0, args)
        k0 = ravel_pytree(k_first)[0]
        kind = _linear.resolve(self.linear_solver, x0.size)
        c = tab.gamma * dt
        gmres_kw = self._gmres_kw(x0.dtype)
        scale = self._newton_scale(x0)

        # the iteration matrix M = I - c J(t0, y0): a constant of the iteration, never
        # differentiated (the root does not depend on it)
        sg = jax.lax.stop_gradient
        t_ng, c_ng = sg(t0), sg(c)
        precond = self._precond(t_ng, sg(y0), sg(args), c_ng, unravel)
        kept = False  # whether this step iterates with the previous step's Jacobian
        if kind == "dense":
            f_ng = lambda x: fx(t_ng, x, sg(args))
            fresh_jac = lambda: _linear.jacobian(f_ng, sg(x0))
            if reuse:
                # Hairer & Wanner's policy (Solving ODEs II, IV.8; radau5): the Jacobian is
                # kept for the next step while Newton converged fast with it; the LU is redone
                # (dt changes). A rejected step's retry starts from the same kept Jacobian
                # (the loop keeps the state of the last accepted step).
                jac_old, keep = sg(reuse)
                kept = keep > 0
                # a fresh Jacobian only when some member needs one (under jax.vmap a plain
                # conditional on the batched flag computed it for every member every step)
                jac = member_cond(keep <= 0, fresh_jac, lambda: jac_old, differentiable=False)
            else:
                jac = sg(fresh_jac())
            lu = _linear.iteration_lu(jac, c_ng)
            linsys = _linear.DenseNewton(lu)
        else:
            linsys = _linear.KrylovNewton(precond=precond, **self._newton_gmres_kw(scale, gmres_kw))
        tangent = _linear.tangent_solver(kind, gmres_kw, precond, lu if kind == "dense" else None)

        def solve_stage(psi, guess, ti):
            def residual(zz):
                return zz - psi - c * fx(ti, zz, args)

            return stage_root(residual, guess, linsys, scale, self.max_newton_iters, tangent)

        s = tab.stages
        if kind == "dense":
            # Small systems: the stages unrolled, with the tableau's coefficients as constants
            # (a loop's per-iteration overhead, and its tiny matrix products, would cost more
            # at run time than its smaller program saves at compile time).
            ks, failed, rate, evals = [k0], jnp.asarray(False), jnp.zeros((), x0.dtype), 0
            for i in range(1, s):
                psi = x0 + _lincomb(tab.a[i - 1], ks, dt)
                guess = psi + _lincomb(tab.predictor[i - 1], ks, c)
                z, fail_i, rate_i, iters = solve_stage(psi, guess, t0 + tab.c[i] * dt)
                # A kept Jacobian whose first iterate passed has shown no contraction rate
                # (newton reports 0): keeping it on that evidence kept t0's Jacobian for good,
                # and its one chord step left an error of order the increment itself. In
                # float32, where Newton's floor (1e3 eps) exceeds a tight rtol, that error ruled
                # the estimate, and Robertson (rtol 1e-5) crawled: 3000 steps to t = 4.5 of 100
                # with Kvaerno5, against 81 steps to t = 100 with a fresh Jacobian each step.
                rate_i = jnp.where(kept & (iters <= 1), jnp.inf, rate_i)
                failed, rate = failed | fail_i, jnp.maximum(rate, rate_i)
                evals = evals + iters
                ks.append((z - psi) / c)
        else:
            # Large (GMRES) systems: the stages in one loop, so that the Newton-Krylov solve is
            # traced and compiled once, not once per stage; stage i reads row i of the padded
            # tableau and writes row i of ks.
            dtype = x0.dtype
            a_mat, p_mat = np.zeros((s, s)), np.zeros((s, s))
            for i in range(1, s):
                a_mat[i, :i] = tab.a[i - 1]
                p_mat[i, :i] = tab.predictor[i - 1]
            a_mat, p_mat = jnp.asarray(a_mat, dtype), jnp.asarray(p_mat, dtype)
            c_vec = jnp.asarray(tab.c, dtype)

            def stage(i, carry):
                ks, _, failed, evals = carry
                psi = x0 + dt * (a_mat[i] @ ks)
                z, fail_i, _, iters = solve_stage(
                    psi, psi + c * (p_mat[i] @ ks), t0 + c_vec[i] * dt
                )
                return ks.at[i].set((z - psi) / c), z, failed | fail_i, evals + iters

            ks0 = jnp.zeros((s, x0.size), dtype).at[0].set(k0)
            init = (ks0, x0, jnp.asarray(False), jnp.zeros((), jnp.int32))
            ks, z, failed, evals = jax.lax.fori_loop(1, s, stage, init)
            ks = [ks[i] for i in range(s)]
        err = _lincomb(tab.b_error, ks, dt)
        # a failed Newton solve: reject (adaptive) or report non-finite (fixed steps)
        err = jnp.where(failed, jnp.inf, err)
        x1 = jnp.where(failed, jnp.nan, z)
        y1, k_last = unravel(x1), unravel(ks[-1])
        if tab.dense is None:
            dense = (y0, y1, k_first, k_last, dt)
        else:
            dense = (y0, dt, tuple(unravel(k) for k in ks))
        if reuse:
            keep = (rate <= self.jacobian_reuse_rate) & ~failed
            reuse = (jac, keep.astype(x0.dtype))
        return StepResult(y1, unravel(err), dense, (k_last, reuse), evals)

    def interpolate(self, dense, theta):
        return stage_interpolant(self.tableau.dense, dense, theta)


class ImplicitEuler(_ESDIRK):
    """Backward Euler, order 1, L-stable; error estimate against the trapezoidal rule
    (``dt (f1 - f0) / 2``); cubic Hermite dense output. Robust, first order: for rough
    problems, loose tolerances, or as a fixed-step baseline.

    Args:
        linear_solver: ``"auto"`` (default: ``"dense"`` up to 256 state entries, else
            ``"gmres"``), ``"dense"`` or ``"gmres"``.
        preconditioner: for ``"gmres"``: ``preconditioner(t, y, args, c)`` returning a function
            ``v -> (I - c J)^{-1} v`` (approximately; ``v`` and the result shaped like ``y``).
        newton_rtol: Newton stops when its predicted error is below ``newton_atol +
            newton_rtol |y|``. Default: inside ``og.Adaptive(rtol, atol)`` 1% of ``rtol``
            (``NEWTON_KAPPA``; at least ``1e3`` machine epsilons), else ``1e-10`` in float64,
            ``1.2e-4`` in float32.
        newton_atol: as ``newton_rtol``; default 1% of ``atol`` inside ``og.Adaptive``, else
            ``1e-12`` in float64, ``1.2e-6`` in float32.
        max_newton_iters: iterations before a stage counts as failed (the step is rejected).
        jacobian_reuse_rate: dense linear solver: keep the Jacobian for the next step while
            every Newton contraction rate stays at most this (default ``1e-3``, Hairer's
            ``thet``; ``0.1`` when Jacobians are costly; ``0`` builds one every step). A
            kept Jacobian under which a stage passed its first iterate (no rate measured) is
            rebuilt.
        gmres_tol: GMRES's relative tolerance (default ``1e-8``, float32 ``1.2e-6``).
        gmres_restart: its Krylov subspace size.
        gmres_maxiter: its number of restarts.

    Example:
        >>> sol = og.solve(f, y0, (0.0, 1.0), solver=og.ImplicitEuler(), step=og.Fixed(0.01))
    """

    tableau = IMPLICIT_EULER


class Kvaerno3(_ESDIRK):
    """Kværnø's ESDIRK 3(2): 4 stages (3 implicit), L-stable, stiffly accurate, FSAL; cubic
    Hermite dense output (order 3). For stiff problems at moderate tolerances (1e-3..1e-6).
    Arguments as :class:`ImplicitEuler`.

    Example:
        >>> sol = og.solve(f, y0, (0.0, 100.0), args, solver=og.Kvaerno3())
    """

    tableau = KVAERNO3


class Kvaerno5(_ESDIRK):
    """Kværnø's ESDIRK 5(4): 7 stages (6 implicit), L-stable, stiffly accurate, FSAL; a
    4th-order continuous extension from the stages (derived from the order conditions, exact
    for cubic slow manifolds of stiff components). The accurate Newton-based stiff solver:
    tight tolerances, large or matrix-free (``linear_solver="gmres"``) systems. Arguments as
    :class:`ImplicitEuler`.

    Example:
        >>> sol = og.solve(f, y0, (0.0, 100.0), args, solver=og.Kvaerno5(),
        ...                step=og.Adaptive(rtol=1e-8, atol=1e-10))
    """

    tableau = KVAERNO5
