"""The CVODES references for kinked right-hand sides (:mod:`tests.kink_references`).

Checked: every form of each right-hand side agrees (the JAX ones odegrad integrates, the CasADi
one CVODES integrates, the NumPy sign-fixed pieces); the crossings are where expected; the
gradients agree between CVODES's forward and adjoint modes and with five-point differences of the
piecewise CVODES solve itself.
"""

from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

try:  # tests/ on sys.path
    import kink_references as kr
    from reference_problems import NUMPY
except ImportError:  # tests imported as a package
    from tests import kink_references as kr
    from tests.reference_problems import NUMPY

slow = pytest.mark.slow


def five_point(fn, h: float) -> float:
    """``fn'(0)`` with error O(h^4): at ``h = 1e-4`` both losses here agree with the CVODES
    gradients to 2e-9 (plain central differences: 1e-5 off, from large third derivatives)."""
    return (fn(-2 * h) - 8 * fn(-h) + 8 * fn(h) - fn(2 * h)) / (12 * h)


def rel_err(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def _relu_flat_grads(grads) -> np.ndarray:
    return np.concatenate([grads[k].ravel() for k in ("W1", "b1", "W2", "b2", "y0")])


def test_seed000_rhs_forms_agree():
    z = kr.seed000_z()
    prob = kr.seed000_problem(z)
    f_ca = prob.numpy_rhs()
    rng = np.random.default_rng(0)
    for _ in range(3):
        y = np.r_[0.3, rng.uniform(0.1, 1.0, kr.SEED_M)]
        want = np.asarray(kr.seed000_f_flat(0.0, jnp.asarray(y), jnp.asarray(z)))
        dc, da = kr.seed000_f_tree(0.0, (jnp.asarray(y[0]), jnp.asarray(y[1:])), jnp.asarray(z))
        signs = np.sign(kr.SEED000.switch(y, z.ravel()))
        piece = kr.SEED000.make_rhs(signs)(0.0, y, z.ravel(), NUMPY)
        for got in (f_ca(0.0, y, z.ravel()), np.r_[dc, da], piece):
            np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)


def test_relu_mlp_rhs_forms_agree():
    params = kr.relu_mlp_params()
    prob = kr.relu_mlp_problem(params)
    f_ca = prob.numpy_rhs()
    jparams = {k: jnp.asarray(v) for k, v in params.items()}
    rng = np.random.default_rng(0)
    for _ in range(5):
        y = 2.0 * rng.standard_normal(2)
        want = np.asarray(kr.relu_mlp_f(0.0, jnp.asarray(y), jparams))
        signs = np.sign(kr.RELU_MLP.switch(y, prob.params))
        piece = kr.RELU_MLP.make_rhs(signs)(0.0, y, prob.params, NUMPY)
        for got in (f_ca(0.0, y, prob.params), piece):
            np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)


def test_kink_counts():
    seed = kr.kink_times(kr.SEED000, np.r_[0.0, np.ones(kr.SEED_M)], kr.seed000_z().ravel())
    assert [j for _, j in seed] == [23, 3, 20, 17, 0]
    relu = kr.kink_times(kr.RELU_MLP, kr.RELU_Y0, kr.relu_mlp_problem().params)
    assert [j for _, j in relu] == [0, 11, 7, 2, 5, 6]


def test_relu_mlp_forward_adjoint_and_finite_differences():
    params = kr.relu_mlp_params()
    v_f, g_f = kr.relu_mlp_cvodes_gradient(params)
    v_a, g_a = kr.relu_mlp_cvodes_gradient(params, mode="adjoint")
    assert v_f == pytest.approx(v_a, rel=1e-14)
    assert rel_err(_relu_flat_grads(g_a), _relu_flat_grads(g_f)) < 1e-8
    assert set(g_f) == {"W1", "b1", "W2", "b2", "y0"}
    assert all(g_f[k].shape == np.shape(params[k]) for k in params)

    # a random direction through every weight and y0, across all six crossings
    rng = np.random.default_rng(3)
    d = {k: rng.standard_normal(np.shape(v)) for k, v in params.items()}
    d_y0 = rng.standard_normal(2)

    def loss(s):
        shifted = {k: params[k] + s * d[k] for k in params}
        prob = kr.relu_mlp_problem(shifted, kr.RELU_Y0 + s * d_y0)
        ys = kr.piecewise_solve(kr.RELU_MLP, prob.y0, prob.params, kr.RELU_TS)
        return float(np.sum(ys**2))

    dd = sum(float(np.sum(g_f[k] * d[k])) for k in params) + float(g_f["y0"] @ d_y0)
    assert dd == pytest.approx(five_point(loss, 1e-4), rel=2e-8)


@slow
def test_seed000_finite_differences():
    z = kr.seed000_z()
    value, g = kr.seed000_cvodes_gradient(z, -1)
    assert g.shape == (kr.SEED_N, kr.SEED_M)
    d = np.random.default_rng(5).standard_normal(z.shape)

    def loss(s):
        prob = kr.seed000_problem(z + s * d)
        return kr.piecewise_solve(kr.SEED000, prob.y0, prob.params, kr.SEED_TS)[-1, 0]

    assert loss(0.0) == pytest.approx(value, rel=1e-13)
    assert float(np.sum(g * d)) == pytest.approx(five_point(loss, 1e-4), rel=2e-8)


@slow
@pytest.mark.parametrize("index", [-1, 19])
def test_seed000_forward_and_adjoint_agree(index):
    z = kr.seed000_z()
    v_a, g_a = kr.seed000_cvodes_gradient(z, index, mode="adjoint")
    v_f, g_f = kr.seed000_cvodes_gradient(z, index, mode="forward")
    assert v_a == pytest.approx(v_f, rel=1e-14)
    assert rel_err(g_a, g_f) < 1e-8
