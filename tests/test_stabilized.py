"""Stabilised explicit methods RKC, ROCK2, ROCK4 on the 1-d heat equation (mildly stiff)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.polynomial import polynomial as P
from scipy.linalg import expm

import odegrad as og
from odegrad._tuning import tuned
from odegrad.problems import diffusion3d
from odegrad.solvers import _rock_coefficients as rc


def heat(n: int):
    """``u_t = a u_xx`` on (0, 1), zero Dirichlet ends, ``n`` interior cells: ``(f, A, x)``."""
    dx = 1.0 / (n + 1)
    x = np.arange(1, n + 1) * dx
    a_mat = np.diag(-2.0 * np.ones(n)) + np.diag(np.ones(n - 1), 1) + np.diag(np.ones(n - 1), -1)
    a_mat /= dx**2

    def f(t, y, a):
        yp = jnp.pad(y, 1)
        return a * (yp[2:] - 2 * yp[1:-1] + yp[:-2]) / dx**2

    return f, a_mat, x


def smooth_y0(x):
    return jnp.asarray(np.sin(np.pi * x) + 0.5 * np.sin(3 * np.pi * x))


SOLVERS = [og.RKC, og.ROCK2, og.ROCK4]


# -- the coefficient data -------------------------------------------------------------------


def _recurrence_poly(ms, recf):
    one, z = np.array([1.0]), np.array([0.0, 1.0])
    um2, um1 = one, P.polyadd(one, recf[0] * z)
    for i in range(2, ms + 1):
        mu, kap = recf[2 * (i - 2) + 1], recf[2 * (i - 2) + 2]
        um2, um1 = um1, P.polyadd(P.polyadd(mu * P.polymul(z, um1), (1 + kap) * um1), -kap * um2)
    return um1


@pytest.mark.parametrize("ms", sorted(rc.ROCK2))
def test_rock2_table_order_conditions(ms):
    fp1, fp2, recf = rc.ROCK2[ms]
    assert ms in rc.ROCK2_MS_PUBLISHED and recf.shape == (2 * ms - 1,)
    z = np.array([0.0, 1.0])
    u = _recurrence_poly(ms, recf)
    k1 = P.polymul(z, u)
    u1 = P.polyadd(u, fp1 * k1)
    k2 = P.polymul(z, u1)
    r = P.polyadd(P.polyadd(u1, fp1 * k2), fp2 * P.polyadd(k2, -k1))
    np.testing.assert_allclose(r[:3] * [1, 1, 2], 1.0, atol=1e-12)


@pytest.mark.parametrize("ms", sorted(rc.ROCK4))
def test_rock4_table_order_conditions(ms):
    fpa, fpb, fpbe, recf = rc.ROCK4[ms]
    assert ms in rc.ROCK4_MS_PUBLISHED and recf.shape == (2 * ms - 1,)
    z = np.array([0.0, 1.0])
    u = _recurrence_poly(ms, recf)
    a21, a31, a32, a41, a42, a43 = fpa
    k1 = P.polymul(z, u)
    k2 = P.polymul(z, P.polyadd(u, a21 * k1))
    k3 = P.polymul(z, P.polyadd(P.polyadd(u, a31 * k1), a32 * k2))
    k4 = P.polymul(z, P.polyadd(P.polyadd(P.polyadd(u, a41 * k1), a42 * k2), a43 * k3))
    r, re = u, u
    for b, be, k in zip(fpb, fpbe, (k1, k2, k3, k4), strict=False):
        r, re = P.polyadd(r, b * k), P.polyadd(re, be * k)
    re = P.polyadd(re, fpbe[4] * P.polymul(z, r))
    fact = [math.factorial(j) for j in range(5)]
    np.testing.assert_allclose(r[:5] * fact, 1.0, atol=1e-12)  # order 4
    np.testing.assert_allclose(re[:4] * fact[:4], 1.0, atol=1e-12)  # embedded order 3
    assert abs(re[4] * 24 - 1) > 1e-4


@pytest.mark.parametrize("solver", SOLVERS)
def test_stability_interval(solver):
    """One scalar step of ``y' = lam y`` stays bounded wherever the stage rule sends it."""
    s = solver(spectral_radius=lambda t, y, a: -a)
    lams = -np.linspace(1.0, 3500.0, 600)

    def amp(lam):
        y0 = jnp.ones(())
        st = s.init(lambda t, y, a: a * y, 0.0, y0, lam)
        return s.step(lambda t, y, a: a * y, 0.0, 1.0, y0, lam, st).y1

    ys = np.asarray(jax.jit(jax.vmap(amp))(jnp.asarray(lams)))
    h_rho = s.safety * -lams  # the rho the solver sees includes the safety factor
    ok = h_rho <= s.stability_limit
    assert np.all(np.abs(ys[ok]) <= 1.0 + 1e-12)
    # beyond the largest degree the step fails (NaN) instead of silently going unstable
    assert np.all(np.isnan(ys[h_rho > s.stability_limit * 1.001]))


def test_rock2_carries_every_published_degree():
    assert tuple(sorted(rc.ROCK2)) == rc.ROCK2_MS_PUBLISHED
    s = og.ROCK2()
    assert s.max_stages == 200 and s.stability_limit > 32000


def test_rock4_carries_every_published_degree():
    assert tuple(sorted(rc.ROCK4)) == rc.ROCK4_MS_PUBLISHED and len(rc.ROCK4) == 50
    s = og.ROCK4()
    assert s.max_stages == 152 and s.stability_limit > 8000


@pytest.mark.parametrize("solver", SOLVERS)
def test_max_step_is_stability_limit_over_rho(solver):
    s = solver(spectral_radius=lambda t, y, a: 1e4)
    st = s.init(lambda t, y, a: -1e4 * y, 0.0, jnp.ones(3), None)
    np.testing.assert_allclose(s.max_step(st), s.stability_limit / (s.safety * 1e4), rtol=1e-12)
    assert og.Tsit5().max_step(None) is None  # the base-class default: no cap


def test_adaptive_steps_clipped_to_max_step():
    """Stiff decay over a long span: the error controller wants ever longer steps; without the
    cap it proposes steps past the largest degree that are rejected (~100 here, 3.7x the
    evaluations); with it every step is within the limit and it reaches the limit."""
    lam = 1e6
    f = lambda t, y, a: -lam * y
    s = og.ROCK2(spectral_radius=lambda t, y, a: lam)
    sol = og.solve(
        f, jnp.ones(2), (0.0, 1.0), None, solver=s, step=og.Adaptive(rtol=1e-4, atol=1e-6),
        saveat=og.SaveAt(steps=True), max_steps=4096,
    )  # fmt: skip
    assert int(sol.result) == 0
    ts = np.asarray(sol.ts)
    dts = np.diff(np.concatenate([[0.0], ts[np.isfinite(ts)]]))
    h_max = s.stability_limit / (s.safety * lam)
    assert h_max * 0.99 <= dts.max() <= h_max * (1 + 1e-9)
    assert int(sol.stats["rejected"]) <= 10, sol.stats


@pytest.mark.parametrize("step", [og.Fixed(0.5), og.StepTo(jnp.linspace(0.0, 1.0, 3))])
def test_fixed_step_beyond_stability_limit_fails(step):
    lam = 1e5  # dt * rho = 6e4 > ROCK2's limit (~3.2e4)
    f = lambda t, y, a: -lam * y
    s = og.ROCK2(spectral_radius=lambda t, y, a: lam)
    with pytest.raises(RuntimeError):
        og.solve(f, jnp.ones(2), (0.0, 1.0), None, solver=s, step=step)
    sol = og.solve(f, jnp.ones(2), (0.0, 1.0), None, solver=s, step=step, throw=False)
    assert int(sol.result) != 0 and not np.all(np.isfinite(np.asarray(sol.ys)))
    # within the limit the same problem is stable
    ok = og.solve(f, jnp.ones(2), (0.0, 1.0), None, solver=s, step=og.Fixed(0.25))
    assert int(ok.result) == 0 and np.all(np.abs(np.asarray(ok.ys)) <= 1.0)


# -- orders, accuracy, stage counts ---------------------------------------------------------


@pytest.mark.parametrize(
    "solver,ns",
    [(og.RKC, (8, 16, 32, 64)), (og.ROCK2, (8, 16, 32, 64)), (og.ROCK4, (4, 8, 16, 32))],
)
def test_self_convergence_order(solver, ns):
    f, _, x = heat(64)  # rho ~ 1.7e4: 4..28 stages over these steps
    y0, t1 = smooth_y0(x), 0.05
    # one compile for every step size (a traced dt: the step count is counted at run time)
    run = jax.jit(lambda dt: og.solve(f, y0, (0.0, t1), 1.0, solver=solver(), step=og.Fixed(dt)))
    ys = [run(t1 / n).ys[-1] for n in ns]
    d = [float(jnp.max(jnp.abs(ys[i] - ys[i + 1]))) for i in range(len(ys) - 1)]
    observed = math.log2(d[-2] / d[-1])
    assert abs(observed - solver.order) < 0.35, (d, observed)


@pytest.mark.parametrize("solver", SOLVERS)
def test_adaptive_matches_expm(solver):
    f, a_mat, x = heat(32)
    y0 = smooth_y0(x) + 0.2 * jnp.sin(8 * jnp.pi * jnp.asarray(x))
    ts = jnp.linspace(0.0, 0.05, 6)
    sol = og.solve(
        f, y0, (0.0, 0.05), 1.0, solver=solver(), step=og.Adaptive(rtol=1e-6, atol=1e-6),
        saveat=og.SaveAt(ts=ts, dense=True),
    )  # fmt: skip
    ref = np.stack([expm(a_mat * float(t)) @ np.asarray(y0) for t in ts])
    np.testing.assert_allclose(sol.ys, ref, atol=2e-5)
    mid = float(0.5 * (ts[2] + ts[3]))
    np.testing.assert_allclose(sol.evaluate(mid), expm(a_mat * mid) @ np.asarray(y0), atol=5e-5)


@pytest.mark.parametrize("solver", SOLVERS)
def test_stage_count_grows_like_sqrt(solver):
    s = solver()
    h_rho = np.array([20.0, 80.0, 320.0])
    counts = np.asarray(jax.vmap(s.stage_count)(jnp.asarray(h_rho)))
    need = np.sqrt(h_rho / s.beta)
    assert np.all(counts >= need) and np.all(counts <= 1.45 * need + 4)
    ratios = counts[1:] / counts[:-1]  # x4 in dt*rho -> about x2 in stages
    assert np.all((ratios > 1.5) & (ratios < 2.6)), counts
    # the steps really take that many evaluations: one step each of size dt and 16 dt
    f, _, x = heat(32)
    y0 = smooth_y0(x)
    evals = []
    run = jax.jit(lambda dt: og.solve(f, y0, (0.0, 0.05), 1.0, solver=s, step=og.Fixed(dt)))
    init_evals = int(s.init_from(f, 0.0, y0, 1.0, None)[1])  # f(t0, y0) and the power iteration
    for n in (64, 4):
        sol = run(0.05 / n)  # (one compile for both: a traced dt, counted at run time)
        refreshes = n // s.rho_every  # power-iteration refreshes of the spectral radius
        evals.append((int(sol.stats["rhs_evals"]) - init_evals - refreshes * s.power_iters) / n)
    assert 2.5 < evals[1] / evals[0] < 5.5, evals


@pytest.mark.parametrize(
    "solver, how",
    [
        (og.ROCK2(), "adaptive, a jump and an event"),
        (og.RKC(), "adaptive, a jump and an event"),
        (og.ROCK2(), "fixed"),
        (og.ROCK4(power_rtol=0.0), "fixed"),
    ],
)
def test_rhs_evals_counts_every_evaluation_made(solver, how):
    """``sol.stats["rhs_evals"]`` equals the evaluations of ``f`` that ran (a host callback
    counts them; a JVP runs ``f`` once): the power iteration's products as many as it made
    before it stopped, the initial step's two evaluations (the state is not ``f(y0)``), one per
    restart past a jump (the estimate carries over) and a fresh start past an event."""
    f, _, x = heat(16)
    calls = []

    def counted(t, y, a):
        jax.debug.callback(lambda: calls.append(1))
        return f(t, y, a) + jnp.where(t > 0.03, 1.0, 0.0)

    y0 = smooth_y0(x)
    if how == "fixed":
        kw = dict(step=og.Fixed(0.01))
    else:
        kick = og.Event(lambda t, y, a: y[8] - 0.6, direction=-1, terminal=False,
                        update=lambda t, y, a: 0.5 * y)  # fmt: skip
        kw = dict(step=og.Adaptive(1e-5, 1e-7, jump_ts=[0.03]), events=kick)
    sol = og.solve(counted, y0, (0.0, 0.1), 1.0, solver=solver, **kw)
    jax.effects_barrier()
    if how != "fixed":
        assert int(sol.events.count) >= 1
    assert int(sol.stats["rhs_evals"]) == len(calls) > 0


def test_rock2_needs_3x_fewer_evaluations_than_tsit5():
    f, a_mat, x = heat(32)
    rho = float(np.abs(np.linalg.eigvalsh(a_mat)).max())
    t1 = 2000 * 2.0 / rho  # 2000 explicit-Euler-stable steps
    y0 = smooth_y0(x) + 0.2 * jnp.sin(8 * jnp.pi * jnp.asarray(x))
    calls = {"n": 0}

    def counted(t, y, a):
        jax.debug.callback(lambda: calls.__setitem__("n", calls["n"] + 1))
        return f(t, y, a)

    step = og.Adaptive(rtol=1e-4, atol=1e-4)
    ref = expm(a_mat * t1) @ np.asarray(y0)
    out = {}
    for solver in (og.Tsit5(), og.ROCK2()):
        calls["n"] = 0
        sol = og.solve(counted, y0, (0.0, t1), 1.0, solver=solver, step=step, max_steps=8192)
        jax.block_until_ready(sol.ys)
        out[type(solver).__name__] = (int(sol.stats["rhs_evals"]), calls["n"])
        np.testing.assert_allclose(sol.ys[-1], ref, atol=1e-4)
    for stats_count, real in out.values():  # the stats count every real call (+1: the loop's
        assert 0 <= real - stats_count <= 1, out  # own f(t0, y0) for the initial step guess)
    assert 3 * out["ROCK2"][1] <= out["Tsit5"][1], out


# -- gradients ------------------------------------------------------------------------------


def _loss(solver, step, adjoint, f, t1):
    def loss(a, y0):
        sol = og.solve(f, y0, (0.0, t1), a, solver=solver, step=step, adjoint=adjoint)
        return jnp.sum(sol.ys[-1] ** 2)

    return loss


@pytest.mark.parametrize("adjoint", [og.Discrete(), og.Discrete(checkpoints=3)])
def test_rock2_discrete_gradient_matches_finite_differences(adjoint):
    f, _, x = heat(32)
    y0 = smooth_y0(x)
    loss = _loss(og.ROCK2(), og.Fixed(0.002), adjoint, f, 0.02)
    g_a, g_y = jax.jit(jax.grad(loss, argnums=(0, 1)))(1.0, y0)
    loss = jax.jit(loss)  # one compile for the four evaluations
    eps = 1e-6
    fd_a = (loss(1.0 + eps, y0) - loss(1.0 - eps, y0)) / (2 * eps)
    v = jnp.asarray(np.random.default_rng(0).standard_normal(y0.shape))
    fd_y = (loss(1.0, y0 + eps * v) - loss(1.0, y0 - eps * v)) / (2 * eps)
    np.testing.assert_allclose(g_a, fd_a, rtol=1e-6)
    np.testing.assert_allclose(jnp.vdot(g_y, v), fd_y, rtol=1e-6)


@pytest.mark.slow  # (ROCK2 with Interpolating by default: test_spectral_radius.py)
def test_rock2_interpolating_gradient_close_to_discrete():
    f, _, x = heat(32)
    y0 = smooth_y0(x)
    step = og.Adaptive(rtol=1e-8, atol=1e-8)
    adjoints = {"Discrete": og.Discrete(), "Interpolating": og.Interpolating()}
    g = jax.jit(  # both gradients from one compiled program
        lambda a, y: {
            name: jax.grad(_loss(og.ROCK2(), step, adjoint, f, 0.01), argnums=(0, 1))(a, y)
            for name, adjoint in adjoints.items()
        }
    )(1.0, y0)
    np.testing.assert_allclose(g["Interpolating"][0], g["Discrete"][0], rtol=1e-4)
    np.testing.assert_allclose(g["Interpolating"][1], g["Discrete"][1], rtol=1e-4, atol=1e-6)


# -- the stage recurrence's own derivative rules -----------------------------------------------


def _fd4(fn, x, v, eps=1e-4):
    """Fourth-order central difference of ``fn`` at ``x`` in direction ``v`` (``fn`` calls a
    compiled function: eager solves retrace each call)."""
    return (
        -fn(x + 2 * eps * v) + 8 * fn(x + eps * v) - 8 * fn(x - eps * v) + fn(x - 2 * eps * v)
    ) / (12 * eps)


_slow = pytest.mark.slow


@pytest.mark.parametrize(
    "solver,dt,rtol,memory",
    # ROCK4's 28-stage steps round the loss to ~1e-12, which caps a difference quotient at ~1e-7.
    # Every solver once in the default run, both stage-memory paths for ROCK2; the rest is slow.
    [
        pytest.param(og.ROCK2, 0.002, 1e-9, None, marks=_slow),
        (og.ROCK2, 0.05, 1e-9, 2000),
        (og.ROCK4, 0.05, 3e-7, None),
        pytest.param(og.RKC, 0.05, 1e-9, None, marks=_slow),
        pytest.param(og.ROCK2, 0.002, 1e-9, 2000, marks=_slow),
        pytest.param(og.ROCK2, 0.05, 1e-9, None, marks=_slow),
        pytest.param(og.ROCK4, 0.05, 3e-7, 2000, marks=_slow),
        pytest.param(og.RKC, 0.05, 1e-9, 2000, marks=_slow),
    ],
)
def test_recurrence_gradient_matches_finite_differences(solver, dt, rtol, memory, retune):
    """The custom rule (reverse recurrence over the stages really taken) against 4th-order
    central differences in float64, with few stages (kept by the primal pass) and many (the
    reverse pass recomputes them; ``memory=2000`` bytes forces checkpointed segments)."""
    if memory is not None:
        retune(stage_memory=memory)
    # float64: x64 is on for the whole test suite (conftest.py)
    f, _, x = heat(32)
    g = lambda t, y, a: f(t, y, a[0]) + a[1] * jnp.sin(y) * (1.0 + t)  # nonlinear, t-dependent
    y0 = smooth_y0(x)
    a0 = jnp.asarray([1.0, 0.3])

    def loss(a, y):
        sol = og.solve(g, y, (0.0, 0.1), (a[0], a[1]), solver=solver(), step=og.Fixed(dt))
        return jnp.sum(sol.ys[-1] ** 2)

    stages = int(solver().stage_count(1.2 * 4.0 / (1.0 / 33) ** 2 * dt))
    # reverse and forward mode (the tangent recurrence) from one compiled program
    (g_a, g_y), jf = jax.jit(
        lambda a, y: (jax.grad(loss, argnums=(0, 1))(a, y), jax.jacfwd(loss)(a, y))
    )(a0, y0)
    v = jnp.asarray(np.random.default_rng(1).standard_normal(y0.shape))
    loss_c = jax.jit(loss)  # one compile for the eight evaluations of both quotients
    fd_y = _fd4(lambda y: loss_c(a0, y), y0, v)
    fd_a = _fd4(lambda a: loss_c(a, y0), a0, jnp.asarray([1.0, 0.0]))
    np.testing.assert_allclose(jnp.vdot(g_y, v), fd_y, rtol=rtol, err_msg=f"{stages} stages")
    np.testing.assert_allclose(g_a[0], fd_a, rtol=rtol, err_msg=f"{stages} stages")
    # forward mode gives the same numbers
    np.testing.assert_allclose(jf, g_a, rtol=1e-11)


@pytest.mark.parametrize(
    "solver", [og.ROCK2, pytest.param(og.ROCK4, marks=_slow), pytest.param(og.RKC, marks=_slow)]
)
def test_straight_line_reverse_matches_recomputing_reverse(solver):
    """Steps of 1 .. KEPT_STAGES recurrence stages are reversed by straight-line code that
    recomputes the inner stages; it must give the numbers of the recomputing loop (forced by
    ``KEPT_STAGES = 1``), for every stage count it handles and the ones beyond."""
    f, _, x = heat(32)
    g = lambda t, y, a: f(t, y, a[0]) + a[1] * jnp.sin(y) * (1.0 + t)  # nonlinear, t-dependent
    y0 = smooth_y0(x)
    a0 = jnp.asarray([1.0, 0.3])
    rho = 1.2 * 4.0 / (1.0 / 33) ** 2
    dts = [0.0006, 0.0015, 0.003, 0.0045, 0.006, 0.008, 0.011, 0.014]
    counts = {int(solver().stage_count(rho * dt)) for dt in dts}
    assert len(counts) >= 5, counts

    # one solve whose steps take every dt twice, so one compiled gradient (per KEPT_STAGES)
    # reverses every stage count
    ts = jnp.concatenate([jnp.zeros(1), jnp.cumsum(jnp.repeat(jnp.asarray(dts), 2))])
    t1 = float(ts[-1])

    def loss(a, y):
        sol = og.solve(g, y, (0.0, t1), (a[0], a[1]), solver=solver(), step=og.StepTo(ts))
        return jnp.sum(sol.ys[-1] ** 2)

    def both(a, y):  # one compiled program, the second gradient traced with KEPT_STAGES = 1
        straight = jax.grad(loss, argnums=(0, 1))(a, y)
        with tuned(kept_stages=1):
            return straight, jax.grad(loss, argnums=(0, 1))(a, y)

    straight, looped = jax.jit(both)(a0, y0)
    for s_, l_ in zip(straight, looped, strict=True):
        np.testing.assert_allclose(s_, l_, rtol=1e-12, atol=1e-14)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoints", [None, 2])
def test_rock2_adaptive_discrete_recomputes_state_from_y(checkpoints):
    """With a spectral radius the ROCK state ``(f(t, y), rho)`` is recomputed from ``y`` by the
    adaptive Discrete adjoint (its checkpoints keep ``y`` alone); with few slots the binomial
    schedule runs instead of the plain sweep. Both match forward sensitivities."""
    f, _, x = heat(32)
    rho = lambda t, y, a: 4.0 * a / (1.0 / 33) ** 2
    solver = og.ROCK2(spectral_radius=rho)
    assert solver.state_from_y and not og.ROCK2().state_from_y
    y0 = smooth_y0(x)
    step = og.Adaptive(rtol=1e-7, atol=1e-7)

    def loss(a, y, adjoint):
        sol = og.solve(f, y, (0.0, 0.02), a, solver=solver, step=step, adjoint=adjoint)
        return jnp.sum(sol.ys[-1] ** 2)

    steps = int(og.solve(f, y0, (0.0, 0.02), 1.0, solver=solver, step=step).stats["accepted"])
    assert checkpoints is None or steps > checkpoints
    got = jax.grad(loss, argnums=(0, 1))(1.0, y0, og.Discrete(checkpoints))
    # forward mode in two directions (a, and a random direction of y0), not a full Jacobian
    v = jnp.asarray(np.random.default_rng(2).standard_normal(y0.shape))
    fwd = lambda a, y: loss(a, y, og.Forward())
    ref_a = jax.jvp(lambda a: fwd(a, y0), (1.0,), (1.0,))[1]
    ref_v = jax.jvp(lambda y: fwd(1.0, y), (y0,), (v,))[1]
    np.testing.assert_allclose(got[0], ref_a, rtol=1e-9)
    np.testing.assert_allclose(jnp.vdot(got[1], v), ref_v, rtol=1e-9)


def test_one_stage_recurrence_runs_that_stage_or_none():
    """``two_step_recurrence`` with room for one stage (ROCK2's last, a conditional rather than a
    loop): ``n = 1`` takes the stage, ``n = 0`` returns the input pair; values, a VJP and a JVP
    against the stage written out."""
    from odegrad.solvers.stabilized import two_step_recurrence

    def stage(u1, u2, x, theta, _):
        return x * theta * jnp.sin(u1) + 1.5 * u1 - 0.5 * u2

    xs = jnp.asarray([0.7])
    p0, c0, th = jnp.linspace(0.0, 1.0, 5), jnp.linspace(1.0, 2.0, 5), jnp.asarray(0.3)

    def pair(p, c, th, n):
        return two_step_recurrence(stage, p, c, th, None, xs, n)

    ct = (jnp.arange(5.0), jnp.arange(5.0) ** 2)
    for n, want in (
        (1, lambda p, c, th: (c, stage(c, p, 0.7, th, None))),
        (0, lambda p, c, th: (p, c)),
    ):
        run = jax.jit(lambda p, c, th, n=n: pair(p, c, th, jnp.asarray(n)))
        for got, exp in zip(run(p0, c0, th), want(p0, c0, th), strict=True):
            np.testing.assert_allclose(got, exp, rtol=1e-14)
        got = jax.vjp(run, p0, c0, th)[1](ct)
        exp = jax.vjp(want, p0, c0, th)[1](ct)
        for a, b in zip(got, exp, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)
        tangents = (jnp.ones(5), jnp.linspace(-1.0, 1.0, 5), jnp.asarray(2.0))
        got = jax.jvp(run, (p0, c0, th), tangents)[1]
        exp = jax.jvp(want, (p0, c0, th), tangents)[1]
        for a, b in zip(got, exp, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)
    # under vmap, members that take the stage and members that do not: each its own pair
    both = jax.jit(jax.vmap(lambda n: pair(p0, c0, th, n)))(jnp.asarray([0, 1]))
    for got, exp in zip(both, ((p0, c0), (c0, stage(c0, p0, 0.7, th, None))), strict=True):
        np.testing.assert_allclose(got[0], exp[0], rtol=1e-14)
        np.testing.assert_allclose(got[1], exp[1], rtol=1e-14)


@pytest.mark.slow
def test_recurrence_gradient_under_vmap():
    f, _, x = heat(16)
    y0 = smooth_y0(x)

    def loss(a):
        sol = og.solve(f, y0, (0.0, 0.05), a, solver=og.ROCK2(), step=og.Fixed(0.025))
        return jnp.sum(sol.ys[-1] ** 2)

    a = jnp.asarray([0.5, 1.0, 2.0])
    batched = jax.vmap(jax.grad(loss))(a)
    np.testing.assert_allclose(batched, [jax.grad(loss)(ai) for ai in a], rtol=1e-6)


def test_float32_state_with_float64_step_under_x64():
    """A float32 state and times with a Python-float step under x64 (as the continuous
    adjoints probe the dense output): the recurrence keeps its carried dtypes."""
    solver = og.ROCK2()
    f = lambda t, y, a: -a * y
    y = jnp.ones(4, jnp.float32)
    t0 = jnp.asarray(0.0, jnp.float32)
    res = solver.step(f, t0, 0.01, y, jnp.float32(2.0), solver.init(f, t0, y, jnp.float32(2.0)))
    assert res.y1.dtype == jnp.float32
    np.testing.assert_allclose(res.y1, np.exp(-0.02), rtol=1e-5)


# ------------------------------------------------- what Discrete's policy prices per step


def _rock2_grid(n_steps, n=24):
    p = diffusion3d(n, dtype=jnp.float32)
    return p, dict(solver=og.ROCK2(), step=og.Fixed(p.t1 / n_steps))


def test_discrete_prices_a_stabilised_step_by_what_it_keeps():
    """A fixed-grid ROCK2 step keeps a few fields for the reverse pass (its stage recurrence
    recomputes the stages), not one per stage it could take (up to 202): keeping every step is
    what the policy says when that fits, and it says nothing of a revolve schedule."""
    p, kw = _rock2_grid(50)
    text = og.explain_adjoint(p.rhs, p.T0, (0.0, p.t1), (p.lam, p.Ci), **kw)
    assert "Discrete(checkpoints='all')" in text and "nothing is recomputed" in text, text


@pytest.mark.slow
def test_a_stabilised_step_keeps_at_most_what_the_policy_prices():
    """The compiled memory per fixed ROCK2 step is within ``solver.step_residuals`` states."""
    temps = {}
    for n_steps in (4, 8):
        p, kw = _rock2_grid(n_steps)

        def loss(T0, a, kw=kw, p=p):
            return jnp.sum(og.solve(p.rhs, T0, (0.0, p.t1), a, **kw).ys[-1] ** 2)

        pars = (p.lam, p.Ci)
        g = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(p.T0, pars).compile()
        temps[n_steps] = g.memory_analysis().temp_size_in_bytes
    field = p.T0.size * p.T0.dtype.itemsize
    per_step = (temps[8] - temps[4]) / 4
    # y, the carried f and the power-iteration vector: three fields a state
    assert 2 * field <= per_step <= og.ROCK2().step_residuals * 3 * field, per_step / field


@pytest.mark.parametrize("adjoint", [pytest.param(og.Discrete(), marks=pytest.mark.slow),
                                     og.Interpolating()], ids=repr)  # fmt: skip
def test_second_derivatives_are_refused(adjoint):
    """The stage recurrence has a first-order derivative rule: jax.hessian through it raised a
    bare TypeError (Discrete) or, with Interpolating, gave 0.215 for 0.270 silently."""
    f, _, x = heat(16)

    def loss(a):
        sol = og.solve(f, smooth_y0(x), (0.0, 0.01), a, solver=og.ROCK2(), adjoint=adjoint)
        return jnp.sum(sol.ys[-1] ** 2)

    assert np.isfinite(float(jax.grad(loss)(1.0)))
    with pytest.raises(NotImplementedError, match="through ROCK2's steps are not supported"):
        jax.hessian(loss)(1.0)
