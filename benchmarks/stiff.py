"""Stiff problems: odegrad's implicit solvers against scipy's Radau and BDF and diffrax's Kvaerno5.

Three problems, float64, one markdown table:

* Robertson's chemical kinetics, ``t`` in ``[0, 100]``, ``k = (0.04, 3e7, 1e4)``,
  rtol = 1e-8, atol = 1e-10;
* Van der Pol, ``mu = 1000``, ``(x, x')(0) = (2, 0)``, ``t`` in ``[0, 500]``, rtol = 1e-8,
  atol = 1e-10;
* the 2-d Brusselator on a 32x32 periodic grid (2048 unknowns; the same as
  ``examples/brusselator2d.py``), ``t`` in ``[0, 10]`` (``--quick``: ``[0, 1]``),
  rtol = 1e-6, atol = 1e-8.

Each is saved at 11 equally spaced times; the loss is a weighted sum of the saved states
(Robertson: weights ``(1, 1e4, 1)``, Van der Pol: ``(1, 1e3)``, Brusselator: the mean of the
saved fields), its gradient is taken with respect to the initial state and the parameters.

Contestants, timed interleaved in one run (``_timing.interleaved_medians``):

* odegrad ``og.Kvaerno5()`` and ``og.Rodas5P()`` + ``og.Adaptive(rtol, atol)``, default adjoint
  ``og.Auto()``; on the Brusselator ``linear_solver="gmres"`` (the ``"auto"`` choice for 2048
  unknowns) with the example's preconditioner (the diffusion inverted by FFT, the pointwise
  reaction Jacobian by 2x2 blocks);
* scipy ``solve_ivp`` ``Radau`` and ``BDF`` with the exact Jacobian as ``jac`` (dense for the
  small problems, ``scipy.sparse`` for the Brusselator: the Jacobian information odegrad has
  through exact Jacobian-vector products), and ``BDF`` with ``jac_sparsity`` (finite
  differences on the sparsity pattern) on the Brusselator; forward only;
* diffrax ``Kvaerno5`` + ``PIDController(rtol, atol)``, forward and gradient with its default
  ``RecursiveCheckpointAdjoint()``. On the Brusselator diffrax factorises the dense 2048x2048
  Jacobian in every step (minutes per call), so it, and scipy's Radau (a complex sparse LU per
  step, about a minute per call), run there only with ``--heavy`` (one sample each).

Ratios are to odegrad Kvaerno5 on the same problem (``x``: that many times its time).

A second table (``hybrid``) measures Kvaerno5's dense Jacobian reuse (``jacobian_reuse_rate``)
on a stiff hybrid neural ODE with 200 states, where a Jacobian costs 200 JVPs of a 256-wide
layer: steps, Jacobians built, f evaluations, forward and gradient time per setting.

    python benchmarks/stiff.py            # full run (several minutes)
    python benchmarks/stiff.py --quick    # a smoke run, < 2 minutes
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

# One BLAS thread for scipy: its LUs are 2x2..3x3 dense or sparse (SuperLU, single-threaded),
# and idle OpenBLAS workers spin after each call, stealing this 2-core machine's cycles from
# whatever is timed next (the same precaution as torch's threads in lotka_volterra.py).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _timing import (  # noqa: E402
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBLEMS = ("robertson", "vdp", "brusselator", "hybrid")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--problems", default=",".join(PROBLEMS), help=f"comma-separated, from {PROBLEMS}"
    )
    p.add_argument("--bruss-t1", type=float, default=None, help="Brusselator end time")
    add_timing_args(p, rounds=10, number=3, budget=20.0)
    p.add_argument("--no-diffrax", action="store_true")
    p.add_argument("--no-scipy", action="store_true")
    p.add_argument(
        "--heavy",
        action="store_true",
        help="also diffrax Kvaerno5 and scipy Radau on the Brusselator (minutes per call)",
    )
    p.add_argument("--json", default=None, help="write the key rows to this JSON file")
    p.add_argument(
        "--quick",
        action="store_true",
        help="3 rounds x 1 call, 1 compile, Brusselator on [0, 1]",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.number, args.compile_reps = 3, 1, 1
        args.budget = min(args.budget, 3.0)
    if args.bruss_t1 is None:
        args.bruss_t1 = 1.0 if args.quick else 10.0
    args.problems = [n.strip() for n in args.problems.split(",")]
    unknown = [n for n in args.problems if n not in PROBLEMS]
    if unknown:
        p.error(f"--problems: unknown {unknown}; choose from {PROBLEMS}")
    return args


# --- the problems ------------------------------------------------------------------------------


class Problem:
    """``rhs(t, y, p)`` in JAX and NumPy (+ the exact Jacobian for scipy), initial state,
    parameters, span, tolerances and loss weights."""

    def __init__(self, name, title, y0, params, t1, rtol, atol, weights, notes=""):
        self.name, self.title = name, title
        self.y0, self.params = y0, params
        self.t1, self.rtol, self.atol = t1, rtol, atol
        self.ts = np.linspace(0.0, t1, 11)
        self.weights = weights  # per state entry (broadcast over the saves)
        self.notes = notes

    # pytree <-> flat for scipy
    def flat(self, y):
        return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(y)])


def robertson():
    def rhs(t, y, k, m=jnp):
        return m.stack(
            [
                -k[0] * y[0] + k[2] * y[1] * y[2],
                k[0] * y[0] - k[2] * y[1] * y[2] - k[1] * y[1] ** 2,
                k[1] * y[1] ** 2,
            ]
        )

    def jac(t, y, k):
        return np.array(
            [
                [-k[0], k[2] * y[2], k[2] * y[1]],
                [k[0], -k[2] * y[2] - 2 * k[1] * y[1], -k[2] * y[1]],
                [0.0, 2 * k[1] * y[1], 0.0],
            ]
        )

    p = Problem(
        "robertson",
        "Robertson, t in [0, 100]",
        jnp.asarray([1.0, 0.0, 0.0]),
        jnp.asarray([0.04, 3e7, 1e4]),
        100.0,
        1e-8,
        1e-10,
        np.array([1.0, 1e4, 1.0]),
    )
    p.rhs, p.np_rhs, p.np_jac = rhs, (lambda t, y, k: rhs(t, y, k, np)), jac
    return p


def van_der_pol():
    def rhs(t, y, p, m=jnp):
        return m.stack([y[1], p[0] * (1.0 - y[0] ** 2) * y[1] - y[0]])

    def jac(t, y, p):
        return np.array([[0.0, 1.0], [-2 * p[0] * y[0] * y[1] - 1.0, p[0] * (1.0 - y[0] ** 2)]])

    p = Problem(
        "vdp",
        "Van der Pol mu=1000, t in [0, 500]",
        jnp.asarray([2.0, 0.0]),
        jnp.asarray([1000.0]),
        500.0,
        1e-8,
        1e-10,
        np.array([1.0, 1e3]),
    )
    p.rhs, p.np_rhs, p.np_jac = rhs, (lambda t, y, q: rhs(t, y, q, np)), jac
    return p


def brusselator(t1):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import scipy.sparse as sp

    import brusselator2d as ex

    n = ex.N
    params = {"A": jnp.asarray(1.0), "B": jnp.asarray(3.4), "alpha": jnp.asarray(0.1)}
    a_, b_, al = 1.0, 3.4, 0.1
    e = np.ones(n)
    lap1 = sp.diags([e[:-1], -2 * e, e[:-1]], [-1, 0, 1], format="lil")
    lap1[0, -1] = lap1[-1, 0] = 1.0
    eye = sp.identity(n, format="csr")
    lap = ((sp.kron(lap1, eye) + sp.kron(eye, lap1)) / ex.DX**2).tocsr()

    def np_rhs(t, y, _):
        u, v = y[: n * n], y[n * n :]
        uuv = u * u * v
        return np.concatenate(
            [a_ + uuv - (b_ + 1) * u + al * (lap @ u), b_ * u - uuv + al * (lap @ v)]
        )

    def np_jac(t, y, _):
        u, v = y[: n * n], y[n * n :]
        return sp.bmat(
            [
                [sp.diags(2 * u * v - (b_ + 1)) + al * lap, sp.diags(u * u)],
                [sp.diags(b_ - 2 * u * v), sp.diags(-u * u) + al * lap],
            ],
            format="csc",
        )

    y0 = ex.initial_state()
    p = Problem(
        "brusselator",
        f"Brusselator 2-d 32x32 (2048 unknowns), t in [0, {t1:g}]",
        y0,
        params,
        t1,
        1e-6,
        1e-8,
        np.full(2 * n * n, 1.0 / (n * n)),
    )
    p.rhs, p.np_rhs, p.np_jac = ex.brusselator, np_rhs, np_jac
    p.sparsity = np_jac(0.0, p.flat(y0) + 1.0, None) != 0
    p.preconditioner = ex.preconditioner
    return p


# --- the contestants ---------------------------------------------------------------------------


def weighted_loss(prob, ys):
    """``sum_k w . y(t_k)`` over the saves (``ys``: pytree with a leading save axis)."""
    flat = jnp.concatenate([x.reshape(x.shape[0], -1) for x in jax.tree.leaves(ys)], axis=1)
    return jnp.sum(flat * jnp.asarray(prob.weights))


def make_odegrad(prob, solver_name):
    import odegrad as og

    kw = {}
    if prob.name == "brusselator":
        kw = {"linear_solver": "gmres", "preconditioner": prob.preconditioner}
    solver = getattr(og, solver_name)(**kw)
    ts = jnp.asarray(prob.ts)

    def solve(y0, p):
        return og.solve(
            prob.rhs,
            y0,
            (0.0, prob.t1),
            p,
            solver=solver,
            step=og.Adaptive(rtol=prob.rtol, atol=prob.atol),
            saveat=og.SaveAt(ts=ts),
        )

    def stats(sol):
        return f"{int(sol.stats['steps'])}/{int(sol.stats['accepted'])}"

    return solve, stats


def make_diffrax(prob):
    import diffrax as dfx

    ts = jnp.asarray(prob.ts)

    def solve(y0, p):
        return dfx.diffeqsolve(
            dfx.ODETerm(prob.rhs),
            dfx.Kvaerno5(),
            t0=0.0,
            t1=prob.t1,
            dt0=None,
            y0=y0,
            args=p,
            saveat=dfx.SaveAt(ts=ts),
            stepsize_controller=dfx.PIDController(rtol=prob.rtol, atol=prob.atol),
        )

    def stats(sol):
        return f"{int(sol.stats['num_steps'])}/{int(sol.stats['num_accepted_steps'])}"

    return solve, stats


def scipy_runs(prob, light):
    """label -> ``run() -> (ys [saves, n], stats text)``."""
    from scipy.integrate import solve_ivp

    y0 = prob.flat(prob.y0)
    params = jax.tree.map(np.asarray, prob.params)
    f = lambda t, y: prob.np_rhs(t, y, params)
    jac = lambda t, y: prob.np_jac(t, y, params)
    big = prob.name == "brusselator"
    variants = [("BDF", "jac", {"jac": jac})]
    if not (big and light):
        variants.insert(0, ("Radau", "jac", {"jac": jac}))
    if big:
        variants.append(("BDF", "jac_sparsity", {"jac_sparsity": prob.sparsity}))
    out = {}
    for method, info, kw in variants:

        def run(method=method, kw=kw):
            s = solve_ivp(
                f,
                (0.0, prob.t1),
                y0,
                method=method,
                t_eval=prob.ts,
                rtol=prob.rtol,
                atol=prob.atol,
                **kw,
            )
            return s.y.T, f"nfev {s.nfev}, njev {s.njev}, nlu {s.nlu}"

        out[f"scipy {method} ({info})"] = run
    return out


# --- the run -----------------------------------------------------------------------------------


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def run_problem(prob, args):
    inputs = (prob.y0, prob.params)
    contestants = {
        f"odegrad {s}": (lambda s=s: make_odegrad(prob, s)) for s in ("Kvaerno5", "Rodas5P")
    }
    heavy = prob.name == "brusselator"
    if not args.no_diffrax and importlib.util.find_spec("diffrax") is not None:
        if not heavy or args.heavy:
            contestants["diffrax Kvaerno5"] = lambda: make_diffrax(prob)

    fwd, grad, loss, gnorm, steps, calls = {}, {}, {}, {}, {}, {}
    for name, make in contestants.items():

        def make_fwd(make=make):
            solve, _ = make()
            return lambda y0, p: weighted_loss(prob, solve(y0, p).ys)

        def make_grad(make=make):
            solve, _ = make()
            return jax.value_and_grad(
                lambda y0, p: weighted_loss(prob, solve(y0, p).ys), argnums=(0, 1)
            )

        fwd[name] = compile_timed(make_fwd, inputs, args.compile_reps)
        grad[name] = compile_timed(make_grad, inputs, args.compile_reps)
        value, g = jax.device_get(grad[name].fn(*inputs))
        loss[name] = float(value)
        gnorm[name] = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
        solve, stats_of = make()
        steps[name] = stats_of(jax.jit(solve)(*inputs))
        calls[f"{name}|fwd"] = lambda c=fwd[name].call: c(*inputs)
        calls[f"{name}|grad"] = lambda c=grad[name].call: c(*inputs)

    if not args.no_scipy and importlib.util.find_spec("scipy") is not None:
        for name, run in scipy_runs(prob, not args.heavy).items():
            ys, steps[name] = run()
            loss[name] = float(np.sum(ys * prob.weights))
            calls[f"{name}|fwd"] = run

    timing = interleaved_medians(calls, args.rounds, args.number, budget_s=args.budget)
    stat = (lambda t: t.median) if args.stat == "median" else (lambda t: t.best)
    ref = "odegrad Kvaerno5"
    ref_fwd, ref_grad = stat(timing[f"{ref}|fwd"]), stat(timing[f"{ref}|grad"])
    rows, json_rows = [], []
    for name in loss:
        tf, tg = timing[f"{name}|fwd"], timing.get(f"{name}|grad")
        rows.append(
            [
                prob.title if not rows else "",
                name,
                fmt_timing(tf),
                fmt_ratio(stat(tf), ref_fwd),
                fmt_timing(tg),
                fmt_ratio(stat(tg) if tg else None, ref_grad),
                fmt_compile(fwd.get(name)),
                fmt_compile(grad.get(name)),
                steps[name],
                fmt_diff(rel(loss[name], loss[ref])),
                fmt_diff(rel(gnorm[name], gnorm[ref])) if name in gnorm else "",
            ]
        )
        json_rows.append(
            result_row(
                f"{prob.title.split(',')[0]} (stiff)",
                name,
                name.split()[0],
                tf,
                tg,
                fwd.get(name),
                grad.get(name),
            )
        )
    return rows, json_rows, timing


def jacobian_reuse_table(args, n=200, width=256):
    """Kvaerno5's dense Jacobian reuse on a problem whose Jacobian costs: a stiff hybrid neural
    ODE ``y' = -K y + W2 tanh(W1 y)`` (``n`` states, ``K`` spread over 1..1e4, a ``width``-wide
    layer), rtol=1e-6, atol=1e-8 on [0, 10], 11 saves; loss ``sum y(t_k)^2``, gradient with
    respect to ``y0`` and all weights (``og.Auto()``: Discrete)."""
    import odegrad as og
    from odegrad.solvers import _linear

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    p = (
        jax.random.normal(k1, (width, n)) / np.sqrt(n),
        jax.random.normal(k2, (n, width)) / np.sqrt(width),
        jnp.logspace(0.0, 4.0, n),
    )
    y0 = jax.random.normal(k3, (n,))
    f = lambda t, y, p: -p[2] * y + p[1] @ jnp.tanh(p[0] @ y)
    ts = og.SaveAt(ts=jnp.linspace(0.0, 10.0, 11))
    rates = {"0 (a Jacobian every step)": 0.0, "1e-3 (default)": 1e-3, "0.1": 0.1}

    def solve(rate):
        solver = og.Kvaerno5(jacobian_reuse_rate=rate)
        step = og.Adaptive(rtol=1e-6, atol=1e-8)
        return lambda y, p: og.solve(f, y, (0.0, 10.0), p, solver=solver, step=step, saveat=ts)

    count = [0]
    jacobian = _linear.jacobian

    def counted(fx, x):
        jax.debug.callback(lambda: count.__setitem__(0, count[0] + 1))
        return jacobian(fx, x)

    calls, info = {}, {}
    for label, rate in rates.items():
        loss = lambda y, p, rate=rate: jnp.sum(solve(rate)(y, p).ys ** 2)
        fwd = jax.jit(loss).lower(y0, p).compile()
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(y0, p).compile()
        _linear.jacobian, count[0] = counted, 0
        sol = jax.block_until_ready(jax.jit(solve(rate))(y0, p))
        _linear.jacobian = jacobian
        g = grad(y0, p)[1]
        flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
        info[label] = (int(sol.stats["steps"]), count[0], int(sol.stats["rhs_evals"]), flat)
        calls[f"{label}|fwd"] = lambda c=fwd: c(y0, p)
        calls[f"{label}|grad"] = lambda c=grad: c(y0, p)
    timing = interleaved_medians(calls, args.rounds, args.number, budget_s=args.budget)
    stat = (lambda t: t.median) if args.stat == "median" else (lambda t: t.best)
    ref = next(iter(rates))
    rows = []
    for label in rates:
        steps, jacs, evals, flat = info[label]
        tf, tg = timing[f"{label}|fwd"], timing[f"{label}|grad"]
        rows.append(
            [
                label,
                steps,
                jacs,
                evals,
                fmt_timing(tf),
                fmt_ratio(stat(tf), stat(timing[f"{ref}|fwd"])),
                fmt_timing(tg),
                fmt_ratio(stat(tg), stat(timing[f"{ref}|grad"])),
                fmt_diff(rel(flat, info[ref][3])),
            ]
        )
    headers = [
        "jacobian_reuse_rate",
        "steps",
        "Jacobians",
        "f evals",
        f"forward {args.stat} (min)",
        "/ every step",
        f"loss+grad {args.stat} (min)",
        "/ every step",
        "rel Δ grad",
    ]
    print(f"\n## Jacobian reuse: Kvaerno5 on a stiff hybrid neural ODE ({n} states)\n")
    print(markdown_table(headers, rows))


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    warm_up_jax()
    makers = {
        "robertson": robertson,
        "vdp": van_der_pol,
        "brusselator": lambda: brusselator(args.bruss_t1),
    }
    rows, json_rows, must = [], [], []
    for name in args.problems:
        if name == "hybrid":
            continue
        prob = makers[name]()
        r, j, timing = run_problem(prob, args)
        rows += r
        json_rows += j
        stat = (lambda t: t.median) if args.stat == "median" else (lambda t: t.best)
        ours = {
            s: timing.get(f"odegrad {s}|{q}")
            for s in ("Kvaerno5", "Rodas5P")
            for q in ("fwd", "grad")
        }
        dfx_g = timing.get("diffrax Kvaerno5|grad")
        if dfx_g is not None:
            best = min(stat(timing[f"odegrad {s}|grad"]) for s in ("Kvaerno5", "Rodas5P"))
            must.append(
                f"{prob.title}: gradient, diffrax Kvaerno5 / odegrad Kvaerno5 = "
                f"{stat(dfx_g) / stat(timing['odegrad Kvaerno5|grad']):.1f}x, / odegrad Rodas5P = "
                f"{stat(dfx_g) / stat(timing['odegrad Rodas5P|grad']):.1f}x (best odegrad "
                f"{stat(dfx_g) / best:.1f}x faster)"
            )
        bdf = timing.get("scipy BDF (jac)|fwd")
        if bdf is not None and ours:
            must.append(
                f"{prob.title}: forward, scipy BDF (jac) / odegrad Kvaerno5 = "
                f"{stat(bdf) / stat(timing['odegrad Kvaerno5|fwd']):.1f}x, / odegrad Rodas5P = "
                f"{stat(bdf) / stat(timing['odegrad Rodas5P|fwd']):.1f}x"
            )
    headers = [
        "problem",
        "method",
        f"forward {args.stat} (min)",
        "/ K5",
        f"loss+grad {args.stat} (min)",
        "/ K5",
        "compile fwd s (lower)",
        "compile grad s (lower)",
        "steps (total/accepted)",
        "rel Δ loss",
        "rel Δ grad",
    ]
    print("## Stiff problems: odegrad vs scipy vs diffrax\n")
    print(environment())
    print(
        f"float64; {args.rounds} interleaved rounds x {args.number} calls, time per call; "
        f"ratios (/ K5) use the {args.stat} and are to `odegrad Kvaerno5` on the same problem; "
        f"compile = trace+lower + XLA compile, cold (of which trace+lower), median of "
        f"{args.compile_reps}; the gradient (w.r.t. the initial state and the parameters) call "
        "returns the loss too; rel Δ against odegrad Kvaerno5\n"
    )
    print(markdown_table(headers, rows))
    notes = [
        "odegrad: default adjoint og.Auto() (Forward() for Robertson and Van der Pol, "
        "Discrete('all') for the Brusselator); Brusselator with linear_solver='gmres' and "
        "examples/brusselator2d.py's preconditioner (diffusion by FFT, reaction by pointwise "
        "2x2 blocks).",
        "scipy: solve_ivp with the exact Jacobian as `jac` (dense arrays for Robertson and Van "
        "der Pol, a scipy.sparse CSC matrix for the Brusselator); `jac_sparsity`: the sparsity "
        "pattern only (finite-difference Jacobian). Forward only, NumPy right-hand sides.",
        "diffrax: Kvaerno5 + PIDController, default RecursiveCheckpointAdjoint, dense LU "
        "(lineax) of the full Jacobian.",
        "steps: odegrad/diffrax total/accepted steps; scipy: f evaluations, Jacobians, LUs.",
    ]
    if not args.heavy:
        notes.append(
            "Brusselator without diffrax Kvaerno5 (a dense 2048x2048 LU per step: minutes per "
            "call, more for its gradient) and scipy Radau (a complex sparse LU per step, about "
            "a minute per call); --heavy adds them."
        )
    reduced = [n for n in rows if "*" in "".join(n)]
    if reduced:
        notes.append("`*`: too slow for the timing budget: a reduced schedule (fewer samples).")
    print()
    for note in notes:
        print(f"- {note}")
    print("\nMust-show figures (ratios > 1: odegrad faster):")
    for line in must:
        print(f"- {line}")
    write_json(
        args.json,
        "stiff",
        json_rows,
        settings=f"float64, Robertson/Van der Pol rtol=1e-8 atol=1e-10, Brusselator t1="
        f"{args.bruss_t1:g} rtol=1e-6 atol=1e-8; gradient w.r.t. y0 and params",
        notes=notes[:2],
    )
    if "hybrid" in args.problems:
        jacobian_reuse_table(args)
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f} s; {load_average()}")


if __name__ == "__main__":
    main()
