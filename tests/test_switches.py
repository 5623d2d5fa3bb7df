"""og.switching_events: events on the surfaces where f switches branch, read from f itself."""

import warnings
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odegrad as og
from test_kinks import ADJOINTS  # the six adjoints, by name

jax.config.update("jax_enable_x64", True)


def _switchy(t, y, a):
    return (
        jnp.where(y > 1.0, jax.nn.relu(y), jnp.sign(y))
        + jnp.floor(t)
        + jnp.clip(y, 0.0, 1.0)
        + jnp.where(y < 1.0, 2.0, 0.0)  # the surface y = 1 again: no second event
    )


def test_finds_each_surface_once():
    """``y > 1`` (twice, once as ``y < 1``), ``sign(y)`` and ``floor(t)`` on a 2-vector give
    five entries, ``g = y - 1``, ``y`` and ``sin(pi t)``; with ``kinks=True`` relu's and clip's
    surfaces join (relu's ``y = 0`` is sign's)."""
    t, y = 0.3, jnp.array([0.5, 2.0])
    events = og.switching_events(_switchy, 0.0, jnp.ones(2), None)
    assert [repr(e.cond).split(" at ")[0] for e in events] == [
        "switching surface gt", "switching surface gt", "switching surface sign",
        "switching surface sign", "switching surface floor",
    ]  # fmt: skip
    assert all(e.terminal is False and e.update is None and e.direction == 0 for e in events)
    assert "test_switches.py" in repr(events[0].cond)
    got = [float(e.cond(t, y, None)) for e in events]
    np.testing.assert_allclose(got, [-0.5, 1.0, 0.5, 2.0, np.sin(np.pi * t)], rtol=1e-15)

    with_kinks = og.switching_events(_switchy, 0.0, jnp.ones(2), None, kinks=True)
    got = [float(e.cond(t, y, None)) for e in with_kinks]
    want = [-0.5, 1.0, 0.5, 2.0, np.sin(np.pi * t), -0.5, -2.0, 0.5, -1.0]  # clip: 0 - y, 1 - y
    np.testing.assert_allclose(got, want, rtol=1e-15)
    assert "relu" in repr(with_kinks[2].cond) and "clip" in repr(with_kinks[5].cond)


def test_what_gives_no_event():
    """A switch on parameters only, equality guards, a Newton loop's test and smooth networks
    give none; a relu network's kinks count only with ``kinks=True``, and more entries than
    ``max_surfaces`` are refused with the count and the fix."""

    def f(t, y, p):
        gain = jnp.where(p["g"] > 0, p["g"], 0.0)  # parameters only: never switches in a solve
        safe = jnp.where(y == 0.0, 1.0, y)  # a guard
        root = jax.lax.while_loop(lambda x: jnp.abs(x * x - safe) > 1e-12,
                                  lambda x: 0.5 * (x + safe / x), safe + 1.0)  # fmt: skip
        return -gain * root

    assert og.switching_events(f, 0.0, 2.0, {"g": 1.0}) == ()
    key = jax.random.PRNGKey(0)
    smooth = eqx.nn.MLP(2, 2, 8, 2, activation=jax.nn.softplus, key=key)
    field = lambda t, y, m: m(y)
    assert og.switching_events(field, 0.0, jnp.ones(2), smooth) == ()
    relu = eqx.nn.MLP(2, 2, 8, 2, activation=jax.nn.relu, key=key)
    assert og.switching_events(field, 0.0, jnp.ones(2), relu) == ()
    with pytest.raises(ValueError, match=r"16 surface entries .*relu.*max_surfaces=10"):
        og.switching_events(field, 0.0, jnp.ones(2), relu, kinks=True, max_surfaces=10)
    assert len(og.switching_events(field, 0.0, jnp.ones(2), relu, kinks=True)) == 16


def test_argmax_is_reported_not_dropped():
    f = lambda t, y, a: y * jnp.argmax(y)
    with pytest.warns(UserWarning, match="argmax .*no event describes"):
        assert og.switching_events(f, 0.0, jnp.ones(3), None) == ()


def _infusion(t, y, p):
    """A one-compartment model: elimination ``k y`` and an infusion at ``rate`` until ``tau``."""
    return -p["k"] * y + jnp.where(t < p["tau"], p["rate"], 0.0)


def _infusion_exact(p, big_t):
    k, rate, tau = p["k"], p["rate"], p["tau"]
    return rate / k * (1 - jnp.exp(-k * tau)) * jnp.exp(-k * (big_t - tau))


@pytest.mark.parametrize(
    "adjoint",
    [
        pytest.param(a, id=k, marks=[pytest.mark.slow] if k in ("backsolve", "quadrature") else [])
        for k, a in ADJOINTS.items()
    ],
)  # Backsolve, Quadrature: Interpolating's event mechanism (all six: test_kinks.py)
def test_infusion_stop_time(adjoint):
    """``dy(T)/dtau = rate exp(-k (T - tau))`` comes only from the crossing (pointwise,
    ``d f/d tau = 0``: without the event every adjoint gives 0). Vmapped over three stop times,
    ``args`` a dict with a string beside the floats, all derivatives against the closed form."""
    big_t = 3.0
    p = {"k": 0.7, "rate": 2.0, "tau": 1.2, "unit": "mg/h"}
    events = og.switching_events(_infusion, 0.0, 0.0, p)
    assert len(events) == 1

    def y_end(tau, events=events):
        q = dict(p, tau=tau)
        return og.solve(_infusion, 0.0, (0.0, big_t), q, adjoint=adjoint, events=events,
                        step=og.Adaptive(rtol=1e-8, atol=1e-8)).ys[-1]  # fmt: skip

    taus = jnp.array([0.5, 1.2, 2.0])
    got = jax.jit(jax.vmap(jax.grad(y_end)))(taus)
    want = [jax.grad(lambda s: _infusion_exact(dict(p, tau=s), big_t))(s) for s in taus]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if isinstance(adjoint, og.Auto):
        blind = jax.jit(jax.grad(partial(y_end, events=None)))(1.2)
        assert float(blind) == 0.0


def _jump_up(t, y, p):
    return jnp.where(y < 1.0, p[0], p[1])


def test_value_jump_found_in_f():
    """``tests/test_kinks.py::test_value_jump_with_an_event`` (every adjoint, the event written
    by hand) with the event read from ``f``: ``dy(T)/dy0 = b / a`` and
    ``dy(T)/d(a, b) = (b (1 - y0) / a^2, T - tau)``."""
    events = og.switching_events(_jump_up, 0.0, 0.0, jnp.ones(2))
    adjoint = og.Auto()

    def y_end(y0, p):
        step = og.Adaptive(rtol=1e-8, atol=1e-8)
        return og.solve(_jump_up, y0, (0.0, 2.0), p, step=step, adjoint=adjoint, events=events)

    grad = jax.grad(lambda y0, p: y_end(y0, p).ys[-1], argnums=(0, 1))
    (a, b), y0 = (2.0, 1.0), -1.0
    d_y0, d_p = jax.jit(grad)(y0, jnp.array([a, b]))
    tau = (1.0 - y0) / a
    np.testing.assert_allclose(d_y0, b / a, rtol=1e-8)
    np.testing.assert_allclose(d_p, [b * (1.0 - y0) / a**2, 2.0 - tau], rtol=1e-6)


@pytest.mark.slow  # ~10 s: four compiled solves; the infusion's closed form runs by default
def test_sign_switched_system_against_finite_differences():
    """Three states switched by ``sign(y0 + y1/2 - 0.2)``, which the solution crosses three
    times: ``Auto`` with the found event gives the hand-written event's gradient, and central
    differences (at rtol 1e-12, h = 1e-4: their noise is ~1e-6); without the event it reads
    -3.21 for 1.82."""

    def f(t, y, p):
        s = jnp.sign(y[0] + 0.5 * y[1] - 0.2)
        return jnp.stack([y[1], -p["w"] * y[0] - p["c"] * y[1] + p["u"] * s, -y[2] + s])

    p = {"w": 4.0, "c": 0.3, "u": 0.8}
    y0 = jnp.array([1.0, 0.0, 0.0])
    events = og.switching_events(f, 0.0, y0, p)
    assert len(events) == 1
    by_hand = og.Event(lambda t, y, p: y[0] + 0.5 * y[1] - 0.2, terminal=False)
    saves = og.SaveAt(ts=jnp.linspace(0.0, 5.0, 6))

    def loss(w, events=events):
        sol = og.solve(f, y0, (0.0, 5.0), dict(p, w=w), events=events, saveat=saves,
                       step=og.Adaptive(rtol=1e-12, atol=1e-12))  # fmt: skip
        return jnp.sum(sol.ys**2)

    value = jax.jit(loss)
    h = 1e-4
    fd = (value(4.0 + h) - value(4.0 - h)) / (2 * h)
    assert int(og.solve(f, y0, (0.0, 5.0), p, events=events).events.count) == 3
    grad = jax.jit(jax.grad(loss))(4.0)
    np.testing.assert_allclose(grad, jax.jit(jax.grad(partial(loss, events=by_hand)))(4.0),
                               rtol=1e-13)  # fmt: skip
    np.testing.assert_allclose(grad, fd, rtol=2e-6)
    blind = jax.jit(jax.grad(partial(loss, events=None)))(4.0)
    assert abs(blind - fd) > 0.5 * abs(fd)


def test_float32():
    """The infusion's ``dy/dtau`` in float32, under ``jax.jit`` with the events built inside."""
    p = {"k": jnp.float32(0.7), "rate": jnp.float32(2.0), "tau": jnp.float32(1.2)}

    @jax.jit
    def grad_tau(p):
        events = og.switching_events(_infusion, jnp.float32(0), jnp.float32(0), p)
        loss = lambda p: og.solve(_infusion, jnp.float32(0), (0.0, 3.0), p, events=events).ys[-1]
        return jax.grad(loss)(p)["tau"]

    with jax.enable_x64(False):
        got = grad_tau(p)
        assert got.dtype == jnp.float32
    want = 2.0 * np.exp(-0.7 * (3.0 - 1.2))
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_bad_arguments():
    with pytest.raises(TypeError, match="f must be callable"):
        og.switching_events(None, 0.0, 0.0)
    with pytest.raises(ValueError, match="max_surfaces=0"):
        og.switching_events(_jump_up, 0.0, 0.0, jnp.ones(2), max_surfaces=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        og.switching_events(_jump_up, 0.0, 0.0, jnp.ones(2))
