"""The stage loop of the stabilised methods, differentiable though its length is a run-time value.

:func:`two_step_recurrence` runs ``u_i = stage(u_{i-1}, u_{i-2}, ...)`` for the stages a step
really takes, in a ``lax.fori_loop`` (two stages per trip, every state a loop output; a
conditional where the table has room for one stage), with its
own derivative rules: a ``jax.custom_jvp`` whose tangent is a linear map with a hand-written
transpose. Forward mode runs the tangent recurrence; reverse mode runs the transposed recurrence,
stage ``n`` down to 1: for up to ``Tuning.kept_stages`` stages as straight-line code that reads the
primal's inputs and outputs and recomputes the stages between them, beyond that over stages it
recomputes once into a buffer (checkpointed segments beyond ``Tuning.stage_memory`` bytes).
:mod:`.stabilized` builds RKC, ROCK2 and ROCK4 on it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from .._batching import any_member, member_where
from .._tree import is_inexact_array, tree_bytes
from .._tuning import tuning


def _lc(*pairs):
    """``sum(c * x)`` over ``(c, x)`` pairs, leafwise; scalars cast to each leaf's dtype."""
    coeffs = [c for c, _ in pairs]
    trees = [x for _, x in pairs]

    def leaf(*xs):
        acc = None
        for c, x in zip(coeffs, xs, strict=True):
            term = jnp.asarray(c, dtype=x.dtype) * x
            acc = term if acc is None else acc + term
        return acc

    return jax.tree.map(leaf, *trees)


def _sg(tree):
    return jax.tree.map(lambda x: lax.stop_gradient(x) if is_inexact_array(x) else x, tree)


def _like(new, old):
    """``new`` with the dtypes of ``old`` (a stage may promote, e.g. float32 time under x64)."""
    return jax.tree.map(lambda a, b: jnp.asarray(a, jnp.result_type(b)), new, old)


def _segment_length(n_max: int, state_bytes: int, budget: int | None = None) -> int:
    """Stages ``B`` per stored segment: every stage while ``n_max`` of them fit in ``budget``,
    else the largest ``B`` with ``B + 2 ceil(n_max / B) + 2`` states in it (at least
    ``~sqrt(2 n_max)``, the fewest states any segment length gives)."""
    if n_max <= 1:
        return 1
    states = (tuning().stage_memory if budget is None else budget) // max(state_bytes, 1)
    if n_max + 4 <= states:
        return n_max
    b_min = max(2, math.isqrt(2 * n_max))
    for b in range(n_max, b_min - 1, -1):
        if b + 2 + 2 * -(-n_max // b) <= states:
            return b
    return b_min


def _capacities(n_max: int, kept: int) -> list[int]:
    """The capacity classes of the recomputing reverse pass, for stage counts above ``kept``:
    ``8 kept``, then everything (each class is one more copy of the stage loops to compile)."""
    return [c for c in (8 * kept,) if c < n_max] + ([n_max] if n_max > kept else [])


def _get(buf, i):
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, i, keepdims=False), buf)


def _put(buf, i, x):
    return jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v, i, 0), buf, x)


def _buffer(x, n):
    # uninitialised where the backend allows it (GPU); zeros on CPU
    return jax.tree.map(lambda v: lax.empty((n, *jnp.shape(v)), jnp.result_type(v)), x)


def _fori_pairs(lo, hi, body, carry):
    """``lax.fori_loop(lo, hi, body, carry)`` two iterations per loop trip. A body that shifts
    its carry (``(p, q) -> (q, new)``) makes XLA copy the shifted arrays in every trip of a
    while loop (an output slot must reuse its input slot's buffer); two iterations per trip
    return two new arrays instead, and the odd one left runs in a loop of at most one trip."""
    pairs = (hi - lo) // 2
    carry = lax.fori_loop(0, pairs, lambda j, c: body(lo + 2 * j + 1, body(lo + 2 * j, c)), carry)
    return lax.fori_loop(lo + 2 * pairs, hi, body, carry)


def _differentiable(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | float | complex) and jnp.issubdtype(
        jnp.result_type(x), jnp.inexact
    )


def two_step_recurrence(stage, prev, cur, theta, consts, xs, n):
    """``u_i = stage(u_{i-1}, u_{i-2}, xs[i-1], theta, consts)`` for ``i = 1..n``, from
    ``u_{-1} = prev``, ``u_0 = cur``; returns ``(u_{n-1}, u_n)``. ``n`` is traced
    (``<= len(xs)``). Its outputs are loop outputs, so XLA materialises them: a stage that
    reads a state through a stencil never recomputes the state's producer once per neighbour.

    The stage count of a stabilised step is a run-time value, so the loop is a ``fori_loop``
    over the stages really taken, and it carries its own derivative rules (a ``jax.custom_jvp``
    whose tangent is a linear map with a custom transpose), in ``prev``, ``cur`` and ``theta``
    (``consts`` and ``xs`` are constants):

    * forward mode (``jax.jvp``, ``og.Forward``): the tangent recurrence, one ``jax.jvp`` of
      ``stage`` per stage, alongside the primal;
    * reverse mode (``jax.vjp``: the Discrete adjoint): the transposed recurrence, stage ``n``
      down to 1, with one ``jax.vjp`` of ``stage`` (so of ``f``) per stage taken. The primal pass
      is the plain loop. A step of up to ``Tuning.kept_stages`` stages is reversed by straight-line
      code (one branch per stage count) that recomputes ``u_1 .. u_{n-2}`` from the primal's
      inputs (``u_{n-1}`` is its output); a step with more is recomputed once by the reverse
      pass into a buffer of its capacity class, and where that would pass
      ``Tuning.stage_memory`` bytes, the state pair every ``B`` stages is kept instead and one
      segment of ``B`` stages at a time is recomputed.

    Second derivatives through it are not supported.
    """
    # tracers ``stage`` closes over (a step's own constants, such as the bounds that keep its
    # stages between two jumps in time, og.Adaptive(jump_ts=)) become explicit constants: a
    # custom_jvp's rules must not capture a tracer of the trace around them
    x0 = jax.tree.map(lambda a: a[0], xs)
    converted, hoisted = jax.closure_convert(stage, cur, prev, x0, theta, consts)
    if hoisted:
        stage = lambda u1, u2, x, th, cs: converted(u1, u2, x, th, cs[0], *cs[1])
        consts = (consts, tuple(hoisted))
    th_leaves, th_def = jax.tree.flatten(theta)
    mask = [_differentiable(v) for v in th_leaves]
    th_diff = [jnp.asarray(v) for v, m in zip(th_leaves, mask, strict=True) if m]
    th_static = [v for v, m in zip(th_leaves, mask, strict=True) if not m]
    # (user constants, theta's non-differentiable leaves, its differentiable leaves that the
    # reverse pass holds constant: None where the leaf is differentiated)
    consts = (_sg(consts), th_static, [None] * len(th_diff))
    xs = _sg(xs)
    n_max = jax.tree.leaves(xs)[0].shape[0]
    kept = max(1, min(n_max, tuning().kept_stages))
    caps = _capacities(n_max, kept)
    state_bytes = tree_bytes(cur)

    def call(u1, u2, x, thd, cs):
        user_consts, static, held = cs
        it_t = iter(thd)
        it_d = iter([next(it_t) if v is None else v for v in held])
        it_s = iter(static)
        leaves = [next(it_d) if m else next(it_s) for m in mask]
        th = jax.tree.unflatten(th_def, leaves)
        return _like(stage(u1, u2, x, th, user_consts), u1)

    def x_at(xs, i):
        return jax.tree.map(lambda a: a[i], xs)

    def plain(prev, cur, thd, cs, xs, n):
        if n_max == 1:
            # One stage at most: a conditional, whose output XLA materialises as a loop's (the
            # fence) without the three copies a one-trip loop of a shifting pair makes; its
            # first output, passed through, is dropped by XLA where the caller does not read it.
            # Under vmap the stage runs when any member takes it, and each member keeps its own
            # pair (member_where: nothing outside vmap)
            return lax.cond(
                any_member(n > 0),
                lambda: member_where(
                    n > 0, (cur, call(cur, prev, x_at(xs, 0), thd, cs)), (prev, cur)
                ),
                # (prev, cur) as a value of its own (n is 0 here): a branch that passes an
                # operand through makes XLA copy the other branch's stage output
                lambda: (prev, jax.tree.map(lambda x: jnp.where(n > 0, 0, x).astype(x.dtype), cur)),
            )

        def body(i, c):
            p, q = c
            return q, call(q, p, x_at(xs, i), thd, cs)

        return _fori_pairs(0, n, body, (prev, cur))

    def run(i0, count, p, q, buf, width, thd, cs, xs):
        """Stages ``i0 + 1 .. i0 + count`` from ``(p, q) = (u_{i0-1}, u_{i0})``; the pair goes to
        ``buf[0:2]`` and stage ``i0 + 1 + r`` to ``buf[2 + min(r, width - 1)]``."""
        buf = _put(_put(buf, 0, p), 1, q)

        def body(r, c):
            p, q, buf = c
            u = call(q, p, x_at(xs, i0 + r), thd, cs)
            return q, u, _put(buf, 2 + jnp.minimum(r, width - 1), u)

        return lax.fori_loop(0, count, body, (p, q, buf))

    def back(i0, count, buf, thd, cs, xs, acc):
        """The transposed stages ``i0 + count .. i0 + 1``, whose inputs are in ``buf``;
        ``acc = (cotangent of u_i, partial cotangent of u_{i-1}, of theta)``."""

        def body(rr, c):
            g, h, ct_th = c
            r = count - 1 - rr
            u1, u2 = _get(buf, r + 1), _get(buf, r)
            return transposed(i0 + r, u1, u2, thd, cs, xs, (g, h, ct_th))

        return lax.fori_loop(0, count, body, acc)

    def transposed(i, u1, u2, thd, cs, xs, acc):
        """Stage ``i + 1`` (inputs ``u1 = u_i``, ``u2 = u_{i-1}``) transposed: ``acc`` holds
        the cotangent of its output, the partial cotangent of ``u1``, and that of ``theta``."""
        g, h, ct_th = acc
        x = x_at(xs, i)
        _, vjp = jax.vjp(lambda a, b, t: call(a, b, x, t, cs), u1, u2, thd)
        c1, c2, cth = vjp(g)
        return _lc((1.0, h), (1.0, c1)), c2, _lc((1.0, ct_th), (1.0, cth))

    # the straight-line branches' stage products, traced once and called from every branch
    # (XLA inlines the calls: the same program, with a fraction of the tracing)
    @jax.jit
    def stage_fwd(u1, u2, x, thd, cs):
        return call(u1, u2, x, thd, cs)

    @jax.jit
    def stage_vjp(u1, u2, x, thd, cs, g):
        return jax.vjp(lambda a, t: call(a, u2, x, t, cs), u1, thd)[1](g)

    @jax.jit
    def stage_vjp_u2(u1, u2, x, thd, cs, g):
        return jax.vjp(lambda b: call(u1, b, x, thd, cs), u2)[1](g)[0]

    def straight_back(m, prev, cur, out, thd, cs, xs, n, acc):
        """The ``m <= kept_stages`` transposed stages as straight-line code: ``u_1 .. u_{m-2}``
        recomputed (each materialised, so that no stencil recomputes its producer), ``u_{m-1}``
        the primal's output, then stages ``m .. 1`` transposed."""
        us = [prev, cur]  # us[j + 1] = u_j
        for i in range(m - 2):
            # computed inside a conditional (taken: n = m here), whose output XLA materialises:
            # straight-line code would let it fuse the stage into every stencil that reads it
            # (optimization_barrier does not prevent that on CPU)
            u1, u2 = us[-1], us[-2]
            us.append(
                lax.cond(
                    n > i,
                    lambda u1=u1, u2=u2, i=i: stage_fwd(u1, u2, x_at(xs, i), thd, cs),
                    lambda u1=u1: _zeros_like(u1),
                )
            )
        if m >= 2:
            us.append(out[0])
        if m == 0:
            return acc
        g, h, ct_th = acc

        def partial_u2(i, g):
            """Stage ``i + 1``'s cotangent of its input ``u_{i-1}`` (a linear term of the next
            stage's cotangent, which XLA fuses there instead of materialising it)."""
            return stage_vjp_u2(us[i + 1], us[i], x_at(xs, i), thd, cs, g)

        def one(i, first, g, gnext, ct_th):
            c1, cth = stage_vjp(us[i + 1], us[i], x_at(xs, i), thd, cs, g)
            part = gnext if first else partial_u2(i + 1, gnext)
            return _lc((1.0, part), (1.0, c1)), _lc((1.0, ct_th), (1.0, cth))

        # stages m .. 1, each in a conditional (taken: n = m here) whose outputs XLA
        # materialises: the cotangent of each stage's input, read through a stencil by the
        # next one, is computed once instead of fused into (recomputed by) its readers
        gnext = h
        for i in range(m - 1, -1, -1):
            g_new, ct_th = lax.cond(
                n > i,
                lambda g, gnext, ct_th, i=i: one(i, i == m - 1, g, gnext, ct_th),
                lambda g, gnext, ct_th: _zeros_like((g, ct_th)),
                g,
                gnext,
                ct_th,
            )
            g, gnext = g_new, g
        return g, partial_u2(0, gnext), ct_th

    def recompute_back(cap, prev, cur, thd, cs, xs, n, acc):
        """Recompute ``n <= cap`` stages and run them backwards, in segments if need be."""
        seg = _segment_length(cap, state_bytes)
        n_seg = -(-cap // seg)
        buf = _buffer(cur, seg + 2)
        marks = _buffer((prev, cur), n_seg) if n_seg > 1 else None

        def fwd(j, c):
            p, q, buf, marks = c
            if marks is not None:
                marks = _put(marks, j, (p, q))
            p, q, buf = run(j * seg, jnp.minimum(seg, n - j * seg), p, q, buf, seg, thd, cs, xs)
            return p, q, buf, marks

        last = -(-n // seg) - 1
        _, _, buf, marks = lax.fori_loop(0, last + 1, fwd, (prev, cur, buf, marks))

        def bwd(k, c):
            j = last - k
            acc, buf = c
            if marks is not None:  # an earlier segment: recompute its stages from its mark
                p, q = _get(marks, j)
                _, _, buf = run(j * seg, jnp.where(k > 0, seg, 0), p, q, buf, seg, thd, cs, xs)
            count = jnp.minimum(seg, n - j * seg)
            return back(j * seg, count, buf, thd, cs, xs, acc), buf

        return lax.fori_loop(0, last + 1, bwd, (acc, buf))[0]

    def tangent(prev, cur, thd, cs, xs, n, dprev, dcur, dthd):
        def body(i, c):
            p, q, dp, dq = c
            x = x_at(xs, i)
            u, du = jax.jvp(lambda a, b, t: call(a, b, x, t, cs), (q, p, thd), (dq, dp, dthd))
            return q, u, dq, du

        _, _, dp, dq = lax.fori_loop(0, n, body, (prev, cur, dprev, dcur))
        return dp, dq

    def reverse(prev, cur, out, thd, cs, xs, n, ct_out):
        acc = (ct_out[1], ct_out[0], _zeros_like(thd))
        branches = [
            lambda acc, m=m: straight_back(m, prev, cur, out, thd, cs, xs, n, acc)
            for m in range(kept + 1)
        ]
        branches += [
            lambda acc, cap=cap: recompute_back(cap, prev, cur, thd, cs, xs, n, acc) for cap in caps
        ]
        which = jnp.where(n <= kept, n, kept + 1 + jnp.searchsorted(jnp.asarray(caps or [0]), n))
        g, h, ct_th = lax.switch(jnp.clip(which, 0, len(branches) - 1), branches, acc)
        return h, g, ct_th  # cotangents of prev (u_{-1}), cur (u_0), theta

    @jax.custom_jvp
    def rec(prev, cur, thd, cs, xs, n):
        return plain(prev, cur, thd, cs, xs, n)

    def rec_jvp(primals, tangents):
        prev, cur, thd, cs, xs, n = primals
        # the primal: the plain loop; its inputs and outputs are what the reverse pass reads
        out = plain(prev, cur, thd, cs, xs, n)
        flat, tdef = jax.tree.flatten(tuple(tangents[:3]), is_leaf=_is_symbolic_zero)
        live = [i for i, t in enumerate(flat) if not _is_symbolic_zero(t)]
        out_leaves, out_def = jax.tree.flatten(out)
        if not live:
            return out, _zeros_like(out)
        # The tangent map (du_{-1}, du_0, dtheta) -> (du_{n-1}, du_n) is linear and has a
        # hand-written transpose (the reverse recurrence). lax.custom_linear_solve is JAX's
        # public way to give a linear map its own transpose; here its "matrix" is the identity,
        # so its "solve" is the map itself. Its right-hand side must be the perturbed tangents
        # only, and it is square: the output pair goes out through the slots of the input pair
        # (same shapes) where those are perturbed, else through a zero slot made from a
        # perturbed tangent (so it is linear too).
        slots, extra = [], []
        for j, o in enumerate(out_leaves):
            if j in live:
                slots.append(live.index(j))
            else:
                slots.append(len(live) + len(extra))
                seed = flat[live[0]]
                extra.append(jnp.zeros_like(o) + (0 * jnp.sum(seed)).astype(jnp.result_type(o)))
        b = [flat[i] for i in live] + extra

        def expand(vals):
            full = [
                jnp.zeros(jnp.shape(p), jnp.result_type(p)) for p in jax.tree.leaves(primals[:3])
            ]
            for i, v in zip(live, vals, strict=False):
                full[i] = v
            return jax.tree.unflatten(tdef, full)

        def solve(_, b):
            dp, dc, dth = expand(b[: len(live)])
            du = jax.tree.leaves(tangent(prev, cur, thd, cs, xs, n, dp, dc, dth))
            x = [jnp.zeros_like(v) for v in b]
            for j, s_ in enumerate(slots):
                x[s_] = du[j]
            return x

        def transpose_solve(_, ct):
            ct_out = jax.tree.unflatten(out_def, [ct[s_] for s_ in slots])
            # theta's leaves without a tangent (a fixed step size) are held constant: each
            # cotangent of a scalar costs a reduction over the field in every stage's transpose
            # (160^3 float64 ROCK2 stage: 22.8 ms with the step size's, 17.8 without)
            n_uv = len(flat) - len(thd)
            th_live = [n_uv + j in live for j in range(len(thd))]
            thl = [v for v, keep in zip(thd, th_live, strict=True) if keep]
            held = [None if keep else v for v, keep in zip(thd, th_live, strict=True)]
            h, g, ct_thl = reverse(prev, cur, out, thl, (*cs[:2], held), xs, n, ct_out)
            it = iter(ct_thl)
            ct_th = [next(it) if keep else None for keep in th_live]
            back_ = jax.tree.leaves(h) + jax.tree.leaves(g) + ct_th
            return [back_[i] for i in live] + [jnp.zeros_like(v) for v in extra]

        x = lax.custom_linear_solve(lambda v: v, b, solve, transpose_solve)
        return out, jax.tree.unflatten(out_def, [x[s_] for s_ in slots])

    rec.defjvp(rec_jvp, symbolic_zeros=True)
    return rec(prev, cur, th_diff, consts, xs, n)


def _is_symbolic_zero(x) -> bool:
    return isinstance(x, SymbolicZero)


def _zeros_like(tree):
    return jax.tree.map(jnp.zeros_like, tree)
