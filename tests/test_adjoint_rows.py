"""A batch stacked into one state: the adjoint's propagator per row block (adjoint/rows.py).

``independent_rows`` reads from ``f``'s jaxpr whether each row of ``f(y)`` depends on the same
row of ``y`` alone; the continuous adjoints then carry one small propagator per row in ``m``
products per stage (``m`` entries per row) instead of stopping at every save. The analysis must
say "independent" only where it is: a false "yes" is a wrong gradient, so most cases here are
functions that mix rows in some way. The analysis reads the vector-Jacobian product the
backward pass uses, so a derivative rule that mixes rows (a ``custom_jvp``) is caught where the
function itself keeps them apart. The gradients (a stacked MLP, a pytree state, a ReLU field, a
field that couples its rows, a mixing derivative rule, rows of 3 entries: more than
``Tuning.row_propagator_entries``) are checked against ``og.Discrete()`` at ``rtol = 1e-12``,
and that the propagator per row was taken exactly where it should be.
"""

from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import odegrad as og  # noqa: E402
from odegrad._tuning import tuned  # noqa: E402
from odegrad.adjoint.rows import independent_rows  # noqa: E402

W = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
Y = jnp.ones((5, 3))


@jax.custom_vjp
def _rescaled(y):  # the identity, whose backward pass normalises over every row
    return y


_rescaled.defvjp(lambda y: (y, None), lambda _, c: (c / jnp.linalg.norm(c),))


def _scan_rows(y, w):
    return jax.lax.scan(lambda c, x: (c + x, c), y[0], y)[1]


INDEPENDENT = {
    "mlp": lambda y, w: jnp.tanh(y @ w) @ w.T,
    "w @ y.T": lambda y, w: (w.T @ y.T).T @ w.T,
    "einsum": lambda y, w: jnp.einsum("bi,ij,kj->bk", y, w, w),
    "row sum": lambda y, w: y * jnp.sum(y**2, 1, keepdims=True),
    "row norm": lambda y, w: y / jnp.linalg.norm(y, axis=1, keepdims=True),
    "roll along columns": lambda y, w: jnp.roll(y, 1, axis=1),
    "kinks": lambda y, w: jax.nn.relu(y) - jnp.abs(y) + jnp.clip(y, -0.5, 0.5),
    "softmax per row": lambda y, w: jax.nn.softmax(y, axis=-1),
    "vmap of a row function": lambda y, w: jax.vmap(lambda r: jnp.sin(r @ w) @ w.T)(y),
    "remat": lambda y, w: jax.checkpoint(lambda z: jnp.tanh(z) * z)(y),
    "row dot": lambda y, w: y * jnp.einsum("bi,bi->b", y, y)[:, None],
    "stack": lambda y, w: jnp.stack([y[:, 0] * y[:, 1], -y[:, 2], y[:, 1]], axis=1),
    "unstack": lambda y, w: jnp.stack(jnp.unstack(y, axis=1)[::-1], axis=1),
    "at[:, 0].set": lambda y, w: y.at[:, 0].set(y[:, 1] * y[:, 2]),
    "scatters into zeros": lambda y, w: (
        jnp.zeros_like(y).at[:, 2].set(y[:, 0]).at[:, 1].add(-y[:, 2])
    ),
    "gathered columns": lambda y, w: y[:, jnp.array([2, 0, 1])],
    "columns scattered": lambda y, w: y.at[:, jnp.array([0, 2])].set(y[:, jnp.array([1, 1])] ** 2),
    # the cotangent in y of a VJP whose parameter cotangent sums over the rows
    "vjp in y": lambda y, w: jax.vjp(lambda y_, w_: jnp.tanh(y_ @ w_) @ w_.T, y, w)[1](y)[0],
}
MIXED = {
    "mean over rows": lambda y, w: y - y.mean(0),
    "max over everything": lambda y, w: y - jnp.max(y),
    "roll along rows": lambda y, w: jnp.roll(y, 1, axis=0),
    "reversed rows": lambda y, w: y[::-1],
    "cumsum over rows": lambda y, w: jnp.cumsum(y, 0),
    "gram": lambda y, w: y @ (y.T @ y),
    "flattened": lambda y, w: (jnp.linspace(0, 1, 15) * y.reshape(-1)).reshape(5, 3)[::-1],
    "flattened rolled": lambda y, w: jnp.roll(y.reshape(-1), 1).reshape(5, 3),
    "softmax over rows": lambda y, w: jax.nn.softmax(y, axis=0),
    "scan over rows": _scan_rows,
    "custom_vjp": lambda y, w: _rescaled(y),
    "gather": lambda y, w: y[jnp.array([0, 0, 1, 2, 3])],
    "set from reversed rows": lambda y, w: y.at[:, 0].set(y[::-1, 1]),
    "set rows from rows": lambda y, w: y.at[1:, 0].set(y[:-1, 1]),
    "set one row": lambda y, w: y.at[0].set(y[1]),
    "set from one row": lambda y, w: y.at[:, 0].set(y[:1, 1]),
    "max into repeated rows": lambda y, w: y.at[jnp.array([0, 0, 1, 2, 3]), 0].max(y[:, 1]),
}


@pytest.mark.parametrize("name", INDEPENDENT)
def test_rows_found_independent(name):
    assert independent_rows(INDEPENDENT[name], Y, W) == 5


@pytest.mark.parametrize("name", MIXED)
def test_rows_that_mix_are_found(name):
    assert independent_rows(MIXED[name], Y, W) == 1


def test_rows_of_pytrees_and_shapes():
    def f(y, w):
        return {"u": y["u"] * y["v"], "v": jnp.tanh(y["u"] @ w)[:, :1]}

    assert independent_rows(f, {"u": jnp.ones((5, 3)), "v": jnp.ones((5, 1))}, W) == 5
    # leaves with different leading sizes, a single row, a scalar state: no row blocks
    assert independent_rows(lambda y, w: y, {"u": jnp.ones((5, 3)), "v": jnp.ones((4,))}, W) == 1
    assert independent_rows(lambda y, w: y, jnp.ones((1, 3)), W) == 1
    assert independent_rows(lambda y, w: y, jnp.ones(()), W) == 1


# -- gradients ----------------------------------------------------------------------------------
P = {
    "w1": jnp.linspace(-0.8, 0.9, 2 * 6).reshape(2, 6),
    "b1": jnp.linspace(-0.1, 0.2, 6),
    "w2": jnp.linspace(0.7, -0.6, 6 * 2).reshape(6, 2),
}
Y0 = jnp.stack([jnp.linspace(-0.5, 0.8, 6), jnp.linspace(0.9, -0.3, 6)], 1)  # (6, 2)
TS = jnp.linspace(0.0, 2.0, 41)


def stacked_mlp(t, y, p):
    return jnp.tanh(y @ p["w1"] + p["b1"]) @ p["w2"] * (1 + 0.1 * t)


def stacked_relu(t, y, p):
    return jax.nn.relu(y @ p["w1"] + p["b1"]) @ p["w2"] - 0.3 * y


def coupled(t, y, p):  # each row pulled to the mean of all rows: not row blocks
    return stacked_mlp(t, y, p) + 0.5 * (y.mean(0) - y)


def pytree_state(t, y, p):  # two (6,) leaves: rows of 2 entries
    du = stacked_mlp(t, jnp.stack([y["x"], y["v"]], 1), p)
    return {"x": du[:, 0] * (1 + 0.2 * y["v"]), "v": du[:, 1] - y["v"] * y["x"] ** 2}


@jax.custom_jvp
def _tanh_mixing(x):  # tanh, whose derivative rule also passes each row's tangent to the next
    return jnp.tanh(x)


@_tanh_mixing.defjvp
def _(primals, tangents):
    (x,), (dx,) = primals, tangents
    return jnp.tanh(x), (1 - jnp.tanh(x) ** 2) * dx + 0.3 * jnp.roll(dx, 1, axis=0)


def scattered(t, y, p):  # the torchdiffeq idiom dy[:, k] = ...
    du = stacked_mlp(t, y, p)
    return jnp.zeros_like(y).at[:, 0].set(du[:, 0]).at[:, 1].set(du[:, 1] - 0.1 * y[:, 0])


def three_per_row(t, y, p):  # rows apart, but 3 entries each: the stops are cheaper
    return jnp.concatenate([stacked_mlp(t, y[:, :2], p), -0.5 * y[:, 2:] * y[:, :1]], 1)


def mixing_rule(t, y, p):  # rows apart in f itself, mixed in its derivative
    return _tanh_mixing(y @ p["w1"] + p["b1"]) @ p["w2"] - 0.2 * y


def loss_for(f, adjoint, tol, y0, ts=TS):
    def loss(p):
        step = og.Adaptive(rtol=tol, atol=tol)
        sol = og.solve(f, y0, (0.0, 2.0), p, saveat=og.SaveAt(ts=ts), step=step, adjoint=adjoint)
        weigh = lambda x: jnp.sin(x) * jnp.arange(1, x.size + 1).reshape(x.shape) / x.size
        return sum(jnp.sum(weigh(x)) for x in jax.tree.leaves(sol.ys))

    return loss


def rel(a, b):
    a, b = np.concatenate([np.ravel(x) for x in a]), np.concatenate([np.ravel(x) for x in b])
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture
def propagator_rows(monkeypatch):
    """The row-block counts of the propagator steps traced."""
    from odegrad.adjoint import columns

    traced = []
    step = columns.PropagatorSolver.step

    def counting(self, *args):
        traced.append(self.rows)
        return step(self, *args)

    monkeypatch.setattr(columns.PropagatorSolver, "step", counting)
    return traced


CASES = {
    "mlp": (stacked_mlp, Y0, 6),
    "relu": (stacked_relu, Y0, 6),
    "pytree": (pytree_state, {"x": Y0[:, 0], "v": Y0[:, 1]}, 6),
    "scattered": (scattered, Y0, 6),
    "coupled": (coupled, Y0, None),
    "mixing derivative rule": (mixing_rule, Y0, None),
    "three entries per row": (three_per_row, jnp.concatenate([Y0, Y0[:, :1]], 1), None),
}


#: the full matrix runs with -m slow; the default suite keeps a network with kinks (relu) and a
#: field the analysis must refuse (the suite stays under 15 minutes on 2 cores)
_SLOW_CASES = ("mlp", "pytree", "scattered", "coupled", "three entries per row")


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in _SLOW_CASES else c for c in CASES]
)
def test_stacked_gradients_match_exact(case, propagator_rows, retune):
    # Backsolve rides the saves only with many parameters by default
    retune(backsolve_across_params=0)
    f, y0, rows = CASES[case]
    adjoints = [og.Interpolating(), og.Quadrature(), og.Backsolve()]
    if case == "mixing derivative rule":  # the analysis refuses the rows for every adjoint alike
        adjoints = adjoints[:1]

    def every(p):
        out = [jax.grad(loss_for(f, a, 1e-9, y0))(p) for a in adjoints]
        if case != "relu":
            return out, jax.grad(loss_for(f, og.Discrete(), 1e-12, y0))(p)
        # across the kinks the discrete gradient (steps held fixed) is off by 1e-5 even at
        # rtol 1e-12; the continuous adjoint stopping at every save agrees with central
        # finite differences to 1e-6 (2026-12-04), tighter than those can tell
        with tuned(row_propagator_entries=0):
            return out, jax.grad(loss_for(f, og.Interpolating(), 1e-12, y0))(p)

    grads, exact = jax.jit(every)(P)
    for a, g in zip(adjoints, grads, strict=True):
        assert rel(jax.tree.leaves(g), jax.tree.leaves(exact)) < 2e-6, (a, case)
    # the row blocks' propagator where the rows are independent; none where they mix
    assert set(propagator_rows) == ({rows} if rows else set())


def test_few_saves_stop_instead(propagator_rows):
    # with fewer saves than Tuning.row_propagator_saves the stops are cheaper: no row path
    ts = TS[::8]  # 6 saves

    def both(p):
        exact = jax.grad(loss_for(stacked_mlp, og.Discrete(), 1e-12, Y0, ts))(p)
        return jax.grad(loss_for(stacked_mlp, og.Interpolating(), 1e-9, Y0, ts))(p), exact

    g, exact = jax.jit(both)(P)
    assert rel(jax.tree.leaves(g), jax.tree.leaves(exact)) < 2e-6
    assert propagator_rows == []


def test_explain_names_the_row_propagator():
    def explain(f, y0):
        return og.explain_adjoint(
            f, y0, (0.0, 2.0), P, saveat=og.SaveAt(ts=TS), adjoint=og.Interpolating()
        )

    assert "in one 2 x 2 propagator per row of the state's 6 independent rows" in explain(
        stacked_mlp, Y0
    )
    # rows that mix, a narrow f: the saves as columns (a state of 12 entries)
    assert "up to 16 as columns per step" in explain(coupled, Y0)


def test_implicit_backward_solves_stop_at_each_save():
    """The saves ride as rows or columns in explicit backward steps only: an implicit solver's
    Newton solve on the stacked columns cost a fresh Jacobian each step, and one max_steps
    budget served the whole span (Van der Pol with Kvaerno3 ran out; test_implicit's slow
    test_stiff_continuous_adjoints_kvaerno3 checks that gradient against CVODES)."""
    for solver in (og.Kvaerno3(), og.Kvaerno5(), og.Rodas5P()):
        said = og.explain_adjoint(
            coupled, Y0, (0.0, 2.0), P, saveat=og.SaveAt(ts=TS), adjoint=og.Interpolating(),
            solver=solver,
        )  # fmt: skip
        assert f"the backward solve stops at each of the {TS.size} saves" in said, said
