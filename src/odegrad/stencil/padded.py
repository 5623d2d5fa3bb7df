"""Second differences with a zero boundary, as linear JAX primitives that XLA:CPU vectorises.

``masked_d2(A, axis)`` is ``set_inner(zeros_like(A), d2_<axis>i(A))``: the second difference
``A[q - e] - 2 A[q] + A[q + e]`` along ``axis`` at every interior cell ``q`` (interior along
every axis), zero on the boundary cells. :func:`odegrad.stencil.laplacian` with ``pad=True`` is
``sum_a masked_d2(A, a) / h_a^2``.

Why a primitive. XLA:CPU emits a ``pad`` (and the padding JAX's transpose of a slice makes) as
a branch around its operand's loads, and LLVM does not vectorise a loop whose loads are
conditional. The usual form, ``set_inner`` of slices, pads along the last (contiguous) axis,
which puts that branch in the innermost loop: the whole stencil, and its transpose, ran as
scalar code (160^3 float64: one ROCK stage 12 ms against 4.1 ms below). Here no load is
conditional along the last axis, in either direction:

- forward, the last two axes are merged into one of ``n2 n1`` entries and the stencil is
  evaluated over every interior row along the second-to-last axis, *all* of each row's ``n1``
  entries: the neighbours along the last axis are ``q -/+ 1`` and along the second-to-last
  ``q -/+ n1``, all inside the array (the first and last entry of a row read the neighbouring
  row's last or first entry; a select puts zero there). Only the outer axes are padded, and
  LLVM hoists their branch out of the innermost loop.
- reverse, the transpose ``L^T c = D^T (P c)`` (``P`` zeroes the boundary cells, ``D`` is the
  second difference) is the same stencil applied at *every* cell to ``Z = P c``, extended by
  zero: ``Z[q + e] - 2 Z[q] + Z[q - e]``. ``Z`` is padded with zero planes along the outer axes
  (materialised once), and along the last axis the merged rows wrap onto boundary cells, where
  ``Z`` is zero already. (JAX's own transpose of the slices pads the cotangent along the last
  axis.) Applying ``P`` as masks on every read instead, with no padded copy, made one kernel
  that LLVM left scalar (the faces' concatenations): 9.1 ms against 6.7 ms for these two.

Each primitive's transpose is the other, so ``jax.grad``, ``jax.jvp``, ``jax.hessian`` and
``jax.linear_transpose`` all see linear maps with efficient adjoints; ``vmap`` adds leading
axes, over which the kernels loop unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir


def _layout(shape: tuple[int, ...], nd: int):
    """``(lead, outer, n2, n1)``: the leading (batch) axes, the spatial axes before the last
    two, and the extents of the last two."""
    lead, spatial = shape[: len(shape) - nd], shape[len(shape) - nd :]
    return lead, spatial[:-2], spatial[-2], spatial[-1]


def _views(X, lead: int, outer: tuple[int, ...], n2: int, n1: int, axis: int, nd: int):
    """The views ``(m, c, p)`` of the merged array ``X`` (``lead`` leading axes, then the
    ``outer`` axes, then the last two merged) over the interior cells of the outer axes and
    the second-to-last, all entries of the last, shifted by one cell along spatial ``axis``;
    each of shape ``(*lead, *(n - 2 for n in outer), n2 - 2, n1)``."""

    def view(o: int):
        idx = [slice(None)] * lead
        for a, n in enumerate(outer):
            idx.append(slice(1 + o, n - 1 + o) if a == axis else slice(1, n - 1))
        step = n1 if axis == nd - 2 else 1 if axis == nd - 1 else 0
        idx.append(slice(n1 + o * step, (n2 - 1) * n1 + o * step))
        v = X[tuple(idx)]
        return v.reshape(*v.shape[:-1], n2 - 2, n1)

    return view(-1), view(0), view(1)


def _inner_last(x, n1: int):
    """``x`` with its entries at index 0 and ``n1 - 1`` along the last axis made zero (dtype and
    weak type kept)."""
    k = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.where((k >= 1) & (k < n1 - 1), x, 0)


def _masked_d2_impl(A, *, axis: int, nd: int):
    lead, outer, n2, n1 = _layout(A.shape, nd)
    X = A.reshape(*lead, *outer, n2 * n1)
    m, c, p = _views(X, len(lead), outer, n2, n1, axis, nd)
    d2 = (p - c) - (c - m)
    d2 = _inner_last(d2, n1)
    return jnp.pad(d2, [(0, 0)] * len(lead) + [(1, 1)] * (nd - 1) + [(0, 0)])


def _masked_d2_transpose_impl(C, *, axis: int, nd: int):
    # L^T C = D^T Z with Z = P C: the second difference of Z, extended by zero, at every cell
    lead, outer, n2, n1 = _layout(C.shape, nd)
    inner = C[(Ellipsis, *(slice(1, -1) for _ in range(nd - 1)), slice(None))]
    Z = _inner_last(inner, n1)  # Z = P C without its boundary planes along the outer axes
    # two zero planes on each side of every outer axis: Z's boundary plane, and one beyond it
    # for the neighbours of the boundary cells (along the last axis, the merged rows wrap onto
    # boundary cells, where Z is zero already); materialised: fused into the views below, a
    # pad's bounds check would sit in front of every load. (In a gradient, XLA may fuse this
    # pass into the kernel that makes C.)
    Z = jnp.pad(Z, [(0, 0)] * len(lead) + [(2, 2)] * (nd - 1) + [(0, 0)])
    Z = lax.optimization_barrier(Z)
    padded = tuple(n + 2 for n in outer)
    X = Z.reshape(*lead, *padded, (n2 + 2) * n1)
    m, c, p = _views(X, len(lead), padded, n2 + 2, n1, axis, nd)
    return (p - c) - (c - m)


def _primitive(name: str, impl) -> Primitive:
    p = Primitive(name)
    p.def_impl(functools.partial(jax.jit, static_argnames=("axis", "nd"))(impl))
    # the input's type as it is: shape, dtype, weak type, sharding, varying manual axes
    p.def_abstract_eval(lambda A, **_: A)
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))

    def batch(args, dims, **params):
        (A,), (d,) = args, dims
        return p.bind(jnp.moveaxis(A, d, 0), **params), 0

    batching.primitive_batchers[p] = batch
    return p


masked_d2_p = _primitive("odegrad_masked_d2", _masked_d2_impl)
masked_d2_transpose_p = _primitive("odegrad_masked_d2_transpose", _masked_d2_transpose_impl)
ad.deflinear2(masked_d2_p, lambda ct, A, **kw: [masked_d2_transpose_p.bind(ct, **kw)])
ad.deflinear2(masked_d2_transpose_p, lambda ct, C, **kw: [masked_d2_p.bind(ct, **kw)])


def masked_d2(A: jax.Array, axis: int) -> jax.Array:
    """``set_inner(zeros_like(A), d2_<axis>i(A))`` for a 2-d or 3-d ``A`` (at least 3 points
    along every axis), in one vectorisable pass; see the module's docstring.

    Example:
        >>> lap = sum(masked_d2(T, a) / h[a] ** 2 for a in range(T.ndim))
    """
    return masked_d2_p.bind(A, axis=axis, nd=A.ndim)
