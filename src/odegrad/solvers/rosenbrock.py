"""Rosenbrock (linearly implicit) solvers for stiff problems: :class:`Rodas5P` and
:class:`Rodas5`.

``k_i = gamma dt M^{-1} (f(u_i) + d_i dt df/dt + sum_j C_ij k_j / dt)`` with ``M = I - gamma dt
J`` and the exact Jacobian ``J`` at the step start: no Newton iterations, one LU (or one GMRES
solve per stage) per step. The linear algebra and the options are those of the ESDIRK solvers
(:mod:`odegrad.solvers.implicit`). Rosenbrock steps are explicit functions of ``J``, so their
exact derivative includes second derivatives of ``f`` (JAX differentiates ``jacfwd`` / the
JVPs).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .._warn import warn_user
from . import _linear
from .base import StepResult
from .implicit import _flat_rhs, _Implicit, _lincomb


@dataclass(frozen=True)
class RosenbrockTableau:
    """A Rosenbrock method in the form of Hairer & Wanner (Solving ODEs II, IV.7, (7.25)):
    ``M k_i = gamma dt (f(t0 + c_i dt, u_i) + d_i dt f_t + sum_{j<i} C[i][j] k_j / dt)`` with
    ``M = I - gamma dt J``, ``u_i = y0 + sum_{j<i} A[i][j] k_j``; ``y1 = y0 + sum_j m_j k_j``
    where stiffly accurate methods have ``u_{i+1} = u_i + k_i`` for the trailing stages (here:
    ``y1 = u_{s-1} + k_{s-1}``) and the error estimate is ``k_{s-1}``. Dense output:
    ``y(theta) = (1-theta) y0 + theta (y1 + (1-theta)(K_1 + theta (K_2 + theta K_3)))`` with
    ``K_m = sum_j H[m][j] k_j``.
    """

    gamma: float
    c: tuple[float, ...]
    d: tuple[float, ...]
    A: tuple[tuple[float, ...], ...]
    C: tuple[tuple[float, ...], ...]
    H: tuple[tuple[float, ...], ...]
    order: int
    embedded_order: int
    dense_order: int

    @property
    def stages(self) -> int:
        return len(self.c)


# Rodas5. Source: G. Di Marzo, "RODAS5(4) – Méthodes de Rosenbrock d'ordre 5(4) adaptées aux
# problèmes différentiels-algébriques", Master's thesis, University of Geneva (1993); see Hairer
# & Wanner, Solving ODEs II. Coefficients and the stiff-aware dense output (h-coefficients)
# carried over from OrdinaryDiffEq.jl's Rodas5Tableau (tableaus/rosenbrock_tableaus.jl); stages
# 6-8 advance u by the previous k (stiffly accurate), which the A rows below spell out.
_R5A = (
    (),
    (2.0,),
    (3.040894194418781, 1.041747909077569),
    (2.576417536461461, 1.622083060776640, -0.9089668560264532),
    (2.760842080225597, 1.446624659844071, -0.3036980084553738, 0.2877498600325443),
    (
        -14.09640773051259,
        6.925207756232704,
        -41.47510893210728,
        2.343771018586405,
        24.13215229196062,
    ),
)
_R5A = (
    *_R5A,
    (*_R5A[5], 1.0),
    (*_R5A[5], 1.0, 1.0),
)
RODAS5 = RosenbrockTableau(
    gamma=0.19,
    c=(0.0, 0.38, 0.3878509998321533, 0.4839718937873840, 0.4570477008819580, 1.0, 1.0, 1.0),
    d=(
        0.19,
        -0.1823079225333714636,
        -0.319231832186874912,
        0.3449828624725343,
        -0.377417564392089818,
        0.0,
        0.0,
        0.0,
    ),
    A=_R5A,
    C=(
        (),
        (-10.31323885133993,),
        (-21.04823117650003, -7.234992135176716),
        (32.22751541853323, -4.943732386540191, 19.44922031041879),
        (-20.69865579590063, -8.816374604402768, 1.260436877740897, -0.7495647613787146),
        (
            -46.22004352711257,
            -17.49534862857472,
            -289.6389582892057,
            93.60855400400906,
            318.3822534212147,
        ),
        (
            34.20013733472935,
            -14.15535402717690,
            57.82335640988400,
            25.83362985412365,
            1.408950972071624,
            -6.551835421242162,
        ),
        (
            42.57076742291101,
            -13.80770672017997,
            93.98938432427124,
            18.77919633714503,
            -31.58359187223370,
            -6.685968952921985,
            -5.810979938412932,
        ),
    ),
    H=(
        (
            27.354592673333357,
            -6.925207756232857,
            26.40037733258859,
            0.5635230501052979,
            -4.699151156849391,
            -1.6008677469422725,
            -1.5306074446748028,
            -1.3929872940716344,
        ),
        (
            44.19024239501722,
            1.3677947663381929e-13,
            202.93261852171622,
            -35.5669339789154,
            -181.91095152160645,
            3.4116351403665033,
            2.5793540257308067,
            2.2435122582734066,
        ),
        (
            -44.0988150021747,
            -5.755396159656812e-13,
            -181.26175034586677,
            56.99302194811676,
            183.21182741427398,
            -7.480257918273637,
            -5.792426076169686,
            -5.32503859794143,
        ),
    ),
    order=5,
    embedded_order=4,
    dense_order=4,
)


# Rodas5P. Source: G. Steinebach, "Construction of Rosenbrock-Wanner method Rodas5P and numerical
# benchmarks within the Julia Differential Equations package", BIT Numer. Math. 63, 27 (2023).
# Coefficients (and the order-4 dense output) carried over from OrdinaryDiffEq.jl's
# Rodas5PTableau (tableaus/rosenbrock_tableaus.jl), the same layout as Rodas5's: stages 6-8
# advance u by the previous k.
_R5PA6 = (
    -7.502846399306121,
    2.561846144803919,
    -11.627539656261098,
    -0.18268767659942256,
    0.030198172008377946,
)
RODAS5P = RosenbrockTableau(
    gamma=0.21193756319429014,
    c=(0.0, 0.6358126895828704, 0.4095798393397535, 0.9769306725060716, 0.4288403609558664,
       1.0, 1.0, 1.0),
    d=(0.21193756319429014, -0.42387512638858027, -0.3384627126235924, 1.8046452872882734,
       2.325825639765069, 0.0, 0.0, 0.0),
    A=(
        (),
        (3.0,),
        (2.849394379747939, 0.45842242204463923),
        (-6.954028509809101, 2.489845061869568, -10.358996098473584),
        (2.8029986275628964, 0.5072464736228206, -0.3988312541770524, -0.04721187230404641),
        _R5PA6,
        (*_R5PA6, 1.0),
        (*_R5PA6, 1.0, 1.0),
    ),
    C=(
        (),
        (-14.155112264123755,),
        (-17.97296035885952, -2.859693295451294),
        (147.12150275711716, -1.41221402718213, 71.68940251302358),
        (165.43517024871676, -0.4592823456491126, 42.90938336958603, -5.961986721573306),
        (24.854864614690072, -3.0009227002832186, 47.4931110020768, 5.5814197821558125,
         -0.6610691825249471),
        (30.91273214028599, -3.1208243349937974, 77.79954646070892, 34.28646028294783,
         -19.097331116725623, -28.087943162872662),
        (37.80277123390563, -3.2571969029072276, 112.26918849496327, 66.9347231244047,
         -40.06618937091002, -54.66780262877968, -9.48861652309627),
    ),
    H=(
        (25.948786856663858, -2.5579724845846235, 10.433815404888879, -2.3679251022685204,
         0.524948541321073, 1.1241088310450404, 0.4272876194431874, -0.17202221070155493),
        (-9.91568850695171, -0.9689944594115154, 3.0438037242978453, -24.495224566215796,
         20.176138334709044, 15.98066361424651, -6.789040303419874, -6.710236069923372),
        (11.419903575922262, 2.8879645146136994, 72.92137995996029, 80.12511834622643,
         -52.072871366152654, -59.78993625266729, -0.15582684282751913, 4.883087185713722),
    ),
    order=5,
    embedded_order=4,
    dense_order=4,
)  # fmt: skip


class _Rosenbrock(_Implicit):
    """A Rosenbrock method from a :class:`RosenbrockTableau`; see the module docstring."""

    tableau: RosenbrockTableau
    init_evals = 0
    state_from_y = True

    #: (no Newton iterations, and the exact Jacobian every step: no Newton settings, no
    #: Jacobian reuse)
    options = ("preconditioner", "gmres_tol", "gmres_restart", "gmres_maxiter")

    def __init__(self, linear_solver: str = "auto", **options):
        unused = sorted(set(options) - set(self.options))
        if unused:
            raise TypeError(
                f"{type(self).__name__}() takes linear_solver and {', '.join(self.options)}; "
                f"not {', '.join(unused)} (it makes no Newton iterations and builds the exact "
                "Jacobian every step)."
            )
        super().__init__(linear_solver, **options)

    @property
    def step_evals(self) -> int:
        return self.tableau.stages  # one evaluation per stage, plus the Jacobian

    def adjoint_solver(self):
        """Kvaerno5: a Rosenbrock method's order conditions use ``df/dt`` and the exact
        Jacobian, and the adjoint's right-hand side reads ``y`` from the forward interpolant,
        which is only piecewise smooth in ``t``. Measured on Van der Pol (mu = 1000, rtol 1e-8,
        atol 1e-10, t <= 500), Interpolating's gradient against CVODES: 1.0e-4 backwards with
        Rodas5, 2.7e-8 with Kvaerno5."""
        from .implicit import Kvaerno5

        return Kvaerno5(self.linear_solver)

    def init(self, f, t0, y0, args):
        return ()

    def step(self, f, t0, dt, y0, args, state):
        tab = self.tableau
        x0, unravel, fx = _flat_rhs(f, y0, args)
        kind = _linear.resolve(self.linear_solver, x0.size)
        c = tab.gamma * dt
        t0 = jnp.asarray(t0, x0.dtype)
        # f and df/dt at the step start in one pass
        f0, f_t = jax.jvp(lambda t: fx(t, x0, args), (t0,), (jnp.ones_like(t0),))
        f_y = lambda x: fx(t0, x, args)
        if kind == "dense":
            solve = _linear.DenseSolve(_linear.jacobian(f_y, x0), c)
        else:
            precond = self._precond(t0, y0, args, c, unravel)
            solve = _linear.KrylovSolve(f_y, x0, c, precond=precond, **self._gmres_kw(x0.dtype))

        s = tab.stages
        if kind == "dense":
            # small systems: the stages unrolled, coefficients as constants
            ks = []
            for i in range(s):
                u = x0 + _lincomb(tab.A[i], ks) if i else x0
                rhs = f0 if i == 0 else fx(t0 + tab.c[i] * dt, u, args)
                if tab.d[i] != 0:
                    rhs = rhs + (tab.d[i] * dt) * f_t
                if i:
                    rhs = rhs + _lincomb(tab.C[i], ks, 1 / dt)
                ks.append(c * solve(rhs))
        else:
            # large (GMRES) systems: stages 1.. in one loop (one Krylov solve to compile, not
            # one per stage), reading row i of the padded tableau
            dtype = x0.dtype
            pad = lambda rows: jnp.asarray([list(r) + [0.0] * (s - len(r)) for r in rows], dtype)
            a_mat, c_mat = pad(tab.A), pad(tab.C)
            c_vec, d_vec = jnp.asarray(tab.c, dtype), jnp.asarray(tab.d, dtype)

            def stage(i, k_arr):
                u = x0 + a_mat[i] @ k_arr
                fu = fx(t0 + c_vec[i] * dt, u, args)
                rhs = fu + (d_vec[i] * dt) * f_t + (c_mat[i] @ k_arr) / dt
                return k_arr.at[i].set(c * solve(rhs))

            k0 = c * solve(f0 + (tab.d[0] * dt) * f_t)
            k_arr = jnp.zeros((s, x0.size), dtype).at[0].set(k0)
            k_arr = jax.lax.fori_loop(1, s, stage, k_arr)
            ks = [k_arr[i] for i in range(s)]
            u = x0 + _lincomb(tab.A[s - 1], ks)
        x1 = u + ks[-1]
        y1 = unravel(x1)
        dense = (y0, y1, *(unravel(_lincomb(row, ks)) for row in tab.H))
        return StepResult(y1, unravel(ks[-1]), dense, ())

    def interpolate(self, dense, theta):
        y0, y1, k1, k2, k3 = dense
        th1 = 1 - theta
        return jax.tree.map(
            lambda a, b, p, q, r: th1 * a + theta * (b + th1 * (p + theta * (q + theta * r))),
            y0,
            y1,
            k1,
            k2,
            k3,
        )


class Rodas5P(_Rosenbrock):
    """Rodas5P, Steinebach's Rosenbrock method of order 5(4) (2023): 8 stages, one Jacobian and
    one LU (or GMRES solves) per step and no Newton iterations; L-stable, stiffly accurate; a
    stiff-aware dense output of order 4. The first choice for small and medium stiff systems
    at tight tolerances (OrdinaryDiffEq's default Rosenbrock method since 2022). Its error
    estimate sees the error of a forcing in ``t`` (Rodas5's does not). Needs the exact
    Jacobian (``jax.jacfwd`` or exact JVPs), and gradients through it use second derivatives of
    ``f``. Arguments: ``linear_solver``, ``preconditioner`` and the ``gmres_*`` options of
    :class:`ImplicitEuler` (no Newton iterations, and the exact Jacobian at every step: no
    Newton settings or ``jacobian_reuse_rate``).

    Example:
        >>> sol = og.solve(f, y0, (0.0, 100.0), args, solver=og.Rodas5P(),
        ...                step=og.Adaptive(rtol=1e-8, atol=1e-10))
    """

    tableau = RODAS5P


class Rodas5(_Rosenbrock):
    """Rodas5, Di Marzo's Rosenbrock method of order 5(4) (1993): as :class:`Rodas5P` (same
    cost, slightly smaller errors per step on autonomous problems) but its error estimate (the
    last stage) does not see the error of a forcing in ``t``: where ``df/dy`` is near zero it
    is ~0 whatever the step, so the steps grow unchecked (``y' = cos t`` on ``[0, 10]`` at
    rtol 1e-6: 9.8 off after 6 steps; Rodas5P: 1.2e-7 in 44). A solve whose ``f`` reads ``t``
    warns at trace time; use :class:`Rodas5P` there.

    Example:
        >>> sol = og.solve(f, y0, (0.0, 100.0), args, solver=og.Rodas5(),
        ...                step=og.Adaptive(rtol=1e-8, atol=1e-10))
    """

    tableau = RODAS5

    def init(self, f, t0, y0, args):
        from .._kinks import reads_time

        if reads_time(f, t0, y0, args):
            warn_user(
                "Rodas5's error estimate does not see the error of f's dependence on t (a "
                "time-dependent forcing: its steps can grow unchecked and miss the tolerance "
                "by orders of magnitude); og.Rodas5P() has the same cost and an estimate that "
                "sees it.",
                UserWarning,
            )
        return ()
