"""``progress=True``: tqdm bars on stderr for the forward solve and the reverse pass, gradients
unchanged, and few trips to the host."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odegrad as og
from odegrad import _progress

pytest.importorskip("tqdm")

TS = jnp.linspace(0.0, 1.0, 7)


def _decay(t, y, a):
    return -a * y + jnp.sin(t)


def _loss(step, adjoint, progress):
    def loss(a):
        sol = og.solve(
            _decay,
            jnp.ones(3),
            (0.0, 1.0),
            a,
            solver=og.Tsit5(),
            step=step,
            saveat=og.SaveAt(ts=TS),
            adjoint=adjoint,
            progress=progress,
        )
        return jnp.sum(sol.ys**2)

    return loss


CASES = [
    (og.Fixed(1e-3), og.Auto(), True),  # chunked scan, JAX's own reverse of the scan
    (og.Fixed(1e-3), og.Discrete(4), True),  # custom reverse sweep
    (og.Adaptive(rtol=1e-8, atol=1e-8), og.Discrete(), True),
    (og.Adaptive(rtol=1e-8, atol=1e-8), og.Interpolating(), True),
    (og.Adaptive(rtol=1e-8, atol=1e-8), og.Forward(), False),  # no backward pass to show
]


@pytest.mark.parametrize("step, adjoint, reverse_bar", CASES, ids=lambda x: repr(x)[:24])
def test_bars_inside_grad_and_gradient_unchanged(step, adjoint, reverse_bar, capsys):
    with_bar, without = jax.jit(  # both from one compiled program
        lambda a: (
            jax.grad(_loss(step, adjoint, True))(a),
            jax.grad(_loss(step, adjoint, False))(a),
        )
    )(2.0)
    err = capsys.readouterr().err
    assert "og.solve:" in err and "100%" in err
    assert ("og.solve reverse" in err) == reverse_bar
    np.testing.assert_allclose(with_bar, without, rtol=1e-12)


@pytest.mark.slow
def test_vmap_of_grad_with_progress(capsys):
    for step in (og.Fixed(1e-3), og.Adaptive(rtol=1e-8, atol=1e-8)):
        batched = jax.vmap(jax.grad(_loss(step, og.Auto(), True)))(jnp.array([1.0, 2.0]))
        single = jax.grad(_loss(step, og.Auto(), False))(2.0)
        np.testing.assert_allclose(batched[1], single, rtol=1e-12)
    assert "og.solve:" in capsys.readouterr().err


def test_fast_repeated_solve_reports_only_at_start_and_end(monkeypatch, capsys):
    """A jitted solve called again reuses its bar and, knowing its speed, reports only twice
    forward and once in reverse (the throttle that keeps the overhead small)."""
    calls = []
    update = _progress._update
    monkeypatch.setattr(_progress, "_update", lambda *a: (calls.append(a[2]), update(*a)))
    grad = jax.jit(jax.grad(_loss(og.Fixed(4e-4), og.Auto(), True)))
    grad(2.0).block_until_ready()  # first run: measures its speed
    calls.clear()
    runs = 5
    for _ in range(runs):
        grad(2.0).block_until_ready()
    assert len(calls) <= 3 * runs, calls
    assert calls.count(100) == 2 * runs  # each run ends both bars
    capsys.readouterr()
