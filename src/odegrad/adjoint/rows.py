"""Whether a right-hand side treats the rows of its state independently, read from its jaxpr.

A batch stacked into one state of shape ``(B, n)`` (a network applied to each row inside ``f``,
the layout of a torchdiffeq user) has a block-diagonal Jacobian: row ``b`` of ``f(y)`` depends
on row ``b`` of ``y`` alone. One vector-Jacobian product with the cotangent ``e_k`` in every row
then gives column ``k`` of every row's ``n x n`` block at once, so the adjoint's propagator (see
:class:`~odegrad.adjoint.columns.PropagatorSolver`) costs ``n`` products per stage for the whole
batch rather than ``B n`` — the cost it has under ``jax.vmap``.

The analysis follows the axis of the rows through a function's equations (nested jaxprs of
``jit``, ``custom_jvp`` and ``remat`` included): elementwise operations, broadcasts, transposes,
reshapes that keep the leading dimensions, stacking, reductions and contractions over other
axes, gathers and scatters with constant indices along other axes (``y[:, idx]``,
``y.at[:, k].set(v)``), and a matrix product in which the rows stay a free or batch
dimension. Anything else that touches a row-carrying value (a reduction over the rows, a
gather across rows, a loop, a sort along the rows) marks what is computed from it as mixed, so
a rule the analysis lacks costs speed, never a wrong gradient.

A ``custom_jvp`` function is read through its primal jaxpr, which says nothing about its
derivative rule; so the adjoint asks about the vector-Jacobian product it
will use (``jax.vjp`` of ``f``, with ``custom_jvp`` rules and ``custom_vjp`` backward passes
traced into it, or the user's ``vjp=``): its cotangent in ``y`` must keep the rows of ``y``
and of the incoming cotangent apart.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

# operations that act entry by entry (operands of equal rank, size-1 dimensions broadcast)
_ELEMENTWISE = frozenset(
    """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp conj
    convert_element_type
    copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow
    real reduce_precision rem round rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan
    tanh xor""".split()
)
_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split()
)
_CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())
_SCATTERS = frozenset("scatter scatter-add scatter-mul scatter-min scatter-max".split())
# calls whose jaxpr is the function itself, derivative included (a custom_jvp rule is taken to
# keep the primal's rows, as jax.nn's do; a custom_vjp's backward pass is opaque, so it is not
# followed, nor are loops and branches)
_CALLS = frozenset("jit pjit closed_call core_call custom_jvp_call checkpoint remat remat2".split())


class _Mixed(Exception):
    """An equation mixes rows (or the analysis cannot tell that it does not)."""


MIXED = "mixed"  # the row axis of a value that mixes rows


def independent_rows(f: Callable, y, *rest) -> int:
    """``B`` when every leaf of ``y`` has ``B > 1`` rows (leading axis) and each row of
    ``f(y, *rest)`` depends on the same row of ``y`` only; else 1. Traced once, nothing
    compiled; ``rest`` is constant here (its rows, if any, are the same row's data).

    Example:
        >>> w = jnp.ones((3, 2))
        >>> independent_rows(lambda y, w: jnp.tanh(y @ w.T) @ w, jnp.ones((5, 3)), w)
        5
        >>> independent_rows(lambda y, w: y - y.mean(0), jnp.ones((5, 3)), w)
        1
    """
    leaves = jax.tree.leaves(y)
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else 1 for x in leaves}
    if len(sizes) != 1 or (rows := sizes.pop()) < 2:
        return 1
    specs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), (y, *rest)
    )
    closed = jax.make_jaxpr(f)(*specs)
    axes = [0] * len(leaves) + [None] * (len(closed.jaxpr.invars) - len(leaves))
    out = _row_axes(closed.jaxpr, axes)
    shapes = [v.aval.shape for v in closed.jaxpr.outvars]
    ok = all(a is None or (a == 0 and s[0] == rows) for a, s in zip(out, shapes, strict=True))
    # (a == 0 is False for MIXED)
    return rows if ok else 1


def _row_axes(jaxpr, axes) -> list:
    """The rows' axis in each of ``jaxpr``'s outputs (``None``: independent of the rows,
    ``MIXED``: rows mixed), given its inputs'. A value that mixes rows marks only what is
    computed from it: a cotangent of shared parameters (a sum over the rows) beside a row-wise
    one leaves the latter row-wise."""
    env = dict(zip(jaxpr.invars, axes, strict=True))
    read = lambda v: None if isinstance(v, jex_core.Literal) else env.get(v)
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if all(a is None for a in ins):
            outs = [None] * len(eqn.outvars)
        elif MIXED in ins:
            outs = [MIXED] * len(eqn.outvars)
        else:
            try:
                outs = _rule(eqn, ins)
            except _Mixed:
                outs = [MIXED] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _rule(eqn, ins) -> list:
    name, params = eqn.primitive.name, eqn.params
    shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
    out_shape = eqn.outvars[0].aval.shape if eqn.outvars else ()
    carried = {a for a in ins if a is not None}
    if name in _ELEMENTWISE or name == "sort":
        if len(carried) != 1:
            raise _Mixed
        (a,) = carried
        for ax, shape in zip(ins, shapes, strict=True):
            if ax is not None and (len(shape) != len(out_shape) or shape[a] != out_shape[a]):
                raise _Mixed
        if name == "sort" and params["dimension"] == a:
            raise _Mixed
        return [a] * len(eqn.outvars)
    if name in _CALLS:
        inner = _call_jaxpr(params)
        if inner is not None and len(inner.invars) == len(ins):
            return _row_axes(inner, ins)
    if name == "dot_general":
        return [_dot_axis(params, ins, shapes)]
    if name == "stack" and len(carried) == 1:  # a new axis at params["axis"]
        (a,) = carried
        return [a + (a >= params["axis"])]
    if name == "concatenate" and len(carried) == 1 and params["dimension"] not in carried:
        (a,) = carried
        return _same_size(a, shapes[ins.index(a)][a], out_shape)
    if name in _SCATTERS:
        return [_scatter_axis(params["dimension_numbers"], ins, shapes)]
    a = ins[0]
    if a is None or any(x is not None for x in ins[1:]):  # (indices, padding values)
        raise _Mixed
    if name == "gather":
        return [_gather_axis(params, a, shapes[0])]
    shape = shapes[0]
    if name == "broadcast_in_dim":
        b = params["broadcast_dimensions"][a]
        return _same_size(b, shape[a], out_shape)
    if name == "transpose":
        return [list(params["permutation"]).index(a)]
    if name == "reshape":
        if params.get("dimensions") is None and tuple(shape[: a + 1]) == tuple(out_shape[: a + 1]):
            return [a]
        raise _Mixed
    if name == "squeeze":
        dims = params["dimensions"]
        if a in dims:
            raise _Mixed
        return [a - sum(d < a for d in dims)]
    if name in _REDUCTIONS:
        dims = params["axes"]
        if a in dims:
            raise _Mixed
        return [a - sum(d < a for d in dims)]
    if name in _CUMULATIVE:
        if params["axis"] == a:
            raise _Mixed
        return [a]
    if name == "unstack" and params["axis"] != a:  # (stack's transpose) the axis removed
        return [a - (a > params["axis"])] * len(eqn.outvars)
    if name == "split" and params["axis"] != a:
        return [a] * len(eqn.outvars)
    if name == "rev" and a not in params["dimensions"]:
        return [a]
    if name == "pad" and tuple(params["padding_config"][a]) == (0, 0, 0):
        return [a]
    if name == "slice" and _whole(params, shape, a):
        return [a]
    if name == "dynamic_slice" and params["slice_sizes"][a] == shape[a]:
        return [a]
    raise _Mixed


def _call_jaxpr(params):
    """The jaxpr of a call equation (``jit``, ``custom_jvp``, ``remat``)."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = params.get(key)
        if isinstance(inner, jex_core.ClosedJaxpr):
            return inner.jaxpr
        if isinstance(inner, jex_core.Jaxpr):
            return inner
    return None


def _same_size(axis, size, out_shape) -> list:
    if out_shape[axis] != size:  # broadcast from one row: every row reads it
        raise _Mixed
    return [axis]


def _whole(params, shape, a) -> bool:
    strides = params.get("strides") or (1,) * len(shape)
    return (
        params["start_indices"][a] == 0
        and params["limit_indices"][a] == shape[a]
        and (strides[a] == 1)
    )


def _dot_axis(params, ins, shapes) -> int:
    """The rows' axis in a ``dot_general``'s output: a batch dimension shared by both operands
    or a free dimension of the one operand that carries them."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    la, ra = ins
    if la is not None and ra is not None:  # both carry rows: only as the same batch dimension
        if la in lb and ra in rb and lb.index(la) == rb.index(ra):
            return lb.index(la)
        raise _Mixed
    side, a = (0, la) if la is not None else (1, ra)
    contract, batch = (lc, lb) if side == 0 else (rc, rb)
    if a in contract:
        raise _Mixed
    if a in batch:
        return list(batch).index(a)
    free = [d for d in range(len(shapes[side])) if d not in contract and d not in batch]
    offset = len(lb) + (0 if side == 0 else len(shapes[0]) - len(lc) - len(lb))
    return offset + free.index(a)


def _windows(rank, collapsed, batching) -> list:
    """The operand dimensions a gather or scatter moves whole slices of, in order."""
    return [d for d in range(rank) if d not in collapsed and d not in batching]


def _gather_axis(params, a, shape) -> int:
    """The rows' axis in a gather's output (``y[:, idx]``): the operand's rows must be a slice
    dimension taken whole, indexed by constants."""
    dn = params["dimension_numbers"]
    windows = _windows(len(shape), dn.collapsed_slice_dims, dn.operand_batching_dims)
    if a in dn.start_index_map or a not in windows or params["slice_sizes"][a] != shape[a]:
        raise _Mixed
    return dn.offset_dims[windows.index(a)]


def _scatter_axis(dn, ins, shapes) -> int:
    """The rows' axis in a scatter's output (``y.at[:, idx].set(v)``): the operand's rows, and
    the updates' where they carry them, must be the same whole window dimension, indexed by
    constants."""
    op_a, index_a, up_a = ins
    windows = _windows(len(shapes[0]), dn.inserted_window_dims, dn.operand_batching_dims)
    if index_a is not None:
        raise _Mixed
    if op_a is None:  # the updates carry the rows: which operand dimension they land in
        if up_a not in dn.update_window_dims:
            raise _Mixed
        op_a = windows[list(dn.update_window_dims).index(up_a)]
    if op_a in dn.scatter_dims_to_operand_dims or op_a not in windows:
        raise _Mixed
    window = dn.update_window_dims[windows.index(op_a)]
    if shapes[2][window] != shapes[0][op_a] or up_a not in (None, window):
        raise _Mixed
    return op_a
