"""Events: located zero crossings, terminal and with state jumps, through every adjoint.

Checked against closed forms (a ball under gravity: impact time and velocity, bounces with
restitution ``e``), central differences (a ball with quadratic drag, two events), and between
the adjoints; ``direction`` on an oscillator; ``max_events``; bad input; ``vmap``; fixed steps;
partitioned solvers; ``progress``. Each jitted gradient is built once (``functools.cache``).
"""

from __future__ import annotations

import functools

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import odegrad as og  # noqa: E402

ADJOINTS = {
    "Discrete": og.Discrete(),
    "Discrete3": og.Discrete(checkpoints=3),
    "Forward": og.Forward(),
    "Auto": og.Auto(),
    "Interpolating": og.Interpolating(),
    "Interpolating3": og.Interpolating(checkpoints=3),
    "Backsolve": og.Backsolve(),
    "Quadrature": og.Quadrature(),
}
TIGHT = og.Adaptive(rtol=1e-10, atol=1e-10)
# the full matrix runs in the slow tier (pytest -m slow); the checkpointed variants and
# Quadrature share their event code with Discrete and Interpolating
SLOW_VARIANTS = {"Discrete3", "Interpolating3", "Quadrature"}
EVERY_ADJOINT = [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_VARIANTS else name
    for name in ADJOINTS
]


def compiled(run):
    """``p -> (run(p), its Jacobian)`` (reverse mode, as ``jax.grad`` uses): one compiled
    program for both."""
    return jax.jit(lambda p: (run(p), jax.jacrev(run)(p)))


def fall(t, y, args):
    return jnp.stack([y[1], -args["g"] * jnp.ones_like(y[0])])


HIT = og.Event(lambda t, y, args: y[0], direction=-1)
BOUNCE = og.Event(
    lambda t, y, args: y[0],
    direction=-1,
    terminal=False,
    update=lambda t, y, args: jnp.stack([y[0], -args["e"] * y[1]]),
)


# -- a ball thrown up at v0 from h0: the impact, in closed form ------------------------------------
def impact_exact(p):
    h0, v0, g = p
    t = (v0 + jnp.sqrt(v0**2 + 2 * g * h0)) / g
    return jnp.stack([t, v0 - g * t])


@functools.cache
def impact(name):
    """``p = (h0, v0, g) -> (t*, v(t*))`` through adjoint ``name``, and its Jacobian."""

    def run(p):
        sol = og.solve(
            fall, p[:2], (0.0, 5.0), {"g": p[2]}, events=HIT, step=TIGHT, adjoint=ADJOINTS[name]
        )
        return jnp.stack([sol.ts[-1], sol.ys[-1, 1]])

    return compiled(run)


P_IMPACT = jnp.array([1.0, 2.0, 9.81])


@pytest.mark.parametrize(  # (Forward's: test_bouncing_ball_...; Auto's: test_drag_two_events_...)
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in ("Forward", "Auto") else n
     for n in EVERY_ADJOINT],
)  # fmt: skip
def test_terminal_impact_matches_closed_form(name):
    value, jac = impact(name)(P_IMPACT)
    np.testing.assert_allclose(value, impact_exact(P_IMPACT), rtol=0, atol=1e-8)
    np.testing.assert_allclose(jac, jax.jacfwd(impact_exact)(P_IMPACT), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_forward_mode_through_events():
    """``jax.jacfwd`` (no custom VJP involved) differentiates the same jump."""

    def run(p):
        sol = og.solve(fall, p[:2], (0.0, 5.0), {"g": p[2]}, events=HIT, step=TIGHT)
        return jnp.stack([sol.ts[-1], sol.ys[-1, 1]])

    np.testing.assert_allclose(
        jax.jacfwd(run)(P_IMPACT), jax.jacfwd(impact_exact)(P_IMPACT), rtol=0, atol=1e-6
    )


def test_terminal_event_log_and_saves():
    ts = jnp.linspace(0.0, 1.0, 6)
    sol = og.solve(
        fall,
        P_IMPACT[:2],
        (0.0, 5.0),
        {"g": 9.81},
        events=HIT,
        step=TIGHT,
        saveat=og.SaveAt(ts=ts, t1=True),
    )
    t_star, v_star = impact_exact(P_IMPACT)
    assert int(sol.events.count) == 1 and int(sol.events.which[0]) == 0
    assert np.all(np.asarray(sol.events.which[1:]) == -1)
    assert np.all(np.isinf(np.asarray(sol.events.ts[1:])))
    np.testing.assert_allclose(sol.events.ts[0], t_star, atol=1e-8)
    np.testing.assert_allclose(sol.events.ys[0], [0.0, v_star], atol=1e-8)
    # saves before the event hold the trajectory; after it, inf rows as for a failed solve
    before = np.asarray(ts) < float(t_star)
    h = 1.0 + 2.0 * ts - 0.5 * 9.81 * ts**2
    np.testing.assert_allclose(np.asarray(sol.ys[:-1, 0])[before], np.asarray(h)[before], 1e-9)
    assert np.all(np.isinf(np.asarray(sol.ys[:-1, 0])[~before]))
    np.testing.assert_allclose(sol.ts[-1], t_star, atol=1e-8)


def test_terminal_under_vmap():
    h0 = jnp.array([0.5, 1.0, 2.0, 4.0])

    def t_star(h):
        y0 = jnp.stack([h, jnp.asarray(2.0)])
        return og.solve(fall, y0, (0.0, 5.0), {"g": 9.81}, events=HIT, step=TIGHT).ts[-1]

    exact = lambda h: impact_exact(jnp.stack([h, 2.0, 9.81]))[0]
    values, grads = jax.jit(jax.vmap(jax.value_and_grad(t_star)))(h0)
    np.testing.assert_allclose(values, jax.vmap(exact)(h0), atol=1e-8)
    np.testing.assert_allclose(grads, jax.vmap(jax.grad(exact))(h0), atol=1e-6)


@pytest.mark.parametrize("name", ["Discrete", "Interpolating"])
def test_backward_in_time(name):
    def t_star(h):
        y0 = jnp.stack([h, jnp.asarray(2.0)])
        sol = og.solve(
            fall, y0, (0.0, -5.0), {"g": 9.81}, events=HIT, step=TIGHT, adjoint=ADJOINTS[name]
        )
        return sol.ts[-1]

    g = 9.81
    exact = lambda h: (2.0 - jnp.sqrt(4.0 + 2 * g * h)) / g  # the earlier root of h + 2t - gt^2/2
    # the solve and its gradient as one compiled program (eagerly, each runs op by op)
    value, grad = jax.jit(lambda h: (t_star(h), jax.grad(t_star)(h)))(1.0)
    np.testing.assert_allclose(value, exact(1.0), atol=1e-8)
    np.testing.assert_allclose(grad, jax.grad(exact)(1.0), atol=1e-6)


def test_backsolve_with_saves_past_a_terminal_event():
    """Save times after the event hold inf rows; the reverse pass starts at the event."""

    def loss(p, adjoint):
        sol = og.solve(
            fall,
            p[:2],
            (0.0, 5.0),
            {"g": p[2]},
            events=HIT,
            step=TIGHT,
            saveat=og.SaveAt(ts=jnp.linspace(0.0, 2.0, 5), t1=True),
            adjoint=adjoint,
        )
        rows = jnp.where(jnp.isfinite(sol.ys[:-1, 0]), sol.ys[:-1, 0], 0.0)
        return jnp.sum(rows**2) + sol.ts[-1]

    # (Interpolating's reverse pass from a terminal event: test_terminal_impact_matches_...)
    adjoints = (og.Discrete(), og.Backsolve())
    # both gradients from one compiled program
    want, *others = jax.jit(lambda p: [jax.grad(loss)(p, a) for a in adjoints])(P_IMPACT)
    for got in others:
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_event_on_a_grid_point():
    """A crossing exactly at a fixed step's end fires once and takes no zero-length step."""
    ev = og.Event(lambda t, y, a: t - 0.5, direction=0, terminal=False)
    sol = og.solve(lambda t, y, a: jnp.ones_like(y), jnp.zeros(1), (0.0, 1.0), events=ev,
                   step=og.Fixed(0.1))  # fmt: skip
    assert int(sol.events.count) == 1 and int(sol.stats["accepted"]) == 10
    np.testing.assert_allclose(sol.events.ts[0], 0.5, atol=1e-12)


# -- a bouncing ball with restitution e: six bounces before T, in closed form ----------------------
T_BOUNCE = 3.0
N_BOUNCES = 6


def bounces_exact(p):
    """Bounce times and ``(h, v)(T)`` of a ball dropped from ``h0`` (``p = (h0, e, g)``)."""
    h0, e, g = p
    t, v, h, times = 0.0, 0.0, h0, []
    for _ in range(N_BOUNCES):
        dt = (v + jnp.sqrt(v**2 + 2 * g * h)) / g
        t, v, h = t + dt, -e * (v - g * dt), 0.0
        times.append(t)
    dt = T_BOUNCE - t
    return jnp.stack(times), jnp.stack([v * dt - 0.5 * g * dt**2, v - g * dt])


@functools.cache
def bounces(name):
    def run(p):
        sol = og.solve(
            fall,
            jnp.stack([p[0], jnp.zeros_like(p[0])]),
            (0.0, T_BOUNCE),
            {"e": p[1], "g": p[2]},
            events=BOUNCE,
            step=TIGHT,
            adjoint=ADJOINTS[name],
        )
        return sol.events.ts[:N_BOUNCES], sol.ys[-1]

    return compiled(run)


P_BOUNCE = jnp.array([1.0, 0.8, 9.81])


@pytest.mark.parametrize(  # (Backsolve's, Discrete's, Auto's: test_terminal_impact_matches_...)
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in ("Backsolve", "Discrete", "Auto")
             else n for n in EVERY_ADJOINT],
)  # fmt: skip
def test_bouncing_ball_matches_closed_form(name):
    (times, y_t), (d_times, d_y) = bounces(name)(P_BOUNCE)
    exact_times, exact_y = bounces_exact(P_BOUNCE)
    np.testing.assert_allclose(times, exact_times, atol=1e-8)
    np.testing.assert_allclose(y_t, exact_y, atol=1e-8)
    e_times, e_y = jax.jacfwd(bounces_exact)(P_BOUNCE)
    np.testing.assert_allclose(d_times, e_times, atol=1e-6)
    np.testing.assert_allclose(d_y, e_y, atol=1e-6)


def test_fixed_steps_continuous_adjoint_across_a_jump():
    """Fixed steps, a jump: the backward step after the event reads the state after it."""

    def loss(c, adjoint):
        sol = og.solve(
            drag,
            jnp.array([1.0, 0.0]),
            (0.0, 1.0),
            {"g": 9.81, "c": c, "e": 0.5},
            events=BOUNCE,
            step=og.Fixed(0.01),
            adjoint=adjoint,
        )
        return sol.ys[-1, 1]

    want, got = jax.jit(  # both gradients from one compiled program
        lambda c: (jax.grad(loss)(c, og.Discrete()), jax.grad(loss)(c, og.Interpolating()))
    )(0.5)
    # the continuous adjoint of the same steps differs from the discrete one by O(dt)
    np.testing.assert_allclose(got, want, rtol=1e-3)


def _fall_or_pushed_up(t, y, args):
    """``fall`` above the ground, pushed up below it: the same motion, since the bounce keeps
    the ball above, but ``f`` jumps on the bounce's surface."""
    return jnp.stack([y[1], jnp.where(y[0] > 0, -args["g"], 5.0)])


@pytest.mark.parametrize(  # (Interpolating's jump term: test_kinks.py's value jump with an event)
    "name", ["Discrete", pytest.param("Interpolating", marks=pytest.mark.slow)]
)
def test_bounce_on_a_surface_where_f_jumps(name):
    """After the bounce the ball leaves upwards, so the jump's ``f+`` is the falling side's even
    though the located state lies a hair below ground (where ``f`` pushes up): ``f+`` taken there
    made every adjoint's Jacobian wrong by O(1) (84.7 of 85)."""
    y0 = lambda p: jnp.stack([p[0], jnp.zeros_like(p[0])])

    def run(p, f):
        sol = og.solve(f, y0(p), (0.0, T_BOUNCE), {"e": p[1], "g": p[2]}, events=BOUNCE,
                       step=TIGHT, adjoint=ADJOINTS[name])  # fmt: skip
        return jnp.concatenate([sol.events.ts[:N_BOUNCES], sol.ys[-1]])

    jumps = jax.jit(jax.jacrev(lambda p: run(p, _fall_or_pushed_up)))(P_BOUNCE)
    e_times, e_y = jax.jacfwd(bounces_exact)(P_BOUNCE)
    # (the restart after each bounce evaluates f a hair below ground: ~2e-6 off at rtol 1e-10)
    np.testing.assert_allclose(jumps, jnp.concatenate([e_times, e_y]), atol=1e-5)


def test_bouncing_ball_fixed_steps():
    """Fixed steps: an event ends a step early and the next resumes the grid."""

    def run(p):
        sol = og.solve(
            fall,
            jnp.stack([p[0], 0.0]),
            (0.0, T_BOUNCE),
            {"e": p[1], "g": p[2]},
            events=BOUNCE,
            step=og.Fixed(0.01),
        )
        return sol.ys[-1, 0], sol.stats["accepted"]

    # the solve and its gradient as one compiled program (eagerly, the solve runs op by op)
    (h_t, accepted), grad = jax.jit(lambda p: (run(p), jax.grad(lambda p: run(p)[0])(p)))(P_BOUNCE)
    # a quadratic is integrated exactly by Tsit5, so only the event location limits this
    np.testing.assert_allclose(h_t, bounces_exact(P_BOUNCE)[1][0], atol=1e-8)
    assert int(accepted) == 300 + N_BOUNCES
    exact = jax.grad(lambda p: bounces_exact(p)[1][0])(P_BOUNCE)
    np.testing.assert_allclose(grad, exact, atol=1e-6)


# -- nonlinear: quadratic drag, two events, against central differences ----------------------------
def drag(t, y, args):
    return jnp.stack([y[1], -args["g"] - args["c"] * y[1] * jnp.abs(y[1])])


APEX = og.Event(lambda t, y, args: y[1], direction=-1, terminal=False)  # records, no jump


@functools.cache
def drag_loss(name):
    def loss(p):
        sol = og.solve(
            drag,
            jnp.stack([p[0], 0.3]),
            (0.0, 2.5),
            {"e": p[1], "g": p[2], "c": p[3]},
            events=[BOUNCE, APEX],
            step=og.Adaptive(rtol=1e-12, atol=1e-12),
            saveat=og.SaveAt(ts=jnp.linspace(0.0, 2.5, 7)),
            adjoint=ADJOINTS[name],
        )
        happened = sol.events.which >= 0
        ts = jnp.where(happened, sol.events.ts, 0.0)
        v_before = jnp.where(happened, sol.events.ys[:, 1], 0.0)  # velocity just before each
        return (
            jnp.sum(sol.ys[:, 0] ** 2)
            + jnp.sum(jnp.where(happened, jnp.sin(ts), 0.0))
            + 0.1 * jnp.sum(v_before**2)
        )

    return jax.jit(loss), jax.jit(jax.grad(loss))


P_DRAG = np.array([1.0, 0.8, 9.81, 0.1])


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("Discrete", marks=pytest.mark.slow),  # (Auto's choice is Discrete's too)
        "Auto",
        pytest.param("Forward", marks=pytest.mark.slow),
        pytest.param("Interpolating3", marks=pytest.mark.slow),
        pytest.param("Backsolve", marks=pytest.mark.slow),
        pytest.param("Quadrature", marks=pytest.mark.slow),
    ],
)
def test_drag_two_events_against_central_differences(name):
    loss, grad = drag_loss(name)
    eps = 1e-6
    fd = [
        (loss(P_DRAG + eps * e) - loss(P_DRAG - eps * e)) / (2 * eps) for e in np.eye(P_DRAG.size)
    ]
    np.testing.assert_allclose(grad(P_DRAG), fd, rtol=1e-5, atol=2e-6)


def test_drag_two_events_sequence():
    sol = og.solve(
        drag,
        jnp.array([1.0, 0.3]),
        (0.0, 2.5),
        {"e": 0.8, "g": 9.81, "c": 0.1},
        events=[BOUNCE, APEX],
        step=TIGHT,
    )
    n = int(sol.events.count)
    which = np.asarray(sol.events.which)
    assert n == 10 and np.all(which[:n] == [1, 0] * 5) and np.all(which[n:] == -1)
    assert np.all(np.diff(np.asarray(sol.events.ts[:n])) > 0)
    # at each bounce the ball is on the ground falling; at each apex it is at rest
    ys = np.asarray(sol.events.ys[:n])
    np.testing.assert_allclose(ys[which[:n] == 0, 0], 0.0, atol=1e-9)
    assert np.all(ys[which[:n] == 0, 1] < 0)
    np.testing.assert_allclose(ys[which[:n] == 1, 1], 0.0, atol=1e-9)


# -- direction, max_events, bad input --------------------------------------------------------------
def oscillator(t, y, args):
    return jnp.stack([y[1], -y[0]])


@pytest.mark.parametrize("direction, multiples", [(1, [2]), (-1, [1, 3]), (0, [1, 2, 3])])
def test_direction_selects_crossings(direction, multiples):
    ev = og.Event(lambda t, y, args: y[0], direction=direction, terminal=False)
    sol = og.solve(oscillator, jnp.array([0.0, 1.0]), (0.0, 10.0), events=ev, step=TIGHT)
    n = int(sol.events.count)
    np.testing.assert_allclose(np.asarray(sol.events.ts[:n]) / np.pi, multiples, atol=1e-9)


def test_max_events_is_a_failure_that_names_it():
    ev = og.Event(lambda t, y, args: y[0], terminal=False)
    with pytest.raises(RuntimeError, match="max_events"):
        og.solve(oscillator, jnp.array([0.0, 1.0]), (0.0, 10.0), events=ev, max_events=2)
    sol = og.solve(
        oscillator, jnp.array([0.0, 1.0]), (0.0, 10.0), events=ev, max_events=2, throw=False
    )
    assert int(sol.result) == og.Result.max_events_reached
    np.testing.assert_allclose(sol.events.ts, [np.pi, 2 * np.pi], atol=1e-5)


@pytest.mark.parametrize(
    "event, match",
    [
        (og.Event(lambda t, y, a: y), "one scalar"),
        (og.Event(lambda t, y, a: y[0] > 0), "bool"),
        (og.Event(lambda t, y, a: y[0], terminal=False, update=lambda t, y, a: y[:1]), "shapes"),
        (og.Event(lambda t, y, a: y[0], terminal=False, update=lambda t, y, a: (y,)), "structure"),
        (
            og.Event(
                lambda t, y, a: y[0], terminal=False, update=lambda t, y, a: y.astype(jnp.float32)
            ),
            "dtype",
        ),
    ],
)
def test_bad_events_raise_at_trace_time(event, match):
    with pytest.raises((ValueError, TypeError), match=match):
        og.solve(oscillator, jnp.array([0.0, 1.0]), (0.0, 1.0), events=event)


def test_bad_event_arguments():
    with pytest.raises(ValueError, match="terminal=False"):
        og.Event(lambda t, y, a: y[0], update=lambda t, y, a: y)
    with pytest.raises(ValueError, match="direction"):
        og.Event(lambda t, y, a: y[0], direction=2)
    with pytest.raises(TypeError, match=r"og\.Event"):
        og.solve(oscillator, jnp.array([0.0, 1.0]), (0.0, 1.0), events=lambda t, y, a: y[0])
    with pytest.raises(ValueError, match="max_events"):
        og.solve(oscillator, jnp.array([0.0, 1.0]), (0.0, 1.0), events=HIT, max_events=0)


# -- batches with different event counts, partitioned solvers, progress, float32 -------------------
def test_vmap_members_with_different_event_counts():
    e = jnp.array([0.4, 0.6, 0.9])  # 3, 2 and 1 bounces before t = 1

    def run(e_):
        y0 = jnp.array([1.0, 0.0])
        args = {"e": e_, "g": 9.81}
        sol = og.solve(fall, y0, (0.0, 1.0), args, events=BOUNCE, step=TIGHT)
        return sol.events.count, sol.ys[-1, 0]

    counts, heights = jax.jit(jax.vmap(run))(e)
    one = jax.jit(run)  # (one compile for the three members)
    for k in range(3):
        c, h = one(e[k])
        assert int(counts[k]) == int(c)
        np.testing.assert_allclose(heights[k], h, atol=1e-10)
    assert len(set(np.asarray(counts).tolist())) == 3


def test_partitioned_solver_with_events():
    """Leapfrog on ``h' = v, v' = -g`` (exact at its grid points for a parabola; events are
    located on its interpolant, to about the step squared)."""

    def run(p):
        f_h = lambda t, v, a: v
        f_v = lambda t, h, a: -a["g"] * jnp.ones_like(h)
        ev = og.Event(
            lambda t, y, a: y[0],
            direction=-1,
            terminal=False,
            update=lambda t, y, a: (y[0], -a["e"] * y[1]),
        )
        sol = og.solve(
            (f_h, f_v),
            (p[0], jnp.zeros_like(p[0])),
            (0.0, T_BOUNCE),
            {"e": p[1], "g": p[2]},
            solver=og.Leapfrog(),
            step=og.Fixed(0.01),
            events=ev,
        )
        return sol.events.ts[:N_BOUNCES]

    # the solve and its Jacobian as one compiled program (eagerly, the solve runs op by op)
    times, jac = jax.jit(lambda p: (run(p), jax.jacrev(run)(p)))(P_BOUNCE)
    np.testing.assert_allclose(times, bounces_exact(P_BOUNCE)[0], atol=1e-3)
    np.testing.assert_allclose(jac, jax.jacfwd(lambda p: bounces_exact(p)[0])(P_BOUNCE), atol=1e-2)


@pytest.mark.slow
def test_progress_bar_with_events():
    sol = og.solve(fall, P_IMPACT[:2], (0.0, 5.0), {"g": 9.81}, events=HIT, progress=True)
    np.testing.assert_allclose(sol.ts[-1], impact_exact(P_IMPACT)[0], rtol=1e-6)


def test_float32():
    y0 = jnp.array([1.0, 2.0], jnp.float32)
    t_star = lambda h: og.solve(fall, jnp.stack([h, 2.0]), (0.0, 5.0), {"g": 9.81}, events=HIT)
    # the solve of y0 and the gradient as one compiled program (eagerly, the solve runs op by op)
    sol, grad = jax.jit(
        lambda y0, h: (
            og.solve(fall, y0, (0.0, 5.0), {"g": jnp.float32(9.81)}, events=HIT),
            jax.grad(lambda h: t_star(h).ts[-1])(h),
        )
    )(y0, jnp.float32(1.0))
    assert sol.ts.dtype == jnp.float32
    np.testing.assert_allclose(sol.ts[-1], impact_exact(P_IMPACT)[0], rtol=1e-5)
    exact = jax.grad(lambda h: impact_exact(jnp.stack([h, 2.0, 9.81]))[0])(1.0)
    np.testing.assert_allclose(grad, exact, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("solver", [og.Kvaerno5(), og.Rodas5(), og.Dopri8(), og.BS3()], ids=repr)
def test_other_solvers_locate_events(solver):
    """Implicit, Rosenbrock and other explicit solvers: their own dense output locates it."""

    def t_star(h):
        y0 = jnp.stack([h, jnp.asarray(2.0)])
        step = og.Adaptive(rtol=1e-8, atol=1e-8)
        return og.solve(fall, y0, (0.0, 5.0), {"g": 9.81}, events=HIT, solver=solver, step=step).ts[
            -1
        ]

    exact = lambda h: impact_exact(jnp.stack([h, 2.0, 9.81]))[0]
    np.testing.assert_allclose(t_star(1.0), exact(1.0), atol=1e-8)
    np.testing.assert_allclose(jax.grad(t_star)(1.0), jax.grad(exact)(1.0), atol=1e-6)


@pytest.mark.parametrize("second", ["hessian", "jacfwd_jacfwd"])
def test_second_derivatives_through_events_are_refused(second):
    """The event time has a first-order derivative rule; a Hessian through it missed the
    second-order terms (relative error 1.0 against the closed form for the impact time), so it
    raises rather than returning that."""

    def t_star(x):
        return og.solve(fall, x[:2], (0.0, 5.0), {"g": x[2]}, events=HIT).ts[-1]

    transform = jax.hessian if second == "hessian" else lambda g: jax.jacfwd(jax.jacfwd(g))
    with pytest.raises(NotImplementedError, match=r"second derivatives .* with events"):
        transform(t_star)(jnp.array([1.0, 2.0, 9.81]))
    # through a jit, where og.solve sees no derivative: the rule itself refuses (it returned a
    # Hessian with a zero column, silently). (Forward mode outside a jit fails in JAX.)
    if second == "hessian":
        with pytest.raises(NotImplementedError, match=r"second derivatives .* with events"):
            transform(jax.jit(t_star))(jnp.array([1.0, 2.0, 9.81]))
    # first derivatives stay available, forward and reverse (checked once: the other case)
    if second == "hessian":
        return
    exact = jax.grad(lambda x: impact_exact(x)[0])(jnp.array([1.0, 2.0, 9.81]))
    x = jnp.array([1.0, 2.0, 9.81])
    reverse, forward = jax.jit(lambda x: (jax.grad(t_star)(x), jax.jacfwd(t_star)(x)))(x)
    np.testing.assert_allclose(reverse, exact, rtol=1e-5)
    np.testing.assert_allclose(forward, exact, rtol=1e-5)


@pytest.mark.parametrize(
    "solver, adjoint",
    [
        (og.Rodas5P(), og.Interpolating()),  # (backward: Kvaerno5, its adjoint_solver)
        pytest.param(og.Tsit5(), og.Interpolating(solver=og.Kvaerno5()), marks=pytest.mark.slow),
        pytest.param(og.Kvaerno5(), og.Quadrature(), marks=pytest.mark.slow),
    ],
    ids=["rodas5p-interpolating", "tsit5-kvaerno5-backward", "kvaerno5-quadrature"],
)
def test_backward_stage_past_an_event_reads_its_own_side(solver, adjoint):
    """y' = -k y with a jump y -> a y + 0.3 t where y = c t (t* = 0.743): the gradient in
    (y0, k, c, a) against the closed form. Kvaerno5's third stage lies at 1.23 dt, past its
    step: on the backward step that ends at the event it read y from the forward step before
    the jump, and dL/dk (the rate of g reads y; the adjoint's own does not) was 9.4e-5 off."""
    ev = og.Event(lambda t, y, p: y - p[2] * t, direction=-1, terminal=False,
                  update=lambda t, y, p: p[3] * y + 0.3 * t)  # fmt: skip

    def exact(p):
        y0, k, c, a = p
        t = 0.5
        for _ in range(60):  # Newton for y0 exp(-k t) = c t
            t = t - (y0 * jnp.exp(-k * t) - c * t) / (-k * y0 * jnp.exp(-k * t) - c)
        return (a * y0 * jnp.exp(-k * t) + 0.3 * t) * jnp.exp(-k * (1.0 - t))

    def loss(p):
        sol = og.solve(lambda t, y, p: -p[1] * y, p[0], (0.0, 1.0), p, solver=solver,
                       adjoint=adjoint, events=ev, max_events=4,
                       step=og.Adaptive(rtol=1e-10, atol=1e-10))  # fmt: skip
        return sol.ys[-1]

    p = jnp.array([1.0, 0.7, 0.8, 0.5])
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(p), jax.grad(exact)(p), rtol=1e-8)


def test_a_crossing_within_the_part_of_a_step_another_event_cuts():
    """A ball thrown up from 1 at 2 m/s: its height crosses 1.1 upwards (event A) before its apex
    (event B), and back down within the same step: over the whole step A shows no sign change,
    only B's does. The step was cut at the apex, where A's sign had changed, and A was lost for
    good; a terminal A ran the solve on to t1. The root search now takes in every event whose
    sign changed up to its bracket's end, and starts again from the step's start."""
    f = lambda t, y, g: jnp.stack([y[1], -g * jnp.ones_like(y[0])])
    up = lambda t, y, g: y[0] - 1.1
    apex = og.Event(lambda t, y, g: y[1], direction=-1, terminal=False)

    def t_up(v, g):  # the first root of 1 + v t - g t^2 / 2 = 1.1
        return (v - jnp.sqrt(v**2 - 2 * g * 0.1)) / g

    for step in (og.Fixed(0.5), og.Adaptive(rtol=1e-3, atol=1e-3)):
        events = [og.Event(up, direction=1, terminal=False), apex]
        sol = og.solve(f, jnp.array([1.0, 2.0]), (0.0, 0.5), 9.81, events=events, step=step)
        np.testing.assert_allclose(sol.events.ts[:2], [t_up(2.0, 9.81), 2.0 / 9.81], rtol=1e-12)
        np.testing.assert_array_equal(sol.events.which[:2], [0, 1])

    def end(v, g):
        events = [og.Event(up, direction=1), apex]
        y0 = jnp.stack([jnp.ones_like(v), v])
        sol = og.solve(f, y0, (0.0, 0.5), g, events=events, step=og.Fixed(0.5))
        return sol.ts[-1], sol.ys[-1, 1]

    (t_end, v_end), grads = jax.jit(lambda v, g: jax.jvp(end, (v, g), (1.0, 0.5)))(2.0, 9.81)
    want = jax.jvp(lambda v, g: (t_up(v, g), v - g * t_up(v, g)), (2.0, 9.81), (1.0, 0.5))
    np.testing.assert_allclose((t_end, v_end), want[0], rtol=1e-12)
    np.testing.assert_allclose(grads, want[1], rtol=1e-9)
    adjoint_grad = jax.jit(jax.grad(lambda v, g: end(v, g)[1], argnums=(0, 1)))(2.0, 9.81)
    want_grad = jax.grad(lambda v, g: v - g * t_up(v, g), argnums=(0, 1))(2.0, 9.81)
    np.testing.assert_allclose(adjoint_grad, want_grad, rtol=1e-9)


def _ball(t, y, g):
    return jnp.stack([y[1], -g * jnp.ones_like(y[0])])


def _rises_past(v0, g):  # when a ball thrown up at v0 from 1 rises through 1.1
    return (v0 - jnp.sqrt(v0**2 - 0.2 * g)) / g


V0_EXCURSION = 0.5 + np.sqrt(0.2 * 9.81)  # above 1.1 for 0.26 s


def _excursion(v0, g, interp_points=None, step=None, adjoint=None):
    """``(first event time, count, step times)`` of the rise through 1.1 (not terminal)."""
    ev = og.Event(lambda t, y, g: y[0] - 1.1, direction=1, terminal=False,
                  interp_points=interp_points)  # fmt: skip
    sol = og.solve(_ball, jnp.stack([1.0, v0]), (0.0, 1.0), g, events=ev,
                   step=step or og.Adaptive(rtol=1e-6, atol=1e-6), saveat=og.SaveAt(steps=True),
                   adjoint=adjoint or og.Auto())  # fmt: skip
    return sol.events.ts[0], sol.events.count, sol.ts


def test_a_brief_excursion_inside_one_step_is_seen():
    """A ball's height above 1.1 for 0.26 s: Tsit5 integrates the parabola exactly, its steps
    grow past it, and the excursion lies inside one step. The default reads ``cond`` at three
    points inside each adaptive step and locates the upward crossing, its time's gradient
    exact; ``interp_points=0`` compares the ends only and misses it (documented), and so does
    the default on a fixed grid, where a step that does not resolve a transient would make
    false events (`test_interp_points_edges`: the state-size rule, dtmax, Discrete)."""
    v0 = V0_EXCURSION
    for interp_points, step, count in (
        (None, None, 1),
        (0, None, 0),
        (None, og.Fixed(0.5), 0),
        (3, og.Fixed(0.5), 1),
    ):
        t_star, n, ts = _excursion(v0, 9.81, interp_points, step)
        assert int(n) == count
        if count:
            np.testing.assert_allclose(t_star, _rises_past(v0, 9.81), rtol=1e-12)
        ts = np.asarray(ts)[np.isfinite(np.asarray(ts))]
        assert np.max(np.diff(ts)) > 0.26  # the excursion lies inside one step
    want = jax.grad(_rises_past, argnums=(0, 1))(v0, 9.81)
    grad = jax.jit(jax.grad(lambda v, g: _excursion(v, g)[0], (0, 1)))
    np.testing.assert_allclose(grad(v0, 9.81), want, rtol=1e-9)
    # a fixed step that does not resolve a transient has a dense output far from the solution
    # (ImplicitEuler's reads 3.6 inside the first step here, where y <= 1): no false event
    sol = og.solve(lambda t, y, lam: -lam * (y - jnp.cos(t)), 0.0, (0.0, 3.0), 50.0,
                   solver=og.ImplicitEuler(), step=og.Fixed(0.5),
                   events=og.Event(lambda t, y, lam: y - 1.05))  # fmt: skip
    assert int(sol.events.count) == 0 and float(sol.ts[-1]) == 3.0
    assert og.Event(lambda t, y, g: y[0], interp_points=np.int64(2)).interp_points == 2
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="interp_points"):
            og.Event(lambda t, y, g: y[0], interp_points=bad)


def test_float64_cond_on_a_float32_state():
    """A ``cond`` that returns float64 on a float32 state (x64 on): the dense output read for
    it stays in the state's dtype, the located time in the time's (a raw dtype TypeError
    before)."""
    cond = lambda t, y, g: (y[0] - 1.1).astype(jnp.float64)
    y0, step = jnp.array([1.0, V0_EXCURSION], jnp.float32), og.Adaptive(1e-5, 1e-5)
    sol = og.solve(_ball, y0, (0.0, 1.0), jnp.float32(9.81), events=og.Event(cond), step=step)
    assert sol.ys.dtype == jnp.float32 and int(sol.events.count) == 1
    np.testing.assert_allclose(sol.events.ts[0], _rises_past(V0_EXCURSION, 9.81), rtol=1e-5)


@pytest.mark.slow  # the default case: test_a_brief_excursion_inside_one_step_is_seen
def test_interp_points_edges():
    """``Adaptive(dtmax=0.01)`` finds the excursion with the ends only; Discrete's gradient
    through the located piece; the default reads the ends only on a state over 65536 entries."""
    v0 = V0_EXCURSION
    t_star, n, ts = _excursion(v0, 9.81, 0, og.Adaptive(rtol=1e-6, atol=1e-6, dtmax=0.01))
    assert int(n) == 1
    np.testing.assert_allclose(t_star, _rises_past(v0, 9.81), rtol=1e-12)
    assert np.max(np.diff(np.asarray(ts)[np.isfinite(np.asarray(ts))])) <= 0.01 * (1 + 1e-12)
    want = jax.grad(_rises_past, argnums=(0, 1))(v0, 9.81)
    t_of = lambda v, g: _excursion(v, g, adjoint=og.Discrete())[0]
    np.testing.assert_allclose(jax.jit(jax.grad(t_of, (0, 1)))(v0, 9.81), want, rtol=1e-9)
    big = lambda t, y, g: (_ball(t, y[0], g), jnp.zeros_like(y[1]))
    halves = og.Adaptive(rtol=1e-6, atol=1e-6, dt0=0.5, dtmax=0.5)  # the excursion in one step
    for size, count in ((2**16 - 2, 1), (2**16 - 1, 0)):  # 65536 and 65537 entries
        ev = og.Event(lambda t, y, g: y[0][0] - 1.1, direction=1, terminal=False)
        sol = og.solve(big, (jnp.array([1.0, v0]), jnp.zeros(size)), (0.0, 1.0), 9.81,
                       events=ev, step=halves)  # fmt: skip
        assert int(sol.events.count) == count


def test_step_bounds_are_checked():
    with pytest.raises(ValueError, match="dtmax must be a positive"):
        og.Adaptive(dtmax=0.0)
    with pytest.raises(ValueError, match="dtmin must not exceed dtmax"):
        og.Adaptive(dtmin=1.0, dtmax=0.1)
