"""Where a continuous adjoint's backward pass gets the forward state ``y(t)``.

* :class:`ForwardDense` — the forward pass's dense output of every step (``Interpolating()``);
* :class:`DenseBlocks` — the same a block of steps at a time, earlier blocks re-taken from the
  state at their start (``Interpolating()`` when every step's buffer would be big);
* :class:`RecomputedSteps` — the forward steps re-taken last first from ``c`` checkpoints, each
  read through its dense output (``Interpolating(checkpoints=c)``);
* :class:`Reintegrated` — ``y`` integrated backwards beside the adjoint, reset to the stored
  forward state at every save time and checked against it (``Backsolve``).

A source changes what the forward pass keeps, how ``y(p)`` is read, what the backward ODE state
carries beside ``a`` and ``g``, and, for the checkpointed one, the order of the whole sweep; the
backward pass itself (:mod:`~odegrad.adjoint.adjoint_ode`) has no branch on which it is.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._batching import any_member, max_member, member_cond
from .._loop import LoopOutput, dense_evaluate
from .._recorders import StepRecord
from .._saving import SavePlan, saves_in_step
from .._solution import SolveFailure, host_check
from .._step import Adaptive
from .._tree import rms_error_ratio, tree_all_finite, tree_scale, tree_set_row
from .._tuning import tuning
from .base import Problem
from .checkpointing import reverse_steps

#: Backsolve flags the reverse pass when the re-integrated state is off by more than this many
#: forward tolerances at a save time ...
DRIFT_LIMIT = 1e6
#: ... or by more than this fraction of itself (``DRIFT_RELATIVE / rtol`` tolerances): at
#: ``rtol = 1e-6`` a million tolerances is the whole state. Van der Pol (mu = 1, y0 = (1, 2),
#: to t = 20; its limit cycle repels backwards) re-integrated to 5.5e5 tolerances off y0, and
#: its gradient was 38.1 for 1.24; to t = 5, 4 tolerances and the gradient to 3e-5.
DRIFT_RELATIVE = 0.1


def drift_limit(rtol):
    """The drift, in tolerances, above which Backsolve's gradient is not trusted:
    ``min(DRIFT_LIMIT, DRIFT_RELATIVE / rtol)``, with the loosest ``rtol`` given per entry."""
    loosest = jnp.max(jnp.stack([jnp.max(jnp.asarray(r)) for r in jax.tree.leaves(rtol)]))
    return jnp.minimum(DRIFT_LIMIT, DRIFT_RELATIVE / loosest)


def _report_drift(on_drift: str, fixed: bool, drift, limit) -> None:
    """Host side: raise or warn when the worst save's drift (any batch member's) is too big."""
    drift = np.ravel(drift)
    limit = np.broadcast_to(np.ravel(limit), drift.shape)
    k = int(np.argmax(drift / limit))
    d, lim = float(drift[k]), float(limit[k])
    if d > lim:
        msg = (
            f"og.Backsolve: the state re-integrated backwards drifted from the forward "
            f"solution by {d:.3g} tolerances at a save time or at t0 (the limit is {lim:.3g}: "
            f"the smaller of {DRIFT_LIMIT:g} tolerances and {DRIFT_RELATIVE:g} of the state), so "
            "its gradient is not trustworthy. "
        )
        if fixed:
            # measured in Adaptive()'s default tolerances: on a coarse grid the drift is mostly
            # the forward steps' own error (a harmonic oscillator, SemiImplicitEuler, dt = 0.3)
            msg += (
                "The forward steps are fixed: the drift is the grid's own discretisation error "
                "(measured in og.Adaptive()'s default tolerances) or instability in reverse "
                "time. Use adjoint=og.Discrete() (og.Auto()'s pick on fixed steps), which "
                "differentiates the steps taken, or refine the grid."
            )
        else:
            msg += (
                "The problem is unstable in reverse time (dissipative or stiff). "
                "Use adjoint=og.Interpolating() (or og.Discrete())."
            )
        if on_drift == "raise":
            raise SolveFailure(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)


def _drift(problem, y, stored):
    """How far the re-integrated ``y`` is from the ``stored`` forward state, in tolerances
    (``inf`` where not finite; 0 where the forward state itself is not: that solve failed, and
    its result says so, not a drift)."""
    ctrl = problem.control if isinstance(problem.control, Adaptive) else Adaptive()
    diff = jax.tree.map(jnp.subtract, y, stored)
    ratio = rms_error_ratio(diff, stored, stored, ctrl.rtol, ctrl.atol)
    return jnp.where(tree_all_finite(stored), jnp.where(jnp.isfinite(ratio), ratio, jnp.inf), 0)


class Pass(NamedTuple):
    """One backward pass: its inputs and the pieces a source's sweep puts together."""

    problem: Problem
    keep: dict  # what the forward pass kept for the backward one
    y0: Any
    args_diff: Any
    jump_at: Callable  # (p, label, c) -> c: the jumps at a breakpoint
    integrate: Callable  # (c, hi, lo) -> c: the backward ODE from hi down to lo
    intervals: Callable  # c -> c: every interval between breakpoints, last first
    #: (p, c, when) -> c: add the jumps of the saves at exactly p, when the saves ride in the
    #: backward steps as columns (None: they are breakpoints)
    absorb: Callable | None = None
    #: (c, lo, hi, first) -> c: the part of ``intervals`` within forward times [lo, hi]: the
    #: jumps at breakpoints in (lo, hi] (``first``: at or below lo too), the backward ODE
    #: between them clipped to [lo, hi]
    span: Callable | None = None


class StateSource:
    """Where the backward pass gets the forward state ``y(t)``; the defaults add nothing."""

    carries = ()  # components of the backward ODE state beside a and g (kept in the carry)
    #: ``y`` at any time of a backward interval (not only along the backward solve's path), so
    #: the saves can enter the backward steps as columns (:mod:`~odegrad.adjoint.columns`)
    reads_anywhere = False
    #: re-takes the forward steps from checkpoints (it needs ``StepRecord(retries=True)``)
    replays_steps = False
    #: integrates ``y`` backwards beside the adjoint (the carry ``"y"``, rate :meth:`rhs`; the
    #: propagator's step takes ``f`` from its own linearisation instead)
    reintegrates = False

    def forward_plan(self, plan: SavePlan) -> SavePlan:
        """The forward solve's SavePlan: the user's, plus what this source reads back."""
        return plan

    def step_record(self, problem: Problem) -> StepRecord:
        """What the forward loop records for the backward pass besides the saves."""
        return StepRecord(retries=problem.replays_retries and self.replays_steps)

    def split(self, out: LoopOutput, plan: SavePlan):
        """The forward output less what this source added to the user's ``plan``, and that
        part."""
        return out, {}

    def y(self, problem: Problem, keep, c, p, within=None):
        """The forward state at ``p``, from ``keep`` or the backward carry (or state) ``c``."""
        raise NotImplementedError

    def reader(self, problem: Problem, keep, c, hi, within=None):
        """For a backward step from ``hi``: ``read(p)``, the state at a time ``p <= hi``, and
        the earliest time it reaches (the step must not go below it)."""
        return (lambda p: self.y(problem, keep, c, p, within)), -jnp.inf

    def states_at_saves(self, problem: Problem, keep):
        """The forward state at every save time (rows), for sources that read anywhere."""
        raise NotImplementedError

    def step_starts(self, keep, c):
        """Where the forward steps whose dense output this source reads start (forward time,
        ascending, ``inf`` after the last), or None: the backward steps end on them (see
        ``_Continuous._backward``)."""
        return None

    def rhs(self, f, problem: Problem, p, y, args_diff) -> dict:
        """d/dp of the :attr:`carries` components at forward time ``p`` and state ``y``."""
        return {}

    def at_event(self, c, y_before):
        """The carry once the backward pass crosses an event whose state before it was this."""
        return c

    def at_breakpoint(self, problem: Problem, keep, c, label):
        """The carry on reaching a breakpoint (save index ``label``), before its jumps."""
        return c

    def sweep(self, bwd: Pass, carry):
        """The backward pass: the carry at the initial time from the one at the final time."""
        return bwd.intervals(carry)


def _with_states(plan: SavePlan) -> SavePlan:
    """``plan`` saving the state beside each saved value."""
    return replace(plan, fn=lambda t, y, a: (plan.fn(t, y, a), y), fn_is_state=False)


def _split_states(out: LoopOutput):
    """A :func:`_with_states` output as the user's, and the states saved beside it."""
    kept = {}
    for name in ("ts_ys", "steps_ys"):  # (value, y) pairs: the user sees the value
        rows = getattr(out, name)
        kept[name] = None if rows is None else rows[1]
        out = out if rows is None else out._replace(**{name: rows[0]})
    return out, kept


def _from_dense(problem: Problem, dense, p, within):
    """The state at ``p`` from dense output; by default from the step that ends at ``p`` at a
    step boundary, as a save there reads it. ``within = (lo, hi)``, the interval being
    integrated: from its own steps alone (at an event's time the steps on either side hold the
    states before and after its jump), at its ends from the step inside it, and beyond them
    from that step's interpolant extended: a backward stage may lie outside its step (Kvaerno5's
    third at 1.23 dt), and there the step past an event is the other branch of ``y`` (dL/dk
    was 9.4e-5 off on y' = -k y with a jump at t* = 0.74)."""
    if within is None:  # without events both sides agree: one search
        return dense_evaluate(problem.solver, dense, p, side="left")
    lo, hi = within
    at = jnp.clip(p, lo, hi)
    return dense_evaluate(problem.solver, dense, p, toward=0.5 * (lo + hi), at=at)


class ForwardDense(StateSource):
    """The forward pass's dense output of every step (``Interpolating()``)."""

    reads_anywhere = True

    def forward_plan(self, plan):
        return replace(plan, dense=True)

    def y(self, problem, keep, c, p, within=None):
        return _from_dense(problem, keep["dense"], p, within)

    def states_at_saves(self, problem, keep):
        return jax.vmap(lambda p: _from_dense(problem, keep["dense"], p, None))(problem.plan.ts)

    def step_starts(self, keep, c):
        return keep["dense"][0]

    def reader(self, problem, keep, c, hi, within=None):
        return _window_reader(problem, keep["dense"], hi, within)


def _window_reader(problem: Problem, dense, hi, within):
    """``(read, reach)`` from a window of the forward steps at and below ``hi``: a backward
    step's many reads (every column at every stage) search a few rows, not every row."""
    starts, sizes, data, n = dense
    rows = min(tuning().column_window_steps, starts.shape[0])
    last = jnp.clip(jnp.searchsorted(starts, hi, side="left") - 1, 0, n - 1)
    first = jnp.maximum(last - rows + 1, 0)
    take = lambda x: lax.dynamic_slice_in_dim(x, first, rows)
    window = (take(starts), take(sizes), jax.tree.map(take, data), last - first + 1)
    return (lambda p: _from_dense(problem, window, p, within)), starts[first]


class _LocalDense(StateSource):
    """Sources whose backward pass reads ``y`` from the dense output of a few forward steps
    in its carry (``"local"``), and that keep the state at each save for the saves' jumps."""

    reads_anywhere = True  # inside the steps whose dense output the carry holds
    replays_steps = True

    def forward_plan(self, plan):
        # the state at each save, for the saves' jumps (the saves are it unless SaveAt(fn=...))
        return plan if plan.ts is None or plan.fn_is_state else _with_states(plan)

    def split(self, out, plan):
        if plan.ts is None:
            return out, {}
        if plan.fn_is_state:
            return out, {"save_ys": out.ts_ys}
        out, kept = _split_states(out)
        return out, {"save_ys": kept["ts_ys"]}

    def states_at_saves(self, problem, keep):
        return keep["save_ys"]

    def y(self, problem, keep, c, p, within=None):
        return _from_dense(problem, c["local"], p, within)

    def step_starts(self, keep, c):
        return c["local"][0]


@dataclass(frozen=True)
class DenseBlocks(_LocalDense):
    """The forward pass's dense output ``rows`` steps at a time (``Interpolating()`` when every
    step's would be big): the forward loop keeps the last block's and the state at the start
    of every block; the backward pass crosses the blocks last first, re-taking each earlier
    block's steps from its start for their dense output. A solve of at most ``rows`` steps
    re-takes nothing.

    Under ``jax.vmap`` a buffer of every step's dense output, ``max_steps`` rows per member,
    cost more than the rest of the solve: the neural ODE's vmapped forward pass with dense
    output took 65 ms with 4096 rows against 7.0 ms with 64 (B = 256; its fresh memory)."""

    rows: int

    def step_record(self, problem):
        return StepRecord(
            states=True,
            solver_states=True,
            stride=self.rows,
            dense_rows=self.rows,
            retries=problem.replays_retries,
        )

    def reader(self, problem, keep, c, hi, within=None):
        return _window_reader(problem, c["local"], hi, within)

    def sweep(self, bwd, carry):
        problem, keep, rows = bwd.problem, bwd.keep, self.rows
        starts, sizes, n = keep["starts"], keep["sizes"], keep["n"]
        m = problem.max_steps
        args = problem.with_args(bwd.args_diff)
        blocks = jnp.maximum(-(-n // rows), 1)
        r = jnp.arange(rows)

        def retake(j, data, count):
            """Block ``j``'s dense output, its first ``count`` steps re-taken from the state at
            its start and written over ``data``."""
            first = j * rows
            x = jax.tree.map(lambda v: v[j], (keep["y"], keep["st"]))

            def body(i, x):
                y, st, data = x
                k = jnp.minimum(first + i, m - 1)
                retried = StepRecord.retried_at(keep, k)
                res = problem.step(starts[k], sizes[k], y, args, st, retried, starts[k + 1])
                return res.y1, res.state, tree_set_row(data, i, res.dense)

            return lax.fori_loop(0, count, body, (*x, data))[2]

        def block(i, c):
            c = dict(c)
            j = blocks - 1 - i  # each member's own blocks, last first
            active = j >= 0
            j = jnp.maximum(j, 0)
            first = j * rows
            # One buffer: it holds the forward pass's last block (every member's last), which
            # the first crossing reads as it is, and each earlier block's steps are written
            # over it (a second buffer of the block's size was measured as temp memory).
            retaken = jnp.where(i == 0, 0, max_member(jnp.clip(n - first, 0, rows)))
            data = retake(j, c.pop("ring"), retaken)
            count = jnp.clip(n - first, 1, rows)
            valid = r < count
            local = (
                jnp.where(valid, starts[jnp.minimum(first + r, m)], jnp.inf),
                jnp.where(valid, sizes[jnp.minimum(first + r, m - 1)], 1),
                data,
                count,
            )
            lo, hi = starts[first], starts[jnp.minimum(first + count, m)]
            new = bwd.span({**c, "local": local}, lo, hi, j == 0)
            # the buffer as the crossing's loop passed it through: read after that loop
            # otherwise, XLA would copy it into the loop
            data = new.pop("local")[2]
            new = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, c)
            return {**new, "ring": data}

        out = lax.fori_loop(0, max_member(blocks), block, {**carry, "ring": keep["ring"]})
        out.pop("ring")
        return out


@dataclass(frozen=True)
class RecomputedSteps(_LocalDense):
    """The forward steps re-taken last first from checkpoints (``Interpolating(checkpoints=c)``),
    each one's dense output the carry's ``"local"`` while the adjoint crosses that step."""

    checkpoints: int

    def sweep(self, bwd, carry):
        problem, keep, jump_at, integrate = bwd.problem, bwd.keep, bwd.jump_at, bwd.integrate
        plan = problem.plan
        if problem.grid is not None:
            starts, n = problem.grid, problem.grid.shape[0] - 1
            sizes = starts[1:] - starts[:-1]
        else:
            starts, sizes, n = keep["starts"], keep["sizes"], keep["n"]
        args = problem.with_args(bwd.args_diff)

        rec = keep
        if problem.events is not None:
            rec = {**keep, "which": keep["events"].which}

        def advance(k, x):
            res = problem.step(
                starts[k], sizes[k], x[0], args, x[1], StepRecord.retried_at(keep, k), starts[k + 1]
            )
            if problem.events is not None:
                return problem.replay_event(rec, k, starts, res, args)[:2]
            return res.y1, res.state

        def backward(k, x, c):
            if problem.progress is not None:
                problem.progress.backward.every(k, n, 1 - k / n)
            res = problem.step(
                starts[k], sizes[k], x[0], args, x[1], StepRecord.retried_at(keep, k), starts[k + 1]
            )
            one = jax.tree.map(lambda d: d[None], res.dense)
            c = {**c, "local": (starts[k][None], sizes[k][None], one, 1)}
            hi = starts[k + 1]
            if problem.events is not None:  # step k ended with an event: jump first
                c = jump_at(hi, -2 - rec["ev"][k], c)
            if plan.steps:  # row k saved the state at the end of step k
                c = jump_at(hi, k, c)
            if plan.ts is not None and bwd.absorb is not None:
                # the saves inside the step ride in its backward steps as columns
                c = bwd.absorb(hi, c, hi > starts[k])
            elif plan.ts is not None:
                j0, j1 = saves_in_step(plan.ts, k, starts[k], hi)

                def sub(m, ch):
                    c_, hi_ = ch
                    j = j1 - 1 - m
                    p = plan.ts[j]
                    c_ = member_cond(hi_ > p, lambda z: integrate(z, hi_, p), lambda z: z, c_)
                    return jump_at(p, j, c_), p

                c, hi = lax.fori_loop(0, j1 - j0, sub, (c, hi))
            lo = starts[k]
            c = member_cond(hi > lo, lambda z: integrate(z, hi, lo), lambda z: z, c)
            c.pop("local")
            return c

        x0 = (bwd.y0, problem.init_state(bwd.y0, args))
        carry = reverse_steps(advance, backward, n, x0, carry, int(self.checkpoints))
        return carry if bwd.absorb is None else bwd.absorb(starts[0], carry)


@dataclass(frozen=True)
class Reintegrated(StateSource):
    """The state integrated backwards beside the adjoint (``Backsolve``); at every save time its
    drift from the stored forward state is measured and it is reset to that state."""

    on_drift: str
    carries = ("y",)
    reintegrates = True

    def forward_plan(self, plan):
        # the forward state beside each saved value: what the reset goes back to
        return _with_states(plan)

    def split(self, out, plan):
        return _split_states(out)

    def y(self, problem, keep, c, p, within=None):
        return c["y"]

    def states_at_saves(self, problem, keep):
        return keep["ts_ys"]

    def rhs(self, f, problem, p, y, args_diff):
        s = problem.direction
        return {"y": tree_scale(s, f(s * p, y, problem.with_args(args_diff)))}

    def at_event(self, c, y_before):
        return {**c, "y": y_before}  # the jump need not be invertible: resume from the stored y-

    def at_breakpoint(self, problem, keep, c, label):
        rows = keep["ts_ys"] if problem.plan.ts is not None else None
        if rows is None and problem.plan.steps:
            rows = keep["steps_ys"]
        if rows is None:
            return c
        stored, has = jax.tree.map(lambda r: r[jnp.maximum(label, 0)], rows), label >= 0
        ratio = _drift(problem, c["y"], stored)
        drift = jnp.where(has, jnp.maximum(c["drift"], ratio), c["drift"])
        y = jax.tree.map(lambda a, b: jnp.where(has, b, a), c["y"], stored)
        return {**c, "y": y, "drift": drift}

    def sweep(self, bwd, carry):
        drift = jnp.zeros((), bwd.keep["t1"].dtype)  # the worst save's, in tolerances
        carry = super().sweep(bwd, {**carry, "y": bwd.keep["y1"], "drift": drift})
        # and at t0, where the re-integrated state must come back to y0 (with no save times
        # in between this is the only check: a diffusion blew up to 1e160 unreported)
        carry["drift"] = jnp.maximum(carry["drift"], _drift(bwd.problem, carry["y"], bwd.y0))
        # the host is called only when some member drifted: nothing on the success path. A
        # forward solve that ended non-finite failed (its result says so; the gradient is nan):
        # re-integrating from there is no drift
        drift = jnp.where(tree_all_finite(bwd.keep["y1"]), carry["drift"], 0)
        # a backward solve that failed with its re-integrated state finite (its adjoint
        # overflowed) stopped short of t0: its own report names where; that y0 is not reached
        # is no drift
        own = (carry["failed"] != 0) & tree_all_finite(carry["y"])
        drift = jnp.where(own, 0, drift)
        control = bwd.problem.control
        limit = drift_limit(control.rtol if isinstance(control, Adaptive) else Adaptive().rtol)
        failed = any_member(jnp.any(drift > limit))
        report = partial(_report_drift, self.on_drift, not isinstance(control, Adaptive))
        return host_check(report, carry, failed, drift, limit)
