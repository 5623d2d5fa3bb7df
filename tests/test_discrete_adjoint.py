"""``og.Discrete``: the exact gradient of the discretised solve, with and without checkpoints.

What is checked, and against what:

* tight adaptive solves against SUNDIALS CVODES forward sensitivities (an independent code);
* fixed-step solves against central finite differences of the *same* discretisation;
* adaptive solves against ``og.StepTo`` on the very steps the adaptive solve accepted, whose
  gradient JAX computes by differentiating a ``lax.scan``: a discrete adjoint takes the step sizes
  as constants, so the two are the same function and must agree to rounding;
* ``checkpoints=None``, an int and ``"all"`` against each other (they replay the same steps);
* every ``SaveAt`` form, backward integration, pytree states, dict args, closed-over arrays,
  ``vmap``, ``jvp``, float32, memory of the compiled gradient, and that the reverse pass of an
  adaptive solve is a custom VJP rather than a differentiated ``while_loop``.

Compilation dominates the run time of this file, so every jitted function is built once per
configuration (``functools.cache``) and shared by the tests that need it; finite differences
reuse the value that the jitted ``value_and_grad`` returns, so they compile nothing new.
"""

from __future__ import annotations

import functools
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

import odegrad as og  # noqa: E402

try:  # tests/ on sys.path (pytest's default rootdir-relative import)
    from cvodes import cvodes_gradient
    from reference_problems import get_problem, jax_rhs
except ImportError:  # tests imported as a package
    from tests.cvodes import cvodes_gradient
    from tests.reference_problems import get_problem, jax_rhs

CHECKPOINTS = (None, 5, "all")
slow = pytest.mark.slow


def maybe_slow(value, is_slow):
    """A parametrize entry, marked slow when ``is_slow`` (a tuple is several arguments)."""
    values = value if isinstance(value, tuple) else (value,)
    return pytest.param(*values, marks=slow) if is_slow else value


# --------------------------------------------------------------------------------------------
# helpers


def rel_err(a, b) -> float:
    """``max |a - b| / max |b|`` over all leaves of two pytrees of the same structure."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), (jax.tree.structure(a), jax.tree.structure(b))
    diffs = [
        np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0)
        for x, y in zip(la, lb, strict=True)
    ]
    scale = max(float(np.max(np.abs(np.asarray(y, np.float64)), initial=0.0)) for y in lb)
    return float(max(diffs)) / max(scale, 1e-300)


MEASURED: list[tuple[str, float, float]] = []  # (what, error, bound), for reports


def assert_close(a, b, rtol, what=""):
    err = rel_err(a, b)
    MEASURED.append((what, err, rtol))
    assert np.isfinite(err) and err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"
    return err


def fd_grad(fun, x, rel_step=1e-6):
    """Central finite differences of a scalar ``fun`` w.r.t. every entry of the pytree ``x``."""
    flat, unravel = ravel_pytree(x)
    flat = np.asarray(flat, dtype=np.float64)
    fun = jax.jit(fun)  # compiled once: an eager solve retraces and recompiles on every call
    g = np.zeros_like(flat)
    for i in range(flat.size):
        h = rel_step * max(1.0, abs(flat[i]))
        xp, xm = flat.copy(), flat.copy()
        xp[i] += h
        xm[i] -= h
        fp, fm = float(fun(unravel(jnp.asarray(xp)))), float(fun(unravel(jnp.asarray(xm))))
        g[i] = (fp - fm) / (2 * h)
    return unravel(jnp.asarray(g))


def weights(ts, shape, dtype):
    """Loss weights as a function of the save time and the entry: the same for any row order."""
    ts = jnp.where(jnp.isfinite(ts), ts, 0.0)
    j = jnp.arange(int(np.prod(shape, dtype=int))).reshape(shape)
    return (jnp.cos(1.3 * ts.reshape(-1, *[1] * len(shape)) + 0.7 * j + 0.3) + 0.5).astype(dtype)


def weighted_sum(ts, ys):
    """``sum w(t, j) * y_j(t)`` over the saved rows with a finite time (adaptive
    ``SaveAt(steps=True)`` pads the rows after the last step with ``inf``)."""
    total = 0.0
    ts = jnp.asarray(ts)
    for leaf in jax.tree.leaves(ys):
        w = weights(ts, leaf.shape[1:], leaf.dtype)
        ok = jnp.isfinite(ts).reshape(-1, *[1] * (leaf.ndim - 1))
        total = total + jnp.sum(jnp.where(ok, w * jnp.where(ok, leaf, 0.0), 0.0))
    return total


def accepted_grid(step_ts, t0):
    """``t0`` followed by the end times of the accepted steps (``sol.ts`` of ``steps=True``)."""
    ts = np.asarray(step_ts)
    return np.concatenate([[t0], ts[np.isfinite(ts)]])


# --------------------------------------------------------------------------------------------
# problems


def lotka_volterra(t, y, p):
    return jnp.stack([p[0] * y[0] - p[1] * y[0] * y[1], -p[2] * y[1] + p[3] * y[0] * y[1]])


LV_Y0 = jnp.array([1.0, 1.0])
LV_P = jnp.array([1.5, 1.0, 3.0, 1.0])


def forced(t, y, p):
    """A forced nonlinear oscillator: explicit time dependence."""
    return jnp.stack([y[1], -p[0] * y[1] - p[1] * jnp.sin(y[0]) + p[2] * jnp.cos(p[3] * t)])


FO_Y0 = jnp.array([0.5, -0.2])
FO_P = jnp.array([0.3, 2.0, 0.7, 1.7])


# partitioned: du/dt = f_u(t, v), dv/dt = f_v(t, u); dict args
def part_fu(t, v, a):
    return v / a["m"]


def part_fv(t, u, a):
    return -a["k"] * jnp.sin(u) + a["c"] * (jnp.roll(u, 1) - u) + a["F"] * jnp.cos(1.3 * t)


PART_Y0 = (jnp.array([0.3, -0.2, 0.5]), jnp.array([0.1, 0.4, -0.3]))
PART_ARGS = {
    "m": jnp.array([1.0, 1.5, 0.8]),
    "k": jnp.array([2.0, 1.0, 3.0]),
    "c": jnp.asarray(0.4, jnp.float64),  # not weakly typed: FD inputs must hit the same compile
    "F": jnp.asarray(0.25, jnp.float64),
}


# --------------------------------------------------------------------------------------------
# 1. tight adaptive solves against CVODES

CVODES_CASES = {
    # name: (t1, save times); forced_oscillator depends on t explicitly
    "lotka_volterra": (5.0, np.linspace(0.5, 5.0, 6)),
    "forced_oscillator": (6.0, np.array([0.7, 2.0, 3.3, 6.0])),
    "damped_pendulum": (4.0, np.array([0.4, 1.9, 2.5, 4.0])),
    "fitzhugh_nagumo": (10.0, np.array([1.0, 5.0, 7.5, 10.0])),
}
CVODES_RTOL = 1e-12


@functools.cache
def cvodes_case(name, checkpoints):
    """Tsit5 (which has a 4th-order interpolant for the save times) at rtol=atol=1e-12."""
    prob = get_problem(name)
    f = jax_rhs(prob)
    t1, ts = CVODES_CASES[name]
    w = np.random.default_rng(7).normal(size=(len(ts), prob.n))

    def loss(y0, params):
        sol = og.solve(
            f,
            y0,
            (prob.t0, t1),
            params,
            solver=og.Tsit5(),
            step=og.Adaptive(rtol=CVODES_RTOL, atol=CVODES_RTOL),
            saveat=og.SaveAt(ts=jnp.asarray(ts)),
            adjoint=og.Discrete(checkpoints),
            max_steps=2048,
        )
        return jnp.sum(jnp.asarray(w) * sol.ys)

    g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return g(jnp.asarray(prob.y0), jnp.asarray(prob.params))


@functools.cache
def cvodes_reference(name):
    prob = get_problem(name)
    _, ts = CVODES_CASES[name]
    w = np.random.default_rng(7).normal(size=(len(ts), prob.n))
    return cvodes_gradient(prob, prob.y0, prob.params, ts, w, rtol=1e-12, atol=1e-12)


def _check_cvodes(name, checkpoints):
    loss, (gy0, gp) = cvodes_case(name, checkpoints)
    ref_loss, ref_gy0, ref_gp = cvodes_reference(name)
    assert_close(loss, ref_loss, 1e-8, f"{name} loss")
    assert_close(gy0, ref_gy0, 1e-6, f"{name} dloss/dy0")
    assert_close(gp, ref_gp, 1e-6, f"{name} dloss/dparams")


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
def test_cvodes_lotka_volterra(checkpoints):
    _check_cvodes("lotka_volterra", checkpoints)


@pytest.mark.parametrize(
    "name", ["forced_oscillator", "damped_pendulum", maybe_slow("fitzhugh_nagumo", True)]
)
def test_cvodes_more_problems(name):
    _check_cvodes(name, 5)


def test_cvodes_checkpoint_modes_agree_adaptive():
    """Adaptive: None, 5 and "all" replay the same recorded steps, so agree to rounding."""
    outs = {c: cvodes_case("lotka_volterra", c) for c in CHECKPOINTS}
    assert_close(outs[5], outs["all"], 1e-10, "adaptive: 5 vs all")
    assert_close(outs[None], outs["all"], 1e-10, "adaptive: None vs all")


@slow
def test_cvodes_dopri8_t1():
    """Dopri8 at rtol=1e-12, saving the end state (as the issue states it)."""
    prob = get_problem("lotka_volterra")
    f = jax_rhs(prob)

    def loss(y0, params, checkpoints):
        sol = og.solve(
            f,
            y0,
            (0.0, 5.0),
            params,
            solver=og.Dopri8(),
            step=og.Adaptive(rtol=1e-12, atol=1e-12),
            adjoint=og.Discrete(checkpoints),
            max_steps=1024,
        )
        return jnp.sum(jnp.array([0.3, -1.2]) * sol.ys[-1])

    g = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    _, ry0, rp = cvodes_gradient(
        prob, prob.y0, prob.params, [5.0], [[0.3, -1.2]], rtol=1e-12, atol=1e-12
    )
    g5 = g(jnp.asarray(prob.y0), jnp.asarray(prob.params), 5)
    assert_close(g5, (ry0, rp), 1e-6, "Dopri8 vs CVODES")
    gall = g(jnp.asarray(prob.y0), jnp.asarray(prob.params), "all")
    assert_close(gall, g5, 1e-10, "Dopri8: all vs 5")


# --------------------------------------------------------------------------------------------
# 2. fixed steps: finite differences of the same discretisation; checkpoint modes agree

FIXED_SAVE_TS = jnp.array([0.0, 0.33, 0.9, 1.45, 2.0])
_grid = np.concatenate([[0.0], np.cumsum(np.linspace(0.02, 0.08, 30))])
_grid *= 2.0 / _grid[-1]
_grid[-1] = 2.0
STEPTO_GRID = jnp.asarray(_grid)  # 30 uneven steps over (0, 2)

FIXED_CASES = {
    # name: (solver, step, partitioned)
    "rk4_fixed": (og.RK4, og.Fixed(0.05), False),
    "tsit5_fixed": (og.Tsit5, og.Fixed(0.1), False),
    "midpoint_stepto": (og.Midpoint, og.StepTo(STEPTO_GRID), False),
    "rk4_stepto": (og.RK4, og.StepTo(STEPTO_GRID), False),
    "semi_implicit_euler_fixed": (og.SemiImplicitEuler, og.Fixed(0.02), True),
    "leapfrog_fixed": (og.Leapfrog, og.Fixed(0.05), True),
    "leapfrog_stepto": (og.Leapfrog, og.StepTo(STEPTO_GRID), True),
}


def fixed_loss(case, checkpoints):
    solver_cls, step, partitioned = FIXED_CASES[case]
    f = (part_fu, part_fv) if partitioned else lotka_volterra

    def loss(y0, args):
        sol = og.solve(
            f,
            y0,
            (0.0, 2.0),
            args,
            solver=solver_cls(),
            step=step,
            saveat=og.SaveAt(ts=FIXED_SAVE_TS, t1=True),
            adjoint=og.Discrete(checkpoints),
        )
        return weighted_sum(sol.ts, sol.ys)

    x0 = (PART_Y0, PART_ARGS) if partitioned else (LV_Y0, LV_P)
    return loss, x0


@functools.cache
def fixed_vg(case, checkpoints):
    """The jitted ``value_and_grad`` of a fixed-step case (compiled once per dtype)."""
    loss, _ = fixed_loss(case, checkpoints)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@functools.cache
def fixed_fd(case):
    _, x0 = fixed_loss(case, 5)
    vg = fixed_vg(case, 5)
    return fd_grad(lambda x: vg(*x)[0], x0)


@pytest.mark.parametrize(
    "case,checkpoints",
    [
        ("rk4_fixed", 5),
        ("rk4_fixed", "all"),
        ("tsit5_fixed", 5),
        maybe_slow(("tsit5_fixed", "all"), True),
        ("midpoint_stepto", 5),
        maybe_slow(("midpoint_stepto", "all"), True),
        maybe_slow(("rk4_stepto", 5), True),
        ("semi_implicit_euler_fixed", 5),
        maybe_slow(("semi_implicit_euler_fixed", "all"), True),
        ("leapfrog_fixed", 5),
        ("leapfrog_fixed", "all"),
        maybe_slow(("leapfrog_stepto", 5), True),
    ],
)
def test_fixed_matches_finite_differences(case, checkpoints):
    _, x0 = fixed_loss(case, checkpoints)
    _, g = fixed_vg(case, checkpoints)(*x0)
    assert_close(g, fixed_fd(case), 1e-6, f"{case} checkpoints={checkpoints} vs FD")


@pytest.mark.parametrize(
    "case",
    [
        "rk4_fixed",
        maybe_slow("leapfrog_fixed", True),
        maybe_slow("midpoint_stepto", True),
        maybe_slow("semi_implicit_euler_fixed", True),
    ],
)
def test_fixed_checkpoint_modes_agree(case):
    _, x0 = fixed_loss(case, None)
    gs = {c: fixed_vg(case, c)(*x0) for c in CHECKPOINTS}
    assert_close(gs[5], gs["all"], 1e-10, f"{case}: 5 vs all")
    assert_close(gs[None], gs["all"], 1e-10, f"{case}: None vs all")


@pytest.mark.parametrize("checkpoints", [2, maybe_slow(1, True), maybe_slow(1000, True)])
def test_fixed_checkpoint_edge_counts(checkpoints):
    """Two slots, one slot (everything recomputed from y0), more slots than the 40 steps."""
    _, x0 = fixed_loss("rk4_fixed", checkpoints)
    out = fixed_vg("rk4_fixed", checkpoints)(*x0)
    assert_close(out, fixed_vg("rk4_fixed", "all")(*x0), 1e-10, f"checkpoints={checkpoints}")


def test_checkpoints_1_is_not_pathologically_slow():
    """8 RK4 steps with one checkpoint: 36 step recomputations, microseconds of work."""
    step = og.StepTo(jnp.linspace(0.0, 1.0, 9))

    def loss(p):
        sol = og.solve(
            lotka_volterra, LV_Y0, (0.0, 1.0), p, solver=og.RK4(), step=step, adjoint=og.Discrete(1)
        )
        return jnp.sum(sol.ys)

    g = jax.jit(jax.grad(loss))
    g(LV_P).block_until_ready()
    start = time.perf_counter()
    out = g(LV_P).block_until_ready()
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5, f"8 steps with checkpoints=1 took {elapsed:.2f} s"
    assert np.all(np.isfinite(np.asarray(out)))


# --------------------------------------------------------------------------------------------
# 3. every SaveAt form: adaptive (vs StepTo on the accepted steps) and fixed (vs FD)

SPAN = (0.0, 3.0)
SAVE_TS = jnp.array([0.0, 0.37, 1.1, 1.9, 2.6, 3.0])  # includes both ends
DENSE_TQ = jnp.array([0.05, 0.61, 1.234, 2.2, 2.999])
ADAPTIVE = og.Adaptive(rtol=1e-7, atol=1e-7)


def save_fn(t, y, p):
    """A saved function of time, state and args, with an output shape unlike the state's."""
    return jnp.stack([y[0] * y[1] * p[0] + jnp.sin(t) * y[1], y[0] ** 2, p[3] * y[1]])


SAVE_FORMS = {
    # name: (SaveAt keyword arguments, whether the loss calls sol.evaluate)
    "t0": ({"t0": True}, False),
    "t1": ({"t1": True}, False),
    "t0_t1": ({"t0": True, "t1": True}, False),
    "ts": ({"ts": SAVE_TS}, False),
    "ts_t0_t1_fn": ({"t0": True, "ts": SAVE_TS, "t1": True, "fn": save_fn}, False),
    "steps": ({"steps": True}, False),
    "steps_fn_t1": ({"steps": True, "fn": save_fn, "t1": True}, False),
    "dense": ({"dense": True}, True),
    "dense_ts_t1": ({"dense": True, "ts": SAVE_TS, "t1": True}, True),
}
# every form appears in at least one unmarked test
FAST_FORMS_ADAPTIVE = {"ts_t0_t1_fn", "steps_fn_t1", "dense_ts_t1"}
FAST_FORMS_FIXED = {"steps_fn_t1", "dense_ts_t1"}


def form_loss(form, step, checkpoints, span=SPAN):
    kwargs, dense = SAVE_FORMS[form]
    if span[1] < span[0] and "ts" in kwargs:
        kwargs = dict(kwargs, ts=span[0] - SAVE_TS)  # descending save times
    saveat = og.SaveAt(**kwargs)
    tq = DENSE_TQ if span[1] > span[0] else span[0] - DENSE_TQ

    def loss(y0, p):
        sol = og.solve(
            forced,
            y0,
            span,
            p,
            solver=og.BS3(),
            step=step,
            saveat=saveat,
            adjoint=og.Discrete(checkpoints),
            max_steps=1024,
        )
        total = 0.0 if sol.ys is None else weighted_sum(sol.ts, sol.ys)
        if dense:
            total = total + weighted_sum(tq, sol.evaluate(tq))
        return total

    return loss


@functools.cache
def adaptive_grid(span):
    """The adaptive solve's accepted step times (they do not depend on what is saved)."""
    sol = og.solve(
        forced,
        FO_Y0,
        span,
        FO_P,
        solver=og.BS3(),
        step=ADAPTIVE,
        saveat=og.SaveAt(steps=True),
        max_steps=1024,
    )
    grid = accepted_grid(sol.ts, span[0])
    assert 10 < grid.size < 1024 and grid[-1] == span[1]
    assert np.all(np.sign(np.diff(grid)) == np.sign(span[1] - span[0]))
    return jnp.asarray(grid)


@functools.cache
def form_vg(form, kind, checkpoints, span=SPAN):
    if kind == "adaptive":
        step = ADAPTIVE
    elif kind == "stepto":  # the adaptive solve's own steps, as a fixed grid
        step = og.StepTo(adaptive_grid(span))
    else:
        step = og.Fixed(0.1)
    loss = form_loss(form, step, checkpoints, span)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("form", [maybe_slow(f, f not in FAST_FORMS_ADAPTIVE) for f in SAVE_FORMS])
def test_saveat_forms_adaptive(form):
    """Adaptive Discrete(5) == StepTo on the same accepted steps (JAX's own scan gradient)."""
    out = form_vg(form, "adaptive", 5)(FO_Y0, FO_P)
    ref = form_vg(form, "stepto", "all")(FO_Y0, FO_P)
    assert_close(out[0], ref[0], 1e-10, f"{form} loss")
    assert_close(out[1], ref[1], 1e-10, f"{form} gradient")
    gy0, gp = out[1]
    if form == "t0":  # only y0 is saved: d/dy0 = the weights at t0, d/dp = 0
        np.testing.assert_allclose(gy0, weights(jnp.zeros(1), (2,), gy0.dtype)[0], atol=1e-15)
        np.testing.assert_array_equal(gp, 0.0)
    else:
        assert float(jnp.max(jnp.abs(gp))) > 1e-3


@pytest.mark.parametrize("form", [maybe_slow(f, f not in FAST_FORMS_FIXED) for f in SAVE_FORMS])
def test_saveat_forms_fixed(form):
    """Fixed steps: Discrete(5) (custom VJP) == finite differences == "all" (scan autodiff)."""
    vg = form_vg(form, "fixed", 5)
    out = vg(FO_Y0, FO_P)
    fd = fd_grad(lambda x: vg(*x)[0], (FO_Y0, FO_P))
    assert_close(out[1], fd, 1e-6, f"{form}: vs FD")
    ref = form_vg(form, "fixed", "all")(FO_Y0, FO_P)
    assert_close(out[1], ref[1], 1e-10, f"{form}: 5 vs all")


@pytest.mark.parametrize("checkpoints", [None, maybe_slow("all", True)])
def test_saveat_dense_adaptive_other_checkpoints(checkpoints):
    out = form_vg("dense_ts_t1", "adaptive", checkpoints)(FO_Y0, FO_P)
    ref = form_vg("dense_ts_t1", "stepto", "all")(FO_Y0, FO_P)
    assert_close(out, ref, 1e-10, f"dense_ts_t1 checkpoints={checkpoints}")


# --------------------------------------------------------------------------------------------
# 4. backward integration (t1 < t0)

BACK_SPAN = (3.0, 0.0)


@pytest.mark.parametrize("form", ["dense_ts_t1", maybe_slow("steps_fn_t1", True)])
def test_backward_integration_adaptive(form):
    out = form_vg(form, "adaptive", 5, BACK_SPAN)(FO_Y0, FO_P)
    ref = form_vg(form, "stepto", "all", BACK_SPAN)(FO_Y0, FO_P)
    assert_close(out[0], ref[0], 1e-10, f"backward {form} loss")
    assert_close(out[1], ref[1], 1e-10, f"backward {form} gradient")


def test_backward_integration_fixed_vs_fd():
    vg = form_vg("ts_t0_t1_fn", "fixed", 5, BACK_SPAN)
    out = vg(FO_Y0, FO_P)
    fd = fd_grad(lambda x: vg(*x)[0], (FO_Y0, FO_P))
    assert_close(out[1], fd, 1e-6, "backward fixed vs FD")


@slow
def test_backward_equals_forward_of_reversed_problem():
    """``y' = f(t, y)`` from 3 down to 0 is ``z' = -f(3 - s, z)`` from 0 up to 3, step by step."""
    out = form_vg("ts", "fixed", 5, BACK_SPAN)(FO_Y0, FO_P)

    def loss(y0, p):
        sol = og.solve(
            lambda s, z, p: -forced(3.0 - s, z, p),
            y0,
            (0.0, 3.0),
            p,
            solver=og.BS3(),
            step=og.Fixed(0.1),
            saveat=og.SaveAt(ts=SAVE_TS),
            adjoint=og.Discrete(5),
        )
        return weighted_sum(3.0 - sol.ts, sol.ys)

    ref = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(FO_Y0, FO_P)
    assert_close(out, ref, 1e-9, "backward vs reversed forward")


# --------------------------------------------------------------------------------------------
# 5. pytree state (scalar, vector), dict args, closed-over arrays (seed 000)

SEED_M, SEED_N = 6, 4
SEED_Z = jnp.asarray(np.random.default_rng(1234).normal(size=(SEED_N, SEED_M)))
SEED_Y0 = (jnp.asarray(0.0, jnp.float64), jnp.ones(SEED_M))
SEED_ARGS = {"scale": jnp.asarray(1.3, jnp.float64), "rate": jnp.asarray(0.8, jnp.float64)}
SEED_TS = jnp.linspace(0.0, 2.0, 21)


def seed_rhs(z):
    """Seed 000's model, ``y = (c, a)`` with ``c`` a scalar; ``z`` is closed over."""

    def f(t, y, a):
        _, av = y
        a_unit = av / jnp.sum(av)
        ka_unit = z.T @ (z @ a_unit)
        aka = a["rate"] * av * ka_unit / jnp.dot(jnp.abs(ka_unit), a_unit)
        return (a["scale"] * jnp.sum(aka) / SEED_M, -jnp.abs(aka))

    return f


def seed_loss(step, checkpoints):
    """Loss over every step's state and the dense output at ``SEED_TS``; the aux output is the
    step times, so the adaptive steps can be replayed exactly (they depend on rounding)."""

    def loss(z, y0, args):
        sol = og.solve(
            seed_rhs(z),  # z reaches f only through the closure
            y0,
            (0.0, 2.0),
            args,
            solver=og.Tsit5(),
            step=step,
            saveat=og.SaveAt(steps=True, dense=True),
            adjoint=og.Discrete(checkpoints),
            max_steps=256,
        )
        c, a = sol.evaluate(SEED_TS)
        value = c[12] + 0.5 * c[-1] + 0.1 * jnp.sum(a[-1] ** 2) + weighted_sum(sol.ts, sol.ys)
        return value, sol.ts

    return loss


@functools.cache
def seed_vg(step, checkpoints):
    loss = seed_loss(step, checkpoints)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("checkpoints", [5, maybe_slow("all", True)])
def test_pytree_state_closure_dict_args_fixed_vs_fd(checkpoints):
    vg = seed_vg(og.Fixed(0.1), checkpoints)
    _, grads = vg(SEED_Z, SEED_Y0, SEED_ARGS)
    fd = fd_grad(lambda x: vg(*x)[0][0], (SEED_Z, SEED_Y0, SEED_ARGS))
    # each part on its own: the closed-over Z, the (scalar, vector) state, the dict args
    for name, g, r in zip(("Z", "y0", "args"), grads, fd, strict=True):
        assert float(jnp.max(jnp.abs(ravel_pytree(g)[0]))) > 1e-3, name
        assert_close(g, r, 1e-6, f"seed 000 fixed d/d{name} vs FD")
    assert jax.tree.structure(grads[1]) == jax.tree.structure(SEED_Y0)
    assert jax.tree.structure(grads[2]) == jax.tree.structure(SEED_ARGS)


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_pytree_state_closure_dict_args_adaptive():
    (value, step_ts), grads = seed_vg(og.Adaptive(rtol=1e-8, atol=1e-8), 5)(
        SEED_Z, SEED_Y0, SEED_ARGS
    )
    grid = accepted_grid(step_ts, 0.0)
    assert 20 < grid.size < 256
    loss = seed_loss(og.StepTo(jnp.asarray(grid)), "all")
    (ref_value, _), ref = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        SEED_Z, SEED_Y0, SEED_ARGS
    )
    assert_close(value, ref_value, 1e-10, "seed 000 adaptive loss")
    for name, g, r in zip(("Z", "y0", "args"), grads, ref, strict=True):
        assert_close(g, r, 1e-10, f"seed 000 adaptive d/d{name}")


def test_closure_in_f_and_fn_equals_args():
    """Parameters closed over by ``f`` and by ``SaveAt(fn=...)`` get the gradient they get when
    passed through ``args`` (adaptive, checkpointed)."""
    kwargs, _ = SAVE_FORMS["ts_t0_t1_fn"]

    def loss(y0, p):
        sol = og.solve(
            lambda t, y, _: forced(t, y, p),
            y0,
            SPAN,
            None,
            solver=og.BS3(),
            step=ADAPTIVE,
            saveat=og.SaveAt(**dict(kwargs, fn=lambda t, y, _: save_fn(t, y, p))),
            adjoint=og.Discrete(5),
            max_steps=1024,
        )
        return weighted_sum(sol.ts, sol.ys)

    out = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(FO_Y0, FO_P)
    ref = form_vg("ts_t0_t1_fn", "adaptive", 5)(FO_Y0, FO_P)
    assert float(jnp.max(jnp.abs(ref[1][1]))) > 1e-2
    assert_close(out, ref, 1e-10, "closure vs args")


# --------------------------------------------------------------------------------------------
# 6. vmap of grad; jvp


@pytest.mark.parametrize("checkpoints", [5, maybe_slow("all", True)])
def test_vmap_grad_adaptive_equals_loop(checkpoints):
    """A batch of params and y0 whose adaptive step counts differ within the batch."""
    form = "ts_t0_t1_fn"
    loss = form_loss(form, ADAPTIVE, checkpoints)
    scales = jnp.array([0.7, 1.0, 1.6])
    ps = FO_P[None, :] * jnp.stack([scales, 1 / scales, scales, scales], axis=1)
    y0s = FO_Y0[None, :] * scales[:, None]
    batched = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1))))(y0s, ps)
    single = form_vg(form, "adaptive", checkpoints)
    for i in range(scales.size):
        row = jax.tree.map(lambda b, i=i: b[i], batched)
        assert_close(row, single(y0s[i], ps[i]), 1e-10, f"batch row {i}")
    assert rel_err(batched[1][1][0], batched[1][1][2]) > 1e-2  # the rows really differ


def test_vmap_grad_fixed_equals_loop():
    case = "rk4_fixed"
    loss, _ = fixed_loss(case, 5)
    ps = LV_P[None, :] * jnp.array([[1.0], [0.9], [1.1]])
    vg = jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=(None, 0))
    batched = jax.jit(vg)(LV_Y0, ps)
    for i in range(3):
        row = jax.tree.map(lambda b, i=i: b[i], batched)
        assert_close(row, fixed_vg(case, 5)(LV_Y0, ps[i]), 1e-10, f"batch row {i}")


def _jvp_vs_vjp(case, checkpoints, jit=True):
    """``jax.jvp`` along a tangent equals ``jax.vjp``'s cotangent contracted with it."""
    loss, x0 = fixed_loss(case, checkpoints)
    tangent = jax.tree.map(lambda x: jnp.cos(jnp.arange(x.size).reshape(x.shape) + 1.0), x0)

    def both(x, v):
        value, dl = jax.jvp(lambda *a: loss(*a), x, v)
        _, vjp_fn = jax.vjp(lambda *a: loss(*a), *x)
        return value, dl, vjp_fn(jnp.ones_like(value))

    value, dl, ct = (jax.jit(both) if jit else both)(x0, tangent)
    contracted = sum(
        jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(ct), jax.tree.leaves(tangent), strict=True)
    )
    assert abs(float(dl)) > 1e-2
    assert_close(dl, contracted, 1e-12, f"{case}: jvp vs vjp")
    assert_close((value, ct), fixed_vg(case, "all")(*x0), 1e-10, f"{case}: vjp vs grad")


@pytest.mark.parametrize("case", ["rk4_stepto", "leapfrog_stepto"])
@slow
def test_jvp_fixed_step_count_all_jit(case):
    """A step count known at trace time (StepTo grid), checkpoints="all", under jit."""
    _jvp_vs_vjp(case, "all")


@slow
def test_jvp_fixed_dt_all_eager():
    """og.Fixed(dt) with checkpoints="all", without jit (the step count is static)."""
    _jvp_vs_vjp("rk4_fixed", "all", jit=False)


def test_jvp_fixed_dt_all_jit():
    """og.Fixed(dt) with checkpoints="all" under jit: a static grid, so forward mode works."""
    _jvp_vs_vjp("rk4_fixed", "all")


def test_jvp_fixed_step_count_int_checkpoints():
    """Discrete(int) is a custom VJP, which JAX cannot push forward; og.solve then runs the plain
    loop for forward mode."""
    _jvp_vs_vjp("rk4_fixed", 5, jit=False)


def test_jvp_fixed_step_count_int_checkpoints_jit():
    """The same under jax.jit, where JAX raises its refusal of a custom VJP's forward mode only
    at lowering, after og.solve has returned: og.solve recognises forward mode from its inputs."""
    _jvp_vs_vjp("rk4_fixed", 5)


@pytest.mark.parametrize("checkpoints", [None, maybe_slow(2, True)])
def test_hessian_adaptive_forward_over_reverse(checkpoints):
    """``jax.hessian`` (forward over reverse) of an adaptive solve: the reverse pass takes a JVP
    under jacfwd's vmap, its member-gated replay loops included (they recursed without end).
    The gradient holds the steps fixed, so its Hessian is forward mode applied twice to the
    plain loop: the same function, to rounding. Also a Hessian-vector product by jax.jvp."""

    def loss(p):
        sol = og.solve(
            lotka_volterra,
            jnp.array([1.0, 0.5]),
            (0.0, 2.0),
            p,
            step=og.Adaptive(rtol=1e-8, atol=1e-8),
            saveat=og.SaveAt(ts=FIXED_SAVE_TS),
            adjoint=og.Discrete(checkpoints),
        )
        return jnp.sum(sol.ys**2)

    p = jnp.array([1.1, 0.4, 0.4, 0.1])
    hessian = jax.jit(jax.hessian(loss))(p)
    forward_twice = jax.jit(jax.jacfwd(jax.jacfwd(loss)))(p)  # eager, it took 3x longer
    assert_close(hessian, forward_twice, 1e-12, f"hessian, checkpoints={checkpoints}")
    v = jnp.array([0.3, -1.0, 0.5, 2.0])
    hvp = jax.jit(lambda p: jax.jvp(jax.grad(loss), (p,), (v,))[1])(p)
    assert_close(hvp, forward_twice @ v, 1e-12, "hessian-vector product")


# --------------------------------------------------------------------------------------------
# 7. float32


@pytest.mark.parametrize("checkpoints", [5, maybe_slow("all", True)])
def test_float32_fixed_close_to_float64(checkpoints):
    case = "rk4_fixed"
    _, (y0, p) = fixed_loss(case, checkpoints)
    vg = fixed_vg(case, checkpoints)
    out64 = vg(y0, p)
    out32 = vg(y0.astype(jnp.float32), p.astype(jnp.float32))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(out32))
    assert_close(out32, out64, 1e-4, f"float32 fixed checkpoints={checkpoints}")


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_float32_adaptive_close_to_float64():
    def loss(y0, p):
        sol = og.solve(
            lotka_volterra,
            y0,
            (0.0, 2.0),
            p,
            step=og.Adaptive(rtol=1e-6, atol=1e-6),
            saveat=og.SaveAt(ts=FIXED_SAVE_TS.astype(y0.dtype)),
            adjoint=og.Discrete(5),
            max_steps=512,
        )
        return weighted_sum(sol.ts, sol.ys)

    vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    out32 = vg(LV_Y0.astype(jnp.float32), LV_P.astype(jnp.float32))
    out64 = vg(LV_Y0, LV_P)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(out32))
    assert_close(out32, out64, 1e-4, "float32 adaptive vs float64 (same tolerances)")


# --------------------------------------------------------------------------------------------
# 8. memory of the compiled gradient, in units of one 64x64 state


def mem_rhs(t, y, p):
    """Elementwise on a 64x64 state, so that ``f`` itself needs next to no temporaries and the
    memory measured is the adjoint's; the forcing makes an adaptive solve take ~1000 steps."""
    return p[0] * jnp.cos(190.0 * t) * y - p[1] * y**3


_x = np.linspace(0, 2 * np.pi, 64, endpoint=False)
MEM_Y0 = jnp.asarray(np.sin(_x)[:, None] * np.cos(2 * _x)[None, :] + 0.5)
MEM_P = jnp.array([20.0, 0.5])
MEM_ADAPTIVE = og.Adaptive(rtol=1e-9, atol=1e-9)


def mem_loss(step, checkpoints, max_steps):
    def loss(y0, p):
        sol = og.solve(
            mem_rhs,
            y0,
            (0.0, 1.0),
            p,
            solver=og.RK4() if isinstance(step, og.Fixed) else og.Tsit5(),
            step=step,
            adjoint=og.Discrete(checkpoints),
            max_steps=max_steps,
        )
        return jnp.sum(sol.ys[-1] ** 2)

    return loss


def temp_states(loss, label) -> float:
    """Temporary memory of the compiled gradient, in states of 64x64."""
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(MEM_Y0, MEM_P).compile()
    mem = compiled.memory_analysis()
    assert mem is not None
    states = mem.temp_size_in_bytes / (MEM_Y0.size * MEM_Y0.dtype.itemsize)
    MEASURED.append((f"memory (states): {label}", states, float("nan")))
    return states


def test_memory_all_fixed_keeps_every_step():
    states = temp_states(mem_loss(og.Fixed(1e-3), "all", 1000), "all, 1000 RK4 steps")
    assert states >= 900, f"checkpoints='all' over 1000 RK4 steps holds only {states:.1f} states"


def test_memory_checkpoints_10_fixed():
    states = temp_states(mem_loss(og.Fixed(1e-3), 10, 1000), "10, 1000 RK4 steps")
    assert states <= 40, f"checkpoints=10 (1000 RK4 steps) needs {states:.1f} states"


def test_memory_checkpoints_10_adaptive():
    states = temp_states(mem_loss(MEM_ADAPTIVE, 10, 2048), "10, adaptive Tsit5 max_steps=2048")
    assert states <= 40, f"checkpoints=10 (adaptive, max_steps=2048) needs {states:.1f} states"


def test_default_budget_keeps_at_least_min_checkpoints():
    """The default budget never leaves fewer than ``Tuning.min_checkpoints`` states (2 slots
    re-take 100 steps ~13 times); a budget passed to the adjoint is held to."""
    from odegrad._tuning import tuned, tuning

    budget = int(2.5 * MEM_Y0.nbytes)  # holds 2 states
    args = (mem_rhs, MEM_Y0, (0.0, 1.0), MEM_P)
    kw = dict(solver=og.RK4(), step=og.Fixed(1e-2))
    floor = tuning().min_checkpoints
    with tuned(memory_budget=budget):
        text = og.explain_adjoint(*args, **kw, adjoint=og.Auto(forward_max_inputs=0))
        held = og.explain_adjoint(*args, **kw, adjoint=og.Discrete(memory_budget=budget))
        states = temp_states(mem_loss(og.Fixed(1e-2), None, 100), "default budget of 2 states")
    two = temp_states(mem_loss(og.Fixed(1e-2), 2, 100), "2 checkpoints, 100 RK4 steps")
    assert f"Discrete(checkpoints={floor})" in text and "min_checkpoints" in text, text
    assert "Discrete(checkpoints=2)" in held, held
    # each slot of the revolve buffer costs up to 3 states of compiled memory (measured: 18
    # states for 6 more slots; the loop carries the buffer)
    extra = states - two
    assert floor - 2 <= extra <= 3 * (floor - 2) + 2, f"{floor} checkpoints: {extra:.1f} more"


@slow
def test_memory_adaptive_problem_takes_about_1000_steps():
    """The adaptive memory problem really takes ~1000 steps, and its gradient is right."""
    sol = og.solve(mem_rhs, MEM_Y0, (0.0, 1.0), MEM_P, step=MEM_ADAPTIVE, max_steps=2048)
    n = int(sol.stats["accepted"])
    assert 800 <= n <= 1500, n
    g10 = jax.jit(jax.grad(mem_loss(MEM_ADAPTIVE, 10, 2048), argnums=(0, 1)))(MEM_Y0, MEM_P)
    gall = jax.jit(jax.grad(mem_loss(MEM_ADAPTIVE, "all", 2048), argnums=(0, 1)))(MEM_Y0, MEM_P)
    assert_close(g10, gall, 1e-10, "memory problem: 10 vs all")


# --------------------------------------------------------------------------------------------
# 9. the reverse pass of an adaptive solve is a custom VJP, never a differentiated while_loop


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
def test_adaptive_grad_is_custom_vjp(checkpoints):
    def loss(p):
        sol = og.solve(
            lotka_volterra,
            LV_Y0,
            (0.0, 1.0),
            p,
            step=og.Adaptive(rtol=1e-6, atol=1e-6),
            adjoint=og.Discrete(checkpoints),
        )
        return jnp.sum(sol.ys)

    # JAX refuses to reverse-differentiate a lax.while_loop, so tracing the gradient at all
    # shows that the loop is not differentiated; the solve is a custom VJP (in the primal
    # program: the gradient's jaxpr has the custom VJP already replaced by its rules)
    grad_jaxpr = jax.make_jaxpr(jax.grad(loss))(LV_P)
    assert "while" in str(grad_jaxpr)
    assert "custom_vjp_call" in str(jax.make_jaxpr(loss)(LV_P))
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
        jax.grad(
            lambda x: jax.lax.while_loop(
                lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * x), (0, x)
            )[1]
        )(2.0)


def _lv_saves_loss(p, c):
    sol = og.solve(
        lotka_volterra,
        LV_Y0,
        (0.0, 3.0),
        p,
        step=og.Adaptive(rtol=1e-7, atol=1e-7),
        saveat=og.SaveAt(ts=jnp.linspace(0.0, 3.0, 5)),
        adjoint=og.Discrete(c),
    )
    return jnp.sum(sol.ys**2)


@pytest.mark.parametrize(
    "checkpoints",
    [
        pytest.param(3, marks=pytest.mark.slow),  # (49, more than the steps, stays by default)
        pytest.param(30, marks=pytest.mark.slow),
        pytest.param(40, marks=pytest.mark.slow),
        pytest.param(48, marks=pytest.mark.slow),
        49,
        pytest.param(400, marks=pytest.mark.slow),
    ],
)
def test_adaptive_checkpoints_fewer_and_more_than_steps(checkpoints):
    """The forward pass keeps the first c states: with c >= the step count (41 accepted steps
    here: 48, 49, 400) the reverse pass recomputes nothing; a short tail past them (40: 2 steps)
    is re-taken from the last kept state; a longer one (3; 30: 12 steps, 66 re-taken against the
    schedule's 50) runs the binomial schedule in that buffer. All equal keeping every step."""
    grad = jax.jit(jax.grad(_lv_saves_loss), static_argnums=1)
    g = grad(LV_P, checkpoints)
    g_all = grad(LV_P, "all")
    assert_close(g, g_all, 1e-13, f"Discrete({checkpoints}) vs all")


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_adaptive_short_tail_under_vmap():
    """Members that step differently (24, 41 and 50 accepted steps); the batch follows its
    longest member: with 45 slots a short tail (6 steps, re-taken from the last kept state; the
    other members' steps there masked), with 30 the binomial schedule (a tail of 21 would re-take
    210 steps, the schedule 68). Each row equals its own solve keeping every step."""
    ps = LV_P[None, :] * jnp.array([0.7, 1.0, 1.3])[:, None]
    batched = jax.jit(jax.vmap(jax.grad(_lv_saves_loss), in_axes=(0, None)), static_argnums=1)
    g_all = jax.jit(jax.grad(_lv_saves_loss), static_argnums=1)
    for slots in (30, 45):
        g = batched(ps, slots)
        for i in range(3):
            assert_close(g[i], g_all(ps[i], "all"), 1e-13, f"{slots} slots, member {i}")
