"""Switching surfaces: record-only events built from the branches in ``f`` itself.

A right-hand side that branches on the state or the time (``where(y > 1, a, b)``,
``where(t < tau, dose, 0)``, ``sign``, ``floor``) jumps in value where the solution crosses the
branch's surface ``g(t, y) = 0``. The solution's derivative then jumps by the saltation term
``(f- - f+) dt*``, ``dt* = -(dg/dy dy + dg/dp dp) / (dg/dt + dg/dy f-)`` (Hiskens & Pai, "Trajectory
sensitivity analysis of hybrid systems", IEEE TCAS-I 47(2), 2000), which no pointwise derivative
of ``f`` holds: every adjoint that differentiates ``f`` misses it unless the crossing is located,
which is what an :class:`~odegrad.Event` on the surface does. An infusion that stops at a fitted
time ``tau`` is the common case: without the event ``dy/dtau`` is exactly 0.

:func:`switching_events` reads the surfaces from ``f``'s jaxpr, as Modelica tools turn every
relation in an ``if`` into a zero-crossing function (Modelica Language Specification 3.6,
section 8.5, "Events and Synchronization"): each comparison ``a < b`` (``gt``, ``ge``, ``lt``,
``le``) of floats that depend on ``t`` or ``y`` gives ``g = a - b``; ``sign(x)`` gives ``x``;
``rem(x, c)`` gives a continuous ``g`` that is zero exactly at the multiples of ``c``, where it
jumps (:func:`_zero_at_multiples`), and so do ``floor``, ``ceil``, a float-to-integer conversion
(``c = 1``) and ``round`` (of ``x + 1/2``). With
``kinks=True`` the places where only ``f``'s slope jumps count too (``abs``, ``max``, ``min``,
``clamp``): an event there makes the step end on the kink, so even ``Discrete`` is exact there.

With all of those events in a solve, each switch is also held for a whole step on the side the
step starts on (:func:`hold_switches`): ``f`` inside a step is the smooth extension of its branch
and the event ends the step at the crossing, so no step straddles the jump (which an explicit
method accepts only once ``h`` is about ``tol / |f+ - f-|``: 36 rejected steps for one crossing
at rtol 1e-8, none held). A ``floor``-like switch holds its level: ``floor``'s integer, the count
``n`` of ``rem(x, c) = x - c n``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from ._batching import any_member, run_if
from ._events import Event
from ._kinks import _CALLS, _inexact, _is_literal, _location, reached_outputs
from ._tree import split_arrays
from ._warn import warn_user

__all__ = ["switching_events"]

_RELATIONS = frozenset({"gt", "ge", "lt", "le"})
_STEPS = frozenset({"sign", "floor", "ceil", "round", "rem", "convert_element_type"})
_KINKS = frozenset({"abs", "max", "min", "clamp"})
#: discontinuous in the state, but on surfaces no single ``g`` describes (ties between entries)
_UNCOVERED = frozenset({"argmax", "argmin"})


def switching_events(
    f: Callable, t0: Any, y0: Any, args: Any = None, *, kinks: bool = False, max_surfaces: int = 16
) -> tuple[Event, ...]:
    """Record-only events on the surfaces where ``f(t, y, args)`` switches branch.

    Pass them to :func:`odegrad.solve` as ``events=`` (with your own: ``events=(*found, hit)``)
    and every adjoint gets the term a jump in ``f``'s value contributes at each crossing (see the
    module docstring), and each step holds ``f``'s branches as they are at its start, so that a
    crossing ends a step rather than being straddled by many small ones (pass all of them:
    a subset holds nothing). Each surface entry is one :class:`~odegrad.Event` (``terminal=False``,
    no ``update``): a ``where`` over a vector of ``n`` entries gives ``n``. A crossing is one
    row of ``sol.events``, so raise ``max_events`` in ``og.solve`` for solutions that cross often.

    Args:
        f: the right-hand side, as passed to ``og.solve``.
        t0: an example time (the solve's own): only its dtype is read.
        y0: an example state: only its structure, shapes and dtypes are read.
        args: an example of ``f``'s ``args``: only its structure and array shapes are read.
        kinks: also put events where only ``f``'s slope jumps (``abs``, ``max``, ``min``,
            ``clamp``, hence ``relu``); off by default, since those cost the gradient only
            ``O(sqrt(tol))`` (see ``docs/adjoints.md``).
        max_surfaces: refuse more surface entries than this: events are located one at a time,
            so a switch per entry of a large state is better written as a smooth ``f``.

    Comparisons of values that depend on neither ``t`` nor ``y`` (on parameters only) never
    switch during a solve and give no event; nor do equality tests (``==``, ``isnan``) or
    comparisons inside ``lax.cond`` branches and loops (a Newton solve's stopping test, and
    also ``jnp.searchsorted``'s: a table lookup ``data[jnp.searchsorted(ts, t)]`` needs its
    events written by hand, e.g. ``t - ts[k]``). Returns ``()`` when ``f`` has no switch.

    Example:
        >>> f = lambda t, y, p: -p["k"] * y + jnp.where(t < p["tau"], p["rate"], 0.0)
        >>> p = {"k": 0.7, "rate": 2.0, "tau": 1.2}
        >>> events = og.switching_events(f, 0.0, 0.0, p)   # one event: t - tau
        >>> dy_dtau = jax.grad(lambda p: og.solve(f, 0.0, (0.0, 3.0), p,
        ...                                       events=events).ys[-1])(p)["tau"]
    """
    if not callable(f):
        raise TypeError(f"switching_events(f={f!r}): f must be callable f(t, y, args).")
    if not isinstance(max_surfaces, int) or max_surfaces < 1:
        raise ValueError(f"switching_events(max_surfaces={max_surfaces!r}): a positive int.")
    labels, uncovered = [], []

    def describe(t, y, a):
        found, skipped, _ = _walk_f(f, t, y, a, kinks)
        labels.extend(label for _, label, *_ in found)
        uncovered.extend(skipped)
        return [g() for g, *_ in found]

    arrays, rebuild, _ = split_arrays(args)  # strings, functions: not for eval_shape
    shapes = jax.eval_shape(lambda t, y, a: describe(t, y, rebuild(a)), t0, y0, arrays)
    sizes = [math.prod(s.shape) for s in shapes]
    for label in uncovered:
        warn_user(
            f"og.switching_events: {label} switches with the state on ties between entries, "
            "which no event describes; its crossings get no event.",
            UserWarning,
        )
    total = sum(sizes)
    if total > max_surfaces:
        listing = ", ".join(
            f"{where} ({n} entries)" for where, n in zip(labels, sizes, strict=True)
        )
        raise ValueError(
            f"switching_events: f switches on {total} surface entries ({listing}), more than "
            f"max_surfaces={max_surfaces}. Each is an event located on its own: pass a larger "
            "max_surfaces if the solution crosses only a few of them, or smooth the switch "
            "(e.g. a sigmoid of width well above the tolerance) where it crosses many."
        )
    entries = [
        f"{where}[{k}]" if n > 1 else where
        for where, n in zip(labels, sizes, strict=True)
        for k in range(n)
    ]
    return tuple(
        Event(_SurfaceEntry(f, kinks, i, total, label), direction=0, terminal=False)
        for i, label in enumerate(entries)
    )


def time_switch_labels(f, t0, y0, args) -> list[str]:
    """Where ``f`` switches branch on a surface that moves with ``t`` (``where(t < tau)``,
    ``floor(t / w)``; among those :func:`switching_events` puts events on), and where it looks
    a table up by ``t`` (a comparison inside a ``lax.scan``, as ``jnp.searchsorted``'s binary
    search makes), by source line; ``[]`` when it has none. Nothing runs."""
    labels: list[str] = []

    def describe(t, y, a):
        labels.extend(label for _, label, *_ in _walk_f(f, t, y, a, False, with_y=False)[0])
        closed = jax.make_jaxpr(f)(t, y, a)
        labels.extend(_lookups(closed.jaxpr, [True] + [False] * (len(closed.jaxpr.invars) - 1)))
        return ()

    arrays, rebuild, _ = split_arrays(args)
    jax.eval_shape(lambda t, y, a: describe(t, y, rebuild(a)), t0, y0, arrays)
    return list(dict.fromkeys(labels))


def moved_time_switches(f, t0, y0, args, moving) -> list[str]:
    """Labels of ``f``'s switches whose surface moves with ``t`` and with a value ``moving(x)``
    marks (an array leaf of ``args``, or one ``f`` closes over): ``where(t < tau, ...)`` with
    ``tau`` differentiated. No pointwise derivative of ``f`` holds the jump's term there, so
    without an event on the surface ``d/dtau`` misses it (``0`` for a held rate). Nothing runs."""
    arrays, rebuild, _ = split_arrays(args)
    labels: list[str] = []

    def surfaces(t, y, a):
        found = _walk_f(f, t, y, rebuild(a), False, with_y=False)[0]
        labels[:] = [label for _, label, *_ in found]
        return [g() for g, *_ in found]

    closed = jax.make_jaxpr(surfaces)(t0, y0, arrays)
    hit = reached_outputs(closed.jaxpr, _moving_vars(closed, arrays, moving))
    return [label for label, h in zip(labels, hit, strict=True) if h]


def _moving_vars(closed, arrays, moving) -> list:
    """The variables of ``closed`` (a jaxpr of ``(t, y, arrays)``, ``arrays`` its last inputs)
    that hold a value ``moving(x)`` marks: inputs from ``arrays`` and closed-over constants."""
    jaxpr, leaves = closed.jaxpr, jax.tree.leaves(arrays)
    inputs = jaxpr.invars[len(jaxpr.invars) - len(leaves) :]
    seeds = [v for v, x in zip(inputs, leaves, strict=True) if moving(x)]
    return seeds + [v for v, c in zip(jaxpr.constvars, closed.consts, strict=True) if moving(c)]


def may_lie_on_moved_switch(cond, t0, y0, args, moving) -> bool:
    """Whether an event's ``cond(t, y, args)`` reads both ``t`` and a value ``moving(x)``
    marks: only such an event can lie on a switch that value moves in time (``t - tau``);
    ``y - 5`` cannot. Nothing runs; a cond this cannot read counts as one that may."""
    try:
        arrays, rebuild, _ = split_arrays(args)
        closed = jax.make_jaxpr(lambda t, y, a: cond(t, y, rebuild(a)))(t0, y0, arrays)
    except Exception:
        return True
    jaxpr, seeds = closed.jaxpr, _moving_vars(closed, arrays, moving)
    return any(reached_outputs(jaxpr, jaxpr.invars[:1])) and any(reached_outputs(jaxpr, seeds))


_ORDERINGS = _RELATIONS | {"lt_to", "le_to"}


def _lookups(jaxpr, deps, where: str = "") -> list[str]:
    """Labels of the ``scan``s in ``jaxpr`` whose operands depend on the invars ``deps`` marks
    and whose body compares (a binary search: ``jnp.searchsorted``), at the user's line
    (``where``: the enclosing call's). A ``while`` loop's comparison is its stopping test (a
    Newton solve), not a lookup."""
    dep = {v for v, d in zip(jaxpr.invars, deps, strict=True) if d}
    found = []
    for eqn in jaxpr.eqns:
        d_in = [not _is_literal(v) and v in dep for v in eqn.invars]
        if not any(d_in):
            continue
        name = eqn.primitive.name
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")) if name in _CALLS else None
        here = where or _location(eqn)
        if inner is not None:
            found += _lookups(getattr(inner, "jaxpr", inner), d_in, here)
        elif name == "scan" and _compares(eqn.params["jaxpr"].jaxpr):
            found.append(f"a lookup by time (a comparison inside lax.scan) at {here}")
        dep.update(eqn.outvars)
    return found


def _compares(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _ORDERINGS:
            return True
        if any(_compares(sub) for sub in jex_core.jaxprs_in_params(eqn.params)):
            return True
    return False


def switch_holder(events, f, t0, y0, args) -> Callable | None:
    """``hold(f, t, y, args)`` (see :func:`hold_switches`) where ``events`` hold every entry of
    one :func:`switching_events` call, and ``f`` (the solve's right-hand side, its closure
    hoisted into ``args``) has the same surfaces; else None. A switch held without an event on
    its surface would never change branch, so a partial set holds nothing."""
    entries = [e.cond for e in events if isinstance(e.cond, _SurfaceEntry)]
    if not entries:
        return None
    first = entries[0]
    same = all(e.f is first.f and e.kinks == first.kinks for e in entries)
    if not same or sorted(e.index for e in entries) != list(range(first.total)):
        return None
    size = jax.eval_shape(lambda t, y, a: surface_values(f, t, y, a, first.kinks), t0, y0, args)
    if size.shape != (first.total,):
        return None
    return SwitchHolder(first.kinks, first.total)


class SwitchHolder:
    """``holder(f, t, y, args)``: :func:`hold_switches` with these events' ``kinks``."""

    def __init__(self, kinks: bool, total: int):
        self.kinks, self.total = kinks, total

    def __call__(self, f, t, y, args, direction=1):
        return hold_switches(f, self.kinks, t, y, args, direction)

    def values(self, f, t, y, args):
        """Every surface entry of ``f`` at ``(t, y)`` (:func:`surface_values`)."""
        return surface_values(f, t, y, args, self.kinks)

    def between_events(self, f):
        """``f`` with every held switch fixed: what a step sees, whose Jacobian no longer
        jumps at those switches (for :func:`odegrad._kinks.find_kinks`, which then reports
        only the others: ``floor``, a ``relu`` without ``kinks=True``, a switch in a loop)."""
        fixed = np.ones((self.total,))  # concrete: the held branches alone, no dependence
        return lambda t, y, a: _walk_f(f, t, y, a, self.kinks, fixed)[2]


class _SurfaceEntry:
    """``cond(t, y, args)``: entry ``index`` of ``f``'s surfaces, all flattened in order."""

    is_surface_entry = True

    def __init__(self, f, kinks: bool, index: int, total: int, label: str):
        self.f, self.kinks, self.index, self.total, self.label = f, kinks, index, total, label

    def __call__(self, t, y, args):
        values = surface_values(self.f, t, y, args, self.kinks)
        if values.size != self.total:  # f traced to a different program
            raise RuntimeError(
                f"og.switching_events: {self.label}: f has {values.size} surface entries at "
                f"these inputs' shapes, not the {self.total} it had when the events were "
                "built; build them with the solve's own t0, y0 and args."
            )
        return values[self.index]

    def __repr__(self) -> str:
        return f"switching surface {self.label}"


def _walk_f(
    f, t, y, args, kinks: bool, sides=None, with_y: bool = True
) -> tuple[list, list[str], Any]:
    """``([(g, label, scale, primitive), ...], uncovered, out)``: the surface values ``g`` of
    ``f`` at ``(t, y, args)``, one array per switch, the labels of state-dependent switches
    no surface describes, and ``f``'s output, with each switch held on the side ``sides``
    gives (the flattened surfaces' signs; 0: as ``f`` computes it) where ``sides`` is given.
    ``with_y=False``: only the switches whose surface moves with ``t``."""
    arrays, rebuild, _ = split_arrays(args)
    closed, shape = jax.make_jaxpr(lambda t_, y_, a_: f(t_, y_, rebuild(a_)), return_shape=True)(
        t, y, arrays
    )
    leaves = [t, *jax.tree.leaves(y), *arrays]
    deps = [True] + [with_y] * len(jax.tree.leaves(y)) + [False] * len(arrays)
    found: list[tuple[Any, str, Any]] = []
    uncovered: list[str] = []
    seen: dict[Any, Any] = {"entries": 0, "sides": sides}
    outs = _walk(closed.jaxpr, closed.consts, leaves, deps, kinks, (found, uncovered), seen,
                 ("", ""))  # fmt: skip
    return found, uncovered, jax.tree.unflatten(jax.tree.structure(shape), outs)


def surface_values(f, t, y, args, kinks: bool, with_scale: bool = False):
    """Every surface entry of ``f`` at ``(t, y, args)``, flattened in order, as one array (and
    with ``with_scale`` the size of each entry's operands, ``|a| + |b|`` for ``a - b``, and the
    levels of the ``floor``-like ones, see :func:`_levels`: ``(values, scales, levels)``)."""
    found, _, _ = _walk_f(f, t, y, args, kinks)
    found = [(g(), scale, levels) for g, _, scale, _, levels in found]
    dtype = jnp.result_type(*[g for g, _, _ in found], t)
    flat = lambda xs: jnp.concatenate([jnp.ravel(x).astype(dtype) for x in xs])
    values = flat([g for g, _, _ in found])
    if not with_scale:
        return values

    def levels(g, lv):  # (is a level, level, below, above, g > 0 above), flattened
        n = jnp.size(g)
        if lv is None:
            return [jnp.zeros(n, bool)] + [jnp.zeros(n, dtype)] * 3 + [jnp.zeros(n, bool)]
        return (
            [jnp.ones(n, bool)] + [jnp.ravel(x).astype(dtype) for x in lv[:3]] + [jnp.ravel(lv[3])]
        )

    each = [levels(g, None if lv is None else lv()) for g, _, lv in found]
    scales = flat([scale() for _, scale, _ in found])
    return values, scales, [jnp.concatenate([e[k] for e in each]) for k in range(5)]


def jump_surfaces(fn, t, y, args):
    """The surfaces where ``fn(t, y, args)`` jumps because a ``rem``, ``floor``, ``ceil``,
    ``round`` or float-to-integer conversion of ``t`` or ``y`` in it does (its comparisons
    and ``sign`` excepted), flattened into one array; None where it has none."""
    found, _, _ = _walk_f(fn, t, y, args, False)
    steps = [g() for g, _, _, name, _ in found if name in _STEPS - {"sign"}]
    if not steps:
        return None
    return jnp.concatenate([jnp.ravel(g).astype(jnp.result_type(t)) for g in steps])


def hold_switches(f, kinks: bool, t0, y0, args, direction=1):
    """``f`` with each of its switches held, for one step, on the side the solution is on at
    the step's start ``(t0, y0)``: the sign of its surface ``g`` there, or near the surface (a
    restart after an event) the sign of ``g``'s rate along ``f`` in ``direction`` (+1: as
    time increases), the side the solution moves to. (A backward pass that reads an interval
    down from its top holds with ``-1``: the side the solution arrived there from.) A
    solution that slides along a surface (``f`` pushing into it from both sides) has no such
    side; there the events chatter until ``max_events`` stops the solve. Modelica's
    tools hold their relations between events the same way (Modelica Language Specification
    3.6, 8.5): inside a step ``f`` is the smooth extension of its branch, and a
    crossing ends the step at the event that changes the branch, so no step straddles a jump
    (which an explicit method can take only at a step size of about ``tol / |f+ - f-|``).
    """
    t0, y0, args = lax.stop_gradient((t0, y0, args))
    g, scale, (is_level, level, below, above, above_positive) = surface_values(
        f, t0, y0, args, kinks, with_scale=True
    )

    def along_f(rate):
        tangent = (jnp.ones_like(t0), f(t0, y0, args))
        return jax.jvp(lambda t, y: surface_values(f, t, y, args, kinks), (t0, y0), tangent)[1]

    # Near the surface (an event's located state, which may lie a rounding error before it)
    # the side is the one the solution moves to. That is the side the loop's events saw it
    # cross to, while the sign of g, computed in another program, may round the other way and
    # hold the old branch for a whole step that no event then ends. Moving toward the surface
    # instead, the event fires within the near band, at once: a wide band costs at most an
    # evaluation of f, never a wrong branch.
    on = jnp.abs(g) <= jnp.sqrt(jnp.finfo(g.dtype).eps) * (scale + 1)
    rate = run_if(any_member(jnp.any(on)), along_f, jnp.zeros_like(g))
    sides = jnp.sign(jnp.where(on, direction * rate, g))
    # a floor-like switch holds its level (floor's integer, rem's count of c): near its jump,
    # the one on the side just found
    beside = jnp.where((sides > 0) == above_positive, above, below)
    sides = jnp.where(is_level, jnp.where(on, beside, level), sides)
    return lambda t, y, a: _walk_f(f, t, y, a, kinks, sides)[2]


def _walk(jaxpr, consts, values, deps, kinks, found, seen, context):
    """Evaluate ``jaxpr``, appending ``(g, label, scale)`` (``scale``: the size of ``g``'s
    operands, for rounding) to ``found[0]`` for each switch on a value
    that depends on ``t`` or ``y`` (``deps``), and to ``found[1]`` the labels of the others.
    Calls holding a switch are evaluated inside; everything else is bound as it is. ``seen``
    keeps one surface per set of operands."""
    const_env = zip(jaxpr.constvars, consts, strict=True)
    env: dict[Any, tuple[Any, bool]] = {v: (c, False) for v, c in const_env}
    env.update(zip(jaxpr.invars, zip(values, deps, strict=True), strict=True))

    def read(v):
        return (v.val, False) if _is_literal(v) else env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        vals = [x for x, _ in ins]
        dep = any(d for _, d in ins)
        name = eqn.primitive.name
        where = _location(eqn)
        here = (context[0], where) if where else context
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")) if name in _CALLS else None
        if dep and inner is not None and _has_switch(getattr(inner, "jaxpr", inner), kinks):
            sub = getattr(inner, "jaxpr", inner)
            sub_context = (str(eqn.params.get("name", name)), here[1]) if here[1] else here
            outs = _walk(sub, getattr(inner, "consts", ()), vals, [d for _, d in ins], kinks,
                         found, seen, sub_context)  # fmt: skip
        else:
            held = _record(eqn, ins, kinks, found, seen, here) if dep else None
            outs = _bind(eqn, vals)
            if not eqn.primitive.multiple_results:
                outs = [outs if held is None else held(outs)]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = (x, dep)
    return [read(v)[0] for v in jaxpr.outvars]


def _bind(eqn, vals):
    """``eqn``'s primitive applied to ``vals``, as ``jax.core.eval_jaxpr`` does it."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)  # jax < 0.7
    with contextlib.ExitStack() as stack:
        manager = getattr(getattr(eqn, "ctx", None), "manager", None)
        if manager is not None:
            stack.enter_context(manager)
        try:  # the user's source line on what this binds (explain_adjoint names it)
            from jax._src import source_info_util

            stack.enter_context(source_info_util.user_context(eqn.source_info.traceback))
        except Exception:  # private API: the location is a courtesy
            pass
        return eqn.primitive.bind(*subfuns, *vals, **params)


def _record(eqn, ins, kinks, found, seen, here):
    """Record ``eqn``'s surface in ``found`` (once per set of operands, in ``seen``) and, where
    ``seen["sides"]`` holds the surfaces' sides, return ``pointwise -> held``: its output with
    the switch held on that side (None: nothing to hold)."""
    name = eqn.primitive.name
    vals = [x for x, _ in ins]
    # a kink inside a library function goes by its name (relu, clip), a comparison by its own
    public = here[0] and not here[0].startswith("_") and here[0] not in _CALLS
    op = here[0] if name in _KINKS and public else name
    label = f"{op} at {here[1]}" if here[1] else op
    if name in _UNCOVERED:
        found[1].append(label)
        return None
    if not any(map(_inexact, eqn.invars)):
        return None
    order = [_key(v, x) for v, x in zip(eqn.invars, vals, strict=True)]
    # g and its scale as thunks: only the surface readers call them, while each of the many
    # evaluations of a held f (every stage of every step, traced again by jvp and vmap) would
    # otherwise trace them too
    size = lambda k: jnp.abs(vals[k])
    shape = jnp.broadcast_shapes(*[jnp.shape(x) for x in vals])
    if name in _RELATIONS or (kinks and name in ("max", "min")):
        keys, g, scale = sorted(order[:2]), lambda: vals[0] - vals[1], lambda: size(0) + size(1)
    elif name == "sign" or (kinks and name == "abs"):
        order = [order[0], ("literal", 0.0)]
        keys, g, scale = sorted(order), lambda: vals[0], lambda: size(0)
    elif kinks and name == "clamp":  # clamp(lo, x, hi)
        keys, g = order, lambda: jnp.stack([vals[1] - vals[0], vals[1] - vals[2]])
        scale = lambda: jnp.stack([size(1) + size(0), size(1) + size(2)])
        shape = (2, *shape)
    elif name in _STEPS and name != "sign":
        if name == "convert_element_type" and _inexact(eqn.outvars[0]):
            return None  # float to float: no jump
        x = lambda: vals[0] + 0.5 if name == "round" else vals[0]
        c = lambda: jnp.abs(jnp.asarray(vals[1] if name == "rem" else 1, jnp.result_type(vals[0])))
        g = lambda: _zero_at_multiples(x(), c())
        # (|g| ~ c^2 |x - jump| near one: the near band then spans ~sqrt(eps) (|x| + c) of x)
        keys, scale = order, lambda: c() * c() * (jnp.abs(x()) + c())
    else:
        return None
    if name != "clamp":
        g = partial(lambda g: jnp.broadcast_to(g(), shape), g)
        scale = partial(lambda scale: jnp.broadcast_to(scale(), shape), scale)
    # one event per surface: y > 1 in two wheres, or y < 1 beside it, is one crossing
    key = ("surface" if name in _RELATIONS | _KINKS - {"clamp"} | {"sign"} else name, *keys)
    if key not in seen:
        seen[key] = (seen["entries"], order[:2], shape)
        seen["entries"] += math.prod(shape)
        # (a thunk: only hold_switches reads them)
        levels = partial(_levels, eqn, vals) if name in _STEPS - {"sign"} else None
        found[0].append((g, label, scale, name, levels))
    sides = seen["sides"]
    if sides is None:
        return None
    start, first_order, shape = seen[key]
    side = sides[start : start + math.prod(shape)].reshape(shape)
    if name in _STEPS - {"sign"}:  # the level held (see hold_switches)
        return lambda pointwise: _held_level(name, vals, side, pointwise)
    if name != "clamp" and order[:2] != first_order:
        side = -side  # g = b - a where the surface was first met as a - b
    return lambda pointwise: _held(name, vals, side, pointwise)


def _held(name, vals, side, pointwise):
    """``name``'s output with its switch held on ``side`` (the sign of ``a - b``, ``x``, or for
    ``clamp`` of ``(x - lo, x - hi)``), and ``pointwise`` where the side is 0."""
    concrete = isinstance(side, np.ndarray) and bool(np.all(side != 0))
    pick = (
        (lambda zero, held: held)
        if concrete
        else (lambda zero, held: jnp.where(zero, pointwise, held))
    )
    if name == "clamp":
        lo, x, hi = vals
        held = jnp.where(side[0] < 0, lo, jnp.where(side[1] > 0, hi, x))
        return pick((side[0] == 0) | (side[1] == 0), held.astype(pointwise.dtype))
    held = {
        "gt": lambda: side > 0,
        "ge": lambda: side > 0,
        "lt": lambda: side < 0,
        "le": lambda: side < 0,
        "sign": lambda: side,
        "abs": lambda: side * vals[0],
        "max": lambda: jnp.where(side > 0, vals[0], vals[1]),
        "min": lambda: jnp.where(side < 0, vals[0], vals[1]),
    }[name]()
    return pick(side == 0, jnp.asarray(held).astype(pointwise.dtype))


def _level(eqn, vals, x):
    """The level of the floor-like ``eqn`` at ``x`` in place of its operand: its own output,
    or for ``rem(x, c) = x - c n`` the count ``n``."""
    if eqn.primitive.name != "rem":
        return _bind(eqn, [x, *vals[1:]])
    c = vals[1]
    return jnp.round((x - lax.rem(x, c)) / c)


def _levels(eqn, vals):
    """``(level, below, above, g > 0 above)``: the level at the operand ``x``, at ``x -+ d``
    (``d`` past the near band of :func:`hold_switches`, so across a jump that near, short
    of the next), and whether the surface is positive at ``x + d``."""
    x = vals[0]
    c = jnp.abs(jnp.asarray(vals[1] if eqn.primitive.name == "rem" else 1, jnp.result_type(x)))
    eps = jnp.finfo(jnp.result_type(x)).eps
    d = jnp.minimum(4 * jnp.sqrt(eps) * (jnp.abs(x) + c + 1 / (c * c)), c / 4)
    shift = 0.5 if eqn.primitive.name == "round" else 0.0
    above = _zero_at_multiples(x + d + shift, c) > 0
    return _level(eqn, vals, x), _level(eqn, vals, x - d), _level(eqn, vals, x + d), above


def _held_level(name, vals, level, pointwise):
    """A floor-like switch with its level held: ``floor``'s integer, ``x - c n`` for ``rem``."""
    if name == "rem":
        return (vals[0] - vals[1] * level.astype(jnp.result_type(vals[0]))).astype(pointwise.dtype)
    return jnp.broadcast_to(level, jnp.shape(pointwise)).astype(pointwise.dtype)


def _zero_at_multiples(x, c):
    """``r (|c| - |r|) (2 |c| - |r|)`` with ``r = rem(x, 2 c)``: continuous in ``x``, changing
    sign at each multiple of ``c``, where ``rem(x, c)`` (so ``floor``, ``round`` of ``x + 1/2``
    with ``c = 1``) jumps. ``rem`` is exact in floating point, so it is exactly zero at the same
    ``x`` where they jump, and the event lands on their jump to the ulp (``sin(pi x / c)``,
    ``1e-16`` at ``x = c``, put it an ulp past the jump, and a step could end between them)."""
    c = jnp.abs(jnp.asarray(c, jnp.result_type(x)))
    r = lax.rem(x, 2 * c)
    return r * (c - jnp.abs(r)) * (2 * c - jnp.abs(r))


def _key(var, value) -> tuple:
    """An operand's identity: a literal's number, else the value itself."""
    if _is_literal(var) and jnp.ndim(var.val) == 0:
        return ("literal", float(var.val))
    return ("value", id(value))


def _has_switch(jaxpr, kinks: bool) -> bool:
    """Whether ``jaxpr`` (or a call in it) holds a switch: a call without one is bound whole,
    its own derivative rule (``relu``'s, ``softplus``'s) kept."""
    wanted = _RELATIONS | _STEPS | _UNCOVERED | (_KINKS if kinks else frozenset())
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "convert_element_type":
            if any(map(_inexact, eqn.invars)) and not _inexact(eqn.outvars[0]):
                return True
        elif name in wanted:
            return True
        if eqn.primitive.name in _CALLS:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if _has_switch(getattr(inner, "jaxpr", inner), kinks):
                return True
    return False
