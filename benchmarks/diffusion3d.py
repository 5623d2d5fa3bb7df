"""Seed 001's 3-d heat diffusion: memory throughput (T_eff) of the right-hand side, the forward
solve and its gradient, against a measured memory copy — ParallelStencil's metric.

``T_eff = A_eff / t``, with ``A_eff`` = 3 arrays (read T, read Ci, write dT/dt) of ``n^3`` values
per right-hand-side evaluation, against ``T_copy`` = 2 arrays per copy of one array. Also: ROCK2
vs Tsit5 right-hand-side evaluations over a long horizon, and diffrax (Tsit5) side by side.

    python benchmarks/diffusion3d.py [--quick] [--sizes 32 64 96 128] [--dtype float64|float32]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import odegrad as og
from _timing import (
    fmt_ratio,
    fmt_time,
    interleaved_medians,
    markdown_table,
    result_row,
    warm_up_jax,
    write_json,
)
from odegrad.problems import diffusion3d


def gbs(nbytes, seconds):
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def run_size(n, dtype, rounds, args):
    p = diffusion3d(n, dtype=dtype)
    item = jnp.dtype(dtype).itemsize
    field = n**3 * item
    solver = og.ROCK2(spectral_radius=p.spectral_radius)
    step = og.Adaptive(rtol=args.tol, atol=args.tol)
    pars = (p.lam, p.Ci)

    copy = jax.jit(lambda x: x * 1.0001).lower(p.T0).compile()  # read one array, write one
    rhs = jax.jit(lambda T, a: p.rhs(0.0, T, a)).lower(p.T0, pars).compile()

    def forward(T0, a):
        sol = og.solve(p.rhs, T0, (0.0, p.t1), a, solver=solver, step=step)
        return sol.ys[-1], sol.stats["rhs_evals"]

    def loss(T0, a):
        return jnp.sum(forward(T0, a)[0] ** 2)

    t0 = time.perf_counter()
    fwd = jax.jit(forward).lower(p.T0, pars).compile()
    t1 = time.perf_counter()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(p.T0, pars).compile()
    compile_grad_s = time.perf_counter() - t1
    compile_s = {"forward": t1 - t0}
    evals = int(fwd(p.T0, pars)[1])
    fns = {
        "copy": lambda: copy(p.T0),
        "rhs": lambda: rhs(p.T0, pars),
        "forward": lambda: fwd(p.T0, pars),
        "gradient": lambda: grad(p.T0, pars),
    }
    if args.diffrax:
        import diffrax as dfx

        term = dfx.ODETerm(p.rhs)
        t0 = time.perf_counter()
        dfx_fwd = (
            jax.jit(
                lambda T0, a: (
                    dfx.diffeqsolve(
                        term,
                        dfx.Tsit5(),
                        0.0,
                        p.t1,
                        None,
                        T0,
                        a,
                        stepsize_controller=dfx.PIDController(args.tol, args.tol),
                        max_steps=100_000,
                    ).ys
                )
            )
            .lower(p.T0, pars)
            .compile()
        )
        compile_s["diffrax"] = time.perf_counter() - t0
        fns["diffrax Tsit5 forward"] = lambda: dfx_fwd(p.T0, pars)
    t = interleaved_medians(fns, rounds, 1, budget_s=60)
    t_copy = t["copy"].best
    rows = [
        ["memory copy", fmt_time(t_copy), gbs(2 * field, t_copy), "1.00"],
        [
            "rhs (3 arrays)",
            fmt_time(t["rhs"].best),
            gbs(3 * field, t["rhs"].best),
            f"{(3 * field / t['rhs'].best) / (2 * field / t_copy):.2f}",
        ],
        [
            f"ROCK2 forward ({evals} rhs evals)",
            fmt_time(t["forward"].best),
            gbs(3 * field * evals, t["forward"].best),
            f"{(3 * field * evals / t['forward'].best) / (2 * field / t_copy):.2f}",
        ],
        [
            "gradient (Auto)",
            fmt_time(t["gradient"].best),
            fmt_ratio(t["gradient"].best, t["forward"].best) + " of forward",
            "",
        ],
        [
            "gradient, medians",
            f"{fmt_time(t['gradient'].median)} / {fmt_time(t['forward'].median)}",
            fmt_ratio(t["gradient"].median, t["forward"].median) + " of forward",
            "",
        ],
    ]
    if "diffrax Tsit5 forward" in t:
        rows.append(["diffrax Tsit5 forward", fmt_time(t["diffrax Tsit5 forward"].best), "", ""])
    print(f"\n### {n}^3, {jnp.dtype(dtype).name}, {args.tol:g} (best of {rounds})\n")
    print(markdown_table(["what", "time", "T_eff", "T_eff / T_copy"], rows))
    problem = f"diffusion3d {n}^3 ROCK2"
    teff = (3 * field * evals / t["forward"].best) / (2 * field / t_copy)
    out = [
        result_row(
            problem,
            "odegrad ROCK2 Auto()",
            "odegrad",
            t["forward"].best,
            t["gradient"].best,
            compile_s["forward"],
            compile_grad_s,
        )
    ]
    if "diffrax Tsit5 forward" in t:
        out.append(
            result_row(
                problem,
                "diffrax Tsit5 (forward only)",
                "diffrax",
                t["diffrax Tsit5 forward"].best,
                None,
                compile_s["diffrax"],
            )
        )
    note = (
        f"{problem}: ROCK2 forward T_eff / T_copy = {teff:.2f} ({evals} rhs evals, best of "
        f"{rounds}); diffrax runs Tsit5, forward only"
    )
    return out, note


def evals_comparison(dtype, args):
    """ROCK2 vs Tsit5 over 2000 explicit-stable steps' worth of time."""
    p = diffusion3d(24, dtype=dtype, steps=2000)
    rows = []
    for name, solver in [
        ("Tsit5", og.Tsit5()),
        ("ROCK2", og.ROCK2(p.spectral_radius)),
        ("ROCK2 (power iteration)", og.ROCK2()),
    ]:
        t0 = time.perf_counter()
        sol = og.solve(
            p.rhs,
            p.T0,
            (0.0, p.t1),
            (p.lam, p.Ci),
            solver=solver,
            step=og.Adaptive(args.tol, args.tol),
            max_steps=100_000,
        )
        rows.append(
            [
                name,
                int(sol.stats["steps"]),
                int(sol.stats["rhs_evals"]),
                f"{time.perf_counter() - t0:.2f} s",
            ]
        )
    print("\n### rhs evaluations over 2000 explicit-stable steps (24^3)\n")
    print(markdown_table(["solver", "steps", "rhs evals", "wall (incl. compile)"], rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 96, 128])
    # seed 001's ParallelStencil code runs Float64
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--no-diffrax", dest="diffrax", action="store_false")
    ap.add_argument("--json", default=None, help="write the key rows (largest size) to this file")
    args = ap.parse_args()
    warm_up_jax()
    dtype = jnp.dtype(args.dtype)
    if dtype == jnp.float64:
        jax.config.update("jax_enable_x64", True)
    sizes = [32, 48] if args.quick else args.sizes
    results = [run_size(n, dtype, 3 if args.quick else 5, args) for n in sizes]
    evals_comparison(dtype, args)
    rows, note = results[-1]  # the largest size
    write_json(
        args.json,
        "diffusion3d",
        rows,
        settings=f"{dtype.name}, rtol=atol={args.tol:g}; times are the best of the rounds",
        notes=[note],
    )


if __name__ == "__main__":
    main()
