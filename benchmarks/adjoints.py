"""Every adjoint side by side: gradient time, compile time, temporary memory, and agreement.

Two problems:
* Lotka–Volterra (2 states, 4 parameters), Tsit5, rtol=atol=1e-6, 20 saves, loss = sum of
  squares of the saves — the small-problem regime where per-step overhead rules.
* a large state: 2-d periodic diffusion-advection on an N x N grid (default 64), Tsit5 at 1e-6,
  loss of the final field — the memory-bound regime.

Prints one markdown table per problem: median time per gradient (interleaved), compile time,
``memory_analysis()`` temporary bytes, and the relative difference from ``Discrete("all")``.

    python benchmarks/adjoints.py [--quick] [--n 64] [--json PATH]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import odegrad as og
from _timing import (
    compile_timed,
    fmt_bytes,
    fmt_compile,
    fmt_diff,
    fmt_ratio,
    fmt_timing,
    interleaved_medians,
    markdown_table,
    result_row,
    warm_up_jax,
    write_json,
)

ADJOINTS = {
    "Auto": lambda: og.Auto(),
    "Discrete('all')": lambda: og.Discrete("all"),
    "Discrete(8)": lambda: og.Discrete(8),
    "Forward": lambda: og.Forward(),
    "Interpolating": lambda: og.Interpolating(),
    "Interpolating(4)": lambda: og.Interpolating(checkpoints=4),
    "Quadrature": lambda: og.Quadrature(),
    "Backsolve": lambda: og.Backsolve(on_drift="warn"),
}


def lotka_volterra():
    def f(t, y, p):
        a, b, c, d = p
        return jnp.stack([a * y[0] - b * y[0] * y[1], -c * y[1] + d * y[0] * y[1]])

    ts = jnp.linspace(0.0, 10.0, 20)
    y0, p = jnp.array([1.0, 1.0]), jnp.array([1.5, 1.0, 3.0, 1.0])

    def make_loss(adjoint):
        def loss(p):
            sol = og.solve(
                f,
                y0,
                (0.0, 10.0),
                p,
                step=og.Adaptive(1e-6, 1e-6),
                saveat=og.SaveAt(ts=ts),
                adjoint=adjoint,
            )
            return jnp.sum(sol.ys**2)

        return jax.grad(loss)

    return "Lotka–Volterra (Tsit5, 1e-6, 20 saves, d/d 4 params)", make_loss, (p,)


def diffusion(n: int):
    def f(t, y, p):
        up, down = jnp.roll(y, 1, 0), jnp.roll(y, -1, 0)
        lap = up + down + jnp.roll(y, 1, 1) + jnp.roll(y, -1, 1) - 4 * y
        return p[0] * lap + p[1] * (up - down)

    x = np.linspace(0, 2 * np.pi, n, endpoint=False)
    y0 = jnp.asarray(np.sin(x)[:, None] * np.cos(2 * x)[None, :], jnp.float32)
    p = jnp.array([0.05, 2.0], jnp.float32)

    def make_loss(adjoint):
        def loss(y0, p):
            sol = og.solve(
                f, y0, (0.0, 1.0), p, step=og.Adaptive(1e-6, 1e-6), adjoint=adjoint, max_steps=2048
            )
            return jnp.sum(sol.ys[-1] ** 2)

        return jax.grad(loss, argnums=(0, 1))

    return f"diffusion {n}x{n} (Tsit5, 1e-6, d/d field and 2 params)", make_loss, (y0, p)


def run(problem, names, rounds, number):
    title, make_loss, args = problem
    compiled, grads = {}, {}
    for name in names:
        compiled[name] = compile_timed(lambda name=name: make_loss(ADJOINTS[name]()), args)
        grads[name] = compiled[name].fn(*args)
    ref = grads["Discrete('all')"]

    def rel(g):
        num = sum(
            float(jnp.sum((a - b) ** 2))
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref), strict=False)
        )
        den = sum(float(jnp.sum(b**2)) for b in jax.tree.leaves(ref))
        return (num / den) ** 0.5

    times = interleaved_medians(
        {n: (lambda c=compiled[n]: c.call(*args)) for n in names}, rounds, number, budget_s=20
    )
    base = times["Auto"].median
    rows = [
        [
            n,
            fmt_timing(times[n]),
            fmt_ratio(times[n].median, base),
            fmt_compile(compiled[n]),
            fmt_bytes(compiled[n].temp_bytes()),
            fmt_diff(rel(grads[n])),
        ]
        for n in names
    ]
    json_rows = [
        result_row(title, n, "odegrad", gradient=times[n], compile_gradient=compiled[n])
        for n in names
    ]
    print(f"\n### {title}\n")
    print(
        markdown_table(
            ["adjoint", "gradient", "vs Auto", "compile", "temp memory", "rel. diff vs Discrete"],
            rows,
        )
    )
    return json_rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--json", help="also write the timings to this JSON file")
    a = ap.parse_args()
    warm_up_jax()
    rounds, number = (5, 3) if a.quick else (15, 5)
    names = list(ADJOINTS)
    jax.config.update("jax_enable_x64", True)
    rows = run(lotka_volterra(), names, rounds, number)
    jax.config.update("jax_enable_x64", False)
    rows += run(diffusion(32 if a.quick else a.n), names, rounds, max(1, number // 2))
    write_json(a.json, "adjoints", rows, "quick" if a.quick else f"n={a.n}")


if __name__ == "__main__":
    main()
