"""Eager ``og.solve`` calls compiled once per configuration instead of on every call.

Called outside any JAX transformation, ``og.solve`` would run its loops op by op: each call
builds new loop bodies, so JAX retraces and recompiles them every time (0.1-2 s per call, where
a compiled solve takes microseconds). diffrax avoids this by wrapping ``diffeqsolve`` in
``eqx.filter_jit``. Here, from a configuration's second eager call on, the call goes through
a ``jax.jit`` kept in a small cache.

What makes a cache hit safe: ``jax.jit`` bakes what the solve's functions close over into the
compiled program, so a user who rebinds a global array that ``f`` reads would get the old
value back. The key therefore holds each user function's jaxpr at this call's shapes (what it
computes, Python-level constants included), and the entry holds the arrays it closes over: a
hit needs the very same ``jax.Array`` objects (immutable) or NumPy constants equal in value.
Anything the key cannot describe (a callable that is not ``f(t, y, args)``-shaped, an object
that is not a dataclass, an active trace, progress bars) takes the uncached path.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core

from ._tree import is_array
from ._tuning import tuning

#: compiled solves kept; the oldest is dropped beyond this
CACHE_SIZE = 32
_cache: OrderedDict[Any, tuple] = OrderedDict()  # key -> (consts, compiled, keep-alives)
_seen: OrderedDict[Any, None] = OrderedDict()  # keys called once (their keep-alives unheld)


class _Uncacheable(Exception):
    """The configuration has something the key cannot describe: solve uncached."""


def _freeze(obj, fns: list, idents: list):
    """A hashable description of a configuration object. Callables are collected in ``fns``
    (keyed by their jaxpr later); arrays by value; dataclasses field by field; odegrad's own
    classes by their attributes."""
    if obj is None or isinstance(obj, bool | int | float | complex | str | bytes | enum.Enum):
        return (type(obj), obj)
    if isinstance(obj, jax_core.Tracer):
        raise _Uncacheable
    if is_array(obj):
        x = np.asarray(obj)
        return ("array", x.shape, x.dtype.str, x.tobytes())
    if isinstance(obj, tuple | list):
        return (type(obj), tuple(_freeze(x, fns, idents) for x in obj))
    if isinstance(obj, dict):
        return (dict, tuple((k, _freeze(v, fns, idents)) for k, v in sorted(obj.items())))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        return (
            type(obj),
            tuple((f.name, _freeze(getattr(obj, f.name), fns, idents)) for f in fields),
        )
    if type(obj).__module__.startswith("odegrad.") and hasattr(obj, "__dict__"):
        # odegrad's own plain classes (the solvers): equal when their attributes are
        return (type(obj), _freeze(dict(vars(obj)), fns, idents))
    if callable(obj):
        fns.append(obj)
        return ("fn", len(fns) - 1)
    raise _Uncacheable


def _static_leaf(x, idents: list):
    """A non-array leaf of ``args`` (an activation function, a string, a number): by value, or
    by identity for callables (what they compute shows in ``f``'s jaxpr, which calls them)."""
    if x is None or isinstance(x, bool | int | float | complex | str | bytes | enum.Enum):
        return (type(x), x)
    if callable(x):
        idents.append(x)
        return ("ident", id(x))
    try:
        hash(x)
    except TypeError:
        raise _Uncacheable from None
    return (type(x), x)


def _fingerprint(fn, t0, y, arrays: list, rebuild: Callable, consts: list) -> str:
    """``fn(t0, y, rebuild(arrays))``'s jaxpr as text; the arrays it closes over go to
    ``consts``. Only the array leaves of args are traced, as in the solve."""
    # a fresh wrapper: make_jaxpr caches traces per function object, consts included, so
    # tracing ``fn`` itself would return the arrays it closed over the first time
    closed = jax.make_jaxpr(lambda t, y, a: fn(t, y, rebuild(a)))(t0, y, arrays)
    for c in closed.consts:
        if isinstance(c, jax_core.Tracer):
            raise _Uncacheable
        consts.append(c)
    return str(closed.jaxpr)


def _same_consts(kept: list, now: list) -> bool:
    if len(kept) != len(now):
        return False
    for a, b in zip(kept, now, strict=True):
        if isinstance(a, np.ndarray):  # a NumPy constant may be mutated in place: by value
            b = np.asarray(b)
            if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b, True):
                return False
        elif a is not b:  # jax.Array: immutable, so the same object is the same value
            return False
    return True


def _kept(c):
    return c if isinstance(c, jax.Array) else np.array(c, copy=True)


def is_eager(*trees) -> bool:
    """No JAX transformation is active and no leaf is traced."""
    if not jax_core.trace_state_clean():
        return False
    return not any(isinstance(x, jax_core.Tracer) for x in jax.tree.leaves(trees))


def cached_solve(body: Callable, f, y0, t_span, args, options: dict):
    """``body(f, y0, t_span, args, **options)`` through a cached ``jax.jit``, or ``None`` when the
    call cannot be keyed safely (the caller then runs ``body`` uncached)."""
    try:
        fns: list = []
        idents: list = []
        config = _freeze(options, fns, idents)
        times = tuple(float(np.asarray(t)) for t in t_span)
        y_leaves, y_def = jax.tree.flatten(y0)
        a_leaves, a_def = jax.tree.flatten(args)
        dynamic = [is_array(x) for x in a_leaves]
        statics = tuple(
            ("array",) if d else _static_leaf(x, idents)
            for x, d in zip(a_leaves, dynamic, strict=True)
        )
        avals = tuple(
            (np.shape(x), jnp.result_type(x).name, getattr(x, "weak_type", False))
            for x in [*y_leaves, *(x for x, d in zip(a_leaves, dynamic, strict=True) if d)]
        )
        arrays = [x for x, d in zip(a_leaves, dynamic, strict=True) if d]

        def rebuild(arrs):
            it = iter(arrs)
            leaves = [next(it) if d else x for x, d in zip(a_leaves, dynamic, strict=True)]
            return jax.tree.unflatten(a_def, leaves)

        consts: list = []
        t0 = np.asarray(times[0], jnp.result_type(*y_leaves)) if y_leaves else times[0]
        users = list(f) if isinstance(f, tuple | list) else [f]
        if len(users) == 2:  # partitioned: du/dt = f_u(t, v, args), dv/dt = f_v(t, u, args)
            jaxprs = [_fingerprint(users[0], t0, y0[1], arrays, rebuild, consts)]
            jaxprs.append(_fingerprint(users[1], t0, y0[0], arrays, rebuild, consts))
        else:
            jaxprs = [_fingerprint(users[0], t0, y0, arrays, rebuild, consts)]
        # SaveAt.fn, event conditions and updates: f-shaped functions
        jaxprs += [_fingerprint(fn, t0, y0, arrays, rebuild, consts) for fn in fns]
        key = (
            config,
            times,
            y_def,
            a_def,
            statics,
            avals,
            tuple(jaxprs),
            tuple(id(u) for u in users),
            jax.config.jax_enable_x64,
            # what the solve reads at trace time besides its inputs: a tuned(...) override
            # or another backend must not be served a program compiled under the other
            tuning(),
            jax.default_backend(),
        )
        hash(key)
    except Exception:  # anything the key cannot describe, or a bad input: the plain path
        return None

    entry = _cache.get(key)
    if entry is not None and _same_consts(entry[0], consts):
        _cache.move_to_end(key)
        return entry[1](y_leaves, arrays)
    if key not in _seen:
        # A configuration's first call runs uncached: compiling the whole solve as one program
        # takes longer than running it eagerly once (Tsit5, van der Pol: 0.73 s against 0.46 s
        # in a warm process), which one-off calls (scripts, tests) would pay for nothing.
        _seen[key] = None
        while len(_seen) > 4 * CACHE_SIZE:
            _seen.popitem(last=False)
        return None

    def run(y_arrays, a_arrays):
        return body(f, jax.tree.unflatten(y_def, y_arrays), t_span, rebuild(a_arrays), **options)

    compiled = jax.jit(run)
    out = compiled(y_leaves, arrays)
    # kept after a successful first call; the entry holds users, consts and static leaves alive
    _cache[key] = ([_kept(c) for c in consts], compiled, users, idents)
    while len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return out
