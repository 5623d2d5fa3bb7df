"""Gradients through ``sol.evaluate`` (the dense output).

Only ``og.Discrete`` differentiates the dense output; ``og.Auto()`` picks it when
``SaveAt(dense=True)``, and every other adjoint raises at trace time where a gradient reaches
``sol.evaluate`` (it used to count it as zero: a silently wrong gradient), while a loss of
``sol.ys`` alone still works with them. Reference: the matrix exponential.
"""

from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import odegrad as og  # noqa: E402

A0 = jnp.array([[-0.5, 1.0], [-1.0, -0.2]])
Y0 = jnp.array([1.0, 0.5])


def linear(t, y, k):
    return (A0 * k) @ y


def loss(k, adjoint, through_evaluate):
    sol = og.solve(linear, Y0, (0.0, 2.0), k, saveat=og.SaveAt(dense=True, t1=True),
                   step=og.Adaptive(rtol=1e-12, atol=1e-12), adjoint=adjoint)  # fmt: skip
    if through_evaluate:
        return jnp.sum(sol.evaluate(jnp.array([0.4, 1.37])) ** 2)
    return jnp.sum(sol.ys**2)


def exact(k, through_evaluate):
    ts = jnp.array([0.4, 1.37]) if through_evaluate else jnp.array([2.0])
    return sum(jnp.sum((jax.scipy.linalg.expm(A0 * k * t) @ Y0) ** 2) for t in ts)


@pytest.mark.parametrize("adjoint", [og.Auto(), og.Discrete()], ids=["Auto", "Discrete"])
def test_evaluate_differentiated(adjoint):
    got = jax.jit(jax.grad(loss), static_argnums=(1, 2))(1.2, adjoint, True)
    np.testing.assert_allclose(got, jax.grad(exact)(1.2, True), rtol=1e-9)


@pytest.mark.parametrize(
    "adjoint",
    [
        pytest.param(og.Forward(), marks=pytest.mark.slow),  # (the refusal is shared: 16 s)
        og.Interpolating(),
        pytest.param(og.Backsolve(), marks=pytest.mark.slow),
    ],
    ids=["Forward", "Interpolating", "Backsolve"],
)
def test_other_adjoints_refuse_evaluate_but_differentiate_ys(adjoint):
    grad = jax.jit(jax.grad(loss), static_argnums=(1, 2))
    with pytest.raises(ValueError, match="does not differentiate the dense output"):
        grad(1.2, adjoint, True)
    got = grad(1.2, adjoint, False)
    np.testing.assert_allclose(got, jax.grad(exact)(1.2, False), rtol=1e-8)


def test_auto_explains_dense_choice():
    text = og.explain_adjoint(linear, Y0, (0.0, 2.0), jnp.asarray(1.2),
                              saveat=og.SaveAt(dense=True))  # fmt: skip
    assert text.startswith("Auto chose Discrete") and "sol.evaluate" in text, text
