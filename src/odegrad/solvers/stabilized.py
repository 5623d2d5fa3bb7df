"""Stabilised explicit Runge–Kutta methods for diffusion-dominated (mildly stiff) problems.

RKC (damped Chebyshev, order 2), ROCK2 and ROCK4 (Abdulle's orthogonal Runge–Kutta–Chebyshev
methods, orders 2 and 4) take ``s`` explicit stages per step, where ``s`` grows like
``sqrt(dt * rho)`` with ``rho`` the spectral radius of the Jacobian: their stability interval on
the negative real axis has length ``~ beta * s**2`` (RKC 0.653, ROCK2 0.811, ROCK4 0.353), so a
step ``dt`` costs ``~ sqrt(dt * rho / beta)`` evaluations instead of the ``~ dt * rho / 2`` of
forward Euler.

``rho`` comes from a user's ``spectral_radius(t, y, args)`` or from a warm-started power iteration
on Jacobian-vector products ``jax.jvp(lambda y: f(t, y, args), (y,), (v,))`` carried in the
solver state (then ``state_from_y`` is false: the vector cannot be recomputed from ``y``), times a
safety factor. Before the first step the iteration makes at most ``init_power_iters = 20``
products and stops once two successive estimates agree to ``power_rtol = 1 %`` (``rkc.f``'s rule;
~6-12 products on diffusion stencils, whose estimate rises to ~0.93-0.96 of the spectral radius
where 20 products reach ~0.96-0.99). The estimate is reused for ``rho_every = 25`` accepted steps
and then refreshed, warm-started from the last vector, as RKC does (``nstsig = mod(nstsig+1,
25)`` in Sommeijer's ``rkc.f``): per step the iteration costs a Jacobian-vector product, a
stencil pass as dear as a stage. After a rejected step it is refreshed where the retry starts
unless it was made there (``rkc.f``'s ``newspc = .not. jacatt``; :meth:`_Stabilized.after_step`,
the loops' hook): stiffness that grows between refreshes then costs one JVP instead of a run of
rejections. The stage count is a discrete choice made under ``lax.stop_gradient``: no
derivative flows through ``rho``.

Differentiability. The stage count varies per step at run time, so the stages of a step run in
a ``lax.fori_loop`` over the stages really taken (:func:`two_step_recurrence`; ROCK2's finishing
procedure is two more stages of the same form), and the loop carries its own derivative rules,
since a dynamic-length loop cannot be reverse-differentiated by JAX: a ``jax.custom_jvp`` whose
tangent is a linear map with a hand-written transpose (``lax.custom_linear_solve`` with the
identity as its matrix). Forward mode runs the tangent recurrence; reverse mode (``jax.vjp`` of
the step: the Discrete adjoint) runs the transposed recurrence, stage ``n`` down to 1, with one
``jax.vjp`` of ``f`` per stage taken, over stages that the primal pass kept or that the reverse
pass recomputes once into a buffer (:mod:`._recurrence` holds this machinery). The continuous
adjoints integrate the adjoint equation with these solvers forward in their own time. Second
derivatives through a step are not supported. Every state is a loop output, so XLA materialises
it before the next stencil reads it (instead of recomputing its producer once per neighbour).

Stage counts are capped by ``max_stages`` (RKC) or by the largest tabulated degree carried in
:mod:`._rock_coefficients` (ROCK2: 200 stages, ``dt * rho <~ 32400``; ROCK4: 152 stages,
``dt * rho <~ 8150``), which bounds the stable ``dt * rho`` by :attr:`_Stabilized.stability_limit`
(``rho`` with the safety factor). An adaptive solve clips its steps to ``stability_limit / rho``
(:meth:`_Stabilized.max_step`, the solver hook the loop reads). A longer step (a fixed step,
``og.Fixed`` / ``og.StepTo``) is not stable and is not taken silently: its ``y1`` is NaN, so the
solve fails with ``Result.nonfinite`` (an error with ``throw=True``).

The carried state is ``(f(t, y), rho, v, age)`` (``age``: accepted steps since ``rho`` was
estimated); ``f(t1, y1)`` is the next step's first stage and the
end slope of the cubic Hermite dense output. Each step reports the right-hand-side evaluations
it really made (stages and the closing ``f(t1, y1)``) as ``StepResult.evals``, and
:meth:`_Stabilized.after_step` those of a refresh (one per power-iteration JVP); the loops sum
both into ``sol.stats["rhs_evals"]``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._batching import any_member, run_if
from .._tree import tree_where
from . import _rock_coefficients as _rc
from ._power_iteration import _start_vector, power_iteration
from ._recurrence import _lc, _like, _sg, two_step_recurrence
from .base import AbstractSolver, StepResult
from .explicit_rk import hermite


class _Stabilized(AbstractSolver):
    """Shared machinery: spectral radius, stage choice, state, dense output, eval count."""

    #: reverse mode keeps a step's recurrence inputs and outputs, not its stages: ~5 fields a
    #: step (ROCK2, 40^3, 8 fixed steps against 4: 19.5 more fields of temporary memory)
    step_residuals = 3

    @property
    def state_from_y(self) -> bool:
        """With a ``spectral_radius`` the carried state ``(f(t, y), rho(t, y, args), None)`` is
        what :meth:`init` computes at any accepted step, so the Discrete adjoint's checkpoints
        keep ``y`` alone (half the memory) and recompute ``f(t, y)`` in place of the step's
        closing ``f(t1, y1)`` (no more evaluations); the power iteration's warm-started
        vector is not recomputable."""
        return self.spectral_radius is not None

    #: length of the stability interval ~ beta * s**2 (for documentation and tests)
    beta: float

    def __init__(
        self,
        spectral_radius=None,
        *,
        safety: float = 1.2,
        power_iters: int = 1,
        init_power_iters: int = 20,
        power_rtol: float = 0.01,
        rho_every: int = 25,
    ):
        """
        Args:
            spectral_radius: optional ``spectral_radius(t, y, args) -> float``, an upper bound of
                the spectral radius of ``df/dy``; it replaces the power iteration.
            safety: factor applied to the spectral-radius estimate before choosing the stages.
            power_iters: JVP power-iteration steps per refresh of the estimate (warm-started
                from the last vector).
            init_power_iters: power-iteration steps before the first step, at most.
            power_rtol: stop the power iteration once two successive estimates agree to this
                relative tolerance (``rkc.f``'s 1 %; OrdinaryDiffEq's ``maxeig!`` 5 %); 0 runs
                every step asked for.
            rho_every: refresh the power-iteration estimate every this many accepted steps
                (1: every step).
        """
        name = type(self).__name__
        if int(rho_every) < 1:
            raise ValueError(f"{name}(rho_every={rho_every!r}): must be a positive int.")
        if not (isinstance(safety, int | float) and 0 < safety < math.inf):
            raise ValueError(
                f"{name}(safety={safety!r}): a positive factor on the spectral-radius estimate "
                "(default 1.2); below 1 the stages can be too few for the step (unstable)."
            )
        for arg, n in (("power_iters", power_iters), ("init_power_iters", init_power_iters)):
            if not (isinstance(n, int | np.integer) and n >= 1):
                raise ValueError(
                    f"{name}({arg}={n!r}): at least 1 power-iteration step (without one the "
                    "spectral radius is never estimated); pass spectral_radius= to skip them."
                )
        if not (isinstance(power_rtol, int | float) and 0 <= power_rtol < 1):
            raise ValueError(
                f"{name}(power_rtol={power_rtol!r}): a relative tolerance in [0, 1) between two "
                "successive spectral-radius estimates (default 0.01; 0 runs every step)."
            )
        if spectral_radius is not None and not callable(spectral_radius):
            raise TypeError(
                f"{name}(spectral_radius={spectral_radius!r}): a function "
                "spectral_radius(t, y, args) -> scalar (an upper bound of df/dy's spectral "
                "radius), or None for the power iteration."
            )
        self.rho_every = int(rho_every)
        self.spectral_radius = spectral_radius
        self.safety = float(safety)
        self.power_iters = int(power_iters)
        self.init_power_iters = int(init_power_iters)
        self.power_rtol = float(power_rtol)
        # static upper bound (the loops count init_from's)
        self.init_evals = 1 + (0 if spectral_radius is not None else self.init_power_iters)
        # static upper bound (the loops use the per-step ``StepResult.evals`` instead)
        self.step_evals = self.max_stages + (0 if spectral_radius is not None else power_iters)

    def with_user_args(self, user_args):
        if self.spectral_radius is None:
            return self
        import copy

        solver = copy.copy(self)
        if user_args is None:  # another system: estimate its spectrum by power iteration
            solver.spectral_radius = None
            solver.init_evals = 1 + self.init_power_iters
            solver.step_evals = self.max_stages + self.power_iters
            return solver
        bound = self.spectral_radius
        solver.spectral_radius = lambda t, y, args: bound(t, y, user_args(args))
        return solver

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # -- spectral radius -------------------------------------------------------------------
    #: a restart keeps the spectral-radius estimate: one evaluation, the first stage
    restart_evals = 1

    def _rho(self, f, t, y, args, v, iters):
        """``(rho, v, products)``: the estimate with the safety factor, the power iteration's
        next vector and the Jacobian-vector products it took (none with a user's bound)."""
        if self.spectral_radius is not None:
            rho = self.spectral_radius(_sg(t), _sg(y), _sg(args))
            if rho is None or jnp.shape(rho) != ():
                raise ValueError(
                    f"{type(self).__name__}(spectral_radius=...) returned "
                    f"{'None' if rho is None else f'shape {jnp.shape(rho)}'}: it must return one "
                    "scalar, an upper bound of the spectral radius of df/dy at (t, y) (e.g. "
                    "4 * D * ndim / dx**2 for a diffusion stencil)."
                )
            rho = jnp.abs(jnp.asarray(rho, jnp.result_type(t)))
            return lax.stop_gradient(self.safety * rho), None, 0
        rho, v, products = power_iteration(f, t, y, args, v, iters, self.power_rtol)
        return self.safety * rho, v, products

    def _init(self, f, t0, y0, args):
        f0 = f(t0, y0, args)
        v0 = None if self.spectral_radius is not None else _start_vector(y0)
        rho, v, products = self._rho(f, t0, y0, args, v0, self.init_power_iters)
        # age as a float: adjoints carry cotangents of the whole state, and an int has none
        return (f0, rho, v, jnp.zeros((), jnp.result_type(rho))), 1 + products

    def init(self, f, t0, y0, args):
        return self._init(f, t0, y0, args)[0]

    def resume_state(self, state):
        """The power iteration's ``(rho, v, age)``: a solve continuing from here (the next
        backward interval of a continuous adjoint) starts from this estimate instead of
        ``init_power_iters`` fresh JVPs. With a user's bound, nothing (:meth:`init` evaluates
        it)."""
        return None if self.spectral_radius is not None else state[1:]

    def init_from(self, f, t0, y0, args, previous):
        """:meth:`init` keeping a previous solve's estimate where it is usable (finite and
        positive; else ``init_power_iters`` JVPs warm-started from its vector). Its ``age`` is
        at least 1, so that a rejection at the start refreshes it (the state may have jumped
        there: an event)."""
        if previous is None or self.spectral_radius is not None:
            return self._init(f, t0, y0, args)
        rho, v, age = previous
        f0 = f(t0, y0, args)
        stale = ~(jnp.isfinite(rho) & (rho > 0))
        t, y, a = _sg((t0, y0, args))

        def estimate(carry):
            rho_old, v_old, _ = carry
            rho_n, v_n, n = self._rho(f, t, y, a, v_old, self.init_power_iters)
            return jnp.where(stale, rho_n, rho_old), tree_where(stale, v_n, v_old), n

        # (under vmap, run when any member has no estimate; the others keep theirs)
        rho, v, products = run_if(any_member(stale), estimate, (*_sg((rho, v)), jnp.int32(0)))
        age = jnp.where(stale, 0, jnp.maximum(age, 1)).astype(age.dtype)
        evals = 1 + jnp.where(stale, products, 0)
        return (f0, rho, v, age), evals

    def restart(self, f, t, y, args, state):
        """Past a jump in ``f``: a fresh first stage, the spectral-radius estimate kept (as
        :meth:`init_from` keeps a previous solve's; a rejection refreshes it)."""
        return self.init_from(f, t, y, args, self.resume_state(state))[0]

    # -- to be provided by each method -----------------------------------------------------
    max_stages: int
    #: the stage recurrence has a first-order derivative rule (``_recurrence``) only
    second_derivatives = False

    def stage_count(self, h_rho):
        """Total stages (``f`` evaluations, the carried first stage included) for ``|dt|*rho``."""
        raise NotImplementedError

    @property
    def stability_limit(self) -> float:
        """The largest ``|dt| * rho`` the stage rule covers with the stages the method carries
        (``rho`` including the safety factor); a longer step would need more stages."""
        raise NotImplementedError

    def max_step(self, state):
        """``stability_limit / rho`` (``inf`` while ``rho`` is 0): the adaptive loop's step cap."""
        rho = state[1]
        ok = rho > 0
        cap = jnp.asarray(self.stability_limit, rho.dtype) / jnp.where(ok, rho, 1.0)
        return lax.stop_gradient(jnp.where(ok, cap, jnp.inf))

    def _advance(self, f, t0, dt, y0, args, f0, h_rho):
        """``(y1, error_of, n_evals)``: the new state, ``error_of(f(t1, y1))`` -> the local error
        estimate, and the evaluations of ``f`` made (the carried ``f(t0, y0)`` excluded)."""
        raise NotImplementedError

    # -- the step ----------------------------------------------------------------------------
    def step(self, f, t0, dt, y0, args, state):
        f0, rho, v, age = state
        h_rho = lax.stop_gradient(jnp.abs(dt) * rho)
        # a step beyond the stability limit (a too-long fixed step) fails instead of silently
        # going unstable: a NaN step size makes every stage, y1 and the error NaN, so the loops
        # report Result.nonfinite (adaptive ones never get here: max_step caps their steps). A
        # NaN in a scalar costs no pass over the state (a select over y1 costs one; fused into
        # the stencil that reads it, XLA:CPU's kernel ran ~10x slower). f then sees NaN times
        # and states in that step: a check inside f (eqx.error_if) raises instead.
        # (negated: a NaN spectral radius, from a user's bound or the power iteration, fails too)
        unstable = ~(h_rho <= self.stability_limit * (1.0 + 1e-5))
        poison = lax.stop_gradient(jnp.where(unstable, jnp.nan, 0.0).astype(jnp.result_type(dt)))
        y1, err_of, n_evals = self._advance(f, t0, dt + poison, y0, args, f0, h_rho)
        t1 = t0 + dt
        f1 = f(t1, y1, args)
        error = err_of(f1)
        # (rho, v, age) pass through unchanged: after_step revises them once the step is
        # accepted or rejected, so a loop that keeps the old state costs no select over v
        evals = (n_evals + 1).astype(jnp.int32)
        return StepResult(y1, error, (y0, y1, f0, f1, dt), (f1, rho, v, age), evals)

    def after_step(self, f, t, y, args, state, accepted, rejected):
        """The spectral radius for the next attempt from ``(t, y)``. With a user's bound, its
        value there once a step is accepted. With the power iteration, a refresh (warm-started,
        ``power_iters`` JVPs) once the estimate is ``rho_every`` accepted steps old, and after
        a rejection unless the estimate was made where the retry starts (``age`` 0), as
        ``rkc.f`` does (``newspc = .not. jacatt``): a rejection often means ``rho`` has grown
        since. The retry's step cap (:meth:`max_step`) and stage count then use it."""
        f0, rho, v, age = state
        if self.spectral_radius is not None:
            bound = self._rho(f, t, y, args, None, 0)[0]
            return (f0, jnp.where(accepted, bound, rho), v, age), 0
        due = (accepted & (age + 1 >= self.rho_every)) | (rejected & (age > 0))
        t, y, args = _sg((t, y, args))

        def refresh(carry):
            rho, v, _ = carry
            rho_n, v_n, n = self._rho(f, t, y, args, v, self.power_iters)
            # a breakdown (every product zero or non-finite) gives rho_n = 0: keep the estimate
            ok = due & (rho_n > 0)
            return jnp.where(ok, rho_n, rho), tree_where(ok, v_n, v), n

        # under vmap it runs when any member is due (a batched predicate would run the power
        # iteration for every member on every step); a loop of at most one trip, so that v is
        # not copied on the steps that keep it (run_if)
        rho, v, products = run_if(any_member(due), refresh, (*_sg((rho, v)), jnp.int32(0)))
        age = jnp.where(due, 0, jnp.where(accepted, age + 1, age)).astype(age.dtype)
        return (f0, rho, v, age), jnp.where(due, products, 0)

    def interpolate(self, dense, theta):
        y0, y1, f0, f1, dt = dense
        return hermite(y0, y1, f0, f1, dt, theta)


# ----------------------------------------------------------------------------------------------
# RKC
# ----------------------------------------------------------------------------------------------


class RKC(_Stabilized):
    """Sommeijer–Shampine–Verwer damped Runge–Kutta–Chebyshev method, order 2.

    ``s >= 2`` stages from the three-term Chebyshev recurrence with damping ``eps = 2/13``
    (B. P. Sommeijer, L. F. Shampine, J. G. Verwer, "RKC: an explicit solver for parabolic
    PDEs", J. Comput. Appl. Math. 88 (1997) 315–326; Verwer, Hundsdorfer & Sommeijer 1990);
    stability interval ``~ 0.653 s**2``, stage count ``s = 1 + floor(sqrt(1 + 1.54 |dt| rho))``.
    Error estimate of the RKC paper: ``(12 (y0 - y1) + 6 dt (f0 + f1)) / 15`` (``O(dt**3)``).

    Example:
        >>> og.solve(heat, u0, (0., 1.), solver=og.RKC(), step=og.Adaptive(1e-6, 1e-8))
    """

    order = 2
    embedded_order = 2  # the estimate is O(dt**3), like an order-2 embedded pair
    beta = 0.653
    eps = 2.0 / 13.0

    def __init__(self, spectral_radius=None, *, max_stages: int = 100, **kw):
        if not (isinstance(max_stages, int | np.integer) and max_stages >= 2):
            raise ValueError(f"RKC(max_stages={max_stages!r}): an int >= 2 (default 100).")
        self.max_stages = int(max_stages)
        super().__init__(spectral_radius, **kw)

    @property
    def stability_limit(self) -> float:
        # s = 1 + floor(sqrt(1 + 1.54 h_rho)) <= max_stages
        return (self.max_stages**2 - 1) / 1.54

    def stage_count(self, h_rho):
        s = 1 + jnp.floor(jnp.sqrt(1.0 + 1.54 * h_rho))
        return jnp.clip(s, 2, self.max_stages).astype(jnp.int32)

    def _advance(self, f, t0, dt, y0, args, f0, h_rho):
        s = self.stage_count(h_rho)
        tdt = jnp.result_type(dt)
        sf = s.astype(tdt)
        w0 = 1.0 + self.eps / (sf * sf)
        temp1 = w0 * w0 - 1.0
        temp2 = jnp.sqrt(temp1)
        arg = sf * jnp.log(w0 + temp2)
        w1 = jnp.sinh(arg) * temp1 / (jnp.cosh(arg) * sf * temp2 - w0 * jnp.sinh(arg))
        b1 = 1.0 / (2.0 * w0) ** 2
        mus1 = w1 * b1
        zero, one = jnp.zeros((), tdt), jnp.ones((), tdt)
        # the stage pair (u_{j-2}, u_{j-1}) and the scalar Chebyshev quantities of each stage
        prev = {"y": y0, "th": zero, "z": one, "dz": zero, "d2z": zero, "b": b1}
        cur = {"y": _lc((1.0, y0), (dt * mus1, f0)), "th": mus1, "z": w0, "dz": one,
               "d2z": zero, "b": b1}  # fmt: skip

        def stage(c1, c2, _, theta, consts):
            t0, dt, y0, f0, args = theta
            w0, w1 = consts
            zj = 2 * w0 * c1["z"] - c2["z"]
            dzj = 2 * w0 * c1["dz"] - c2["dz"] + 2 * c1["z"]
            d2zj = 2 * w0 * c1["d2z"] - c2["d2z"] + 4 * c1["dz"]
            bj = d2zj / (dzj * dzj)
            a1 = 1.0 - c1["z"] * c1["b"]
            mu = 2 * w0 * bj / c1["b"]
            nu = -bj / c2["b"]
            mus = mu * w1 / w0
            k = f(t0 + dt * c1["th"], c1["y"], args)
            yj = _lc(
                (mu, c1["y"]),
                (nu, c2["y"]),
                (1.0 - mu - nu, y0),
                (dt * mus, k),
                (-dt * mus * a1, f0),
            )
            thj = mu * c1["th"] + nu * c2["th"] + mus * (1.0 - a1)
            return {"y": yj, "th": thj, "z": zj, "dz": dzj, "d2z": d2zj, "b": bj}

        # stages j = 2..s
        theta = (t0, dt, y0, f0, args)
        xs = jnp.zeros(self.max_stages - 1, tdt)
        y1 = two_step_recurrence(stage, prev, cur, theta, (w0, w1), xs, s - 1)[1]["y"]

        def err_of(f1):
            return _lc((0.8, y0), (-0.8, y1), (0.4 * dt, f0), (0.4 * dt, f1))

        return y1, err_of, s - 1


# ----------------------------------------------------------------------------------------------
# ROCK2 / ROCK4
# ----------------------------------------------------------------------------------------------


def _recurrence_tables(blocks: dict):
    """Padded per-degree tables: degrees, mu_1, mu_i and kappa_i (i = 2..ms), zero beyond ms
    (one column more than the largest degree needs: room for a finishing stage)."""
    degrees = np.array(sorted(blocks), dtype=np.int32)
    width = max(int(degrees.max()), 1)
    mu1 = np.zeros(len(degrees))
    mu = np.zeros((len(degrees), width))
    kappa = np.zeros((len(degrees), width))
    for i, ms in enumerate(degrees):
        recf = np.asarray(blocks[int(ms)][-1], dtype=np.float64)
        if recf.shape != (2 * ms - 1,):
            raise ValueError(f"recf block of degree {ms} has {recf.size} entries, not {2 * ms - 1}")
        mu1[i] = recf[0]
        mu[i, : ms - 1] = recf[1::2]
        kappa[i, : ms - 1] = recf[2::2]
    return degrees, mu1, mu, kappa


def _orthogonal_stage(f):
    """One stage ``u_i = dt mu_i f(u_{i-1}) + (1 + kappa_i) u_{i-1} - kappa_i u_{i-2}``, with its
    time, for :func:`two_step_recurrence` (``x = (mu_i, kappa_i)``, ``theta = (dt, args)``)."""

    def stage(c1, c2, x, theta, _):
        (u1, t1), (u2, t2) = c1, c2
        mu, kap = x
        dt, args = theta
        k = f(t1, u1, args)
        u = _lc((dt * mu, k), (1.0 + kap, u1), (-kap, u2))
        return u, dt * mu + (1.0 + kap) * t1 - kap * t2

    return stage


def _orthogonal_recurrence(f, t0, dt, y0, args, f0, ms, mu1, mu_row, kappa_row, extra=None):
    """The ``ms``-stage recurrence ``u_i = dt mu_i f(u_{i-1}) + (1+kappa_i) u_{i-1} - kappa_i
    u_{i-2}`` (``u_0 = y0``, ``u_1 = y0 + dt mu_1 f0``), and with ``extra = (mu, kappa)`` one
    stage more of the same form; returns the last two ``(u, t)``."""
    t0 = jnp.asarray(t0, jnp.result_type(dt, t0))
    prev = (y0, t0)
    cur = _like((_lc((1.0, y0), (dt * mu1, f0)), t0 + dt * mu1), prev)
    n = ms - 1  # stages i = 2..ms
    if extra is not None:
        mu_row, kappa_row = mu_row.at[n].set(extra[0]), kappa_row.at[n].set(extra[1])
        n = ms
    xs = (mu_row, kappa_row)
    return two_step_recurrence(_orthogonal_stage(f), prev, cur, (dt, args), None, xs, n)


class _ROCK(_Stabilized):
    _table: dict
    _stage_extra: int  # stages beyond the recurrence degree (finishing procedure)

    def __init__(self, spectral_radius=None, **kw):
        degrees = _recurrence_tables(self._table)[0]
        self.degrees = tuple(int(d) for d in degrees)
        self.max_stages = self.degrees[-1] + self._stage_extra
        super().__init__(spectral_radius, **kw)

    def _tables(self, dtype):
        degrees, mu1, mu, kappa = _recurrence_tables(self._table)
        return (
            jnp.asarray(degrees),
            jnp.asarray(mu1, dtype),
            jnp.asarray(mu, dtype),
            jnp.asarray(kappa, dtype),
        )

    beta: float
    _rho_offset: float

    @property
    def stability_limit(self) -> float:
        # the degree rule below picks a carried degree while h_rho < beta s_max^2 - offset
        return self.beta * self.max_stages**2 - self._rho_offset

    def _degree_index(self, h_rho):
        """The published codes' rule: ``s = floor(sqrt((offset + h rho) / beta)) + 1`` stages,
        rounded up to a tabulated recurrence degree."""
        stages = jnp.floor(jnp.sqrt((self._rho_offset + h_rho) / self.beta)) + 1
        need = jnp.maximum(stages, self._stage_extra + 1) - self._stage_extra
        idx = jnp.searchsorted(jnp.asarray(self.degrees), need.astype(jnp.int32), side="left")
        return jnp.minimum(idx, len(self.degrees) - 1)

    def _recurrence(self, f, t0, dt, y0, args, f0, h_rho, extra=None):
        """The orthogonal Chebyshev recurrence of the degree ``h_rho`` needs (and ``extra``, see
        :func:`_orthogonal_recurrence`): ``(last two (u, t), idx, ms)`` with ``idx`` the row of
        the coefficient tables and ``ms`` the degree."""
        degrees, mu1, mu, kappa = self._tables(jnp.result_type(dt))
        idx = self._degree_index(h_rho)
        ms = degrees[idx]
        if extra is not None:
            extra = tuple(jnp.asarray([e[d] for d in self.degrees], mu.dtype)[idx] for e in extra)
        pair = _orthogonal_recurrence(
            f, t0, dt, y0, args, f0, ms, mu1[idx], mu[idx], kappa[idx], extra
        )
        return pair, idx, ms

    def stage_count(self, h_rho):
        idx = self._degree_index(h_rho)
        return jnp.asarray(self.degrees, jnp.int32)[idx] + self._stage_extra


class ROCK2(_ROCK):
    """Abdulle–Medovikov ROCK2: orthogonal Runge–Kutta–Chebyshev method of order 2.

    A recurrence of degree ``ms`` (tabulated) plus a two-stage finishing procedure, ``ms + 2``
    stages, stability interval ``~ 0.811 (ms + 2)**2``; embedded first-order error estimate
    ``dt fp2 (f(u_{s-1}) - f(u_{s-2}))``. Coefficients: :mod:`._rock_coefficients` (A. Abdulle,
    A. A. Medovikov, Numer. Math. 90 (2001) 1–18).
    """

    order = 2
    embedded_order = 1
    beta = 0.811
    _rho_offset = 1.5  # the published codes' degree rule: sqrt((offset + h rho) / beta) + 1
    _table = _rc.ROCK2
    _stage_extra = 2

    def _advance(self, f, t0, dt, y0, args, f0, h_rho):
        # The finishing procedure k1 = f(u), u1 = u + d1 k1, k2 = f(u1),
        # y1 = u1 + d1 k2 + d2 (k2 - k1) (d = dt fp) is two more stages of the recurrence's form:
        # u1 = u + d1 f(u), then y1 = (d1 + d2) f(u1) + (1 + kappa) u1 - kappa u with
        # kappa = -d2 / d1 (k1 = (u1 - u) / d1). So every stage is a loop stage: XLA materialises
        # each state before the next stencil reads it, and the reverse pass is one clean loop.
        fp1 = {d: self._table[d][0] for d in self.degrees}
        fp2 = {d: self._table[d][1] for d in self.degrees}
        zero = dict.fromkeys(self.degrees, 0.0)
        ((u, t), (ua, ta)), idx, ms = self._recurrence(
            f, t0, dt, y0, args, f0, h_rho, extra=(fp1, zero)
        )
        tdt = jnp.result_type(dt)
        c1 = jnp.asarray([fp1[d] for d in self.degrees], tdt)[idx]
        c2 = jnp.asarray([fp2[d] for d in self.degrees], tdt)[idx]
        xs = ((c1 + c2)[None], (-c2 / c1)[None])
        # (n = min(ms, 1) = 1, traced: the one stage is a conditional, see two_step_recurrence)
        _, (y1, _) = two_step_recurrence(
            _orthogonal_stage(f), (u, t), (ua, ta), (dt, args), None, xs, jnp.minimum(ms, 1)
        )
        # the embedded estimate d2 (k2 - k1) = d2 / (d1 + d2) (y1 - 2 u1 + u)
        err = _lc((c2 / (c1 + c2), y1), (-2.0 * c2 / (c1 + c2), ua), (c2 / (c1 + c2), u))
        return y1, (lambda f1: err), ms + 1


class ROCK4(_ROCK):
    """Abdulle's ROCK4: orthogonal Runge–Kutta–Chebyshev method of order 4.

    A recurrence of degree ``ms`` (tabulated) plus a four-stage finishing procedure, ``ms + 4``
    stages, stability interval ``~ 0.353 (ms + 4)**2``; embedded third-order error estimate.
    Coefficients: :mod:`._rock_coefficients` (A. Abdulle, SIAM J. Sci. Comput. 23 (2002)).
    """

    order = 4
    embedded_order = 3
    beta = 0.353
    _rho_offset = 3.0
    _table = _rc.ROCK4
    _stage_extra = 4

    def _advance(self, f, t0, dt, y0, args, f0, h_rho):
        tdt = jnp.result_type(dt)
        (_, (u, t)), idx, ms = self._recurrence(f, t0, dt, y0, args, f0, h_rho)
        fpa = jnp.asarray([self._table[d][0] for d in self.degrees], tdt)[idx] * dt
        fpb = jnp.asarray([self._table[d][1] for d in self.degrees], tdt)[idx] * dt
        fpbe = jnp.asarray([self._table[d][2] for d in self.degrees], tdt)[idx] * dt
        a21, a31, a32, a41, a42, a43 = (fpa[i] for i in range(6))
        k1 = f(t, u, args)
        k2 = f(t + a21, _lc((1.0, u), (a21, k1)), args)
        k3 = f(t + a31 + a32, _lc((1.0, u), (a31, k1), (a32, k2)), args)
        k4 = f(t + a41 + a42 + a43, _lc((1.0, u), (a41, k1), (a42, k2), (a43, k3)), args)
        ks = (k1, k2, k3, k4)
        y1 = _lc((1.0, u), *((fpb[i], ks[i]) for i in range(4)))
        err4 = _lc(*((fpbe[i] - fpb[i], ks[i]) for i in range(4)))

        def err_of(f1):
            return _lc((1.0, err4), (fpbe[4], f1))

        return y1, err_of, ms + 3


__all__ = ["RKC", "ROCK2", "ROCK4", "power_iteration", "two_step_recurrence"]
