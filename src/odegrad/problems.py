"""Ready-made problems used by the demo, the examples and the benchmarks.

:func:`diffusion3d` is seed 001's ParallelStencil heat-diffusion model, as written there:
``dT/dt = lam * Ci * (d2T/dx2 + d2T/dy2 + d2T/dz2)`` on the interior of a 10 x 10 x 10 box with
fixed boundary values, ``Ci = 1 / (cp_min + two Gaussian anomalies)``, a two-Gaussian initial
temperature, and a horizon of 100 explicit-stable steps ``dt = min(dx, dy, dz)^2 * cp_min / 8.1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import stencil as st
from ._scaleout import context_mesh
from .stencil.halo import axis_count, exchange_halo


@dataclass(frozen=True)
class Diffusion3D:
    """Seed 001's problem: ``f(t, T, (lam, Ci))``, initial field, ``Ci``, ``lam`` and horizon."""

    n: int
    spacing: tuple[float, float, float]
    T0: jax.Array
    Ci: jax.Array
    lam: jax.Array
    dt_explicit: float
    t1: float

    def rhs(self, t, T, args):
        """``dT/dt``: ``lam * Ci * laplacian(T)`` inside, zero on the (Dirichlet) boundary."""
        lam, Ci = args
        dx, dy, dz = self.spacing
        lap = st.d2_xi(T) / dx**2 + st.d2_yi(T) / dy**2 + st.d2_zi(T) / dz**2
        return st.set_inner(jnp.zeros_like(T), lam * st.inn(Ci) * lap)

    def rhs_padded(self, t, T, args):
        """:meth:`rhs` as one operator, ``lam * Ci * laplacian(T, h, pad=True)``: the same values
        (to rounding: ``lam * Ci`` multiplies all cells), in a kernel XLA:CPU vectorises (see
        :func:`odegrad.stencil.laplacian`)."""
        lam, Ci = args
        return lam * Ci * st.laplacian(T, self.spacing, pad=True)

    def sharded_rhs(
        self,
        mesh: jax.sharding.Mesh,
        spec: jax.sharding.PartitionSpec | None = None,
        *,
        overlap: bool = False,
    ):
        """:meth:`rhs` for ``T`` and ``Ci`` sharded over ``mesh`` as ``spec``, by halo exchange.

        Returns ``rhs(t, T, (lam, Ci))`` that runs block by block in ``jax.shard_map``: each
        device receives one plane of ``T`` from each neighbour along each sharded axis
        (:func:`~odegrad.stencil.exchange_halo`) and computes ``lam * Ci * laplacian(T)`` on
        its block, zero on the field's boundary; the result is sharded like ``T``. The same
        numbers as :meth:`rhs`, without gathering the field.

        Args:
            mesh: the device mesh.
            spec: the ``PartitionSpec`` of ``T`` and ``Ci``; default: the mesh's first two
                axes over x and y (``P(*mesh.axis_names[:2])``).
            overlap: compute the block's interior (which needs no halo) separately from its
                faces, so that the exchange can proceed while the interior is computed.

        Example:
            >>> mesh = jax.make_mesh((2, 2), ("x", "y"))
            >>> rhs = p.sharded_rhs(mesh)  # T, Ci sharded as P("x", "y")
            >>> og.solve(rhs, T0, (0.0, p.t1), (p.lam, Ci), solver=og.ROCK2(p.spectral_radius))
        """
        from jax.sharding import PartitionSpec as P

        if spec is None:
            spec = P(*mesh.axis_names[:2])
        dims = (tuple(spec) + (None,) * 3)[:3]
        counts = tuple(axis_count(mesh, e) for e in dims)
        shape = tuple(jnp.shape(self.T0))

        def check(shape):
            for d, (m, count) in enumerate(zip(shape, counts, strict=True)):
                if m % count or m // count < 2:
                    raise ValueError(
                        f"sharded_rhs: {m} points along axis {d} cannot be split into {count} "
                        f"blocks of at least 2 (mesh axis {dims[d]!r}); choose a grid divisible "
                        f"by {count} or fewer devices along that axis."
                    )

        check(shape)
        h2 = tuple(h**2 for h in self.spacing)

        def local(t, T, lam, Ci):
            # global boundary mask of this block (Dirichlet: zero there)
            inside = None
            for d, e in enumerate(dims):
                b = T.shape[d]
                start = 0
                if e is not None:
                    start = _block_position(e) * b
                g = start + lax.broadcasted_iota(jnp.int32, T.shape, d)
                ok = (g > 0) & (g < b * counts[d] - 1)
                inside = ok if inside is None else inside & ok
            if not overlap:
                lap = _laplacian_halo(exchange_halo(T, dims, 1, corners=False), T, dims, h2)
            else:
                lap = _laplacian_overlap(T, dims, h2)
            val = lam.astype(T.dtype) * Ci * lap
            return jnp.where(inside, val, jnp.zeros((), T.dtype))

        def rhs(t, T, args):
            lam, Ci = args
            check(jnp.shape(T))
            return jax.shard_map(
                local, mesh=context_mesh(mesh), in_specs=(P(), spec, P(), spec), out_specs=spec
            )(t, T, lam, Ci)

        return rhs

    def spectral_radius(self, t, T, args):
        """Gershgorin bound of the Jacobian's spectral radius: ``4 lam max(Ci) sum(1/dx^2)``."""
        lam, Ci = args
        dx, dy, dz = self.spacing
        return 4.0 * jnp.abs(lam) * jnp.max(Ci) * (1 / dx**2 + 1 / dy**2 + 1 / dz**2)


def diffusion3d(n: int = 16, dtype=jnp.float32, steps: int = 100) -> Diffusion3D:
    """Seed 001's 3-d heat diffusion on an ``n^3`` grid over ``steps`` explicit-stable steps.

    Example:
        >>> p = og.problems.diffusion3d(16)
        >>> sol = og.solve(p.rhs, p.T0, (0.0, p.t1), (p.lam, p.Ci), solver=og.ROCK2())
    """
    lam, cp_min, length = 1.0, 1.0, 10.0
    d = length / (n - 1)
    x = np.arange(n) * d
    X, Y, Z = np.meshgrid(x, x, x, indexing="ij")
    anomalies = 5 * np.exp(
        -((X - length / 1.5) ** 2) - (Y - length / 2) ** 2 - (Z - length / 1.5) ** 2
    )
    anomalies += 5 * np.exp(
        -((X - length / 3.0) ** 2) - (Y - length / 2) ** 2 - (Z - length / 1.5) ** 2
    )
    Ci = 1.0 / (cp_min + anomalies)
    T0 = 100 * np.exp(
        -(((X - length / 2) / 2) ** 2) - ((Y - length / 2) / 2) ** 2 - ((Z - length / 3.0) / 2) ** 2
    ) + 50 * np.exp(
        -(((X - length / 2) / 2) ** 2) - ((Y - length / 2) / 2) ** 2 - ((Z - length / 1.5) / 2) ** 2
    )
    dt = d**2 * cp_min / 8.1
    return Diffusion3D(
        n=n,
        spacing=(d, d, d),
        T0=jnp.asarray(T0, dtype),
        Ci=jnp.asarray(Ci, dtype),
        lam=jnp.asarray(lam, dtype),
        dt_explicit=dt,
        t1=steps * dt,
    )


def _block_position(entry):
    idx = jnp.zeros((), jnp.int32)
    for name in (entry,) if isinstance(entry, str) else entry:
        idx = idx * lax.axis_size(name) + lax.axis_index(name)
    return idx


def _second_differences(E, core, h2):
    """``sum_d (E[+1] - 2 E + E[-1]) / h2[d]`` (``h2[d]``: the squared spacing) over ``core``, a
    tuple of slices into ``E`` that leaves at least one cell on each side along every axis."""
    out = None
    for d in range(E.ndim):
        lo = list(core)
        hi = list(core)
        lo[d] = slice(core[d].start - 1, core[d].stop - 1)
        hi[d] = slice(core[d].start + 1, core[d].stop + 1)
        c = E[core]
        term = (E[tuple(hi)] - c - (c - E[tuple(lo)])) / h2[d]
        out = term if out is None else out + term
    return out


def _laplacian_halo(E, T, dims, h2):
    """The Laplacian at every cell of the block ``T`` from its halo-extended copy ``E``; along
    unsharded axes the first and last cells (the boundary) get 0."""
    core = tuple(
        slice(1, 1 + T.shape[d]) if e is not None else slice(1, T.shape[d] - 1)
        for d, e in enumerate(dims)
    )
    lap = _second_differences(E, core, h2)
    pad = [(0, 0) if e is not None else (1, 1) for e in dims]
    return jnp.pad(lap, pad)


def _laplacian_overlap(T, dims, h2):
    """:func:`_laplacian_halo`, with the block's interior computed from ``T`` alone (no halo
    needed, so it can run while the halo planes are exchanged) and only the faces from the
    halo-extended block."""
    E = exchange_halo(T, dims, 1, corners=False)
    inner = tuple(slice(1, T.shape[d] - 1) for d in range(T.ndim))
    lap = jnp.pad(_second_differences(T, inner, h2), 1)
    for d, e in enumerate(dims):
        if e is None:
            continue
        b = T.shape[d]
        for face in (0, b - 1):
            # the face plane, over the block's full extent along the other sharded axes
            core = []
            for k, ek in enumerate(dims):
                if k == d:
                    core.append(slice(face + 1, face + 2))
                elif ek is not None:
                    core.append(slice(1, 1 + T.shape[k]))
                else:
                    core.append(slice(1, T.shape[k] - 1))
            val = _second_differences(E, tuple(core), h2)
            at = [
                slice(face, face + 1)
                if k == d
                else (slice(None) if dims[k] is not None else slice(1, T.shape[k] - 1))
                for k in range(T.ndim)
            ]
            lap = lap.at[tuple(at)].set(val)
    return lap
