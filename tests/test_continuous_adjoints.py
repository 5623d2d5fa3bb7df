"""Continuous adjoints (Backsolve, Interpolating, Quadrature) and Forward / Auto.

What is checked, and against what:

* gradients of ``sum(ys**2)`` at 10 save times on six classic non-stiff problems against SUNDIALS
  CVODES forward sensitivities (an independent code), at ``rtol = atol = 1e-11``;
* a dissipative PDE (1-d heat equation): every robust method against ``og.Discrete``; Backsolve is
  either accurate or raises — never silently wrong;
* the scenario of seed 000 (mixed scalar + vector state, ``abs`` kinks), flat and as a pytree,
  across methods, and in float32;
* a user-supplied ``vjp=``, ``jit`` + ``vmap``, ``og.explain_adjoint``, and the compiled memory of
  ``Interpolating(checkpoints=c)``.

Compilation dominates the run time, so every jitted gradient is built once per configuration
(``functools.cache``).
"""

from __future__ import annotations

import functools

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import odegrad as og  # noqa: E402

try:  # tests/ on sys.path (pytest's default rootdir-relative import)
    import kink_references as kr
    from cvodes import cvodes_gradient, cvodes_solve
    from reference_problems import get_problem, jax_rhs
except ImportError:  # tests imported as a package
    from tests import kink_references as kr
    from tests.cvodes import cvodes_gradient, cvodes_solve
    from tests.reference_problems import get_problem, jax_rhs

slow = pytest.mark.slow

ADJOINTS = {
    "Backsolve": og.Backsolve(),
    "Interpolating": og.Interpolating(),
    "Interpolating4": og.Interpolating(checkpoints=4),
    # the dense output kept 16 steps at a time, earlier blocks re-taken (DenseBlocks)
    "InterpolatingBlocks": og.Interpolating(dense_rows=16),
    "Quadrature": og.Quadrature(),
    "Forward": og.Forward(),
    "Auto": og.Auto(),
}
PROBLEM_NAMES = (
    "lotka_volterra",
    "damped_pendulum",
    "lorenz",
    "fitzhugh_nagumo",
    "brusselator",
    "forced_oscillator",
)
TOL = 1e-11


def rel_err(a, b) -> float:
    """``max |a - b| / max |b|`` over all leaves of two pytrees of the same structure."""
    la = [np.asarray(x, dtype=np.float64).ravel() for x in jax.tree.leaves(a)]
    lb = [np.asarray(x, dtype=np.float64).ravel() for x in jax.tree.leaves(b)]
    assert len(la) == len(lb)
    a_, b_ = np.concatenate(la), np.concatenate(lb)
    return float(np.max(np.abs(a_ - b_)) / np.max(np.abs(b_)))


# --------------------------------------------------------------------------------------------
# 1. classic problems against CVODES


@functools.cache
def cvodes_reference(name: str):
    pr = get_problem(name)
    ts = pr.ts(10)
    ys = cvodes_solve(pr, ts=ts, rtol=1e-12, atol=1e-12)
    loss, g_y0, g_p = cvodes_gradient(pr, ts=ts, weights=2.0 * ys, rtol=1e-12, atol=1e-12)
    return ts, float(np.sum(ys**2)), loss, g_y0, g_p


@functools.cache
def classic_grad(name: str, adjoint_name: str, solver_name: str = "Tsit5"):
    pr = get_problem(name)
    f = jax_rhs(pr)
    ts = jnp.asarray(pr.ts(10))
    adjoint = ADJOINTS[adjoint_name]
    solver = getattr(og, solver_name)()

    def loss(y0, p):
        sol = og.solve(
            f,
            y0,
            (pr.t0, pr.t1),
            p,
            solver=solver,
            step=og.Adaptive(rtol=TOL, atol=TOL),
            saveat=og.SaveAt(ts=ts),
            adjoint=adjoint,
            max_steps=100_000,
        )
        return jnp.sum(sol.ys**2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


# The default tier: Lotka-Volterra with each adjoint but Auto (it picks Forward there) and
# Interpolating4 (Interpolating's checkpoints: test_adjoint_columns.py's saved-function case)
CLASSIC_CASES = [
    pytest.param(
        p, a, id=f"{p}-{a}",
        marks=() if p == "lotka_volterra" and a not in ("Auto", "Interpolating4") else slow,
    )
    for p in PROBLEM_NAMES
    for a in ADJOINTS
]  # fmt: skip


@pytest.mark.parametrize("name, adjoint_name", CLASSIC_CASES)
def test_classic_vs_cvodes(name, adjoint_name):
    pr = get_problem(name)
    _, sumsq, loss_ref, g_y0_ref, g_p_ref = cvodes_reference(name)
    # the CVODES loss sum(2 y * y) is twice our sum of squares: a consistency check of the weights
    assert loss_ref == pytest.approx(2 * sumsq, rel=1e-12)
    value, (g_y0, g_p) = classic_grad(name, adjoint_name)(
        jnp.asarray(pr.y0), jnp.asarray(pr.params)
    )
    e_y0, e_p = rel_err(g_y0, g_y0_ref), rel_err(g_p, g_p_ref)
    print(f"\n{name} {adjoint_name} Tsit5: rel err dL/dy0 {e_y0:.2e}  dL/dp {e_p:.2e}")
    assert float(value) == pytest.approx(sumsq, rel=1e-8)
    assert e_y0 < 1e-5
    assert e_p < 1e-5


DOPRI8_CASES = [
    pytest.param(
        p,
        a,
        marks=slow,
        id=f"{p}-{a}",  # (Dopri8's dense output: test_solvers, in the default run)
    )
    for p in PROBLEM_NAMES
    for a in ADJOINTS
]


@pytest.mark.parametrize("name, adjoint_name", DOPRI8_CASES)
def test_classic_vs_cvodes_dopri8(name, adjoint_name):
    """The issue's setting: Dopri8 at rtol=atol=1e-11 (its 14-stage continuous extension feeds
    the saves and the continuous adjoints)."""
    pr = get_problem(name)
    _, _, _, g_y0_ref, g_p_ref = cvodes_reference(name)
    _, (g_y0, g_p) = classic_grad(name, adjoint_name, "Dopri8")(
        jnp.asarray(pr.y0), jnp.asarray(pr.params)
    )
    e_y0, e_p = rel_err(g_y0, g_y0_ref), rel_err(g_p, g_p_ref)
    print(f"\n{name} {adjoint_name} Dopri8: rel err dL/dy0 {e_y0:.2e}  dL/dp {e_p:.2e}")
    assert e_y0 < 1e-5
    assert e_p < 1e-5


# --------------------------------------------------------------------------------------------
# 2. a dissipative PDE: the heat equation

HEAT_N = 64


def heat_f(t, y, k):
    padded = jnp.concatenate([jnp.zeros(1, y.dtype), y, jnp.zeros(1, y.dtype)])
    dx = 1.0 / (HEAT_N + 1)
    return k * (padded[2:] - 2 * y + padded[:-2]) / dx**2


def heat_y0():
    x = np.arange(1, HEAT_N + 1) / (HEAT_N + 1)
    return jnp.asarray(np.exp(-80.0 * (x - 0.4) ** 2) + 0.3 * np.sin(np.pi * x))


HEAT_TS = jnp.linspace(0.0, 0.05, 6)


@functools.cache
def heat_grad(adjoint_name: str):
    adjoint = og.Discrete() if adjoint_name == "Discrete" else ADJOINTS[adjoint_name]

    def loss(y0, k):
        sol = og.solve(
            heat_f,
            y0,
            (0.0, 0.05),
            k,
            solver=og.Tsit5(),
            step=og.Adaptive(rtol=1e-8, atol=1e-8),
            saveat=og.SaveAt(ts=HEAT_TS),
            adjoint=adjoint,
            max_steps=20_000,
        )
        w = jnp.linspace(0.5, 1.5, HEAT_N)
        return jnp.sum(w * sol.ys**2)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


HEAT_K = 0.5


@pytest.mark.parametrize(
    "adjoint_name",
    [
        pytest.param("Interpolating", marks=slow),
        pytest.param("Quadrature", marks=slow),
        pytest.param("Forward", marks=slow),
        pytest.param("Auto", marks=slow),
    ],
)
def test_heat_equation_vs_discrete(adjoint_name):
    ref = heat_grad("Discrete")(heat_y0(), HEAT_K)
    g = heat_grad(adjoint_name)(heat_y0(), HEAT_K)
    e_y0, e_k = rel_err(g[0], ref[0]), rel_err(g[1], ref[1])
    print(f"\nheat {adjoint_name}: rel err dL/dy0 {e_y0:.2e}  dL/dk {e_k:.2e}")
    assert np.all(np.isfinite(np.asarray(g[0])))
    assert e_y0 < 1e-5
    assert e_k < 1e-5


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_heat_equation_backsolve_never_silently_wrong():
    ref = heat_grad("Discrete")(heat_y0(), HEAT_K)
    try:
        g = heat_grad("Backsolve")(heat_y0(), HEAT_K)
        g = jax.block_until_ready(g)
    except Exception as err:  # RuntimeError or JaxRuntimeError from the drift check
        msg = str(err)
        print(f"\nheat Backsolve raised: {type(err).__name__}")
        assert isinstance(err, RuntimeError | jax.errors.JaxRuntimeError)
        assert "Backsolve" in msg
        assert "Interpolating" in msg
        return
    e_y0, e_k = rel_err(g[0], ref[0]), rel_err(g[1], ref[1])
    print(f"\nheat Backsolve did not raise: rel err dL/dy0 {e_y0:.2e}  dL/dk {e_k:.2e}")
    assert e_y0 < 1e-4
    assert e_k < 1e-4


# --------------------------------------------------------------------------------------------
# 3. seed 000: mixed scalar + vector state, abs() kinks

SEED_M, SEED_TS = kr.SEED_M, kr.SEED_TS


def seed_z(dtype=jnp.float64):
    return jnp.asarray(kr.seed000_z(), dtype)


def seed_grad(adjoint_name: str, form: str, index: int, dtype_name: str = "float64"):
    # tight: at 1e-9 the abs() kinks leave the discrete gradient ~2e-3 off (1e-11: ~1e-6)
    tol = 1e-11 if jnp.dtype(dtype_name) == jnp.float64 else 1e-6
    adjoint = og.Discrete() if adjoint_name == "Discrete" else ADJOINTS[adjoint_name]
    return kr.seed000_value_and_grad(adjoint, form, index, dtype_name, tol)


SEED_CASES = [
    pytest.param(form, index, marks=() if (form, index) == ("flat", -1) else slow)
    for form in ("flat", "tree")
    for index in (-1, 19)
]


@pytest.mark.parametrize("form, index", SEED_CASES)
def test_seed000_methods_agree(form, index):
    z = seed_z()
    v_ref, g_ref = seed_grad("Discrete", form, index)(z)
    assert np.all(np.isfinite(np.asarray(g_ref)))
    assert float(jnp.max(jnp.abs(g_ref))) > 0
    # unmarked: the seed's own method (Backsolve); the slow cases add Interpolating and Auto
    quick = (form, index) == ("flat", -1)
    names = ("Backsolve",) if quick else ("Backsolve", "Interpolating", "Auto")
    for name in names:
        v, g = seed_grad(name, form, index)(z)
        e = rel_err(g, g_ref)
        print(f"\nseed000 {form} ys[{index}] {name}: rel err vs Discrete {e:.2e}")
        assert float(v) == pytest.approx(float(v_ref), rel=1e-8)
        assert e < 1e-3


@slow
def test_seed000_auto_is_interpolating():
    """abs() in f: Auto leaves Discrete for Interpolating (see tests/test_kinks.py)."""
    z = seed_z()
    v, g = seed_grad("Auto", "flat", -1)(z)
    v_ref, g_ref = seed_grad("Interpolating", "flat", -1)(z)
    assert float(v) == float(v_ref)
    assert rel_err(g, g_ref) < 1e-12


@slow
def test_seed000_flat_and_tree_agree():
    z = seed_z()
    v1, g1 = seed_grad("Interpolating", "flat", -1)(z)
    v2, g2 = seed_grad("Interpolating", "tree", -1)(z)
    assert float(v1) == pytest.approx(float(v2), rel=1e-8)
    assert rel_err(g2, g1) < 1e-6


def test_seed000_finite_differences():
    """A directional derivative by central differences of the (tight) solve itself. The
    error-controlled adjoints only: Discrete holds the steps fixed across the abs() kinks and
    is off by ~1.5e-4 here (tests/test_kinks.py measures all of them against CVODES)."""
    z = seed_z()
    fn = seed_grad("Discrete", "flat", -1)
    d = jnp.asarray(np.random.default_rng(5).standard_normal(z.shape))
    # the adaptive solve's noise divided by eps: at 1e-5 this machine's FD was 1.6e-4 off the
    # adjoints (which agree to 3e-8), at 1e-4 within 6e-6 (truncation ~eps^2 is far smaller)
    eps = 1e-4
    fd = (float(fn(z + eps * d)[0]) - float(fn(z - eps * d)[0])) / (2 * eps)
    for name in ("Backsolve", "Interpolating"):
        dd = float(jnp.sum(seed_grad(name, "flat", -1)(z)[1] * d))
        print(f"\nseed000 directional derivative {name} {dd:.8f} vs central FD {fd:.8f}")
        assert dd == pytest.approx(fd, rel=1e-4)  # FD noise of the adaptive solve ~1e-5


@pytest.mark.parametrize(
    "adjoint_name",
    [pytest.param("Interpolating", marks=slow), pytest.param("Backsolve", marks=slow)],
)
def test_seed000_float32(adjoint_name):
    _, g64 = seed_grad("Discrete", "flat", -1)(seed_z())
    _, g32 = seed_grad(adjoint_name, "flat", -1, "float32")(seed_z(jnp.float32))
    assert g32.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(g32)))
    e = rel_err(g32, g64)
    print(f"\nseed000 float32 {adjoint_name}: rel err vs float64 Discrete {e:.2e}")
    assert e < 1e-2


# --------------------------------------------------------------------------------------------
# 4. a user-supplied vjp

LIN_A = np.array([[-0.5, 2.0, 0.0], [-2.0, -0.3, 0.2], [0.1, 0.0, -0.8]])
LIN_Y0 = np.array([1.0, -0.5, 0.25])


def lin_f(t, y, a):
    return a @ y


def lin_vjp(t, y, a, ct):
    return a.T @ ct, jnp.outer(ct, y)


@functools.cache
def linear_grad(adjoint_name: str, user_vjp: bool):
    cls = {"Interpolating": og.Interpolating, "Backsolve": og.Backsolve}[adjoint_name]
    adjoint = cls(vjp=lin_vjp) if user_vjp else cls()

    def loss(y0, a):
        sol = og.solve(
            lin_f,
            y0,
            (0.0, 2.0),
            a,
            step=og.Adaptive(rtol=1e-10, atol=1e-10),
            saveat=og.SaveAt(ts=jnp.linspace(0.0, 2.0, 5)),
            adjoint=adjoint,
        )
        return jnp.sum(sol.ys**2)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("adjoint_name", ["Interpolating", pytest.param("Backsolve", marks=slow)])
def test_user_vjp_matches_default(adjoint_name):
    args = jnp.asarray(LIN_Y0), jnp.asarray(LIN_A)
    g_user = linear_grad(adjoint_name, True)(*args)
    g_default = linear_grad(adjoint_name, False)(*args)
    assert g_user[1].shape == (3, 3)
    assert float(jnp.max(jnp.abs(g_default[1]))) > 1e-3
    assert rel_err(g_user, g_default) < 1e-12


@pytest.mark.parametrize(
    "adjoint", [og.Interpolating, pytest.param(og.Quadrature, marks=pytest.mark.slow)]
)
def test_fixed_backward_steps_take_dt(adjoint):
    """``step=og.Fixed(dt)`` makes the backward solve take equal steps of at most ``dt``
    between its stops (here the saves of an adaptive forward solve), whatever the forward
    steps: the gradient converges at the backward solver's order (Ralston's 2) as ``dt``
    shrinks. (It was one backward step per interval before, whatever ``dt``.)"""
    f = lambda t, y, a: -a * jnp.sin(y) - 0.3 * y
    y0, ts = jnp.asarray([1.0, 2.0]), jnp.linspace(0.0, 1.0, 3)

    def grad(adj):
        def loss(a):
            sol = og.solve(f, y0, (0.0, 1.0), a, step=og.Adaptive(1e-10, 1e-10),
                           saveat=og.SaveAt(ts=ts), adjoint=adj)  # fmt: skip
            return jnp.sum(sol.ys**2)

        return jax.jit(jax.grad(loss))(1.5)

    exact = grad(og.Discrete())
    errs = [abs(grad(adjoint(solver=og.Ralston(), step=og.Fixed(dt))) - exact)
            for dt in (0.1, 0.05, 0.025)]  # fmt: skip
    assert errs[0] > 1e-3 and errs[-1] < 1e-3, errs
    ratios = [errs[0] / errs[1], errs[1] / errs[2]]
    assert all(3.0 < r < 5.0 for r in ratios), errs  # second order


# --------------------------------------------------------------------------------------------
# 5. jit + vmap


@slow
@pytest.mark.parametrize("rows", [None, 8])
def test_vmap_of_grad_equals_loop(rows):
    """Members with their own step counts (``rows=8``: several blocks of dense output each, a
    different number per member; test_batched.py has the default run's case)."""
    pr = get_problem("lotka_volterra")
    f = jax_rhs(pr)
    y0 = jnp.asarray(pr.y0)

    def loss(p):
        sol = og.solve(
            f,
            y0,
            (0.0, 5.0),
            p,
            step=og.Adaptive(rtol=1e-8, atol=1e-8),
            saveat=og.SaveAt(ts=jnp.linspace(0.0, 5.0, 6)),
            adjoint=og.Interpolating(dense_rows=rows),
        )
        return jnp.sum(sol.ys**2)

    ps = jnp.asarray(pr.params) * jnp.asarray([[1.0], [0.9], [1.1]])
    grad = jax.jit(jax.grad(loss))
    batched = jax.jit(jax.vmap(jax.grad(loss)))(ps)
    looped = jnp.stack([grad(p) for p in ps])
    assert batched.shape == (3, 4)
    assert rel_err(batched, looped) < 1e-10
    # the three parameter sets really give three different gradients
    assert rel_err(looped[1], looped[0]) > 1e-3


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_one_trajectory_keeps_blocks_of_dense_output_when_every_step_does_not_fit(retune):
    """An adaptive solve whose ``max_steps`` rows of dense output pass ``adaptive_all_bytes``
    keeps blocks of steps (re-taken once each, one backward solve per block) while two blocks
    fit ``single_blocks_bytes``, and checkpoints (a backward solve per step) beyond: the
    default is then ``dense_rows=64`` (to round-off), and matches forward mode."""
    pr = get_problem("lotka_volterra")
    f, y0 = jax_rhs(pr), jnp.asarray(pr.y0)
    ts = jnp.linspace(0.0, 10.0, 5)

    def grads(*adjoints):
        def loss(p, adjoint):
            sol = og.solve(f, y0, (0.0, 10.0), p, step=og.Adaptive(1e-8, 1e-8),
                           saveat=og.SaveAt(ts=ts), adjoint=adjoint)  # fmt: skip
            return jnp.sum(sol.ys**2), sol.stats["accepted"]

        p = jnp.asarray(pr.params)
        return jax.jit(lambda p: [jax.grad(loss, has_aux=True)(p, a) for a in adjoints])(p)

    retune(adaptive_all_bytes=2**16, single_blocks_bytes=2**16, dense_block_bytes=2**12)
    text = og.explain_adjoint(
        f, y0, (0.0, 10.0), jnp.asarray(pr.params), adjoint=og.Interpolating()
    )
    assert "that of 64 steps at a time" in text, text
    (default, n), (rows64, _), (fwd, _) = grads(
        og.Interpolating(), og.Interpolating(dense_rows=64), og.Forward()
    )
    assert int(n) > 2 * 64  # three blocks or more
    # the same steps and blocks; two programs' fusions round apart (~1e-15 with the tests'
    # XLA flags)
    np.testing.assert_allclose(default, rows64, rtol=1e-12, atol=0)
    assert rel_err(default, fwd) < 1e-6
    # two blocks do not fit, nor every step's: checkpoints
    retune(adaptive_all_bytes=2**12, single_blocks_bytes=2**12, adaptive_dense_bytes=2**12)
    text = og.explain_adjoint(
        f, y0, (0.0, 10.0), jnp.asarray(pr.params), adjoint=og.Interpolating()
    )
    assert "revolve" in text, text


# --------------------------------------------------------------------------------------------
# 6. explain_adjoint


def test_explain_adjoint_names_choice():
    pr = get_problem("lotka_volterra")
    f, y0, p = jax_rhs(pr), jnp.asarray(pr.y0), jnp.asarray(pr.params)
    text = og.explain_adjoint(f, y0, (0.0, 10.0), p)
    assert "Forward" in text
    assert len(text.split()) > 15
    text = og.explain_adjoint(f, y0, (0.0, 10.0), p, step=og.Fixed(0.01))
    assert "Discrete" in text
    assert "1000" in text  # the step count
    big = jnp.ones(1000)
    text = og.explain_adjoint(lambda t, y, k: -k * y, big, (0.0, 1.0), jnp.asarray(1.0))
    assert "Discrete" in text
    assert "Forward()" not in text.split(":")[0]


@pytest.mark.slow  # 21 s; Auto's choices: test_seed000_auto_is_interpolating, test_kinks.py
def test_auto_counts_only_traced_inputs(monkeypatch):
    """A large concrete y0 carries no derivative: with 2 differentiated parameters Auto runs
    Forward (no reverse loop in the gradient's program); with y0 differentiated too, Discrete.
    Both give the gradient Discrete('all') gives."""
    y0 = jnp.linspace(0.5, 1.5, 200)

    def loss(p, y=y0, adjoint=None):
        f = lambda t, y_, p_: -p_[0] * y_ + p_[1] * jnp.sin(t)
        sol = og.solve(
            f, y, (0.0, 1.0), p, saveat=og.SaveAt(ts=jnp.linspace(0, 1, 4)), adjoint=adjoint
        )
        return jnp.sum(sol.ys**2)

    chosen = []
    for cls in (og.Forward, og.Discrete):
        run = cls.run
        monkeypatch.setattr(
            cls, "run", lambda self, pr, run=run: (chosen.append(self), run(self, pr))[1]
        )
    p = jnp.array([1.3, 0.4])
    g_auto = jax.jit(jax.grad(loss))(p)
    assert isinstance(chosen[0], og.Forward), chosen
    g_ref = jax.jit(jax.grad(lambda p: loss(p, adjoint=og.Discrete("all"))))(p)
    np.testing.assert_allclose(g_auto, g_ref, rtol=1e-12)
    chosen.clear()
    g_both = jax.jit(jax.grad(lambda p, y: loss(p, y), argnums=(0, 1)))(p, y0)
    assert isinstance(chosen[0], og.Discrete), chosen
    g_both_ref = jax.jit(jax.grad(lambda p, y: loss(p, y, og.Discrete("all")), argnums=(0, 1)))(
        p, y0
    )
    for a, b in zip(g_both, g_both_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)


# --------------------------------------------------------------------------------------------
# 7. memory of Interpolating(checkpoints=c)


def _diffusion_2d(t, y, k):
    p = jnp.pad(y, 1)
    return k * (p[2:, 1:-1] + p[:-2, 1:-1] + p[1:-1, 2:] + p[1:-1, :-2] - 4 * y)


@functools.cache
def memory_temp_bytes(checkpoints, x64: bool = True, t1: float = 4.0):
    """``temp_size_in_bytes`` of the compiled gradient; ``x64=False``: x64 off (float32)."""
    with jax.enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        y0 = jnp.asarray(np.random.default_rng(0).standard_normal((32, 32)), dtype)

        def loss(y0, k):
            sol = og.solve(
                _diffusion_2d,
                y0,
                (0.0, t1),
                k,
                step=og.Fixed(0.01),
                adjoint=og.Interpolating(checkpoints=checkpoints),
                max_steps=round(t1 / 0.01),
            )
            return jnp.sum(sol.ys**2)

        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        compiled = grad.lower(y0, jnp.asarray(0.1, dtype)).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        # and the gradient runs
        g = grad(y0, jnp.asarray(0.1, dtype))
        assert np.all(np.isfinite(np.asarray(g[0])))
        return temp, g


def _check_memory(x64: bool):
    state = 32 * 32 * (8 if x64 else 4)
    full, g_full = memory_temp_bytes(None, x64)
    print(f"\nx64={x64}: Interpolating() temp {full} B ({full / state:.0f} states)")
    temps = {}
    for c in (2, 4, 8):
        m, g = memory_temp_bytes(c, x64)
        temps[c] = m
        print(f"x64={x64}: Interpolating(checkpoints={c}) temp {m} B ({m / state:.0f} states)")
        assert rel_err(g, g_full) < (1e-10 if x64 else 1e-4)
    # c checkpoints (y and the carried stage) plus one step: grows with c ...
    assert temps[2] < temps[4] < temps[8] < 0.05 * full
    assert temps[8] - temps[4] <= 3 * 4 * state  # about 2 states per extra checkpoint
    # ... and not with the step count: twice the steps, the same memory
    longer, _ = memory_temp_bytes(4, x64, t1=8.0)
    print(f"x64={x64}: Interpolating(checkpoints=4), 800 steps: {longer / state:.0f} states")
    assert longer <= 1.05 * temps[4]
    # the full dense output of 400 steps is at least 400 states
    assert full > 400 * state


@slow
def test_interpolating_checkpoint_memory_x64():
    _check_memory(True)


@slow
def test_interpolating_checkpoint_memory_x32():
    _check_memory(False)


def test_interpolating_dense_blocks_under_vmap():
    """Under ``jax.vmap`` the default keeps the forward dense output a block of steps at a
    time, not ``max_steps`` rows per member: its compiled memory is a fraction of those rows
    (the blocks' gradients against each member's own: test_batched.py)."""
    pr = get_problem("lotka_volterra")
    f = jax_rhs(pr)
    y0s = jnp.asarray(pr.y0) * jnp.linspace(0.8, 1.2, 64)[:, None]
    ts = jnp.linspace(0.0, 5.0, 6)
    step = og.Adaptive(rtol=1e-6, atol=1e-6)

    def loss(p):
        def one(y0):
            sol = og.solve(f, y0, (0.0, 5.0), p, step=step, saveat=og.SaveAt(ts=ts),
                           adjoint=og.Interpolating())  # fmt: skip
            return sol.ys

        return jnp.sum(jax.vmap(one)(y0s) ** 2)

    p = jnp.asarray(pr.params)
    compiled = jax.jit(jax.grad(loss)).lower(p).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    rows = 4096 * 9 * 2 * 8 * 64  # every step's dense output: Tsit5's 9 vectors of 2, x64
    print(f"\ntemp {temp / 2**20:.2f} MiB; every step's dense output {rows / 2**20:.1f} MiB")
    assert temp < 0.3 * rows
    assert np.all(np.isfinite(np.asarray(compiled(p))))
    said = []  # the policy's sentence, traced under the same vmap
    jax.vmap(
        lambda y0: said.append(og.explain_adjoint(f, y0, (0.0, 5.0), p, saveat=og.SaveAt(ts=ts),
                               step=step, adjoint=og.Interpolating()))
    )(y0s)  # fmt: skip
    assert "steps at a time" in said[0] and "x64 batch members" in said[0], said[0]


def test_interpolating_dense_blocks_one_buffer():
    """One trajectory whose ``max_steps`` rows of dense output pass the budget keeps a block
    of steps (here 64 of a 32 x 32 float64 field's Tsit5 dense output, 8 vectors: 4 MiB); the
    backward pass re-takes earlier blocks into that same buffer, and the crossing reads it in
    place: the compiled memory is one block and a little (5.4 MiB; it was 9.4: two blocks)."""
    y0 = jnp.asarray(np.random.default_rng(0).standard_normal((32, 32)))
    adjoint = og.Interpolating()
    loss = lambda y0, k: jnp.sum(og.solve(_diffusion_2d, y0, (0.0, 1.0), k, adjoint=adjoint,
                                          step=og.Adaptive(1e-6, 1e-6)).ys ** 2)  # fmt: skip
    said = og.explain_adjoint(_diffusion_2d, y0, (0.0, 1.0), 0.1, adjoint=adjoint)
    assert "keeps that of 64 steps at a time" in said, said
    compiled = jax.jit(jax.grad(loss)).lower(y0, 0.1).compile()
    block = 64 * 9 * y0.size * 8  # Tsit5's dense row: y0, dt, 7 stages (dt a scalar: < 9)
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"\ntemp {temp / 2**20:.2f} MiB; one block {block / 2**20:.2f} MiB")
    assert temp < 1.3 * block


@pytest.mark.parametrize(  # (the slow tier: 23 s; Discrete's Hessian stays in the default run)
    "adjoint_name",
    [pytest.param(n, marks=pytest.mark.slow) for n in ("Interpolating", "Backsolve")],
)  # the mechanism (member_cond's differentiable select) is shared
def test_hessian_forward_over_reverse(adjoint_name):
    # jax.jacfwd(jax.grad(...)) differentiates the backward pass forward: its conditionals
    # (member_cond) and host checks must take a JVP. Against central differences of the
    # same gradient.
    def f(t, y, p):
        return jnp.stack([p[0] * y[0] - p[1] * y[0] * y[1], -p[2] * y[1] + p[3] * y[0] * y[1]])

    def loss(p):
        sol = og.solve(
            f,
            jnp.array([2.0, 1.0]),
            (0.0, 3.0),
            p,
            saveat=og.SaveAt(ts=jnp.linspace(0.0, 3.0, 7)),
            step=og.Adaptive(rtol=1e-11, atol=1e-11),
            adjoint=getattr(og, adjoint_name)(),
        )
        return jnp.sum(sol.ys**2)

    p = jnp.array([1.1, 0.4, 0.4, 0.1])
    h = np.asarray(jax.jit(jax.jacfwd(jax.grad(loss)))(p))
    grad = jax.jit(jax.grad(loss))
    eps = 1e-5
    fd = np.stack(
        [(grad(p.at[i].add(eps)) - grad(p.at[i].add(-eps))) / (2 * eps) for i in range(p.size)]
    )
    np.testing.assert_allclose(h, fd, rtol=1e-4, atol=1e-5 * np.abs(fd).max())


@pytest.mark.parametrize(
    "adjoint",
    [og.Interpolating(), pytest.param(og.Quadrature(), marks=pytest.mark.slow)],
    ids=["interpolating", "quadrature"],
)
def test_backward_steps_resolve_fast_forward_states(adjoint):
    """``y' = A y`` with a fast mode (-30) that ``dL/dA[0, 1]`` integrates: the backward error
    norm leaves ``dL/dA`` out, so backward steps sized for the smooth adjoint alone stepped
    over the fast mode's decay (that entry was 1.1e-3 off at rtol 1e-8, Quadrature's 4.1e-4).
    Ending each backward step on the forward steps under it resolves it as the forward solve
    did. Against the matrix exponential, every entry to 1e-6 of itself."""
    a = jnp.array([[-1.0, 0.5], [0.0, -30.0]])
    want = jax.grad(lambda a: (jax.scipy.linalg.expm(a * 2.0) @ jnp.ones(2))[0])(a)
    step = og.Adaptive(rtol=1e-8, atol=1e-8)
    f = lambda t, y, a: a @ y
    loss = lambda a: og.solve(f, jnp.ones(2), (0.0, 2.0), a, step=step, adjoint=adjoint).ys[-1, 0]
    np.testing.assert_allclose(jax.grad(loss)(a), want, rtol=1e-6)
