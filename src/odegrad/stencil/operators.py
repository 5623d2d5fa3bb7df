"""Finite-difference operators on 1-, 2- and 3-d arrays, built from pure slicing.

Axes are named x, y, z = 0, 1, 2 (ParallelStencil.jl's FiniteDifferences1D/2D/3D).
Suffix ``a``: all points of the other axes; suffix ``i``: inner points of the other
axes (their first and last entries dropped). Docstring formulas use 0-based 3-d
indices; for lower ndim the trailing indices are simply absent. Every operator is
pure ``jax.numpy`` slicing, so it works under ``jax.jit``, ``jax.grad``, ``jax.jvp`` and
``jax.vmap`` (``vmap`` over a leading batch axis, since ndim is read from the unbatched
array). The linear ones (differences, second differences, averages) carry a ``custom_jvp``
whose reverse pass pads the cotangent once and combines slices of it (the same values as
JAX's own transpose of the slicing, to rounding), which XLA:CPU compiles far better.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from .padded import masked_d2

Array = jax.Array

_NAMES = "xyz"


def _check(name: str, A: ArrayLike, min_ndim: int = 1) -> Array:
    """Return ``A`` as a jax array after checking min_ndim <= ndim <= 3."""
    A = jnp.asarray(A)
    if not min_ndim <= A.ndim <= 3:
        # (an operator of every axis asks for ndim of the array itself: 1-d to 3-d then)
        wanted = " or ".join(f"{d}-d" for d in range(min_ndim if min_ndim <= 3 else 1, 4))
        raise ValueError(f"{name}: expected a {wanted} array, got ndim={A.ndim}")
    return A


def _trims(
    name: str, A: Array, axes: tuple[int, ...], width: int, inner: bool
) -> tuple[list[int], list[int]]:
    """``(trim, base)`` of a stencil: the output loses ``trim[k]`` points along axis ``k``
    and starts at ``base[k]`` along the axes that are not in ``axes``."""
    trim = [2 if inner else 0] * A.ndim
    base = [1 if inner else 0] * A.ndim
    for a in axes:
        trim[a] = width
    for k, t in enumerate(trim):
        _at_least(name, A, k, t + 1)
    return trim, base


def _at_least(name: str, A: Array, k: int, n: int) -> None:
    if A.shape[k] < n:  # (fewer would give an empty result, or a negative slice)
        raise ValueError(
            f"{name}: needs at least {n} points along axis {k} ({_NAMES[k]}), got shape {A.shape}"
        )


def _take(name: str, A: Array, shift: Sequence[int], trim: Sequence[int]) -> Array:
    """``A[shift_k : n_k - trim_k + shift_k]`` along every axis k."""
    idx = []
    for k, (s, t) in enumerate(zip(shift, trim, strict=True)):
        _at_least(name, A, k, t + 1)
        idx.append(slice(s, A.shape[k] - t + s))
    return A[tuple(idx)]


def _shifts(
    ndim: int, axes: tuple[int, ...], offsets: Sequence[int], base: Sequence[int]
) -> list[tuple[int, ...]]:
    """One shift per combination of ``offsets`` along ``axes`` (``base`` elsewhere)."""
    shifts = []
    for combo in itertools.product(offsets, repeat=len(axes)):
        shift = list(base)
        for a, o in zip(axes, combo, strict=True):
            shift[a] = o
        shifts.append(tuple(shift[:ndim]))
    return shifts


def _views(
    name: str,
    A: ArrayLike,
    axes: tuple[int, ...],
    offsets: Sequence[int],
    inner: bool,
    span: int | None = None,
) -> list[Array]:
    """Shifted views of ``A``: one per combination of ``offsets`` along ``axes``.

    Along each of ``axes`` the stencil covers ``span`` points (default
    ``max(offsets) + 1``), so the output loses ``span - 1`` points there; the other
    axes keep all points, or only the inner ones if ``inner``.
    """
    A = _check(name, A, max(axes, default=0) + 1)
    width = (max(offsets) + 1 if span is None else span) - 1
    trim, base = _trims(name, A, axes, width, inner)
    return [_take(name, A, s, trim) for s in _shifts(A.ndim, axes, offsets, base)]


# --------------------------------------------------------------- linear stencils, derivatives
#
# A linear stencil (d_*, d2_*, av*) is ``combine(views)``, the views being shifted slices of
# ``A``. Left to JAX, its transpose turns every slice into its own ``pad`` of the cotangent;
# XLA:CPU fuses those pads (with whatever produced the cotangent) into one unvectorised loop
# that re-evaluates the producer once per pad with per-element bounds checks, several times
# the cost of the forward stencil. So these operators carry a ``custom_jvp``: the primal is
# the plain slicing, and the tangent writes every view as ``pad(dA)[inside]``, with ``dA``
# padded by ``trim - shift`` below and ``shift`` above, sliced at ``trim``. Forward, XLA folds
# each slice of a pad into a slice of ``dA`` (the cost and bits of the plain operator);
# reverse, JAX transposes view ``v`` into "pad the cotangent by ``trim`` on both sides, slice
# it at ``trim - shift_v``": the same pad for every view (and for every operator of the same
# cotangent and output shape), which XLA merges into one materialised pad whose slices it
# vectorises. Signs are applied to ``dA`` before the pad (``x - y`` is ``x + (-y)`` exactly),
# so that the pads see the cotangent itself.

_OFFSETS = {"d": (0, 1), "d2": (0, 1, 2), "av": (0, 1)}


def _combine(kind: str, vs: list[Array]) -> Array:
    if kind == "d":
        lo, hi = vs
        return hi - lo
    if kind == "d2":
        m, c, p = vs
        return (p - c) - (c - m)
    return sum(vs[1:], vs[0]) / len(vs)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _stencil(name: str, kind: str, axes: tuple[int, ...], inner: bool, A: Array) -> Array:
    return _combine(kind, _views(name, A, axes, _OFFSETS[kind], inner))


@_stencil.defjvp
def _stencil_jvp(name, kind, axes, inner, primals, tangents):
    (A,), (dA,) = primals, tangents
    offsets = _OFFSETS[kind]
    trim, base = _trims(name, A, axes, max(offsets), inner)
    zero = jnp.zeros((), dA.dtype)
    inside = tuple(slice(t, n) for n, t in zip(A.shape, trim, strict=True))
    neg = -dA if kind != "av" else dA

    def view(i: int, negate: bool = False) -> Array:
        # the i-th shifted view of dA (or -dA), as a slice of a pad of it; its transpose
        # slices the cotangent padded by trim on both sides
        cfg = [(t - s, s, 0) for s, t in zip(shifts[i], trim, strict=True)]
        return lax.pad(neg if negate else dA, zero, cfg)[inside]

    shifts = _shifts(A.ndim, axes, offsets, base)
    # the primal's arithmetic, signs applied before the pad: bit for bit the plain operator
    if kind == "d":
        out = view(1) + view(0, True)
    elif kind == "d2":
        out = (view(2) + view(1, True)) + (view(0) + view(1, True))
    else:
        out = _combine(kind, [view(i) for i in range(len(shifts))])
    return _stencil(name, kind, axes, inner, A), out


def _linear(name: str, kind: str, A: ArrayLike, axes: tuple[int, ...], inner: bool) -> Array:
    A = _check(name, A, max(axes, default=0) + 1)
    _trims(name, A, axes, max(_OFFSETS[kind]), inner)
    return _stencil(name, kind, axes, inner, A)


def _diff(name: str, A: ArrayLike, axis: int, inner: bool) -> Array:
    return _linear(name, "d", A, (axis,), inner)


def _diff2(name: str, A: ArrayLike, axis: int, inner: bool) -> Array:
    return _linear(name, "d2", A, (axis,), inner)


def _mean(name: str, A: ArrayLike, axes: tuple[int, ...], inner: bool) -> Array:
    return _linear(name, "av", A, axes, inner)


def _harm(name: str, A: ArrayLike, axes: tuple[int, ...], inner: bool) -> Array:
    vs = _views(name, A, axes, (0, 1), inner)
    return len(vs) / sum((1 / v for v in vs[1:]), 1 / vs[0])


def _select(name: str, A: ArrayLike, axes: tuple[int, ...]) -> Array:
    return _views(name, A, axes, (1,), inner=False, span=3)[0]


def _every(A: ArrayLike) -> tuple[int, ...]:
    return tuple(range(jnp.ndim(A)))


# ----------------------------------------------------------------------------- differences


def d_xa(A: ArrayLike) -> Array:
    """d_xa(A)[i,j,k] = A[i+1,j,k] - A[i,j,k]; shape (nx-1, ny, nz)."""
    return _diff("d_xa", A, 0, inner=False)


def d_ya(A: ArrayLike) -> Array:
    """d_ya(A)[i,j,k] = A[i,j+1,k] - A[i,j,k]; shape (nx, ny-1, nz)."""
    return _diff("d_ya", A, 1, inner=False)


def d_za(A: ArrayLike) -> Array:
    """d_za(A)[i,j,k] = A[i,j,k+1] - A[i,j,k]; shape (nx, ny, nz-1)."""
    return _diff("d_za", A, 2, inner=False)


def d_xi(A: ArrayLike) -> Array:
    """d_xi(A)[i,j,k] = A[i+1,j+1,k+1] - A[i,j+1,k+1]; shape (nx-1, ny-2, nz-2)."""
    return _diff("d_xi", A, 0, inner=True)


def d_yi(A: ArrayLike) -> Array:
    """d_yi(A)[i,j,k] = A[i+1,j+1,k+1] - A[i+1,j,k+1]; shape (nx-2, ny-1, nz-2)."""
    return _diff("d_yi", A, 1, inner=True)


def d_zi(A: ArrayLike) -> Array:
    """d_zi(A)[i,j,k] = A[i+1,j+1,k+1] - A[i+1,j+1,k]; shape (nx-2, ny-2, nz-1)."""
    return _diff("d_zi", A, 2, inner=True)


def d2_xa(A: ArrayLike) -> Array:
    """d2_xa(A)[i,j,k] = A[i+2,j,k] - 2A[i+1,j,k] + A[i,j,k]; shape (nx-2, ny, nz)."""
    return _diff2("d2_xa", A, 0, inner=False)


def d2_ya(A: ArrayLike) -> Array:
    """d2_ya(A)[i,j,k] = A[i,j+2,k] - 2A[i,j+1,k] + A[i,j,k]; shape (nx, ny-2, nz)."""
    return _diff2("d2_ya", A, 1, inner=False)


def d2_za(A: ArrayLike) -> Array:
    """d2_za(A)[i,j,k] = A[i,j,k+2] - 2A[i,j,k+1] + A[i,j,k]; shape (nx, ny, nz-2)."""
    return _diff2("d2_za", A, 2, inner=False)


def d2_xi(A: ArrayLike) -> Array:
    """d2_xi(A)[i,j,k] = A[i+2,j+1,k+1] - 2A[i+1,j+1,k+1] + A[i,j+1,k+1]; shape (nx-2, ny-2, nz-2)."""  # noqa: E501
    return _diff2("d2_xi", A, 0, inner=True)


def d2_yi(A: ArrayLike) -> Array:
    """d2_yi(A)[i,j,k] = A[i+1,j+2,k+1] - 2A[i+1,j+1,k+1] + A[i+1,j,k+1]; shape (nx-2, ny-2, nz-2)."""  # noqa: E501
    return _diff2("d2_yi", A, 1, inner=True)


def d2_zi(A: ArrayLike) -> Array:
    """d2_zi(A)[i,j,k] = A[i+1,j+1,k+2] - 2A[i+1,j+1,k+1] + A[i+1,j+1,k]; shape (nx-2, ny-2, nz-2)."""  # noqa: E501
    return _diff2("d2_zi", A, 2, inner=True)


# ------------------------------------------------------------------------------ selections


def all(A: ArrayLike) -> Array:  # ParallelStencil's name (shadows the builtin here)
    """all(A)[i,j,k] = A[i,j,k]; shape (nx, ny, nz)."""
    return _check("all", A)


def inn(A: ArrayLike) -> Array:
    """inn(A)[i,j,k] = A[i+1,j+1,k+1]; shape (nx-2, ny-2, nz-2)."""
    return _select("inn", A, _every(A))


def inn_x(A: ArrayLike) -> Array:
    """inn_x(A)[i,j,k] = A[i+1,j,k]; shape (nx-2, ny, nz)."""
    return _select("inn_x", A, (0,))


def inn_y(A: ArrayLike) -> Array:
    """inn_y(A)[i,j,k] = A[i,j+1,k]; shape (nx, ny-2, nz)."""
    return _select("inn_y", A, (1,))


def inn_z(A: ArrayLike) -> Array:
    """inn_z(A)[i,j,k] = A[i,j,k+1]; shape (nx, ny, nz-2)."""
    return _select("inn_z", A, (2,))


def inn_xy(A: ArrayLike) -> Array:
    """inn_xy(A)[i,j,k] = A[i+1,j+1,k]; shape (nx-2, ny-2, nz)."""
    return _select("inn_xy", A, (0, 1))


def inn_xz(A: ArrayLike) -> Array:
    """inn_xz(A)[i,j,k] = A[i+1,j,k+1]; shape (nx-2, ny, nz-2)."""
    return _select("inn_xz", A, (0, 2))


def inn_yz(A: ArrayLike) -> Array:
    """inn_yz(A)[i,j,k] = A[i,j+1,k+1]; shape (nx, ny-2, nz-2)."""
    return _select("inn_yz", A, (1, 2))


# -------------------------------------------------------------------------------- averages


def av(A: ArrayLike) -> Array:
    """av(A)[i,j,k] = mean of A[i+a,j+b,k+c] over a,b,c in {0,1}; shape (nx-1, ny-1, nz-1)."""
    return _mean("av", A, _every(A), inner=False)


def av_xa(A: ArrayLike) -> Array:
    """av_xa(A)[i,j,k] = (A[i,j,k] + A[i+1,j,k]) / 2; shape (nx-1, ny, nz)."""
    return _mean("av_xa", A, (0,), inner=False)


def av_ya(A: ArrayLike) -> Array:
    """av_ya(A)[i,j,k] = (A[i,j,k] + A[i,j+1,k]) / 2; shape (nx, ny-1, nz)."""
    return _mean("av_ya", A, (1,), inner=False)


def av_za(A: ArrayLike) -> Array:
    """av_za(A)[i,j,k] = (A[i,j,k] + A[i,j,k+1]) / 2; shape (nx, ny, nz-1)."""
    return _mean("av_za", A, (2,), inner=False)


def av_xi(A: ArrayLike) -> Array:
    """av_xi(A)[i,j,k] = (A[i,j+1,k+1] + A[i+1,j+1,k+1]) / 2; shape (nx-1, ny-2, nz-2)."""
    return _mean("av_xi", A, (0,), inner=True)


def av_yi(A: ArrayLike) -> Array:
    """av_yi(A)[i,j,k] = (A[i+1,j,k+1] + A[i+1,j+1,k+1]) / 2; shape (nx-2, ny-1, nz-2)."""
    return _mean("av_yi", A, (1,), inner=True)


def av_zi(A: ArrayLike) -> Array:
    """av_zi(A)[i,j,k] = (A[i+1,j+1,k] + A[i+1,j+1,k+1]) / 2; shape (nx-2, ny-2, nz-1)."""
    return _mean("av_zi", A, (2,), inner=True)


def av_xya(A: ArrayLike) -> Array:
    """av_xya(A)[i,j,k] = mean of A[i+a,j+b,k] over a,b in {0,1}; shape (nx-1, ny-1, nz)."""
    return _mean("av_xya", A, (0, 1), inner=False)


def av_xza(A: ArrayLike) -> Array:
    """av_xza(A)[i,j,k] = mean of A[i+a,j,k+c] over a,c in {0,1}; shape (nx-1, ny, nz-1)."""
    return _mean("av_xza", A, (0, 2), inner=False)


def av_yza(A: ArrayLike) -> Array:
    """av_yza(A)[i,j,k] = mean of A[i,j+b,k+c] over b,c in {0,1}; shape (nx, ny-1, nz-1)."""
    return _mean("av_yza", A, (1, 2), inner=False)


def av_xyi(A: ArrayLike) -> Array:
    """av_xyi(A)[i,j,k] = mean of A[i+a,j+b,k+1] over a,b in {0,1}; shape (nx-1, ny-1, nz-2)."""
    return _mean("av_xyi", A, (0, 1), inner=True)


def av_xzi(A: ArrayLike) -> Array:
    """av_xzi(A)[i,j,k] = mean of A[i+a,j+1,k+c] over a,c in {0,1}; shape (nx-1, ny-2, nz-1)."""
    return _mean("av_xzi", A, (0, 2), inner=True)


def av_yzi(A: ArrayLike) -> Array:
    """av_yzi(A)[i,j,k] = mean of A[i+1,j+b,k+c] over b,c in {0,1}; shape (nx-2, ny-1, nz-1)."""
    return _mean("av_yzi", A, (1, 2), inner=True)


# ----------------------------------------------------------------------- harmonic averages


def harm(A: ArrayLike) -> Array:
    """harm(A)[i,j,k] = 2^ndim / sum of 1/A[i+a,j+b,k+c] over a,b,c in {0,1}; shape (nx-1, ny-1, nz-1)."""  # noqa: E501
    return _harm("harm", A, _every(A), inner=False)


def harm_xa(A: ArrayLike) -> Array:
    """harm_xa(A)[i,j,k] = 2 / (1/A[i,j,k] + 1/A[i+1,j,k]); shape (nx-1, ny, nz)."""
    return _harm("harm_xa", A, (0,), inner=False)


def harm_ya(A: ArrayLike) -> Array:
    """harm_ya(A)[i,j,k] = 2 / (1/A[i,j,k] + 1/A[i,j+1,k]); shape (nx, ny-1, nz)."""
    return _harm("harm_ya", A, (1,), inner=False)


def harm_za(A: ArrayLike) -> Array:
    """harm_za(A)[i,j,k] = 2 / (1/A[i,j,k] + 1/A[i,j,k+1]); shape (nx, ny, nz-1)."""
    return _harm("harm_za", A, (2,), inner=False)


def harm_xi(A: ArrayLike) -> Array:
    """harm_xi(A)[i,j,k] = 2 / (1/A[i,j+1,k+1] + 1/A[i+1,j+1,k+1]); shape (nx-1, ny-2, nz-2)."""
    return _harm("harm_xi", A, (0,), inner=True)


def harm_yi(A: ArrayLike) -> Array:
    """harm_yi(A)[i,j,k] = 2 / (1/A[i+1,j,k+1] + 1/A[i+1,j+1,k+1]); shape (nx-2, ny-1, nz-2)."""
    return _harm("harm_yi", A, (1,), inner=True)


def harm_zi(A: ArrayLike) -> Array:
    """harm_zi(A)[i,j,k] = 2 / (1/A[i+1,j+1,k] + 1/A[i+1,j+1,k+1]); shape (nx-2, ny-2, nz-1)."""
    return _harm("harm_zi", A, (2,), inner=True)


def harm_xya(A: ArrayLike) -> Array:
    """harm_xya(A)[i,j,k] = 4 / sum of 1/A[i+a,j+b,k] over a,b in {0,1}; shape (nx-1, ny-1, nz)."""
    return _harm("harm_xya", A, (0, 1), inner=False)


def harm_xza(A: ArrayLike) -> Array:
    """harm_xza(A)[i,j,k] = 4 / sum of 1/A[i+a,j,k+c] over a,c in {0,1}; shape (nx-1, ny, nz-1)."""
    return _harm("harm_xza", A, (0, 2), inner=False)


def harm_yza(A: ArrayLike) -> Array:
    """harm_yza(A)[i,j,k] = 4 / sum of 1/A[i,j+b,k+c] over b,c in {0,1}; shape (nx, ny-1, nz-1)."""
    return _harm("harm_yza", A, (1, 2), inner=False)


def harm_xyi(A: ArrayLike) -> Array:
    """harm_xyi(A)[i,j,k] = 4 / sum of 1/A[i+a,j+b,k+1] over a,b in {0,1}; shape (nx-1, ny-1, nz-2)."""  # noqa: E501
    return _harm("harm_xyi", A, (0, 1), inner=True)


def harm_xzi(A: ArrayLike) -> Array:
    """harm_xzi(A)[i,j,k] = 4 / sum of 1/A[i+a,j+1,k+c] over a,c in {0,1}; shape (nx-1, ny-2, nz-1)."""  # noqa: E501
    return _harm("harm_xzi", A, (0, 2), inner=True)


def harm_yzi(A: ArrayLike) -> Array:
    """harm_yzi(A)[i,j,k] = 4 / sum of 1/A[i+1,j+b,k+c] over b,c in {0,1}; shape (nx-2, ny-1, nz-1)."""  # noqa: E501
    return _harm("harm_yzi", A, (1, 2), inner=True)


# ---------------------------------------------------------------------------------- others


def _local(name: str, A: ArrayLike, op: Callable[[Array, Array], Array]) -> Array:
    out = _select(name, A, _every(A))
    for a in _every(A):
        lo, hi = _views(name, A, (a,), (0, 2), inner=True)
        out = op(out, op(lo, hi))
    return out


def maxloc(A: ArrayLike) -> Array:
    """maxloc(A)[i,j,k] = max of A[i+1,j+1,k+1] and its 2*ndim axis neighbours; shape (nx-2, ny-2, nz-2)."""  # noqa: E501
    return _local("maxloc", A, jnp.maximum)


def minloc(A: ArrayLike) -> Array:
    """minloc(A)[i,j,k] = min of A[i+1,j+1,k+1] and its 2*ndim axis neighbours; shape (nx-2, ny-2, nz-2)."""  # noqa: E501
    return _local("minloc", A, jnp.minimum)


def _is_zero(h) -> bool:
    """Whether a concrete spacing is 0 (a traced one is not checked)."""
    try:
        return bool(np.any(np.asarray(h) == 0))
    except jax.errors.JAXTypeError:
        return False


def laplacian(
    A: ArrayLike,
    spacing: float | ArrayLike | Sequence[float | ArrayLike],
    *,
    pad: bool = False,
) -> Array:
    """laplacian(A, h) = d2_xi(A)/h_x^2 + d2_yi(A)/h_y^2 + d2_zi(A)/h_z^2; shape (nx-2, ny-2, nz-2).

    With ``pad=True`` the result has the shape of ``A``, zero on its boundary cells:
    ``jnp.pad(laplacian(A, h), 1)``, the values of ``set_inner(zeros_like(A), laplacian(A,
    h))`` (to rounding under ``jax.jit``, where XLA may contract either differently; without
    ``set_inner``'s cast to ``A.dtype``), computed in a kernel that XLA:CPU vectorises, forward
    and reverse (2.7x faster at 160^3 in float64; see :mod:`odegrad.stencil.padded`). Prefer
    it for a right-hand side of that form.

    Example:
        >>> dT = lam * Ci * st.laplacian(T, (dx, dy, dz), pad=True)  # seed 001's rhs
    """
    A = _check("laplacian", A)
    if isinstance(spacing, str) or (not isinstance(spacing, Sequence) and jnp.ndim(spacing) > 1):
        raise TypeError(
            f"laplacian: spacing={spacing!r}: a grid spacing (a number) or one per axis "
            f"(a sequence or 1-d array of {A.ndim})."
        )
    if isinstance(spacing, Sequence):
        hs = tuple(spacing)
    else:
        h = jnp.asarray(spacing)
        hs = (h,) * A.ndim if h.ndim == 0 else tuple(h)
    if len(hs) != A.ndim:
        raise ValueError(
            f"laplacian: spacing has {len(hs)} entries but the array has ndim={A.ndim}"
        )
    if any(_is_zero(h) for h in hs):
        raise ValueError(f"laplacian: spacing={spacing!r} holds 0; a grid spacing is nonzero.")
    # symbolic sizes (jax.export's) cannot size the merged axis's slices; (`all` is the
    # ParallelStencil operator in this module)
    symbolic = any(not isinstance(n, int) for n in A.shape)
    if pad and A.ndim > 1 and not symbolic:
        for axis in range(A.ndim):
            _at_least("laplacian", A, axis, 3)
        terms = [masked_d2(A, a) / hs[a] ** 2 for a in range(A.ndim)]
        return sum(terms[1:], terms[0])
    terms = [_diff2("laplacian", A, a, inner=True) / hs[a] ** 2 for a in range(A.ndim)]
    lap = sum(terms[1:], terms[0])
    return jnp.pad(lap, 1) if pad else lap


def set_inner(A: ArrayLike, values: ArrayLike) -> Array:
    """set_inner(A, V) = copy of A with A[1:-1,1:-1,1:-1] = V (V broadcast, cast to A.dtype); shape of A."""  # noqa: E501
    A = _check("set_inner", A)
    inner = (slice(1, -1),) * A.ndim
    shape = _take("set_inner", A, (1,) * A.ndim, (2,) * A.ndim).shape
    vshape = jnp.shape(values)
    try:
        ok = jnp.broadcast_shapes(vshape, shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"set_inner: values of shape {vshape} do not fit the interior {shape}")
    return A.at[inner].set(values)
