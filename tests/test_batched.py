"""Batched and neural-network workloads: models as ``args``, ``jax.vmap`` over members that take
different step counts, ``throw=True`` under vmap, and memory budgets that count the batch."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odegrad as og
from odegrad._solve import _build_problem
from odegrad._tuning import tuned

ADJOINTS = [
    og.Auto(),
    og.Discrete(),
    og.Discrete("all"),
    og.Discrete(3),
    og.Forward(),
    og.Backsolve(),
    og.Interpolating(),
    og.Interpolating(checkpoints=2),
    og.Quadrature(),
]
TS = jnp.linspace(0.0, 2.0, 7)
TOL = og.Adaptive(rtol=1e-9, atol=1e-9)


class Field(eqx.Module):
    """A neural vector field with leaves of every kind: arrays, a jitted activation function,
    a static string, a Python int and None."""

    mlp: eqx.nn.MLP
    scale: jax.Array
    name: str = eqx.field(static=True, default="field")
    order: int = 2
    nothing: None = None

    def __call__(self, t, y, args):
        return self.scale * self.mlp(y) - 0.1 * y**self.order * jnp.sign(y)


def field() -> Field:
    mlp = eqx.nn.MLP(2, 2, 8, 2, activation=jax.nn.softplus, key=jax.random.PRNGKey(0))
    return Field(mlp, jnp.asarray(0.7))


def _y0():
    return jnp.array([0.6, -0.3])


def _slow_for(*slow):
    """ADJOINTS, with those in ``slow`` in the slow tier (the longest compiles; the default run
    keeps the others, which share their mechanism)."""
    return [pytest.param(a, marks=pytest.mark.slow) if a in slow else a for a in ADJOINTS]


@pytest.mark.parametrize(
    "adjoint",  # (Quadrature shares Interpolating's handling of args, Discrete("all")
    # Discrete's, and Auto runs Interpolating here: slow tier)
    _slow_for(
        og.Interpolating(),
        og.Interpolating(checkpoints=2),
        og.Quadrature(),
        og.Discrete("all"),
        og.Discrete(3),
        og.Backsolve(),
    ),
    ids=repr,
)
def test_equinox_module_as_args_matches_closure(adjoint):
    """An equinox module passed as ``args`` (non-array leaves included) gives the gradient of
    the same module closed over, to 1e-12, with every adjoint."""
    model = field()

    def loss_args(m):
        sol = og.solve(
            lambda t, y, m_: m_(t, y, None),
            _y0(),
            (0.0, 2.0),
            m,
            saveat=og.SaveAt(ts=TS),
            step=TOL,
            adjoint=adjoint,
        )
        return jnp.sum(sol.ys**2)

    def loss_closure(m):
        sol = og.solve(
            lambda t, y, a: m(t, y, a),
            _y0(),
            (0.0, 2.0),
            None,
            saveat=og.SaveAt(ts=TS),
            step=TOL,
            adjoint=adjoint,
        )
        return jnp.sum(sol.ys**2)

    if isinstance(adjoint, og.Auto):  # (the default run's Interpolating case, see above)
        said = og.explain_adjoint(lambda t, y, m_: m_(t, y, None), _y0(), (0.0, 2.0), model,
                                  saveat=og.SaveAt(ts=TS), step=TOL)  # fmt: skip
        assert said.startswith("Auto chose Interpolating("), said
    g_args, g_closure = eqx.filter_jit(  # both from one compiled program
        lambda m: (eqx.filter_grad(loss_args)(m), eqx.filter_grad(loss_closure)(m))
    )(model)
    leaves_a = jax.tree.leaves(eqx.filter(g_args, eqx.is_array))
    leaves_c = jax.tree.leaves(eqx.filter(g_closure, eqx.is_array))
    assert len(leaves_a) == len(leaves_c) == 7  # 3 weights, 3 biases, scale
    for a, c in zip(leaves_a, leaves_c, strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-14)
    assert float(jnp.abs(g_args.scale)) > 1e-3  # a real gradient, not zeros on both sides


def _decay(t, y, k):
    return -k * y + jnp.sin(3.0 * t) * y[::-1]


# members whose rates differ by 20x take very different step counts
Y0S = jnp.array([[1.0, 0.5], [0.2, -1.0], [2.0, 1.0]])
KS = jnp.array([0.5, 10.0, 3.0])


@functools.cache
def _member_steps() -> list[int]:
    """Each member's step count, solved alone (one compile, shared by the cases below)."""
    steps = jax.jit(lambda y, k: og.solve(_decay, y, (0.0, 2.0), k, step=TOL).stats["steps"])
    return [int(steps(y, k)) for y, k in zip(Y0S, KS, strict=True)]


@pytest.mark.parametrize(
    "adjoint",
    [
        *_slow_for(  # (Auto runs Forward here; Discrete() keeps every step here too)
            og.Discrete("all"),
            og.Interpolating(checkpoints=2),
            og.Quadrature(),
            og.Discrete(3),
            og.Backsolve(),
            og.Forward(),
        ),
        # the dense output 4 steps at a time: each member re-takes its own number of blocks
        # (slow tier: test_interpolating_dense_blocks_under_vmap keeps blocks under vmap)
        pytest.param(og.Interpolating(dense_rows=4), marks=pytest.mark.slow),
    ],
    ids=repr,
)
def test_vmap_gradient_equals_each_member(adjoint):
    """Under vmap the loops run to the longest member and the others' extra steps change
    nothing: the batched gradient equals each member's own, with every adjoint."""

    def loss(y0, k):
        sol = og.solve(
            _decay, y0, (0.0, 2.0), k, saveat=og.SaveAt(ts=TS), step=TOL, adjoint=adjoint
        )
        return jnp.sum(sol.ys**2)

    batched = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1))))(Y0S, KS)
    steps = _member_steps()
    assert max(steps) > 1.5 * min(steps)  # the members really differ
    if isinstance(adjoint, og.Auto):  # (the default run's Forward case, see above)
        said = og.explain_adjoint(_decay, Y0S[0], (0.0, 2.0), KS[0], saveat=og.SaveAt(ts=TS),
                                  step=TOL)  # fmt: skip
        assert said.startswith("Auto chose Forward("), said
    one_member = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    for i in range(len(KS)):
        one = one_member(Y0S[i], KS[i])
        for b, o in zip(jax.tree.leaves(batched), jax.tree.leaves(one), strict=True):
            np.testing.assert_allclose(b[i], o, rtol=1e-10, atol=1e-12)


def blowup(t, y, args):
    return y**2  # y(0) = y0 > 0 is singular at t = 1 / y0


def test_vmap_failure_names_the_member():
    run = jax.jit(jax.vmap(lambda y: og.solve(blowup, y, (0.0, 2.0)).ys))
    with pytest.raises(Exception, match=r"failed at t=1\b.*batch member 2 of a batch of \(4,\)"):
        jax.block_until_ready(run(jnp.array([0.1, 0.2, 1.0, 0.3])))
    ok = run(jnp.array([0.1, 0.2, 0.3]))
    np.testing.assert_allclose(ok[:, -1], [0.1 / 0.8, 0.2 / 0.6, 0.3 / 0.4], rtol=1e-5)


def test_failure_raises_under_grad():
    """Under jax.grad the primal outputs are dead code; the check still runs."""
    grad = jax.jit(jax.grad(lambda y: og.solve(blowup, y, (0.0, 2.0)).ys.sum()))
    with pytest.raises(Exception, match=r"failed at t=1\b"):
        jax.block_until_ready(grad(jnp.asarray(1.0)))
    # d y(2) / d y0 = 1 / (1 - 2 y0)^2, to the default tolerance (1e-6)
    assert float(grad(jnp.asarray(0.25))) == pytest.approx(1 / (1 - 0.5) ** 2, rel=1e-4)


def test_throw_adds_no_effect_to_the_program():
    """throw=True leaves no effect (host callback with side effects) in the program, so a jitted
    solve keeps JAX's fast dispatch path, also under vmap."""
    solve = lambda y: og.solve(_decay, y, (0.0, 2.0), 1.0, saveat=og.SaveAt(ts=TS)).ys
    for fn in (solve, jax.vmap(solve)):
        jaxpr = jax.make_jaxpr(fn)(Y0S if fn is not solve else Y0S[0])
        assert not jaxpr.effects
        assert "debug_callback" not in str(jaxpr)


def _problem(batch_fn=None, **kw):
    problem, _ = _build_problem(
        _decay, Y0S[0], (0.0, 2.0), 1.0, None, TOL, None, og.Auto(), kw.get("max_steps", 4096)
    )
    return problem


def test_explain_and_run_share_the_policy():
    """explain_adjoint's text and the checkpoints Discrete runs with come from one policy:
    a budget change moves both."""
    assert "Discrete(checkpoints='all')" in og.explain_adjoint(
        _decay, Y0S[0], (0.0, 2.0), 1.0, step=TOL, adjoint=og.Auto(forward_max_inputs=0)
    )
    assert og.Discrete().resolve(_problem()) == "all"
    with tuned(adaptive_all_bytes=0, adaptive_slots=7):
        text = og.explain_adjoint(
            _decay, Y0S[0], (0.0, 2.0), 1.0, step=TOL, adjoint=og.Auto(forward_max_inputs=0)
        )
        assert "Discrete(checkpoints=7)" in text and "first 7 states" in text
        assert og.Discrete().resolve(_problem()) == 7


def test_explain_counts_a_python_float_in_args():
    """Under jax.grad a Python float in args is a traced parameter: explain_adjoint counts it
    (it said 0 parameters, and Forward for 32 state entries, where grad ran Discrete)."""
    y0 = jnp.ones(32)
    text = og.explain_adjoint(_decay, y0, (0.0, 2.0), 0.5)
    assert text == og.explain_adjoint(_decay, y0, (0.0, 2.0), jnp.asarray(0.5))
    assert "1 differentiable parameters" in text and text.startswith("Auto chose Discrete")
    assert og.explain_adjoint(_decay, y0[:31], (0.0, 2.0), 0.5).startswith("Auto chose Forward")


def test_budget_counts_the_batch():
    """The same solve keeps every step alone, but checkpoints when vmapped over 4096 members
    (whose max_steps buffers would exceed the budget together)."""
    texts = []

    def member(y0):
        texts.append(
            og.explain_adjoint(
                _decay, y0, (0.0, 2.0), 1.0, step=TOL, adjoint=og.Auto(forward_max_inputs=0)
            )
        )
        return y0

    member(Y0S[0])
    jax.vmap(member)(jnp.ones((4096, 2)))
    assert "checkpoints='all'" in texts[0]
    assert "checkpoints=64" in texts[1] and "x4096 batch members" in texts[1]


def test_batched_training_memory_counts_the_batch():
    """Compiled temporary memory of a vmapped default gradient: the budget is for the batch, so
    it grows far slower than the batch once the members' buffers would exceed it."""

    def temp(b):
        y0s = jnp.ones((b, 2)) * jnp.linspace(0.5, 1.5, b)[:, None]

        def loss(k):
            sol = jax.vmap(
                lambda y: og.solve(
                    _decay,
                    y,
                    (0.0, 2.0),
                    k,
                    saveat=og.SaveAt(ts=TS),
                    step=TOL,
                    adjoint=og.Discrete(),
                )
            )(y0s)
            return jnp.sum(sol.ys**2)

        return jax.jit(jax.grad(loss)).lower(1.0).compile().memory_analysis().temp_size_in_bytes

    small, big = temp(8), temp(1024)
    # at 8 members every step is kept (1.5 MiB); kept at 1024 members too, it would grow 128x
    # (192 MiB); with the batch counted, 64 checkpoints and the step times take 65.5 MiB
    assert big < 0.5 * (1024 / 8) * small, f"{small / 2**20:.2f} -> {big / 2**20:.1f} MiB"


def test_throw_costs_no_memory_under_vmap():
    """The untaken failure branch of ``throw=True`` holds nothing per member: args the batch
    shares (a 64 x 64 weight) reached its host callback broadcast to every member (the
    width-256 MLP's train step at vmap 256: 141 MiB of temporary memory against 81 MiB)."""
    weight = 0.1 * jnp.eye(64)
    y0s = jnp.ones((128, 64)) * jnp.linspace(0.5, 1.5, 128)[:, None]
    f = lambda t, y, w: -jnp.tanh(w @ y)

    def temp(throw):
        def loss(w):
            solve = lambda y: og.solve(f, y, (0.0, 1.0), w, step=og.Fixed(0.25), throw=throw)
            return jnp.sum(jax.vmap(solve)(y0s).ys ** 2)

        compiled = jax.jit(jax.grad(loss)).lower(weight).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    checked, unchecked = temp(True), temp(False)
    # broadcast, the weight alone would take 128 x 16 KiB = 2 MiB more
    assert checked <= unchecked + 2**16, f"{checked / 2**20:.2f} / {unchecked / 2**20:.2f} MiB"
