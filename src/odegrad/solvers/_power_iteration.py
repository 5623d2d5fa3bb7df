"""The spectral-radius estimate of the stabilised methods (:mod:`.stabilized`): a warm-started
power iteration on Jacobian-vector products ``jax.jvp(lambda y: f(t, y, args), (y,), (v,))``,
two passes over the state per iteration, from a cheap hashed start vector."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._batching import any_member, member_where, run_if
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


def power_iteration(f, t, y, args, v, iters: int, rtol: float = 0.0):
    """At most ``iters`` steps of the power iteration on ``J = df/dy (t, y)``, warm-started
    from ``v``, stopped once two successive estimates agree to ``rtol`` (``rtol > 0``).

    Returns ``(rho, w, products)``, the first two without derivatives: ``rho = |J v_k| / |v_k|``
    for the last iterate ``v_k`` estimates the spectral radius, ``w`` (a multiple of ``J v_k``)
    is the next warm start, ``products`` (int32) the Jacobian-vector products made. Each
    iteration is one Jacobian-vector product and one norm, two passes over the state: the
    iterates are rescaled every second product, on its output (see ``pair``), rather than in a
    pass of their own.

    The stopping rule is Sommeijer's ``rkc.f`` (``rkcrho``: ``|sigma - sigmal| <= 0.01 sigma``
    after at least two products, at most 50); OrdinaryDiffEq's ``maxeig!`` uses 5 %. It is
    checked after every second product. From a random start on a diffusion stencil the estimate
    rises to the spectral radius from below, and stops at ~0.94 of it after ~11 products where
    20 reach ~0.97; the solvers' safety factor (1.2) covers either. A breakdown (a product of
    zero or non-finite norm) also stops it: further products cannot improve the estimate.
    Under ``jax.vmap`` the loop runs while any member runs, and a member that stopped keeps its
    values (so its estimate does not depend on the batch).

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

    def live(carry, more):  # members still iterating, with room for ``more`` products
        *_, k, stopped = carry
        return ~stopped & (k + more <= iters)

    def pair(carry):
        # The first product stays unscaled (|w1| ~ rho |v|): a scaling between two stencils
        # is fused into the second one's reads, which makes XLA:CPU's kernel ~2x slower. The
        # second is scaled on its output (which the loop carries in memory) by |v| / |w1|^2,
        # to norm ~1, so the next |w1| ~ rho cannot overflow.
        v, nv, rho, k, _ = carry
        w1 = product(v)
        n1 = _norm(w1)
        growth = n1 / nv  # |J v| / |v|
        w2 = scaled(product(w1), n1 / jnp.where(usable(nv), nv, jnp.nan) * n1)
        n2 = _norm(w2)
        next_growth = n2 * growth  # |J w1| / |w1|
        stop = ~(usable(n1) & usable(n2))
        if rtol > 0:
            stop = stop | (jnp.abs(next_growth - growth) <= rtol * next_growth)
        new = (w2, n2, best(rho, growth, next_growth), k + 2, stop)
        return member_where(live(carry, 2), new, carry)

    carry = (v, nv, jnp.zeros((), dtype), jnp.zeros((), jnp.int32), jnp.zeros((), bool))
    carry = lax.while_loop(lambda c: any_member(live(c, 2)), pair, carry)
    if iters % 2:

        def last(carry):
            v, nv, rho, k, stopped = carry
            w = scaled(product(v), nv)  # |w| ~ rho
            nw = _norm(w)
            return member_where(live(carry, 1), (w, nw, best(rho, nw), k + 1, stopped), carry)

        carry = run_if(any_member(live(carry, 1)), last, carry)
    w, _, rho, products, _ = carry
    return lax.stop_gradient(rho), _sg(w), products


def _restart(v, nv, ok):
    start = _start_vector(v)
    return tree_where(ok, v, start), jnp.where(ok, nv, _norm(start))
