"""Events: zero crossings of ``cond(t, y, args)`` located on the step's dense output.

On every accepted step ``[t, t + h]`` the loop compares the sign of each event's ``cond`` at the
two ends. A crossing in the event's ``direction`` is located by the Illinois method (regula falsi
that halves the retained end's value when one end sticks; Dowell & Jarratt, BIT 11, 1971) on
``theta -> cond(t + theta h, interpolant(theta))``, the earliest crossing of all events wins, and
the step ends there: the solve stops (``terminal``), the state jumps by ``update`` and the solve
restarts, or the crossing is only recorded.

Gradients flow through the event time and the jump by the implicit function theorem
(:mod:`odegrad._event_jump`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ._batching import any_member
from ._event_jump import beside_surface, jump
from ._recorders import Recorder
from ._roots import common_root, earliest_piece
from ._tree import tree_fill_rows, tree_set_row

PyTree = Any

#: points inside each step where an event's ``cond`` is read besides the ends, by default, on
#: adaptive steps and a state of at most ``INTERP_POINTS_MAX_STATE`` entries (SciML's
#: ``ContinuousCallback`` reads 10 in all). Elsewhere the default reads the ends only:
#: * a larger state (a PDE's fields): a point there is a pass over the whole state when
#:   ``cond`` reads all of it (1.39x the solve at 48^3, ``benchmarks/events.py``), and such
#:   solves' steps are held short by stability, not accuracy;
#: * fixed grids (``Fixed``, ``StepTo``): a step that does not resolve a fast transient has a
#:   dense output far from the solution inside it (ImplicitEuler's, 3.6 where y is 1 on
#:   y' = -50 (y - cos t) with dt = 0.5), whose false crossings would end the solve.
INTERP_POINTS = 3
INTERP_POINTS_MAX_STATE = 2**16
#: interior points read unrolled; more run as a loop of batches this size (``lax.map``), so
#: the compile time does not grow with their number
INTERP_POINTS_BATCH = 4


@dataclass(frozen=True)
class Event:
    """A zero crossing of ``cond(t, y, args)`` that stops the solve or changes the state.

    Args:
        cond: ``cond(t, y, args) -> scalar``; the event is where it crosses zero.
        direction: ``+1`` only rising crossings (negative to positive as the solve advances),
            ``-1`` only falling ones, ``0`` either.
        terminal: the solve ends at the event (``sol.ts[-1]`` is the event time with
            ``SaveAt(t1=True)``, later saves are ``inf``).
        update: ``update(t, y, args) -> y`` for a non-terminal event: the state jumps there and
            the solve continues. Without it a non-terminal event is only recorded.
        interp_points: how many points inside each step ``cond`` is also read at, on the
            step's dense output (``theta = k / (interp_points + 1)``); every event of a solve
            is read at the most that any of them asks for. By default 3 on adaptive steps with a
            state of at most 65536 entries, else 0 (the ends only). The points are only as good
            as the dense output: on a fixed grid that does not resolve a transient, give 0.

    A crossing is found on each step from the signs of ``cond`` at its ends and at
    ``interp_points`` equally spaced points of the step's dense output between them (as
    SciML's ``ContinuousCallback``): a ``cond`` that crosses and comes back within one step is
    seen when a point falls inside the excursion, and two crossings between neighbouring points
    cancel. ``interp_points=0`` compares the ends only (as diffrax); each point costs one
    interpolation of the state and one ``cond`` per step, a pass over the whole state where
    ``cond`` reads all of it (``docs/events.md``). A solve that starts on ``cond == 0`` does not
    fire at its start. After an event the solve restarts on ``cond == 0``; the sign it leaves
    with is that of ``cond``'s rate of change there, so a ball that bounces and falls back within
    one step still fires.
    A ``cond`` that changes sign by a jump (``t % P - d`` at ``t = P``) fires there once; its
    event time is differentiated through the jump's own surface (the ``rem`` in it).

    Example:
        >>> hit = og.Event(lambda t, y, args: y[0], direction=-1)   # height falls to zero
        >>> bounce = og.Event(lambda t, y, e: y[0], direction=-1, terminal=False,
        ...                   update=lambda t, y, e: y.at[1].multiply(-e))
        >>> cool = og.Event(lambda t, y, args: y.mean() - 0.5, interp_points=0)  # ends only
    """

    cond: Callable
    direction: int = 0
    terminal: bool = True
    update: Callable | None = None
    interp_points: int | None = None

    def __post_init__(self):
        if not callable(self.cond):
            raise TypeError(f"Event(cond={self.cond!r}): cond must be callable cond(t, y, args).")
        if self.direction not in (-1, 0, 1):
            raise ValueError(
                f"Event(direction={self.direction!r}): use +1 (rising), -1 (falling) or 0 (both)."
            )
        k = self.interp_points
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0):
            raise ValueError(
                f"Event(interp_points={k!r}): pass a non-negative int, the number of points "
                "inside each step where cond is read besides its ends (0: the ends only), or "
                "None for the default."
            )
        if self.update is not None and not callable(self.update):
            raise TypeError(f"Event(update={self.update!r}): update must be callable.")
        if self.update is not None and self.terminal:
            raise ValueError(
                "Event(update=...) with terminal=True: a terminal event ends the solve, so "
                "the update would never apply; pass terminal=False to jump and continue."
            )


class EventLog(NamedTuple):
    """``sol.events``: the events in the order they happened (``max_events`` rows).

    ``ts``: event times, ``+inf`` after the last; ``which``: the index of the event that fired
    (``-1`` after the last); ``ys``: the state just before each event; ``count``: how many.
    """

    ts: Any
    which: Any
    ys: PyTree
    count: Any


@dataclass(frozen=True)
class EventSet:
    """The solve's events, normalised: ``conds[i](t, y, args)`` and ``updates[i]`` (or None)
    take the solve's ``args`` (real time), ``f`` is the full right-hand side."""

    conds: tuple
    updates: tuple
    terminal: tuple
    directions: tuple
    f: Callable
    max_events: int
    #: ``hold(f, t, y, args) -> f`` held on the sides of its switches at ``(t, y)`` for a step
    #: (:func:`odegrad._switches.hold_switches`), where the events are ``f``'s own switches
    hold: Callable | None = None
    #: per event: the index of its cond's surface entry from ``og.switching_events``, or None
    #: (a surface entry's crossing by a jump never fires alone: the jump's own surface ties
    #: with it, see :meth:`locate`)
    surfaces: tuple = ()
    #: points inside each step where every ``cond`` is read besides the ends
    interp_points: int = 0

    @staticmethod
    def build(
        events, event_fns, f, partitioned, max_events, hold=None, steps=(0, True)
    ) -> EventSet | None:
        """The solve's :class:`Event` s with their ``(cond, update)`` on the solve's ``args``
        (``event_fns``), ``f`` its right-hand side (a pair for a partitioned solver);
        ``steps = (state entries, adaptive)`` sets the default ``interp_points``."""
        if not events:
            return None
        full = f
        if partitioned:
            f_u, f_v = f
            full = lambda t, y, a: (f_u(t, y[1], a), f_v(t, y[0], a))
        return EventSet(
            conds=tuple(c for c, _ in event_fns),
            updates=tuple(u for _, u in event_fns),
            terminal=tuple(bool(e.terminal) for e in events),
            directions=tuple(int(e.direction) for e in events),
            f=full,
            max_events=int(max_events),
            hold=hold,
            surfaces=tuple(
                e.cond.index if getattr(e.cond, "is_surface_entry", False) else None for e in events
            ),
            interp_points=max(default_interp_points(e, *steps) for e in events),
        )

    def held(self, f, t, y, args, direction):
        """``f`` for a step that starts at ``(t, y)`` (real time) and moves in ``direction``
        (+1 or -1, in real time): its switches held there on the side it moves into when the
        events are its switching surfaces, else ``f`` itself."""
        return f if self.hold is None else self.hold(f, t, y, args, direction)

    def values(self, t, y, args):
        """Every event's ``cond`` at ``(t, y)``, as one array (``f``'s surfaces, when they are
        the events, read in one pass over ``f`` rather than one per event)."""
        found = None if self.hold is None else self.hold.values(self.f, t, y, args)
        return jnp.stack([
            jnp.asarray(c(t, y, args) if k is None else found[k]).reshape(())
            for c, k in zip(self.conds, self.surfaces or (None,) * len(self.conds), strict=True)
        ])  # fmt: skip

    def crossed(self, before, after):
        """Which events cross between ``before`` and ``after`` (the ``cond`` values), in their
        direction (forward time)."""
        rise = (before < 0) & (after >= 0)
        fall = (before > 0) & (after <= 0)
        d = jnp.asarray(self.directions)
        return jnp.where(d > 0, rise, jnp.where(d < 0, fall, rise | fall))

    def interior(self, interpolate, s, t, h, args):
        """``(thetas, values)``: the points of the step ``[t, t + h]`` where every ``cond`` is
        read, its ends included (``theta`` from 0 to 1), and the ``cond`` values at those inside
        it (no derivative: they only decide where a crossing is)."""
        n, dtype = self.interp_points, jnp.result_type(h)
        thetas = jnp.arange(n + 2, dtype=dtype) / (n + 1)
        read = lambda theta: self.values(s * (t + theta * h), interpolate(theta), args)
        if n <= INTERP_POINTS_BATCH:  # a few: unrolled (measured faster than a vmap of them)
            values = jnp.stack([read(theta) for theta in thetas[1:-1]])
        else:  # many: one trace however many, a few states at once
            values = lax.map(read, thetas[1:-1], batch_size=INTERP_POINTS_BATCH)
        return thetas, lax.stop_gradient(values)

    def locate(self, interpolate, s, t, h, args, before, after, crossed, lo=0.0, hi=1.0):
        """``(theta, which)``: where in the step ``tau = t + theta h`` the earliest crossing is
        (``theta`` in ``(0, 1]``; ``inf`` with none) and which event it is; ``before`` and
        ``after`` are the ``cond`` values at ``theta = lo`` and ``hi``, the piece of the step
        searched.

        A ``cond`` may change sign by a jump rather than through zero (``rem(t, P) - d`` at
        ``t = P``, where ``rem`` itself jumps): that is no surface, and its implicit-function
        derivative would be wrong. Where such a jump and a true zero of another event fall at
        the same place (``og.switching_events`` puts one on the ``rem``), the true zero fires,
        at the latest of their located times."""
        dtype = jnp.result_type(before)
        eps = jnp.finfo(dtype).eps
        # crossings tied to a few ulps of the time, not of theta (a short step late in a long
        # solve): every event crossing within that of the earliest is tied
        tie = 16 * eps * (1 + jnp.abs(t) / jnp.maximum(jnp.abs(h), eps))
        tie = lax.stop_gradient(tie.astype(dtype))

        def values_at(theta):
            y = interpolate(theta)
            return lax.stop_gradient(self.values(s * (t + theta * h), y, args).astype(dtype))

        # (the bracket itself as narrow as the time resolves, a quarter of the tie: the jump's
        # sides are read a few ulps from the located state, which must be that near its surface)
        _, hi, glo, ghi, crossed = common_root(
            values_at, before, after, crossed, tie / 4, self.crossed, lo, hi
        )
        # the step ends past every tied crossing (an ulp apart): a rem's exact zero at t = P lies
        # before its jump when the solve runs backward in time, and its relation's jump would
        # fire again an ulp after the restart. So one more look, a tie past the bracket.
        past = jnp.minimum(hi + tie, 1.0)
        g_past = values_at(past)
        later = jnp.any(crossed & self.crossed(ghi, g_past) & ~self.crossed(glo, ghi))
        end, g_end = jnp.where(later, past, hi), jnp.where(later, g_past, ghi)
        tied = crossed & self.crossed(glo, g_end)
        band = jnp.sqrt(eps)
        zeros = jnp.abs(g_end) <= band * (jnp.abs(before) + jnp.abs(after))
        which = jnp.where(jnp.any(tied & zeros), jnp.argmax(tied & zeros), jnp.argmax(tied))
        return jnp.where(jnp.any(crossed), end, jnp.inf), which

    def jump(self, which, t, z, args, s):
        """``(t*, y-, y+)`` of event ``which`` at real time ``t`` from the state ``z`` there,
        differentiable as the module docstring says (``s``: the solve's time direction)."""
        branches = [
            (lambda t_, z_, a_, s_, i=i: jump(self, i, t_, z_, a_, s_))
            for i in range(len(self.conds))
        ]
        if len(branches) == 1:
            return branches[0](t, z, args, s)
        return lax.switch(which, branches, t, z, args, s)

    def beside(self, which, t, y, args, s, before: bool):
        """``(t', y')`` a few ulps before or after event ``which``'s crossing at ``(t, y)``,
        strictly on that side of its surface (see :func:`beside_surface`; no derivative)."""
        branches = [
            (lambda t_, y_, i=i: beside_surface(self.f, self._cond(i), t_, y_, args, s, before))
            for i in range(len(self.conds))
        ]
        return branches[0](t, y) if len(branches) == 1 else lax.switch(which, branches, t, y)

    def _cond(self, i):
        return lambda t, y, a: jnp.asarray(self.conds[i](t, y, a)).reshape(())

    def rate(self, which, t, y, args):
        """``d cond / dt`` of event ``which`` along the solution through ``(t, y)``."""
        f = self.f(t, y, args)

        def one(i):
            return lambda: jax.jvp(
                lambda t_, y_: self._cond(i)(t_, y_, args), (t, y), (jnp.ones_like(t), f)
            )[1]

        branches = [one(i) for i in range(len(self.conds))]
        return branches[0]() if len(branches) == 1 else lax.switch(which, branches)

    def is_terminal(self, which):
        return jnp.asarray(self.terminal)[which]


def default_interp_points(event: Event, state_size: int, adaptive: bool) -> int:
    """``event.interp_points``, or the default for a state of ``state_size`` entries on
    adaptive steps or a fixed grid."""
    if event.interp_points is not None:
        return int(event.interp_points)
    return INTERP_POINTS if adaptive and state_size <= INTERP_POINTS_MAX_STATE else 0


def prepare(events: Event | Sequence[Event] | None, max_events: int) -> tuple[Event, ...]:
    """The user's ``events`` as a tuple of :class:`Event`, checked."""
    if events is None:
        return ()
    if isinstance(events, Event):
        events = (events,)
    if not isinstance(events, Sequence) or not all(isinstance(e, Event) for e in events):
        raise TypeError(f"events={events!r}: pass an og.Event or a sequence of og.Event.")
    if not isinstance(max_events, int) or max_events < 1:
        raise ValueError(f"max_events={max_events!r} must be a positive int.")
    return tuple(events)


def check_shapes(events: tuple[Event, ...], t0, y0, arrays, user_args) -> None:
    """Trace each ``cond`` and ``update`` once: a scalar condition, an update that keeps the
    state's structure, shapes and dtype (``user_args(arrays)`` rebuilds the user's ``args``)."""
    want = jax.eval_shape(lambda: y0)
    for i, ev in enumerate(events):
        c = jax.eval_shape(lambda t, y, a, ev=ev: ev.cond(t, y, user_args(a)), t0, y0, arrays)
        if not (hasattr(c, "shape") and c.shape in ((), (1,))):
            raise ValueError(
                f"events[{i}].cond returned {c}; it must return one scalar (the event is its "
                "zero crossing), e.g. y[0] - 1.0 rather than y - 1.0."
            )
        if not jnp.issubdtype(c.dtype, jnp.floating):
            raise TypeError(
                f"events[{i}].cond returned dtype {c.dtype}; return a float whose sign changes "
                "at the event (a bool has no crossing to locate), e.g. y[0] - 1.0."
            )
        if ev.update is None:
            continue
        out = jax.eval_shape(lambda t, y, a, ev=ev: ev.update(t, y, user_args(a)), t0, y0, arrays)
        if jax.tree.structure(out) != jax.tree.structure(want):
            raise ValueError(
                f"events[{i}].update returned structure {jax.tree.structure(out)} but the state "
                f"has {jax.tree.structure(want)}; return the new state with y0's structure."
            )
        for o, w in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
            if o.shape != w.shape or o.dtype != w.dtype:
                raise ValueError(
                    f"events[{i}].update returned a leaf {o.dtype}{list(o.shape)} where the state "
                    f"has {w.dtype}{list(w.shape)}; the update must keep shapes and dtypes."
                )


class StepEvents(NamedTuple):
    """What :func:`step_events` found in one step."""

    fired: Any  # an event ended this step
    overflow: Any  # ... but the log was full
    theta: Any  # where in the step (1 without an event)
    which: Any
    terminal: Any
    tau: Any  # forward time of the event (a constant)
    t_star: Any  # real time of the event, differentiable
    y_minus: Any
    y_plus: Any
    state: Any  # the solver's state restarted at (t*, y+)
    evals: Any  # the right-hand-side evaluations the restart made
    values: Any  # every cond at the step's new end


class EventState(NamedTuple):
    """What the while loop carries for its events."""

    values: Any  # every cond at the current time
    count: Any  # events so far
    done: Any  # a terminal event fired

    @staticmethod
    def init(events: EventSet, t, y, args) -> EventState:
        return EventState(events.values(t, y, args), jnp.asarray(0), jnp.asarray(False))

    def after(self, ev: StepEvents, accept) -> EventState:
        """The state after a step that found ``ev`` (and was accepted or not)."""
        return EventState(
            jnp.where(accept, ev.values, self.values),
            self.count + ev.fired,
            self.done | (ev.fired & ev.terminal),
        )


@dataclass(frozen=True)
class EventLogRecorder(Recorder):
    """``sol.events``: each event's time (real), which event, and the state just before it."""

    max_events: int

    def init(self, setup):
        n, tdtype = self.max_events, setup.tdtype
        return (
            jnp.full((n,), jnp.inf, tdtype),
            jnp.full((n,), -1, jnp.int32),
            tree_fill_rows(setup.y0, n),
        )

    def update(self, state, step, setup):
        ts, which, ys = state
        ev, row = step.event, step.event_row
        return (
            ts.at[row].set(ev.t_star, mode="drop"),
            which.at[row].set(ev.which, mode="drop"),
            tree_set_row(ys, row, ev.y_minus),
        )

    def finish(self, state, final):
        return {"events": EventLog(*state, final.events.count)}


def step_events(
    events: EventSet, solver, f, args, s, t, h, t_end, res, state: EventState, accept
) -> StepEvents:
    """Detect, locate and apply the first event of an accepted step ``[t, t + h]`` (forward
    time; ``res``: the solver's step). The location runs in a branch taken only when some
    member of the batch crossed."""
    before, count = state.values, state.count
    after = events.values(s * t_end, res.y1, args)

    def interpolate(theta):  # in the state's dtypes, whatever theta's (a float64 cond's)
        y = solver.interpolate(res.dense, theta)
        return jax.tree.map(lambda v, like: v.astype(jnp.result_type(like)), y, res.y1)

    if events.interp_points:
        thetas, inside = events.interior(interpolate, s, t, h, args)
        values = jnp.concatenate([before[None], inside.astype(before.dtype), after[None]])
        crossing = lambda a, b: events.crossed(a, b) & accept
        crossed, lo, hi, glo, ghi = earliest_piece(thetas, values, crossing)
    else:
        crossed, lo, hi, glo, ghi = events.crossed(before, after) & accept, 0.0, 1.0, before, after
    fired = jnp.any(crossed)

    def located(_):
        theta, which = events.locate(interpolate, s, t, h, args, glo, ghi, crossed, lo, hi)
        # members that did not fire compute, then discard; in the time dtype (a float64 cond's)
        theta = jnp.where(fired, theta, 1.0).astype(jnp.result_type(h))
        tau = jnp.where(theta >= 1, t_end, t + theta * h)
        t_star, y_minus, y_plus = events.jump(which, s * tau, interpolate(theta), args, s)
        terminal = events.is_terminal(which)
        held = events.held(f, s * tau, y_plus, args, s)
        state, evals = solver.init_from(held, s * tau, y_plus, args, None)
        # the event that fired restarts on cond = 0: it leaves with the sign of cond's rate
        # (times the step, as a scale for the next location), not a second firing at zero.
        # A cond that jumps through zero (rem(t, P) - d at t = P) or that an update moved off
        # its surface is not near zero there: it keeps its value, or it would fire again at once
        leaving = s * events.rate(which, s * tau, y_plus, args) * h
        values = events.values(s * tau, y_plus, args)
        band = jnp.sqrt(jnp.finfo(values.dtype).eps)
        near = jnp.abs(values[which]) <= band * (jnp.abs(before[which]) + jnp.abs(after[which]))
        values = values.at[which].set(jnp.where(near, leaving.astype(values.dtype), values[which]))
        evals = jnp.asarray(evals, jnp.int32) + 1  # (and f in the rate of the event's cond)
        which = which.astype(jnp.int32)
        return theta, which, terminal, tau, t_star, y_minus, y_plus, state, evals, values

    def quiet(_):
        zero = jnp.asarray(0, jnp.int32)
        unchanged = (jnp.ones_like(h), zero, jnp.asarray(False), t_end, s * t_end)
        return (*unchanged, res.y1, res.y1, res.state, zero, after)

    theta, which, terminal, tau, t_star, y_minus, y_plus, state, evals, values = lax.cond(
        any_member(fired), located, quiet, None
    )
    which = which.astype(jnp.int32)
    overflow = fired & (count >= events.max_events)
    fired = fired & ~overflow
    values = jnp.where(fired, values, after)
    terminal, evals = terminal & fired, jnp.where(fired, evals, 0)
    return StepEvents(
        fired, overflow, theta, which, terminal, tau, t_star, y_minus, y_plus, state, evals, values
    )
