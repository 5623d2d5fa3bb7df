"""Implicit solvers for stiff problems: the ESDIRK methods (Newton), and what they share with
the Rosenbrock method of :mod:`odegrad.solvers.rosenbrock` (options, linear algebra, tolerances).

Each method is data — an :class:`~odegrad.solvers.esdirk_tableaus.ESDIRKTableau` or a
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

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .._batching import member_cond
from .._tree import tightest_tolerance
from . import _linear
from ._newton import stage_root
from .base import AbstractSolver, StepResult
from .esdirk_tableaus import IMPLICIT_EULER, KVAERNO3, KVAERNO5, ESDIRKTableau
from .explicit_rk import stage_interpolant

#: Newton stops at this fraction of the adaptive controller's tolerances (Hairer & Wanner's
#: ``kappa``, Solving ODEs II, IV.8: 1e-2..1e-1); without a controller at ``1e-10`` (float64).
NEWTON_KAPPA = 1e-2
#: GMRES inside Newton: the increment's scaled error below this (relative to the Newton
#: tolerance), or the linear residual below ``NEWTON_GMRES_RTOL`` of the right-hand side.
GMRES_KAPPA = 0.1
NEWTON_GMRES_RTOL = 1e-3

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
