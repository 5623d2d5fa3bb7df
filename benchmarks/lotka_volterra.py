"""Lotka–Volterra (4 parameters), Tsit5 at rtol = atol = 1e-6: odegrad vs diffrax vs torchdiffeq.

``x' = a x - b x z``, ``z' = -c z + d x z`` with ``(a, b, c, d) = (1.5, 1, 3, 1)``,
``(x, z)(0) = (1, 1)``, ``t`` in ``[0, 10]``, the state saved at 20 times
``linspace(0, 10, 20)`` (``SaveAt(ts=...)``), loss = sum of squares of the saved states,
gradient with respect to the 4 parameters.

Contestants, timed interleaved in one run:

* odegrad, ``og.Tsit5()`` + ``og.Adaptive(rtol, atol)``, with the default adjoint ``og.Auto()``
  and with ``og.Discrete("all")`` and ``og.Discrete(8)`` (``--adjoints`` picks others);
* diffrax, ``Tsit5`` + ``PIDController(rtol, atol)``, the default
  ``RecursiveCheckpointAdjoint()``;
* torchdiffeq (when importable), ``dopri5`` (it has no Tsit5), through ``odeint`` (backprop
  through the solver) and ``odeint_adjoint`` (continuous adjoint).

Ratios are to odegrad with ``og.Auto()``. The losses and gradients of every contestant are
compared with odegrad's (relative difference; the solvers' own error at this tolerance is
~1e-6, so differences of that order are expected between libraries).

    python benchmarks/lotka_volterra.py            # full run
    python benchmarks/lotka_volterra.py --quick    # a smoke run, < 1 minute
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np

from _timing import (
    add_timing_args,
    compile_timed,
    environment,
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

PARAMS = (1.5, 1.0, 3.0, 1.0)
Y0 = (1.0, 1.0)

#: --adjoints names -> the odegrad adjoint they build (names absent from odegrad are skipped).
ADJOINTS = {
    "auto": ("Auto", ()),
    "discrete-all": ("Discrete", ("all",)),
    "discrete-8": ("Discrete", (8,)),
    "forward": ("Forward", ()),
    "backsolve": ("Backsolve", ()),
    "interpolating": ("Interpolating", ()),
    "quadrature": ("Quadrature", ()),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--t1", type=float, default=10.0, help="end time (t0 = 0)")
    p.add_argument("--saves", type=int, default=20, help="number of save times linspace(0, t1)")
    p.add_argument("--rtol", type=float, default=1e-6)
    p.add_argument("--atol", type=float, default=1e-6)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    p.add_argument(
        "--adjoints",
        default=None,
        help=f"comma-separated odegrad adjoints, from: {', '.join(ADJOINTS)}, or 'all' "
        "(default: auto,discrete-all,discrete-8; with --quick: auto)",
    )
    add_timing_args(p, rounds=20, number=5, budget=15.0)
    p.add_argument("--no-diffrax", action="store_true")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--json", default=None, help="write the key rows to this JSON file")
    p.add_argument(
        "--quick", action="store_true", help="5 rounds x 2 calls, 1 compile, odegrad Auto() only"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.number, args.compile_reps = 5, 2, 1
        args.budget = min(args.budget, 2.0)
    if args.adjoints is None:
        args.adjoints = "auto" if args.quick else "auto,discrete-all,discrete-8"
    names = list(ADJOINTS) if args.adjoints == "all" else args.adjoints.split(",")
    unknown = [n for n in names if n not in ADJOINTS]
    if unknown:
        p.error(f"--adjoints: unknown {unknown}; choose from {list(ADJOINTS)}")
    args.adjoints = [n.strip() for n in names]
    return args


# --- the contestants ------------------------------------------------------------------------


def lotka_volterra(t, y, p):
    x, z = y[0], y[1]
    a, b, c, d = p[0], p[1], p[2], p[3]
    return jnp.stack([a * x - b * x * z, -c * z + d * x * z])


class Setup:
    def __init__(self, args):
        self.args = args
        self.dtype = jnp.dtype(args.dtype)
        self.params = jnp.asarray(PARAMS, self.dtype)
        self.y0 = jnp.asarray(Y0, self.dtype)
        self.ts = jnp.linspace(0.0, args.t1, args.saves, dtype=self.dtype)


def make_odegrad(s: Setup, adjoint_name: str):
    """A fresh ``solve(params) -> Solution`` for odegrad with the named adjoint."""
    import odegrad as og

    cls_name, cls_args = ADJOINTS[adjoint_name]
    adjoint = getattr(og, cls_name)(*cls_args)
    a = s.args
    ts, y0 = s.ts, s.y0

    def rhs(t, y, p):
        return lotka_volterra(t, y, p)

    def solve(params):
        return og.solve(
            rhs,
            y0,
            (0.0, a.t1),
            params,
            solver=og.Tsit5(),
            step=og.Adaptive(rtol=a.rtol, atol=a.atol),
            saveat=og.SaveAt(ts=ts),
            adjoint=adjoint,
        )

    return solve, (lambda sol: sol.ys), (lambda sol: (sol.stats["steps"], sol.stats["accepted"]))


def make_diffrax(s: Setup):
    import diffrax as dfx

    a = s.args
    ts, y0 = s.ts, s.y0

    def rhs(t, y, p):
        return lotka_volterra(t, y, p)

    def solve(params):
        return dfx.diffeqsolve(
            dfx.ODETerm(rhs),
            dfx.Tsit5(),
            t0=0.0,
            t1=a.t1,
            dt0=None,
            y0=y0,
            args=params,
            saveat=dfx.SaveAt(ts=ts),
            stepsize_controller=dfx.PIDController(rtol=a.rtol, atol=a.atol),
        )

    def stats(sol):
        return sol.stats["num_steps"], sol.stats["num_accepted_steps"]

    return solve, (lambda sol: sol.ys), stats


def jax_contestants(s: Setup) -> dict:
    """name -> factory of a fresh ``(solve, ys_of, stats_of)``."""
    out = {}
    if importlib.util.find_spec("odegrad") is not None:
        import odegrad as og

        for name in s.args.adjoints:
            if hasattr(og, ADJOINTS[name][0]):
                cls_name, cls_args = ADJOINTS[name]
                label = f"odegrad {cls_name}({', '.join(map(repr, cls_args))})"
                out[label] = lambda name=name: make_odegrad(s, name)
    if not s.args.no_diffrax and importlib.util.find_spec("diffrax") is not None:
        out["diffrax RecursiveCheckpointAdjoint()"] = lambda: make_diffrax(s)
    return out


def torch_contestants(s: Setup) -> dict:
    """name -> ``(forward(), loss_and_grad(), nfe counter)`` for torchdiffeq, if importable."""
    if s.args.no_torch or importlib.util.find_spec("torchdiffeq") is None:
        return {}
    import torch
    from torchdiffeq import odeint, odeint_adjoint

    # One intra-op thread: the tensors have 2 entries, and idle OpenMP workers spin after each
    # call, stealing this 2-core machine's cycles from whatever is timed next.
    torch.set_num_threads(1)
    tdtype = torch.float64 if s.args.dtype == "float64" else torch.float32
    a = s.args

    class LV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.tensor(PARAMS, dtype=tdtype))
            self.nfe = 0

        def forward(self, t, y):
            self.nfe += 1
            x, z = y[0], y[1]
            pa, pb, pc, pd = self.p[0], self.p[1], self.p[2], self.p[3]
            return torch.stack([pa * x - pb * x * z, -pc * z + pd * x * z])

    y0 = torch.tensor(Y0, dtype=tdtype)
    ts = torch.tensor(np.asarray(s.ts), dtype=tdtype)
    out = {}
    for label, integrate in (
        ("torchdiffeq dopri5 odeint (backprop)", odeint),
        ("torchdiffeq dopri5 odeint_adjoint", odeint_adjoint),
    ):
        m = LV()

        def forward(m=m, integrate=integrate):
            with torch.no_grad():
                return integrate(m, y0, ts, rtol=a.rtol, atol=a.atol, method="dopri5")

        def loss_and_grad(m=m, integrate=integrate):
            ys = integrate(m, y0, ts, rtol=a.rtol, atol=a.atol, method="dopri5")
            loss = (ys**2).sum()
            (g,) = torch.autograd.grad(loss, (m.p,))
            return loss.detach(), g

        out[label] = (forward, loss_and_grad, m)
    return out


# --- the run --------------------------------------------------------------------------------


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def main(argv=None):
    args = parse_args(argv)
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    t_start = time.perf_counter()
    warm_up_jax()
    s = Setup(args)
    inputs = (s.params,)

    fwd, grad, results, steps, calls = {}, {}, {}, {}, {}
    for name, make in jax_contestants(s).items():

        def make_fwd(make=make):
            solve, ys_of, _ = make()
            return lambda p: ys_of(solve(p))

        def make_grad(make=make):
            solve, ys_of, _ = make()

            def loss(p):
                return jnp.sum(ys_of(solve(p)) ** 2)

            return jax.value_and_grad(loss)

        def make_stats(make=make):
            solve, _, stats_of = make()
            return lambda p: stats_of(solve(p))

        fwd[name] = compile_timed(make_fwd, inputs, args.compile_reps)
        grad[name] = compile_timed(make_grad, inputs, args.compile_reps)
        loss, g = jax.device_get(grad[name].fn(*inputs))
        results[name] = (float(loss), np.asarray(g))
        steps[name] = "/".join(str(int(x)) for x in jax.device_get(jax.jit(make_stats())(s.params)))
        calls[f"{name}|fwd"] = lambda c=fwd[name].call: c(*inputs)
        calls[f"{name}|grad"] = lambda c=grad[name].call: c(*inputs)

    torch_runs = torch_contestants(s)
    for name, (forward, loss_and_grad, module) in torch_runs.items():
        module.nfe = 0
        forward()
        steps[name] = f"{module.nfe} f evals"
        loss, g = loss_and_grad()
        results[name] = (float(loss), g.numpy())
        calls[f"{name}|fwd"] = forward
        calls[f"{name}|grad"] = loss_and_grad

    timing = interleaved_medians(calls, args.rounds, args.number, budget_s=args.budget)
    stat = (lambda t: t.median) if args.stat == "median" else (lambda t: t.best)
    names = list(results)
    ref = names[0]  # odegrad Auto() when present
    ref_fwd, ref_grad = stat(timing[f"{ref}|fwd"]), stat(timing[f"{ref}|grad"])
    ref_cf = fwd[ref].total_s if ref in fwd else None
    ref_cg = grad[ref].total_s if ref in grad else None

    rows = []
    for name in names:
        tf, tg = timing[f"{name}|fwd"], timing[f"{name}|grad"]
        cf = fwd[name].total_s if name in fwd else None
        cg = grad[name].total_s if name in grad else None
        rows.append(
            [
                name,
                fmt_timing(tf),
                fmt_ratio(stat(tf), ref_fwd),
                fmt_timing(tg),
                fmt_ratio(stat(tg), ref_grad),
                fmt_compile(fwd.get(name)),
                fmt_ratio(cf, ref_cf),
                fmt_compile(grad.get(name)),
                fmt_ratio(cg, ref_cg),
                steps[name],
                f"{results[name][0]:.10g}",
                fmt_diff(rel(results[name][0], results[ref][0])),
                fmt_diff(rel(results[name][1], results[ref][1])),
            ]
        )
    headers = [
        "method",
        f"forward {args.stat} (min)",
        "/ ref",
        f"loss+grad {args.stat} (min)",
        "/ ref",
        "compile fwd s (lower)",
        "/ ref",
        "compile grad s (lower)",
        "/ ref",
        "steps (total/accepted)",
        "loss",
        "rel Δ loss",
        "rel Δ grad",
    ]
    print("## Lotka–Volterra, 4 parameters: odegrad vs diffrax vs torchdiffeq\n")
    print(environment())
    print(
        f"t in [0, {args.t1}], {args.saves} saves, rtol={args.rtol}, atol={args.atol}, "
        f"{args.dtype}; {args.rounds} interleaved rounds x {args.number} calls, time per call; "
        f"ratios use the {args.stat} and are to `{ref}` (ref); compile = trace+lower + XLA "
        f"compile, cold (of which trace+lower), median of {args.compile_reps}; the gradient "
        "call returns the loss too\n"
    )
    print(markdown_table(headers, rows))
    print(f"\nrel Δ: against `{ref}` (|Δ| / |ref|, 2-norm over the 4 parameters for the gradient).")
    if importlib.util.find_spec("odegrad") is not None:
        import odegrad as og

        text = og.explain_adjoint(
            lotka_volterra,
            s.y0,
            (0.0, args.t1),
            s.params,
            solver=og.Tsit5(),
            step=og.Adaptive(rtol=args.rtol, atol=args.atol),
            saveat=og.SaveAt(ts=s.ts),
        )
        print(f"og.explain_adjoint: {text}")
    reduced = [n for n, t in timing.items() if t.reduced]
    if reduced:
        print(
            "`*`: too slow for the timing budget, reduced schedule: "
            + ", ".join(f"{n} ({len(timing[n].samples)} sample(s))" for n in reduced)
        )
    problem = f"Lotka-Volterra Tsit5 rtol={args.rtol:g}"
    write_json(
        args.json,
        "lotka_volterra",
        [
            result_row(
                problem,
                name,
                name.split()[0],
                timing[f"{name}|fwd"],
                timing[f"{name}|grad"],
                fwd.get(name),
                grad.get(name),
            )
            for name in names
        ],
        settings=f"t in [0, {args.t1}], {args.saves} saves, rtol={args.rtol}, atol={args.atol}, "
        f"{args.dtype}; the gradient call returns the loss too",
    )
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f} s; {load_average()}")


if __name__ == "__main__":
    main()
