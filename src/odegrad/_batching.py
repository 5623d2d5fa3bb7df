"""Loops and budgets that stay efficient under ``jax.vmap``.

``jax.vmap`` of a ``lax.while_loop`` whose predicate is batched runs until the last member is
done and, on every iteration, selects between the old and the new carry of every member — every
buffer in the carry included — and a ``lax.cond`` with a batched predicate runs both branches.
The loops here keep their control flow unbatched instead: they run while :func:`any_member`
runs, to :func:`max_member` steps, and gate each member's own updates with
:func:`member_where`, which costs nothing outside vmap. Each is a ``custom_vmap`` whose batching
rule reduces over the batch axis.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def _reduced_over_batch(reduce, doc: str):
    """The identity, whose batching rule applies ``reduce`` over the batch axis (recursively,
    so nested vmaps reduce over every batch axis) and returns an unbatched value."""

    @jax.custom_batching.custom_vmap
    def identity(x):
        return x

    @identity.def_vmap
    def _vmap(axis_size, in_batched, x):
        del axis_size
        return identity(reduce(x, axis=0) if in_batched[0] else x), False

    identity.__doc__ = doc
    return identity


any_member = _reduced_over_batch(
    jnp.any,
    "``pred`` reduced with ``any`` over every batch axis that ``jax.vmap`` added: a loop or a "
    "``lax.cond`` on it stays unbatched.",
)
max_member = _reduced_over_batch(
    jnp.max, "``n`` reduced with ``max`` over every batch axis that ``jax.vmap`` added."
)


@jax.custom_jvp
def member_where(pred, new, old):
    """``new`` where ``pred``, else ``old``, for loops whose control is unbatched and where
    ``pred`` holds for every member unless ``jax.vmap`` batches it: then this is ``new`` at no
    cost, and a batched ``pred`` selects per member (``jnp.where``).

    Forward-mode derivatives select the tangents with ``jnp.where`` (a ``custom_vmap`` has no
    JVP of its own that JAX can take: the Hessian ``jax.jacfwd(jax.grad(...))`` of a reverse
    pass built on this recursed without end)."""
    return _member_where(pred, new, old)


@member_where.defjvp
def _member_where_jvp(primals, tangents):
    pred, new, old = primals
    _, d_new, d_old = tangents
    d_out = jax.tree.map(lambda a, b: jnp.where(pred, a, b), d_new, d_old)
    return member_where(pred, new, old), d_out


@jax.custom_batching.custom_vmap
def _member_where(pred, new, old):
    del pred, old
    return new


@_member_where.def_vmap
def _member_where_vmap(axis_size, in_batched, pred, new, old):
    pred_b, new_b, old_b = in_batched
    if not pred_b:
        return _member_where(pred, new, old), new_b

    def pick(x, xb, y, yb):
        x = x if xb else jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))
        y = y if yb else jnp.broadcast_to(y, (axis_size, *jnp.shape(y)))
        p = jnp.reshape(pred, (axis_size,) + (1,) * (jnp.ndim(x) - 1))
        return jnp.where(p, x, y)

    out = jax.tree.map(pick, new, new_b, old, old_b)
    return out, jax.tree.map(lambda _: True, new)


def member_cond(pred, true_fn, false_fn, *operands, differentiable: bool = True):
    """``lax.cond(pred, true_fn, false_fn, *operands)`` for a ``pred`` that ``jax.vmap`` may
    batch: ``true_fn`` runs when any member needs it and each member keeps its own branch's
    result (a ``jnp.where`` on ``pred``); outside vmap a conditional whose taken branch ends
    in a select on a scalar.

    JAX turns a conditional on a batched predicate into a select between both branches after
    broadcasting every operand, the branches' closed-over arrays included, to the batch: a
    backward pass whose branch closes over the forward pass's stored dense output (neural ODE,
    vmap 256) spent more time broadcasting those buffers than integrating. Here they stay
    unbatched; members whose ``pred`` is false also run ``true_fn``, so it must be safe (say,
    integrating an empty interval) where its result is discarded. ``differentiable=False``
    (for values no derivative flows through, such as a kept Jacobian) selects with
    :func:`member_where`, which costs nothing outside vmap.

    Example:
        >>> c = member_cond(hi > lo, lambda c: integrate(c, hi, lo), lambda c: c, c)
    """

    def both(*ops):
        new, old = true_fn(*ops), false_fn(*ops)
        if not differentiable:
            return member_where(pred, new, old)
        # a custom_vmap (member_where) takes no JVP under jax.jacfwd(jax.grad(...)) nor a
        # linearisation inside a reverse step: jnp.where does, for a select on the outputs
        return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)

    return jax.lax.cond(any_member(pred), both, false_fn, *operands)


def run_if(pred, fn, operand):
    """``fn(operand)`` where ``pred`` (an unbatched scalar, see :func:`any_member`), else
    ``operand`` itself, as a loop of zero or one trip rather than a ``lax.cond``: a conditional
    copies every array its not-taken branch passes through (XLA gives its result buffers of
    their own), while a loop that does not run leaves its carry where it is. On a 160^3 field
    that is a 33 MB copy saved each time ``fn`` is skipped. Not reverse-differentiable: for
    values no derivative flows through (a spectral-radius estimate).

    Example:
        >>> rho, v = run_if(any_member(due), lambda c: refresh(*c), (rho, v))
    """
    return jax.lax.fori_loop(0, jnp.asarray(pred).astype(jnp.int32), lambda _, c: fn(c), operand)


@jax.custom_batching.custom_vmap
def _batch_probe(x):
    return x


_PROBED: list[int] = []


@_batch_probe.def_vmap
def _batch_probe_vmap(axis_size, in_batched, x):
    if in_batched[0]:
        _PROBED.append(int(axis_size))
    return _batch_probe(x), in_batched[0]


def vmap_batch_size(tree: PyTree) -> int:
    """How many members ``jax.vmap`` batches ``tree``'s leaves into (the product over nested
    vmaps; 1 outside vmap), found at trace time by a probe whose batching rule records the
    axis size (a vmap applied to an already-jitted function batches after tracing: 1).

    Budgets decided per member (checkpoint memory, XLA:CPU's small-buffer rule) must account
    for it: the batched program holds one copy per member.
    """
    traced = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.core.Tracer)]
    if not traced:
        return 1
    # one scalar batched along every vmap that batches any leaf (dead code once traced)
    probe = sum(jnp.real(jnp.ravel(x)[:1].sum()).astype(jnp.float32) for x in traced)
    _PROBED.clear()
    try:
        _batch_probe(jax.lax.stop_gradient(probe))
        return int(np.prod(_PROBED, dtype=np.int64)) if _PROBED else 1
    finally:
        _PROBED.clear()
