"""Stencils on fields sharded over a device mesh: halo exchange with neighbouring devices only.

A field sharded with ``NamedSharding(mesh, P("x", "y", None))`` is cut into blocks, one per
device. A stencil near a block's edge reads a few cells of the neighbouring blocks (its *halo*).
:func:`exchange_halo` fetches exactly those cells from the neighbours with ``lax.ppermute``
inside ``jax.shard_map``; no device ever holds more than its block plus its halo, and nothing is
gathered. Its reverse-mode derivative is again a halo exchange (the transpose of a ``ppermute``
is the reverse ``ppermute``), so gradients of sharded stencils stay sharded too.

:func:`sharded` turns an ordinary function of whole fields (such as a right-hand side built from
:mod:`odegrad.stencil` operators) into one that runs block by block, unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from .._scaleout import context_mesh

__all__ = ["axis_count", "exchange_halo", "halo_bytes", "sharded"]

AxisName = str | tuple[str, ...] | None


def _names(entry: AxisName) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def axis_count(mesh: Mesh, entry: AxisName) -> int:
    """How many blocks a ``PartitionSpec`` entry (a mesh axis name, a tuple of names, or None)
    cuts an array dimension into.

    Example:
        >>> axis_count(jax.make_mesh((2, 2), ("x", "y")), ("x", "y"))
        4
    """
    return math.prod(mesh.shape[n] for n in _names(entry))


def _position(entry: AxisName):
    """This block's index along a (possibly multi-axis) spec entry, inside ``shard_map``."""
    idx = jnp.zeros((), jnp.int32)
    for n in _names(entry):
        idx = idx * lax.axis_size(n) + lax.axis_index(n)
    return idx


def _receive(block, dim: int, entry: AxisName, width: int, periodic: bool):
    """The ``width`` cells before and after this block along ``dim``, from its neighbours
    (zeros past a non-periodic global edge)."""
    names = _names(entry)
    count = math.prod(lax.axis_size(n) for n in names)
    size = block.shape[dim]
    if width > size:
        raise ValueError(
            f"exchange_halo: width={width} is larger than the block ({size} cells) along array "
            f"axis {dim}; use fewer devices along mesh axis {entry!r} or a smaller width."
        )
    first = lax.slice_in_dim(block, 0, width, axis=dim)
    last = lax.slice_in_dim(block, size - width, size, axis=dim)
    if count == 1:
        if periodic:
            return last, first
        return jnp.zeros_like(first), jnp.zeros_like(first)
    axis = names[0] if len(names) == 1 else names
    to_right = [(i, i + 1) for i in range(count - 1)] + ([(count - 1, 0)] if periodic else [])
    to_left = [(j, i) for i, j in to_right]
    # devices without a sender (the global edges, when not periodic) receive zeros
    return lax.ppermute(last, axis, to_right), lax.ppermute(first, axis, to_left)


def _exchange_dim(block, dim: int, entry: AxisName, width: int, periodic: bool):
    before, after = _receive(block, dim, entry, width, periodic)
    return jnp.concatenate([before, block, after], axis=dim)


def exchange_halo(
    block: jax.Array,
    axes: Sequence[AxisName],
    width: int = 1,
    *,
    periodic: bool | Sequence[bool] = False,
    corners: bool = True,
) -> jax.Array:
    """This device's block, extended by ``width`` cells of its neighbours' blocks on each side.

    Call it inside ``jax.shard_map``. ``axes`` names, for each array dimension, the mesh axis it
    is sharded over (the entries of its ``PartitionSpec``; ``None`` for a dimension that is not
    sharded, which is left as it is). Along each sharded dimension the block grows by
    ``2 * width`` cells: ``width`` received from the previous and ``width`` from the next block
    (``lax.ppermute``, one message each way). At the global edges of a non-periodic dimension the
    added cells are zeros; with ``periodic=True`` they wrap around. Dimensions are exchanged one
    after the other, on the already extended block, so corner and edge cells (needed by
    stencils with diagonal terms) are right too.

    Args:
        block: the local block (inside ``shard_map``).
        axes: one entry per dimension of ``block``: a mesh axis name, a tuple of names, or None.
        width: halo cells per side (the stencil's radius).
        periodic: one bool, or one per dimension.
        corners: fill the corner and edge cells (exchanging dimensions one after the other).

    Example:
        >>> def lap(T):  # inside shard_map, T sharded as P("x", "y", None)
        ...     E = exchange_halo(T, ("x", "y", None))  # (bx + 2, by + 2, nz)
        ...     return E[2:, 1:-1] + E[:-2, 1:-1] + E[1:-1, 2:] + E[1:-1, :-2] - 4 * T
    """
    axes = tuple(axes)
    if len(axes) != block.ndim:
        raise ValueError(
            f"exchange_halo: axes={axes!r} has {len(axes)} entries but the block has "
            f"ndim={block.ndim}; give one mesh axis name (or None) per array dimension."
        )
    if not (isinstance(width, int) and width >= 1):
        raise ValueError(f"exchange_halo: width={width!r} must be a positive int.")
    per_dim = (periodic,) * block.ndim if isinstance(periodic, bool) else tuple(periodic)
    if len(per_dim) != block.ndim:
        raise ValueError(
            f"exchange_halo: periodic={periodic!r} needs one bool per dimension ({block.ndim})."
        )
    axes_i = range(block.ndim)
    if corners:
        for dim, entry in enumerate(axes):
            if entry is not None:
                block = _exchange_dim(block, dim, entry, width, per_dim[dim])
        return block
    out = block
    for dim, entry in enumerate(axes):
        if entry is None:
            continue
        before, after = _receive(block, dim, entry, width, per_dim[dim])
        # the slabs cover the block; the result is already wider along the dimensions before
        grown = [(width, width) if k < dim and axes[k] is not None else (0, 0) for k in axes_i]
        out = jnp.concatenate([jnp.pad(before, grown), out, jnp.pad(after, grown)], axis=dim)
    return out


# --- sharded(fn): run a whole-field function block by block -------------------------------------


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _spec_dims(spec: PartitionSpec, ndim: int) -> tuple[AxisName, ...]:
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return entries[:ndim]


def _window(x, spec, mesh, halo, name):
    """The block of ``x`` with ``halo`` neighbour cells on each side of every sharded dimension,
    where the global edges of the window coincide with the field's own edges.

    An inner block takes ``[-halo, b + halo)``; the first block ``[0, b + 2 halo)`` and the last
    ``[-2 halo, b)``, so that ``fn`` applies its own boundary treatment at the field's edges.
    """
    for dim, entry in enumerate(_spec_dims(spec, x.ndim)):
        count = axis_count(mesh, entry)
        if count == 1:
            continue
        b = x.shape[dim]
        if b < 2 * halo:
            raise ValueError(
                f"sharded: {name} has {b} cells per block along axis {dim} (mesh axis "
                f"{entry!r}), fewer than 2 * halo = {2 * halo}; use fewer devices along that "
                "mesh axis, a larger grid, or a smaller halo."
            )
        ext = _exchange_dim(x, dim, entry, 2 * halo, periodic=False)
        i = _position(entry)
        start = jnp.where(i == 0, 2 * halo, jnp.where(i == count - 1, 0, halo))
        x = lax.dynamic_slice_in_dim(ext, start, b + 2 * halo, axis=dim)
    return x


def _crop(y, spec, mesh, halo, name):
    for dim, entry in enumerate(_spec_dims(spec, y.ndim)):
        count = axis_count(mesh, entry)
        if count == 1:
            continue
        b = y.shape[dim] - 2 * halo
        i = _position(entry)
        start = jnp.where(i == 0, 0, jnp.where(i == count - 1, 2 * halo, halo))
        y = lax.dynamic_slice_in_dim(y, start, b, axis=dim)
    return y


def _map_specs(fn, specs, tree, what):
    try:
        return jax.tree.map(
            lambda s, sub: jax.tree.map(lambda x: fn(x, s), sub), specs, tree, is_leaf=_is_spec
        )
    except ValueError as e:
        raise ValueError(
            f"sharded: {what} do not match the structure of the arguments/outputs ({e}); give "
            "one PartitionSpec per argument (or per leaf), as for jax.shard_map."
        ) from None


def sharded(
    fn: Callable[..., Any],
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    *,
    halo: int = 1,
) -> Callable[..., Any]:
    """Run ``fn``, a function of whole fields, on sharded fields block by block with halo exchange.

    ``fn`` is written for whole (unsharded) arrays, e.g. a right-hand side built from
    :mod:`odegrad.stencil` operators with its boundary treatment (``set_inner``, ``inn``...).
    The returned function takes the same arguments, sharded over ``mesh`` as ``in_specs`` says
    (``jax.shard_map`` conventions: a ``PartitionSpec`` per argument or per leaf; ``P()`` for
    replicated values such as scalars), and returns ``fn``'s result sharded as ``out_specs``.

    Each device evaluates ``fn`` on its block extended by ``halo`` cells from its neighbours
    (:func:`exchange_halo`; the blocks at the field's global edges are extended inwards by
    ``2 * halo`` instead, so that ``fn``'s own boundary treatment applies there) and keeps its
    own block of the result. Nothing is gathered: per call and sharded dimension each device
    sends two slabs of ``2 * halo`` cells per sharded input to its neighbours.

    Requirements: every output value depends only on inputs at most ``halo`` cells away along
    each sharded dimension (and on whether it lies within ``halo`` cells of the field's edge),
    the outputs have the shapes of the inputs along sharded dimensions, and each block has at
    least ``2 * halo`` cells there. Reductions over the whole field (``max``, ``sum``) would
    only see one block and are not allowed inside ``fn``.

    Args:
        fn: the function of whole arrays.
        mesh: the device mesh.
        in_specs: ``PartitionSpec`` per argument (a pytree prefix of the arguments).
        out_specs: ``PartitionSpec`` per output (a pytree prefix of the outputs).
        halo: the stencil radius in cells (1 for the second-order operators of
            :mod:`odegrad.stencil`).

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> p = og.problems.diffusion3d(48)
        >>> mesh = jax.make_mesh((2, 2), ("x", "y"))
        >>> field = P("x", "y", None)
        >>> rhs = og.stencil.sharded(p.rhs, mesh, (P(), field, (P(), field)), field)
        >>> sol = og.solve(rhs, T0_sharded, (0.0, p.t1), (p.lam, Ci_sharded),
        ...                solver=og.ROCK2(p.spectral_radius))
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"sharded: mesh={mesh!r} must be a jax.sharding.Mesh (jax.make_mesh).")
    if not (isinstance(halo, int) and halo >= 1):
        raise ValueError(f"sharded: halo={halo!r} must be a positive int (the stencil radius).")
    in_specs_t = tuple(in_specs) if isinstance(in_specs, list) else in_specs
    if not isinstance(in_specs_t, tuple) or _is_spec(in_specs_t):
        raise TypeError(
            "sharded: in_specs must be a tuple with one PartitionSpec (or pytree of them) per "
            f"argument of fn, got {in_specs!r}."
        )

    def local(*args):
        if len(args) != len(in_specs_t):
            raise TypeError(
                f"sharded: fn got {len(args)} arguments but in_specs has {len(in_specs_t)}."
            )
        windows = _map_specs(
            lambda x, s: _window(x, s, mesh, halo, "an argument"), in_specs_t, args, "in_specs"
        )
        out = fn(*windows)

        def crop(y, s):
            return _crop(y, s, mesh, halo, "an output")

        return _map_specs(crop, out_specs, out, "out_specs")

    def run(*args):
        return jax.shard_map(
            local, mesh=context_mesh(mesh), in_specs=in_specs_t, out_specs=out_specs
        )(*args)

    return run


def halo_bytes(
    shape: Sequence[int],
    spec: PartitionSpec,
    mesh: Mesh,
    width: int,
    itemsize: int,
    *,
    corners: bool = True,
) -> int:
    """Bytes of the messages of one :func:`exchange_halo` of a field of global ``shape``, per
    device: two slabs of ``width`` cells per sharded dimension, one to each neighbour (a device
    at a global edge of a non-periodic dimension sends only one of the two). With ``corners``
    the slabs span the block as extended along the dimensions exchanged before.

    Example:
        >>> halo_bytes((48, 48, 48), P("x", "y"), jax.make_mesh((2, 2), ("x", "y")), 1, 8)
        38400
    """
    dims = _spec_dims(spec, len(shape))
    block = [n // axis_count(mesh, e) for n, e in zip(shape, dims, strict=True)]
    total = 0
    for d, e in enumerate(dims):
        if axis_count(mesh, e) == 1:
            continue
        total += 2 * width * math.prod(block[:d] + block[d + 1 :])
        if corners:
            block[d] += 2 * width
    return total * itemsize
