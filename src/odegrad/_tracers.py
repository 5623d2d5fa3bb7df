"""Which derivative transforms trace a value, read from JAX's tracers.

A value traced by ``jax.jvp``/``jax.jacfwd`` is a ``JVPTracer``; by ``jax.grad``/``jax.vjp`` (and
``jax.linearize``) a ``LinearizeTracer``; each holds the value of the transform outside it
(``.primal``), and ``jax.vmap``'s ``BatchTracer`` holds its own (``.val``). The classes are
private to JAX, so they are matched by name: a renamed class reads as "not differentiated".
"""

from __future__ import annotations

from collections.abc import Iterator

import jax

_DERIVATIVE = ("JVPTracer", "LinearizeTracer")


def _derivative_tracers(tree) -> Iterator:
    """Each leaf's derivative tracers, innermost transform first, through ``vmap``'s."""
    for x in jax.tree.leaves(tree):
        while isinstance(x, jax.core.Tracer):
            if type(x).__name__ in _DERIVATIVE:
                yield x
                x = x.primal
            else:
                x = getattr(x, "val", None)


def differentiated(tree) -> bool:
    """Whether ``jax.grad`` or ``jax.jvp`` reaches a leaf of ``tree`` (not from outside a
    ``jax.jit`` traced first, whose tracers hide it)."""
    return any(True for _ in _derivative_tracers(tree))


def forward_mode(tree) -> bool:
    """Whether the innermost derivative tracing ``tree`` is forward mode (``jax.jvp``): a JVP
    tracer met before any linearize one (reverse mode, and ``jax.linearize``)."""
    for x in jax.tree.leaves(tree):
        first = next(_derivative_tracers(x), None)
        if first is not None and type(first).__name__ == "JVPTracer":
            return True
    return False


def derivative_levels(tree) -> int:
    """How many nested derivative transforms trace the leaves of ``tree``: 2 or more under a
    second derivative (``jax.hessian``)."""
    return len({id(x._trace) for x in _derivative_tracers(tree)})
