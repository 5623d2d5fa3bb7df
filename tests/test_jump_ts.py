"""``og.Adaptive(jump_ts=)``: steps end at known times where ``f`` jumps in ``t``.

The problem: ``y' = -k y + u(t)`` with ``u`` piecewise constant, looked up from a table by
``searchsorted`` (a lookup no switch reader sees), whose closed form is a product of
exponentials; every derivative is checked against that closed form's own.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odegrad as og
from test_kinks import ADJOINTS  # the six adjoints, by name

slow = [pytest.mark.slow]

jax.config.update("jax_enable_x64", True)

KNOTS = np.array([0.0, 1.3, 2.1, 3.7, 5.0])  # u changes at the inner three
P = {"k": 0.8, "vals": np.array([1.0, -0.5, 2.0, 0.3])}


def _table(t, y, p):
    inner = p.get("knots", KNOTS)[1:-1]
    return -p["k"] * y + p["vals"][jnp.searchsorted(inner, t, side="right")]


def _exact(y0, p, t0, t1):
    """``y(t1)`` from ``y(t0) = y0``, either direction, interval by interval."""
    knots = p.get("knots", KNOTS)
    order = range(4) if t1 > t0 else range(3, -1, -1)
    y = y0
    for i in order:
        a, b = (knots[i], knots[i + 1]) if t1 > t0 else (knots[i + 1], knots[i])
        a = jnp.clip(a, min(t0, t1), max(t0, t1))
        b = jnp.clip(b, min(t0, t1), max(t0, t1))
        u = p["vals"][i] / p["k"]
        y = u + (y - u) * jnp.exp(-p["k"] * (b - a))
    return y


def _gradients(fn, y0, p):
    g = jax.grad(fn, argnums=(0, 1))(y0, p)
    return np.concatenate([np.ravel(g[0]), np.ravel(g[1]["k"]), np.ravel(g[1]["vals"])])


@pytest.mark.parametrize(
    "adjoint",
    [
        pytest.param(a, id=k, marks=[] if k in ("auto", "interpolating") else slow)
        for k, a in ADJOINTS.items()
    ],
)  # (Backsolve, Discrete, Forward in the slow tier: test_with_switching_events has them too)
def test_gradients_match_the_closed_form(adjoint):
    """Every adjoint, to 1e-9: Interpolating's and Quadrature's backward solves, whose error
    norm leaves out ``dL/dp``, stop at the jumps too (stepping over them they were 8e-3 and
    3e-3 off ``dL/dvals``, a one-hot integrand the norm does not see)."""
    step = og.Adaptive(rtol=1e-10, atol=1e-10, jump_ts=KNOTS[1:-1])

    def y_end(y0, p):
        sol = og.solve(_table, y0, (0.0, 5.0), p, adjoint=adjoint, step=step)
        return sol.ys[-1], sol.stats

    y0 = 0.4
    (y, stats), g = jax.jit(jax.value_and_grad(y_end, (0, 1), has_aux=True))(y0, P)
    got = np.concatenate([np.ravel(g[0]), np.ravel(g[1]["k"]), np.ravel(g[1]["vals"])])
    want = _gradients(lambda y, p: _exact(y, p, 0.0, 5.0), y0, P)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
    assert abs(float(y - _exact(y0, P, 0.0, 5.0))) < 1e-10
    # the controller does not find each jump by rejecting steps (without jump_ts: 128
    # rejected of 284, 1706 evaluations)
    assert int(stats["rejected"]) <= 4 and int(stats["rhs_evals"]) < 700


@pytest.mark.parametrize(
    "adjoint",
    [
        pytest.param(a, id=k, marks=[] if k == "interpolating" else slow)
        for k, a in ADJOINTS.items()
    ],
)
def test_backward_in_time_with_saves_at_the_jumps(adjoint):
    """From ``t = 5`` down to 0, saves at every knot: the jumps themselves, where a step ends
    and the next starts (for Interpolating's saves that ride inside its backward steps: the
    step past a jump keeps the count of saves taken in, and its stages read time on its own
    side)."""
    step = og.Adaptive(rtol=1e-10, atol=1e-10, jump_ts=KNOTS[1:-1])
    ts = KNOTS[::-1]
    weights = jnp.array([0.3, -1.0, 0.5, 2.0, 1.0])

    def loss(y0, p):
        sol = og.solve(_table, y0, (5.0, 0.0), p, saveat=og.SaveAt(ts=ts), step=step,
                       adjoint=adjoint)  # fmt: skip
        return weights @ sol.ys, sol.ys

    def exact(y0, p):
        ys = jnp.stack([_exact(y0, p, 5.0, t) for t in ts])
        return weights @ ys, ys

    y0 = 1.7
    (_, ys), g = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(y0, P)
    (_, want), g_want = jax.value_and_grad(exact, (0, 1), has_aux=True)(y0, P)
    np.testing.assert_allclose(ys, want, rtol=1e-10)
    flat = lambda g: np.concatenate([np.ravel(g[0]), np.ravel(g[1]["k"]), np.ravel(g[1]["vals"])])
    np.testing.assert_allclose(flat(g), flat(g_want), rtol=1e-9)


def test_vmapped_jump_times_per_member():
    """Each member's own knots, traced (read from ``args`` by ``f`` and given as ``jump_ts``),
    under ``jit(vmap(grad))``, with the default adjoint."""

    def y_end(shift, y0):
        knots = jnp.asarray(KNOTS).at[1:-1].add(shift)
        p = dict(P, knots=knots)
        step = og.Adaptive(rtol=1e-9, atol=1e-9, jump_ts=knots[1:-1])
        return og.solve(_table, y0, (0.0, 5.0), p, step=step).ys[-1]

    shifts = jnp.array([-0.2, 0.0, 0.35])
    values, grads = jax.jit(jax.vmap(jax.value_and_grad(y_end, argnums=1), (0, None)))(shifts, 0.4)
    for s_, v, g in zip(shifts, values, grads, strict=True):
        p = dict(P, knots=jnp.asarray(KNOTS).at[1:-1].add(s_))
        assert abs(float(v - _exact(0.4, p, 0.0, 5.0))) < 1e-9
        assert abs(float(g - jax.grad(_exact)(0.4, p, 0.0, 5.0))) < 1e-9


@pytest.mark.parametrize(
    "solver, rtol, tol",
    [
        pytest.param(og.Kvaerno5(), 1e-8, 1e-6, marks=pytest.mark.slow),
        pytest.param(og.Rodas5(), 1e-8, 1e-6, marks=pytest.mark.slow),
        (og.ROCK2(), 1e-6, 1e-4),  # (second order: 1e-8 would take thousands of steps)
    ],
    ids=["Kvaerno5", "Rodas5", "ROCK2"],
)
def test_other_solvers(solver, rtol, tol):
    """Implicit, Rosenbrock and stabilised solvers restart past each jump too (a fresh state:
    a stabilised solver's spectral radius estimated again)."""
    step = og.Adaptive(rtol=rtol, atol=rtol, jump_ts=KNOTS[1:-1])

    def y_end(y0, p):
        return og.solve(_table, y0, (0.0, 5.0), p, solver=solver, step=step).ys[-1]

    y0 = 0.4
    y, g = jax.jit(jax.value_and_grad(y_end, (0, 1)))(y0, P)
    assert abs(float(y - _exact(y0, P, 0.0, 5.0))) < tol
    got = np.concatenate([np.ravel(g[0]), np.ravel(g[1]["k"]), np.ravel(g[1]["vals"])])
    want = _gradients(lambda y, p: _exact(y, p, 0.0, 5.0), y0, P)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


@pytest.mark.slow  # (float32 jump times under vmap: test_vmapped_jump_times_per_member's kind)
def test_float32():
    p = {"k": jnp.float32(0.8), "vals": jnp.asarray(P["vals"], jnp.float32)}
    knots = jnp.asarray(KNOTS, jnp.float32)
    step = og.Adaptive(rtol=1e-5, atol=1e-5, jump_ts=knots[1:-1])
    q = dict(p, knots=knots)

    def y_end(y0):
        return og.solve(_table, y0, (0.0, 5.0), q, step=step).ys[-1]

    y, g = jax.value_and_grad(y_end)(jnp.float32(0.4))
    assert y.dtype == jnp.float32
    q64 = {"k": 0.8, "vals": P["vals"], "knots": KNOTS}
    np.testing.assert_allclose(y, _exact(0.4, q64, 0.0, 5.0), rtol=1e-4)
    np.testing.assert_allclose(g, jax.grad(_exact)(0.4, q64, 0.0, 5.0), rtol=1e-4)


@pytest.mark.parametrize(
    "jump_ts, error, match",
    [
        (np.ones((2, 2)), ValueError, "1-d array"),
        (np.array([1.0, np.nan]), ValueError, "nan"),
        (np.array(["a", "b"]), TypeError, "real numbers"),
    ],
)
@pytest.mark.parametrize("name", ["jump_ts", "step_ts"])
def test_bad_jump_ts(jump_ts, error, match, name):
    with pytest.raises(error, match=f"{name}.*{match}"):
        og.Adaptive(**{name: jump_ts})


def _linear(t, y, p):
    return -p["k"] * y + p["c"]


def _linear_exact(y0, p, t0, t1):
    u = p["c"] / p["k"]
    return u + (y0 - u) * jnp.exp(-p["k"] * (t1 - t0))


STOPS = np.linspace(0.0, 5.0, 8)[1:-1]


@pytest.mark.parametrize(
    "span",
    [(0.0, 5.0), pytest.param((5.0, 0.0), marks=slow)],  # (backwards: test_step_ts_gradients)
    ids=["forward", "backward"],
)
def test_step_ts_land_without_a_restart(span):
    """Every step that would reach a ``step_ts`` time ends on it and the next goes on with no
    fresh first stage (the same evaluations per step as a solve without them); ``jump_ts``
    among them restart there, one evaluation each."""
    p = {"k": 0.8, "c": 1.5}

    def run(**times):
        step = og.Adaptive(rtol=1e-8, atol=1e-8, **times)
        sol = og.solve(_linear, 0.4, span, p, step=step, saveat=og.SaveAt(steps=True))
        ts = np.asarray(sol.ts)
        y_end = np.asarray(sol.ys)[np.isfinite(ts)][-1]
        extra = int(sol.stats["rhs_evals"]) - 6 * int(sol.stats["steps"])  # Tsit5: 6 per try
        return set(ts[np.isfinite(ts)].tolist()), extra, y_end

    want = float(_linear_exact(0.4, p, *span))
    ts_plain, extra_plain, y_plain = run()
    for times, restarts in [
        ({"step_ts": STOPS}, 0),
        ({"jump_ts": STOPS}, len(STOPS)),
        ({"step_ts": STOPS[:2], "jump_ts": STOPS[2:]}, len(STOPS) - 2),
    ]:
        ts, extra, y_end = run(**times)
        assert set(STOPS.tolist()) <= ts and not set(STOPS.tolist()) <= ts_plain
        assert extra == extra_plain + restarts, (times, extra, extra_plain)
        assert abs(y_end - want) < 1e-8 * abs(want) and abs(y_plain - want) < 1e-8 * abs(want)


A_KINK = float(STOPS[2])


def _kinked(t, y, p):
    return -p["k"] * y + p["c"] * jnp.abs(t - A_KINK)


def _kinked_exact(y0, p, t0, t1):
    """Piece by piece: on a piece with forcing ``c (m t + b)``, ``y - y_p`` decays as
    ``exp(-k t)``, ``y_p = c (m t + b) / k - c m / k^2``."""
    k, c = p["k"], p["c"]

    def piece(y, ta, tb, m, b):
        y_p = lambda t: c * (m * t + b) / k - c * m / k**2
        return y_p(tb) + (y - y_p(ta)) * jnp.exp(-k * (tb - ta))

    s = 1.0 if t1 > t0 else -1.0
    return piece(piece(y0, t0, A_KINK, -s, s * A_KINK), A_KINK, t1, s, -s * A_KINK)


@pytest.mark.slow  # (converted backward stops: test_backward_steps_resolve_fast_forward_states)
def test_step_ts_gradients():
    """``f`` kinks in ``t`` at a ``step_ts`` time (where a restart is not needed): on a
    backward-in-time span ``Interpolating``'s backward solve lands there too (its times
    converted to the backward loop's), and its gradient matches the closed form to 1e-9 (7.9e-6
    off without ``step_ts``, and without the conversion)."""
    p = {"k": 0.8, "c": 1.5}
    step = og.Adaptive(rtol=1e-10, atol=1e-10, step_ts=STOPS)
    want = jax.grad(_kinked_exact, (0, 1))(0.4, p, 5.0, 0.0)
    adjoint = og.Interpolating()
    fn = lambda y0, p: og.solve(_kinked, y0, (5.0, 0.0), p, step=step, adjoint=adjoint).ys[-1]
    got = jax.grad(fn, (0, 1))(0.4, p)
    np.testing.assert_allclose(jax.tree.leaves(got), jax.tree.leaves(want), rtol=1e-9)


def _stop_at_two(t, y, p):
    return -p["k"] * y + jnp.where(t < 2.0, p["vals"][0], p["vals"][1])


def test_continuous_adjoints_warn_of_switches_they_cannot_see():
    """A switch in time with no event and no ``jump_ts``: the backward solve's seminorm steps
    across it unseen (Interpolating's ``dL/dvals`` was 6e-4 off at rtol 1e-10), so the solve
    says so at trace time; with the jump's time given, or the switch's event, it is silent (and
    right: test_gradients_match_the_closed_form, test_with_switching_events)."""
    p = {"k": 0.8, "vals": jnp.array([1.0, -0.5])}

    def trace(step):  # (the warning is given at trace time: nothing is compiled)
        y_end = lambda p: og.solve(_stop_at_two, 0.4, (0.0, 5.0), p, step=step,
                                   adjoint=og.Interpolating()).ys[-1]  # fmt: skip
        return jax.eval_shape(jax.grad(y_end), p)

    with pytest.warns(RuntimeWarning, match=r"switches branch in time at lt at .*test_jump_ts"):
        trace(og.Adaptive())
    # a table lookup by searchsorted (a binary search in a lax.scan): Interpolating's dL/du
    # was 82 % off on benchmarks/jump_ts.py's 20-step table
    with pytest.warns(RuntimeWarning, match=r"lookup by time .* at test_jump_ts.py:\d+ \(_table\)"):
        table = lambda p: og.solve(_table, 0.4, (0.0, 5.0), p, adjoint=og.Quadrature()).ys[-1]
        jax.eval_shape(jax.grad(table), P)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace(og.Adaptive(jump_ts=[2.0]))
        events = og.switching_events(_stop_at_two, 0.0, 0.4, p)

        def with_event(p):
            sol = og.solve(_stop_at_two, 0.4, (0.0, 5.0), p, events=events,
                           adjoint=og.Interpolating())  # fmt: skip
            return sol.ys[-1]

        jax.eval_shape(jax.grad(with_event), p)


def _infusion_and_table(t, y, p):
    """An infusion at ``rate`` until a fitted ``tau`` (an event: its time is differentiated)
    on top of the table input (jumps at known times)."""
    return _table(t, y, p) + jnp.where(t < p["tau"], p["rate"], 0.0)


def _infusion_and_table_exact(y0, p, big_t=5.0):
    """Superposed: ``y0 e^{-kT}``, each constant piece ``r`` on ``[a, b]`` adding
    ``r / k (e^{-k (T - b)} - e^{-k (T - a)})``."""
    k = p["k"]
    piece = lambda r, a, b: r / k * (jnp.exp(-k * (big_t - b)) - jnp.exp(-k * (big_t - a)))
    total = y0 * jnp.exp(-k * big_t) + piece(p["rate"], 0.0, p["tau"])
    for i in range(4):
        total = total + piece(p["vals"][i], KNOTS[i], KNOTS[i + 1])
    return total


@pytest.mark.parametrize(
    "adjoint",
    [pytest.param(a, id=k, marks=[] if k == "auto" else slow) for k, a in ADJOINTS.items()],
)
def test_with_switching_events(adjoint):
    """``jump_ts`` beside ``og.switching_events``: the event's time (``tau = 2.9``, between two
    knots) carries its derivative, the knots restart the solver; every derivative against the
    closed form."""
    p = dict(P, tau=2.9, rate=1.5)
    events = og.switching_events(_infusion_and_table, 0.0, 0.0, p)
    assert len(events) == 1  # t < tau (searchsorted's comparisons are not read)
    step = og.Adaptive(rtol=1e-10, atol=1e-10, jump_ts=KNOTS[1:-1])

    def y_end(y0, p):
        return og.solve(_infusion_and_table, y0, (0.0, 5.0), p, adjoint=adjoint, step=step,
                        events=events).ys[-1]  # fmt: skip

    y, g = jax.jit(jax.value_and_grad(y_end, (0, 1)))(0.4, p)
    y_want, g_want = jax.value_and_grad(_infusion_and_table_exact, (0, 1))(0.4, p)
    assert abs(float(y - y_want)) < 1e-10
    flat = lambda g: np.concatenate([np.ravel(g[0])] + [np.ravel(g[1][n]) for n in sorted(p)])
    np.testing.assert_allclose(flat(g), flat(g_want), rtol=0, atol=1e-8)


def test_differentiated_jump_times_are_refused():
    """A derivative reaching ``jump_ts`` would be dropped (they are constants, and ``f``'s own
    pointwise derivative misses the jump's term): refused at trace time, naming the fix."""

    def y_end(tau):
        p = dict(P, tau=tau, rate=1.5)
        step = og.Adaptive(jump_ts=jnp.stack([tau]))
        return og.solve(_infusion_and_table, 0.4, (0.0, 5.0), p, step=step).ys[-1]

    with pytest.raises(ValueError, match=r"jump_ts\) is being differentiated.*switching_events"):
        jax.eval_shape(jax.grad(y_end), 2.9)
    step = lambda tau: og.Adaptive(jump_ts=jax.lax.stop_gradient(jnp.stack([tau])))
    fine = lambda tau: og.solve(_table, 0.4, (0.0, 5.0), P, step=step(tau)).ys[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.eval_shape(jax.grad(fine), 2.9)  # (stop_gradient: the times are data)
    # the same held times while f's switch moves with the differentiated tau: the jump's term
    # is missing as without jump_ts (dy/dtau was a silent 0), so the solve warns as there
    moved = lambda tau: og.solve(
        _infusion_and_table, 0.4, (0.0, 5.0), dict(P, tau=tau, rate=1.5), step=step(tau)
    ).ys[-1]
    with pytest.warns(RuntimeWarning, match=r"no event there \(Adaptive\(jump_ts=\) ends"):
        jax.eval_shape(jax.grad(moved), 2.9)


def test_auto_keeps_discrete_across_unseen_time_switches():
    """Where ``Auto`` would take Interpolating (kinks, many inputs, a tight tolerance) but
    ``f`` also switches in time unseen, it keeps Discrete and says why; given the jump's time
    (or its event), Interpolating."""

    def f(t, y, p):  # 40 states: too many inputs for Forward; abs: a kink
        return -p["k"] * jnp.abs(y) + jnp.where(t < 2.0, p["u0"], p["u1"])

    y0, p = jnp.linspace(-1.0, 1.0, 40), {"k": 0.8, "u0": 1.0, "u1": -0.5}
    explain = lambda step: og.explain_adjoint(f, y0, (0.0, 5.0), p, step=step)
    unseen = explain(og.Adaptive(rtol=1e-8, atol=1e-8))
    assert unseen.startswith("Auto chose Discrete") and "switches branch in time at lt" in unseen
    seen = explain(og.Adaptive(rtol=1e-8, atol=1e-8, jump_ts=[2.0]))
    assert seen.startswith("Auto chose Interpolating"), seen
