"""Validation of the CVODES reference (:mod:`cvodes`) and the shared problems
(:mod:`reference_problems`) against references that do not go through CasADi:

* states: SciPy's DOP853 (non-stiff) / Radau (stiff) at ``rtol=1e-12``, with the right-hand side
  evaluated through a NumPy namespace (so a CasADi transcription error would show);
* gradients: central finite differences of :func:`cvodes_solve` (Lotka–Volterra, Robertson),
  CVODES forward vs adjoint sensitivities, and the variational system integrated by DOP853;
* a linear system ``y' = A y``: ``expm`` for the states, ``expm`` / ``expm_frechet`` for the
  gradients with respect to ``y0`` and ``A``;
* the JAX and CasADi right-hand sides built from the one definition agree.

Measured (this machine, default ``rtol = atol = 1e-12``): states agree with SciPy to <= 4e-10
of each component's scale, forward-mode gradients with the variational system to <= 3e-10 and
with the closed form to ~1e-11, finite differences to ~1e-8 (limited by the differences
themselves), adjoint mode with forward mode to <= 2e-7. The bounds below leave >= 10x headroom.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from scipy.integrate import solve_ivp
from scipy.linalg import expm, expm_frechet

try:  # tests/ on sys.path (pytest's default rootdir-relative import)
    import reference_problems as rp
    from cvodes import cvodes_gradient, cvodes_jacobian, cvodes_solve
except ImportError:  # tests imported as a package
    from tests import reference_problems as rp
    from tests.cvodes import cvodes_gradient, cvodes_jacobian, cvodes_solve

NP = rp.NUMPY

ALL = list(rp.PROBLEMS)


def scaled_err(ys, ref) -> float:
    """``max |ys - ref|`` with each component divided by its largest magnitude over time."""
    ys, ref = np.asarray(ys), np.asarray(ref)
    scale = np.maximum(np.max(np.abs(ref), axis=0), 1e-300)
    return float(np.max(np.abs(ys - ref) / scale))


@functools.cache
def scipy_solution(name: str) -> tuple[np.ndarray, np.ndarray]:
    p = rp.get_problem(name)
    ts = p.ts()
    sol = solve_ivp(
        lambda t, y: p.rhs(t, y, p.params, NP),
        (p.t0, p.t1),
        p.y0,
        method="Radau" if p.stiff else "DOP853",
        t_eval=ts,
        rtol=1e-12,
        atol=1e-14 if p.stiff else 1e-12,
    )
    assert sol.status == 0, sol.message
    return ts, sol.y.T


def random_weights(n_ts: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_ts, n))


# --------------------------------------------------------------------------------------------
# the problems themselves


@pytest.mark.parametrize("name", ALL)
def test_backends_agree(name):
    """The JAX, CasADi and NumPy right-hand sides built from one definition agree."""
    import jax.numpy as jnp

    p = rp.get_problem(name)
    rng = np.random.default_rng(1)
    f_jax = rp.jax_rhs(p)
    f_ca = p.numpy_rhs()
    for _ in range(3):
        t = float(rng.uniform(p.t0, p.t1))
        y = p.y0 + 0.1 * rng.standard_normal(p.n)
        a = p.params * (1.0 + 0.1 * rng.standard_normal(p.n_params))
        want = np.asarray(p.rhs(t, y, a, NP))
        got_jax = np.asarray(f_jax(jnp.asarray(t), jnp.asarray(y), jnp.asarray(a)))
        assert got_jax.shape == (p.n,)
        np.testing.assert_allclose(got_jax, want, rtol=1e-13, atol=1e-13 * np.max(np.abs(want)))
        np.testing.assert_allclose(
            f_ca(t, y, a), want, rtol=1e-13, atol=1e-13 * np.max(np.abs(want))
        )


def test_problem_catalogue():
    for name in (
        "lotka_volterra",
        "damped_pendulum",
        "lorenz",
        "fitzhugh_nagumo",
        "brusselator",
        "forced_oscillator",
        "robertson",
        "van_der_pol_stiff",
        "linear",
    ):
        assert name in rp.PROBLEMS
    assert rp.get_problem("lorenz").t1 <= 1.0
    rob = rp.get_problem("robertson")
    assert rob.stiff and rob.t1 == 100.0
    np.testing.assert_array_equal(rob.params, [0.04, 3e7, 1e4])
    vdp = rp.get_problem("van_der_pol_stiff")
    assert vdp.stiff and vdp.t1 == 500.0 and vdp.params[0] == 1000.0
    assert rp.get_problem("lotka_volterra").n_params == 4
    assert rp.get_problem("fitzhugh_nagumo").n_params == 4


# --------------------------------------------------------------------------------------------
# (a) states against SciPy


@pytest.mark.parametrize("name", ALL)
def test_solve_matches_scipy(name):
    ts, ref = scipy_solution(name)
    ys = cvodes_solve(rp.get_problem(name), ts=ts)
    assert ys.shape == ref.shape
    err = scaled_err(ys, ref)
    assert err < 1e-8, f"{name}: {err:.2e}"


def test_solve_save_times_and_time_dependence():
    """``ts[0] == t0`` returns ``y0``; ``ts`` may start later; ``t0 != 0`` with explicit ``t``."""
    p = dataclasses.replace(rp.forced_oscillator(), name="forced_oscillator_t0", t0=1.3)
    ts = np.array([1.3, 2.0, 4.5, 7.0])
    ys = cvodes_solve(p, ts=ts)
    np.testing.assert_array_equal(ys[0], p.y0)
    sol = solve_ivp(
        lambda t, y: p.rhs(t, y, p.params, NP),
        (1.3, 7.0),
        p.y0,
        method="DOP853",
        t_eval=ts,
        rtol=1e-12,
        atol=1e-12,
    )
    assert scaled_err(ys, sol.y.T) < 1e-8
    # the same times without t0 in the grid
    np.testing.assert_allclose(cvodes_solve(p, ts=ts[1:]), ys[1:], rtol=0, atol=1e-9)
    # shifting t0 changes the (time-dependent) solution: t really enters the CasADi RHS
    ys0 = cvodes_solve(rp.get_problem("forced_oscillator"), ts=ts - 1.3)
    assert np.max(np.abs(ys0 - ys)) > 1e-2


def test_input_validation():
    p = rp.get_problem("lotka_volterra")
    with pytest.raises(ValueError):
        cvodes_solve(p, ts=[1.0, 0.5])
    with pytest.raises(ValueError):
        cvodes_solve(p, ts=[-1.0, 1.0])
    with pytest.raises(ValueError):
        cvodes_solve(p, y0=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError):
        cvodes_gradient(p, ts=[1.0, 2.0], weights=np.ones((2, 3)))


# --------------------------------------------------------------------------------------------
# (b) gradients against finite differences, the adjoint, and the variational system


def fd_gradient(p, y0, params, ts, weights, rel=1e-4, zero_step=1e-6, tol=1e-14):
    """Central differences of the loss, Richardson-extrapolated (error O(h^4)).

    Step ``h = rel * |z_j|`` (``zero_step`` where ``z_j == 0``). Plain central differences at
    ``h ~ 1e-6 |z|`` are limited to ~1e-7 by the solver's own noise (error/h); extrapolating
    from ``h ~ 1e-4 |z|`` keeps that noise down while cancelling the O(h^2) truncation.
    """
    z = np.concatenate([y0, params])

    def loss(zz):
        return np.sum(weights * cvodes_solve(p, zz[: p.n], zz[p.n :], ts, tol, tol))

    def central(j, h):
        zp, zm = z.copy(), z.copy()
        zp[j] += h
        zm[j] -= h
        return (loss(zp) - loss(zm)) / (2 * h)

    g = np.empty_like(z)
    for j in range(z.size):
        h = rel * abs(z[j]) if z[j] != 0 else zero_step
        g[j] = (4 * central(j, h / 2) - central(j, h)) / 3
    return g


def log_scaled_err(g, ref, z) -> float:
    """Error of ``z_j * g_j`` (derivatives w.r.t. ``log z_j``; ``1`` where ``z_j == 0``) relative
    to the largest such entry: fair to parameters that differ by orders of magnitude."""
    s = np.where(z != 0, np.abs(z), 1.0)
    return float(np.max(np.abs(s * (g - ref))) / np.max(np.abs(s * ref)))


@pytest.mark.parametrize(
    "name, ts, bound",
    [
        ("lotka_volterra", np.array([0.0, 1.0, 2.5, 4.0, 7.5, 10.0]), 1e-7),
        ("lotka_volterra", np.array([0.4, 3.3, 6.1]), 1e-7),
        # d/dy0_2 at y0_2 = 0 (equilibrium scale ~4e-5) is the noisiest entry
        ("robertson", np.array([1e-3, 0.1, 1.0, 10.0, 40.0, 100.0]), 1e-5),
    ],
)
def test_gradient_vs_finite_differences(name, ts, bound):
    p = rp.get_problem(name)
    w = random_weights(ts.size, p.n, seed=3)
    loss, gy0, gp = cvodes_gradient(p, p.y0, p.params, ts, w)
    ys = cvodes_solve(p, p.y0, p.params, ts)
    assert abs(loss - np.sum(w * ys)) <= 1e-12 * max(1.0, abs(loss))
    assert gy0.shape == (p.n,) and gp.shape == (p.n_params,)
    g = np.concatenate([gy0, gp])
    fd = fd_gradient(p, p.y0, p.params, ts, w)
    err = log_scaled_err(g, fd, np.concatenate([p.y0, p.params]))
    assert err < bound, f"{name}: {err:.2e}"


@pytest.mark.parametrize(
    "name, tol, bound",
    [
        ("lotka_volterra", 1e-12, 3e-6),
        ("brusselator", 1e-12, 3e-6),
        ("robertson", 1e-10, 1e-6),
        ("van_der_pol_stiff", 1e-10, 1e-6),
    ],
)
def test_forward_and_adjoint_agree(name, tol, bound):
    p = rp.get_problem(name)
    ts = p.ts()
    w = random_weights(ts.size, p.n, seed=4)
    lf, gyf, gpf = cvodes_gradient(p, ts=ts, weights=w)
    la, gya, gpa = cvodes_gradient(p, ts=ts, weights=w, rtol=tol, atol=tol, mode="adjoint")
    assert abs(lf - la) <= 1e3 * tol * max(1.0, abs(lf))
    err = log_scaled_err(
        np.concatenate([gya, gpa]), np.concatenate([gyf, gpf]), np.concatenate([p.y0, p.params])
    )
    assert err < bound, f"{name}: {err:.2e}"


def variational_reference(p, ts):
    """``(ys, S)`` with ``S[k] = d y(ts[k]) / d [y0, p]`` from the variational equations
    (Jacobians by central differences of the NumPy RHS, integrated by DOP853 at 1e-13)."""
    n, m = p.n, p.n_params

    def jac(t, y, a):
        z = np.concatenate([y, a])
        cols = []
        for j in range(n + m):
            h = 1e-5 * max(1.0, abs(z[j]))
            zp, zm = z.copy(), z.copy()
            zp[j] += h
            zm[j] -= h
            fp = np.asarray(p.rhs(t, zp[:n], zp[n:], NP))
            fm = np.asarray(p.rhs(t, zm[:n], zm[n:], NP))
            cols.append((fp - fm) / (2 * h))
        return np.stack(cols, axis=1)  # exact for polynomials of degree <= 2 in (y, p)

    def rhs(t, state):
        y, s = state[:n], state[n:].reshape(n, n + m)
        jz = jac(t, y, p.params)
        ds = jz[:, :n] @ s
        ds[:, n:] += jz[:, n:]
        return np.concatenate([np.asarray(p.rhs(t, y, p.params, NP)), ds.ravel()])

    s0 = np.hstack([np.eye(n), np.zeros((n, m))]).ravel()
    sol = solve_ivp(
        rhs,
        (p.t0, ts[-1]),
        np.concatenate([p.y0, s0]),
        method="DOP853",
        t_eval=ts,
        rtol=1e-13,
        atol=1e-13,
    )
    return sol.y.T[:, :n], sol.y.T[:, n:].reshape(ts.size, n, n + m)


@pytest.mark.parametrize("name", ["lotka_volterra", "lorenz", "brusselator", "fitzhugh_nagumo"])
def test_jacobian_vs_variational_system(name):
    """Polynomial right-hand sides, for which the differenced Jacobian is exact."""
    p = rp.get_problem(name)
    ts = p.ts(6)
    ys_ref, s_ref = variational_reference(p, ts)
    ys, dy0, dp = cvodes_jacobian(p, ts=ts)
    assert dy0.shape == (ts.size, p.n, p.n) and dp.shape == (ts.size, p.n, p.n_params)
    assert scaled_err(ys, ys_ref) < 1e-9
    s = np.concatenate([dy0, dp], axis=2)
    err = np.max(np.abs(s - s_ref)) / np.max(np.abs(s_ref))
    assert err < 1e-8, f"{name}: {err:.2e}"


# --------------------------------------------------------------------------------------------
# (c) closed form on y' = A y


def test_linear_closed_form():
    p = rp.get_problem("linear")
    n = p.extra["n"]
    a = p.params.reshape(n, n)
    ts = np.array([0.0, 0.3, 0.9, 1.4, 2.0])
    w = random_weights(ts.size, n, seed=5)

    exact = np.stack([expm(a * t) @ p.y0 for t in ts])
    assert scaled_err(cvodes_solve(p, ts=ts), exact) < 1e-10

    # d y(t) / d y0 = expm(A t);  d y(t) / d A_ij = L(A t, t E_ij) y0 (Fréchet derivative)
    _, dy0, dp = cvodes_jacobian(p, ts=ts)
    np.testing.assert_allclose(dy0, np.stack([expm(a * t) for t in ts]), rtol=0, atol=1e-10)
    dp_exact = np.zeros((ts.size, n, n * n))
    for k, t in enumerate(ts):
        for ij in range(n * n):
            e = np.zeros(n * n)
            e[ij] = 1.0
            dp_exact[k, :, ij] = expm_frechet(a * t, t * e.reshape(n, n), compute_expm=False) @ p.y0
    np.testing.assert_allclose(dp, dp_exact, rtol=0, atol=1e-10)

    loss, gy0, gp = cvodes_gradient(p, ts=ts, weights=w)
    assert abs(loss - np.sum(w * exact)) < 1e-10
    np.testing.assert_allclose(gy0, np.einsum("ki,kij->j", w, dy0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        gy0, sum(expm(a * t).T @ w[k] for k, t in enumerate(ts)), rtol=0, atol=1e-10
    )
    np.testing.assert_allclose(gp, np.einsum("ki,kij->j", w, dp_exact), rtol=0, atol=1e-10)

    _, gy0_adj, gp_adj = cvodes_gradient(p, ts=ts, weights=w, mode="adjoint")
    np.testing.assert_allclose(gy0_adj, gy0, rtol=0, atol=1e-7)
    np.testing.assert_allclose(gp_adj, gp, rtol=0, atol=1e-7)
