"""Reverse a chain of steps under a memory bound: binomial checkpointing (revolve).

:func:`reverse_steps` runs ``backward(k, x_k, adjoint)`` for ``k = n-1, ..., 0``, where the states
``x_k`` come from ``x_0`` by ``advance``. It keeps at most ``slots`` states and recomputes the
rest. Each time it must split an unreversed range of ``l`` steps while ``s`` slots are free, it
advances by ``max(1, l - beta(s - 1, t))`` steps, where ``t`` is the least integer with
``beta(s, t) = C(s + t, s) >= l``. This is Griewank's binomial rule: it reverses ``n`` steps
with ``s`` slots in at most ``t`` forward sweeps, the minimum possible (A. Griewank and
A. Walther, "Algorithm 799: revolve", ACM TOMS 26, 2000).

``n`` may be a traced integer, so the same schedule serves step counts known only at run time
(adaptive solves record their step sizes and replay them here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.special import gammaln

PyTree = Any


def binomial_advance(length, free):
    """How far to advance before taking a checkpoint (Griewank's rule; see module docstring)."""
    length = jnp.asarray(length)
    lf = length.astype(jnp.float32)
    sf = jnp.asarray(free).astype(jnp.float32)

    def beta(s, t):
        return jnp.exp(gammaln(s + t + 1.0) - gammaln(s + 1.0) - gammaln(t + 1.0))

    # least t with beta(free, t) >= length (log-domain, a few iterations at most)
    t = lax.while_loop(lambda t: beta(sf, t) < lf * (1 - 1e-6), lambda t: t + 1.0, 0.0)
    adv = jnp.round(lf - beta(sf - 1.0, t)).astype(length.dtype)
    adv = jnp.where(free >= length - 1, 1, adv)
    return jnp.clip(adv, 1, jnp.maximum(length - 1, 1))


def reverse_steps(
    advance: Callable[[Any, PyTree], PyTree],
    backward: Callable[[Any, PyTree, PyTree], PyTree],
    n,
    x0: PyTree,
    adjoint: PyTree,
    slots: int,
    stored: tuple[PyTree, Any] | None = None,
) -> PyTree:
    """Run ``backward`` over steps ``n-1 .. 0`` keeping at most ``slots`` states.

    Args:
        advance: ``advance(k, x_k) -> x_{k+1}``.
        backward: ``backward(k, x_k, adjoint) -> adjoint``.
        n: number of steps (int or traced int).
        x0: the state before step 0.
        adjoint: the adjoint after the last step.
        slots: checkpoint slots, including the one holding ``x0`` (>= 1).
        stored: optionally ``(buffer, count)``: states ``x_0 .. x_{count-1}`` already kept by the
            forward pass in a buffer with ``slots`` rows, so no recomputation is needed.

    Returns:
        The adjoint before step 0.
    """
    if stored is None:
        buf = jax.tree.map(lambda x: jnp.zeros((slots, *jnp.shape(x)), jnp.result_type(x)), x0)
        buf = jax.tree.map(lambda b, x: b.at[0].set(x), buf, x0)
        pos = jnp.zeros((slots,), jnp.int32)
        height = jnp.asarray(1, jnp.int32)
    else:
        buf, count = stored
        pos = jnp.arange(slots, dtype=jnp.int32)
        height = jnp.asarray(count, jnp.int32)
    n = jnp.asarray(n, jnp.int32)
    top = jnp.maximum(height - 1, 0)
    carry = {
        "buf": buf,
        "pos": pos,
        "height": height,
        "x": jax.tree.map(lambda b: b[top], buf),
        "cur": pos[top],
        "fine": n,
        "adj": adjoint,
    }

    def advance_to(k_from, k_to, x):
        return lax.fori_loop(k_from, k_to, lambda k, xk: advance(k, xk), x)

    def step_back(c):
        adj = backward(c["cur"], c["x"], c["adj"])
        fine = c["cur"]
        # drop the checkpoint at `fine` (no longer needed), then restore from the top one
        height = jnp.where(c["pos"][c["height"] - 1] >= fine, c["height"] - 1, c["height"])
        height = jnp.maximum(height, 1)
        top = height - 1
        x = jax.tree.map(lambda b: b[top], c["buf"])
        return {**c, "adj": adj, "fine": fine, "height": height, "x": x, "cur": c["pos"][top]}

    def move_forward(c):
        length = c["fine"] - c["cur"]
        free = slots - c["height"]
        target = jnp.where(free > 0, c["cur"] + binomial_advance(length, free), c["fine"] - 1)
        x = advance_to(c["cur"], target, c["x"])
        push = free > 0
        idx = jnp.where(push, c["height"], slots)  # out of range: no write
        buf = jax.tree.map(lambda b, xi: b.at[idx].set(xi, mode="drop"), c["buf"], x)
        pos = c["pos"].at[idx].set(target, mode="drop")
        height = c["height"] + push.astype(jnp.int32)
        return {**c, "buf": buf, "pos": pos, "height": height, "x": x, "cur": target}

    def body(c):
        return lax.cond(c["fine"] - c["cur"] == 1, step_back, move_forward, c)

    carry = lax.while_loop(lambda c: c["fine"] > 0, body, carry)
    return carry["adj"]
