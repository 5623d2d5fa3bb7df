"""Seed 000: reverse-mode gradients of a model whose state mixes a scalar and a vector.

The right-hand side concatenates a scalar and a vector (out of place, as in the report), and the
same model runs with a ``(scalar, vector)`` pytree state; gradients of ``y(T)[0]`` and
``y(t_19)[0]`` with respect to the matrix ``Z`` agree across adjoints (Backsolve, Interpolating,
Discrete, Auto). Runs on CPU or GPU unchanged.

    python examples/mixed_state_gpu.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import odegrad as og

M, N, T_END, DTAU = 32, 16, 2.0, 0.1


def f_concat(t, ca, Z):
    a = ca[1:]
    a_unit = a / jnp.sum(a)
    w_unit = Z @ a_unit
    ka_unit = Z.T @ w_unit
    z_unit = jnp.dot(jnp.abs(ka_unit), a_unit)
    aka_over_z = a * ka_unit / z_unit
    return jnp.concatenate([jnp.sum(aka_over_z)[None] / M, -jnp.abs(aka_over_z)])


def f_pytree(t, y, Z):
    c, a = y
    d = f_concat(t, jnp.concatenate([c[None], a]), Z)
    return d[0], d[1:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tol", type=float, default=1e-10)
    ap.add_argument("--float32", action="store_true", help="as in the report (use --tol 1e-6)")
    a = ap.parse_args(argv)
    # abs() kinks make the gradient sensitive to the step sequence: the adjoints agree to ~1e-3
    # only at tight tolerance, hence float64 by default
    if not a.float32:
        jax.config.update("jax_enable_x64", True)
    dt = jnp.float32 if a.float32 else jnp.float64
    Z = jax.random.normal(jax.random.PRNGKey(1234), (N, M), dt)
    ts = jnp.arange(21, dtype=dt) * DTAU
    ca0 = jnp.concatenate([jnp.zeros(1), jnp.ones(M)]).astype(dt)
    y0_tree = (jnp.zeros((), dt), jnp.ones(M, dt))
    adjoints = {"Auto": og.Auto(), "Discrete": og.Discrete(), "Interpolating": og.Interpolating()}
    if not a.quick:
        adjoints["Backsolve"] = og.Backsolve(on_drift="warn")
    step = og.Adaptive(a.tol, a.tol)
    print(f"seed 000 on {jax.devices()[0].platform}: Z {N}x{M}, T={T_END}, saves every {DTAU}")
    for label, f, y0, first in [
        ("concatenated state", f_concat, ca0, lambda ys: ys[:, 0]),
        ("(scalar, vector) pytree", f_pytree, y0_tree, lambda ys: ys[0]),
    ]:
        grads = {}
        for name, adj in adjoints.items():

            def c(Z, adj=adj, f=f, y0=y0, first=first):
                sol = og.solve(
                    f, y0, (0.0, T_END), Z, step=step, saveat=og.SaveAt(ts=ts), adjoint=adj
                )
                s = first(sol.ys)
                return s[-1] + s[19]

            g = jax.jit(jax.grad(c))
            jax.block_until_ready(g(Z))
            t0 = time.perf_counter()
            grads[name] = jax.block_until_ready(g(Z))
            print(
                f"  {label:24s} {name:14s} |dc/dZ| = {float(jnp.linalg.norm(grads[name])):.6f}"
                f"  ({1e3 * (time.perf_counter() - t0):.2f} ms)"
            )
        ref = grads["Discrete"]
        worst = max(float(jnp.linalg.norm(g - ref) / jnp.linalg.norm(ref)) for g in grads.values())
        print(f"  {label}: largest relative difference between adjoints {worst:.1e}")


if __name__ == "__main__":
    main()
