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
``floor``, ``ceil`` and a float-to-integer conversion give ``sin(pi x)`` (zero at the integers
where they jump), ``round`` gives ``cos(pi x)``, ``rem(x, c)`` gives ``sin(pi x / c)``. With
``kinks=True`` the places where only ``f``'s slope jumps count too (``abs``, ``max``, ``min``,
``clamp``): an event there makes the step end on the kink, so even ``Discrete`` is exact there.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._events import Event
from ._kinks import _CALLS, _inexact, _is_literal, _location
from ._tree import split_arrays

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
    module docstring). Each surface entry is one :class:`~odegrad.Event` (``terminal=False``,
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
        found, skipped = _walk_f(f, t, y, a, kinks)
        labels.extend(label for _, label in found)
        uncovered.extend(skipped)
        return [g for g, _ in found]

    arrays, rebuild, _ = split_arrays(args)  # strings, functions: not for eval_shape
    shapes = jax.eval_shape(lambda t, y, a: describe(t, y, rebuild(a)), t0, y0, arrays)
    sizes = [math.prod(s.shape) for s in shapes]
    for label in uncovered:
        warnings.warn(
            f"og.switching_events: {label} switches with the state on ties between entries, "
            "which no event describes; its crossings get no event.",
            stacklevel=2,
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


class _SurfaceEntry:
    """``cond(t, y, args)``: entry ``index`` of ``f``'s surfaces, all flattened in order."""

    def __init__(self, f, kinks: bool, index: int, total: int, label: str):
        self.f, self.kinks, self.index, self.total, self.label = f, kinks, index, total, label

    def __call__(self, t, y, args):
        found, _ = _walk_f(self.f, t, y, args, self.kinks)
        flat = [jnp.ravel(g) for g, _ in found]
        if sum(v.size for v in flat) != self.total:  # f traced to a different program
            raise RuntimeError(
                f"og.switching_events: {self.label}: f has {sum(v.size for v in flat)} surface "
                f"entries at these inputs' shapes, not the {self.total} it had when the events "
                "were built; build them with the solve's own t0, y0 and args."
            )
        dtype = jnp.result_type(*flat, t)
        return jnp.concatenate([v.astype(dtype) for v in flat])[self.index]

    def __repr__(self) -> str:
        return f"switching surface {self.label}"


def _walk_f(f, t, y, args, kinks: bool) -> tuple[list[tuple[Any, str]], list[str]]:
    """``([(g, label), ...], uncovered)``: the surface values ``g`` of ``f`` at ``(t, y, args)``,
    one array per switch, and the labels of state-dependent switches no surface describes."""
    arrays, rebuild, _ = split_arrays(args)
    closed = jax.make_jaxpr(lambda t_, y_, a_: f(t_, y_, rebuild(a_)))(t, y, arrays)
    leaves = [t, *jax.tree.leaves(y), *arrays]
    deps = [True] * (1 + len(jax.tree.leaves(y))) + [False] * len(arrays)
    found: list[tuple[Any, str]] = []
    uncovered: list[str] = []
    _walk(closed.jaxpr, closed.consts, leaves, deps, kinks, (found, uncovered), {}, ("", ""))
    return found, uncovered


def _walk(jaxpr, consts, values, deps, kinks, found, seen, context):
    """Evaluate ``jaxpr``, appending ``(g, label)`` to ``found[0]`` for each switch on a value
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
            if dep:
                _record(eqn, ins, kinks, found, seen, here)
            outs = _bind(eqn, vals)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = (x, dep)
    return [read(v)[0] for v in jaxpr.outvars]


def _bind(eqn, vals):
    """``eqn``'s primitive applied to ``vals``, as ``jax.core.eval_jaxpr`` does it."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)  # jax < 0.7
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    if manager is None:
        return eqn.primitive.bind(*subfuns, *vals, **params)
    with manager:
        return eqn.primitive.bind(*subfuns, *vals, **params)


def _record(eqn, ins, kinks, found, seen, here) -> None:
    name = eqn.primitive.name
    vals = [x for x, _ in ins]
    # a kink inside a library function goes by its name (relu, clip), a comparison by its own
    public = here[0] and not here[0].startswith("_") and here[0] not in _CALLS
    op = here[0] if name in _KINKS and public else name
    label = f"{op} at {here[1]}" if here[1] else op
    if name in _UNCOVERED:
        found[1].append(label)
        return
    if not any(map(_inexact, eqn.invars)):
        return
    keys = [_key(v, x) for v, x in zip(eqn.invars, vals, strict=True)]
    if name in _RELATIONS or (kinks and name in ("max", "min")):
        keys, g = sorted(keys), vals[0] - vals[1]
    elif name == "sign" or (kinks and name == "abs"):
        keys, g = sorted([keys[0], ("literal", 0.0)]), vals[0]
    elif kinks and name == "clamp":  # clamp(lo, x, hi)
        g = jnp.stack([vals[1] - vals[0], vals[1] - vals[2]])
    elif name in _STEPS and name != "sign":
        if name == "convert_element_type" and _inexact(eqn.outvars[0]):
            return  # float to float: no jump
        x = vals[0] / vals[1] if name == "rem" else vals[0]
        g = jnp.cos(jnp.pi * x) if name == "round" else jnp.sin(jnp.pi * x)
    else:
        return
    # one event per surface: y > 1 in two wheres, or y < 1 beside it, is one crossing
    key = ("surface" if name in _RELATIONS | _KINKS - {"clamp"} | {"sign"} else name, *keys)
    if key in seen:
        return
    seen[key] = True
    if name != "clamp":
        g = jnp.broadcast_to(g, jnp.broadcast_shapes(*[jnp.shape(x) for x in vals]))
    found[0].append((g, label))


def _key(var, value) -> tuple:
    """An operand's identity: a literal's number, else the value itself."""
    if _is_literal(var) and jnp.ndim(var.val) == 0:
        return ("literal", float(var.val))
    return ("value", id(value))


def _has_switch(jaxpr, kinks: bool) -> bool:
    wanted = _RELATIONS | _STEPS | _UNCOVERED | (_KINKS if kinks else frozenset())
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in wanted:
            return True
        if eqn.primitive.name in _CALLS:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if _has_switch(getattr(inner, "jaxpr", inner), kinks):
                return True
    return False
