"""Rosenbrock error estimates on a forcing in ``t``: Rodas5, Rodas5P and Kvaerno5 (for scale) on
``y' = -lam y + cos t``, ``y(0) = 0``, ``t`` in ``[0, 10]``, against the closed form
``y = (lam cos t + sin t - lam e^{-lam t}) / (lam^2 + 1)``.

At ``lam = 0`` the problem is a quadrature, ``df/dy = 0``: Rodas5's estimate (its last stage)
stays ~0 whatever the step. Prints one markdown table: the error at ``t = 10`` (steps taken).

Run: ``python benchmarks/rodas_forcing.py``
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

import odegrad as og

jax.config.update("jax_enable_x64", True)


def exact(lam: float, t: float = 10.0) -> float:
    return (lam * np.cos(t) + np.sin(t) - lam * np.exp(-lam * t)) / (lam**2 + 1)


def main() -> None:
    f = lambda t, y, lam: -lam * y + jnp.cos(t)
    solvers = (og.Rodas5, og.Rodas5P, og.Kvaerno5)
    print("| rtol = atol | lam | " + " | ".join(s.__name__ for s in solvers) + " |")
    print("|---|---|" + "---|" * len(solvers))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Rodas5's warning that f reads t: the point here
        for rtol in (1e-6, 1e-8):
            for lam in (0.0, 1e-3, 0.1, 10.0):
                row = []
                for solver in solvers:
                    step = og.Adaptive(rtol=rtol, atol=rtol)
                    sol = og.solve(f, jnp.zeros(()), (0.0, 10.0), lam, solver=solver(), step=step)
                    err = abs(float(sol.ys[-1]) - exact(lam))
                    row.append(f"{err:.1e} ({int(sol.stats['steps'])})")
                print(f"| {rtol:g} | {lam:g} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
