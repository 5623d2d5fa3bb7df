"""``Discrete("all")`` on a step count known only at run time, keeping each step's VJP.

A fixed grid on a traced span (seed 004's call: ``t`` a jit argument, ``dt0 = t[1] - t[0]``)
runs a while loop. With every step kept, its reverse pass applies the VJP each step left in
the forward pass (``odegrad.adjoint.discrete.keeps_pullbacks``) where the step's residuals are
few. Checked: gradients equal the static grid's (JAX's own reverse pass of a scan) to rounding,
for smooth and kinked ``f``, every ``SaveAt`` form and under ``vmap``; second derivatives; and
where the rule keeps states instead, as ``og.explain_adjoint`` says.
"""

from __future__ import annotations

import functools

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import odegrad as og  # noqa: E402
from odegrad._tuning import tuned  # noqa: E402

N, STEPS, T = 16, 40, 0.4
KEPT = "every step's VJP (its residuals) kept"


def wave(kink: bool):
    """Seed 004's fields and right-hand sides on a 16 x 16 grid (4 KiB of float64 state)."""
    if kink:
        du = lambda t, v, a: -a * jnp.abs(v) * v - jax.nn.relu(v - 0.05)
    else:
        du = lambda t, v, a: -a * v**2
    dv = lambda t, u, a: -jnp.fft.irfft(jnp.sin(a * jnp.fft.rfft(u)), n=N)
    return du, dv


def fields(scale=1.0):
    ku, kv = jax.random.split(jax.random.key(3))
    return (
        scale * 0.1 * jax.random.normal(ku, (N, N)),
        scale * 0.1 * jax.random.normal(kv, (N, N)),
    )


SAVES = {
    "steps_fn": og.SaveAt(steps=True, fn=lambda t, y, a: jnp.tanh(a * y[0][3, 5]) + y[1][7, 2]),
    "ts": og.SaveAt(ts=np.linspace(0.0, T, 7)),
    "t1": og.SaveAt(t1=True),
    "dense": og.SaveAt(t1=True, dense=True),
}


def loss(y0, a, t1, saveat, kink, adjoint):
    sol = og.solve(
        wave(kink),
        y0,
        (0.0, t1),
        a,
        solver=og.SemiImplicitEuler(),
        step=og.Fixed(T / STEPS),
        saveat=saveat,
        adjoint=adjoint,
        max_steps=STEPS + 2,
    )
    value = sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(sol.ys))
    if saveat.dense:
        value += sum(jnp.sum(jnp.cos(x)) for x in jax.tree.leaves(sol.evaluate(0.37 * t1)))
    return value


@functools.cache
def traced_grad(save, kink):
    """The gradient with the span a jit argument: a fixed grid of run-time length."""
    fn = lambda y0, a, t1: loss(y0, a, t1, SAVES[save], kink, og.Discrete("all"))
    return jax.jit(jax.grad(fn, (0, 1)))


@pytest.mark.parametrize("kink", [False, True])
@pytest.mark.parametrize("save", list(SAVES))
def test_traced_span_gradient_equals_static_grid(save, kink):
    y0, a = fields(), 1.3
    static_loss = lambda y0, a: loss(y0, a, T, SAVES[save], kink, og.Discrete("all"))
    static = jax.jit(jax.grad(static_loss, (0, 1)))(y0, a)  # (eagerly: 2-3x the time)
    traced = traced_grad(save, kink)(y0, a, T)
    for x, y in zip(jax.tree.leaves(traced), jax.tree.leaves(static), strict=True):
        scale = float(jnp.max(jnp.abs(y)))
        assert scale > 1e-3
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-12 * scale)


def test_traced_span_keeps_the_step_vjps():
    said = []

    @jax.jit
    def explain(a, t1):  # (a traced, as under jax.grad: its residuals count)
        for kink in (False, True):
            said.append(
                og.explain_adjoint(
                    wave(kink), fields(), (0.0, t1), a, solver=og.SemiImplicitEuler(),
                    step=og.Fixed(T / STEPS), adjoint=og.Discrete("all"), max_steps=STEPS + 2,
                )
            )  # fmt: skip
        for max_steps in (STEPS + 2, 4096):  # og.Auto(): 168 KiB of states, 16 MiB
            said.append(
                og.explain_adjoint(
                    wave(False), fields(), (0.0, t1), a, solver=og.SemiImplicitEuler(),
                    step=og.Fixed(T / STEPS), max_steps=max_steps,
                )
            )  # fmt: skip
        return t1

    explain(1.3, T)
    assert all(KEPT in text for text in said[:3])
    assert "Auto chose Discrete(checkpoints='all')" in said[2]
    # it cannot know that 4096 rows would be used: checkpoints, and the hint
    assert "Auto chose Discrete(checkpoints=64)" in said[3] and KEPT not in said[3]
    assert "Discrete('all') keeps every step's VJP instead" in said[3]


def test_traced_span_under_vmap():
    """Members of different step counts (spans 0.3 and 0.4): each its own VJPs."""
    y0, a = fields(), 1.3
    spans = jnp.array([0.3, T])
    fn = lambda a, t1: loss(y0, a, t1, SAVES["t1"], True, og.Discrete("all"))
    batched = jax.jit(jax.vmap(jax.grad(fn), (None, 0)))(a, spans)
    for g, t1 in zip(batched, [0.3, T], strict=True):
        ref = jax.grad(lambda a: loss(y0, a, t1, SAVES["t1"], True, og.Discrete(4)))(a)
        np.testing.assert_allclose(g, ref, rtol=1e-12)


def test_second_derivative():
    """Forward over reverse through the kept VJPs: against central differences of the
    gradient."""
    y0 = fields()
    fn = lambda a, t1: loss(y0, a, t1, SAVES["steps_fn"], False, og.Discrete("all"))
    grad = jax.jit(jax.grad(fn))
    hess = jax.jit(lambda a, t1: jax.jvp(lambda a: grad(a, t1), (a,), (1.0,))[1])(1.3, T)
    eps = 1e-5
    fd = (grad(1.3 + eps, T) - grad(1.3 - eps, T)) / (2 * eps)
    np.testing.assert_allclose(hess, fd, rtol=1e-6)


def lotka_volterra(t, y, a):
    x, z = y[0], y[1]
    return jnp.stack([a[0] * x - a[1] * x * z, -a[2] * z + a[3] * x * z])


def test_elementwise_step_keeps_states():
    """Tsit5 on a traced span of Lotka–Volterra keeps every operation's output: more states of
    residuals than ``Tuning.pullback_states``, so the rule keeps the states and replays the
    stages; an adaptive solve keeps states whatever its residuals."""
    y0 = jnp.array([10.0, 5.0])

    def explain():
        said = []

        def trace(t1):
            for step in (og.Fixed(0.01), og.Adaptive()):
                said.append(
                    og.explain_adjoint(
                        lotka_volterra, y0, (0.0, t1), jnp.ones(4), step=step,
                        adjoint=og.Discrete("all"), max_steps=2000,
                    )
                )  # fmt: skip
            return t1

        jax.jit(trace)(10.0)
        return said

    with tuned(pullback_min_bytes=0):
        fixed, adaptive = explain()
    assert "Discrete(checkpoints='all')" in fixed and KEPT not in fixed
    with tuned(pullback_min_bytes=0, pullback_states=1e3):
        forced, adaptive = explain()
    assert KEPT in forced and KEPT not in adaptive
