"""Kinks: where a right-hand side's Jacobian jumps with the state or the parameters.

A right-hand side built from ``abs``, ``max``/``min``, ``relu``, ``where`` on a state-dependent
condition, ``clip``, ``floor``, ``sign``, ``argmax``, ``sort``, ... is continuous but its Jacobian
``df/dy`` jumps where a trajectory crosses the switching surface. The state error of a Runge-Kutta
step across the surface is ``O(h^2)`` while the error of the sensitivities ``S' = (df/dy) S +
df/dp`` is ``O(h)``: a step-size controller that sees only the state lets the sensitivities drift
by ``O(sqrt(tol))``, and a discrete adjoint, which differentiates exactly those steps, inherits it.

:func:`find_kinks` finds them at trace time, from the jaxpr of ``jax.jvp(f)``: a kink is a
tangent output that depends on a *discontinuous* function (a comparison, an integer conversion,
``sign``, ``floor``, ``round``, ...) of the state or the differentiable parameters. Looking at the
JVP rather than at ``f`` itself is what makes ``jax.nn.softplus`` smooth (its implementation calls
``max``, but its custom JVP is smooth) and ``jax.nn.relu`` a kink (its JVP selects on ``x > 0``).
Equality tests (``x == c``, ``isnan``, ``isfinite``) are guards, not kinks: they change value on a
set a trajectory crosses in no time. A ``while`` loop's iteration count (a Newton solve inside
``f``) is not counted either: it moves the result by the loop's own tolerance, not by a jump.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

__all__ = ["Kink", "find_kinks", "reads_time"]

#: float-valued primitives that are discontinuous in their (first) operand
_JUMPS = frozenset({"sign", "floor", "ceil", "round", "rem", "nextafter"})
#: continuous but piecewise: ``x == max(x, c)`` holds on a half-space, not on a surface
_PIECEWISE = frozenset(
    {"abs", "max", "min", "clamp", "select_n", "reduce_max", "reduce_min", "sort", "cummax",
     "cummin", "reduce_precision"}
)  # fmt: skip
#: user-level names a discontinuity is reported under, when the same source line holds them
_USER_OPS = frozenset(
    {"abs", "max", "min", "clamp", "sign", "floor", "ceil", "round", "rem", "sort", "argmax",
     "argmin", "cond", "select_n", "gt", "ge", "lt", "le", "reduce_max", "reduce_min"}
)  # fmt: skip
_CALLS = ("custom_jvp_call", "custom_vjp_call", "jit", "pjit", "closed_call", "remat2")


@dataclasses.dataclass(frozen=True)
class Kink:
    """A place in ``f`` whose derivative jumps: the operation and the user's source line."""

    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.op} at {self.where}" if self.where else self.op


@dataclasses.dataclass(frozen=True)
class _Taint:
    dep: bool = False  # depends on the state or differentiable parameters
    piecewise: bool = False  # through max/min/abs/...: equality tests on it are not guards
    jumps: frozenset = frozenset()  # the kinks it depends on discontinuously

    def __or__(self, other: _Taint) -> _Taint:
        return _Taint(
            self.dep or other.dep, self.piecewise or other.piecewise, self.jumps | other.jumps
        )


_CLEAN = _Taint()


def find_kinks(f: Callable, t, y, args) -> tuple[Kink, ...]:
    """The kinks of ``f(t, y, args)`` in ``y`` and ``args`` (its inexact array leaves).

    Traces ``jax.jvp`` of ``f`` once (nothing is compiled or run). The derivative of a
    ``jax.custom_vjp`` function inside ``f`` is hidden from forward mode, so its body is read
    instead, where every ``abs``/``max``/``min``/``clamp``/``select`` counts as a kink.

    Example:
        >>> find_kinks(lambda t, y, k: -k * jnp.abs(y), 0.0, jnp.ones(3), 2.0)
        (Kink(op='abs', where='...'),)
    """
    specs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), (t, y, args)
    )
    n_y, n_a = len(jax.tree.leaves(specs[1])), len(jax.tree.leaves(specs[2]))
    inputs = [_CLEAN] + [_Taint(dep=True)] * (n_y + n_a)

    def tangent_map(t_, y_, a_, ty, ta):
        return jax.jvp(lambda yy, aa: f(t_, yy, aa), (y_, a_), (ty, ta))

    closed = jax.make_jaxpr(tangent_map)(*specs, specs[1], specs[2])
    taint_in = inputs + [_CLEAN] * (len(closed.jaxpr.invars) - len(inputs))
    outs = _propagate(closed.jaxpr, taint_in, False, ("", ""))
    found = frozenset().union(*(o.jumps for o in outs[len(outs) // 2 :]))  # tangent outputs
    if _has_primitive(closed.jaxpr, "custom_lin"):
        closed = jax.make_jaxpr(f)(*specs)
        outs = _propagate(closed.jaxpr, inputs, False, ("", ""))
        found = found.union(*(o.jumps for o in outs))
    return tuple(sorted(found, key=lambda k: (k.where, k.op)))


def reads_time(f: Callable, t, y, args) -> bool:
    """Whether ``f(t, y, args)``'s value depends on ``t`` by data flow through its jaxpr (an
    operation with a ``t``-dependent operand counts as ``t``-dependent in all its results, so
    ``0 * t`` counts). Nothing runs."""
    jaxpr = jax.make_jaxpr(lambda t_: f(t_, y, args))(t).jaxpr
    return any(reached_outputs(jaxpr, jaxpr.invars))


def reached_outputs(jaxpr, seeds) -> list[bool]:
    """Which of ``jaxpr``'s outputs depend on the variables ``seeds`` by data flow (an
    operation with a reached operand reaches all its results, nested calls included)."""
    reached = set(seeds)
    for eqn in jaxpr.eqns:
        if any(not _is_literal(v) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return [not _is_literal(v) and v in reached for v in jaxpr.outvars]


def describe_kinks(kinks: Sequence[Kink], limit: int = 3) -> str:
    """``abs at model.py:12 (f), relu at model.py:14 (f)`` (and how many more)."""
    shown = ", ".join(str(k) for k in kinks[:limit])
    more = len(kinks) - limit
    return shown + (f" and {more} more" if more > 0 else "")


def jacobian_jumps(kinks: Sequence[Kink], events: Any = None) -> str:
    """``f's Jacobian jumps (abs at model.py:12 (f))``, and without ``events`` what to do where
    ``f``'s value jumps too: only an event on the surface locates the crossing, whose term
    (the saltation matrix) no pointwise derivative of ``f`` holds."""
    hint = ""
    if events is None:
        hint = (
            "; where f's value jumps there too, only an og.Event on that surface gives the "
            "gradient the crossing's term (og.switching_events(f, t0, y0, args) builds them)"
        )
    return f"f's Jacobian jumps ({describe_kinks(kinks)}{hint})"


def _propagate(jaxpr, taint_in: Sequence[_Taint], opaque: bool, context) -> list[_Taint]:
    """Taints of ``jaxpr``'s outputs. ``opaque``: inside a custom VJP, whose derivative forward
    mode does not show, so non-smooth primal operations count as kinks themselves.
    ``context``: the (name, source line) of the user-level call this jaxpr belongs to."""
    env: dict[Any, _Taint] = {v: _CLEAN for v in jaxpr.constvars}
    env.update(zip(jaxpr.invars, taint_in, strict=True))
    names = _user_ops(jaxpr)
    for eqn in jaxpr.eqns:
        ins = [_CLEAN if _is_literal(v) else env.get(v, _CLEAN) for v in eqn.invars]
        outs = _eqn_taint(eqn, ins, opaque, _here(eqn, names, context))
        env.update(zip(eqn.outvars, outs, strict=True))
    return [_CLEAN if _is_literal(v) else env.get(v, _CLEAN) for v in jaxpr.outvars]


def _here(eqn, names: dict[str, str], context) -> tuple[str, str]:
    """(name, source line) a kink at ``eqn`` is reported under: the user-level operation on
    that line, else the enclosing user-level call (``relu``, ``elu``) for library internals."""
    where = _location(eqn)
    if not where:
        return context
    return names.get(where, eqn.primitive.name), where


def _eqn_taint(eqn, ins: list[_Taint], opaque: bool, here) -> list[_Taint]:
    name, params = eqn.primitive.name, eqn.params
    n_out = len(eqn.outvars)
    union = _CLEAN
    for t in ins:
        union = union | t

    if name in _CALLS:
        inner = params.get("jaxpr", params.get("call_jaxpr"))
        jaxpr = getattr(inner, "jaxpr", inner)
        if len(jaxpr.invars) == len(ins) and len(jaxpr.outvars) == n_out:
            context = (_call_name(eqn, inner), here[1]) if here[1] else here
            return _propagate(jaxpr, ins, opaque or name == "custom_vjp_call", context)
        return [union] * n_out
    if name == "cond":
        index, ops = ins[0], ins[1:]
        outs = [_CLEAN] * n_out
        for branch in params["branches"]:
            b = _propagate(branch.jaxpr, ops, opaque, here)
            outs = [o | x for o, x in zip(outs, b, strict=True)]
        if index.dep:  # a state-dependent branch: every output switches with it
            index = index | _Taint(True, True, frozenset({Kink("cond", here[1])}))
        return [o | index for o in outs]
    if name in ("while", "scan"):
        return _loop_taint(eqn, ins, opaque, here)
    if any(True for _ in jex_core.jaxprs_in_params(params)):  # unknown higher-order primitive
        return [union] * n_out
    if not union.dep:
        return [union] * n_out

    if name == "is_finite":
        return [_CLEAN] * n_out
    if name in ("eq", "ne"):
        # equal on a surface a trajectory crosses in no time (x == 0, isnan), unless an operand
        # is piecewise: x == max(x, c) holds on a whole half-space (max's own JVP tests that)
        same = eqn.invars[0] is eqn.invars[1]
        jumps = union.piecewise and not same and not any(map(_non_finite_literal, eqn.invars))
        if not jumps:
            return [_CLEAN] * n_out
    else:
        # a comparison, an integer conversion, argmax, a sort's permutation (a state-dependent
        # float turned into a discrete value), a float jump (sign, floor), or inside a custom
        # VJP a non-smooth primal operation
        jumps = (
            name in _JUMPS
            or (opaque and name in _PIECEWISE)
            or (any(map(_inexact, eqn.invars)) and not all(map(_inexact, eqn.outvars)))
        )
    piecewise = union.piecewise or jumps or name in _PIECEWISE
    kinks = union.jumps | {Kink(here[0] or name, here[1])} if jumps else union.jumps
    return [_Taint(True, piecewise, kinks)] * n_out


def _loop_taint(eqn, ins: list[_Taint], opaque: bool, here) -> list[_Taint]:
    """A ``while``/``scan``: iterate the body's taints to a fixed point (they only grow). A
    ``while`` loop's state-dependent trip count is not a kink: it moves the result by the
    loop's own tolerance."""
    params = eqn.params
    if eqn.primitive.name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        body, consts, carry, xs = params["body_jaxpr"], ins[nc : nc + nb], ins[nc + nb :], []
    else:
        nc, ncarry = params["num_consts"], params["num_carry"]
        body, consts = params["jaxpr"], ins[:nc]
        carry, xs = ins[nc : nc + ncarry], ins[nc + ncarry :]
    ys: list[_Taint] = []
    for _ in range(len(carry) + 2):
        outs = _propagate(body.jaxpr, consts + carry + xs, opaque, here)
        new = [c | o for c, o in zip(carry, outs[: len(carry)], strict=True)]
        ys = outs[len(carry) :]
        if new == carry:
            break
        carry = new
    return carry + ys


def _call_name(eqn, inner) -> str:
    name = eqn.params.get("name")
    if name is None:
        info = getattr(getattr(inner, "jaxpr", inner), "debug_info", None)
        name = getattr(info, "func_name", None)
    return str(name or eqn.primitive.name)


def _has_primitive(jaxpr, name: str) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            return True
        for inner in jex_core.jaxprs_in_params(eqn.params):
            if _has_primitive(getattr(inner, "jaxpr", inner), name):
                return True
    return False


def _inexact(v) -> bool:
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _non_finite_literal(v) -> bool:
    if not _is_literal(v):
        return False
    try:  # numpy: under an outer jit trace, jnp would stage this out as a tracer
        return not bool(np.all(np.isfinite(np.asarray(v.val))))
    except TypeError:
        return False


def _is_literal(v) -> bool:
    return isinstance(v, jex_core.Literal)


def _location(eqn) -> str:
    try:
        from jax._src import source_info_util

        where = source_info_util.summarize(eqn.source_info)
    except Exception:  # private API: the location is a courtesy
        return ""
    if not where:
        return ""
    # "/path/to/model.py:12:8 (f)" -> "model.py:12 (f)"
    path, _, rest = where.partition(":")
    line, _, func = rest.partition(" ")
    return f"{os.path.basename(path)}:{line.split(':')[0]}" + (f" {func}" if func else "")


def _user_ops(jaxpr) -> dict[str, str]:
    """Source line -> the first user-level operation written there (``abs``, ``relu``, ...)."""
    found: dict[str, str] = {}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _CALLS:
            name = _call_name(eqn, eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")))
        elif name not in _USER_OPS:
            continue
        found.setdefault(_location(eqn), name)
    return found
