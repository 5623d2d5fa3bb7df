"""The spectral-radius estimate of the stabilised methods (:mod:`.stabilized`): a warm-started
power iteration on Jacobian-vector products ``jax.jvp(lambda y: f(t, y, args), (y,), (v,))``,
two passes over the state per iteration, from a cheap hashed start vector."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._batching import any_member
from .._tree import tree_where
from ._recurrence import _sg


def _norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(jnp.abs(x))) for x in jax.tree.leaves(tree)))


def _start_vector(y):
    """A fixed pseudo-random vector shaped like ``y`` (all modes present), of norm ~1, its
    entries uniform in ``[-1/2, 1/2) * sqrt(12 / size)``: MurmurHash3's 32-bit finaliser
    (``fmix32``, Austin Appleby) of each entry's index, a few integer operations per entry,
    where ``jax.random.normal`` (Threefry and an inverse error function) cost as much as 15
    stencil passes on a 160^3 field."""

    leaves, treedef = jax.tree.flatten(y)
    # uniform entries have mean square 1/12: this scale gives the vector norm ~1, so that the
    # first norm of the power iteration cannot overflow where rho**2 * size would
    scale = np.float32(np.sqrt(12.0 / max(sum(int(np.prod(jnp.shape(x))) for x in leaves), 1)))

    def leaf(i, x):
        h = lax.iota(jnp.uint32, int(np.prod(jnp.shape(x)))) + np.uint32(
            (0x9E3779B9 * (i + 1)) % 2**32
        )
        h = (h ^ (h >> 16)) * np.uint32(0x85EBCA6B)
        h = (h ^ (h >> 13)) * np.uint32(0xC2B2AE35)
        h = h ^ (h >> 16)
        dtype = jnp.result_type(x)
        u = ((h >> 8).astype(jnp.float32) * np.float32(2.0**-24) - np.float32(0.5)) * scale
        return u.astype(dtype).reshape(jnp.shape(x))

    return jax.tree.unflatten(treedef, [leaf(i, x) for i, x in enumerate(leaves)])


def power_iteration(f, t, y, args, v, iters: int):
    """``iters`` steps of the power iteration on ``J = df/dy (t, y)``, warm-started from ``v``.

    Returns ``(rho, w)``, both without derivatives: ``rho = |J v_k| / |v_k|`` for the last
    iterate ``v_k`` estimates the spectral radius, and ``w`` (a multiple of ``J v_k``) is the
    next warm start. Each iteration is one Jacobian-vector product and one norm, two passes
    over the state: the iterates are rescaled every second product, on its output (see
    ``pair``), rather than in a pass of their own.
    A ``v`` of zero or non-finite norm (a breakdown in an earlier refresh) restarts from
    :func:`_start_vector`; a non-finite product keeps the last finite estimate.
    """
    t, y, args, v = _sg(t), _sg(y), _sg(args), _sg(v)
    dtype = jnp.result_type(*jax.tree.leaves(y))

    def usable(nrm):
        return jnp.isfinite(nrm) & (nrm > 0)

    nv = _norm(v)
    v, nv = lax.cond(
        any_member(~usable(nv)),
        lambda: _restart(v, nv, usable(nv)),
        lambda: (v, nv),
    )

    def product(v):
        return jax.jvp(lambda y_: f(t, y_, args), (y,), (v,))[1]

    def scaled(w, nw):
        inv = jnp.where(usable(nw), 1.0 / nw, 0.0)
        return jax.tree.map(lambda x: x * inv.astype(x.dtype), w)

    def best(rho, *candidates):
        for nrm in candidates:
            rho = jnp.where(usable(nrm), nrm.astype(dtype), rho)
        return rho

    def pair(_, carry):
        # The first product stays unscaled (|w1| ~ rho |v|): a scaling between two stencils
        # is fused into the second one's reads, which makes XLA:CPU's kernel ~2x slower. The
        # second is scaled on its output (which the loop carries in memory) by |v| / |w1|^2,
        # to norm ~1, so the next |w1| ~ rho cannot overflow.
        v, nv, rho = carry
        w1 = product(v)
        n1 = _norm(w1)
        growth = n1 / nv  # |J v| / |v|
        w2 = scaled(product(w1), n1 / jnp.where(usable(nv), nv, jnp.nan) * n1)
        n2 = _norm(w2)
        return w2, n2, best(rho, growth, n2 * growth)

    carry = lax.fori_loop(0, iters // 2, pair, (v, nv, jnp.zeros((), dtype)))
    if iters % 2:
        v, nv, rho = carry
        w = scaled(product(v), nv)  # |w| ~ rho
        nw = _norm(w)
        carry = (w, nw, best(rho, nw))
    w, _, rho = carry
    return lax.stop_gradient(rho), _sg(w)


def _restart(v, nv, ok):
    start = _start_vector(v)
    return tree_where(ok, v, start), jnp.where(ok, nv, _norm(start))
