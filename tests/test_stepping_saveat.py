"""Step grids (Fixed, StepTo), what SaveAt stores and where, and how failures are reported.

Values are checked against hand-written NumPy steppers on the same grid (Euler, RK4), against
``expm`` for linear problems, or against a second solve that differs only in what it saves.
Calls that must take the static-count (``lax.scan``) path run eagerly: with concrete ``t_span``
and ``dt``; adaptive solves are jitted.
"""

from __future__ import annotations

import itertools
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odegrad as og

TOL = 1e-9


def max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def nonlin(t, y, args):
    """A non-autonomous nonlinear right-hand side, the same in JAX and NumPy."""
    xp = jnp if isinstance(y, jax.Array) else np
    return xp.cos(t) * y - 0.3 * y**2


Y0 = np.array([0.5, -0.2, 1.0])


def numpy_euler(f, ts, y0):
    ys, y = [], np.asarray(y0, np.float64)
    for t0, t1 in itertools.pairwise(ts):
        y = y + (t1 - t0) * f(t0, y, None)
        ys.append(y)
    return np.stack(ys)


def numpy_rk4(f, ts, y0):
    ys, y = [], np.asarray(y0, np.float64)
    for t0, t1 in itertools.pairwise(ts):
        h = t1 - t0
        k1 = f(t0, y, None)
        k2 = f(t0 + h / 2, y + h / 2 * k1, None)
        k3 = f(t0 + h / 2, y + h / 2 * k2, None)
        k4 = f(t0 + h, y + h * k3, None)
        y = y + h * (k1 / 6 + k2 / 3 + k3 / 3 + k4 / 6)
        ys.append(y)
    return np.stack(ys)


# --------------------------------------------------------------------------------------------
# step grids


@pytest.mark.parametrize(
    "t0, t1, dt, n",
    [
        (0.0, 1.0, 0.1, 10),
        (0.0, 1.0, 0.3, 4),  # 3.33 -> 4 steps of 1/4 (never longer than dt)
        (0.0, 1.0, 0.28, 4),  # 3.57 -> 4 steps of 1/4
        (0.0, 1.0, 0.7, 2),  # 1.43 -> 2 steps of 1/2
        (2.0, -1.0, 0.25, 12),  # backwards
    ],
)
def test_fixed_step_count_and_grid(t0, t1, dt, n):
    """Exactly ceil(|t1 - t0| / dt) equal steps (none longer than dt), the last landing on t1
    exactly; rows equal a hand-written Euler loop on that grid."""
    sol = og.solve(
        nonlin,
        jnp.asarray(Y0),
        (t0, t1),
        solver=og.Euler(),
        step=og.Fixed(dt),
        saveat=og.SaveAt(steps=True),
    )
    grid = np.linspace(t0, t1, n + 1)
    assert sol.ts.shape == (n,) and sol.ys.shape == (n, 3)
    assert float(sol.ts[-1]) == t1
    np.testing.assert_allclose(np.asarray(sol.ts), grid[1:], rtol=0, atol=1e-15)
    assert max_abs(sol.ys, numpy_euler(nonlin, grid, Y0)) < 1e-14
    stats = {k: int(v) for k, v in sol.stats.items()}
    assert stats["steps"] == stats["accepted"] == n and stats["rejected"] == 0


def test_step_to_grid():
    """StepTo steps exactly from one given time to the next (non-uniform, forwards and
    backwards), with the RK4 values of a hand-written loop on that grid."""
    for ts in (
        np.array([0.0, 0.1, 0.15, 0.4, 0.8, 1.0]),
        np.array([1.0, 0.7, 0.65, 0.2, 0.0]),
    ):
        sol = og.solve(
            nonlin,
            jnp.asarray(Y0),
            (float(ts[0]), float(ts[-1])),
            solver=og.RK4(),
            step=og.StepTo(jnp.asarray(ts)),
            saveat=og.SaveAt(steps=True),
        )
        np.testing.assert_array_equal(np.asarray(sol.ts), ts[1:])
        assert max_abs(sol.ys, numpy_rk4(nonlin, ts, Y0)) < 1e-14
        assert int(sol.stats["steps"]) == len(ts) - 1


def test_step_to_traced_grid_reuses_compilation():
    """A jitted solve over a traced StepTo grid: one compile, any grid of the same length."""
    traces = []

    @jax.jit
    def run(ts):
        traces.append(1)
        return og.solve(
            nonlin, jnp.asarray(Y0), (0.0, 1.0), solver=og.RK4(), step=og.StepTo(ts)
        ).ys[-1]

    for ts in (np.linspace(0.0, 1.0, 6), np.array([0.0, 0.05, 0.3, 0.31, 0.9, 1.0])):
        assert max_abs(run(jnp.asarray(ts)), numpy_rk4(nonlin, ts, Y0)[-1]) < 1e-14
    assert len(traces) == 1


# --------------------------------------------------------------------------------------------
# SaveAt layout and values


def test_saveat_t0_ts_t1_layout(linear, linear_args):
    """Rows in the order t0, ts..., t1, with the states there (adaptive, tol 1e-9)."""
    ts = jnp.array([0.25, 0.5, 1.7])
    sol = jax.jit(
        lambda y, a: og.solve(
            linear.f,
            y,
            (0.0, 2.0),
            a,
            step=og.Adaptive(rtol=TOL, atol=TOL),
            saveat=og.SaveAt(t0=True, ts=ts, t1=True),
        )
    )(*linear_args)
    np.testing.assert_array_equal(np.asarray(sol.ts), [0.0, 0.25, 0.5, 1.7, 2.0])
    assert sol.ys.shape == (5, 3)
    assert max_abs(sol.ys[0], linear.y0) == 0.0
    assert max_abs(sol.ys, linear.exact(np.asarray(sol.ts))) < 10 * TOL


def test_saveat_t0_steps_t1_layout():
    """Fixed steps with t0, steps and t1: 1 + N + 1 rows (the t1 row repeats the last step)."""
    sol = og.solve(
        nonlin,
        jnp.asarray(Y0),
        (0.0, 1.0),
        solver=og.RK4(),
        step=og.Fixed(0.125),
        saveat=og.SaveAt(t0=True, steps=True, t1=True),
    )
    grid = np.linspace(0.0, 1.0, 9)
    np.testing.assert_allclose(np.asarray(sol.ts), [*grid, 1.0], rtol=0, atol=1e-15)
    want = np.concatenate([Y0[None], numpy_rk4(nonlin, grid, Y0), numpy_rk4(nonlin, grid, Y0)[-1:]])
    assert sol.ys.shape == (10, 3)
    assert max_abs(sol.ys, want) < 1e-14


def fn_pytree(t, y, args):
    """A nonlinear function of (t, y, args), returning a pytree of a different structure."""
    return {"t": t, "q": args["w"] * jnp.sum(y**2), "y0sq": y[0] ** 2}


FN_ARGS = {
    "w": jnp.asarray(0.5),
    "a": jnp.asarray([[-0.5, 2.0, 0.0], [-2.0, -0.3, 0.2], [0.1, 0.0, -0.8]]),
}


def lin_args_f(t, y, args):
    return args["a"] @ y


@pytest.mark.parametrize("kind", ["ts", "steps_fixed", "adaptive_steps"])
def test_fn_applied_before_storing(kind):
    """SaveAt(fn=...) stores fn(t, y, args) of the state the plain solve stores (for ts: of the
    interpolated state, not an interpolation of fn), with t the save time; including t0/t1."""
    y0 = jnp.asarray(Y0)
    if kind == "ts":
        step, extra = og.Adaptive(rtol=1e-8, atol=1e-8), {"ts": jnp.array([0.3, 1.1, 1.9])}
    elif kind == "steps_fixed":
        step, extra = og.Fixed(0.25), {"steps": True}
    else:
        step, extra = og.Adaptive(rtol=1e-6, atol=1e-6), {"steps": True}

    def run(fn):
        return og.solve(
            lin_args_f,
            y0,
            (0.0, 2.0),
            FN_ARGS,
            step=step,
            saveat=og.SaveAt(t0=True, t1=True, fn=fn, **extra),
            max_steps=64,
        )

    if kind == "steps_fixed":  # eager: the scan path
        plain, mapped = run(None), run(fn_pytree)
    else:
        plain, mapped = jax.jit(lambda: (run(None), run(fn_pytree)))()
    # (two loops in one program: XLA may round them differently, ~1e-12 here)
    np.testing.assert_allclose(np.asarray(mapped.ts), np.asarray(plain.ts), rtol=1e-10)
    want = jax.vmap(fn_pytree, in_axes=(0, 0, None))(plain.ts, plain.ys, FN_ARGS)
    assert set(mapped.ys) == {"t", "q", "y0sq"}
    finite = np.isfinite(np.asarray(plain.ts))
    assert finite.sum() >= 5
    for key in ("t", "q", "y0sq"):
        got, exp = np.asarray(mapped.ys[key])[finite], np.asarray(want[key])[finite]
        assert max_abs(got, exp) < 1e-10, key
    np.testing.assert_array_equal(np.asarray(mapped.ys["t"])[finite], np.asarray(mapped.ts)[finite])


def test_steps_adaptive_pads_with_inf(linear, linear_args):
    """Adaptive steps=True: max_steps rows; the accepted steps first (increasing times, the last
    at t1, states within tolerance of expm), then inf in times and states."""
    sol = jax.jit(
        lambda y, a: og.solve(
            linear.f,
            y,
            (0.0, 2.0),
            a,
            step=og.Adaptive(rtol=1e-8, atol=1e-8),
            saveat=og.SaveAt(steps=True),
            max_steps=200,
        )
    )(*linear_args)
    n = int(sol.stats["accepted"])
    ts, ys = np.asarray(sol.ts), np.asarray(sol.ys)
    assert ts.shape == (200,) and ys.shape == (200, 3)
    assert 10 < n < 200
    assert np.all(np.diff(ts[:n]) > 0) and ts[n - 1] == 2.0
    assert np.all(ts[n:] == np.inf) and np.all(ys[n:] == np.inf)
    assert max_abs(ys[:n], linear.exact(ts[:n])) < 10 * 1e-8


def test_steps_adaptive_backward_pads_with_inf(linear, linear_args):
    sol = jax.jit(
        lambda y, a: og.solve(
            linear.f, y, (2.0, 0.0), a, saveat=og.SaveAt(steps=True), max_steps=64
        )
    )(*linear_args)
    n = int(sol.stats["accepted"])
    ts = np.asarray(sol.ts)
    assert ts[n - 1] == 0.0 and np.all(np.diff(ts[:n]) < 0)
    assert np.all(ts[n:] == np.inf)


# --------------------------------------------------------------------------------------------
# failures: max_steps, blow-up


def test_max_steps_reached_keeps_earlier_rows(linear, linear_args):
    """throw=False with too few steps: result max_steps_reached; what was saved before the
    failure is kept (the same rows a long enough solve gives), the rest is inf."""
    ts = jnp.linspace(0.0, 2.0, 21)

    def run(saveat, max_steps):
        return og.solve(
            linear.f,
            linear_args[0],
            (0.0, 2.0),
            linear_args[1],
            step=og.Adaptive(rtol=1e-10, atol=1e-10),
            saveat=saveat,
            max_steps=max_steps,
            throw=False,
        )

    short_steps, long_steps, short_ts = jax.jit(
        lambda: (
            run(og.SaveAt(steps=True), 12),
            run(og.SaveAt(steps=True), 512),
            run(og.SaveAt(ts=ts), 12),
        )
    )()
    assert int(short_steps.result) == og.Result.max_steps_reached
    assert int(short_ts.result) == og.Result.max_steps_reached
    assert int(long_steps.result) == og.Result.success
    assert int(short_steps.stats["steps"]) == 12
    # the first 12 steps are the same steps whatever max_steps is (to the round-off by which
    # XLA may compile two loops of one program differently; the controller at rtol 1e-10
    # carries it: ~4e-10)
    np.testing.assert_allclose(np.asarray(short_steps.ts), np.asarray(long_steps.ts)[:12], 1e-8)
    np.testing.assert_allclose(np.asarray(short_steps.ys), np.asarray(long_steps.ys)[:12], 1e-8)
    t_reached = float(short_steps.ts[-1])
    assert 0.0 < t_reached < 2.0
    ts_np, ys = np.asarray(ts), np.asarray(short_ts.ys)
    kept = ts_np <= t_reached
    assert 1 < kept.sum() < len(ts_np)
    assert max_abs(ys[kept], linear.exact(ts_np[kept])) < 10 * 1e-10
    assert np.all(ys[~kept] == np.inf)


def test_max_steps_reached_raises(linear, linear_args):
    with pytest.raises(RuntimeError, match=r"max_steps was reached.*raise max_steps"):
        og.solve(
            linear.f,
            *linear_args[:1],
            (0.0, 2.0),
            linear_args[1],
            step=og.Adaptive(rtol=1e-10, atol=1e-10),
            max_steps=12,
        )


def blowup(t, y, args):
    return y**2  # y(0) = 1: y = 1 / (1 - t), singular at t = 1


FAIL_TIME = re.compile(r"failed at t=([-+0-9.eE]+)")


def test_blowup_adaptive_result():
    sol = jax.jit(lambda y: og.solve(blowup, y, (0.0, 2.0), throw=False))(jnp.asarray(1.0))
    assert int(sol.result) in (og.Result.step_size_underflow, og.Result.nonfinite)


def test_blowup_adaptive_raises_with_reason_and_time():
    with pytest.raises(RuntimeError) as info:
        og.solve(blowup, jnp.asarray(1.0), (0.0, 2.0))
    msg = str(info.value)
    assert "step size fell below" in msg or "non-finite" in msg
    t = float(FAIL_TIME.search(msg).group(1))
    assert abs(t - 1.0) < 1e-3  # the singularity


def test_blowup_adaptive_raises_under_jit():
    run = jax.jit(lambda y: og.solve(blowup, y, (0.0, 2.0)).ys)
    with pytest.raises(Exception, match=r"failed at t=1\b.*(step size fell below|non-finite)"):
        jax.block_until_ready(run(jnp.asarray(1.0)))


def test_blowup_fixed_nonfinite():
    """Fixed steps run through the singularity: the state overflows, reported as nonfinite."""
    sol = og.solve(blowup, jnp.asarray(1.0), (0.0, 2.0), step=og.Fixed(0.1), throw=False)
    assert int(sol.result) == og.Result.nonfinite
    with pytest.raises(RuntimeError, match=r"failed at t=.*non-finite"):
        og.solve(blowup, jnp.asarray(1.0), (0.0, 2.0), step=og.Fixed(0.1))


@pytest.mark.parametrize(
    "saveat, expected",
    [
        ("steps", r"failed at t=1.1 \(step 12\): the state became non-finite"),
        ("ts", r"failed at t=1.25: the state was first non-finite \(inf/nan\) at this save time"),
        ("t1", r"failed at t=2 \(step 20\): the state was non-finite \(inf/nan\) at the end"),
    ],
)
def test_blowup_fixed_traced_span_located_as_static(saveat, expected):
    """A grid whose step count is known only at run time (a traced span) runs on through a
    non-finite value as the static grid's scan does, and the error locates it the same way:
    the failing step's start and number where every step is saved (y = 1 / (1 - t) overflows
    in the step from 1.1 to 1.2), else the first save time, or the end, saying so."""
    saveat = {
        "steps": og.SaveAt(steps=True),
        "ts": og.SaveAt(ts=jnp.linspace(0.0, 2.0, 9)),
        "t1": og.SaveAt(t1=True),
    }[saveat]

    def message(traced):
        def run(y, t1):
            span = (0.0, t1 if traced else 2.0)
            return og.solve(blowup, y, span, step=og.Fixed(0.1), saveat=saveat).ys

        with pytest.raises(Exception, match=expected) as info:
            jax.block_until_ready(jax.jit(run)(jnp.asarray(1.0), 2.0))
        return str(info.value).splitlines()[-1]

    assert message(True) == message(False)


def test_blowup_located_under_nested_vmap():
    """The error's host side locates a failure member by member, from the saved rows (a fixed
    grid) or where the loop stopped (adaptive), with two batch axes, one of them only on
    some operands (the span is batched over the outer axis alone): the first failing member
    is reported where its own solve reports it."""
    t1s = jnp.array([0.5, 2.0])
    y0s = jnp.array([0.5, 1.0, 0.8])  # y' = y^2 blows up at 1 / y0: 2, 1, 1.25

    def run(t1, y0, step):
        return og.solve(blowup, y0, (0.0, t1), step=step, saveat=og.SaveAt(steps=True)).ys

    for step in (og.Fixed(0.1), None):
        batched = jax.jit(jax.vmap(jax.vmap(partial(run, step=step), (None, 0)), (0, None)))
        with pytest.raises(Exception) as alone:
            jax.block_until_ready(jax.jit(partial(run, step=step))(2.0, 1.0))
        where = re.search(r"failed at t=\S+ \(step \d+", str(alone.value)).group(0)
        with pytest.raises(Exception, match=re.escape(where) + r", batch member \(1, 1\) of a "
                           r"batch of \(2, 3\); 2 members failed\)"):  # fmt: skip
            jax.block_until_ready(batched(t1s, y0s))
        ok = batched(jnp.array([0.5, 0.9]), y0s)  # every member finite: their own values
        alone = run(0.9, 0.8, step)  # (the batch's rows run to max_steps, inf after the end)
        np.testing.assert_allclose(ok[1, 2, : len(alone)], alone, rtol=1e-8)


def test_blowup_fixed_traced_span_under_vmap():
    """Members with their own step counts: the one that blows up fails alone, the others
    equal their own solves."""
    t1s = jnp.array([0.5, 2.0, 0.9])

    def run(t1):
        sol = og.solve(blowup, jnp.asarray(1.0), (0.0, t1), step=og.Fixed(0.1), throw=False)
        return sol.ys[-1], sol.result, sol.stats["steps"]

    ys, results, steps = jax.jit(jax.vmap(run))(t1s)
    assert results.tolist() == [og.Result.success, og.Result.nonfinite, og.Result.success]
    assert steps.tolist() == [5, 20, 9]
    for k in (0, 2):
        alone = og.solve(blowup, jnp.asarray(1.0), (0.0, float(t1s[k])), step=og.Fixed(0.1))
        np.testing.assert_allclose(float(ys[k]), float(alone.ys[-1]), rtol=1e-13)
    assert abs(float(ys[0]) - 2.0) < 0.05  # y(0.5) = 2, first order accurate in 0.1 steps
    with pytest.raises(
        Exception,
        match=r"failed at t=2 \(step 20, batch member 1 of a batch of \(3,\)\): the state was "
        "non-finite",
    ):
        jax.block_until_ready(
            jax.jit(jax.vmap(lambda t1: og.solve(blowup, 1.0, (0.0, t1), step=og.Fixed(0.1)).ys))(
                t1s
            )
        )


#: each adjoint with one step kind by default (Quadrature's start saves are Interpolating's)
_EMPTY_SPAN_SLOW = ("fixed-quadrature", "adaptive-quadrature", "fixed-discrete3",
                    "adaptive-interpolating", "adaptive-auto")  # fmt: skip


@pytest.mark.parametrize(
    "step, adjoint",
    [
        pytest.param(step, adjoint, id=f"{sid}-{aid}",
                     marks=[pytest.mark.slow] if f"{sid}-{aid}" in _EMPTY_SPAN_SLOW else [])
        for sid, step in (("fixed", og.Fixed(0.1)), ("adaptive", og.Adaptive()))
        for aid, adjoint in (("auto", og.Auto()), ("discrete3", og.Discrete(3)),
                             ("interpolating", og.Interpolating()), ("quadrature", og.Quadrature()))
    ],
)  # fmt: skip
def test_traced_empty_span_saves_y0(step, adjoint):
    """A span traced to t1 == t0 (a member of a vmap over t1 = linspace(0, 1, 3)): the loop
    takes no step, and the saves at t0 are fn(t0, y0) (they held the buffer's inf fill, which
    the fixed grid then reported as a non-finite state). Their gradients: Discrete visited no
    step that held them (it gave 0), the continuous adjoints read the state from an empty dense
    output (nan where fn reads args)."""

    def run(t1, y0=1.0, k=2.0):
        saveat = og.SaveAt(ts=jnp.array([0.0, 0.0]), fn=lambda t, y, k: k * y)
        sol = og.solve(lambda t, y, k: -k * y, y0, (0.0, t1), k, step=step, saveat=saveat,
                       adjoint=adjoint)  # fmt: skip
        return sol.ys, sol.result

    ys, results = jax.jit(jax.vmap(run))(jnp.linspace(0.0, 1.0, 3))
    assert results.tolist() == [og.Result.success] * 3
    np.testing.assert_allclose(ys[0], [2.0, 2.0])
    loss = lambda y0, k, t1: run(t1, y0, k)[0].sum()  # 2 k y0 at t1 == t0
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(1.0, 2.0, 0.0)
    np.testing.assert_allclose(grads, (4.0, 2.0))
    batch = lambda y0, k: jax.vmap(lambda t1: loss(y0, k, t1))(jnp.array([0.0, 0.5])).sum()
    # (every member saves at t = 0: 2 k y0 each; the empty one is no longer dropped)
    got = jax.jit(jax.grad(batch, argnums=(0, 1)))(1.0, 2.0)
    np.testing.assert_allclose(got, (8.0, 4.0))


@pytest.mark.parametrize("step", [og.Fixed(0.1), og.Adaptive()], ids=["fixed", "adaptive"])
def test_traced_empty_span_dense_output_is_y0(step):
    """``sol.evaluate`` of a span traced to t1 == t0 is y0 (it read an unwritten row: nan),
    and its gradient is the identity in y0 and zero in args, also for a member of a vmap;
    a non-empty member still interpolates (y0 exp(-k t), |y| = y here)."""

    def at(t, t1, y0, k):
        f = lambda t, y, k: -k * jnp.abs(y)
        sol = og.solve(f, y0, (0.0, t1), k, step=step, saveat=og.SaveAt(dense=True))
        return sol.evaluate(t)

    y0 = jnp.array([1.0, 2.0])
    np.testing.assert_array_equal(jax.jit(at)(0.0, 0.0, y0, 0.7), y0)
    jac_y0, d_k = jax.jit(jax.jacrev(at, argnums=(2, 3)))(0.0, 0.0, y0, 0.7)
    np.testing.assert_array_equal(jac_y0, np.eye(2))
    np.testing.assert_array_equal(d_k, [0.0, 0.0])
    t1s = jnp.array([0.0, 1.0])
    got = jax.jit(jax.vmap(lambda t1: at(0.5 * t1, t1, y0, 0.7)))(t1s)
    tol = 1e-5 if isinstance(step, og.Adaptive) else 1e-4
    np.testing.assert_allclose(got, [y0, y0 * np.exp(-0.35)], rtol=tol)


def test_traced_infinite_t1_takes_no_step():
    """A traced t1 = inf ran until max_steps; it takes no step and fails as invalid_t_span."""
    sol = jax.jit(lambda t1: og.solve(lambda t, y, a: jnp.ones_like(y), 1.0, (0.0, t1),
                                      throw=False))(jnp.inf)  # fmt: skip
    assert int(sol.result) == og.Result.invalid_t_span
    assert int(sol.stats["steps"]) == 0


def test_nonfinite_save_fn_is_named():
    """A fixed grid locates a failure by its saved rows: where those are SaveAt(fn)'s, the
    error says that fn's value may be what is not finite."""

    def run(y):
        saveat = og.SaveAt(steps=True, fn=lambda t, y, a: jnp.log(y - 0.6))
        return og.solve(lambda t, y, a: -y, y, (0.0, 1.0), step=og.Fixed(0.1), saveat=saveat).ys

    with pytest.raises(Exception, match=r"the state, or SaveAt\(fn\) of it, became non-finite"):
        jax.block_until_ready(jax.jit(run)(jnp.asarray(1.0)))


def test_result_codes():
    assert [r.name for r in og.Result] == [
        "success",
        "max_steps_reached",
        "step_size_underflow",
        "nonfinite",
        "nonfinite_y0",
        "nonfinite_f0",
        "max_events_reached",
        "invalid_save_times",
        "invalid_t_span",
        "invalid_step_times",
    ]
    sol = jax.jit(lambda y: og.solve(blowup, y, (0.0, 0.5)))(jnp.asarray(1.0))
    assert int(sol.result) == og.Result.success
    assert abs(float(sol.ys[-1]) - 2.0) < 1e-5  # y(0.5) = 2


# --------------------------------------------------------------------------------------------
# the two ways a static grid saves, and chunked save buffers


# save times on grid points, between them, several inside one step, duplicated, t0 and t1
TS_MIXED = np.array([0.0, 0.0, 0.013, 0.1, 0.1004, 0.1008, 0.35, 0.5, 0.77, 1.0, 1.0])


@pytest.mark.parametrize("adjoint", [og.Discrete("all"), og.Discrete(3)])
def test_stacked_saves_equal_in_loop_saves(adjoint):
    """Small states read their saves after the scan from stacked step starts; large ones write
    them inside the step. Both must give the same values and gradients."""
    from odegrad._tuning import tuned

    def run(p):
        sol = og.solve(
            nonlin,
            jnp.asarray(Y0) * p,
            (0.0, 1.0),
            solver=og.Tsit5(),
            step=og.Fixed(0.01),
            saveat=og.SaveAt(ts=TS_MIXED, fn=lambda t, y, a: (y[0] * t, y[1:])),
            adjoint=adjoint,
        )
        return sol.ys

    def loss(p):
        a, b = run(p)
        return jnp.sum(jnp.sin(a)) + jnp.sum(b**2)

    # the saves and the gradient from one compiled program per configuration (a new function
    # each time: jax.jit shares the traces of one function, which would keep the first tuning)
    both = lambda: jax.jit(lambda p: (run(p), jax.grad(loss)(p)))
    stacked = both()(1.3)
    with tuned(stacked_save_bytes=0):
        in_loop = both()(1.3)
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(in_loop), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("n_saves", [3, 40, 300])
def test_chunked_save_buffer_adaptive(n_saves):
    """Adaptive saves go to a buffer split into <= 512-byte chunks (40 and 300 saves of 3
    float64 span several chunks): the rows equal the dense output at the same times."""
    ts = np.sort(np.concatenate([[0.0, 1.0], np.random.default_rng(0).uniform(0, 1, n_saves - 2)]))
    kw = dict(solver=og.Tsit5(), step=og.Adaptive(rtol=1e-9, atol=1e-9))
    sol = jax.jit(lambda y: og.solve(nonlin, y, (0.0, 1.0), saveat=og.SaveAt(ts=ts), **kw))(
        jnp.asarray(Y0)
    )
    dense = og.solve(nonlin, jnp.asarray(Y0), (0.0, 1.0), saveat=og.SaveAt(dense=True), **kw)
    assert max_abs(sol.ys, dense.evaluate(jnp.asarray(ts))) < 1e-13
    assert max_abs(sol.ts, ts) == 0.0


def test_chunked_save_buffer_forward_sensitivities():
    """Forward() sizes the chunks for its tangent lanes; its gradient matches Discrete's."""
    ts = np.linspace(0.0, 1.0, 37)

    def loss(p, adjoint):
        sol = og.solve(
            lambda t, y, a: a[0] * jnp.cos(t) * y - a[1] * y**2,
            jnp.asarray(Y0),
            (0.0, 1.0),
            p,
            step=og.Adaptive(rtol=1e-10, atol=1e-10),
            saveat=og.SaveAt(ts=ts),
            adjoint=adjoint,
        )
        return jnp.sum(jnp.sin(sol.ys))

    p = jnp.array([1.0, 0.3])
    g_fwd = jax.jit(jax.grad(lambda p: loss(p, og.Forward())))(p)
    g_disc = jax.jit(jax.grad(lambda p: loss(p, og.Discrete("all"))))(p)
    np.testing.assert_allclose(g_fwd, g_disc, rtol=1e-11)


def test_large_finite_values_are_not_a_failure():
    """Huge but finite saved rows (their plain sum overflows float32) are a success."""
    y0 = jnp.full((4,), 3e37, jnp.float32)
    sol = og.solve(
        lambda t, y, a: 0.1 * y, y0, (0.0, 1.0), step=og.Fixed(0.1), saveat=og.SaveAt(steps=True)
    )
    assert int(sol.result) == og.Result.success
    assert np.all(np.isfinite(np.asarray(sol.ys)))


def test_unrolled_static_grid_equals_the_scan():
    """A few steps of a large state run as straight-line code (``Tuning.unrolled_steps``): the
    same solution, saves and gradient as the scan, and no loop left in the compiled program."""
    from odegrad._tuning import tuned

    y0 = jnp.linspace(0.0, 1.0, 64).reshape(8, 8)

    def f(t, y, k):
        return -k * y + jnp.roll(y, 1, axis=0) * jnp.sin(t)

    def loss(y0, k):
        sol = og.solve(
            f,
            y0,
            (0.0, 0.6),
            k,
            solver=og.RK4(),
            step=og.Fixed(0.2),
            saveat=og.SaveAt(ts=jnp.array([0.1, 0.5]), t1=True),
        )
        return jnp.sum(sol.ys[0] ** 2) + jnp.sum(sol.ys[-1] * sol.ys[1]), sol.ys

    out = {}
    for name, kw in (("scan", dict(unrolled_steps=0)), ("unrolled", dict(unrolled_state_bytes=0))):
        with tuned(**kw):
            fn = jax.jit(jax.value_and_grad(lambda y, k: loss(y, k), argnums=(0, 1), has_aux=True))
            compiled = fn.lower(y0, 0.7).compile()
        # loops that carry the state (a save-time search keeps its own small loop)
        state_loops = [
            line
            for line in compiled.as_text().splitlines()
            if " while(" in line and "[8,8]" in line
        ]
        out[name] = (compiled(y0, 0.7), len(state_loops))
    (val_s, grads_s), loops_s = out["scan"]
    (val_u, grads_u), loops_u = out["unrolled"]
    assert loops_s >= 1 and loops_u == 0, (loops_s, loops_u)
    pairs = zip(jax.tree.leaves((val_s, grads_s)), jax.tree.leaves((val_u, grads_u)), strict=True)
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_error_norm_sum_is_xla_own_reduction_and_exact(retune):
    """The error norm's sum (``entry_sum``) is XLA's own reduction loop up to
    ``plain_sum_entries`` (XLA:CPU's YNNPACK kernel for an add reduction cost ~13 us more per
    call in a loop) and the same sum: values, JVP, gradient and vmap as ``jnp.sum``'s."""
    from odegrad._tree import entry_sum

    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 5, 4)))
    np.testing.assert_allclose(entry_sum(x), jnp.sum(x), rtol=1e-14)
    assert entry_sum(x[0].astype("f4")).dtype == "f4"
    # float16 and bfloat16 keep jnp.sum's float32 accumulation (a narrow loop lost 2 %)
    low = jnp.full(65536, 0.9, jnp.bfloat16)
    assert float(entry_sum(low)) == float(jnp.sum(low)) == 58880.0
    _, tangent = jax.jvp(entry_sum, (x,), (x**2,))
    np.testing.assert_allclose(tangent, jnp.sum(x**2), rtol=1e-14)
    np.testing.assert_array_equal(jax.grad(entry_sum)(x), jnp.ones_like(x))
    np.testing.assert_allclose(jax.vmap(entry_sum)(x), jnp.sum(x, axis=(1, 2)), rtol=1e-14)
    field = jnp.ones((16, 16, 16))  # seed 001's grid
    hlo = jax.jit(entry_sum).lower(field).compile().as_text()
    retune(plain_sum_entries=0)
    plain = jax.jit(lambda x: entry_sum(x)).lower(field).compile().as_text()
    if jax.default_backend() == "cpu":  # (the add reduction: a YNNPACK kernel on XLA:CPU)
        assert "ynn" not in hlo and "ynn" in plain
