"""Every documented input error: its exception type, and a message that names the offending
argument and says how to fix it. Most raise while ``og.solve`` checks its inputs, before
anything is compiled, so the file is fast; the last section (a non-finite y0 or f(t0, y0, args),
found as the solve runs) compiles tiny solves."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odegrad as og


@contextlib.contextmanager
def raises(exc, *fragments):
    """``pytest.raises(exc)`` and every fragment (plain text) in the message."""
    with pytest.raises(exc) as info:
        yield info
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


def decay(t, y, args):
    return -y


Y0 = jnp.ones(3)


def fu(t, v, args):
    return v


def fv(t, u, args):
    return -u


# --------------------------------------------------------------------------------------------
# the right-hand side


def test_f_returns_other_structure():
    y0 = {"a": jnp.ones(2), "b": jnp.asarray(1.0)}
    with raises(ValueError, "f returned structure", "same pytree structure as y0"):
        og.solve(lambda t, y, a: (y["a"], y["b"]), y0, (0.0, 1.0))


def test_f_returns_other_shape():
    with raises(ValueError, "f returned a leaf of shape (2,)", "(3,)", "shapes of y0"):
        og.solve(lambda t, y, a: -y[:2], Y0, (0.0, 1.0))


def test_f_returns_other_dtype():
    """A float32 state whose f computes in float64 (a closed-over float64 constant)."""
    k = jnp.asarray(2.0, jnp.float64)
    with raises(ValueError, "f returned dtype float64", "float32", ".astype(float32)"):
        og.solve(lambda t, y, a: -k * y, jnp.ones(3, jnp.float32), (0.0, 1.0))


def test_partitioned_half_returns_other_shape():
    """The check names which half of a partitioned f is wrong."""
    with raises(ValueError, "f_v returned a leaf of shape (1,)", "(2,)"):
        og.solve(
            (fu, lambda t, u, a: -u[:1]),
            (jnp.ones(2), jnp.zeros(2)),
            (0.0, 1.0),
            solver=og.Leapfrog(),
            step=og.Fixed(0.1),
        )


# --------------------------------------------------------------------------------------------
# the time span and save times


@pytest.mark.parametrize(
    "step",
    [og.Adaptive(), pytest.param(og.Fixed(0.1), marks=pytest.mark.slow)],  # (the same loop)
    ids=["adaptive", "fixed"],
)
def test_t_span_equal_ends(step):
    """An empty span is the solution y0 with no step taken (it was refused; a traced one, and
    diffrax, gave y0), and its gradient the identity."""
    sol = og.solve(decay, Y0, (1.0, 1.0), step=step, saveat=og.SaveAt(t0=True, ts=[1.0], t1=True))
    np.testing.assert_array_equal(sol.ys, np.ones((3, 3)))
    assert int(sol.stats["steps"]) == 0 and int(sol.result) == og.Result.success
    grad = jax.grad(lambda y: og.solve(decay, y, (0, 0.0), step=step).ys[-1].sum())(Y0)
    np.testing.assert_array_equal(grad, np.ones(3))


@pytest.mark.parametrize("span", [(0.0,), (0.0, 1.0, 2.0), 1.0])
def test_t_span_not_a_pair(span):
    with raises(ValueError, "t_span=", "must be a pair (t0, t1)"):
        og.solve(decay, Y0, span)


def test_t_span_not_finite():
    with raises(ValueError, "t_span=", "must be finite"):
        og.solve(decay, Y0, (0.0, np.inf))


@pytest.mark.parametrize(
    "where, build",
    [
        ("Fixed(dt)", lambda T: dict(t_span=(0.0, 1.0), step=og.Fixed(T / 10))),
        ("StepTo(ts)", lambda T: dict(t_span=(0.0, T), step=og.StepTo(jnp.linspace(0.0, T, 5)))),
    ],
)
@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_differentiated_step_grid_named(where, build, transform):
    """Differentiating through a step size or step grid raised a leaked-tracer error deep
    inside JAX; the message names the input and the fix."""

    def loss(T):
        kw = build(T)
        return og.solve(decay, Y0, kw.pop("t_span"), **kw).ys[-1].sum()

    fragments = ("is being differentiated", "stop_gradient")
    if where == "StepTo(ts)":  # t_span moves too: the time derivatives refuse a given grid
        fragments = ("t_span or SaveAt(ts) is being differentiated", "step=og.StepTo(ts)")
    with raises(ValueError, where, *fragments):
        if transform == "grad":
            jax.jit(jax.grad(loss))(1.0)
        else:
            jax.jvp(loss, (1.0,), (1.0,))


@pytest.mark.parametrize(
    "where, kw",
    [
        ("SaveAt(dense=True)", dict(saveat=og.SaveAt(t1=True, dense=True))),
        ("SaveAt(fn=...)", dict(saveat=og.SaveAt(t1=True, fn=lambda t, y, a: y[0]))),
        ("events=", dict(events=og.Event(lambda t, y, a: y[0] - 0.5))),
    ],
)
def test_differentiated_t_span_unsupported_outputs_named(where, kw):
    def loss(T):
        return jnp.sum(og.solve(decay, Y0, (0.0, T), **kw).ys[-1])

    with raises(ValueError, "t_span or SaveAt(ts) is being differentiated", where, "T * f(t0"):
        jax.grad(loss)(1.0)


def test_differentiated_times_advice_works():
    """The message's rescaling gives d/dT of the solve over (0, T): d y(T) / dT = f(T, y(T))."""

    def f(t, y, a):
        return -a * y + jnp.sin(t)

    def scaled(s, y, args):
        T, a = args
        return T * f(s * T, y, a)

    tight = og.Adaptive(rtol=1e-6, atol=1e-6)

    def loss(T):
        sol = og.solve(scaled, Y0, (0.0, 1.0), (T, 0.7), step=tight, adjoint=og.Forward())
        return sol.ys[-1].sum()

    y1 = og.solve(f, Y0, (0.0, 1.3), 0.7, step=tight).ys[-1]
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(1.3), f(1.3, y1, 0.7).sum(), rtol=1e-4)
    # and t1 differentiated directly (odegrad._times) gives the same
    direct = jax.grad(lambda T: og.solve(f, Y0, (0.0, T), 0.7, step=tight).ys[-1].sum())(1.3)
    np.testing.assert_allclose(direct, f(1.3, y1, 0.7).sum(), rtol=1e-4)


@pytest.mark.parametrize(
    "ts", [jnp.array([0.7, 0.2]), jnp.array([0.5, 2.0])], ids=["unsorted", "outside"]
)
def test_traced_saveat_ts_checked_when_run(ts):
    """Save times traced under jit cannot be checked when traced: out of order they gave
    values off by 4e-4 and a gradient that disagreed between adjoints, outside the span an
    inf row, both with result success. The solve's result says so now."""
    run = jax.jit(lambda ts, throw: og.solve(decay, Y0, (0.0, 1.0), saveat=og.SaveAt(ts=ts),
                                             throw=throw), static_argnums=1)  # fmt: skip
    with raises(Exception, "SaveAt(ts) must be sorted", "inside t_span"):
        jax.block_until_ready(run(ts, True).ys)
    assert int(run(ts, False).result) == og.Result.invalid_save_times
    good = run(jnp.array([0.2, 0.7]), True)
    assert int(good.result) == og.Result.success
    np.testing.assert_allclose(good.ys[:, 0], np.exp(-np.array([0.2, 0.7])), rtol=1e-5)


def test_traced_step_to_checked_when_run():
    """A traced StepTo(ts) off the span or out of order stepped y0 from ts[0] and called the
    state at ts[-1] the one at t1, with result success (y(1) = 0.61 for 0.37). The result
    says so now; throw=True raises, naming the rule."""

    def solve(ts, throw):
        return og.solve(decay, Y0, (0.0, 1.0), solver=og.RK4(), step=og.StepTo(ts), throw=throw)

    run = jax.jit(solve, static_argnums=1)
    bad = [[0.5, 0.75, 1.0], [0.0, 0.25, 0.5], [0.0, 0.7, 0.3, 1.0]]
    for ts in bad:
        assert int(run(jnp.array(ts), False).result) == og.Result.invalid_step_times, ts
    with raises(RuntimeError, "StepTo(ts) must run strictly monotonically"):
        jax.block_until_ready(run(jnp.array(bad[0]), True).ys)
    good = run(jnp.array([0.0, 0.5, 1.0]), True)
    np.testing.assert_allclose(good.ys[-1, 0], np.exp(-1.0), rtol=1e-2)


@pytest.mark.parametrize("step", [og.Fixed(0.1), og.Adaptive()], ids=["fixed", "adaptive"])
def test_traced_t_span_not_finite(step):
    """A traced t1 that is nan took no step and returned y0 as a success; it is
    Result.invalid_t_span (a concrete one raises at once, test_t_span_not_finite)."""

    def run(t1, throw=True):
        return og.solve(decay, Y0, (0.0, t1), step=step, throw=throw)

    results = jax.jit(jax.vmap(lambda t1: run(t1, False).result))(jnp.array([1.0, jnp.nan]))
    assert results.tolist() == [og.Result.success, og.Result.invalid_t_span]
    with raises(RuntimeError, "t_span holds inf or nan", "as t_span was traced"):
        jax.block_until_ready(jax.jit(lambda t1: run(t1).ys)(jnp.nan))


def test_backsolve_gradient_of_failed_solve_is_nan():
    """With throw=False, a forward solve that blew up gives a nan gradient through Backsolve;
    re-integrating from its non-finite end is not reported as a drift (it raised "drifted
    by inf tolerances")."""

    def loss(a):
        sol = og.solve(lambda t, y, a: a * y**2, 1.0, (0.0, 2.0), a, step=og.Fixed(0.1),
                       throw=False, adjoint=og.Backsolve())  # fmt: skip
        return jnp.sum(jnp.where(jnp.isfinite(sol.ys), sol.ys, 0.0))

    assert np.isnan(float(jax.jit(jax.grad(loss))(1.0)))


def test_saveat_ts_unsorted():
    with raises(ValueError, "SaveAt(ts)", "sorted in the direction of integration", "ascending"):
        og.solve(decay, Y0, (0.0, 1.0), saveat=og.SaveAt(ts=jnp.array([0.2, 0.8, 0.5])))


def test_saveat_ts_ascending_for_backward_solve():
    with raises(ValueError, "SaveAt(ts)", "descending for t1 < t0"):
        og.solve(decay, Y0, (1.0, 0.0), saveat=og.SaveAt(ts=jnp.array([0.2, 0.5])))


@pytest.mark.parametrize(
    "span, ts, bad",
    [
        ((0.0, 1.0), [0.5, 1.5], "1.5"),
        ((0.0, 1.0), [-0.1, 0.5], "-0.1"),
        ((1.0, 0.0), [2.0], "2.0"),
    ],
)
def test_saveat_ts_outside_span(span, ts, bad):
    with raises(ValueError, "SaveAt(ts)", bad, "outside t_span", "inside the span"):
        og.solve(decay, Y0, span, saveat=og.SaveAt(ts=jnp.array(ts)))


def test_saveat_misuse():
    with raises(ValueError, "SaveAt() saves nothing", "SaveAt(t1=True)"):
        og.SaveAt()
    with raises(ValueError, "either ts=... or steps=True", "dense=True"):
        og.SaveAt(ts=jnp.array([0.5]), steps=True)
    with raises(ValueError, "SaveAt(ts): ts must be 1-d", "(2, 2)"):
        og.SaveAt(ts=jnp.ones((2, 2)))
    with raises(TypeError, "SaveAt(fn=...)", "callable fn(t, y, args)"):
        og.SaveAt(t1=True, fn=3.0)


def test_evaluate_without_dense():
    sol = og.solve(decay, Y0, (0.0, 1.0), solver=og.Euler(), step=og.Fixed(0.5))
    with raises(ValueError, "sol.evaluate(t) needs dense output", "SaveAt(dense=True"):
        sol.evaluate(0.3)


# --------------------------------------------------------------------------------------------
# step controllers


@pytest.mark.parametrize("dt", [0.0, -0.1, np.inf, np.nan])
def test_fixed_dt_not_positive(dt):
    with raises(ValueError, "Fixed(dt=", "positive and finite", "t1 < t0 integrates backwards"):
        og.Fixed(dt)


def test_adaptive_bad_tolerances():
    with raises(ValueError, "Adaptive(rtol=-1e-06)", "non-negative"):
        og.Adaptive(rtol=-1e-6)
    with raises(ValueError, "Adaptive(atol=-1.0)", "non-negative"):
        og.Adaptive(atol=-1.0)
    with raises(ValueError, "rtol and atol cannot both be zero"):
        og.Adaptive(rtol=0.0, atol=0.0)
    with raises(ValueError, "Adaptive(dt0=-0.1)", "positive", "None for an automatic"):
        og.Adaptive(dt0=-0.1)


def test_max_steps_too_small_for_fixed_count():
    with raises(ValueError, "takes 100 steps but max_steps=50", "max_steps>=100", "larger dt"):
        og.solve(decay, Y0, (0.0, 1.0), solver=og.RK4(), step=og.Fixed(0.01), max_steps=50)


def test_max_steps_too_small_for_step_to():
    with raises(ValueError, "StepTo(ts) takes 10 steps but max_steps=5", "max_steps>=10"):
        og.solve(
            decay,
            Y0,
            (0.0, 1.0),
            solver=og.RK4(),
            step=og.StepTo(jnp.linspace(0.0, 1.0, 11)),
            max_steps=5,
        )


@pytest.mark.parametrize("max_steps", [0, -3, 2.5])
def test_max_steps_not_positive_int(max_steps):
    with raises(ValueError, f"max_steps={max_steps!r}", "positive int"):
        og.solve(decay, Y0, (0.0, 1.0), max_steps=max_steps)


def test_step_to_bad_grid():
    with raises(ValueError, "StepTo(ts)", "ts must start at t0=0.0 and end at t1=1.0"):
        og.solve(decay, Y0, (0.0, 1.0), solver=og.RK4(), step=og.StepTo(jnp.array([0.1, 1.0])))
    with raises(ValueError, "StepTo(ts)", "strictly monotonic in the direction of t_span"):
        og.solve(
            decay, Y0, (0.0, 1.0), solver=og.RK4(), step=og.StepTo(jnp.array([0.0, 0.6, 0.4, 1.0]))
        )
    with raises(ValueError, "StepTo(ts)", "1-d array of at least 2 times"):
        og.StepTo(jnp.array([0.0]))


@pytest.mark.parametrize(
    "solver",
    [og.Euler(), og.Midpoint(), og.Ralston(), og.RK4(), og.Leapfrog(), og.SemiImplicitEuler()],
)
def test_adaptive_without_error_estimate(solver):
    f = (fu, fv) if solver.partitioned else decay
    y0 = (jnp.ones(2), jnp.zeros(2)) if solver.partitioned else Y0
    with raises(ValueError, "step=og.Adaptive(...) needs an error estimate", "og.Fixed(dt)"):
        og.solve(f, y0, (0.0, 1.0), solver=solver)  # the default step is Adaptive
    with raises(ValueError, "needs an error estimate", repr(solver)):
        og.solve(f, y0, (0.0, 1.0), solver=solver, step=og.Adaptive(rtol=1e-3))


# --------------------------------------------------------------------------------------------
# partitioned solvers


def test_failed_backward_solve_raises_or_gives_nan():
    """A continuous adjoint's backward solve that fails (here out of steps: 1000 fixed steps
    per interval against max_steps=50) is not a silently truncated gradient: with throw it
    raises, naming why and where; with throw=False the gradient is nan."""
    f = lambda t, y, a: -a * y

    def grad(a, throw=True, dt=1e-3):
        adjoint = og.Interpolating(step=og.Fixed(dt))
        loss = lambda a: og.solve(f, jnp.ones(2), (0.0, 1.0), a, max_steps=50, throw=throw,
                                  adjoint=adjoint).ys.sum()  # fmt: skip
        return jax.grad(loss)(a)

    with pytest.raises(Exception, match=r"out of steps \(max_steps=50 per interval\) at t=0.95"):
        grad(1.0)
    assert np.isnan(float(grad(1.0, throw=False)))
    np.testing.assert_allclose(grad(1.0, dt=0.1), -2 * np.exp(-1.0), rtol=1e-3)


def test_backward_solve_made_nonfinite_raises_loss_nan_does_not():
    """A backward solve that goes non-finite from a finite adjoint raises with throw (a vjp that
    overflows below t = 0.5 stands in for float32 Robertson's, below; Backsolve too, whose
    re-integrated state stays finite); a nan the loss brings in stays the gradient's nan."""

    def overflowing_vjp(t, y, k, ct):
        _, pull = jax.vjp(lambda y_, k_: -k_ * y_, y, k)
        cy, ck = pull(ct)
        return jnp.where(t < 0.5, jnp.inf, 1.0) * cy, ck

    for adjoint in (og.Interpolating(vjp=overflowing_vjp), og.Backsolve(vjp=overflowing_vjp)):
        overflows = lambda k, a=adjoint: og.solve(lambda t, y, k: -k * y, Y0, (0.0, 1.0), k,
                                                  adjoint=a)  # fmt: skip
        with pytest.raises(Exception, match=r"went non-finite from a finite adjoint.*at t=0.5"):
            jax.jit(jax.grad(lambda k, o=overflows: o(k).ys.sum()))(1.0)
    nan_loss = lambda y0: og.solve(decay, y0, (0.0, 1.0), adjoint=og.Interpolating()).ys.sum()
    assert np.isnan(np.asarray(jax.grad(lambda y0: nan_loss(y0) * jnp.nan)(jnp.ones(2)))).all()
    # a nan at a middle save (missing data), which the columns take in inside a backward step
    ts = jnp.linspace(0.1, 1.0, 10)
    w = jnp.where(jnp.arange(10) == 4, jnp.nan, 1.0)[:, None]
    saves = lambda y0: og.solve(decay, y0, (0.0, 1.0), saveat=og.SaveAt(ts=ts),
                                adjoint=og.Interpolating()).ys  # fmt: skip
    assert np.isnan(np.asarray(jax.jit(jax.grad(lambda y0: jnp.sum(saves(y0) * w)))(Y0))).all()


@pytest.mark.slow
def test_float32_robertson_backward_solves():
    """Float32 Robertson with Kvaerno5 and Interpolating: Newton failed at every step size at
    t = 10, and the gradient was nan without a word, until Newton stopped at the arithmetic's
    resolution: it now matches float64's. Backsolve's re-integration there fails, and says so
    (its drift check, relative to the state, sees it first)."""
    rob = lambda t, y, k: jnp.stack([
        -k[0] * y[0] + k[1] * y[1] * y[2],
        k[0] * y[0] - k[1] * y[1] * y[2] - k[2] * y[1] ** 2,
        k[2] * y[1] ** 2,
    ])  # fmt: skip

    def loss(lk, adjoint=None, atol=1e-8):
        sol = og.solve(rob, jnp.array([1.0, 0.0, 0.0], lk.dtype), (0.0, 10.0), jnp.exp(lk),
                       solver=og.Kvaerno5(), step=og.Adaptive(rtol=1e-5, atol=atol),
                       adjoint=adjoint or og.Interpolating())  # fmt: skip
        return sol.ys[-1, 0]

    lk = jnp.log(jnp.array([0.04, 1e4, 3e7], jnp.float32))
    g32 = jax.jit(jax.grad(loss))(lk)
    g64 = jax.jit(jax.grad(lambda lk: loss(lk, og.Discrete())))(lk.astype(jnp.float64))
    np.testing.assert_allclose(g32, g64, rtol=1e-4)  # (it raised: see above)
    backsolve = jax.jit(jax.grad(lambda lk: loss(lk, og.Backsolve(), atol=1e-6)))
    raised = r"Backsolve: the (backward .* non-finite .*at t=9.9|state .* drifted)"
    with pytest.raises(Exception, match=raised):
        backsolve(lk)


def test_eager_jacfwd_through_a_failed_solve_names_where():
    """Eager ``jax.jacfwd``: the result code is concrete while the values that locate the
    failure are JVP tracers; the error is the solve's (t and step), not NumPy's refusal to
    convert a tracer."""
    loss = lambda y0: og.solve(decay, y0, (0.0, 50.0), max_steps=3).ys[-1].sum()
    with pytest.raises(Exception, match=r"og.solve failed at t=.* \(step 3\): max_steps") as e:
        jax.jacfwd(loss)(Y0)
    assert type(e.value).__name__ == "SolveFailure"


def test_backsolve_drift_is_also_relative_to_the_state():
    """Backsolve's drift check: Van der Pol's limit cycle repels backwards, and re-integrated
    from t = 20 the state came back 5.5e5 tolerances (half of itself) off y0, under the
    1e6-tolerance limit, with a gradient of 38.1 for 1.24; the limit is also 10 % of the state
    now (1e5 tolerances at rtol 1e-6). From t = 5 it drifts 4 tolerances, and its gradient is
    Interpolating's."""
    vdp = lambda t, y, mu: jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])

    def grad(adjoint, t1):
        def loss(y0, mu):
            sol = og.solve(vdp, y0, (0.0, t1), mu, step=og.Adaptive(1e-6, 1e-6), adjoint=adjoint)
            return jnp.sum(sol.ys[-1] * jnp.array([1.0, -0.5]))

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.array([1.0, 2.0]), 1.0)

    drifted = r"drifted .* by \d\.\d+e\+05 tolerances .*\(the limit is 1e\+05.*unstable in reverse"
    with pytest.raises(Exception, match=drifted):
        grad(og.Backsolve(), 20.0)
    for got, want in zip(grad(og.Backsolve(), 5.0), grad(og.Interpolating(), 5.0), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-3)


def test_adjoint_backward_solver_or_step_that_cannot_work():
    """A continuous adjoint's own backward solver needs an error estimate when its steps are
    adaptive (the forward's ``og.Adaptive``), and its own ``step`` is ``og.Adaptive`` or
    ``og.Fixed`` (checked when the adjoint is made): the others fail before any solve runs,
    naming the fix."""
    f = lambda t, y, a: -a * y

    def grad(adjoint):
        loss = lambda a: og.solve(f, jnp.ones(2), (0.0, 1.0), a, adjoint=adjoint).ys.sum()
        return jax.grad(loss)(1.0)

    with pytest.raises(ValueError, match=r"Ralston\(\) does not have: pass solver= an embedded"):
        grad(og.Interpolating(solver=og.Ralston()))
    with pytest.raises(ValueError, match=r"og.Adaptive\(...\) or og.Fixed\(dt\) steps"):
        grad(og.Quadrature(step=og.StepTo(jnp.linspace(0.0, 1.0, 3))))


def test_continuous_adjoint_arguments():
    """``Interpolating(3)`` is three checkpoints (as ``Discrete(3)``), not ``vjp=3``, which a
    forward solve never calls: a non-callable vjp or a step control that is not one fails
    when the adjoint is made, not inside ``jax.grad``."""
    assert og.Interpolating(3).checkpoints == 3 and og.Quadrature(2).checkpoints == 2
    with pytest.raises(TypeError, match=r"^Interpolating\(vjp=3\): vjp is a function"):
        og.Interpolating(vjp=3)
    with pytest.raises(TypeError, match=r"^Backsolve\(step=0.1\): the backward step control"):
        og.Backsolve(step=0.1)
    with pytest.raises(ValueError, match=r"^Backsolve\(on_drift=3\)"):
        og.Backsolve(3)


@pytest.mark.parametrize("solver", [og.SemiImplicitEuler(), og.Leapfrog()])
def test_partitioned_solver_given_single_f(solver):
    with raises(TypeError, f"solver={solver!r} is partitioned", "f=(f_u, f_v)", "y0=(u0, v0)"):
        og.solve(decay, (jnp.ones(2), jnp.zeros(2)), (0.0, 1.0), solver=solver, step=og.Fixed(0.1))


def test_pair_of_f_given_to_unpartitioned_solver():
    with raises(TypeError, "f is a pair of functions", "og.SemiImplicitEuler() or og.Leapfrog()"):
        og.solve((fu, fv), (jnp.ones(2), jnp.zeros(2)), (0.0, 1.0), solver=og.Tsit5())


def test_partitioned_state_not_a_pair():
    with raises(ValueError, "is partitioned: y0 must be a pair (u0, v0)"):
        og.solve((fu, fv), jnp.ones(2), (0.0, 1.0), solver=og.Leapfrog(), step=og.Fixed(0.1))


# --------------------------------------------------------------------------------------------
# the initial state and the other arguments


@pytest.mark.parametrize(
    "y0, dtype",
    [
        (jnp.arange(3), "int"),
        (np.array([1, 2, 3], dtype=np.int32), "int32"),
        ({"x": jnp.ones(2), "n": jnp.asarray(3)}, "int"),
        (jnp.array([True, False]), "bool"),
    ],
)
def test_integer_y0(y0, dtype):
    with raises(TypeError, f"y0 has a leaf of dtype {dtype}", "floating point", "dtype=float"):
        og.solve(decay, y0, (0.0, 1.0))


def test_complex_y0():
    """Complex states are solved (tests/test_complex.py)."""
    sol = og.solve(decay, jnp.ones(2, jnp.complex64) * (1 + 1j), (0.0, 1.0))
    assert sol.ys.dtype == jnp.complex64 and sol.ts.dtype == jnp.float32
    np.testing.assert_allclose(sol.ys[-1], (1 + 1j) * np.exp(-1.0), rtol=1e-5)


def test_mixed_dtype_y0():
    with raises(TypeError, "y0 mixes dtypes", "float32", "float64", "one floating dtype"):
        og.solve(decay, (jnp.ones(2, jnp.float32), jnp.ones(2)), (0.0, 1.0))


def test_empty_y0():
    with raises(ValueError, "y0 has no arrays", "pytree of arrays"):
        og.solve(decay, {}, (0.0, 1.0))


def test_wrong_kind_of_argument():
    with raises(TypeError, "solver=", "not an odegrad solver", "og.Tsit5()"):
        og.solve(decay, Y0, (0.0, 1.0), solver="tsit5")
    with raises(TypeError, "step=", "og.Adaptive(...), og.Fixed(dt) or og.StepTo(ts)"):
        og.solve(decay, Y0, (0.0, 1.0), step=0.1)
    with raises(TypeError, "saveat=", "og.SaveAt(...)"):
        og.solve(decay, Y0, (0.0, 1.0), saveat=[0.5])
    with raises(TypeError, "adjoint=", "og.Auto() or og.Discrete()"):
        og.solve(decay, Y0, (0.0, 1.0), adjoint="backsolve")
    with raises(TypeError, "f must be callable f(t, y, args)"):
        og.solve(3.0, Y0, (0.0, 1.0))


# --------------------------------------------------------------------------------------------
# the same checks under jit, where t_span, dt and ts are still Python numbers / constants


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"t_span": (1.0, np.inf)}, "must be finite"),
        ({"saveat": og.SaveAt(ts=np.array([0.5, 0.2]))}, "sorted in the direction"),
        ({"saveat": og.SaveAt(ts=np.array([0.5, 2.0]))}, "outside t_span"),
        ({"step": og.Fixed(0.01), "solver": og.RK4(), "max_steps": 50}, "max_steps>=100"),
    ],
)
def test_input_errors_under_jit(kwargs, fragment):
    kwargs = {"t_span": (0.0, 1.0), **kwargs}

    def run(y):
        return og.solve(decay, y, **kwargs).ys

    with raises(ValueError, fragment):
        jax.jit(run)(Y0)


# --------------------------------------------------------------------------------------------
# a non-finite initial state or initial derivative: detected as the solve runs (under jit the
# values are traced), reported as Result.nonfinite_y0 / nonfinite_f0 at t0, step 0, with the
# leaf at fault named. These compile tiny solves.


def scaled(t, y, args):
    return jax.tree.map(lambda x: -args["k"] * x, y)


ARGS = {"k": jnp.asarray(0.5), "c": jnp.ones(2)}
NAN_Y0 = ("failed at t=0 (step 0)", "the initial state y0 is not finite", "check the inputs")


def solve_jit(f, y0, args=None, t_span=(0.0, 1.0), **kwargs):
    return jax.jit(lambda y, a: og.solve(f, y, t_span, a, **kwargs))(y0, args)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"step": og.Fixed(0.25)}, {"solver": og.RK4(), "step": og.Fixed(0.25)}],
    ids=["adaptive", "fixed-tsit5", "fixed-rk4"],
)
def test_nan_in_y0_under_jit(kwargs):
    y0 = jnp.array([1.0, jnp.nan, 2.0])
    with raises(RuntimeError, *NAN_Y0, "y0 holds nan at index (1,)"):
        solve_jit(scaled, y0, ARGS, **kwargs)
    sol = solve_jit(scaled, y0, ARGS, throw=False, **kwargs)
    assert int(sol.result) == og.Result.nonfinite_y0
    if "step" not in kwargs:  # the adaptive loop stops at once, not after max_steps
        assert int(sol.stats["steps"]) == 1


def test_inf_in_pytree_y0_names_the_leaf():
    y0 = {"x": jnp.ones(2), "v": (jnp.asarray(1.0), jnp.array([[0.0, 0.0], [-jnp.inf, 0.0]]))}
    with raises(RuntimeError, *NAN_Y0, "y0['v'][1] holds -inf at index (1, 0)"):
        solve_jit(scaled, y0, ARGS)
    assert int(solve_jit(scaled, y0, ARGS, throw=False).result) == og.Result.nonfinite_y0


def test_inf_in_args_leaf_names_it():
    args = {"k": jnp.asarray(jnp.inf), "c": jnp.ones(2)}
    y0 = (jnp.ones(2), jnp.asarray(3.0))
    fragments = (
        "failed at t=0 (step 0)",
        "the initial derivative f(t0, y0, args) is not finite while y0 is",
        "f(t0, y0, args)[0] holds -inf at index (0,)",
        "args['k'] holds inf",
        "check args",
    )
    with raises(RuntimeError, *fragments):
        solve_jit(scaled, y0, args)
    assert int(solve_jit(scaled, y0, args, throw=False).result) == og.Result.nonfinite_f0


def test_f_nan_at_t0_blames_f():
    """Finite y0 and args: f itself is not finite at t0 (sqrt(t - 1) at t0 = 0)."""

    def f(t, y, args):
        return {"a": -y["a"], "b": jnp.sqrt(t - 1.0) * y["b"]}

    y0 = {"a": jnp.ones(2), "b": jnp.ones(3)}
    fragments = (
        "failed at t=0 (step 0)",
        "f(t0, y0, args)['b'] holds nan at index (0,)",
        "though args are finite",
        "check the right-hand side f at t0",
    )
    for kwargs in ({}, {"solver": og.RK4(), "step": og.Fixed(0.1)}):
        with raises(RuntimeError, *fragments):
            solve_jit(f, y0, ARGS, **kwargs)
        sol = solve_jit(f, y0, ARGS, throw=False, **kwargs)
        assert int(sol.result) == og.Result.nonfinite_f0


def test_f_nan_at_t0_partitioned():
    """The error names the half of f = (f_u, f_v) at fault."""
    y0 = (jnp.ones(2), jnp.zeros(2))
    f = (fu, lambda t, u, args: -u / args)
    kwargs = {"solver": og.Leapfrog(), "step": og.Fixed(0.1)}
    with raises(RuntimeError, "f_v(t0, u0, args) holds -inf at index (0,)", "args are finite"):
        solve_jit(f, y0, jnp.asarray(0.0), **kwargs)
    sol = solve_jit(f, y0, jnp.asarray(0.0), throw=False, **kwargs)
    assert int(sol.result) == og.Result.nonfinite_f0


def test_nonfinite_array_f_closes_over():
    def run(c):
        return og.solve(lambda t, y, a: -c * y, jnp.ones(2), (0.0, 1.0)).ys

    with raises(RuntimeError, "an array of shape (2,) that f closes over holds inf or nan"):
        jax.jit(run)(jnp.array([1.0, jnp.nan]))


def test_nonfinite_start_under_vmap_names_the_member():
    y0s = jnp.array([[1.0, 1.0], [1.0, 1.0], [1.0, jnp.nan]])
    ks = jnp.array([1.0, jnp.inf, 2.0])

    def run(y, k, throw=True):
        return og.solve(scaled, y, (0.0, 1.0), {"k": k}, throw=throw)

    with raises(RuntimeError, "batch member 1 of a batch of (3,); 2 members failed", "args['k']"):
        jax.jit(jax.vmap(run))(y0s, ks)
    sols = jax.jit(jax.vmap(lambda y, k: run(y, k, throw=False)))(y0s, ks)
    codes = [og.Result.success, og.Result.nonfinite_f0, og.Result.nonfinite_y0]
    assert sols.result.tolist() == codes
    assert np.all(np.isfinite(np.asarray(sols.ys[0])))


@pytest.mark.parametrize("on_mesh", [pytest.param(False, marks=pytest.mark.slow), True])
def test_leaves_located_on_the_device_on_a_mesh(on_mesh):
    """On a mesh, leaves reach the error's callback as their first non-finite index and kind,
    not whole (a sharded field would be gathered onto one device; test_scaleout checks that no
    such gather is compiled): the error names the same entries as from whole leaves, also under
    vmap and for a fixed grid that runs on past a non-finite step (its saved rows summarised)."""
    if on_mesh:
        with jax.set_mesh(jax.make_mesh((1,), ("x",))):
            return test_leaves_located_on_the_device_on_a_mesh(False)
    big = np.ones((40, 40))
    y0 = {"small": jnp.ones(2), "big": jnp.asarray(big).at[3, 7].set(-jnp.inf)}
    with raises(RuntimeError, *NAN_Y0, "y0['big'] holds -inf at index (3, 7)"):
        solve_jit(scaled, y0, ARGS)
    c = jnp.ones(2000).at[1234].set(jnp.nan).at[1500].set(jnp.inf)

    def g(t, y, a):
        return jax.tree.map(lambda x: -x * jnp.mean(a["c"]), y)

    fragments = (
        "f(t0, y0, args)['big'] holds nan at index (0, 0)",
        "args['c'] holds nan at index (1234,)",
    )
    with raises(RuntimeError, *fragments):
        solve_jit(g, {"small": jnp.ones(2), "big": jnp.asarray(big)}, {"c": c})
    # a member of a batch: its own entries
    ys = jnp.stack([jnp.asarray(big), jnp.asarray(big).at[39, 0].set(jnp.nan)])
    run = jax.vmap(lambda y: og.solve(lambda t, y, a: -y, y, (0.0, 1.0)).ys)
    with raises(RuntimeError, "batch member 1 of a batch of (2,)", "y0 holds nan at index (39, 0)"):
        jax.jit(run)(ys)
    # a fixed grid runs on: the first saved step holding nan (step 2 evaluates f at t = 0.2),
    # as for a small state
    blow = lambda t, y, a: jnp.where(t >= 0.2, jnp.nan, -y)
    for y in (jnp.ones(3), jnp.asarray(big)):
        with raises(RuntimeError, "failed at t=0.1 (step 2)", "became non-finite"):
            solve_jit(blow, y, None, step=og.Fixed(0.1), saveat=og.SaveAt(steps=True))


def test_concrete_nan_y0_raises_before_solving():
    """A concrete y0 is checked at once (a ValueError); throw=False returns the code."""
    y0 = {"x": np.array([1.0, np.inf])}
    with raises(ValueError, "initial state y0 is not finite", "y0['x'] holds inf at index (1,)"):
        og.solve(scaled, y0, (0.0, 1.0), ARGS)
    sol = og.solve(scaled, y0, (0.0, 1.0), ARGS, throw=False)
    assert int(sol.result) == og.Result.nonfinite_y0
    # args are not checked up front (inf may be meant, a bound, say): f(t0, y0, args) is
    with raises(RuntimeError, "failed at t=0 (step 0)", "args['k'] is inf", "check args"):
        og.solve(scaled, jnp.ones(2), (0.0, 1.0), {"k": float("inf")})


def test_gradient_of_nonfinite_start_raises():
    def loss(k):
        return og.solve(scaled, jnp.ones(2), (0.0, 1.0), {"k": k}).ys.sum()

    with raises(RuntimeError, "args['k'] holds inf"):
        jax.jit(jax.grad(loss))(jnp.inf)


def test_evaluate_outside_the_span_is_nan():
    """Dense output past the span extrapolated silently (``evaluate(1.5)`` gave 0.266 for
    ``exp(-1.5) = 0.223``; past a terminal event, a ball under the floor): it is nan there,
    as diffrax's is past an event; a vmapped Solution says how to evaluate its members."""
    sol = og.solve(decay, Y0, (0.0, 1.0), saveat=og.SaveAt(dense=True))
    got = np.asarray(sol.evaluate(jnp.array([-0.5, 0.0, 0.5, 1.0, 1.5])))[:, 0]
    assert np.isnan(got[[0, 4]]).all()
    np.testing.assert_allclose(got[1:4], np.exp(-np.array([0.0, 0.5, 1.0])), rtol=1e-5)
    batch = jax.vmap(lambda y: og.solve(decay, y, (0.0, 1.0), saveat=og.SaveAt(dense=True)))
    sols = batch(jnp.ones((2, 3)))
    with raises(ValueError, "jax.vmap(lambda s: s.evaluate(t))(sol)"):
        sols.evaluate(0.5)


def test_wrong_argument_counts_name_the_convention():
    """A two-argument f (torchdiffeq's, scipy's order) or a one-argument SaveAt(fn) raised
    Python's bare "takes 2 positional arguments but 3 were given"; and SaveAt(ts=[]) an
    IndexError from deep inside the solve."""
    with raises(TypeError, "f(t, y, args) failed", "lambda t, y, args: f(t, y)"):
        og.solve(lambda t, y: -y, Y0, (0.0, 1.0))
    with raises(TypeError, "SaveAt(fn)(t, y, args) failed", "lambda t, y, args: fn(y)"):
        og.solve(decay, Y0, (0.0, 1.0), saveat=og.SaveAt(t1=True, fn=lambda y: y))
    with raises(ValueError, "SaveAt(ts): ts must be 1-d with at least one time"):
        og.SaveAt(ts=[])


def test_half_precision_below_its_resolution():
    """A float16 state at the default rtol failed at t0 as "non-finite" (bfloat16: "step size
    underflow ... stiff"): the tolerance is below the dtype's resolution, and the message says
    so; at a tolerance it resolves, it solves."""
    with raises(ValueError, "below what a float16 state resolves", "float32"):
        og.solve(decay, jnp.ones(2, jnp.float16), (0.0, 1.0))
    sol = og.solve(decay, jnp.ones(2, jnp.float16), (0.0, 1.0), step=og.Adaptive(1e-2, 1e-3))
    np.testing.assert_allclose(np.asarray(sol.ys[-1], float), np.exp(-1.0), rtol=5e-3)


def test_implicit_solver_failures_are_worded_for_it(caplog):
    """An implicit solver that runs out of steps, or whose step underflows at a blow-up, is not
    told to "try a stiff solver"; only an ESDIRK one (Newton) is pointed at max_newton_iters.
    A failure under jax.jit is reported once: JAX's callback logger, which printed the same
    error and traceback before the JaxRuntimeError, stays quiet for ours."""
    blow_up = lambda t, y, a: y**2  # y = 1 / (1 - t): singular at t = 1
    cases = [
        (og.Kvaerno3(), 3, "max_steps was reached before t1 with an implicit solver"),
        (og.Kvaerno3(), 4096, "fell below the floor with an implicit solver"),
        (og.Rodas5P(), 4096, "fell below the floor with an implicit solver"),
    ]
    for solver, max_steps, fragment in cases:
        caplog.clear()
        with pytest.raises(RuntimeError) as info:
            solve_jit(blow_up, jnp.ones(1), t_span=(0.0, 2.0), solver=solver, max_steps=max_steps)
        text = str(info.value)
        assert fragment in text and "stiff solver" not in text, text
        assert ("max_newton_iters" in text) == ("floor" in text and solver.order == 3), text
        logged = [r.getMessage() + str(r.exc_info) for r in caplog.records]
        assert not [m for m in logged if "og.solve failed" in m], logged
