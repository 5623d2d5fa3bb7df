"""The solvers: convergence order, adaptive accuracy, dense output, direction, pytrees, dtypes,
statistics, and ``jit`` / ``vmap``.

Every check compares with something independent of odegrad: the method's own solution at half
the step (self-convergence, for the order), ``scipy.linalg.expm`` for linear systems, SciPy's
DOP853 at ``rtol=atol=1e-13``, diffrax (same published interpolants), a periodic orbit, or
closed-form time reversal. Jitted functions are built once and called with different arguments
where the tests can share them, since compilation dominates the run time.
"""

from __future__ import annotations

import functools
import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.integrate import solve_ivp
from scipy.linalg import expm

import odegrad as og

try:  # tests/ on sys.path (pytest's default rootdir-relative import)
    import reference_problems as rp
except ImportError:  # tests imported as a package
    from tests import reference_problems as rp


def fit_slope(hs, errs) -> float:
    """Least-squares slope of ``log(err)`` against ``log(h)``."""
    return float(np.polyfit(np.log(np.asarray(hs)), np.log(np.asarray(errs)), 1)[0])


def max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# --------------------------------------------------------------------------------------------
# problems


def forced(t, y, args):
    """``x'' + c x' + k x = amp sin(w t)``: smooth and explicitly time dependent."""
    c, k, amp, w = args
    return jnp.stack([y[1], -c * y[1] - k * y[0] + amp * jnp.sin(w * t)])


FORCED_ARGS = (0.1, 4.0, 1.0, 1.5)
FORCED_Y0 = np.array([1.0, 1.0])


def pendulum(t, y, args):
    """Damped nonlinear pendulum ``theta'' = -0.25 theta' - 5 sin(theta)``."""
    return jnp.stack([y[1], -0.25 * y[1] - 5.0 * jnp.sin(y[0])])


PENDULUM_Y0 = np.array([1.0, 1.0])


def pend_fu(t, v, args):  # du/dt = v
    return v


def pend_fv(t, u, args):  # dv/dt = -5 sin(u)  (undamped nonlinear pendulum)
    return -5.0 * jnp.sin(u)


PROBLEMS_1ST = {
    "forced": (forced, FORCED_Y0, FORCED_ARGS),
    "pendulum": (pendulum, PENDULUM_Y0, None),
}

EXPLICIT = {
    "Euler": og.Euler,
    "Heun": og.Heun,
    "Midpoint": og.Midpoint,
    "Ralston": og.Ralston,
    "RK4": og.RK4,
    "BS3": og.BS3,
    "Tsit5": og.Tsit5,
    "Dopri5": og.Dopri5,
    "Dopri8": og.Dopri8,
}
PARTITIONED = {"SemiImplicitEuler": og.SemiImplicitEuler, "Leapfrog": og.Leapfrog}

# --------------------------------------------------------------------------------------------
# 1. convergence order by self-convergence, fixed steps

# name -> (order, problem, t1, step counts). Each window was chosen from a sweep over
# N = 2..2048 as the range where the local slopes have settled (asymptotic regime) and the
# differences are still far above float64 round-off (smallest difference used: ~1e-13). Dopri8
# uses the pendulum at 4..64 steps: with more steps its differences reach round-off.
ORDER_CASES = {
    "Euler": (1, "forced", 4.0, (256, 512, 1024, 2048)),
    "Heun": (2, "forced", 4.0, (32, 64, 128, 256)),
    "Midpoint": (2, "forced", 4.0, (32, 64, 128, 256)),
    "Ralston": (2, "forced", 4.0, (32, 64, 128, 256)),
    "RK4": (4, "forced", 4.0, (32, 64, 128, 256)),
    "BS3": (3, "forced", 4.0, (32, 64, 128, 256)),
    "Tsit5": (5, "forced", 4.0, (64, 128, 256, 512)),
    "Dopri5": (5, "forced", 4.0, (64, 128, 256, 512)),
    # (64 steps reach 1e-13 against 32, the round-off window's edge)
    "Dopri8": (8, "pendulum", 2.0, (4, 8, 16, 32)),
}
PARTITIONED_ORDER_CASES = {
    "SemiImplicitEuler": (1, 2.0, (64, 128, 256, 512)),
    "Leapfrog": (2, 2.0, (16, 32, 64, 128)),
}
ORDER_TOL = 0.3


@functools.cache
def fixed_runtime_fn(name: str):
    """``dt -> (y1, stats)``: one compile for every step size (traced ``dt``: runtime count)."""
    _, prob, t1, _ = ORDER_CASES[name]
    f, y0, args = PROBLEMS_1ST[prob]
    solver = EXPLICIT[name]()

    @jax.jit
    def run(dt):
        sol = og.solve(f, jnp.asarray(y0), (0.0, t1), args, solver=solver, step=og.Fixed(dt))
        return sol.ys[-1], sol.stats

    return run


@functools.cache
def partitioned_runtime_fn(name: str):
    _, t1, _ = PARTITIONED_ORDER_CASES[name]
    solver = PARTITIONED[name]()

    @jax.jit
    def run(dt):
        y0 = (jnp.asarray(1.0), jnp.asarray(0.5))
        sol = og.solve((pend_fu, pend_fv), y0, (0.0, t1), solver=solver, step=og.Fixed(dt))
        return jnp.stack([sol.ys[0][-1], sol.ys[1][-1]])

    return run


def self_convergence(run, t1, ns):
    """Differences between the solutions at ``n`` and ``2n`` steps, and the slope they give."""
    ys = [np.asarray(run(t1 / n)) for n in ns]
    errs = [max_abs(a, b) for a, b in itertools.pairwise(ys)]
    hs = [t1 / n for n in ns[:-1]]
    return fit_slope(hs, errs), errs


@pytest.mark.parametrize("name", list(ORDER_CASES))
def test_fixed_step_order(name):
    order, _, t1, ns = ORDER_CASES[name]
    run = lambda dt: fixed_runtime_fn(name)(dt)[0]
    slope, errs = self_convergence(run, t1, ns)
    assert min(errs) > 1e-13, f"{name}: window reaches round-off, errs={errs}"
    assert abs(slope - order) <= ORDER_TOL, f"{name}: slope {slope:.3f}, order {order}, {errs}"


@pytest.mark.parametrize("name", list(PARTITIONED_ORDER_CASES))
def test_partitioned_order(name):
    order, t1, ns = PARTITIONED_ORDER_CASES[name]
    slope, errs = self_convergence(partitioned_runtime_fn(name), t1, ns)
    assert min(errs) > 1e-13
    assert abs(slope - order) <= ORDER_TOL, f"{name}: slope {slope:.3f}, order {order}, {errs}"


def test_partitioned_matches_first_order_form():
    """Leapfrog converges to what Dopri8 gives for the same pendulum written as ``y = (u, v)``,
    and its error there is the one Richardson extrapolation predicts, (4/3) |y_h - y_{h/2}|."""
    y_ref = np.asarray(
        jax.jit(
            lambda: og.solve(
                lambda t, y, a: jnp.stack([y[1], -5.0 * jnp.sin(y[0])]),
                jnp.array([1.0, 0.5]),
                (0.0, 2.0),
                solver=og.Dopri8(),
                step=og.Adaptive(rtol=1e-12, atol=1e-12),
            ).ys[-1]
        )()
    )
    run = partitioned_runtime_fn("Leapfrog")
    y_h, y_h2 = np.asarray(run(2.0 / 256)), np.asarray(run(2.0 / 512))
    predicted = 4.0 / 3.0 * np.abs(y_h - y_h2)
    actual = np.abs(y_h - y_ref)
    assert np.all(actual > 1e-7)  # second order: not exact
    np.testing.assert_allclose(actual, predicted, rtol=0.05)


def test_leapfrog_is_time_reversible():
    """Velocity Verlet forward then backward with the same step returns to ``y0`` to rounding."""

    @jax.jit
    def there_and_back(u0, v0):
        fs, solver, step = (pend_fu, pend_fv), og.Leapfrog(), og.Fixed(0.05)
        fwd = og.solve(fs, (u0, v0), (0.0, 2.0), solver=solver, step=step)
        u1, v1 = fwd.ys[0][-1], fwd.ys[1][-1]
        back = og.solve(fs, (u1, v1), (2.0, 0.0), solver=solver, step=step)
        return u1, v1, back.ys[0][-1], back.ys[1][-1]

    u1, _, u0b, v0b = there_and_back(jnp.asarray(1.0), jnp.asarray(0.5))
    assert abs(float(u1) - 1.0) > 0.1  # it went somewhere
    assert abs(float(u0b) - 1.0) < 1e-12 and abs(float(v0b) - 0.5) < 1e-12


# --------------------------------------------------------------------------------------------
# 2. statistics and the scan (static count) path


# Right-hand-side evaluations per step: the published stage counts (FSAL methods reuse the last
# stage as the next first stage: BS3 4 - 1, Tsit5 and Dopri5 7 - 1). Plus one at the start.
EVALS_PER_STEP = {
    "Euler": 1,
    "Heun": 2,
    "Midpoint": 2,
    "Ralston": 2,
    "RK4": 4,
    "BS3": 3,
    "Tsit5": 6,
    "Dopri5": 6,
    "Dopri8": 13,
}


class Counter:
    """Counts executed right-hand-side evaluations through a host callback."""

    def __init__(self):
        self.n = 0

    def _bump(self):
        self.n += 1

    def wrap(self, f):
        def g(t, y, args):
            jax.debug.callback(self._bump)
            return f(t, y, args)

        return g


@pytest.mark.parametrize("name", list(ORDER_CASES))
def test_fixed_stats_and_scan_path(name):
    """og.Fixed: exactly N steps, no rejections, ``rhs_evals = 1 + N * evals_per_step``
    (counted by a callback in f); the static-count scan (eager call: concrete t_span and dt)
    equals the runtime-count loop (traced dt under jit) to rounding."""
    _, prob, t1, ns = ORDER_CASES[name]
    f, y0, args = PROBLEMS_1ST[prob]
    n = ns[1]
    counter = Counter()
    sol = og.solve(
        counter.wrap(f),
        jnp.asarray(y0),
        (0.0, t1),
        args,
        solver=EXPLICIT[name](),
        step=og.Fixed(t1 / n),
    )
    jax.effects_barrier()
    stats = {k: int(v) for k, v in sol.stats.items()}
    want = 1 + n * EVALS_PER_STEP[name]
    assert stats == {"steps": n, "accepted": n, "rejected": 0, "rhs_evals": want}
    assert counter.n == want
    y_rt, stats_rt = fixed_runtime_fn(name)(t1 / n)
    assert max_abs(sol.ys[-1], y_rt) <= 1e-13 * (1 + float(jnp.max(jnp.abs(y_rt))))
    assert {k: int(v) for k, v in stats_rt.items()} == stats


@pytest.mark.parametrize("name", list(PARTITIONED))
def test_partitioned_stats(name):
    """One evaluation of the pair (f_u, f_v) per step; Leapfrog evaluates f_v once more at t0."""
    cu, cv = Counter(), Counter()
    n = 7
    sol = jax.jit(
        lambda u, v: og.solve(
            (cu.wrap(pend_fu), cv.wrap(pend_fv)),
            (u, v),
            (0.0, 0.7),
            solver=PARTITIONED[name](),
            step=og.Fixed(0.1),
        )
    )(jnp.asarray(1.0), jnp.asarray(0.5))
    jax.effects_barrier()
    init = 1 if name == "Leapfrog" else 0
    stats = {k: int(v) for k, v in sol.stats.items()}
    assert stats == {"steps": n, "accepted": n, "rejected": 0, "rhs_evals": init + n}
    assert (cu.n, cv.n) == (n, init + n)


@pytest.mark.parametrize(
    "name, dt0, evals",
    [("Tsit5", None, 6), ("Tsit5", 0.5, 6), ("BS3", 0.5, 3), ("Dopri8", None, 13)],
)
def test_adaptive_stats(name, dt0, evals):
    """steps == accepted + rejected; rhs_evals counts every evaluation made (the automatic first
    step costs one more); a too-large dt0 forces rejections."""
    p = rp.get_problem("lorenz")
    counter = Counter()
    sol = jax.jit(
        lambda y, a: og.solve(
            counter.wrap(rp.jax_rhs(p)),
            y,
            (0.0, 1.0),
            a,
            solver=EXPLICIT[name](),
            step=og.Adaptive(rtol=1e-7, atol=1e-7, dt0=dt0),
        )
    )(jnp.asarray(p.y0), jnp.asarray(p.params))
    jax.effects_barrier()
    st = {k: int(v) for k, v in sol.stats.items()}
    assert st["steps"] == st["accepted"] + st["rejected"]
    assert st["accepted"] > 10
    want = 1 + (1 if dt0 is None else 0) + st["steps"] * evals
    assert st["rhs_evals"] == want == counter.n
    if dt0 is not None:
        assert st["rejected"] >= 1  # dt0 = 0.5 is far too large for Lorenz at 1e-7


# --------------------------------------------------------------------------------------------
# 3. adaptive accuracy on classic non-stiff problems


NP = SimpleNamespace(
    sin=np.sin, cos=np.cos, exp=np.exp, log=np.log, sqrt=np.sqrt, tanh=np.tanh, stack=np.array
)


def _arenstorf(t, y, p, m):
    """Restricted three-body problem (Hairer, Nørsett & Wanner I, II.0): a periodic orbit."""
    mu = p[0]
    mp = 1.0 - mu
    x, z, vx, vz = y[0], y[1], y[2], y[3]
    d1 = ((x + mu) ** 2 + z**2) ** 1.5
    d2 = ((x - mp) ** 2 + z**2) ** 1.5
    return m.stack(
        [
            vx,
            vz,
            x + 2 * vz - mp * (x + mu) / d1 - mu * (x - mp) / d2,
            z - 2 * vx - mp * z / d1 - mu * z / d2,
        ]
    )


ARENSTORF = rp.Problem(
    "arenstorf",
    _arenstorf,
    [0.994, 0.0, 0.0, -2.00158510637908252240537862224],
    [0.012277471],
    17.0652165601579625588917206249,  # one period: y(t1) = y0
    description="Arenstorf orbit",
)
ADAPTIVE_PROBLEMS = {
    name: rp.get_problem(name)
    for name in ("lotka_volterra", "damped_pendulum", "lorenz", "forced_oscillator", "linear")
}
ADAPTIVE_PROBLEMS["arenstorf"] = ARENSTORF
ADAPTIVE_SOLVERS = ("Tsit5", "Dopri5", "Dopri8", "BS3")
TOL = 1e-9

# Error bounds, in units of the tolerance, for ``max_i |y_i - ref_i| / (atol + rtol |ref_i|)`` at
# t1. Measured (this machine, float64): Tsit5/Dopri5 <= 1.0, Dopri8 <= 0.2, BS3 <= 12 (BS3 takes
# 500-8000 steps here and a tolerance bounds the local, not the global, error). The bounds leave
# ~8x headroom over the worst measured case; a wrong coefficient or a broken controller
# produces errors orders of magnitude larger.
ADAPTIVE_BOUND = {"Tsit5": 10.0, "Dopri5": 10.0, "Dopri8": 10.0, "BS3": 100.0}
# The Arenstorf orbit amplifies local errors by ~1e4 over one period, so a fixed multiple of the
# tolerance says little; instead odegrad must be at least as accurate as SciPy's implementation of
# the same pair (RK45 = Dopri5) or of the same order (DOP853 for Dopri8, RK23 for BS3) at the
# same tolerances, up to a factor 2. Measured ratios odegrad/SciPy: Tsit5 0.09, Dopri5 0.24,
# Dopri8 0.02, BS3 0.48.
SCIPY_COUNTERPART = {"Tsit5": "RK45", "Dopri5": "RK45", "Dopri8": "DOP853", "BS3": "RK23"}


@functools.cache
def reference_solution(name: str) -> np.ndarray:
    p = ADAPTIVE_PROBLEMS[name]
    if name == "linear":
        n = p.extra["n"]
        return expm(p.params.reshape(n, n) * (p.t1 - p.t0)) @ p.y0
    if name == "arenstorf":
        return p.y0.copy()  # periodic orbit
    sol = solve_ivp(
        lambda t, y: p.rhs(t, y, p.params, NP),
        (p.t0, p.t1),
        p.y0,
        method="DOP853",
        rtol=1e-13,
        atol=1e-13,
    )
    return sol.y[:, -1]


def scaled_error(y, ref, tol=TOL) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(y - ref) / (tol + tol * np.abs(ref))))


@pytest.mark.parametrize("problem", list(ADAPTIVE_PROBLEMS))
@pytest.mark.parametrize("solver", ADAPTIVE_SOLVERS)
def test_adaptive_accuracy(solver, problem):
    p = ADAPTIVE_PROBLEMS[problem]
    sol = jax.jit(
        lambda y0, a: og.solve(
            rp.jax_rhs(p),
            y0,
            (p.t0, p.t1),
            a,
            solver=EXPLICIT[solver](),
            step=og.Adaptive(rtol=TOL, atol=TOL),
            max_steps=16384,
        )
    )(jnp.asarray(p.y0), jnp.asarray(p.params))
    assert int(sol.result) == og.Result.success
    assert float(sol.ts[-1]) == p.t1
    err = scaled_error(sol.ys[-1], reference_solution(problem))
    if problem == "arenstorf":
        sp = solve_ivp(
            lambda t, y: p.rhs(t, y, p.params, NP),
            (p.t0, p.t1),
            p.y0,
            method=SCIPY_COUNTERPART[solver],
            rtol=TOL,
            atol=TOL,
        )
        sp_err = scaled_error(sp.y[:, -1], p.y0)
        assert err <= 2.0 * sp_err, f"{solver} on {problem}: {err:.3g} vs SciPy {sp_err:.3g}"
    else:
        bound = ADAPTIVE_BOUND[solver]
        assert err <= bound, f"{solver} on {problem}: error {err:.3g} x tol > {bound}"


def test_arenstorf_reference_is_periodic():
    """The Arenstorf reference ``y(T) = y0`` agrees with DOP853 at 1e-13 (to its ~1e-9)."""
    p = ARENSTORF
    sol = solve_ivp(
        lambda t, y: p.rhs(t, y, p.params, NP), (0.0, p.t1), p.y0, "DOP853", rtol=1e-13, atol=1e-13
    )
    assert max_abs(sol.y[:, -1], p.y0) < 1e-8


# --------------------------------------------------------------------------------------------
# 4. dense output


@pytest.mark.parametrize("name", ["Tsit5", "Dopri5"])
def test_dense_matches_diffrax(name):
    """The free 4th-order interpolants equal diffrax's (same published polynomials) on the same
    fixed steps, at off-grid times, on a nonlinear non-autonomous problem."""
    dfx = pytest.importorskip("diffrax")

    def f(t, y, a):
        return a @ y + jnp.sin(3.0 * t) * y**2

    a = jnp.asarray([[-0.5, 2.0, 0.0], [-2.0, -0.3, 0.2], [0.1, 0.0, -0.8]])
    y0 = jnp.array([1.0, -0.5, 0.25])
    tq = jnp.array([0.013, 0.4, 0.61, 1.1, 1.37, 2.2, 2.9, 3.0])  # steps of 0.25: off-grid
    ours = jax.jit(
        lambda y, a: (
            og.solve(
                f,
                y,
                (0.0, 3.0),
                a,
                solver=getattr(og, name)(),
                step=og.Fixed(0.25),
                saveat=og.SaveAt(ts=tq),
            ).ys
        )
    )(y0, a)
    theirs = jax.jit(
        lambda y, a: (
            dfx.diffeqsolve(
                dfx.ODETerm(f),
                getattr(dfx, name)(),
                0.0,
                3.0,
                0.25,
                y,
                a,
                saveat=dfx.SaveAt(ts=tq),
                stepsize_controller=dfx.ConstantStepSize(),
            ).ys
        )
    )(y0, a)
    assert max_abs(ours, theirs) < 1e-13


# Off-grid error of SaveAt(ts) on the linear problem against expm, fixed steps. The quartic
# interpolants of Tsit5/Dopri5 have local error O(h^5), so the off-grid error falls like h^5
# (the solution itself is O(h^5)); the cubic Hermite fallback (RK4) has local error O(h^4), which
# then dominates. Dopri8's Bogacki–Shampine extension (exactly order 5 with the published rational
# coefficients) gives O(h^6), measured over N = 8..64 to stay above round-off; the others over
# N = 32..256 steps over [0, 3]; 301 query times, so that the
# maximum is taken over all positions inside a step whatever N is (with a handful of times, the
# position of each time inside its step changes with N and the local slopes scatter by +-0.7).
DENSE_ORDER = {"Tsit5": 5, "Dopri5": 5, "RK4": 4, "Dopri8": 6}
DENSE_TQ = np.array([0.1234, 0.5, 0.9876, 1.3, 1.77, 2.05, 2.61, 2.9])
DENSE_TQ_FINE = np.linspace(0.01, 2.99, 301) + 0.00123


@pytest.mark.parametrize("name", list(DENSE_ORDER))
def test_dense_output_order(name, linear, linear_args):
    exact = linear.exact(DENSE_TQ_FINE)
    y0, a = linear_args

    @jax.jit
    def run(dt):
        return og.solve(
            linear.f,
            y0,
            (0.0, 3.0),
            a,
            solver=EXPLICIT[name](),
            step=og.Fixed(dt),
            saveat=og.SaveAt(ts=jnp.asarray(DENSE_TQ_FINE)),
        ).ys

    ns = np.array([8, 16, 32, 64]) if name == "Dopri8" else np.array([32, 64, 128, 256])
    errs = [max_abs(run(3.0 / n), exact) for n in ns]
    slope = fit_slope(3.0 / ns, errs)
    assert min(errs) > 1e-13
    assert abs(slope - DENSE_ORDER[name]) <= ORDER_TOL, f"{name}: slope {slope:.3f}, {errs}"


@pytest.mark.parametrize("name", ["Tsit5", "Dopri5"])
def test_evaluate_adaptive(name, linear, linear_args):
    """``sol.evaluate`` with SaveAt(dense=True) at tol 1e-9: accurate to a few tol against expm
    (measured <= 0.5 tol), identical to SaveAt(ts) rows, exact at the ends."""
    y0, a = linear_args
    tq = jnp.asarray(DENSE_TQ)

    @jax.jit
    def run(y, a):
        sol = og.solve(
            linear.f,
            y,
            (0.0, 3.0),
            a,
            solver=EXPLICIT[name](),
            step=og.Adaptive(rtol=TOL, atol=TOL),
            saveat=og.SaveAt(ts=tq, t1=True, dense=True),
        )
        return sol.ys, sol.evaluate(tq), sol.evaluate(0.0), sol.evaluate(3.0), sol.evaluate(1.3)

    ys, ev, e0, e3, one = run(y0, a)
    assert ev.shape == (len(DENSE_TQ), 3)
    assert scaled_error(ev, linear.exact(DENSE_TQ)) < 5.0
    assert max_abs(ev, ys[:-1]) < 1e-14
    assert max_abs(e0, y0) < 1e-15
    assert max_abs(e3, ys[-1]) < 1e-14
    assert one.shape == (3,) and max_abs(one, linear.exact(1.3)) < 5 * TOL


EVALUATE = jax.jit(lambda sol, t: sol.evaluate(t))


def test_evaluate_fixed_hermite(linear, linear_args):
    """Dense output on the scan path (eager call, fixed steps, cubic Hermite): exact at the step
    ends, and off the grid within (error at the grid) + h^4 max|y''''| / 384 of expm, the Hermite
    remainder, with |y''''| <= |A|_2^4 |y|."""
    y0, a = linear_args
    h = 0.05
    sol = og.solve(
        linear.f,
        y0,
        (0.0, 3.0),
        a,
        solver=og.RK4(),
        step=og.Fixed(h),
        saveat=og.SaveAt(steps=True, dense=True),
    )
    assert sol.ts.shape == (60,)
    grid_err = max_abs(sol.ys, linear.exact(np.asarray(sol.ts)))
    assert max_abs(EVALUATE(sol, sol.ts), sol.ys) < 1e-15
    ev = EVALUATE(sol, jnp.asarray(DENSE_TQ))
    remainder = h**4 * np.linalg.norm(linear.a, 2) ** 4 * np.max(np.abs(linear.y0)) / 384
    off_err = max_abs(ev, linear.exact(DENSE_TQ))
    assert off_err <= grid_err + remainder  # linear interpolation would miss by ~1e-3


# --------------------------------------------------------------------------------------------
# 5. direction of integration


@pytest.mark.parametrize("name", ["RK4", "Tsit5"])
def test_backward_matches_reversed_problem(name):
    """Integrating ``y' = f(t, y)`` from 4 down to 0 is integrating ``z' = -f(4 - s, z)`` from
    s = 0 up to 4 (z(s) = y(4 - s)), step for step, for a time-dependent f."""

    def reversed_f(s, z, args):
        return -forced(4.0 - s, z, args)

    def run(f, t_span):
        return og.solve(
            f,
            jnp.asarray(FORCED_Y0),
            t_span,
            FORCED_ARGS,
            solver=EXPLICIT[name](),
            step=og.Fixed(0.1),
            saveat=og.SaveAt(t0=True, steps=True),
        )

    back, fwd = run(forced, (4.0, 0.0)), run(reversed_f, (0.0, 4.0))  # eager: the scan path
    assert back.ts.shape == (41,)
    np.testing.assert_allclose(np.asarray(back.ts), 4.0 - np.asarray(fwd.ts), atol=1e-14)
    assert float(back.ts[-1]) == 0.0 and float(back.ts[0]) == 4.0
    assert max_abs(back.ys, fwd.ys) < 1e-12
    assert max_abs(back.ys[0], FORCED_Y0) == 0.0


def test_backward_adaptive_against_expm(linear, linear_args):
    """Adaptive backward solve with save times given in decreasing order, and dense output."""
    y2 = linear.exact(2.0)
    ts = jnp.array([1.9, 1.3, 0.7, 0.2])
    tq = np.array([1.95, 1.0, 0.33, 0.01])

    @jax.jit
    def run(y, a):
        sol = og.solve(
            linear.f,
            y,
            (2.0, 0.0),
            a,
            step=og.Adaptive(rtol=TOL, atol=TOL),
            saveat=og.SaveAt(t0=True, ts=ts, t1=True, dense=True),
        )
        return sol.ts, sol.ys, sol.evaluate(jnp.asarray(tq))

    ts_out, ys, ev = run(jnp.asarray(y2), linear_args[1])
    np.testing.assert_array_equal(np.asarray(ts_out), [2.0, 1.9, 1.3, 0.7, 0.2, 0.0])
    assert scaled_error(ys, linear.exact(np.asarray(ts_out))) < 10.0
    assert scaled_error(ys[-1], linear.y0) < 10.0
    assert scaled_error(ev, linear.exact(tq)) < 10.0


# --------------------------------------------------------------------------------------------
# 6. pytree states, dtypes


M4 = np.array(
    [[-0.2, 1.0, 0.0, 0.1], [-1.0, -0.1, 0.3, 0.0], [0.0, -0.3, -0.4, 0.5], [0.2, 0.0, -0.5, -0.1]]
)
Z0 = np.array([0.7, 1.0, -0.5, 0.25])


def exact4(ts):
    return np.stack([expm(M4 * t) @ Z0 for t in np.asarray(ts)])


def test_dict_state():
    """A dict state mixing a scalar and a vector: structure, shapes and values (adaptive)."""

    def f(t, y, m):
        z = jnp.concatenate([y["x"][None], y["v"]])
        dz = m @ z
        return {"x": dz[0], "v": dz[1:]}

    ts = jnp.array([0.5, 1.0, 2.5])
    sol = jax.jit(
        lambda y, m: og.solve(
            f,
            y,
            (0.0, 3.0),
            m,
            step=og.Adaptive(rtol=TOL, atol=TOL),
            saveat=og.SaveAt(t0=True, ts=ts, t1=True),
        )
    )({"x": jnp.asarray(Z0[0]), "v": jnp.asarray(Z0[1:])}, jnp.asarray(M4))
    assert set(sol.ys) == {"x", "v"}
    assert sol.ys["x"].shape == (5,) and sol.ys["v"].shape == (5, 3)
    want = exact4([0.0, 0.5, 1.0, 2.5, 3.0])
    got = np.concatenate([np.asarray(sol.ys["x"])[:, None], np.asarray(sol.ys["v"])], axis=1)
    assert scaled_error(got, want) < 10.0


def test_tuple_state_fixed_and_dense():
    """A (scalar, vector) tuple state with fixed RK4 steps, saved every step, with dense output."""

    def f(t, y, m):
        z = jnp.concatenate([y[0][None], y[1]])
        dz = m @ z
        return (dz[0], dz[1:])

    sol = og.solve(  # eager: the scan path, exactly one row per step
        f,
        (jnp.asarray(Z0[0]), jnp.asarray(Z0[1:])),
        (0.0, 2.0),
        jnp.asarray(M4),
        solver=og.RK4(),
        step=og.Fixed(0.02),
        saveat=og.SaveAt(steps=True, dense=True),
    )
    assert isinstance(sol.ys, tuple) and sol.ys[0].shape == (100,) and sol.ys[1].shape == (100, 3)
    got = np.concatenate([np.asarray(sol.ys[0])[:, None], np.asarray(sol.ys[1])], axis=1)
    want = exact4(np.asarray(sol.ts))
    assert max_abs(got, want) < 1e-8  # RK4, h = 0.02, |M4| ~ 1.2: measured ~1e-9
    ev = EVALUATE(sol, jnp.array([0.011, 1.234]))
    got_ev = np.concatenate([np.asarray(ev[0])[:, None], np.asarray(ev[1])], axis=1)
    assert max_abs(got_ev, exact4([0.011, 1.234])) < 1e-7


def test_float32_stays_float32(linear):
    """A float32 state gives float32 times, states and dense output, at float32 accuracy."""
    y0 = jnp.asarray(linear.y0, jnp.float32)
    a = jnp.asarray(linear.a, jnp.float32)
    ts = jnp.linspace(0.0, 3.0, 7)  # float64 save times are cast to the state's dtype

    @jax.jit
    def run(y, a):
        sol = og.solve(
            linear.f,
            y,
            (0.0, 3.0),
            a,
            step=og.Adaptive(rtol=1e-5, atol=1e-5),
            saveat=og.SaveAt(ts=ts, dense=True),
        )
        return sol.ts, sol.ys, sol.evaluate(jnp.float32(1.1))

    ts_out, ys, ev = run(y0, a)
    assert ys.dtype == jnp.float32 and ts_out.dtype == jnp.float32 and ev.dtype == jnp.float32
    assert scaled_error(ys, linear.exact(np.asarray(ts)), tol=1e-5) < 10.0
    fixed = og.solve(  # eager: the scan path
        linear.f,
        y0,
        (0.0, 3.0),
        a,
        solver=og.RK4(),
        step=og.Fixed(0.05),
        saveat=og.SaveAt(steps=True),
    )
    assert fixed.ys.shape == (60, 3)
    assert fixed.ys.dtype == jnp.float32 and fixed.ts.dtype == jnp.float32
    assert max_abs(fixed.ys[-1], linear.exact(3.0)) < 1e-5


# --------------------------------------------------------------------------------------------
# 7. jit and vmap


@functools.cache
def lv_adaptive():
    p = rp.get_problem("lotka_volterra")

    def run(y0, params):
        return og.solve(
            rp.jax_rhs(p),
            y0,
            (0.0, 5.0),
            params,
            step=og.Adaptive(rtol=1e-8, atol=1e-8),
            saveat=og.SaveAt(ts=jnp.linspace(0.0, 5.0, 6)),
        )

    return p, run


def test_vmap_over_y0_adaptive():
    """Each batch member takes its own adaptive steps and equals its unbatched solve."""
    p, run = lv_adaptive()
    params = jnp.asarray(p.params)
    y0s = jnp.array([[1.0, 1.0], [2.0, 0.5], [0.5, 3.0], [1.2, 0.9]])
    batched = jax.jit(jax.vmap(run, in_axes=(0, None)))(y0s, params)
    single = jax.jit(run)
    assert batched.ys.shape == (4, 6, 2)
    steps = []
    for i in range(4):
        s = single(y0s[i], params)
        assert max_abs(batched.ys[i], s.ys) < 1e-13
        assert int(batched.stats["steps"][i]) == int(s.stats["steps"])
        steps.append(int(s.stats["steps"]))
    assert len(set(steps)) > 1  # the members really took different step sequences


def test_vmap_over_args_fixed(linear):
    """vmap over the parameters (a batch of matrices) with fixed steps, against expm."""
    scales = jnp.array([0.5, 1.0, 1.5])

    def run(scale):
        return og.solve(
            linear.f,
            jnp.asarray(linear.y0),
            (0.0, 1.0),
            scale * jnp.asarray(linear.a),
            solver=og.Tsit5(),
            step=og.Fixed(0.01),
        ).ys[-1]

    batched = jax.jit(jax.vmap(run))(scales)
    single = jax.jit(run)
    for i, s in enumerate(np.asarray(scales)):
        assert max_abs(batched[i], single(scales[i])) < 1e-14
        assert max_abs(batched[i], expm(s * linear.a) @ linear.y0) < 1e-11


def test_jit_equals_eager(linear, linear_args):
    """Eager (static count: lax.scan) and jitted (traced count: while loop) solves agree."""

    def run(y, a):
        return og.solve(linear.f, y, (0.0, 1.0), a, solver=og.RK4(), step=og.Fixed(0.1)).ys

    eager = run(*linear_args)
    jitted = jax.jit(run)(*linear_args)
    assert max_abs(eager, jitted) < 1e-15
    assert max_abs(jitted[-1], linear.exact(1.0)) < 5e-5  # RK4, h = 0.1: measured 2.2e-5


def test_fixed_under_jit_uses_static_count(linear, linear_args):
    """The contract: a fixed step count gives exactly that many rows, jitted or not."""

    def run(y, a):
        return og.solve(
            linear.f,
            y,
            (0.0, 1.0),
            a,
            solver=og.RK4(),
            step=og.Fixed(0.1),
            saveat=og.SaveAt(steps=True),
        ).ts

    assert run(*linear_args).shape == (10,)  # eager
    assert jax.jit(run)(*linear_args).shape == (10,)


# -- the step controller's gains: the solver's unless given ---------------------------------------


def _step_times(solver, step):
    """The accepted step ends of Lotka–Volterra at rtol = atol = 1e-6, and the rejections."""
    p = rp.lotka_volterra()
    sol = og.solve(
        rp.jax_rhs(p),
        jnp.asarray(p.y0),
        (p.t0, p.t1),
        jnp.asarray(p.params),
        solver=solver,
        step=step,
        saveat=og.SaveAt(steps=True),
    )
    ts = np.asarray(sol.ts)
    return ts[np.isfinite(ts)], int(sol.stats["rejected"])


@pytest.mark.parametrize(
    "solver, gains",
    [(og.Tsit5(), (0.2, 0.65)), (og.Dopri5(), (0.2, 0.65)), (og.Kvaerno3(), (0.4, 0.3))],
    ids=["Tsit5", "Dopri5", "Kvaerno3"],
)
def test_default_gains_are_the_solvers(solver, gains):
    """Explicit Runge–Kutta steps with DOPRI5's gains, implicit solvers with PI.3.4's; the other
    family's gains take other steps, so the comparison can fail."""
    tol = dict(rtol=1e-6, atol=1e-6)
    default = _step_times(solver, og.Adaptive(**tol))
    given = _step_times(solver, og.Adaptive(**tol, pcoeff=gains[0], icoeff=gains[1]))
    other = (0.4, 0.3) if gains == (0.2, 0.65) else (0.2, 0.65)
    swapped = _step_times(solver, og.Adaptive(**tol, pcoeff=other[0], icoeff=other[1]))
    np.testing.assert_array_equal(default[0], given[0])
    assert default[1] == given[1]
    assert default[0].shape != swapped[0].shape or not np.array_equal(default[0], swapped[0])


def test_one_gain_given_takes_the_other_from_the_solver():
    tol = dict(rtol=1e-6, atol=1e-6)
    one = _step_times(og.Tsit5(), og.Adaptive(**tol, pcoeff=0.0))
    both = _step_times(og.Tsit5(), og.Adaptive(**tol, pcoeff=0.0, icoeff=0.65))
    np.testing.assert_array_equal(one[0], both[0])


def test_next_factor_formula():
    """``clip(safety e^-beta1 max(e_prev, floor)^beta2)`` with ``beta1 = (p + i) / (q + 1)``,
    ``beta2 = p / (q + 1)``, from the solver's gains where the control gives none."""
    control = og.Adaptive()
    for gains in ((0.2, 0.65), (0.4, 0.3)):
        for e, e_prev in ((0.5, 0.3), (1e-3, 1e-4), (2.0, 0.9)):
            got = float(control.next_factor(e, e_prev, 4, 1e-2, gains))
            beta1, beta2 = (gains[0] + gains[1]) / 5, gains[0] / 5
            want = np.clip(0.9 * e**-beta1 * max(e_prev, 1e-2) ** beta2, 0.2, 10.0)
            np.testing.assert_allclose(got, want, rtol=1e-6)
    given = og.Adaptive(pcoeff=0.0, icoeff=1.0)
    np.testing.assert_allclose(
        float(given.next_factor(1e-3, 1e-4, 4, 1e-2, (0.2, 0.65))), 0.9 * 1e-3**-0.2, rtol=1e-6
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pcoeff=-0.1), "pcoeff=-0.1"),
        (dict(icoeff=-1.0), "icoeff=-1.0"),
        (dict(pcoeff=0.0, icoeff=0.0), "cannot both be zero"),
    ],
)
def test_bad_gains_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        og.Adaptive(**kwargs)


def test_tolerances_per_entry():
    """``atol``/``rtol`` per entry (CVODES' vector ``abstol``): equal entries step exactly as
    the number does; a loose entry on a component that dominates the error takes fewer steps
    and keeps the tight one's accuracy; a pytree state takes a pytree; the continuous
    adjoints' backward solve uses the tightest (checked against the matrix exponential)."""
    a = jnp.array([[-1.0, 0.5], [0.0, -30.0]])
    y0 = jnp.array([1.0, 1.0])
    f = lambda t, y, a: a @ y
    exact = expm(np.asarray(a) * 2.0) @ np.asarray(y0)

    def run(**tols):
        sol = og.solve(f, y0, (0.0, 2.0), a, step=og.Adaptive(**tols))
        return np.asarray(sol.ys[-1]), int(sol.stats["steps"])

    same = run(rtol=1e-6, atol=1e-6)
    per_entry = run(rtol=jnp.array([1e-6, 1e-6]), atol=np.array([1e-6, 1e-6]))
    np.testing.assert_array_equal(per_entry[0], same[0])
    assert per_entry[1] == same[1]
    as_list = run(rtol=[1e-6, 1e-6], atol=(1e-6, jnp.asarray(1e-6)))  # scipy's array_like
    np.testing.assert_array_equal(as_list[0], same[0])
    loose_fast = run(rtol=1e-6, atol=jnp.array([1e-6, 1e-2]))
    assert loose_fast[1] < same[1]
    assert abs(loose_fast[0][0] - exact[0]) < 1e-5

    g = lambda t, y, a: {"u": -y["u"], "v": -2.0 * y["v"]}
    tols = {"u": 1e-3, "v": jnp.array([1e-9, 1e-10])}
    sol = og.solve(g, {"u": 1.0, "v": jnp.ones(2)}, (0.0, 1.0), step=og.Adaptive(1e-9, tols))
    np.testing.assert_allclose(sol.ys["v"][-1], np.exp(-2.0), rtol=1e-8)
    # the continuous adjoints' backward state is not the state: it traces with the tightest
    loss = _per_entry_loss(og.Interpolating())
    assert jax.eval_shape(jax.grad(loss), jnp.eye(2)).shape == (2, 2)


def _per_entry_loss(adjoint):
    step = og.Adaptive(rtol=1e-10, atol=jnp.array([1e-10, 1e-11]))
    f = lambda t, y, a: a @ y
    return lambda a: og.solve(f, jnp.ones(2), (0.0, 2.0), a, step=step, adjoint=adjoint).ys[-1, 0]


@pytest.mark.slow  # (test_tolerances_per_entry traces the same backward solve)
@pytest.mark.parametrize("adjoint", [og.Interpolating(), og.Quadrature(), og.Forward()])
def test_tolerances_per_entry_gradients(adjoint):
    a = jnp.array([[-1.0, 0.5], [0.0, -30.0]])
    want = jax.grad(lambda a: (jax.scipy.linalg.expm(a * 2.0) @ jnp.ones(2))[0])(a)
    got = jax.grad(_per_entry_loss(adjoint))(a)
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize(
    "atol, match",
    [
        (jnp.array([1e-3, 1e-8, 1e-3]), "shape \\(3,\\) does not broadcast"),
        ({"a": 1e-8}, "the state's structure"),
        ([1e-3, 1e-8, 1e-3], "shape \\(3,\\) does not broadcast"),
        (np.array([1e-3, -1.0]), "non-negative"),
    ],
)
def test_bad_tolerances_per_entry(atol, match):
    with pytest.raises(ValueError, match=match):
        og.solve(lambda t, y, a: -y, jnp.ones(2), (0.0, 1.0), step=og.Adaptive(atol=atol))


def test_float32_times_far_from_zero():
    """float32 time: a step moves ``y`` by the ``h`` that ``t`` actually moved (``t + h``
    rounds: from ``t0 = 1e6``, ``y(t0 + 0.5)`` was 0.6365 for 0.6065, reported a success), and
    the smallest step is relative to where a step starts, not to the span's far end (a fast
    start on ``(0, 1e4)`` was refused at ``t = 0`` as a step size underflow)."""
    far = og.solve(lambda t, y, a: -y, jnp.float32(1.0), (1e6, 1e6 + 0.5))
    assert abs(float(far.ys[-1]) - np.exp(-0.5)) < 1e-5
    w, k = 3000.0, 100.0
    fast = lambda t, y, a: jnp.cos(w * t) * jnp.exp(-k * t)
    sol = og.solve(fast, jnp.float32(0.0), (0.0, 1e4))
    assert abs(float(sol.ys[-1]) - k / (w * w + k * k)) < 5e-5
    # a long float64 span that needs more steps than allowed says so (it said "stiff")
    sol = og.solve(lambda t, y, a: -y, 1.0, (0.0, 1e8), throw=False)
    assert og.Result(int(sol.result)) == og.Result.max_steps_reached
