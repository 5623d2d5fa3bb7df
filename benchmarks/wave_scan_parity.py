"""Seed 004: does odegrad match a hand-written ``lax.scan`` (forward, gradient, compile time)?

The user's problem: two N x N fields with ``du/dt = -(v**2)``, ``dv/dt = -irfft(sin(rfft(u)))``,
semi-implicit Euler (``u`` first, then ``v`` from the new ``u``), one sample of ``u`` saved after
every step, loss ``mean(samples**2)``, gradient with respect to both initial fields.

Contestants, all compiled ahead of time on ``(fields, t)`` and timed interleaved in one run:

* ``scan + checkpoint`` / ``scan``: the seed's hand-written ``lax.scan`` (with and without
  ``jax.checkpoint`` on the body). It steps over ``(t[k], t[k+1])`` with ``dt = t[k+1] - t[k]``,
  exactly the arithmetic of ``og.StepTo(t)``, so its values are the reference (max |diff| 0).
* ``odegrad StepTo(t)``: ``og.solve(..., step=og.StepTo(t), adjoint=og.Discrete("all"))``.
* ``odegrad Fixed(dt), traced span``: ``t_span=(t[0], t[-1])``, ``og.Fixed(t[1] - t[0])`` with
  ``t`` a jit argument, as the seed's diffrax call is written (the step count is a run-time value).
* ``odegrad Fixed(dt), traced span, Auto()``: the same with the default adjoint, which keeps
  checkpoints there (it cannot know that the run fills the ``max_steps`` rows).
* ``odegrad Fixed(dt), static span``: ``t_span`` and ``dt`` Python floats (step count static).
* ``diffrax StepTo``: the seed's diffrax call with ``StepTo(t)`` and
  ``RecursiveCheckpointAdjoint(checkpoints=steps)``.

Ratios are to the faster of the two scans for that column. ``*`` marks a contestant so slow that
it was timed on a reduced schedule (see ``--budget``).

    python benchmarks/wave_scan_parity.py            # N=64, 2000 steps, float32
    python benchmarks/wave_scan_parity.py --quick    # a smoke run, < 1 minute
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from _timing import (
    add_timing_args,
    compile_timed,
    environment,
    fmt_bytes,
    fmt_compile,
    fmt_diff,
    fmt_ratio,
    fmt_timing,
    interleaved_medians,
    load_average,
    markdown_table,
    result_row,
    warm_up_jax,
    write_json,
)

SCANS = ("scan + checkpoint", "scan")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=64, help="grid size N (fields are N x N)")
    p.add_argument("--steps", type=int, default=2000, help="number of time steps")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    add_timing_args(p, rounds=15, number=3, budget=20.0)
    p.add_argument("--no-diffrax", action="store_true", help="skip the diffrax contestant")
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated substrings: keep the scans and the contestants whose name matches",
    )
    p.add_argument("--dump-hlo", default=None, help="directory to write each gradient's HLO to")
    p.add_argument(
        "--progress",
        action="store_true",
        help="also time `odegrad StepTo(t)` with og.solve(..., progress=True) (its overhead)",
    )
    p.add_argument("--json", default=None, help="write the key rows to this JSON file")
    p.add_argument(
        "--quick", action="store_true", help="N=32, 200 steps, 5 rounds x 2 calls, 1 compile"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.steps, args.rounds, args.number, args.compile_reps = 32, 200, 5, 2, 1
        args.budget = min(args.budget, 5.0)
    return args


# --- the problem ----------------------------------------------------------------------------


class Wave:
    """The seed's problem at size ``n`` with ``steps`` steps on ``t = linspace(0, 1, steps+1)``."""

    def __init__(self, n: int, steps: int, dtype):
        self.n, self.steps, self.dtype = n, steps, dtype
        self.t = jnp.linspace(0.0, 1.0, steps + 1, dtype=dtype)
        c = min(32, n // 2)  # the seed's impulse at [32, 32]
        u0 = jnp.zeros((n, n), dtype)
        v0 = jnp.zeros((n, n), dtype).at[c, c].set(1.0)
        self.fields = (u0, v0)
        self.idx = 64 if n > 64 else n // 4  # the seed samples [64, 64] at N=256

    def rhs(self):
        """Fresh ``(du, dv, sample)`` closures (so that no trace is reused between compiles)."""
        n, idx = self.n, self.idx

        def du(t, v, args):
            return -(v**2)

        def dv(t, u, args):
            return -jnp.fft.irfft(jnp.sin(jnp.fft.rfft(u)), n=n)

        def sample(t, y, args):
            return y[0][idx, idx]

        return du, dv, sample


def make_scan(p: Wave, checkpoint: bool):
    du, dv, sample = p.rhs()

    def step(carry, x):
        u, v = carry
        t0, t1 = x
        dt = t1 - t0
        u = u + du(t0, v, None) * dt
        v = v + dv(t1, u, None) * dt
        return (u, v), sample(t1, (u, v), None)

    if checkpoint:
        step = jax.checkpoint(step)

    def integrate(fields, t):
        return jax.lax.scan(step, fields, (t[:-1], t[1:]))[1]

    return integrate


def make_odegrad(p: Wave, step_kind: str, progress: bool = False, auto: bool = False):
    import odegrad as og

    du, dv, sample = p.rhs()
    t_end = float(p.t[-1])

    def integrate(fields, t):
        if step_kind == "stepto":
            span, step = (t[0], t[-1]), og.StepTo(t)
        elif step_kind == "fixed-traced":
            span, step = (t[0], t[-1]), og.Fixed(t[1] - t[0])
        else:  # "fixed-static"
            span, step = (0.0, t_end), og.Fixed(t_end / p.steps)
        sol = og.solve(
            (du, dv),
            fields,
            span,
            solver=og.SemiImplicitEuler(),
            step=step,
            saveat=og.SaveAt(steps=True, fn=sample),
            adjoint=og.Auto() if auto else og.Discrete("all"),
            max_steps=p.steps,
            **({"progress": True} if progress else {}),
        )
        return sol.ys

    return integrate


def make_diffrax(p: Wave):
    import diffrax as dfx

    du, dv, sample = p.rhs()

    def integrate(fields, t):
        return dfx.diffeqsolve(
            (dfx.ODETerm(du), dfx.ODETerm(dv)),
            solver=dfx.SemiImplicitEuler(),
            t0=t[0],
            t1=t[-1],
            dt0=None,
            y0=fields,
            args=None,
            saveat=dfx.SaveAt(steps=True, fn=sample),
            stepsize_controller=dfx.StepTo(ts=t),
            adjoint=dfx.RecursiveCheckpointAdjoint(checkpoints=p.steps),
            max_steps=p.steps,
        ).ys

    return integrate


def gradient_of(integrate):
    return jax.grad(lambda fields, t: jnp.mean(integrate(fields, t) ** 2))


def contestants(p: Wave, args) -> dict:
    """name -> factory of a fresh ``integrate(fields, t) -> samples``."""
    out = {
        "scan + checkpoint": lambda: make_scan(p, checkpoint=True),
        "scan": lambda: make_scan(p, checkpoint=False),
    }
    if importlib.util.find_spec("odegrad") is not None:
        out["odegrad StepTo(t)"] = lambda: make_odegrad(p, "stepto")
        out["odegrad Fixed(dt), traced span"] = lambda: make_odegrad(p, "fixed-traced")
        out["odegrad Fixed(dt), traced span, Auto()"] = lambda: make_odegrad(
            p, "fixed-traced", auto=True
        )
        out["odegrad Fixed(dt), static span"] = lambda: make_odegrad(p, "fixed-static")
        if args.progress:
            out["odegrad StepTo(t), progress=True"] = lambda: make_odegrad(p, "stepto", True)
    if not args.no_diffrax and importlib.util.find_spec("diffrax") is not None:
        out["diffrax StepTo"] = lambda: make_diffrax(p)
    if args.only:
        keys = [k.strip().lower() for k in args.only.split(",")]
        out = {n: f for n, f in out.items() if n in SCANS or any(k in n.lower() for k in keys)}
    return out


# --- the run --------------------------------------------------------------------------------


def max_abs_diff(a, b) -> float:
    diffs = [
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    ]
    return max(diffs)


def main(argv=None):
    args = parse_args(argv)
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    t_start = time.perf_counter()
    warm_up_jax()
    p = Wave(args.n, args.steps, jnp.dtype(args.dtype))
    inputs = (p.fields, p.t)
    # The seed's sample is identically zero (the impulse's row never reaches the sampled row:
    # the FFT acts along the last axis only), so agreement is also checked on random fields.
    keys = jax.random.split(jax.random.key(0))
    check = (
        tuple(0.1 * jax.random.normal(k, (p.n, p.n), p.dtype) for k in keys),
        p.t,
    )
    makers = contestants(p, args)

    fwd, grad, values, grads = {}, {}, {}, {}
    for name, make in makers.items():
        fwd[name] = compile_timed(make, inputs, args.compile_reps)
        grad[name] = compile_timed(lambda make=make: gradient_of(make()), inputs, args.compile_reps)
        values[name] = [jax.device_get(fwd[name].fn(*x)) for x in (inputs, check)]
        grads[name] = jax.device_get(grad[name].fn(*check))  # (the seed's is all zero too)
        if args.dump_hlo:
            d = pathlib.Path(args.dump_hlo)
            d.mkdir(parents=True, exist_ok=True)
            slug = "".join(c if c.isalnum() else "_" for c in name).strip("_")
            (d / f"{slug}.grad.hlo.txt").write_text(grad[name].fn.as_text())
            (d / f"{slug}.fwd.hlo.txt").write_text(fwd[name].fn.as_text())

    calls = {}
    for name in makers:
        calls[f"{name}|fwd"] = lambda c=fwd[name].call: c(*inputs)
        calls[f"{name}|grad"] = lambda c=grad[name].call: c(*inputs)
    timing = interleaved_medians(calls, args.rounds, args.number, budget_s=args.budget)
    stat = (lambda t: t.median) if args.stat == "median" else (lambda t: t.best)

    def best_scan(metric):
        return min(metric(s) for s in SCANS if s in makers)

    ref_fwd = best_scan(lambda s: stat(timing[f"{s}|fwd"]))
    ref_grad = best_scan(lambda s: stat(timing[f"{s}|grad"]))
    ref_cf = best_scan(lambda s: fwd[s].total_s)
    ref_cg = best_scan(lambda s: grad[s].total_s)

    rows = []
    for name in makers:
        tf, tg = timing[f"{name}|fwd"], timing[f"{name}|grad"]
        rows.append(
            [
                name,
                fmt_timing(tf),
                fmt_ratio(stat(tf), ref_fwd),
                fmt_timing(tg),
                fmt_ratio(stat(tg), ref_grad),
                fmt_ratio(stat(tg), stat(tf)),
                fmt_compile(fwd[name]),
                fmt_ratio(fwd[name].total_s, ref_cf),
                fmt_compile(grad[name]),
                fmt_ratio(grad[name].total_s, ref_cg),
                fmt_bytes(grad[name].temp_bytes()),
                fmt_diff(max_abs_diff(values[name][1], values["scan"][1])),
                fmt_diff(max_abs_diff(grads[name], grads["scan"])),
            ]
        )
    headers = [
        "method",
        f"forward {args.stat} (min)",
        "fwd / scan",
        f"gradient {args.stat} (min)",
        "grad / scan",
        "grad / fwd",
        "compile fwd s (lower)",
        "/ scan",
        "compile grad s (lower)",
        "/ scan",
        "grad temp",
        "max |Δ| values",
        "max |Δ| grad",
    ]
    print("## Seed 004: wave fields, semi-implicit Euler: lax.scan vs odegrad vs diffrax\n")
    print(environment())
    print(
        f"N={p.n}, steps={p.steps}, dtype={args.dtype}, sample u[{p.idx},{p.idx}]; "
        f"{args.rounds} interleaved rounds x {args.number} calls, time per call; ratios use the "
        f"{args.stat} and are to the faster scan; compile = trace+lower + XLA compile, cold "
        f"(of which trace+lower), median of {args.compile_reps}\n"
    )
    print(markdown_table(headers, rows))
    seed_zero = all(float(np.max(np.abs(v[0]))) == 0.0 for v in values.values())
    print(
        "\nmax |Δ|: against `scan`, on random initial fields 0.1*N(0,1) (|values| <= "
        f"{float(np.max(np.abs(values['scan'][1]))):.3g}, |grad| <= "
        f"{max(float(np.max(np.abs(g))) for g in grads['scan']):.3g})"
        + (
            "; on the seed's fields every contestant returns the seed's all-zero samples."
            if seed_zero
            else "; on the seed's fields: "
            + ", ".join(f"{n} {max_abs_diff(values[n][0], values['scan'][0]):.2e}" for n in makers)
        )
    )
    print("grad temp: XLA's temporary buffers for the gradient (memory_analysis()).")
    reduced = [n for n, t in timing.items() if t.reduced]
    if reduced:
        print(
            "`*`: too slow for the timing budget, reduced schedule: "
            + ", ".join(f"{n} ({len(timing[n].samples)} sample(s))" for n in reduced)
        )
    if "odegrad StepTo(t), progress=True" in makers:
        on, off = "odegrad StepTo(t), progress=True", "odegrad StepTo(t)"
        print(
            "progress=True overhead (vs `odegrad StepTo(t)`, interleaved medians): forward "
            f"{stat(timing[f'{on}|fwd']) / stat(timing[f'{off}|fwd']) - 1:+.1%}, gradient "
            f"{stat(timing[f'{on}|grad']) / stat(timing[f'{off}|grad']) - 1:+.1%}"
        )
    library = {"scan": "lax.scan", "odeg": "odegrad", "diff": "diffrax"}
    problem = f"seed 004 wave N={p.n}, {p.steps} steps"
    write_json(
        args.json,
        "wave_scan_parity",
        [
            result_row(
                problem,
                name,
                library[name[:4]],
                timing[f"{name}|fwd"],
                timing[f"{name}|grad"],
                fwd[name],
                grad[name],
            )
            for name in makers
        ],
        settings=f"N={p.n}, steps={p.steps}, {args.dtype}, SemiImplicitEuler",
    )
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f} s; {load_average()}")


if __name__ == "__main__":
    main()
