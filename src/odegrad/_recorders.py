"""What the while loop keeps besides the state: one small recorder object per optional output.

A recorder has a carry of its own in the loop state, in the spirit of optax's transforms::

    state = recorder.init(setup)               # before the loop: buffers of max_steps rows
    state = recorder.update(state, step, setup)  # after every attempted step
    outputs = recorder.finish(state, final)    # after the loop: named outputs

``update`` sees a :class:`StepTaken` and writes only when ``step.accept`` (a rejected step writes
to the out-of-range row ``step.row``, which drops the write). The loop itself knows none of the
outputs: saves (:mod:`~odegrad._saving`), the event log (:mod:`~odegrad._events`), the dense
output, the quadrature sum and an adjoint's record are all recorders.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ._tree import Packed, tree_fill_rows, tree_set_row

PyTree = Any


class LoopSetup(NamedTuple):
    """What recorders may read before the loop (times in forward time ``tau``)."""

    solver: Any
    f: Any
    args: PyTree
    s: Any  # +1 or -1: real time t = s * tau
    tau0: Any
    y0: PyTree
    st0: PyTree  # the solver's initial state
    max_steps: int
    events: Any = None  # the solve's EventSet, or None

    @property
    def tdtype(self):
        return jnp.result_type(self.tau0)

    def first_dense(self):
        """The dense output of a unit step from the start (to trace under ``jax.eval_shape``)."""
        h = jnp.asarray(self.s, self.tdtype)
        return self.solver.step(self.f, self.s * self.tau0, h, self.y0, self.args, self.st0).dense


class StepTaken(NamedTuple):
    """One attempted step of the while loop, as recorders see it (forward time)."""

    t: Any  # where it started
    h: Any  # its size
    t_new: Any  # where it ended (an event's time when one ended it)
    y: PyTree  # the state at its start
    st: PyTree  # the solver state at its start
    res: Any  # the solver's StepResult (dense output, y1)
    y_end: PyTree  # the state at its end before any event's jump
    accept: Any
    row: Any  # the accepted-step index; out of range (max_steps) when rejected
    event: Any = None  # StepEvents, when the solve has events
    event_row: Any = None  # the row of sol.events it wrote (out of range: none)
    pullback: Any = None  # the step's VJP, when a StepRecord took the step (``take``)


class Recorder(abc.ABC):
    """One optional output of the while loop: ``init``, ``update`` and ``finish``."""

    @abc.abstractmethod
    def init(self, setup: LoopSetup) -> PyTree:
        """The recorder's carry before the first step."""

    @abc.abstractmethod
    def update(self, state: PyTree, step: StepTaken, setup: LoopSetup) -> PyTree:
        """The carry after ``step`` (which may be rejected)."""

    @abc.abstractmethod
    def finish(self, state: PyTree, final) -> dict:
        """Named outputs from the final carry (``final``: the loop's LoopState)."""


@dataclass(frozen=True)
class StepTimes(Recorder):
    """Every accepted step's start and size: ``starts`` (``max_steps + 1`` rows, ``inf`` after
    the last step's end) and ``sizes`` (``max_steps`` rows, 1 after the last step)."""

    def init(self, setup):
        tdtype, n = setup.tdtype, setup.max_steps
        return (
            jnp.full((n + 1,), jnp.inf, tdtype).at[0].set(setup.tau0),
            jnp.ones((n,), tdtype),
        )

    def update(self, state, step, setup):
        starts, sizes = state
        # the end of accepted step k is the start of row k + 1
        return (
            starts.at[step.row + 1].set(step.t_new, mode="drop"),
            sizes.at[step.row].set(step.h, mode="drop"),
        )

    def finish(self, state, final):
        return {"starts": state[0], "sizes": state[1]}


@dataclass(frozen=True)
class DenseRows(Recorder):
    """Every accepted step's dense output (``sol.evaluate`` and the continuous adjoints)."""

    def init(self, setup):
        return tree_fill_rows(jax.eval_shape(setup.first_dense), setup.max_steps, 0.0)

    def update(self, state, step, setup):
        return tree_set_row(state, step.row, step.res.dense)

    def finish(self, state, final):
        return {"dense": state}


@dataclass(frozen=True)
class Accumulate(Recorder):
    """``sum over accepted steps of fn(t, dt, dense, args)`` (real time, signed ``dt``): the
    quadrature adjoint's ``dL/dp``; ``combine(total, new)`` in place of the sum if given;
    ``zeros``: the starting total, if known (else found by tracing ``fn`` on a first step)."""

    fn: Any
    combine: Any = None
    zeros: Any = None

    def init(self, setup):
        if self.zeros is not None:
            return self.zeros
        h = jnp.asarray(setup.s, setup.tdtype)
        shape = jax.eval_shape(
            lambda: self.fn(setup.s * setup.tau0, h, setup.first_dense(), setup.args)
        )
        return jax.tree.map(jnp.zeros_like, shape)

    def update(self, state, step, setup):
        s = setup.s
        contrib = self.fn(s * step.t, s * step.h, step.res.dense, setup.args)
        if self.combine is not None:
            new = self.combine(state, contrib)
            return jax.tree.map(lambda a, b: jnp.where(step.accept, b, a), state, new)
        return jax.tree.map(lambda a, b: a + jnp.where(step.accept, b, 0), state, contrib)

    def finish(self, state, final):
        return {"accumulated": state}


@dataclass(frozen=True)
class StepRecord(Recorder):
    """What a reverse pass needs from the forward while loop, besides :class:`StepTimes`: the
    starting state of every accepted step (``states``) and its solver state (``solver_states``,
    compacted by the solver), in the first ``rows`` rows (default every step); with events, also
    the row of ``sol.events`` each step ended with (-1: none) and where in the step (``theta``).

    Example:
        >>> problem.forward(record=StepRecord(states=True, rows=16))
    """

    states: bool = False
    solver_states: bool = False
    rows: int | None = None
    #: states kept at every ``stride``-th accepted step only (row ``k // stride``)
    stride: int = 1
    #: the dense output of the last ``dense_rows`` accepted steps, step ``k`` in row
    #: ``k % dense_rows`` (``"ring"``): a continuous adjoint's block of forward steps
    dense_rows: int | None = None
    #: also which accepted steps followed a rejection (``retried``, every step): a replay
    #: chaining each step's state into the next applies ``solver.after_step`` there, as
    #: the forward loop did, so that it retakes the steps the loop took
    retries: bool = False
    #: ``take(tau, h, tau_new, y, st) -> (StepResult, pullback)``: the loop takes each step
    #: through it and keeps the step's VJP (``jax.vjp``'s residuals, row ``k`` for accepted step
    #: ``k``, as ``record["pullback"]``, a :class:`~odegrad._tree.Packed` of rows): a reverse
    #: pass then applies them and re-takes no step, as JAX's reverse pass of a scan does
    take: Callable | None = field(default=None, compare=False)
    #: (the pullback's layout, read off the traced loop body)
    _pullback_layout: list = field(default_factory=list, compare=False, repr=False)

    def init(self, setup):
        rows = setup.max_steps if self.rows is None else min(self.rows, setup.max_steps)
        rows = -(-rows // self.stride)
        c = {}
        if self.dense_rows is not None:
            c["ring"] = tree_fill_rows(jax.eval_shape(setup.first_dense), self.dense_rows, 0.0)
        if self.states:
            c["y"] = tree_fill_rows(setup.y0, rows, 0.0)
        if self.solver_states:
            c["st"] = tree_fill_rows(setup.solver.compact_state(setup.st0), rows, 0.0)
        if self.retries:
            c["retried"] = jnp.zeros((setup.max_steps,), bool)
            c["pending"] = jnp.zeros((), bool)  # the last attempt was rejected
        if self.take is not None:
            # traced as the loop body traces the step: times, state and solver state abstract
            first = lambda t, h, y, st: Packed.pack(self.take(t, h, t + h, y, st)[1])
            t = jax.ShapeDtypeStruct((), setup.tdtype)
            packed = jax.eval_shape(first, t, t, setup.y0, setup.st0)
            c["pullback"] = [jnp.zeros((setup.max_steps, *x.shape), x.dtype) for x in packed.arrays]
        if setup.events is not None:
            c["ev"] = jnp.full((setup.max_steps,), -1, jnp.int32)
            c["theta"] = jnp.ones((setup.max_steps,), setup.tdtype)
        return c

    def update(self, state, step, setup):
        new = dict(state)
        row = step.row
        if self.stride > 1:  # out of range unless a kept step (a rejected one: max_steps)
            keep = step.accept & (row % self.stride == 0)
            row = jnp.where(keep, row // self.stride, setup.max_steps)
        if "y" in state:
            new["y"] = tree_set_row(state["y"], row, step.y)
        if "st" in state:
            new["st"] = tree_set_row(state["st"], row, setup.solver.compact_state(step.st))
        if "ring" in state:
            ring_row = jnp.where(step.accept, step.row % self.dense_rows, self.dense_rows)
            new["ring"] = tree_set_row(state["ring"], ring_row, step.res.dense)
        if "pullback" in state:
            packed = Packed.pack(step.pullback)
            rows = [(x.shape[1:], x.dtype) for x in state["pullback"]]
            if [(x.shape, x.dtype) for x in packed.arrays] != rows:  # (never cast nor broadcast)
                raise AssertionError(f"a step's VJP {packed.arrays} does not fit its rows {rows}")
            self._pullback_layout[:] = [packed.layout]
            new["pullback"] = tree_set_row(state["pullback"], step.row, list(packed.arrays))
        if "retried" in state:
            new["retried"] = state["retried"].at[step.row].set(state["pending"], mode="drop")
            new["pending"] = ~step.accept
        if "ev" in state:
            ev = step.event
            new["ev"] = (
                state["ev"].at[step.row].set(jnp.where(ev.fired, step.event_row, -1), mode="drop")
            )
            new["theta"] = state["theta"].at[step.row].set(ev.theta, mode="drop")
        return new

    @staticmethod
    def retried_at(record, k):
        """Whether accepted step ``k`` of a finished ``record`` followed a rejection (``None``
        when it was not recorded): the ``retried`` argument of ``Problem.step``."""
        return record["retried"][k] if "retried" in record else None

    def finish(self, state, final):
        kept = {k: v for k, v in state.items() if k != "pending"}
        if "pullback" in kept:
            kept["pullback"] = Packed(kept["pullback"], self._pullback_layout[0])
        return {"record": {**kept, "n": final.accepted}}
