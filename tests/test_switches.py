"""og.switching_events: events on the surfaces where f switches branch, read from f itself."""

import warnings
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odegrad as og
from test_kinks import ADJOINTS, _switched_oscillator  # the six adjoints, by name

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
    five entries, ``g = y - 1``, ``y`` and ``r (1 - r) (2 - r)`` with ``r = rem(t, 2)`` (zero at
    the integers, where ``floor`` jumps); with ``kinks=True`` relu's and clip's
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
    at_integers = t * (1 - t) * (2 - t)  # (0 < t < 1)
    np.testing.assert_allclose(got, [-0.5, 1.0, 0.5, 2.0, at_integers], rtol=1e-15)

    with_kinks = og.switching_events(_switchy, 0.0, jnp.ones(2), None, kinks=True)
    got = [float(e.cond(t, y, None)) for e in with_kinks]
    want = [-0.5, 1.0, 0.5, 2.0, at_integers, -0.5, -2.0, 0.5, -1.0]  # clip: 0 - y, 1 - y
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


def test_held_branches_are_the_smooth_extensions():
    """Held at ``y = (0.5, -0.5, 0, 0)`` (``y0 > 0.1``, ``y1 < 0``), ``f`` evaluated across
    every surface keeps those branches: each ``where``, ``sign``, ``abs``, ``max`` (relu) and
    ``clip`` continues its piece linearly, ``floor`` keeps its level (1 at the start) and
    ``rem`` its count of periods (``x - 0.3 n``, ``n = 1`` at the start)."""
    from odegrad._switches import hold_switches

    def f(t, y, a):
        return jnp.stack([
            jnp.where(y[0] > 0.1, 1.0, -1.0) + jnp.where(0.1 >= y[0], 10.0, 0.0),
            jnp.sign(y[1]) + jnp.abs(y[1]),
            jax.nn.relu(y[0] - 0.1) + jnp.clip(y[1], -0.2, 0.2),
            jnp.floor(2.0 * y[0]) + y[0] % 0.3,
        ])  # fmt: skip

    start = jnp.array([0.5, -0.5, 0.0, 0.0])  # (f's output has the state's shape)
    held = hold_switches(f, True, 0.0, start, None)
    other_side = jnp.array([-0.3, 0.4, 0.0, 0.0])
    levels = 1.0 + (-0.3 - 0.3)  # floor(2 y0) = 1, rem(y0, 0.3) = y0 - 0.3 as at y0 = 0.5
    np.testing.assert_allclose(held(0.0, other_side, None), [1.0, -1.4, -0.6, levels], rtol=1e-12)
    np.testing.assert_allclose(f(0.0, other_side, None), [9.0, 1.4, 0.2, -1.0 - 0.0], atol=1e-12)
    # not holding the kinks: relu, abs and clip follow the point, the wheres and sign do not
    held = hold_switches(f, False, 0.0, start, None)
    np.testing.assert_allclose(held(0.0, other_side, None), [1.0, -0.6, 0.2, levels], rtol=1e-12)


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


# (Forward on the found events: test_switches_held_for_each_step)
_INFUSION_SLOW = ("interpolating", "backsolve", "quadrature", "forward")


@pytest.mark.parametrize(
    "adjoint",
    [
        pytest.param(a, id=k, marks=[pytest.mark.slow] if k in _INFUSION_SLOW else [])
        for k, a in ADJOINTS.items()
    ],
)  # Interpolating on switching events: test_switch_on_the_start_time (all six: -m slow)
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
    if isinstance(adjoint, og.Auto):  # without the event: 0, and a warning that says so
        with pytest.warns(RuntimeWarning, match="a differentiated value moves .*_infusion"):
            blind = jax.jit(jax.grad(partial(y_end, events=None)))(1.2)
        assert float(blind) == 0.0
        # an event that reads neither t nor tau cannot lie on the switch (it silenced the
        # warning: a silent 0); the found events and one on t - tau can (traced only: the
        # warnings are raised at trace time)
        elsewhere = og.Event(lambda t, y, p: y - 100.0, terminal=False)
        with pytest.warns(RuntimeWarning, match="a differentiated value moves .*_infusion"):
            jax.eval_shape(jax.grad(partial(y_end, events=elsewhere)), 1.2)
        by_hand = og.Event(lambda t, y, p: t - p["tau"], terminal=False)
        for covered in ((*events, elsewhere), (by_hand, elsewhere)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                jax.eval_shape(jax.grad(partial(y_end, events=covered)), 1.2)
            assert not [w for w in caught if "differentiated value moves" in str(w.message)]


_DOSES, _DOSE_T = 4, 7.0  # doses start at 0, P, 2P, 3P (P = 2.1) and last d


def _repeated_doses(kind):
    """A dose of ``rate`` for ``d`` every ``P`` (all fitted), written as users write it: with
    ``%``, or as windows ``j P < t < j P + d`` (the first on the start time itself)."""
    if kind == "remainder":
        dosing = lambda t, p: t % p["P"] < p["d"]
    else:
        dosing = lambda t, p: jnp.any(jnp.stack(
            [(t > j * p["P"]) & (t < j * p["P"] + p["d"]) for j in range(_DOSES)]))  # fmt: skip
    return lambda t, y, p: -p["k"] * y + jnp.where(dosing(t, p), p["rate"], 0.0)


def _repeated_doses_exact(p, y_end=None):
    """``y(T)`` from ``y(0) = 0``, or with ``y_end`` ``y(0)`` from ``y(T) = y_end``:
    ``e^{kt} y`` changes by ``rate / k (e^{k (jP + d)} - e^{k jP})`` over dose ``j``."""
    k, rate, d, period = p["k"], p["rate"], p["d"], p["P"]
    gain = sum(rate / k * (jnp.exp(k * (j * period + d)) - jnp.exp(k * j * period))
               for j in range(_DOSES))  # fmt: skip
    if y_end is None:
        return jnp.exp(-k * _DOSE_T) * gain
    return jnp.exp(k * _DOSE_T) * y_end - gain


_DOSE_P = {"k": 0.7, "rate": 2.0, "d": 0.5, "P": 2.1}


@pytest.mark.parametrize(
    "kind,adjoint",
    [
        ("remainder", "auto"),
        *[
            pytest.param("remainder", a, marks=pytest.mark.slow)
            for a in ("discrete", "interpolating", "quadrature", "backsolve")
        ],
        *[
            pytest.param("windows", a, marks=pytest.mark.slow)
            for a in ("auto", "interpolating", "quadrature", "backsolve")
        ],
    ],
)  # fmt: skip  (the start-time surface runs by default in test_switch_on_the_start_time)
def test_repeated_doses(kind, adjoint):
    """Doses every ``P`` with ``t % P < d``: the events are ``rem``'s jumps at ``j P`` (its
    surface is exactly zero where it jumps, so the relation ``rem - d``, which changes sign
    there by a jump, is not taken for a crossing) and ``t = j P + d``; ``dy(T)/d(k, rate, d,
    P)`` against the closed form for every adjoint. Before, the relation fired at ``t = P``,
    restarted as if it sat on its surface and fired again until ``max_events``. Written as
    windows, the first surface ``t > 0`` lies on the start time, where ``f`` itself is off
    the dose the solution takes: the continuous adjoints hold each interval's switches as
    the forward steps did (``Interpolating`` was 1e-3 off in ``dy/drate``)."""
    f = _repeated_doses(kind)
    events = og.switching_events(f, 0.0, 0.0, _DOSE_P)

    def y_end(p):
        sol = og.solve(f, 0.0, (0.0, _DOSE_T), p, events=events, adjoint=ADJOINTS[adjoint],
                       max_events=16, step=og.Adaptive(rtol=1e-9, atol=1e-9))  # fmt: skip
        return sol.ys[-1], sol.events

    (value, log), grad = jax.jit(jax.value_and_grad(y_end, has_aux=True))(_DOSE_P)
    starts, ends = 2.1 * np.arange(1, 4), 2.1 * np.arange(4) + 0.5
    np.testing.assert_allclose(np.sort(log.ts[: int(log.count)]),
                               np.sort(np.concatenate([starts, ends])), rtol=1e-12)  # fmt: skip
    np.testing.assert_allclose(value, _repeated_doses_exact(_DOSE_P), rtol=1e-9)
    want = jax.grad(_repeated_doses_exact)(_DOSE_P)
    for k in _DOSE_P:
        np.testing.assert_allclose(grad[k], want[k], rtol=1e-7, atol=1e-9, err_msg=k)


@pytest.mark.parametrize(
    "adjoint", ["discrete", pytest.param("interpolating", marks=pytest.mark.slow)]
)
def test_repeated_doses_backward_in_time(adjoint):
    """From ``y(T)`` back to ``y(0)``: each step holds the side the solve moves into, in its
    own direction (the side of increasing time took 165 steps with 61 rejected, each restart
    holding the branch it had just left; now 76 and none), and the gradients match the
    closed form."""
    f = _repeated_doses("remainder")
    events = og.switching_events(f, 0.0, 0.0, _DOSE_P)
    step = og.Adaptive(rtol=1e-9, atol=1e-9)
    solve = lambda p, adjoint: og.solve(
        f, 1.0, (_DOSE_T, 0.0), p, events=events, adjoint=adjoint, max_events=16, step=step
    )

    def y_start(p):
        sol = solve(p, ADJOINTS[adjoint])
        return sol.ys[-1], sol

    (value, sol), grad = jax.jit(jax.value_and_grad(y_start, has_aux=True))(_DOSE_P)
    # the 7 crossings, and the dose that starts on the end time t = 0
    np.testing.assert_allclose(sol.events.ts[:8], [6.8, 6.3, 4.7, 4.2, 2.6, 2.1, 0.5, 0.0])
    assert int(sol.stats["rejected"]) <= 2 and int(sol.events.count) == 8
    np.testing.assert_allclose(value, _repeated_doses_exact(_DOSE_P, 1.0), rtol=1e-8)
    want = jax.grad(lambda p: _repeated_doses_exact(p, 1.0))(_DOSE_P)
    for k in _DOSE_P:
        np.testing.assert_allclose(grad[k], want[k], rtol=1e-7, err_msg=k)


def test_switch_on_the_start_time():
    """The infusion written ``0 < t < tau``: the surface ``t = 0`` lies on the start time,
    where ``f`` itself is off the dose the solution takes (``t > 0`` is false there).
    ``Interpolating`` holds each interval's switches as the forward steps did, so its last
    backward stage, on ``t0``, reads the dose (it was 1e-3 off in ``dy/drate`` on the
    repeated doses, 0.2 here)."""
    f = lambda t, y, p: -p["k"] * y + jnp.where((t > 0) & (t < p["tau"]), p["rate"], 0.0)
    p = {"k": 0.7, "rate": 2.0, "tau": 1.2}
    events = og.switching_events(f, 0.0, 0.0, p)
    assert len(events) == 2
    y_end = lambda p: og.solve(f, 0.0, (0.0, 3.0), p, events=events, adjoint=og.Interpolating(),
                               step=og.Adaptive(rtol=1e-9, atol=1e-9)).ys[-1]  # fmt: skip
    got, want = jax.jit(jax.grad(y_end))(p), jax.grad(lambda q: _infusion_exact(q, 3.0))(p)
    for k in p:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-7, err_msg=k)


def test_event_whose_cond_jumps_through_zero():
    """A hand-written ``og.Event`` on ``t % P - d`` changes sign at ``t = j P + d`` through
    zero and at ``t = j P`` by ``rem``'s jump. It fires at both (the solve stops or records
    there as asked) without firing again, and the jump's event time takes its derivative
    from ``rem``'s surface: ``dt*/dP = j``, ``dt*/dd = 0`` (the implicit function of ``cond``
    itself gives ``0, 1``: ``dy/dd`` was off by 1.6)."""
    f = _repeated_doses("remainder")
    event = og.Event(lambda t, y, p: t % p["P"] - p["d"], terminal=False)

    def y_end(p):
        sol = og.solve(f, 0.0, (0.0, _DOSE_T), p, events=event, max_events=16,
                       step=og.Adaptive(rtol=1e-10, atol=1e-10))  # fmt: skip
        return sol.ys[-1], sol.events

    (value, log), grad = jax.jit(jax.value_and_grad(y_end, has_aux=True))(_DOSE_P)
    assert int(log.count) == 7
    np.testing.assert_allclose(value, _repeated_doses_exact(_DOSE_P), rtol=1e-7)
    want = jax.grad(_repeated_doses_exact)(_DOSE_P)
    for k in _DOSE_P:
        np.testing.assert_allclose(grad[k], want[k], rtol=1e-6, err_msg=k)


def test_switches_held_for_each_step():
    """With the found events ``f``'s branch is held for each step (the sign of its surface at
    the step's start), so no step straddles the jump: the infusion takes no rejected step
    where the same ``where`` with a hand-written event (which holds nothing) takes 36, and
    ``y(T)`` is closer to the closed form (1.0e-9 against 4.9e-9). ``Discrete`` (a replay of
    the steps) and ``Forward`` (the loop's own derivative) differentiate the same held steps:
    equal to rounding."""
    p = {"k": 0.7, "rate": 2.0, "tau": 1.2}
    step = og.Adaptive(rtol=1e-8, atol=1e-8)
    found = og.switching_events(_infusion, 0.0, 0.0, p)
    by_hand = og.Event(lambda t, y, p: t - p["tau"], terminal=False)
    solve = lambda p, events, adjoint=None: og.solve(
        _infusion, 0.0, (0.0, 3.0), p, events=events, step=step, adjoint=adjoint or og.Auto()
    )
    held, pointwise = solve(p, found), solve(p, by_hand)
    assert int(held.stats["rejected"]) == 0 and int(pointwise.stats["rejected"]) > 20
    assert int(held.stats["rhs_evals"]) < 0.4 * int(pointwise.stats["rhs_evals"])
    exact = _infusion_exact(p, 3.0)
    assert abs(held.ys[-1] - exact) < 0.3 * abs(pointwise.ys[-1] - exact)  # 1.0e-9, 4.9e-9
    grads = {
        name: jax.jit(jax.grad(lambda p, a=a: solve(p, found, a).ys[-1]))(p)
        for name, a in (("discrete", og.Discrete()), ("forward", og.Forward()))
    }
    for k in p:
        np.testing.assert_allclose(grads["discrete"][k], grads["forward"][k], rtol=1e-12)
    want = jax.grad(lambda q: _infusion_exact(q, 3.0))(p)
    for k in p:
        np.testing.assert_allclose(grads["discrete"][k], want[k], rtol=1e-8)


@pytest.mark.slow  # (the mechanism: test_switches_held_for_each_step)
def test_floor_held_for_each_step():
    """A staircase input ``rate floor(t / w)``: the level is held for each step (``floor``'s
    integer, read at the step's start), so the steps end on its jumps rather than straddle
    them: 54 steps, 5 rejected, 329 evaluations where holding nothing took 238 / 124 / 1433
    with the same events (and 245 / 119 / 1472 without, ``dy/dw`` then 3.7 off). ``Discrete``
    and ``Forward`` differentiate the held steps alike; all against the closed form."""
    f = lambda t, y, p: -p["k"] * y + p["rate"] * jnp.floor(t / p["w"])
    p, big_t = {"k": 0.7, "rate": 2.0, "w": 1.3}, 5.0

    def exact(p):  # level n on [n w, (n + 1) w)
        k, w = p["k"], p["w"]
        ends = lambda n: (n * w, jnp.minimum((n + 1) * w, big_t))
        return sum(p["rate"] * n / k * (jnp.exp(-k * (big_t - ends(n)[1]))
                                        - jnp.exp(-k * (big_t - ends(n)[0])))
                   for n in range(1, 4))  # fmt: skip

    events = og.switching_events(f, 0.0, 0.0, p)
    step = og.Adaptive(rtol=1e-9, atol=1e-9)

    def y_end(p, adjoint, events=events):
        sol = og.solve(f, 0.0, (0.0, big_t), p, events=events, adjoint=adjoint, step=step)
        return sol.ys[-1], sol.stats

    grads = {}
    for name, adjoint in (("discrete", og.Discrete()), ("forward", og.Forward())):
        (value, stats), grads[name] = jax.jit(
            jax.value_and_grad(partial(y_end, adjoint=adjoint), has_aux=True)
        )(p)
    blind = y_end(p, og.Auto(), events=None)[1]
    assert int(stats["rejected"]) <= 8 and int(blind["rejected"]) > 80
    assert int(stats["rhs_evals"]) < 0.3 * int(blind["rhs_evals"])
    np.testing.assert_allclose(value, exact(p), rtol=1e-9)
    want = jax.grad(exact)(p)
    for k in p:
        np.testing.assert_allclose(grads["discrete"][k], grads["forward"][k], rtol=1e-12)
        np.testing.assert_allclose(grads["discrete"][k], want[k], rtol=1e-8, err_msg=k)


def test_auto_sees_held_switches_as_smooth():
    """Held switches leave ``f`` smooth inside each step, so ``Auto`` no longer counts them as
    kinks (and takes ``Forward`` on this small problem, whose held steps it differentiates
    exactly); a ``relu`` left unheld (``kinks=False``) still counts, and with ``kinks=True``
    it is held too."""
    p = {"k": 0.7, "rate": 2.0, "tau": 1.2}
    explain = lambda f, **kw: og.explain_adjoint(f, 0.0, (0.0, 3.0), p, **kw)
    found = og.switching_events(_infusion, 0.0, 0.0, p)
    assert explain(_infusion, events=found).startswith("Auto chose Forward()")
    assert "Jacobian jumps" not in explain(_infusion, events=found)
    by_hand = og.Event(lambda t, y, p: t - p["tau"], terminal=False)
    assert "Jacobian jumps" in explain(_infusion, events=by_hand)
    with_relu = lambda t, y, p: _infusion(t, y, p) - jax.nn.relu(y - 1.0)
    assert "Jacobian jumps" in explain(
        with_relu, events=og.switching_events(with_relu, 0.0, 0.0, p)
    )
    all_held = og.switching_events(with_relu, 0.0, 0.0, p, kinks=True)
    assert "Jacobian jumps" not in explain(with_relu, events=all_held)


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
    times: ``Auto`` with the found event gives the hand-written event's gradient (to 1e-8: the
    found one also holds ``f``'s branch for each step, so the steps differ), and central
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
    np.testing.assert_allclose(
        grad, jax.jit(jax.grad(partial(loss, events=by_hand)))(4.0), rtol=1e-8
    )  # fmt: skip (the found event holds f's branch per step)
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


@pytest.mark.slow  # ~40 s: six compiled gradients and central differences
def test_state_switch_held_every_adjoint():
    """A damped oscillator whose force changes law (and value) at ``y[0] = 0.3``, crossed three
    times: with the found events and the branch held per step, the six adjoints agree to 1e-6
    of the largest entry and match central differences of the solve."""
    y0, p = jnp.array([1.0, 0.0]), jnp.array([4.0, 1.0, 0.5])
    events = og.switching_events(_switched_oscillator, 0.0, y0, p)
    assert len(events) == 1
    ts = jnp.linspace(0.0, 6.0, 7)

    def loss(y0, p, adjoint):
        sol = og.solve(_switched_oscillator, y0, (0.0, 6.0), p, adjoint=adjoint, events=events,
                       step=og.Adaptive(rtol=1e-9, atol=1e-9), saveat=og.SaveAt(ts=ts))  # fmt: skip
        return jnp.sum(sol.ys[:, 0] ** 2 + sol.ys[:, 1])

    sol = og.solve(_switched_oscillator, y0, (0.0, 6.0), p, events=events,
                   step=og.Adaptive(rtol=1e-9, atol=1e-9))  # fmt: skip
    assert int(sol.events.count) == 3 and int(sol.stats["rejected"]) <= 3
    value = jax.jit(partial(loss, adjoint=og.Discrete()))
    x, h = np.concatenate([y0, p]), 1e-4
    fd = np.array([(value(*np.split(x + h * e, [2])) - value(*np.split(x - h * e, [2]))) / (2 * h)
                   for e in np.eye(5)])  # fmt: skip
    scale = np.abs(fd).max()
    grads = {}
    for name, adjoint in ADJOINTS.items():
        g = jax.jit(jax.grad(partial(loss, adjoint=adjoint), argnums=(0, 1)))(y0, p)
        grads[name] = np.concatenate(g)
        np.testing.assert_allclose(grads[name], fd, rtol=1e-3, atol=1e-4 * scale, err_msg=name)
    for name, g in grads.items():
        np.testing.assert_allclose(g, grads["discrete"], rtol=1e-6, atol=1e-6 * scale, err_msg=name)


@pytest.mark.slow  # ~15 s
def test_kinks_held_make_discrete_exact():
    """``kinks=True`` puts events on ``abs``, ``clip`` and ``relu`` and holds their pieces per
    step: ``Discrete`` then matches central differences to their noise (3e-10 measured), where
    without the events its steps straddle the kinks and it is 2.5e-5 to 3e-4 off (``O(sqrt(tol))``;
    the figure moves with the compiler's rounding)."""

    def f(t, y, p):
        force = (-p[0] * y[0] - jnp.abs(y[1]) * p[1] + jnp.clip(y[0], -0.2, 0.2) * p[2]
                 - jax.nn.relu(y[0] - 0.1))  # fmt: skip
        return jnp.stack([y[1], force])

    y0, p = jnp.array([1.0, 0.0]), jnp.array([4.0, 0.3, 1.0])
    events = og.switching_events(f, 0.0, y0, p, kinks=True)
    assert len(events) == 4

    def loss(p, events=events):
        sol = og.solve(f, y0, (0.0, 5.0), p, events=events, adjoint=og.Discrete(),
                       step=og.Adaptive(1e-10, 1e-10),
                       saveat=og.SaveAt(ts=jnp.linspace(0, 5, 6)))  # fmt: skip
        return jnp.sum(sol.ys**2)

    value, h = jax.jit(loss), 1e-5
    fd = np.array([(value(p + h * e) - value(p - h * e)) / (2 * h) for e in np.eye(3)])
    held = jax.jit(jax.grad(loss))(p)
    np.testing.assert_allclose(held, fd, rtol=1e-8, atol=1e-8 * np.abs(fd).max())
    straddled = jax.jit(jax.grad(partial(loss, events=None)))(p)
    assert np.abs(straddled - fd).max() > 1e-6 * np.abs(fd).max()
