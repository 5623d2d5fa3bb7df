"""Complex states (Schrödinger equations): solved by the explicit and partitioned solvers,
differentiated by ``og.Discrete`` (``og.Auto()`` picks it), refused clearly elsewhere.

References: the matrix exponential of a time-independent Hamiltonian (``psi(t) = expm(-i H t)
psi0``, differentiated by JAX itself), and central finite differences along the real and the
imaginary direction of each entry for a non-holomorphic right-hand side (a ``|psi|^2 psi``
term). For a real loss of a complex input JAX's gradient is ``dL/dx - i dL/dy``.
"""

from __future__ import annotations

import functools

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import odegrad as og  # noqa: E402

H0 = jnp.array([[1.0, 0.3, 0.0], [0.3, -0.5, 0.2], [0.0, 0.2, 0.1]], complex)
V = jnp.array([[0, 1, 0], [1, 0, -1j], [0, 1j, 0]], complex)  # Hermitian
PSI0 = jnp.array([1.0, 0.5j, -0.2], complex) / 1.2
TARGET = jnp.array([0.0, 1.0, 0.0], complex)
TS = jnp.linspace(0.0, 2.0, 5)
TIGHT = og.Adaptive(rtol=1e-11, atol=1e-11)


def schroedinger(t, psi, theta):
    return -1j * ((H0 + theta * V) @ psi)


def fidelities(ys):
    return jnp.sum(jnp.abs(ys @ TARGET.conj()) ** 2 * jnp.arange(1.0, 1.0 + ys.shape[0]))


@functools.cache
def linear_grad(step_name: str):
    step = TIGHT if step_name == "adaptive" else og.Fixed(0.002)
    adjoint = og.Auto() if step_name == "adaptive" else og.Discrete()

    def loss(theta, psi0):
        sol = og.solve(schroedinger, psi0, (0.0, 2.0), theta, step=step,
                       saveat=og.SaveAt(ts=TS), adjoint=adjoint)  # fmt: skip
        return fidelities(sol.ys)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def exact_loss(theta, psi0):
    h = H0 + theta * V
    return fidelities(jax.vmap(lambda t: jax.scipy.linalg.expm(-1j * h * t) @ psi0)(TS))


@pytest.mark.parametrize("step_name", ["adaptive", "fixed"])
def test_schroedinger_gradient_matches_matrix_exponential(step_name):
    theta = jnp.asarray(0.7)
    got = linear_grad(step_name)(theta, PSI0)
    want = jax.grad(exact_loss, argnums=(0, 1))(theta, PSI0)
    rtol = 1e-8 if step_name == "adaptive" else 1e-6  # RK4 at dt = 0.002: error ~ dt^4
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)
    np.testing.assert_allclose(got[1], want[1], rtol=rtol, atol=rtol)
    assert got[1].dtype == jnp.complex128 and got[0].dtype == jnp.float64


def gross_pitaevskii(t, psi, g):
    return -1j * (H0 @ psi + g * jnp.abs(psi) ** 2 * psi)


def test_non_holomorphic_rhs_against_finite_differences():
    def loss(g, psi0):
        sol = og.solve(gross_pitaevskii, psi0, (0.0, 2.0), g, step=TIGHT)
        return jnp.sum(jnp.abs(sol.ys[-1] - TARGET) ** 2)

    loss_jit = jax.jit(loss)
    g_g, g_psi = jax.jit(jax.grad(loss, argnums=(0, 1)))(0.8, PSI0)
    eps = 1e-6

    def fd(d_g, d_psi):
        plus, minus = loss_jit(0.8 + d_g, PSI0 + d_psi), loss_jit(0.8 - d_g, PSI0 - d_psi)
        return (plus - minus) / (2 * eps)

    np.testing.assert_allclose(g_g, fd(eps, 0.0), rtol=1e-6)
    unit = np.eye(3)
    d_re = np.array([fd(0.0, eps * unit[i]) for i in range(3)])
    d_im = np.array([fd(0.0, 1j * eps * unit[i]) for i in range(3)])
    np.testing.assert_allclose(g_psi.real, d_re, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(g_psi.imag, -d_im, rtol=1e-6, atol=1e-8)  # JAX: dL/dx - i dL/dy


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_vmap_and_events_with_complex_state():
    grad_g = jax.grad(
        lambda g, psi0: jnp.sum(jnp.abs(og.solve(gross_pitaevskii, psi0, (0.0, 1.0), g).ys) ** 2)
    )
    batch = jnp.stack([PSI0, 1j * PSI0])
    got = jax.vmap(lambda p: grad_g(0.8, p))(batch)
    # (each entry ~1e-6, a difference of O(1) terms: round-off of 4e-16 between programs)
    want = [grad_g(0.8, PSI0), grad_g(0.8, 1j * PSI0)]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    ev = og.Event(lambda t, y, a: jnp.real(y[0]) - 0.5)
    sol = og.solve(gross_pitaevskii, PSI0, (0.0, 2.0), 0.8, events=ev, step=TIGHT)
    assert abs(float(jnp.real(sol.ys[-1, 0])) - 0.5) < 1e-8


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(solver=og.ROCK2()), "solver=ROCK2()"),
        (dict(solver=og.Kvaerno5()), "solver=Kvaerno5"),
        (dict(adjoint=og.Interpolating()), "adjoint=Interpolating"),
        (dict(adjoint=og.Forward()), "adjoint=Forward"),
    ],
)
def test_unsupported_complex_combinations_are_named(kw, fragment):
    with pytest.raises(TypeError, match="y0 is complex") as info:
        og.solve(gross_pitaevskii, PSI0, (0.0, 1.0), 0.8, **kw)
    assert fragment in str(info.value) and "psi.real, psi.imag" in str(info.value)


def test_auto_explains_the_complex_choice():
    text = og.explain_adjoint(gross_pitaevskii, PSI0, (0.0, 1.0), jnp.asarray(0.8))
    assert text.startswith("Auto chose Discrete") and "the state is complex" in text


def test_time_derivative_with_complex_state():
    """d/dt1 pairs the cotangent with f without a conjugate (Re sum(c f)): jnp.vdot gave a wrong
    value for a complex state. Against central differences and forward mode."""

    def loss(t1):
        y = og.solve(gross_pitaevskii, PSI0, (0.0, t1), 0.8, step=TIGHT).ys[-1]
        return jnp.sum(jnp.real(y)) + 2.0 * jnp.sum(jnp.imag(y))

    eps = 1e-5
    fd = (loss(1.0 + eps) - loss(1.0 - eps)) / (2 * eps)
    np.testing.assert_allclose(jax.grad(loss)(1.0), fd, rtol=1e-7)
    np.testing.assert_allclose(jax.jvp(loss, (1.0,), (1.0,))[1], fd, rtol=1e-7)
