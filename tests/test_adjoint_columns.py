"""Save cotangents as columns of the continuous adjoints' backward steps (adjoint/columns.py).

With many save times per step the backward solve no longer stops at each save: the saves inside
a backward step ride in it as extra columns. Each case differentiates a loss with columns
(the default, ``Tuning.adjoint_columns``) and checks it against the exact gradient of a tightly
solved problem (``og.Discrete()`` at ``rtol = 1e-12``); the first also with a small column count
that forces the step cap (more saves per forward step than columns) and with the saves as
breakpoints (``adjoint_columns=0``, the backward solve stopping at every save).

The cases cover what the column bookkeeping could get wrong: saves at ``t0`` and at ``t1``,
repeated save times, ``SaveAt(fn=...)`` reading ``args`` (the saves' own ``dL/dp``), saves after
a terminal event (``inf`` rows that must take no part), a save at an event's time (the save's
cotangent enters after the event's transposed jump), the re-taken steps of
``Interpolating(checkpoints=c)`` (which then keep the state at each save), ``Quadrature``, a
kinked right-hand side, and ``jax.vmap`` with members that step differently.

Lotka–Volterra's 2-entry state takes the adjoint's propagator (``PropagatorSolver``); the
columns proper run with ``propagator_entries=0``. ``Backsolve`` rides the saves in the
propagator with ``backsolve_across_params=0`` (its default needs many parameters): its
gradient, and its drift report on a problem unstable backwards.
"""

from __future__ import annotations

import functools

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import odegrad as og  # noqa: E402
from odegrad._tuning import tuned  # noqa: E402

TOL = 1e-9  # the continuous adjoints' solves


def lotka_volterra(t, y, p):
    a, b, c, d, e = p
    return jnp.stack([a * y[0] - b * y[0] * y[1], -c * y[1] + d * y[0] * y[1]]) + e * jnp.sin(t)


def kinked(t, y, p):  # |y1| and max(., 0): the Jacobian jumps
    a, b, c, d, e = p
    return jnp.stack([-a * jnp.abs(y[1]) + b * y[0], -c * jnp.maximum(y[0], 0.2) + d * y[1] + e])


P = jnp.array([1.1, 0.4, 0.4, 0.1, 0.05])
Y0 = jnp.array([2.0, 1.5])
# saves at t0 (twice), dense in the middle (many per forward step), repeated, and at t1
TS = jnp.concatenate([jnp.zeros(2), jnp.linspace(0.3, 3.5, 37), jnp.array([3.5, 3.5, 4.0])])


def make_loss(f, adjoint, tol, *, ts=TS, fn=None, event=None, t1=False, row_weights=None):
    def loss(p, y0):
        sol = og.solve(
            f,
            y0,
            (0.0, 4.0),
            p,
            saveat=og.SaveAt(ts=ts, fn=fn, t1=t1),
            step=og.Adaptive(rtol=tol, atol=tol),
            adjoint=adjoint,
            events=event,
            throw=event is None,
        )
        ys = jnp.where(jnp.isfinite(sol.ys), sol.ys, 0.0)  # rows after a terminal event
        w = jnp.arange(1, ys.size + 1).reshape(ys.shape) / ys.size
        if row_weights is not None:
            w = w * row_weights[:, None]
        return jnp.sum(jnp.sin(ys) * w)

    return loss


def gradients(f, adjoint, columns=(16, 2), tuning=None, **kw):
    """The gradients w.r.t. (p, y0) with each column count (0: saves as breakpoints; a dict:
    tuning fields), and the exact one, last; ``tuning``: more fields to change. One compiled
    program for them all (several programs compile for longer), each gradient traced under its
    own tuning; the exact gradient of the plain loss is compiled once per process."""

    def every(p, y0):
        out = []
        for n in columns:
            with tuned(**(n if isinstance(n, dict) else {"adjoint_columns": n}), **(tuning or {})):
                out.append(jax.grad(make_loss(f, adjoint, TOL, **kw), (0, 1))(p, y0))
        if kw:
            out.append(jax.grad(make_loss(f, og.Discrete(), 1e-12, **kw), (0, 1))(p, y0))
        return out

    out = jax.jit(every)(P, Y0)
    return out if kw else [*out, _exact(f)]


@functools.cache
def _exact(f):
    return jax.jit(jax.grad(make_loss(f, og.Discrete(), 1e-12), (0, 1)))(P, Y0)


def rel(a, b):
    a, b = np.concatenate([np.ravel(x) for x in a]), np.concatenate([np.ravel(x) for x in b])
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def assert_agree(grads, bound):
    *approx, exact = grads
    for i, g in enumerate(approx):
        assert rel(g, exact) < bound, (i, rel(g, exact))


ADJOINTS = {
    "Interpolating": og.Interpolating(),
    "Quadrature": og.Quadrature(),
    "Interpolating(checkpoints=3)": og.Interpolating(checkpoints=3),
}


@pytest.mark.parametrize(
    "columns",  # the propagator with up to 16 saves per step, and with its step cap (2);
    # saves as breakpoints (the path before columns)
    [({}, {"propagator_saves": 2}), pytest.param((0,), marks=pytest.mark.slow)],
)
def test_columns_match_breakpoints_and_exact(columns):
    # this 2-entry state takes the propagator; the columns proper are the next test's
    assert_agree(gradients(lotka_volterra, og.Interpolating(), columns), 1e-6)


@pytest.mark.parametrize(
    "name", ["Interpolating", pytest.param("Quadrature", marks=pytest.mark.slow)]
)
def test_columns_without_the_propagator_match_exact(name):
    # many columns and the step cap (more saves per forward step than columns)
    columns = (16, 2) if name == "Quadrature" else (2,)  # (slow: both; quick: the cap)
    no_propagator = {"propagator_entries": 0}
    grads = gradients(lotka_volterra, ADJOINTS[name], columns, no_propagator)
    assert_agree(grads, 1e-6)


@pytest.fixture
def propagator_steps(monkeypatch):
    """Counts the propagator's steps as traced (a gate that silently sent these cases down
    another path would leave the tests below comparing that path)."""
    from odegrad.adjoint import columns

    traced = []
    step = columns.PropagatorSolver.step

    def counting(self, *args):
        traced.append(self.reintegrate is not None)
        return step(self, *args)

    monkeypatch.setattr(columns.PropagatorSolver, "step", counting)
    return traced


@pytest.mark.parametrize(
    "f", [lotka_volterra, pytest.param(kinked, marks=pytest.mark.slow)], ids=["smooth", "kinked"]
)
def test_backsolve_steps_across_saves(propagator_steps, f):
    # the re-integrated y rides in the propagator: no stop at the saves, its drift corrected
    # at each step's end from the last save inside
    across = {"backsolve_across_params": 0}
    grads = gradients(f, og.Backsolve(), (16,), across)
    assert any(propagator_steps)
    assert_agree(grads, 1e-6 if f is lotka_volterra else 1e-5)


@pytest.mark.slow  # the event test above runs the propagator by default
def test_propagator_with_saves_at_one_time_and_event(propagator_steps):
    event = og.Event(lambda t, y, args: y[0] - 6.0, terminal=True)
    ts = jnp.concatenate([TS, jnp.full(3, 1.7)])
    ts = jnp.sort(ts)
    grads = gradients(lotka_volterra, og.Quadrature(), (16,), ts=ts, event=event)
    assert propagator_steps
    assert_agree(grads, 1e-5)


def test_backsolve_across_saves_reports_drift(retune, propagator_steps):
    # a fast mode (rate 1000) beside a slow one is unstable backwards: re-integrated from t1,
    # rounding in the fast mode grows by e^40 between saves, which the saves inside each step
    # reveal without stopping there
    retune(backsolve_across_params=0)

    def decay(t, y, p):  # modes -p0 along (1, 1) and -p1 along (1, -1)
        s, d = (y[0] + y[1]) / 2, (y[0] - y[1]) / 2
        return jnp.stack([-p[0] * s - p[1] * d, -p[0] * s + p[1] * d])

    def loss(p):
        sol = og.solve(
            decay,
            jnp.array([1.0, 2.0]),
            (0.0, 2.0),
            p,
            saveat=og.SaveAt(ts=jnp.linspace(0.0, 2.0, 50)),
            step=og.Adaptive(rtol=1e-6, atol=1e-9),
            adjoint=og.Backsolve(),
        )
        return jnp.sum(sol.ys)

    with pytest.raises(Exception, match="Backsolve"):
        jax.block_until_ready(jax.jit(jax.grad(loss))(jnp.array([1.0, 1000.0])))
    assert any(propagator_steps)


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_backsolve_drift_check_is_free_and_warns_with_its_gradient(monkeypatch):
    # the drift test calls the host only when a member drifted: no callback on the success
    # path (a debug callback there cost the vmapped neural ODE's step 112 -> 49 ms), and
    # on_drift="warn" passes the gradient through the host unchanged
    from odegrad.adjoint import sources

    def loss(p, on_drift="raise"):
        return make_loss(lotka_volterra, og.Backsolve(on_drift=on_drift), 1e-8)(p, Y0)

    grad = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0,)))
    ps = jnp.stack([P, P * 1.1])
    assert "debug_callback" not in str(jax.make_jaxpr(grad)(ps))
    g = np.asarray(grad(ps))
    assert np.all(np.isfinite(g)) and np.abs(g[1] - g[0]).max() > 1e-3 * np.abs(g).max()
    monkeypatch.setattr(sources, "DRIFT_LIMIT", 0.0)  # every solve "drifts"
    with pytest.warns(RuntimeWarning, match="drifted"):
        g_warned = jax.block_until_ready(jax.jit(jax.grad(lambda p: loss(p, "warn")))(ps[1]))
    # (member 1 of the batch: the same arithmetic, to rounding)
    np.testing.assert_allclose(np.asarray(g_warned), g[1], rtol=1e-12, atol=1e-14)
    with pytest.raises(Exception, match="Backsolve"):
        jax.block_until_ready(jax.jit(jax.vmap(jax.grad(loss)))(ps))


@pytest.mark.slow  # the default run has Quadrature's columns against CVODES (continuous adjoints)
@pytest.mark.parametrize(
    "name",  # (the re-taken steps' columns stay in the default run through the SaveAt(fn) test)
    ["Quadrature", "Interpolating(checkpoints=3)"],
)
def test_columns_of_the_other_sources_match_exact(name):
    assert_agree(gradients(lotka_volterra, ADJOINTS[name]), 1e-6)


@pytest.mark.parametrize(
    "name", [pytest.param("Interpolating", marks=pytest.mark.slow), "Interpolating(checkpoints=3)"]
)
def test_columns_with_saved_function_of_args(name):
    # the saved value reads args: each save adds its own dL/dp besides its jump of a (and the
    # re-taken steps keep the state beside each save)
    def fn(t, y, p):
        return jnp.stack([y[0] * p[0], y[1] ** 2 + p[4]])

    assert_agree(gradients(lotka_volterra, ADJOINTS[name], (16,), fn=fn), 1e-6)


def test_columns_on_a_kinked_field():
    assert_agree(gradients(kinked, og.Interpolating(), (16,)), 1e-5)


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_columns_with_terminal_event_and_save_at_its_time():
    # y0 rises through 6 at some t* near 2; saves land just before t*, exactly on it (found
    # first, then placed) and just after it; the saves after t* are inf rows that must take no
    # part, and the event's state (SaveAt(t1=True)) moves with t*(p)
    event = og.Event(lambda t, y, args: y[0] - 6.0, terminal=True)
    sol = jax.jit(  # (compiled: eagerly, the solve runs its loop's surroundings op by op)
        lambda y0, p: og.solve(
            lotka_volterra,
            y0,
            (0.0, 4.0),
            p,
            saveat=og.SaveAt(t1=True),
            step=og.Adaptive(rtol=1e-12, atol=1e-12),
            events=event,
            throw=False,
        )
    )(Y0, P)
    t_event = float(sol.ts[-1])
    assert 0.3 < t_event < 3.5
    near = jnp.array([t_event - 1e-6, t_event, t_event + 1e-6])
    ts = jnp.sort(jnp.concatenate([TS, near]))
    # The row at exactly t* is where the loss jumps: it is finite or inf by the last ulps of
    # each solve's event time (the Discrete reference's, at 1e-12, and Interpolating's, at
    # 1e-9, differed, and the gradients by 2x). It is placed, and weighted 0.
    at_event = np.flatnonzero(np.asarray(ts) == t_event)
    weights = jnp.ones(ts.size + 1).at[at_event].set(0.0)
    grads = gradients(
        lotka_volterra, og.Interpolating(), (16,), ts=ts, event=event, t1=True,
        row_weights=weights,
    )  # fmt: skip
    # the event time moves with p: the gradient includes its sensitivity, to the tolerance
    assert_agree(grads, 1e-5)
    # the row at t* - 1e-6 is in and the one at t* + 1e-6 out, in every solve
    rows = jax.jit(
        lambda y0, p: og.solve(
            lotka_volterra, y0, (0.0, 4.0), p, saveat=og.SaveAt(ts=near),
            step=og.Adaptive(rtol=TOL, atol=TOL), events=event, throw=False,
        ).ys
    )(Y0, P)  # fmt: skip
    assert np.isfinite(rows[0]).all() and not np.isfinite(rows[2]).any(), rows


@pytest.mark.parametrize(
    "name",  # test_batched.py's vmap test covers Interpolating() by default
    [
        pytest.param("Interpolating", marks=pytest.mark.slow),
        pytest.param("Backsolve", marks=pytest.mark.slow),
    ],
)
def test_columns_under_vmap_equal_each_member(retune, name):
    y0s = jnp.array([[2.0, 1.5], [0.5, 3.0], [4.0, 0.2]])  # step differently
    adjoint = og.Backsolve() if name == "Backsolve" else og.Interpolating()
    loss = make_loss(lotka_volterra, adjoint, TOL)
    retune(adjoint_columns=16, backsolve_across_params=0)
    one = jax.jit(jax.grad(loss))
    each = [one(P, y0) for y0 in y0s]
    batched = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(P, y0s)
    grad_of_vmap = jax.jit(jax.grad(lambda p: jnp.sum(jax.vmap(loss, (None, 0))(p, y0s))))(P)
    for i in range(len(y0s)):
        np.testing.assert_allclose(batched[i], each[i], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(grad_of_vmap, sum(each), rtol=1e-9, atol=1e-12)


def test_widest_value_reads_nested_jaxprs():
    from odegrad.adjoint.columns import widest_value

    assert widest_value(lambda y: jnp.outer(y, y).sum(0), jnp.ones(8)) == 64
    inner = jax.jit(lambda x: jnp.outer(x, x).sum())  # (6, 6) inside a jit inside a scan
    scanned = lambda y: jax.lax.scan(lambda c, x: (c + inner(x), None), 0.0, y)[0]
    assert widest_value(scanned, jnp.ones((3, 6))) == 36
    assert widest_value(jax.vmap(lambda y: jnp.outer(y, y)), jnp.ones((5, 4))) == 80
    # branches and loops (their jaxprs take other operands than the equation) count whole
    branch = lambda y: jax.lax.cond(y[0] > 0, lambda z: jnp.outer(z, z).sum(0), lambda z: z, y)
    assert widest_value(branch, jnp.ones(6)) == 36
    body = lambda c: (c[0] + 1, jnp.tanh(jnp.outer(c[1], c[1]).sum(0)))
    loop = lambda y: jax.lax.while_loop(lambda c: c[0] < 3, body, (0, y))[1]
    assert widest_value(loop, jnp.ones(5)) == 25
    # work on the parameters alone (a transposed weight matrix) does not count
    w = jnp.ones((128, 128))
    assert widest_value(lambda y, w: jnp.tanh(y @ w.T), jnp.ones(128), w) == 128


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_saves_stop_the_backward_solve_once_f_is_wide(monkeypatch):
    # Tuning.column_width: a 10-entry state (past the propagator) whose f is narrow rides its
    # saves as columns; the same f judged wide stops at every save; both give the exact gradient
    from odegrad.adjoint import adjoint_ode

    built = []

    class Counted(adjoint_ode.ColumnSolver):
        def __init__(self, *args, **kw):
            built.append(type(self))
            super().__init__(*args, **kw)

    monkeypatch.setattr(adjoint_ode, "ColumnSolver", Counted)
    rows = jax.vmap(lotka_volterra, in_axes=(None, 0, None))
    stacked = lambda t, y, p: rows(t, y, p)
    y0s = jnp.stack([Y0 * (1 + 0.1 * k) for k in range(5)])

    def grad(width):
        with tuned(column_width=width, row_propagator_entries=0):  # (rows: test_adjoint_rows)
            loss = make_loss(stacked, og.Interpolating(), TOL)
            return jax.jit(jax.grad(loss, (0, 1)))(P, y0s)

    columns = grad(None)
    assert built == [Counted]
    stops = grad(4)
    assert built == [Counted]  # no column step traced this time
    exact = jax.jit(jax.grad(make_loss(stacked, og.Discrete(), 1e-12), (0, 1)))(P, y0s)
    assert rel(columns, exact) < 1e-6 and rel(stops, exact) < 1e-6
