"""Small pytree arithmetic used by the solvers and the loops.

Every function here is traced once per solve; none runs per step at Python level.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

PyTree = Any


def tree_axpy(alpha, x: PyTree, y: PyTree) -> PyTree:
    """``alpha * x + y`` leafwise."""
    return jax.tree.map(lambda xi, yi: alpha * xi + yi, x, y)


def tree_scale(alpha, x: PyTree) -> PyTree:
    return jax.tree.map(lambda xi: alpha * xi, x)


def tree_add(x: PyTree, y: PyTree) -> PyTree:
    return jax.tree.map(jnp.add, x, y)


def tree_zeros_like(x: PyTree) -> PyTree:
    return jax.tree.map(jnp.zeros_like, x)


def tree_lincomb(base: PyTree | None, scale, coeffs: Sequence[float], terms: Sequence[PyTree]):
    """``base + scale * sum_i coeffs[i] * terms[i]``, skipping zero coefficients.

    ``coeffs`` are Python floats (a tableau row), so zero terms cost nothing at run time and
    XLA sees one fused expression per leaf.
    """
    pairs = [(c, t) for c, t in zip(coeffs, terms, strict=True) if c != 0]
    if not pairs:
        return base if base is not None else tree_zeros_like(terms[0])

    def leaf(b, *ks):
        dtype = ks[0].dtype
        acc = None
        for (c, _), k in zip(pairs, ks, strict=True):
            term = k if c == 1 else jnp.asarray(c, dtype) * k
            acc = term if acc is None else acc + term
        acc = scale * acc
        return acc if b is None else b + acc

    if base is None:
        return jax.tree.map(lambda *ks: leaf(None, *ks), *[t for _, t in pairs])
    return jax.tree.map(leaf, base, *[t for _, t in pairs])


def tree_where(pred, x: PyTree, y: PyTree) -> PyTree:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), x, y)


def tree_fill_rows(like: PyTree, n: int, value=jnp.inf) -> PyTree:
    """A buffer of ``n`` rows shaped like ``like``'s leaves, filled with ``value``."""
    return jax.tree.map(lambda x: jnp.full((n, *jnp.shape(x)), value, jnp.result_type(x)), like)


def tree_set_row(buf: PyTree, i, row: PyTree) -> PyTree:
    """``buf[i] = row`` leafwise; an index out of range drops the write."""
    return jax.tree.map(lambda b, r: b.at[i].set(r, mode="drop"), buf, row)


def tree_all_finite(x: PyTree):
    """One scalar: are all entries finite? ``sum(x * 0)`` is 0, or nan where any entry is inf or
    nan: one fused pass that, unlike a plain sum, cannot overflow on large finite values."""
    leaves = jax.tree.leaves(x)
    total = sum(entry_sum(leaf * 0) for leaf in leaves)
    return jnp.isfinite(total)


def tree_bytes(x: PyTree) -> int:
    """Bytes of all leaves (arrays or ``jax.ShapeDtypeStruct``s)."""
    return sum(int(np.prod(jnp.shape(v))) * jnp.dtype(v.dtype).itemsize for v in jax.tree.leaves(x))


def tree_size(x: PyTree) -> int:
    return sum(int(np.prod(jnp.shape(leaf))) for leaf in jax.tree.leaves(x))


def tolerance_leaves(tol, tree: PyTree, name: str = "atol") -> list:
    """``tol`` as one value per leaf of ``tree``: a number for every entry, or one per entry
    (an array shaped like a single-array ``tree``, or a pytree of ``tree``'s structure whose
    leaves broadcast against its leaves)."""
    leaves = jax.tree.leaves(tree)
    tols = jax.tree.leaves(tol)
    one_array = jax.tree_util.treedef_is_leaf(jax.tree.structure(tree))
    if one_array and isinstance(tol, list | tuple) and all(jnp.ndim(t) == 0 for t in tols):
        # one number per entry of an array state, as a list (scipy's ``atol`` array_like)
        concrete = all(isinstance(t, int | float | np.generic) for t in tols)
        tols = [np.asarray(tols) if concrete else jnp.stack([jnp.asarray(t) for t in tols])]
        tol = tols[0]
    if jax.tree_util.treedef_is_leaf(jax.tree.structure(tol)) and jnp.ndim(tol) == 0:
        return [tol] * len(leaves)
    if jax.tree.structure(tol) != jax.tree.structure(tree):
        raise ValueError(
            f"Adaptive({name}=...): a tolerance per entry must have the state's structure "
            f"({jax.tree.structure(tree)}), got {jax.tree.structure(tol)}; or pass one number."
        )
    for t, y in zip(tols, leaves, strict=True):
        try:
            shape = jnp.broadcast_shapes(jnp.shape(t), jnp.shape(y))
        except ValueError:
            shape = None
        if shape != jnp.shape(y):
            raise ValueError(
                f"Adaptive({name}=...): a tolerance of shape {jnp.shape(t)} does not broadcast "
                f"to its state entry's shape {jnp.shape(y)}."
            )
    return tols


def tightest_tolerance(tol):
    """One number for a tolerance given per entry: its smallest (where a solver or a backward
    solve needs a scalar)."""
    tols = jax.tree.leaves(tol)
    if len(tols) == 1 and jnp.ndim(tols[0]) == 0:
        return tols[0]
    if all(isinstance(t, int | float | np.ndarray | np.generic) for t in tols):
        return float(min(np.min(t) for t in tols))
    return jnp.min(jnp.stack([jnp.min(jnp.asarray(t)) for t in tols]))


def rms_error_ratio(err: PyTree, y0: PyTree, y1: PyTree, rtol, atol):
    """RMS over all entries of ``err / (atol + rtol * max(|y0|, |y1|))`` (Hairer's norm); nan
    where ``y1`` holds an inf or a nan (an inf would otherwise give a scale of inf and a ratio of
    0: a step to inf accepted), which spares the loops a pass of their own over ``y1``.
    ``rtol``/``atol``: numbers, or one per entry (:func:`tolerance_leaves`)."""
    num = 0.0
    rtols, atols = tolerance_leaves(rtol, y0, "rtol"), tolerance_leaves(atol, y0, "atol")
    leaves = (jax.tree.leaves(x) for x in (err, y0, y1))
    for e, a, b, rt, at in zip(*leaves, rtols, atols, strict=True):
        scale = at + rt * jnp.maximum(jnp.abs(a), jnp.abs(b))
        if jnp.iscomplexobj(e):  # the modulus (a real sum), nan where y1 is
            e, b = jnp.abs(e), jnp.abs(b)
        num = num + entry_sum(jnp.square(e / scale) + b * 0)
    return jnp.sqrt(num / max(tree_size(y0), 1))


def entry_sum(x):
    """``jnp.sum(x)``; up to ``Tuning.plain_sum_entries`` entries as XLA's own reduction loop.

    XLA:CPU makes an add reduction a YNNPACK kernel, which costs more per call than XLA's own
    loop on small arrays (see the tuning); a reducer it does not take for an add, ``u - (-v)``
    (the same IEEE sum: negation is exact), keeps XLA's own. Differentiable: its JVP is the
    tangent's sum.
    """
    from ._tuning import tuning

    # (jnp.sum accumulates float16 and bfloat16 in float32; the plain loop would not. With
    # several devices a sharded x needs a cross-device reduction, which XLA's SPMD partitioner
    # builds for an add only: "UNIMPLEMENTED: Unsupported reduction computation" otherwise)
    if (
        jnp.size(x) > tuning().plain_sum_entries
        or jnp.dtype(jnp.result_type(x)).itemsize < 4
        or jax.device_count() > 1
    ):
        return jnp.sum(x)
    return _plain_sum(x)


@jax.custom_jvp
def _plain_sum(x):
    zero = jnp.zeros((), jnp.result_type(x))
    return jax.lax.reduce(x, zero, lambda u, v: u - (-v), tuple(range(jnp.ndim(x))))


@_plain_sum.defjvp
def _plain_sum_jvp(primals, tangents):
    return _plain_sum(primals[0]), jnp.sum(tangents[0])


def is_inexact_array(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic) and jnp.issubdtype(
        jnp.result_type(x), jnp.inexact
    )


def is_array(x) -> bool:
    """A JAX or NumPy array (or NumPy scalar) of any dtype: a leaf that can be traced."""
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def split_arrays(tree: PyTree):
    """The array leaves of ``tree`` as a list, and ``rebuild(arrays)`` that puts them back
    beside the other leaves (functions, strings, Python numbers, equinox static fields), which
    never enter a traced computation.

    ``arrays_of(like)`` picks the array positions out of a pytree of ``tree``'s structure (a
    cotangent of it, say), with ``None`` read as zeros.
    """
    leaves, treedef = jax.tree.flatten(tree)
    mask = [is_array(x) for x in leaves]

    def rebuild(arrays):
        it = iter(arrays)
        return jax.tree.unflatten(
            treedef, [next(it) if m else x for x, m in zip(leaves, mask, strict=True)]
        )

    def arrays_of(like):
        flat = treedef.flatten_up_to(like)
        return [
            jnp.zeros(jnp.shape(x), jnp.result_type(x)) if y is None else y
            for x, y, m in zip(leaves, flat, mask, strict=True)
            if m
        ]

    return [x for x, m in zip(leaves, mask, strict=True) if m], rebuild, arrays_of


def partition_args(args: PyTree):
    """Split ``args`` into differentiable (inexact array) leaves and everything else.

    Returns ``(diff, static, combine)`` where ``combine(diff, static)`` rebuilds ``args``.
    """
    leaves, treedef = jax.tree.flatten(args)
    mask = [is_inexact_array(leaf) for leaf in leaves]
    diff = [leaf for leaf, m in zip(leaves, mask, strict=True) if m]
    static = [leaf for leaf, m in zip(leaves, mask, strict=True) if not m]

    def combine(diff_leaves, static_leaves):
        it_d, it_s = iter(diff_leaves), iter(static_leaves)
        return jax.tree.unflatten(treedef, [next(it_d) if m else next(it_s) for m in mask])

    return diff, static, combine


def hoist_closure(fun, *example_args):
    """``(converted, consts)``: ``converted(*args, *consts) == fun(*args)``, with every traced
    value ``fun`` closes over in ``consts``, as :func:`jax.closure_convert` (which leaves in
    the closure the tracers that cannot be differentiated, integer ones: a ``jax.grad`` outside
    the ``jax.jit`` that made them traces the adjoints' rules after that trace ended, and meets
    them as a leaked tracer). ``example_args`` fix the argument types, as there."""
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*example_args)
    consts = list(closed.consts)
    where = [i for i, c in enumerate(consts) if isinstance(c, jax.core.Tracer)]
    in_tree = jax.tree.structure(example_args)
    out_tree = jax.tree.structure(out_shape)

    def converted(*args_and_consts):
        n_args = len(args_and_consts) - len(where)
        args, hoisted = args_and_consts[:n_args], args_and_consts[n_args:]
        values = list(consts)
        for i, v in zip(where, hoisted, strict=True):
            values[i] = v
        flat, tree = jax.tree.flatten(args)
        if tree != in_tree:
            raise TypeError(f"hoist_closure: arguments {tree} do not match {in_tree}.")
        out = jaxpr_as_fun(ClosedJaxpr(closed.jaxpr, values))(*flat)
        return jax.tree.unflatten(out_tree, out)

    return converted, [consts[i] for i in where]


def hoist_rhs(f, partitioned: bool, t, y0, args):
    """:func:`hoist_closure` of a right-hand side ``f(t, y, args)``: ``(conv, consts)``; of a
    partitioned pair (``f_u(t, v, args)``, ``f_v(t, u, args)`` for ``y0 = (u0, v0)``), each
    half on its own: ``((conv_u, conv_v), (consts_u, consts_v))``."""
    if partitioned:
        (cu, ku), (cv, kv) = (
            hoist_closure(g, t, y, args) for g, y in zip(f, (y0[1], y0[0]), strict=True)
        )
        return (cu, cv), (ku, kv)
    return hoist_closure(f, t, y0, args)


def lift_tracers(obj):
    """``(tracers, rebuild)``: the JAX tracers inside ``obj`` (in tuples, named tuples, lists,
    dicts and the fields of dataclasses such as ``og.Fixed(dt)``), and ``rebuild(values)``,
    ``obj`` with ``values`` in their place: how a custom derivative rule takes them as
    arguments rather than closing over another trace's values."""
    found = []

    def visit(x):
        if isinstance(x, jax.core.Tracer):
            found.append(x)
            k = len(found) - 1
            return lambda values: values[k]
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            parts = {f.name: visit(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
            parts = {name: p for name, p in parts.items() if p is not None}
            if not parts:
                return None
            return lambda values: dataclasses.replace(
                x, **{name: p(values) for name, p in parts.items()}
            )
        if isinstance(x, tuple | list | dict):
            items = list(x.items()) if isinstance(x, dict) else list(enumerate(x))
            parts = {key: visit(v) for key, v in items}
            parts = {key: p for key, p in parts.items() if p is not None}
            if not parts:
                return None

            def rebuilt(values):
                new = [parts[k](values) if k in parts else v for k, v in items]
                if isinstance(x, dict):
                    return type(x)(zip(x.keys(), new, strict=True))
                return type(x)(*new) if hasattr(x, "_fields") else type(x)(new)

            return rebuilt
        return None

    rebuild = visit(obj)
    return found, (lambda values: obj) if rebuild is None else rebuild


@jax.tree_util.register_pytree_node_class
class Packed:
    """A pytree's leaves in few arrays: the leaves of at most ``small_bytes`` concatenated, one
    vector per dtype, the others as they are. Kept per step in a loop, each array is one write:
    a step's VJP of a small problem has dozens of scalar residuals (Lotka–Volterra's Tsit5
    step: 70), and XLA:CPU runs a loop body's every dynamic-update-slice as a kernel of its
    own. ``unpack`` works on arrays with leading axes too (a buffer of rows).

    Example:
        >>> p = Packed.pack({"a": jnp.ones(()), "b": jnp.zeros((4096,))})
        >>> p.unpack()["a"]
    """

    def __init__(self, arrays: tuple, layout):
        self.arrays = tuple(arrays)
        self.layout = layout  # (treedef, per leaf: (array index, offset or None, shape))

    @classmethod
    def pack(cls, tree: PyTree, small_bytes: int = 4096) -> Packed:
        leaves, treedef = jax.tree.flatten(tree)
        arrays, groups, spec = [], {}, []
        for leaf in leaves:
            leaf = jnp.asarray(leaf)
            if leaf.size * leaf.dtype.itemsize > small_bytes:
                spec.append((len(arrays), None, leaf.shape))
                arrays.append(leaf)
                continue
            group = groups.setdefault(leaf.dtype, [])
            offset = sum(int(x.size) for x in group)
            spec.append((leaf.dtype, offset, leaf.shape))
            group.append(leaf.ravel())
        index = {}
        for dtype, group in groups.items():
            index[dtype] = len(arrays)
            arrays.append(jnp.concatenate(group))
        spec = tuple(
            (index[i], offset, shape) if offset is not None else (i, None, shape)
            for i, offset, shape in spec
        )
        return cls(arrays, (treedef, spec))

    def unpack(self) -> PyTree:
        treedef, spec = self.layout
        leaves = []
        for i, offset, shape in spec:
            a = self.arrays[i]
            if offset is None:
                leaves.append(a)
            else:
                size = int(np.prod(shape))
                leaves.append(a[..., offset : offset + size].reshape(*a.shape[:-1], *shape))
        return jax.tree.unflatten(treedef, leaves)

    def tree_flatten(self):
        return self.arrays, self.layout

    @classmethod
    def tree_unflatten(cls, layout, arrays):
        return cls(arrays, layout)
