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

from . import stencil as st


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
