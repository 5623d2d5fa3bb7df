"""Derivatives with respect to ``t0``, ``t1`` and ``SaveAt(ts)`` (``odegrad._times``).

Checked against central finite differences of the same tight solve, for every adjoint, forward
and backward in time, with the ``t0`` row (which saves ``y0`` itself and must not move), against
the analytic solution of ``y' = -k y``, in forward mode against reverse mode, under ``vmap``,
and on a right-hand side with a kink (``abs``): the time derivatives are ``f`` at the saved
states, whatever the adjoint does across kinks.
"""

from __future__ import annotations

import functools

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import odegrad as og  # noqa: E402

TIGHT = og.Adaptive(rtol=1e-11, atol=1e-11)
P = jnp.array([1.1, 0.4, 0.4, 0.1])
Y0 = jnp.array([1.0, 0.5])


def forced_lv(t, y, p):
    """Lotka–Volterra with a time-dependent forcing (so that d/dt0 is not -d/dt1)."""
    x, z = y
    return jnp.stack([p[0] * x - p[1] * x * z, -p[2] * z + p[3] * x * z + 0.1 * jnp.sin(t)])


def kinked(t, y, p):
    return jnp.stack([-p[0] * jnp.abs(y[0] - 0.6) + jnp.sin(t), p[1] * jnp.maximum(y[0], 0.7)])


@functools.cache
def loss_for(adjoint_name: str, rhs=forced_lv):
    def loss(t0, t1, ts, p):
        saveat = og.SaveAt(t0=True, ts=ts, t1=True)
        adjoint = getattr(og, adjoint_name)()
        sol = og.solve(rhs, Y0, (t0, t1), p, step=TIGHT, saveat=saveat, adjoint=adjoint)
        # every row weighted differently, and the saved times themselves
        weights = jnp.arange(1.0, 1.0 + sol.ts.shape[0])[:, None] * jnp.array([1.0, -0.5])
        return jnp.sum(weights * jnp.sin(sol.ys)) + 0.1 * jnp.sum(sol.ts**2)

    return jax.jit(loss), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def central_differences(fun, args, index, eps=1e-5):
    """Central differences of ``fun(*args)`` in argument ``index`` (a scalar or a vector)."""
    x = np.asarray(args[index], float)
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[i] = eps
        plus = [*args[:index], x + step, *args[index + 1 :]]
        minus = [*args[:index], x - step, *args[index + 1 :]]
        out[i] = (float(fun(*plus)) - float(fun(*minus))) / (2 * eps)
    return out


SLOW = pytest.mark.slow
ADJOINTS = [
    pytest.param("Auto", marks=SLOW),  # (Auto's time gradients: test_kinked_rhs_time_gradients)
    "Discrete",
    "Interpolating",
    "Forward",
    pytest.param("Quadrature", marks=SLOW),
    pytest.param("Backsolve", marks=SLOW),
]


@pytest.mark.parametrize("adjoint_name", ADJOINTS)
@pytest.mark.parametrize("backward", [False, pytest.param(True, marks=SLOW)])
def test_time_gradients_match_finite_differences(adjoint_name, backward):
    loss, grad = loss_for(adjoint_name)
    t0, t1, ts = 0.0, 2.0, jnp.array([0.3, 1.1, 1.7])
    if backward:
        t0, t1, ts = 2.0, 0.0, ts[::-1]
    args = (jnp.asarray(t0), jnp.asarray(t1), ts, P)
    got = grad(*args)
    for i, name in enumerate(("t0", "t1", "ts", "p")):
        fd = central_differences(loss, args, i)
        err = np.max(np.abs(np.asarray(got[i]) - fd)) / np.max(np.abs(fd))
        print(f"{adjoint_name} backward={backward} d/d{name}: {err:.1e}")
        assert err < 1e-6, (name, np.asarray(got[i]), fd)


def test_kinked_rhs_time_gradients():
    loss, grad = loss_for("Auto", kinked)
    args = (jnp.asarray(0.0), jnp.asarray(2.0), jnp.array([0.5, 1.5]), P)
    got = grad(*args)
    for i in range(3):
        fd = central_differences(loss, args, i)
        np.testing.assert_allclose(got[i], fd, rtol=1e-6, atol=1e-8)


def test_decay_analytic_both_modes():
    """``y(t) = exp(-k (t - t0))``: ``dy(s)/dt0 = k y(s)``, ``dy(t1)/dt1 = -k y(t1)``; the t0
    row is ``y0`` and does not move."""
    k, t0, s, t1 = 2.0, 0.25, 0.5, 1.0

    def rows(t0, t1, s):
        saveat = og.SaveAt(t0=True, ts=jnp.reshape(s, (1,)), t1=True)
        return og.solve(lambda t, y, a: -a * y, jnp.ones(1), (t0, t1), k, step=TIGHT,
                        saveat=saveat).ys[:, 0]  # fmt: skip

    y_s, y_1 = np.exp(-k * (s - t0)), np.exp(-k * (t1 - t0))
    jac_expected = np.array(
        [[0.0, 0.0, 0.0], [k * y_s, 0.0, -k * y_s], [k * y_1, -k * y_1, 0.0]]
    )  # rows (t0, s, t1) by (d t0, d t1, d s)
    reverse = np.stack(jax.jit(jax.jacrev(rows, argnums=(0, 1, 2)))(t0, t1, s), axis=1)
    forward = np.stack(jax.jit(jax.jacfwd(rows, argnums=(0, 1, 2)))(t0, t1, s), axis=1)
    np.testing.assert_allclose(reverse, jac_expected, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(forward, jac_expected, rtol=1e-8, atol=1e-10)


def test_vmap_over_t1_and_eager():
    def y_end(t1):
        return og.solve(lambda t, y, a: -a * y, jnp.ones(1), (0.0, t1), 2.0, step=TIGHT).ys[-1, 0]

    t1s = jnp.array([0.5, 1.0, 2.0])
    expected = -2.0 * np.exp(-2.0 * np.asarray(t1s))
    np.testing.assert_allclose(jax.vmap(jax.grad(y_end))(t1s), expected, rtol=1e-8)
    np.testing.assert_allclose(jax.grad(y_end)(1.0), expected[1], rtol=1e-8)  # eager


def test_second_derivative_in_time_is_refused():
    def y_end(t1):
        return og.solve(lambda t, y, a: -a * y, jnp.ones(1), (0.0, t1), 2.0).ys[-1, 0]

    with pytest.raises(NotImplementedError, match="second derivatives with respect to t_span"):
        jax.hessian(y_end)(1.0)


def test_forward_mode_under_jit_and_grad_of_jit():
    """jax.jit(jax.jvp(...)) in the times (JAX refuses a custom VJP's forward mode only when
    lowering: the forward rule is chosen from the inputs), and jax.grad(jax.jit(loss)) of a
    solve with constant times (they stay concrete arrays, which the adjoints' custom VJPs may
    close over)."""

    def y_end(t1, k):
        return og.solve(lambda t, y, a: -a * y, jnp.ones(1), (0.0, t1), k, step=TIGHT).ys[-1, 0]

    tangent = jax.jit(lambda t1: jax.jvp(lambda s: y_end(s, 2.0), (t1,), (1.0,))[1])(1.0)
    np.testing.assert_allclose(tangent, -2.0 * np.exp(-2.0), rtol=1e-8)
    grad_k = jax.grad(jax.jit(lambda k: y_end(1.0, k)))(2.0)
    np.testing.assert_allclose(grad_k, -np.exp(-2.0), rtol=1e-8)
    # save times and a fixed grid, with the custom-VJP adjoints (their rules closed over the
    # jit trace's arrays of times: "No constant handler for type: DynamicJaxprTracer")
    ts = jnp.linspace(0.0, 2.0, 5)
    exact = float(np.sum(-np.asarray(ts) * np.exp(-0.7 * np.asarray(ts))))
    # (the custom VJPs on both kinds of grid, Forward on one: each case is its own program)
    cases = [(og.Discrete(), og.Fixed(0.01)), (og.Interpolating(), TIGHT),
             (og.Interpolating(), og.Fixed(0.01)), (og.Forward(), TIGHT)]  # fmt: skip
    for adjoint, step in cases:

        def saved(k, adjoint=adjoint, step=step):
            sol = og.solve(lambda t, y, a: -a * y, jnp.ones(1), (0.0, 2.0), k, step=step,
                           saveat=og.SaveAt(ts=ts), adjoint=adjoint)  # fmt: skip
            return jnp.sum(sol.ys)

        got = jax.grad(jax.jit(saved))(0.7)
        np.testing.assert_allclose(got, exact, rtol=1e-6, err_msg=f"{adjoint} {step}")


@pytest.mark.parametrize(
    "adjoint",
    # (Auto's grad of a jit: test_step_grid_made_inside_jit_is_held_constant)
    [pytest.param(og.Auto(), marks=SLOW), og.Discrete(),
     pytest.param(og.Discrete("all"), marks=SLOW), og.Interpolating(),
     pytest.param(og.Forward(), marks=SLOW), pytest.param(og.Backsolve(), marks=SLOW),
     pytest.param(og.Quadrature(), marks=SLOW)],
    ids=lambda a: repr(a),
)  # fmt: skip
def test_grad_of_jit_with_times_computed_inside(adjoint):
    """jax.grad outside a jax.jit whose loss makes the times from its arguments (t1 = T, save
    times jnp.linspace(0, T, 5)), an integer in args and an integer f closes over: the
    adjoints' custom VJPs took such values from the jit trace by closure, and the gradient,
    traced after that trace ended, failed ("No constant handler for type:
    DynamicJaxprTracer"); with T differentiated too it failed as a "closed-over value"."""
    y0 = jnp.array([1.0, 2.0])

    def loss(k, T, n, m):
        f = lambda t, y, a: -a[0] * y * a[1] / m  # a[1] == m: the decay rate is k
        ts = jnp.linspace(0.0, T, 5)
        sol = og.solve(f, y0, (0.0, T), (k, n), step=TIGHT, saveat=og.SaveAt(ts=ts),
                       adjoint=adjoint)  # fmt: skip
        return jnp.sum(sol.ys)

    k, T, i = 0.7, 2.0, np.arange(5)
    ts = i * T / 4
    exact_k = 3 * np.sum(-ts * np.exp(-k * ts))
    exact_T = 3 * np.sum(-k * (i / 4) * np.exp(-k * ts))
    n = jnp.int32(3)
    got = jax.grad(jax.jit(loss), argnums=(0, 1))(k, T, n, n)
    np.testing.assert_allclose(got, (exact_k, exact_T), rtol=1e-8)
    got_k = jax.grad(jax.jit(loss))(k, T, n, n)  # T traced but not differentiated
    np.testing.assert_allclose(got_k, exact_k, rtol=1e-8)


@pytest.mark.parametrize("solver", [og.SemiImplicitEuler(), og.Leapfrog()], ids=repr)
def test_partitioned_grad_of_jit_with_traced_span(solver):
    """A partitioned f (each half closing over a jit argument) with t1 traced, on fixed steps:
    both orders of jit and grad agree, and match the oscillator's closed form to the method's
    order. u' = v, v' = -k u, u(0) = 1, v(0) = 0: u(T) = cos(w T), w = sqrt(k)."""

    def loss(k, T):
        f = (lambda t, v, a: v, lambda t, u, a: -k * u)
        sol = og.solve(f, (jnp.asarray(1.0), jnp.asarray(0.0)), (0.0, T), solver=solver,
                       step=og.Fixed(1e-3))  # fmt: skip
        return sol.ys[0][-1]

    k, T = 2.0, 1.3
    w = np.sqrt(k)
    exact = (-np.sin(w * T) * T / (2 * w), -w * np.sin(w * T))
    outside = jax.grad(jax.jit(loss), argnums=(0, 1))(k, T)
    inside = jax.jit(jax.grad(loss, argnums=(0, 1)))(k, T)
    np.testing.assert_allclose(outside, inside, rtol=1e-12)
    # first order (SemiImplicitEuler, dt = 1e-3) or second (Leapfrog)
    tol = 1e-3 if isinstance(solver, og.SemiImplicitEuler) else 2e-6
    np.testing.assert_allclose(outside, exact, rtol=tol)


def test_grad_of_jit_with_events_and_traced_span():
    """Events hold the times constant: under jax.grad(jax.jit(loss)) with a traced t1 the
    parameters' gradient is right, and a derivative reaching t1 raises (it would be zero)."""
    event = og.Event(lambda t, y, a: y[0] - 0.1, terminal=True)

    def loss(k, T):
        sol = og.solve(lambda t, y, a: -a * y, jnp.ones(1), (0.0, T), k, step=TIGHT,
                       events=[event])  # fmt: skip
        return sol.ts[-1]  # the event's time, log(10) / k

    np.testing.assert_allclose(jax.grad(jax.jit(loss))(2.0, 5.0), -np.log(10.0) / 4.0, rtol=1e-8)
    with pytest.raises(ValueError, match="holds constant"):
        jax.grad(jax.jit(loss), argnums=1)(2.0, 5.0)


@pytest.mark.parametrize(
    "adjoint", [og.Discrete(), pytest.param(og.Interpolating(), marks=SLOW)], ids=repr
)
def test_grad_of_jit_with_traced_tolerance(adjoint):
    """A tolerance passed into the jitted loss (og.Adaptive(rtol=rtol)): the controller the
    adjoints' rules use is rebuilt from their arguments (it was a leaked tracer)."""

    def loss(k, rtol):
        step = og.Adaptive(rtol=rtol, atol=1e-10)
        sol = og.solve(lambda t, y, a: -a * y, jnp.ones(2), (0.0, 1.0), k, step=step,
                       adjoint=adjoint)  # fmt: skip
        return jnp.sum(sol.ys)

    got = jax.grad(jax.jit(loss))(0.7, 1e-10)
    np.testing.assert_allclose(got, -2 * np.exp(-0.7), rtol=1e-8)


def test_t_span_as_an_array():
    """t_span as an array [t0, t1] (scipy's solve_ivp takes one): eager, under jit, and
    differentiated, d/dt0 and d/dt1 of y(t1) = exp(-(t1 - t0)) against the closed form."""
    f = lambda t, y, k: -k * y
    y_end = lambda span: og.solve(f, jnp.ones(1), span, 1.0, step=TIGHT).ys[-1, 0]
    e = np.exp(-1.0)
    for span in (np.array([0.0, 1.0]), jnp.array([0.0, 1.0])):
        np.testing.assert_allclose(y_end(span), e, rtol=1e-9)
    np.testing.assert_allclose(jax.jit(y_end)(jnp.array([0.0, 1.0])), e, rtol=1e-9)
    np.testing.assert_allclose(jax.grad(y_end)(jnp.array([0.0, 1.0])), [e, -e], rtol=1e-8)


def test_constants_refuse_derivatives_and_static_grids_keep_forward_mode():
    """A tolerance has no derivative: differentiating it raises whether the times are traced
    or not (with a traced span it was a silent zero), and a solve on an og.Fixed grid with
    save times made inside a jit keeps its plain scan, so jax.jvp outside the jit works."""
    f = lambda t, y, k: -k * y

    def by_rtol(k, rtol, T):
        step = og.Adaptive(rtol=rtol, atol=1e-10)
        return og.solve(f, jnp.ones(1), (0.0, T), k, step=step).ys[-1, 0]

    with pytest.raises(ValueError, match="holds constant: a tolerance"):
        jax.grad(jax.jit(by_rtol), argnums=1)(0.7, 1e-9, 0.6)
    with pytest.raises(ValueError, match="holds constant: a tolerance"):
        jax.grad(by_rtol, argnums=(1, 2))(0.7, 1e-9, 0.6)

    def saved(k):
        ts = jnp.linspace(0.0, 0.6, 4)[1:]
        sol = og.solve(f, jnp.ones(1), (0.0, 0.6), k, step=og.Fixed(0.01),
                       saveat=og.SaveAt(ts=ts), adjoint=og.Discrete("all"))  # fmt: skip
        return sol.ys[-1, 0]

    tangent = jax.jvp(jax.jit(saved), (0.7,), (1.0,))[1]
    np.testing.assert_allclose(tangent, -0.6 * np.exp(-0.42), rtol=1e-8)


@pytest.mark.parametrize(
    "adjoint", [og.Auto(), og.Discrete("all"), pytest.param(og.Discrete(2), marks=SLOW)], ids=repr
)
def test_step_grid_made_inside_jit_is_held_constant(adjoint):
    """og.StepTo(ts) with ts made inside the jitted loss from T: the grid is held constant by
    every adjoint, so a jax.grad outside the jit that reaches it raises. Auto and
    Discrete("all") run a plain scan, which JAX itself differentiated (the discretisation's
    dependence on its steps) where the other adjoints raised. The parameter's gradient stands,
    against central differences, and so does jax.jvp outside the jit."""
    f = lambda t, y, k: -k * y + jnp.sin(t)

    def loss(k, T):
        ts = jnp.linspace(0.0, T, 41)
        sol = og.solve(f, jnp.ones(2), (0.0, T), k, solver=og.RK4(), step=og.StepTo(ts),
                       saveat=og.SaveAt(ts=ts[::4]), adjoint=adjoint)  # fmt: skip
        return jnp.sum(sol.ys)

    with pytest.raises(ValueError, match=r"holds constant: a tolerance, og\.Fixed"):
        jax.grad(jax.jit(loss), argnums=1)(0.7, 2.0)
    expected = central_differences(loss, (0.7, 2.0), 0, eps=1e-6)
    np.testing.assert_allclose(jax.grad(jax.jit(loss))(0.7, 2.0), expected, rtol=1e-8)
    if not isinstance(adjoint, og.Discrete) or adjoint.checkpoints == "all":
        tangent = jax.jvp(jax.jit(lambda k: loss(k, 2.0)), (0.7,), (1.0,))[1]
        np.testing.assert_allclose(tangent, expected, rtol=1e-8)


def test_float32_state_with_float64_span():
    """Under x64 a float32 state takes float32 times whatever the span's dtype (a float64 jit
    argument made f's hoisted jaxpr refuse them). Against the analytic solution of
    ``y' = a sin(t) y``: ``y(t1) = y0 exp(a (1 - cos t1))``."""
    y0 = jnp.ones(3, jnp.float32)
    f = lambda t, y, a: a * jnp.sin(t) * y

    def loss(a, t1):
        sol = og.solve(f, y0, (0.0, t1), a, step=og.Adaptive(rtol=1e-6, atol=1e-7))
        return jnp.sum(sol.ys)

    a, t1 = jnp.float32(0.5), 1.0
    value, (da, dt1) = jax.jit(jax.value_and_grad(loss, (0, 1)))(a, t1)
    assert value.dtype == jnp.float32
    exact = 3 * np.exp(0.5 * (1 - np.cos(1.0)))
    np.testing.assert_allclose(value, exact, rtol=1e-5)
    np.testing.assert_allclose(da, exact * (1 - np.cos(1.0)), rtol=1e-4)
    np.testing.assert_allclose(dt1, exact * 0.5 * np.sin(1.0), rtol=1e-4)
