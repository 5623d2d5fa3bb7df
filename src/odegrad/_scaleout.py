"""Sharded solves and ensembles over several devices (see docs/scaleout.md).

``og.solve`` keeps sharded inputs sharded: its loops are ordinary JAX code, so XLA's sharding
propagation (GSPMD) partitions the state, the solver's stages, the saved rows and the adjoint's
buffers like ``y0``. Meshes whose axes are *Explicit* (the default of ``jax.make_mesh``) type
every array with its sharding and ask each operation to say how its result is sharded; the
loops do not, so ``og.solve`` runs itself with the mesh's axes switched to *Auto*
(:func:`on_auto_axes`, ``jax.sharding.auto_axes``) and gives the results the sharding of
``y0`` back.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

__all__ = ["ensemble"]


def _explicit_sharding(x):
    """``(abstract mesh, spec)`` of an array typed with Explicit mesh axes, else None."""
    try:
        sh = jax.typeof(x).sharding
    except (TypeError, AttributeError):
        return None
    mesh = getattr(sh, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return None
    if AxisType.Explicit not in tuple(getattr(mesh, "axis_types", ())):
        return None
    return mesh, sh.spec


def _out_specs(tree, y0):
    """A spec per leaf of ``tree``: ``P(None, ..., *spec)`` for a leaf whose trailing shape is
    that of an explicitly sharded leaf of ``y0`` (states, saved rows, stored steps), else
    replicated."""
    known = []
    for leaf in jax.tree.leaves(y0):
        found = _explicit_sharding(leaf)
        if found is not None:
            spec = tuple(found[1]) + (None,) * (leaf.ndim - len(found[1]))
            known.append((tuple(leaf.shape), spec))

    def spec_of(x):
        shape = tuple(getattr(x, "shape", ()))
        for s, spec in known:
            k = len(s)
            if len(shape) >= k and shape[len(shape) - k :] == s and k > 0:
                return PartitionSpec(*((None,) * (len(shape) - k)), *spec)
        return PartitionSpec()

    return jax.tree.map(spec_of, tree)


def explicit_mesh(tree):
    """The abstract mesh of the first leaf of ``tree`` typed with Explicit mesh axes, or None."""
    for x in jax.tree.leaves(tree):
        found = _explicit_sharding(x)
        if found is not None:
            return found[0]
    return None


def on_auto_axes(fn, mesh, y0, *rest):
    """``fn(y0, *rest)`` with the Explicit axes of ``mesh`` made Auto (``jax.sharding.auto_axes``):
    odegrad's loops rely on sharding propagation. Results whose trailing shape is that of a leaf
    of ``y0`` get its sharding back, the others are replicated. Only the JAX arrays among
    ``rest``'s leaves cross the boundary; other leaves (Python numbers) are passed as they are."""
    leaves, treedef = jax.tree.flatten(rest)
    is_arr = [isinstance(x, jax.Array) for x in leaves]
    arrays = [x for x, m in zip(leaves, is_arr, strict=True) if m]
    out_tree = []

    def flat(y0, arrays):
        it = iter(arrays)
        full = [next(it) if m else x for x, m in zip(leaves, is_arr, strict=True)]
        out, tree = jax.tree.flatten(fn(y0, *jax.tree.unflatten(treedef, full)))
        out_tree[:] = [tree]
        return tuple(out)

    try:
        with jax.sharding.use_abstract_mesh(mesh):
            shapes = jax.eval_shape(
                jax.sharding.auto_axes(flat, out_sharding=PartitionSpec()), y0, arrays
            )
            out_specs = tuple(_out_specs(list(shapes), y0))
            out = jax.sharding.auto_axes(flat, out_sharding=out_specs)(y0, arrays)
    except ValueError as e:
        if "AbstractMesh" not in str(e):
            raise
        # a transformation run op by op (jax.grad, jax.jvp without jax.jit) cannot execute on
        # the mesh's abstract form, which is all an Explicit-typed tracer carries
        raise ValueError(
            "og.solve: y0 or args are sharded over a mesh with Explicit axes and the solve is "
            "transformed without jax.jit (e.g. jax.grad(loss)(y0)); put jax.jit around the "
            "transformation: jax.jit(jax.grad(loss))(y0)."
        ) from e
    return jax.tree.unflatten(out_tree[0], out)


#: the mesh of the last odegrad ``shard_map`` traced in the current solve (:func:`failure_mesh`)
_TRACED_MESH: contextvars.ContextVar = contextvars.ContextVar("odegrad_mesh", default=None)


@contextlib.contextmanager
def solve_scope():
    """Around the tracing of one solve: the meshes its right-hand sides note are its own."""
    token = _TRACED_MESH.set(None)
    try:
        yield
    finally:
        _TRACED_MESH.reset(token)


def failure_mesh():
    """The mesh a solve runs on, as far as tracing can tell: the context's (a mesh with Explicit
    axes, see :func:`on_auto_axes`, or ``jax.set_mesh``), else that of a sharded right-hand side
    of odegrad's (``og.stencil.sharded``) traced in this solve, else None. A failed solve's
    error callback runs on each of its devices (see ``_solution._failure_token``)."""
    ctx = jax.sharding.get_abstract_mesh()
    return _TRACED_MESH.get() if ctx.empty else ctx


#: ``(axis names, device count, members per device)`` of the :func:`ensemble` being traced
_ENSEMBLE: contextvars.ContextVar = contextvars.ContextVar("odegrad_ensemble", default=None)


def ensemble_block():
    """``(index, count, size)`` inside :func:`ensemble`'s ``shard_map``: this device's block of
    the batch (traced), the number of blocks and their size; None elsewhere. A failed member is
    named by its place in the whole batch."""
    found = _ENSEMBLE.get()
    if found is None:
        return None
    names, count, size = found
    return jax.lax.axis_index(names), count, size


def context_mesh(mesh):
    """``mesh``, or the context's abstract mesh when it is the same mesh with other axis types
    (inside :func:`on_auto_axes`), for ``jax.shard_map`` calls of sharded right-hand sides.
    Notes the mesh for :func:`failure_mesh`."""
    _TRACED_MESH.set(mesh)
    ctx = jax.sharding.get_abstract_mesh()
    if (
        not ctx.empty
        and tuple(ctx.axis_names) == tuple(mesh.axis_names)
        and tuple(ctx.axis_sizes) == tuple(mesh.axis_sizes)
        and tuple(ctx.axis_types) != tuple(mesh.axis_types)
    ):
        return ctx
    return mesh


def ensemble(
    fn: Callable[..., Any], mesh: jax.sharding.Mesh, axis: str | tuple[str, ...] | None = None
) -> Callable[..., Any]:
    """``jax.vmap(fn)`` over the leading axis of every argument, that axis sharded over devices.

    Each device runs ``fn`` on its own slice of the batch (``jax.shard_map`` of ``jax.vmap``),
    independently: an adaptive solve in ``fn`` takes as many steps as its own members need,
    and nothing is communicated until the results are returned, sharded like the inputs.
    Parameter sweeps and multiple shooting are the typical use; ``fn`` may call ``og.solve``
    and ``jax.grad`` of it. The batch size must be a multiple of the number of devices along
    ``axis``.

    Args:
        fn: a function of arrays (or pytrees of arrays), each with a leading batch axis once
            batched; the outputs get a leading batch axis too.
        mesh: the device mesh.
        axis: the mesh axis (or axes) to spread the batch over; default all of them.

    Example:
        >>> mesh = jax.make_mesh((4,), ("batch",))
        >>> def loss(lam):
        ...     sol = og.solve(f, y0, (0.0, 1.0), lam)
        ...     return jnp.sum(sol.ys[-1] ** 2)
        >>> sweep = og.ensemble(jax.value_and_grad(loss), mesh)
        >>> values, grads = sweep(jnp.linspace(0.5, 2.0, 8))  # 2 per device
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"ensemble: mesh={mesh!r} must be a jax.sharding.Mesh (jax.make_mesh).")
    axis = tuple(mesh.axis_names) if axis is None else axis
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    unknown = [n for n in names if n not in mesh.axis_names]
    if unknown:
        raise ValueError(
            f"ensemble: axis={axis!r} names {unknown}, not axes of the mesh "
            f"{tuple(mesh.axis_names)}; pass one of those."
        )
    spec = PartitionSpec(names[0] if len(names) == 1 else names)
    count = 1
    for n in names:
        count *= mesh.shape[n]
    batched = jax.vmap(fn)
    sharding = NamedSharding(mesh, spec)

    def place(x):
        if not isinstance(x, jax.core.Tracer):
            return jax.device_put(x, sharding)
        if AxisType.Explicit in tuple(mesh.axis_types):
            return jax.sharding.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)

    def run(*args):
        sizes = {x.shape[0] for x in jax.tree.leaves(args) if getattr(x, "ndim", 0) > 0}
        if any(n % count for n in sizes):
            raise ValueError(
                f"ensemble: batch sizes {sorted(sizes)} are not multiples of the {count} devices "
                f"along {axis!r}; pad the batch or use fewer devices."
            )
        args = jax.tree.map(place, args)

        def block(*args):
            size = next((x.shape[0] for x in jax.tree.leaves(args) if jnp.ndim(x)), 0)
            token = _ENSEMBLE.set((names, count, size))
            try:
                return batched(*args)
            finally:
                _ENSEMBLE.reset(token)

        # check_vma=False: the solver loops mix per-device (varying) and constant values freely
        return jax.shard_map(block, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(
            *args
        )

    return run
