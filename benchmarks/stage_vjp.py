"""Where a stencil gradient's time goes: one ROCK stage of seed 001's heat diffusion and its
VJPs with different cotangents, jitted on their own; with ``--grad``, the jitted gradient of
``sum(T(t1)^2)`` over 4 fixed ``og.ROCK2()`` steps with ``og.Auto()``, against the forward solve,
with the steps as a ``lax.scan`` and as straight-line code (``Tuning.unrolled_steps``).

    python benchmarks/stage_vjp.py 160 float64
    python benchmarks/stage_vjp.py 160 float32 --grad
    python benchmarks/stage_vjp.py 160 float64 --grad --malloc reuse   # freed memory reused
    python benchmarks/stage_vjp.py 160 float64 --rhs seed                # the seed's form only

The stage is ``u = c dt f(u1) + 1.3 u1 - 0.3 u2`` with ``f`` the seed's right-hand side (as
written there, ``set_inner`` of slices, and as ``lam * Ci * laplacian(T, h, pad=True)``), whose
parameters are the scalar ``lam`` and the field ``Ci``; each VJP is taken with respect to ``u1``
and the listed parameters. Best of ``--rounds`` interleaved rounds (``_timing``). See
docs/stencil.md.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import odegrad as og
from _timing import add_malloc_arg, apply_malloc, interleaved_medians
from odegrad._tuning import tuned
from odegrad.problems import diffusion3d


def best_of(calls: dict, rounds: int) -> dict:
    """Seconds per call of each, the fastest of ``rounds`` interleaved rounds."""
    return {name: t.best for name, t in interleaved_medians(calls, rounds, 1).items()}


def stage_rows(p, rounds: int, forms: dict) -> None:
    """One stage and its VJPs for each rhs of ``forms`` (name -> rhs), interleaved."""
    u1, u2, g = p.T0, p.T0 * 0.9, p.T0 * 0.5
    dt = jnp.asarray(1e-3, p.T0.dtype)
    inputs = (u1, u2, dt, p.lam, p.Ci)
    calls = {}
    for form, rhs in forms.items():

        def stage(u1, u2, dt, lam, Ci, rhs=rhs):
            return dt * 0.01 * rhs(0.0, u1, (lam, Ci)) + 1.3 * u1 - 0.3 * u2

        def vjp(argnums, stage=stage):
            def run(u1, u2, dt, lam, Ci, g):
                args = (u1, u2, dt, lam, Ci)
                pull = jax.vjp(
                    lambda *d: stage(*_put(args, argnums, d)), *(args[i] for i in argnums)
                )[1]
                return pull(g)

            return jax.jit(run).lower(*inputs, g).compile()

        fwd = jax.jit(stage).lower(*inputs).compile()
        calls[f"{form}: forward stage"] = lambda fwd=fwd: fwd(*inputs)
        for label, argnums in [
            ("u1, dt, lam, Ci", (0, 2, 3, 4)),
            ("u1, lam, Ci", (0, 3, 4)),
            ("u1, dt, Ci", (0, 2, 4)),
            ("u1, Ci", (0, 4)),
        ]:
            c = vjp(argnums)
            calls[f"{form}: VJP in {label}"] = lambda c=c: c(*inputs, g)
    for name, t in best_of(calls, rounds).items():
        print(f"| {name} | {t * 1e3:.1f} ms |")


def _put(args, argnums, values):
    out = list(args)
    for i, v in zip(argnums, values, strict=True):
        out[i] = v
    return tuple(out)


def gradient_rows(p, rounds: int, forms: dict) -> None:
    """The solve's forward and gradient, as a scan and as straight-line steps, in one process,
    for each rhs of ``forms``."""
    pars = (p.lam, p.Ci)
    fixed = og.Fixed(p.t1 / 4)
    calls, temps = {}, {}
    variants = [
        (f"{form}, {name}", rhs, tune)
        for form, rhs in forms.items()
        for name, tune in (("scan", dict(unrolled_steps=0)), ("straight-line", {}))
    ]
    for name, rhs, tune in variants:
        # a fresh function per variant: jax.jit would reuse the first one's trace
        def final(T0, a, rhs=rhs):
            sol = og.solve(rhs, T0, (0.0, p.t1), a, solver=og.ROCK2(), step=fixed)
            return sol.ys[-1]

        def loss(T0, a, final=final):
            return jnp.sum(final(T0, a) ** 2)

        with tuned(**{"unrolled_steps": 4, **tune}, unrolled_state_bytes=0):
            fwd = jax.jit(final).lower(p.T0, pars).compile()
            grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(p.T0, pars).compile()
        calls[f"{name} forward"] = lambda fwd=fwd: fwd(p.T0, pars)
        calls[f"{name} gradient"] = lambda grad=grad: grad(p.T0, pars)
        temps[name] = grad.memory_analysis().temp_size_in_bytes / 2**20
    best = best_of(calls, rounds)
    print("| 4 ROCK2 steps | forward | gradient | / forward | temporary memory |")
    print("|---|--:|--:|--:|--:|")
    for name, temp in temps.items():
        tf, tg = best[f"{name} forward"], best[f"{name} gradient"]
        print(
            f"| {name} | {tf * 1e3:.0f} ms | {tg * 1e3:.0f} ms | {tg / tf:.2f}x | {temp:.0f} MiB |"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, nargs="?", default=160)
    ap.add_argument("dtype", nargs="?", default="float64")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--grad", action="store_true", help="also time the whole gradient")
    ap.add_argument(
        "--rhs",
        nargs="+",
        default=["seed", "padded"],
        choices=["seed", "padded"],
        help="the seed's set_inner form and/or lam * Ci * laplacian(T, h, pad=True)",
    )
    add_malloc_arg(ap)
    args = ap.parse_args()
    apply_malloc(args.malloc)
    jax.config.update("jax_enable_x64", True)
    p = diffusion3d(args.n, dtype=jnp.dtype(args.dtype))
    print(f"{args.n}^3 {args.dtype}\n\n| | best |\n|---|--:|")
    forms = {name: {"seed": p.rhs, "padded": p.rhs_padded}[name] for name in args.rhs}
    stage_rows(p, args.rounds, forms)
    if args.grad:
        print()
        gradient_rows(p, max(3, args.rounds // 3), forms)


if __name__ == "__main__":
    main()
