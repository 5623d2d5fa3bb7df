"""Save-time cotangents as extra columns of a backward step, so the adjoint steps across saves.

The adjoint ``a`` of a loss on saved values jumps by each save's cotangent ``c_j`` at its time
``s_j``. A backward solve that stops at every save restarts there and pays at least one full
step per save: with 100 saves and a smooth field, a hundred steps where the forward pass took
five. The adjoint ODE is linear in ``a``, so over a backward step from ``hi`` down to ``lo``
the jumps inside it superpose::

    a(lo) = Phi(lo, hi) a(hi) + sum over lo < s_j < hi of Phi(lo, s_j) c_j

Each term is the homogeneous adjoint ODE over its own span, ``[lo, hi]`` or ``[lo, s_j]``. A
:class:`ColumnSolver` step integrates them together: column ``j`` runs in the step's variable
``theta`` in ``[0, 1]``, at forward time ``s_j - theta (s_j - lo)``. One explicit Runge–Kutta
step of size 1 in ``theta`` on the stacked columns evaluates every column's right-hand side in
one vector-Jacobian product of ``f``, whose parameter cotangent is summed over the columns
inside the product (for a dense layer a matrix product, not a parameter-sized array per
column). ``dL/dp`` is one state of the backward ODE (``Interpolating``) with that sum as its
rate, or a Gauss–Legendre quadrature in ``theta`` over the columns (``Quadrature``). The error
estimate is the largest of the columns'.

A step holds at most ``columns`` saves (``Tuning.adjoint_columns``, fewer for a large state:
``Tuning.column_entries``); the loop's step is capped (:meth:`ColumnSolver.max_step`) so that no
more fall inside. A step with fewer saves inside still pays for every column: a branch to a
one-column step for the steps without saves made sparse saves (Lotka–Volterra, 20 saves in ~120
steps) 1.3x faster but doubled the compile time. A save at a step's end enters the next step as
a column of its full length; one at the start of a backward interval is added to ``a``
beforehand (:meth:`SaveColumns.absorb`), after that breakpoint's own jumps (an event's). Saves
at equal times are merged.

The sources that can read ``y`` anywhere in the interval have ``reads_anywhere``: the forward
dense output (``Interpolating()``, ``Quadrature()``) and the re-taken step
(``Interpolating(checkpoints=c)``).

For small states (``Tuning.propagator_entries``) a :class:`PropagatorSolver` step carries the
``n x n`` propagator of the adjoint ODE instead (``n`` columns at the step's own times), and
every save inside enters through it: ``n`` products per stage however many saves. With 100
saves in 5 forward steps the neural ODE's (n = 2) backward pass took 5 steps of 7 stages,
2 columns each plus 7 rows for ``dL/dp``: about 105 rows of network products per member,
against about 1,100 as columns (9 steps of 7 stages, 17 columns each). It reads ``y`` only
at its own stages, so ``Backsolve``, whose re-integrated ``y`` is known along one path only,
rides the saves in it too (when ``f`` has enough parameters for the stops to cost more than
the propagator's bookkeeping, ``Tuning.backsolve_across_params``); otherwise ``Backsolve``
stops at every save. A state of ``B`` rows that ``f`` keeps apart (a batch stacked into one
state, see :mod:`~odegrad.adjoint.rows`) carries one ``m x m`` propagator per row in the same
``m`` products per stage.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from .._step import time_inside_jumps
from .._tree import rms_error_ratio, tree_bytes, tree_lincomb, tree_size
from .._tuning import tuning
from ..solvers.base import AbstractSolver, StepResult
from ..solvers.explicit_rk import ExplicitRK, dense_weights
from .rows import independent_rows

PyTree = Any


def _solve(m, b):
    """``m^-1 b`` for small ``m`` near the identity (batched over leading axes), by Gaussian
    elimination unrolled over the static size without pivoting: elementwise operations that XLA
    fuses, where a batched LAPACK call per backward step cost more than the step on small
    problems."""
    n = m.shape[-1]
    for k in range(n):
        scale = m[..., k + 1 :, k] / m[..., k, k, None]
        m = m.at[..., k + 1 :, :].add(-scale[..., None] * m[..., k, None, :])
        b = b.at[..., k + 1 :].add(-scale * b[..., k, None])
    x = [None] * n
    for k in reversed(range(n)):
        acc = b[..., k]
        for j in range(k + 1, n):
            acc = acc - m[..., k, j] * x[j]
        x[k] = acc / m[..., k, k]
    return jnp.stack(x, -1)


def _blocks(tree, rows: int):
    """``tree``'s entries as ``(rows, m)``: row block ``b`` holds row ``b`` of every leaf (all
    of them when ``rows`` is 1), and the function that puts such an array back."""
    leaves, treedef = jax.tree.flatten(tree)
    dtype = jnp.result_type(*leaves)
    parts = [jnp.reshape(x, (rows, -1)).astype(dtype) for x in leaves]
    cuts = list(itertools.accumulate(p.shape[1] for p in parts))[:-1]

    def unravel(x):
        pieces = jnp.split(x, cuts, axis=1) if cuts else [x]
        out = [p.reshape(jnp.shape(v)).astype(v.dtype) for p, v in zip(pieces, leaves, strict=True)]
        return jax.tree.unflatten(treedef, out)

    return jnp.concatenate(parts, axis=1), unravel


def widest_value(f: Callable, y, *rest) -> int:
    """Entries of the largest array that one call ``f(y, *rest)`` computes from ``y``: the
    widest output of an equation of its jaxpr that depends on ``y`` (work on ``rest`` alone, a
    transposed weight matrix say, does not count), nested jaxprs included; traced once, nothing
    compiled.

    A product over ``k`` columns costs about ``k`` single ones once ``f``'s arrays are wide
    enough to keep the processor busy; below that, the columns ride in the idle lanes.

    Example:
        >>> widest_value(lambda y, w: jnp.tanh(y @ w.T), jnp.ones(8), jnp.ones((4, 8)))
        4
    """
    specs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), (y, *rest)
    )
    closed = jax.make_jaxpr(f)(*specs)
    n_y = len(jax.tree.leaves(specs[0]))
    deps = [i < n_y for i in range(len(closed.jaxpr.invars))]
    return _widest(closed.jaxpr, deps)


def _widest(jaxpr, deps) -> int:
    """The widest output of ``jaxpr``'s equations that depend on the invars flagged in
    ``deps``. A call whose jaxpr takes the equation's operands one to one (``jit``, custom
    derivatives) is followed operand by operand; any other nested jaxpr (loops, branches)
    counts whole once an operand depends."""
    dep = {v for v, d in zip(jaxpr.invars, deps, strict=True) if d}
    widest = 0
    for eqn in jaxpr.eqns:
        ins = [not isinstance(v, jex_core.Literal) and v in dep for v in eqn.invars]
        if not any(ins):
            continue
        dep.update(eqn.outvars)
        for v in eqn.outvars:
            widest = max(widest, math.prod(getattr(v.aval, "shape", ())))
        for inner in jex_core.jaxprs_in_params(eqn.params):
            inner = getattr(inner, "jaxpr", inner)
            one_to_one = len(inner.invars) == len(ins)
            widest = max(widest, _widest(inner, ins if one_to_one else [True] * len(inner.invars)))
    return widest


class SavePath(NamedTuple):
    """How a backward solve takes in the saves: in the propagator (``rows`` blocks of it, up to
    ``n_saves`` saves per step), as columns (``n_columns`` per step), or, both ``False``, by
    stopping at each."""

    propagator: bool
    columns: bool
    rows: int = 1
    n_saves: int = 1
    n_columns: int = 1


def save_path(problem, f, vjp, source, solver, adaptive: bool, a) -> SavePath:
    """Choose :class:`SavePath` for a backward solve of ``solver`` (adaptive or not) whose
    adjoint is shaped like ``a``: the saves ride in the steps of explicit adaptive solves, in
    the propagator for small states (it reads ``y`` at its own stages, so ``Backsolve``'s
    re-integrated ``y`` serves too) and for a batch of independent rows stacked into one state
    (:mod:`~odegrad.adjoint.rows`), as columns where ``y`` is readable anywhere and the columns
    pay (:func:`columns_pay`)."""
    t = tuning()
    ts = problem.plan.ts
    # explicit Runge-Kutta methods only, where the columns decouple. The implicit ones
    # (ESDIRK, Rosenbrock) have a tableau too, but as a ColumnSolver's inner step they ran one
    # Newton (or linear) solve on all the columns stacked ((columns + 1) x the state's size)
    # with a fresh Jacobian every step (none kept), and their saves' stiff transients, which
    # each save brings in either way, shared one budget of max_steps for the whole span, not
    # one per interval: Van der Pol (mu = 1000, rtol 1e-8, 10 saves) with Kvaerno3 needs
    # ~3,500 backward steps after each save (35,880 in all against the forward's 456) and ran
    # out at 8,192; stopping at each save, each interval takes its ~3,500 within its own budget.
    explicit = getattr(solver, "tableau", None) is not None and not getattr(
        solver, "implicit", False
    )
    if not (t.adjoint_columns > 0 and ts is not None and adaptive and explicit):
        return SavePath(False, False)
    size, n_params = tree_size(a), tree_size(problem.args_diff)
    many = ts.shape[0] >= t.row_propagator_saves
    rows = row_blocks(problem, vjp, t.row_propagator_entries) if many else 1
    block = size // rows
    propagator = (
        (source.reads_anywhere or (source.reintegrates and n_params >= t.backsolve_across_params))
        and 0 < block <= (t.propagator_entries if rows == 1 else t.row_propagator_entries)
        and isinstance(solver, ExplicitRK)
        and solver.tableau.dense is not None  # its stage weights at the saves
    )
    if propagator:
        n_saves = min(t.propagator_saves, ts.shape[0])
        at_save = tree_bytes(a) * block  # the propagator at each save, (M, B, m, m)
        # XLA:CPU's small-buffer fast path pays for a cheap f (few parameters; a 4-entry tanh
        # system, 200 saves: 2.1 ms capped, 5.1 ms not); on a network the cap's extra steps
        # cost more (the neural ODE as one (4, 2) state, 100 saves: 6.9 ms capped at 2 saves
        # per step, 1.6 ms not)
        rule, cheap = t.small_buffer_bytes, n_params < t.backsolve_across_params
        if rule and problem.batch == 1 and rows == 1 and at_save <= rule and cheap:
            n_saves = min(n_saves, rule // at_save)
        if rows > 1:
            n_saves = min(n_saves, t.row_propagator_bytes // at_save)
        return SavePath(True, True, rows, max(1, n_saves))
    if not (source.reads_anywhere and columns_pay(problem, f)):
        return SavePath(False, False)
    # columns cost one evaluation of f each per stage: fewer for a large state, and no more
    # than there are saves
    n_columns = min(t.adjoint_columns, t.column_entries // size, ts.shape[0])
    return SavePath(False, True, n_columns=max(1, n_columns))


def row_blocks(problem, vjp, per_row: int) -> int:
    """``B`` where the state's leaves have ``B`` rows that the vector-Jacobian product the
    backward pass uses keeps apart (a batch stacked into one state): read from that product, so
    a derivative rule of the user's (``custom_jvp``, ``custom_vjp``, ``vjp=``) is read too. Only
    looked for in a state too large for one propagator."""
    if tree_size(problem.y0) <= tuning().propagator_entries or per_row == 0:
        return 1
    t = problem.direction * problem.tau0
    pull = lambda y_ct, a: vjp(t, y_ct[0], a, y_ct[1])[0]
    return independent_rows(pull, (problem.y0, problem.y0), problem.args_diff)


def columns_pay(problem, f) -> bool:
    """Whether the saves should ride as columns rather than stop the backward solve: with at
    least two columns per step (``Tuning.column_entries``), and, where the backend's tuning
    says so, only while ``f``'s widest array, over the whole batch, leaves room for them
    (``Tuning.column_width``)."""
    t = tuning()
    if t.column_entries // max(tree_size(problem.y0), 1) < 2:
        return False
    if t.column_width is None:
        return True
    rhs = lambda y, a: f(problem.direction * problem.tau0, y, problem.with_args(a))
    width = widest_value(rhs, problem.y0, problem.args_diff) * max(problem.batch, 1)
    return width <= t.column_width


class SaveColumns(NamedTuple):
    """The saves' a-jumps, merged per distinct time (ascending; unused rows at ``+inf``)."""

    times: Any  # (N,)
    jumps: PyTree  # rows (N, ...) shaped like a
    states: PyTree = None  # rows (N, ...): the forward state there (Backsolve's drift test)

    @classmethod
    def merge(cls, times, jumps, valid, states=None) -> SaveColumns:
        """Sort, drop invalid saves (their jump becomes zero, their time ``+inf``) and sum the
        jumps of equal times into the group's first row (``states``: the group's first)."""
        order = jnp.argsort(jnp.where(valid, times, jnp.inf), stable=True)
        times = jnp.where(valid, times, jnp.inf)[order]
        valid = valid[order]
        rows = jax.tree.map(
            lambda r: jnp.where(valid.reshape((-1,) + (1,) * (r.ndim - 1)), r[order], 0), jumps
        )
        first = jnp.concatenate([jnp.ones((1,), bool), times[1:] != times[:-1]])
        group = jnp.cumsum(first) - 1
        n = times.shape[0]
        merged = jax.tree.map(lambda r: jax.ops.segment_sum(r, group, num_segments=n), rows)
        utimes = jnp.full((n,), jnp.inf, times.dtype).at[group].set(times)
        if states is not None:  # each group's first row
            pick = lambda r: jnp.where(first.reshape((-1,) + (1,) * (r.ndim - 1)), r[order], 0)
            states = jax.tree.map(lambda r: jax.ops.segment_sum(pick(r), group, n), states)
        return cls(utimes, merged, states)

    def below(self, p):
        """The index of the last save strictly before ``p`` (-1: none)."""
        return (jnp.searchsorted(self.times, p, side="left") - 1).astype(jnp.int32)

    def absorb(self, a, p):
        """``a`` plus the jump of a save at exactly ``p``, if any."""
        hit = self.times == p
        return jax.tree.map(
            lambda x, r: x + jnp.sum(jnp.where(hit.reshape((-1,) + (1,) * x.ndim), r, 0), 0),
            a,
            self.jumps,
        )


def save_columns(problem, keep, ys, args_diff, ct, with_states=False):
    """The saves' jumps of ``a`` (merged per time, :class:`SaveColumns`) from the states ``ys``
    there, and the sum of their ``dL/dp``, in one product over the saves; saves past where the
    solve stopped take no part."""
    plan = problem.plan
    valid = plan.ts <= keep["t1"]
    rows = jax.tree.map(
        lambda r: jnp.where(valid.reshape((-1,) + (1,) * (r.ndim - 1)), r, 0), ct.ts_ys
    )

    def saved(y_, a_):
        return jax.vmap(lambda p, y: plan.fn(p, y, problem.with_args(a_)))(plan.ts, y_)

    _, pull = jax.vjp(saved, ys, args_diff)
    cy, ca = pull(rows)
    return SaveColumns.merge(plan.ts, cy, valid, ys if with_states else None), ca


class ColumnSolver(AbstractSolver):
    """A backward solver whose step also carries the saves inside it as columns (see the module
    docstring). The backward state is ``{"a": ..., "g": ...}`` (``"g"``: ``dL/dp``, absent for
    the quadrature adjoint); ``rates(y, p, A, weights, args, with_g)`` gives the columns'
    ``da/dp`` at forward times ``p`` and states ``y`` (one per column), each times its weight,
    and the weighted sum of their ``dg/dp`` (``None`` unless ``with_g``).

    ``reader(hi)`` gives ``(read, reach)`` for a step from ``hi`` (see
    :meth:`~odegrad.adjoint.sources.StateSource.reader`). Its carried state is
    ``(k, hi, reach)``: the index of the last save not yet taken in, the start of the next step
    and how far below it the reader reaches. ``f`` (the main column's rate) serves only the
    loop's first-step guess.
    """

    def __init__(
        self,
        inner: AbstractSolver,
        saves: SaveColumns,
        columns: int,
        reader: Callable,
        rates: Callable,
        floor,
        quadrature: tuple | None = None,
        jumps=None,
    ):
        self.inner, self.saves, self.columns = inner, saves, columns
        # Adaptive(jump_ts=) in the backward loop's time (-p), where a step's stages read p
        self.jumps = jumps
        self.reader, self.rates = reader, rates
        self.floor = floor  # the backward interval's end: a save there is not this loop's
        self.quadrature = quadrature  # (nodes, weights) on [0, 1] for dL/dp, or None
        self.order = inner.order
        self.embedded_order = inner.embedded_order
        self.prev_ratio_floor, self.pi_gains = inner.prev_ratio_floor, inner.pi_gains
        self.init_evals = 0
        self.step_evals = inner.init_evals + inner.step_evals

    def init(self, f, t0, y0, args):
        return (self.saves.below(t0), t0, self.reader(t0)[1])

    def restart(self, f, t, y, args, state):
        # each step starts its inner solver afresh; the state counts the saves taken in
        return state

    def max_step(self, state):
        """At most ``columns`` saves inside a step (it may reach down to the next one after),
        and no further than the reader reaches."""
        k, hi, reach = state
        j = k - self.columns
        cap = jnp.where(j >= 0, hi - self.saves.times[jnp.maximum(j, 0)], jnp.inf)
        return jnp.minimum(cap, hi - reach)

    def _inside(self, k, lo):
        """The ``columns`` saves from index ``k`` down (latest first): their times, whether each
        lies inside the step above ``lo``, and ``take(rows)``, those rows of a save array."""
        idx = jnp.maximum(k - jnp.arange(self.columns), 0)
        times = self.saves.times[idx]
        inside = (k - jnp.arange(self.columns) >= 0) & (times > jnp.maximum(lo, self.floor))
        return times, inside, lambda rows: jax.tree.map(lambda r: r[idx], rows)

    def _columns(self, t0, dt, y0, k):
        lo = t0 + dt
        times, inside, take = self._inside(k, lo)
        start = jnp.concatenate([t0[None], jnp.where(inside, times, lo)])
        first = jax.tree.map(lambda a: a[None], y0["a"])
        jumps = jax.tree.map(
            lambda r: jnp.where(inside.reshape((-1,) + (1,) * (r.ndim - 1)), r, 0),
            take(self.saves.jumps),
        )
        cols = jax.tree.map(lambda x, r: jnp.concatenate([x, r]), first, jumps)
        return start, start - lo, cols, jnp.sum(inside)

    def _times(self, t0):
        """Forward times ``p`` of a step from ``t0`` as its stages read them: strictly between
        the jumps around it (:func:`~odegrad._step.time_inside_jumps`)."""
        return time_inside_jumps(self.jumps, -t0, -1.0)

    def rhs_theta(self, read, start, length, at=lambda p: p):
        """d/dtheta of the stacked state: column ``j`` at forward time ``start_j - theta
        length_j`` (as ``at`` reads it), its rate times ``-length_j``."""

        def rhs(theta, z, args):
            p = at(start - theta * length)
            da, dg = self.rates(jax.vmap(read)(p), p, z["a"], -length, args, "g" in z)
            return {"a": da} if dg is None else {"a": da, "g": dg}

        return rhs

    def _stacked(self, read, start, length, cols, y0, args, at):
        """One step of size 1 in theta on the stacked columns: the new state (columns summed),
        its error (the worst column's; ``dL/dp`` left out) and the quadrature's ``dL/dp``."""
        z0 = {**y0, "a": cols}
        rhs = self.rhs_theta(read, start, length, at)
        one = jnp.ones((), start.dtype)
        res = self.inner.step(rhs, 0 * one, one, z0, args, self.inner.init(rhs, 0 * one, z0, args))
        y1 = {**res.y1, "a": jax.tree.map(lambda x: jnp.sum(x, 0), res.y1["a"])}
        # zeros for dL/dp make its error estimate dead code
        error = {name: jax.tree.map(jnp.zeros_like, v) for name, v in y0.items()}
        error["a"] = jax.tree.map(lambda e: jnp.max(jnp.abs(e), 0), res.error["a"])
        quad = ()
        if self.quadrature is not None:  # Gauss–Legendre in theta over every column at once
            quad = None
            for x, w in zip(*self.quadrature, strict=True):
                a = self.inner.interpolate(res.dense, x)["a"]
                p = at(start - x * length)
                _, dg = self.rates(jax.vmap(read)(p), p, a, -length, args, True)
                dg = jax.tree.map(lambda v: w * v, dg)
                quad = dg if quad is None else jax.tree.map(jnp.add, quad, dg)
        return y1, error, quad

    def step(self, f, t0, dt, y0, args, state):
        k = state[0]
        t0 = jnp.asarray(t0)
        start, length, cols, taken = self._columns(t0, dt, y0, k)
        read = self.reader(t0)[0]
        y1, error, quad = self._stacked(read, start, length, cols, y0, args, self._times(t0))
        lo = t0 + dt
        state = ((k - taken).astype(k.dtype), lo, self.reader(lo)[1])
        return StepResult(y1, error, quad, state)

    def interpolate(self, dense, theta):
        raise NotImplementedError("the column steps keep no dense output")


class PropagatorSolver(ColumnSolver):
    """A backward step for small states that carries the adjoint's propagator instead of one
    column per save, so a step costs ``n`` state products per stage however many saves it
    crosses.

    Over a step from ``hi`` down to ``lo`` (``theta`` in ``[0, 1]``, forward time
    ``hi - theta (hi - lo)``) the step integrates the ``n x n`` propagator ``U(theta)``
    (``U(0) = I``) of the homogeneous adjoint ODE: ``n`` columns at one time, each a
    vector-Jacobian product of ``f`` with respect to ``y`` alone. With the saves inside at
    ``theta_j`` and ``dw_j = U(theta_j)^-1 c_j`` (``U`` from the step's dense output),
    ``a(theta) = U(theta) w(theta)`` where ``w = a(hi) + sum of dw_j over theta_j < theta`` is
    piecewise constant, and ``a(lo) = U(1) w(1)``.

    ``dL/dp`` over the step is ``int a^T f_p`` on each piece between saves. Written with the
    Runge–Kutta method's continuous extension ``b_k(theta)`` of ``G(theta) = int_0^theta f_p^T U``,
    it telescopes to one sum over the stages::

        sum over pieces of G w  =  sum_k L_k u_k,   u_k = b_k w(1) - sum_j b_k(theta_j) dw_j

    with ``L_k = f_p^T U_k`` at stage ``k`` (``U_k`` its stage value): one vector-Jacobian product
    with respect to ``p`` over the stages, cotangent ``U_k u_k`` each, its parameter cotangent
    summed inside the product. The error estimate is the propagator's applied to ``w(1)``. The
    step's "dense output" is ``{"g": dL/dp}``, which the loop sums over accepted steps.

    Against :class:`ColumnSolver` (``columns + 1`` products with respect to ``y`` and ``p`` per
    stage) this pays ``n`` products with respect to ``y`` per stage and one over the stages
    with respect to ``p``, and the step's length is not capped by the saves' count (up to
    ``columns`` saves are gathered per step). ``U(theta_j)`` must be invertible: a backward step
    of an explicit method is stability-limited, so ``U`` stays near the identity. It needs the
    method's stage weights, so only explicit tableaus with a continuous extension use it.
    ``state_rates(y, p, U, weight, args)`` gives ``dy/dp`` and the columns' ``dU/dtheta`` at
    forward time ``p``; ``rates`` is :class:`ColumnSolver`'s (here for ``dL/dp`` only).

    ``reintegrate`` (``Backsolve``): ``(rtol, atol)`` of its drift test. The step then
    integrates ``y`` (key ``"y"``, from the same linearisation of ``f``) beside ``U`` instead of
    reading it, and compares its dense output with the forward state at each save inside
    (``saves.states``): the worst ratio in tolerances is the dense output's ``"drift"``. Where
    the step ends, ``y`` is corrected by the last save's difference carried there to first
    order, ``Phi(lo, s) e = U(1)^-T U(theta_s)^T e``: the reset to the stored state that a solve
    stopping at that save makes, without stopping.
    """

    def __init__(
        self,
        inner,
        saves,
        columns,
        reader,
        rates,
        state_rates,
        floor,
        reintegrate=None,
        rows=1,
        jumps=None,
    ):
        super().__init__(inner, saves, columns, reader, rates, floor, jumps=jumps)
        self.state_rates, self.reintegrate, self.rows = state_rates, reintegrate, rows

    def step(self, f, t0, dt, y0, args, state):
        k, tab = state[0], self.inner.tableau
        t0 = jnp.asarray(t0)
        lo = t0 + dt
        length = t0 - lo
        read = self.reader(t0)[0]
        a0, unravel = _blocks(y0["a"], self.rows)  # (B, m): one m x m propagator per row block
        n = a0.shape[1]
        on_y = self.reintegrate is not None

        def matrix(cols):  # columns (n, ...) shaped like a -> (B, m, n) matrices
            return jnp.moveaxis(jax.vmap(lambda c: _blocks(c, self.rows)[0])(cols), 0, -1)

        def apply(u, v):  # u (B, m, n) times v (B, n), row block by row block
            return jnp.einsum("bij,bj->bi", u, v)

        at = self._times(t0)

        def rhs(theta, z, args_):
            p = at(t0 - theta * length)
            y = z["y"] if on_y else read(p)
            dy, da = self.state_rates(y, p, z["a"], -length, args_)
            return {"a": da, "y": jax.tree.map(lambda v: -length * v, dy)} if on_y else {"a": da}

        # column k: e_k in every row block (the blocks' Jacobians are independent)
        eye = jnp.broadcast_to(jnp.eye(n, dtype=a0.dtype)[:, None, :], (n, *a0.shape))
        z0 = {"a": jax.vmap(unravel)(eye), **({"y": y0["y"]} if on_y else {})}
        one = jnp.ones((), t0.dtype)
        res = self.inner.step(rhs, 0 * one, one, z0, args, self.inner.init(rhs, 0 * one, z0, args))
        u_end = matrix(res.y1["a"])

        # the saves inside the step, each's propagated jump dw_j
        times, inside, take = self._inside(k, lo)
        theta = jnp.where(inside, (t0 - times) / length, 0)
        jumps = jax.vmap(lambda c: _blocks(c, self.rows)[0])(take(self.saves.jumps))
        jumps = jnp.where(inside[:, None, None], jumps, 0)
        dense_at = jax.vmap(lambda th: self.inner.interpolate(res.dense, th))(theta)
        u_at = jax.vmap(matrix)(dense_at["a"])
        dw = jnp.where(inside[:, None, None], _solve(u_at, jumps), 0)
        w = a0 + jnp.sum(dw, 0)
        y1 = {**y0, "a": unravel(apply(u_end, w))}
        error = {name: jax.tree.map(jnp.zeros_like, v) for name, v in y0.items()}
        error["a"] = unravel(apply(matrix(res.error["a"]), w))
        out = {}
        if on_y:
            stored = take(self.saves.states)
            y1["y"], error["y"], out["drift"] = self._reset(
                res, dense_at["y"], stored, u_at, u_end, inside
            )

        # dL/dp: one product over the stages (see the class docstring)
        ks = res.dense[2]
        weights = dense_weights(tab.dense, theta)  # per stage, (columns,)
        stages = [z0] + [tree_lincomb(z0, one, tab.a[i - 1], ks[:i]) for i in range(1, tab.stages)]
        cts = jnp.stack(
            [
                apply(matrix(stage["a"]), b_i * w - jnp.einsum("s,sbj->bj", w_i, dw))
                for stage, b_i, w_i in zip(stages, tab.b, weights, strict=True)
            ]
        )
        p = at(t0 - jnp.asarray(tab.c, t0.dtype) * length)
        ys = jax.tree.map(lambda *v: jnp.stack(v), *[z["y"] for z in stages]) if on_y else None
        ys = jax.vmap(read)(p) if ys is None else ys
        w_p = jnp.broadcast_to(-length, p.shape)
        _, out["g"] = self.rates(ys, p, jax.vmap(unravel)(cts), w_p, args, True)
        state = ((k - jnp.sum(inside)).astype(k.dtype), lo, self.reader(lo)[1])
        return StepResult(y1, error, out, state)  # dL/dp as its "dense output", summed outside

    def _reset(self, res, y_at, stored, u_at, u_end, inside):
        """Backsolve's state at the step's end, its error, and the worst drift at the saves."""
        rtol, atol = self.reintegrate
        ratio = jax.vmap(
            lambda y, s: rms_error_ratio(jax.tree.map(jnp.subtract, y, s), s, s, rtol, atol)
        )(y_at, stored)
        drift = jnp.max(jnp.where(inside, jnp.where(jnp.isfinite(ratio), ratio, jnp.inf), 0))
        last = jnp.maximum(jnp.sum(inside) - 1, 0)  # the save nearest lo (none: no correction)
        diff = jax.tree.map(lambda y, s: (y[last] - s[last]) * jnp.any(inside), y_at, stored)
        e, unravel = _blocks(diff, self.rows)
        back = jnp.einsum("bji,bj->bi", u_at[last], e)  # U(theta_s)^T e, block by block
        shift = _solve(jnp.swapaxes(u_end, -1, -2), back)
        y_end = jax.tree.map(jnp.subtract, res.y1["y"], unravel(shift))
        return y_end, res.error["y"], drift
