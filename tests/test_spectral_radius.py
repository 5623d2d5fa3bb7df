"""The stabilised methods' spectral-radius estimate: the power iteration, its reuse between
refreshes, the refresh after rejections (``after_step``), under vmap, in replays, and handed
from one solve to the next (``resume_state`` / ``init_from``: a continuous adjoint's backward
intervals)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.linalg import expm

import odegrad as og
from odegrad.solvers.stabilized import ROCK2
from test_stabilized import heat, smooth_y0


def test_spectral_radius_refresh_under_vmap_equals_each_member():
    """Under vmap the members' estimates age differently (rejections differ): an accepted step
    and the hook after it (what a loop does) refresh the estimate of the members due and keep
    the others' (the branch runs when any member is due), exactly as each member alone does."""
    f, _, x = heat(24)
    solver = og.ROCK2(rho_every=3)
    y0s = jnp.stack([smooth_y0(x), 0.5 * smooth_y0(x) ** 2])
    a = jnp.asarray([0.7, 1.3])
    states = jax.vmap(lambda y, a_: solver.init(f, 0.0, y, a_))(y0s, a)
    f0, rho, v, age = states
    # member 0 stale (not due), member 1 due; rho set off the truth so a refresh shows
    states = (f0, 0.5 * rho, v, jnp.asarray([0.0, 2.0], age.dtype))

    def step(y, a_, st):
        res = solver.step(f, 0.0, 1e-4, y, a_, st)
        st1, _ = solver.after_step(f, 1e-4, res.y1, a_, res.state, True, False)
        return res._replace(state=st1)

    batched = jax.jit(jax.vmap(step))(y0s, a, states)
    one = jax.jit(step)  # (one compile for both members)
    for i in range(2):
        alone = one(y0s[i], a[i], jax.tree.map(lambda s_: s_[i], states))
        for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(alone), strict=True):
            np.testing.assert_allclose(got[i], want, rtol=1e-13, atol=1e-13)
    new_rho, new_age = batched.state[1], batched.state[3]
    assert new_rho[0] == 0.5 * rho[0] and new_age[0] == 1  # kept, one step older
    assert new_rho[1] != 0.5 * rho[1] and new_age[1] == 0  # refreshed


def test_adaptive_solve_under_vmap_equals_each_member_alone():
    """A batch whose members reject different steps (stiffness growing at different rates):
    the loop refreshes each member's estimate after its own rejections and accepted steps
    (``after_step`` once per attempt), so every member takes the steps, rejections and
    evaluations it takes alone and ends at the same state."""
    f, _, x = heat(40)
    y0 = smooth_y0(x) + 0.2 * jnp.sin(8 * jnp.pi * jnp.asarray(x))
    g = lambda t, y, a: (1 + a * t**2) * f(t, y, 1.0)

    def solve(a):
        sol = og.solve(g, y0, (0.0, 0.05), a, solver=og.ROCK2(rho_every=3),
                       step=og.Adaptive(1e-6, 1e-8))  # fmt: skip
        return sol.ys[-1], sol.stats["rejected"], sol.stats["rhs_evals"]

    a = jnp.asarray([0.0, 4e5])
    batch = jax.jit(jax.vmap(solve))(a)
    one = jax.jit(solve)
    rejected = []
    for i in range(2):
        y1, rej, evals = one(a[i])
        np.testing.assert_allclose(batch[0][i], y1, rtol=1e-12, atol=1e-14)
        assert int(batch[1][i]) == int(rej) and int(batch[2][i]) == int(evals)
        rejected.append(int(rej))
    assert rejected[1] > rejected[0]  # the members did reject differently


@pytest.mark.parametrize("solver", [og.ROCK2, og.RKC])
def test_spectral_radius_estimate_reused_between_refreshes(solver):
    """Refreshing the power-iteration estimate every 25 accepted steps (as RKC does) costs one
    JVP per 25 steps instead of one per step, and the solution stays within the tolerance of
    the every-step estimate and of the exact one."""
    f, a_mat, x = heat(32)
    y0 = smooth_y0(x) + 0.2 * jnp.sin(8 * jnp.pi * jnp.asarray(x))
    t1 = 0.05
    exact = expm(a_mat * t1) @ np.asarray(y0)
    sols = {
        every: og.solve(
            f, y0, (0.0, t1), 1.0, solver=solver(rho_every=every), step=og.Adaptive(1e-6, 1e-8)
        )
        for every in (1, 25)
    }
    steps = int(sols[25].stats["accepted"])
    assert steps > 50  # several refreshes
    saved = int(sols[1].stats["rhs_evals"]) - int(sols[25].stats["rhs_evals"])
    assert saved >= steps - steps // 25 - 5, (saved, steps)
    for sol in sols.values():
        np.testing.assert_allclose(sol.ys[-1], exact, atol=2e-5)
    with pytest.raises(ValueError, match="rho_every"):
        solver(rho_every=0)


@pytest.mark.parametrize("solver", [og.RKC, og.ROCK4])
def test_rejection_refreshes_a_stale_spectral_radius(solver, monkeypatch):
    """Stiffness that grows in time (``y' = (1 + a t^2) A y``) outruns an estimate refreshed
    every 25 steps: after a rejection the estimate is refreshed where the retry starts (as
    ``rkc.f`` does), which saves rejected steps and evaluations; the solution matches
    ``expm``. Without the refresh after rejections it takes several times the rejections."""
    from odegrad.solvers.stabilized import _Stabilized

    f, a_mat, x = heat(32)
    y0 = smooth_y0(x) + 0.2 * jnp.sin(8 * jnp.pi * jnp.asarray(x))
    g = lambda t, y, a: (1 + a * t**2) * f(t, y, 1.0)
    t1, a = 0.05, 4e5
    exact = expm(np.asarray(a_mat) * (t1 + a * t1**3 / 3)) @ np.asarray(y0)

    def run():
        sol = og.solve(g, y0, (0.0, t1), a, solver=solver(), step=og.Adaptive(1e-6, 1e-8))
        np.testing.assert_allclose(sol.ys[-1], exact, atol=1e-10)
        return int(sol.stats["rejected"]), int(sol.stats["rhs_evals"])

    refreshed = run()

    # the hook without its rejection rule: a refresh every rho_every accepted steps only
    def every_25(self, f, t, y, args, state, accepted, rejected):
        return after_step(self, f, t, y, args, state, accepted, False)

    after_step = _Stabilized.after_step
    monkeypatch.setattr(_Stabilized, "after_step", every_25)
    stale = run()
    assert 2 * refreshed[0] < stale[0], (refreshed, stale)
    assert refreshed[1] < 0.8 * stale[1], (refreshed, stale)


def test_after_step_refreshes_stale_estimates_only():
    """The hook re-estimates ``rho`` for members rejected with an estimate made elsewhere
    (``age > 0``) and for accepted members whose estimate turns ``rho_every`` steps old, keeps
    it for the others (counting their age), and counts the JVPs; under vmap per member."""
    f, _, x = heat(24)
    solver = og.ROCK2(rho_every=5)
    y0 = smooth_y0(x)
    f0, rho, v, age = solver.init(f, 0.0, y0, 1.0)
    off = (f0, 0.5 * rho, v, jnp.asarray(3.0, age.dtype))

    def hook(state, accepted, rejected, f=f, a=1.0):
        return solver.after_step(f, 0.0, y0, a, state, jnp.asarray(accepted), jnp.asarray(rejected))

    fresh, n = hook(off, False, True)
    assert int(n) == solver.power_iters and float(fresh[3]) == 0.0
    np.testing.assert_allclose(fresh[1], rho, rtol=0.05)  # one warm-started iteration more
    for state, rejected in ((off, False), ((f0, 0.5 * rho, v, 0.0 * age), True)):
        kept, n = hook(state, False, rejected)
        assert int(n) == 0 and float(kept[1]) == float(0.5 * rho)
        assert float(kept[3]) == float(state[3])
    # accepted: one step older, and refreshed once rho_every (5) steps old
    older, n = hook(off, True, False)
    assert int(n) == 0 and float(older[1]) == float(0.5 * rho) and float(older[3]) == 4.0
    due, n = hook(older, True, False)
    assert int(n) == solver.power_iters and float(due[3]) == 0.0
    np.testing.assert_allclose(due[1], fresh[1], rtol=1e-12)
    stack = lambda *xs: jax.tree.map(lambda *leaves: jnp.stack(leaves), *xs)
    got, n = jax.vmap(hook)(stack(off, off, older), jnp.asarray([False, False, True]),
                            jnp.asarray([True, False, False]))  # fmt: skip
    assert list(np.asarray(n)) == [solver.power_iters, 0, solver.power_iters]
    assert float(got[1][0]) == float(fresh[1]) and float(got[1][1]) == float(0.5 * rho)
    assert list(np.asarray(got[3])) == [0.0, 3.0, 0.0]
    # a breakdown (every product non-finite) keeps the estimate it could not refresh
    broken = lambda t, y, a: f(t, y, a) * jnp.where(a > 0, 1.0, jnp.nan)
    kept, n = hook(off, False, True, f=broken, a=-1.0)
    assert int(n) == solver.power_iters and float(kept[1]) == float(0.5 * rho)
    np.testing.assert_array_equal(kept[2], v)


def test_a_solver_defining_the_removed_after_rejection_hook_fails_loudly():
    """``after_rejection`` became ``after_step``; a subclass that still defines the old hook
    would never be called, so defining it is an error that names the replacement."""
    from odegrad.solvers.base import AbstractSolver

    with pytest.raises(TypeError, match=r"after_step\(f, t, y, args, state, accepted"):

        class Old(AbstractSolver):
            def after_rejection(self, f, t, y, args, state, rejected):
                return state, 0


def test_power_iteration_restarts_from_a_broken_vector_and_keeps_float32_in_range():
    """A zero or non-finite warm start restarts from the fixed start vector; iterates are
    rescaled, so a float32 spectral radius of 1e15 (20 products: 1e300 unscaled) comes out."""
    from odegrad.solvers.stabilized import _start_vector, power_iteration

    d = jnp.linspace(1.0, 2.0, 50, dtype=jnp.float32) * 1e15
    f = lambda t, y, a: -d * y
    y = jnp.ones(50, jnp.float32)
    for v in (_start_vector(y), jnp.zeros_like(y), jnp.full_like(y, jnp.nan)):
        rho, w, _ = power_iteration(f, 0.0, y, None, v, 20)
        assert np.isfinite(np.asarray(w)).all()
        np.testing.assert_allclose(float(rho), 2e15, rtol=0.05)
    u = np.asarray(_start_vector(jnp.zeros((7, 9), jnp.float64)))
    assert u.shape == (7, 9) and np.unique(u).size == u.size
    assert 0.7 < np.linalg.norm(u) < 1.3  # norm ~1: the first norm cannot overflow


def test_power_iteration_stops_when_two_estimates_agree_as_rkc_f_does():
    """With ``rtol`` the iteration stops after the first pair of products whose estimates
    ``|J v| / |v|`` agree to ``rtol`` (``rkc.f``'s rule, checked every second product): the
    count and the estimate equal a NumPy power iteration's with that rule. ``rtol = 0`` makes
    every product asked for (odd counts too); a zero Jacobian stops at the first pair; under
    vmap each member stops where it stops alone."""
    from odegrad.solvers.stabilized import _start_vector, power_iteration

    n = 40
    a = (
        np.diag(-2.0 * np.ones(n)) + np.diag(np.ones(n - 1), 1) + np.diag(np.ones(n - 1), -1)
    ) * n**2
    f = lambda t, y, p: jnp.asarray(a) @ y
    y = jnp.zeros(n)
    v0 = _start_vector(y)

    def reference(v, iters, rtol):
        v, estimates = np.asarray(v), []
        while len(estimates) < iters:
            w = a @ v
            estimates.append(np.linalg.norm(w) / np.linalg.norm(v))
            v = w / np.linalg.norm(w)
            pair_done = len(estimates) % 2 == 0
            if rtol and pair_done and abs(estimates[-1] - estimates[-2]) <= rtol * estimates[-1]:
                break
        return estimates[-1], len(estimates)

    true = np.abs(np.linalg.eigvalsh(a)).max()
    for iters, rtol in ((20, 0.01), (20, 0.05), (20, 0.0), (5, 0.0), (7, 0.01)):
        rho, _, k = power_iteration(f, 0.0, y, None, v0, iters, rtol)
        want, count = reference(v0, iters, rtol)
        assert int(k) == count, (iters, rtol)
        np.testing.assert_allclose(float(rho), want, rtol=1e-12)
        assert 0.9 * true < float(rho) <= true
    assert int(power_iteration(f, 0.0, y, None, v0, 20, 0.01)[2]) < 20  # it did stop early
    zero = lambda t, y, p: 0.0 * y
    rho, _, k = power_iteration(zero, 0.0, y, None, v0, 20, 0.01)
    assert int(k) == 2 and float(rho) == 0.0
    # members: the top eigenvector (agrees at once) and the hashed start; each as alone
    top = jnp.asarray(np.linalg.eigh(a)[1][:, 0])
    starts = jnp.stack([top, v0])
    rho_b, _, k_b = jax.vmap(lambda v: power_iteration(f, 0.0, y, None, v, 20, 0.01))(starts)
    for i in range(2):
        rho_i, _, k_i = power_iteration(f, 0.0, y, None, starts[i], 20, 0.01)
        assert int(k_b[i]) == int(k_i) and float(rho_b[i]) == float(rho_i)
    assert int(k_b[0]) == 2 < int(k_b[1])


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_replays_refresh_after_the_rejections_the_forward_loop_refreshed_after(retune):
    """Adjoints that replay steps from checkpoints (``Discrete(3)``, ``Interpolating(
    checkpoints=3)``) chain each step's state into the next; where the forward loop refreshed
    the estimate after a rejection, so must they (``StepRecord(retries=True)``), or they
    retake steps with the stale estimate: unstable, gradients of 1e200 or nan before this."""
    # the replays do not depend on how a step's stages are reversed: straight-line code for up
    # to 2 stages (not 6) halves the compile (test_straight_line_reverse_* covers the rest)
    retune(kept_stages=2)
    f, _, x = heat(8)
    y0 = smooth_y0(x) + 0.2 * jnp.sin(8 * jnp.pi * jnp.asarray(x))
    b = jnp.cos(3 * jnp.asarray(x))
    g = lambda t, y, p: (1 + p[0] * t**2) * (f(t, y, 1.0) + p[1] * b)
    p = (jnp.asarray(1e8), jnp.asarray(2.0))
    step = og.Adaptive(1e-3, 1e-5)

    def grad(adjoint, c, y0):
        def loss(c, y0):
            sol = og.solve(g, y0, (0.0, 0.01), (p[0], c), solver=og.RKC(), step=step,
                           adjoint=adjoint)  # fmt: skip
            return jnp.sum(sol.ys[-1] ** 2), sol.stats["rejected"]

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(c, y0)

    # Discrete("all") replays nothing: every step's state is stored; the three gradients from
    # one compiled program
    adjoints = (og.Discrete("all"), og.Discrete(3), og.Interpolating(checkpoints=3))
    (exact, rejected), *others = jax.jit(lambda c, y0: [grad(a, c, y0) for a in adjoints])(p[1], y0)
    assert int(rejected) >= 5  # (the forward loop's own count)
    assert abs(float(exact[0])) > 1e-3
    # dL/dy0 is ~1e-143 exactly (the stiffness damps y0 out): Discrete's is its steps'
    # amplification, 1e-13 to 1e-10 as rounding moves the step sizes, the continuous adjoint's
    # ~1e-23; both far below dL/dc's 9e-3. Discrete(3) replays Discrete("all")'s steps exactly.
    (replayed, _), (continuous, _) = others
    np.testing.assert_allclose(replayed[0], exact[0], rtol=1e-12)
    np.testing.assert_allclose(replayed[1], exact[1], rtol=1e-9, atol=1e-20)
    np.testing.assert_allclose(continuous[0], exact[0], rtol=1e-9)
    np.testing.assert_allclose(continuous[1], exact[1], atol=1e-9)


# -- handed from one solve to the next ----------------------------------------------------------


def test_init_from_keeps_a_usable_estimate_and_starts_afresh_otherwise():
    """``init_from`` with a previous solve's ``resume_state``: ``f(t, y)`` evaluated afresh and
    the estimate kept (one evaluation, ``age`` at least 1 so that a rejection refreshes it);
    with nan (nothing known) exactly ``init`` (``f`` and the power iteration's products); under
    vmap per member. With a user's bound nothing is handed on."""
    f, _, x = heat(24)
    solver = og.ROCK2()
    y0, y1 = smooth_y0(x), 0.5 * smooth_y0(x) ** 2
    fresh = solver.init(f, 0.1, y1, 1.3)
    prev = solver.resume_state(solver.init(f, 0.0, y0, 0.7))
    got, n = solver.init_from(f, 0.1, y1, 1.3, prev)
    assert int(n) == 1 and float(got[3]) == 1.0
    np.testing.assert_array_equal(got[0], f(0.1, y1, 1.3))
    assert float(got[1]) == float(prev[0]) and float(got[1]) != float(fresh[1])
    np.testing.assert_array_equal(got[2], prev[1])
    unknown = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), prev)
    got, n = solver.init_from(f, 0.1, y1, 1.3, unknown)
    fresh_evals = int(solver.init_from(f, 0.1, y1, 1.3, None)[1])
    assert 1 < fresh_evals <= 1 + solver.init_power_iters
    assert int(n) == fresh_evals and float(got[3]) == 0.0
    for a, b in zip(got, fresh, strict=True):
        np.testing.assert_array_equal(a, b)
    stack = lambda *xs: jax.tree.map(lambda *leaves: jnp.stack(leaves), *xs)
    batched, n = jax.vmap(lambda p: solver.init_from(f, 0.1, y1, 1.3, p))(stack(prev, unknown))
    assert list(np.asarray(n)) == [1, fresh_evals]
    assert float(batched[1][0]) == float(prev[0]) and float(batched[1][1]) == float(fresh[1])
    bounded = og.ROCK2(spectral_radius=lambda t, y, a: 4.0 * a / (1 / 25) ** 2)
    assert bounded.resume_state(bounded.init(f, 0.0, y0, 1.0)) is None
    got, n = bounded.init_from(f, 0.1, y1, 1.3, None)
    assert int(n) == bounded.init_evals
    for a, b in zip(got, bounded.init(f, 0.1, y1, 1.3), strict=True):
        np.testing.assert_array_equal(a, b)


_INITS: list[int] = []


class _CountedROCK2(ROCK2):
    """ROCK2 reporting at run time, per solve or backward interval, whether ``init_from`` had
    to estimate afresh (``f`` and the power iteration's products) or reused the estimate (1)."""

    def init_from(self, f, t0, y0, args, previous):
        state, evals = super().init_from(f, t0, y0, args, previous)
        jax.debug.callback(lambda n: _INITS.append(int(n)), evals)
        return state, evals


@pytest.mark.parametrize(
    "adjoint, step",
    [  # (all with -m slow, 19-23 s each: the suite stays under 15 minutes on 2 cores; the
        # default run keeps ROCK2's continuous adjoint, test_rock2_interpolating_gradient_...)
        pytest.param(og.Interpolating(), og.Adaptive(1e-7, 1e-9), marks=pytest.mark.slow),
        pytest.param(og.Quadrature(), og.Adaptive(1e-7, 1e-9), marks=pytest.mark.slow),
        pytest.param(og.Backsolve(), og.Adaptive(1e-7, 1e-9), marks=pytest.mark.slow),
        pytest.param(
            og.Interpolating(checkpoints=3), og.Adaptive(1e-7, 1e-9), marks=pytest.mark.slow
        ),
        # (on a fixed grid the backward ODE's own O(dt^2) error: 0.7 % from Discrete's)
        pytest.param(og.Interpolating(), og.Fixed(0.002), marks=pytest.mark.slow),
    ],
    ids=["interpolating", "quadrature", "backsolve", "checkpoints", "fixed-grid"],
)
def test_backward_intervals_reuse_the_spectral_radius(adjoint, step):
    """A continuous adjoint integrates backwards interval by interval (between save times, or
    step by step on a fixed grid); with adaptive steps each interval starts from the
    spectral-radius estimate the one before it ended with: the power iteration runs its
    ``init_power_iters`` JVPs once, not once per interval (seed 001: 1125 intervals). Fixed
    steps, which nothing rejects, estimate afresh. The gradient matches the Discrete
    adjoint's and, to rounding, the one that re-estimates at every interval."""
    _INITS.clear()
    got = _heat_gradient(_CountedROCK2(), adjoint, step)
    log = np.asarray(_INITS)
    fresh = log > 1  # f and the power iteration's products, against f alone
    assert log.size >= 10 and log.max() <= 1 + og.ROCK2().init_power_iters, log
    if isinstance(step, og.Adaptive):
        # the forward solve's start and the first backward interval's estimate afresh
        assert fresh[:2].all() and np.all(log[2:] == 1), log
    else:  # nothing rejects a fixed step: afresh each time (test_fixed_step_backward_solve_*)
        assert np.all(fresh), log
    # every interval re-estimating (the default init_from) gives the same gradient
    afresh = type("Afresh", (ROCK2,), {"resume_state": lambda self, state: None})()
    again = _heat_gradient(afresh, adjoint, step)
    exact = _heat_gradient(og.ROCK2(), og.Discrete(), step)
    for g, r, e in zip(got, again, exact, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-8, atol=1e-12 * np.max(np.abs(r)))
        tol = 2e-3 if isinstance(step, og.Adaptive) else 1.5e-2
        np.testing.assert_allclose(g, e, rtol=tol, atol=tol * np.max(np.abs(e)))


@functools.cache
def _heat_gradient(solver, adjoint, step):
    """The gradient of the saves' squares with respect to ``(a, y0)`` (cached: Discrete's
    reference is shared by the cases with the same steps)."""
    f, _, x = heat(24)
    y0 = smooth_y0(x) + 0.2 * jnp.sin(8 * jnp.pi * jnp.asarray(x))
    ts = jnp.linspace(0.0, 0.02, 11)

    def loss(a, y0):
        sol = og.solve(f, y0, (0.0, 0.02), a, solver=solver, step=step, adjoint=adjoint,
                       saveat=og.SaveAt(ts=ts))  # fmt: skip
        return jnp.sum(sol.ys**2)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(1.0, y0)


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_backward_intervals_resume_per_member_under_vmap():
    """Under vmap each member hands its own estimate from interval to interval: the batched
    gradient is each member's alone."""
    f, _, x = heat(16)
    y0 = smooth_y0(x)
    ts = jnp.linspace(0.0, 0.02, 6)

    def grad(a):
        def loss(a):
            sol = og.solve(f, y0, (0.0, 0.02), a, solver=og.ROCK2(), step=og.Adaptive(1e-7, 1e-9),
                           adjoint=og.Interpolating(), saveat=og.SaveAt(ts=ts))  # fmt: skip
            return jnp.sum(sol.ys**2)

        return jax.grad(loss)(a)

    a = jnp.asarray([0.5, 2.0])
    batched = jax.jit(jax.vmap(grad))(a)
    one = jax.jit(grad)
    np.testing.assert_allclose(batched, [one(ai) for ai in a], rtol=1e-10)


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_fixed_step_backward_solve_estimates_afresh_where_stiffness_grows():
    """On a fixed grid nothing rejects a backward step, so an estimate handed on from a less
    stiff interval would choose too few stages and diverge: fixed-step backward solves
    re-estimate per interval (as before the hand-over). Diffusion that decays in time meets
    growing stiffness backwards; Interpolating matches Discrete (it read 1e19 with the
    estimate handed on). Backsolve, unstable on diffusion, is reported (its re-integrated
    state misses y0 at t0), not returned as a gradient of 1e115."""
    n = 60
    x = jnp.linspace(0.0, 1.0, n)
    lap = lambda y: (jnp.roll(y, 1) - 2 * y + jnp.roll(y, -1)) * n**2
    f = lambda t, y, p: p[0] * jnp.exp(-6.0 * t) * lap(y) + p[1] * jnp.sin(2 * jnp.pi * x)
    y0 = jnp.exp(-50 * (x - 0.5) ** 2)

    def grad(p, adjoint):
        def loss(p):
            sol = og.solve(f, y0, (0.0, 1.0), p, solver=og.ROCK2(), step=og.Fixed(0.01),
                           adjoint=adjoint)  # fmt: skip
            return jnp.sum(sol.ys**2)

        return jax.jit(jax.grad(loss))(p)

    p = jnp.asarray([0.3, 0.5])
    exact = grad(p, og.Discrete())
    np.testing.assert_allclose(grad(p, og.Interpolating()), exact, rtol=1e-3)
    with pytest.raises(Exception, match=r"drifted .* at a save time or at t0 .*steps are fixed"):
        grad(p, og.Backsolve())


def test_bad_spectral_radius_options_are_refused():
    """Settings that leave the stage count unstable are refused by name; a NaN bound fails the
    step (Result.nonfinite) rather than stepping with too few stages (1e21..1e37 before)."""
    for make, name in [
        (lambda: og.ROCK2(safety=0), "safety"),
        (lambda: og.ROCK4(init_power_iters=0), "init_power_iters"),
        (lambda: og.ROCK2(power_iters=0), "power_iters"),
        (lambda: og.RKC(max_stages=1), "max_stages"),
    ]:
        with pytest.raises(ValueError, match=rf"\({name}="):
            make()
    with pytest.raises(TypeError, match=r"spectral_radius=3.0\): a function"):
        og.ROCK2(3.0)
    f, _, x = heat(16)
    y0 = smooth_y0(x)
    for bound, says in [(lambda t, y, a: jnp.ones(1), "shape"), (lambda t, y, a: None, "None")]:
        with pytest.raises(ValueError, match=rf"spectral_radius=...\) returned {says}"):
            og.solve(f, y0, (0.0, 0.1), 1.0, solver=og.ROCK2(bound), step=og.Fixed(0.01))
    nan_bound = og.ROCK2(lambda t, y, a: jnp.nan)
    sol = og.solve(f, y0, (0.0, 0.1), 1.0, solver=nan_bound, step=og.Fixed(0.01), throw=False)
    assert sol.result == og.Result.nonfinite
