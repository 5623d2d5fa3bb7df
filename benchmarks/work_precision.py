"""Work–precision of adaptive step-size control: odegrad vs diffrax vs scipy.

Each method solves each problem at each tolerance. A cell of the table is
``nfev / error / rejected``: the right-hand-side evaluations (all of them: the first-step
selection, rejected steps, the FSAL start), the max-norm error of the final state against a
reference, and the rejected steps. Problems:

* ``neural[i]``: member ``i`` of diffrax's neural-ODE example as in ``benchmarks/neural_ode.py``
  (MLP 2 -> 2, width 64, depth 2, softplus, tanh output, initialised from key 0; initial
  conditions uniform in ``[-0.6, 1]^2`` from key 5678; ``t`` in ``[0, 10]``, 100 save times),
  float64, at ``(rtol, atol)`` = ``(1e-3, 1e-6)`` (the example's), ``(1e-5, 1e-8)`` and
  ``(1e-7, 1e-10)``. The weights and initial conditions are drawn in float32, as the example
  does, and cast.
* ``neural32[i]``: the same in float32, the example's precision (scipy still float64), at
  ``(1e-3, 1e-6)`` and ``(1e-4, 1e-7)``. Its errors (~1e-6) are mostly float32 roundoff, so
  there only the work (the step count) tells the methods apart.
* ``tests/reference_problems.py``'s Lotka–Volterra, Lorenz (``t1 = 1``), FitzHugh–Nagumo,
  forced oscillator and Brusselator, float64, at ``rtol = atol`` in ``--tols`` (1e-3 ... 1e-9).

Methods (``--solvers``, default Tsit5,Dopri5):

* ``og <solver> [<variant>]``: ``og.solve`` with the step controller of each ``--variants``
  entry of :data:`VARIANTS`; ``default`` is ``og.Adaptive(rtol, atol)`` (for these explicit
  solvers DOPRI5's gains), ``pi34`` Gustafsson's PI.3.4 gains (the default until the second
  half of issue 12), ``floor1e-4`` the default before issue 12 (PI.3.4 with the previous
  ratio floored at 1e-4, not 1e-2).
  ``nfev`` is ``sol.stats["rhs_evals"]``.
* ``dfx <solver>``: diffrax ``diffeqsolve(..., dt0=None,
  stepsize_controller=PIDController(rtol, atol))`` (its defaults: an I controller,
  ``0.9 e^(-1/(p+1))`` clipped to ``[0.2, 10]`` and never below 1 after an accepted step, and
  its own first step). diffrax reports steps, not evaluations: ``nfev`` counts the calls of the
  vector field with a host callback. (diffrax 0.7's ``dt0=None`` start is the constant 0.01:
  it selects a first step only for a bare ``ODETerm``, and ``diffeqsolve`` wraps its terms.)
* ``scipy RK45``: ``solve_ivp(method="RK45")`` (Dormand–Prince 5(4), scipy's own I controller
  and first step), ``nfev`` as scipy counts it; the rejected steps are inferred from it.

The reference is scipy ``DOP853`` at ``rtol = atol = 1e-13`` in float64 (the neural field's MLP
evaluated in NumPy). Below the table, each method's work at equal error relative to
``--baseline`` (default: the first method), see :func:`work_ratios`. Under 1 means fewer
evaluations than the baseline for the same error. Shifting one controller's tolerances by
0.5x-3x moves this ratio by up to ~6% on the classic problems and ~10% on ``neural``: the
noise of the measure. On ``neural32`` it is meaningless (roundoff).

    python benchmarks/work_precision.py                  # everything (~1 minute on 2 cores)
    python benchmarks/work_precision.py --quick          # Tsit5, 4 problems, 2 tolerances
    python benchmarks/work_precision.py --variants default,i,pi42 --solvers Tsit5 --no-scipy
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import equinox as eqx
import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import odegrad as og  # noqa: E402
from _timing import environment, markdown_table, warm_up_jax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

import reference_problems as rp  # noqa: E402

CLASSIC = ["lotka_volterra", "lorenz", "fitzhugh_nagumo", "forced_oscillator", "brusselator"]
TOLS = [1e-3, 1e-5, 1e-7, 1e-9]
NEURAL_TOLS = [(1e-3, 1e-6), (1e-5, 1e-8), (1e-7, 1e-10)]
NEURAL32_TOLS = [(1e-3, 1e-6), (1e-4, 1e-7)]
QUICK_PROBLEMS = ["neural", "neural32", "lotka_volterra", "lorenz"]
QUICK_TOLS = [1e-3, 1e-7]
MAX_STEPS = 100_000
ORDER = 5  # of every method here: Tsit5, Dopri5 and RK45 are 5th-order


@dataclass(frozen=True)
class PrevFloor(og.Adaptive):
    """``og.Adaptive`` with another floor on the previous error ratio of its PI term."""

    floor: float = 1e-4

    def next_factor(self, ratio, ratio_prev, q, floor=None, gains=None):
        beta1, beta2 = (self.pcoeff + self.icoeff) / (q + 1), self.pcoeff / (q + 1)
        ratio = jnp.maximum(ratio, 1e-10)
        factor = self.safety * ratio ** (-beta1) * jnp.maximum(ratio_prev, self.floor) ** beta2
        return jnp.clip(factor, self.factormin, self.factormax)


def _adaptive(**kw):
    return lambda rtol, atol: og.Adaptive(rtol, atol, **kw)


#: ``--variants`` name -> ``make(rtol, atol)``, the odegrad step controller.
VARIANTS: dict[str, Callable] = {
    "default": _adaptive(),
    # the default until issue 12: PI.3.4 with the previous ratio floored at 1e-4
    "floor1e-4": lambda rtol, atol: PrevFloor(rtol, atol, pcoeff=0.4, icoeff=0.3, floor=1e-4),
    "i": _adaptive(pcoeff=0.0, icoeff=1.0),  # the elementary controller, diffrax's default
    "pi42": _adaptive(pcoeff=0.2, icoeff=0.4),  # Söderlind's PI.4.2
    # Gustafsson's PI.3.4, the default until the second half of issue 12
    "pi34": _adaptive(pcoeff=0.4, icoeff=0.3),
    "safety95": _adaptive(safety=0.95),
}


@dataclass
class Problem:
    """``f(t, y, args)`` in JAX and ``fnp(t, y)`` in NumPy, with the tolerances to run at."""

    name: str
    f: Callable
    args: Any
    fnp: Callable
    y0: np.ndarray
    t0: float
    t1: float
    tols: list[tuple[float, float]]
    kind: str  # problems of one kind share a right-hand side, so one compiled solve
    ts: np.ndarray | None = None
    ref: np.ndarray | None = field(default=None, repr=False)


@dataclass
class Point:
    nfev: int
    err: float
    accepted: int
    rejected: int


# --- problems -------------------------------------------------------------------------------


def classic_problem(name: str, tols) -> Problem:
    p = rp.get_problem(name)
    params = np.asarray(p.params)
    return Problem(
        name,
        rp.jax_rhs(p),
        jnp.asarray(params),
        lambda t, y, p=p, params=params: p.rhs(t, y, params, rp.NUMPY),
        np.asarray(p.y0, np.float64),
        p.t0,
        p.t1,
        [(t, t) for t in tols],
        kind=name,
    )


def neural_problems(members: int, tols, dtype=jnp.float64) -> list[Problem]:
    from neural_ode import N_SAVES, T0, T1, make_model, vector_field

    model = make_model(64, jax.random.PRNGKey(0), jnp.float32)
    model = jax.tree.map(lambda x: x.astype(dtype) if eqx.is_array(x) else x, model)
    y0s = jax.random.uniform(
        jax.random.PRNGKey(5678), (32, 2), dtype=jnp.float32, minval=-0.6, maxval=1.0
    )
    layers = [(np.asarray(lin.weight), np.asarray(lin.bias)) for lin in model.mlp.layers]

    def fnp(t, y):
        for i, (w, b) in enumerate(layers):
            y = w @ y + b
            y = np.tanh(y) if i == len(layers) - 1 else np.logaddexp(0.0, y)
        return y

    ts = np.linspace(T0, T1, N_SAVES)
    tag = "neural" if dtype == jnp.float64 else "neural32"
    return [
        Problem(
            f"{tag}[{i}]",
            vector_field,
            model,
            fnp,
            np.asarray(y0s[i], dtype),
            T0,
            T1,
            list(tols),
            kind=tag,
            ts=ts,
        )
        for i in range(members)
    ]


def reference(p: Problem) -> np.ndarray:
    from scipy.integrate import solve_ivp

    y0 = p.y0.astype(np.float64)
    sol = solve_ivp(p.fnp, (p.t0, p.t1), y0, method="DOP853", rtol=1e-13, atol=1e-13)
    if not sol.success:
        raise RuntimeError(f"reference solve failed for {p.name}: {sol.message}")
    return sol.y[:, -1]


# --- methods: run(problem, rtol, atol) -> (y1, nfev, accepted, rejected) ----------------------


class OdegradMethod:
    def __init__(self, solver: str, variant: str, make_step: Callable | None = None):
        self.solver, self.variant = solver, variant
        self.make_step = make_step or VARIANTS[variant]
        self.label = f"og {solver}" + ("" if variant == "default" else f" {variant}")
        self._compiled: dict[str, Callable] = {}

    def _go(self, p: Problem):
        if p.kind not in self._compiled:
            solver = getattr(og, self.solver)()
            t0, t1, ts = _times(p)
            saveat = og.SaveAt(ts=ts) if ts is not None else og.SaveAt(t1=True)

            @eqx.filter_jit
            def go(y0, args, rtol, atol):
                sol = og.solve(
                    p.f,
                    y0,
                    (t0, t1),
                    args,
                    solver=solver,
                    step=self.make_step(rtol, atol),
                    saveat=saveat,
                    max_steps=MAX_STEPS,
                )
                s = sol.stats
                return sol.ys[-1], s["rhs_evals"], s["accepted"], s["rejected"]

            self._compiled[p.kind] = go
        return self._compiled[p.kind]

    def run(self, p: Problem, rtol: float, atol: float):
        out = self._go(p)(*_inputs(p, rtol, atol))
        return np.asarray(out[0]), *(int(x) for x in out[1:])


class DiffraxMethod:
    def __init__(self, solver: str):
        self.solver = solver
        self.label = f"dfx {solver}"
        self._compiled: dict[str, Callable] = {}
        self._count = [0]

    def _counted(self, f):
        def bump():
            self._count[0] += 1

        def g(t, y, args):
            jax.debug.callback(bump)
            return f(t, y, args)

        return g

    def _go(self, p: Problem):
        if p.kind not in self._compiled:
            import diffrax as dfx

            solver = getattr(dfx, self.solver)()
            t0, t1, ts = _times(p)
            saveat = dfx.SaveAt(ts=ts) if ts is not None else dfx.SaveAt(t1=True)

            @eqx.filter_jit
            def go(y0, args, rtol, atol):
                sol = dfx.diffeqsolve(
                    dfx.ODETerm(self._counted(p.f)),
                    solver,
                    t0,
                    t1,
                    None,
                    y0,
                    args,
                    saveat=saveat,
                    stepsize_controller=dfx.PIDController(rtol=rtol, atol=atol),
                    max_steps=MAX_STEPS,
                )
                s = sol.stats
                return sol.ys[-1], s["num_steps"], s["num_accepted_steps"], s["num_rejected_steps"]

            self._compiled[p.kind] = go
        return self._compiled[p.kind]

    def run(self, p: Problem, rtol: float, atol: float):
        go = self._go(p)
        self._count[0] = 0
        y1, _, a, r = jax.block_until_ready(go(*_inputs(p, rtol, atol)))
        return np.asarray(y1), self._count[0], int(a), int(r)


class ScipyMethod:
    label = "scipy RK45"

    def run(self, p: Problem, rtol: float, atol: float):
        from scipy.integrate import solve_ivp

        y0 = p.y0.astype(np.float64)
        sol = solve_ivp(p.fnp, (p.t0, p.t1), y0, method="RK45", rtol=rtol, atol=atol)
        # scipy keeps no count of rejections; report the surplus of evaluations over the
        # accepted steps' 6 each (+2 to start) as rejected steps
        accepted = len(sol.t) - 1
        return sol.y[:, -1], sol.nfev, accepted, max((sol.nfev - 2 - 6 * accepted) // 6, 0)


def _times(p: Problem):
    """``t0, t1, ts`` in the state's precision: float64 times would make diffrax promote a
    float32 state."""
    dt = p.y0.dtype
    ts = None if p.ts is None else jnp.asarray(p.ts, dt)
    return jnp.asarray(p.t0, dt), jnp.asarray(p.t1, dt), ts


def _inputs(p: Problem, rtol, atol):
    """The solve's arguments; the tolerances in the state's precision (float32 for neural32)."""
    dt = p.y0.dtype
    return jnp.asarray(p.y0), p.args, jnp.asarray(rtol, dt), jnp.asarray(atol, dt)


# --- measuring and reporting ----------------------------------------------------------------


def measure(problems, methods) -> dict:
    """``{(problem, (rtol, atol), label): Point}``."""
    out = {}
    for p in problems:
        if p.ref is None:
            p.ref = reference(p)
        for m in methods:
            for rtol, atol in p.tols:
                y1, nfev, acc, rej = m.run(p, rtol, atol)
                err = float(np.max(np.abs(np.asarray(y1).reshape(-1) - p.ref)))
                out[p.name, (rtol, atol), m.label] = Point(nfev, err, acc, rej)
    return out


def fmt_tol(tol) -> str:
    rtol, atol = tol
    return f"{rtol:.0e}" if rtol == atol else f"{rtol:.0e}/{atol:.0e}"


def table(problems, labels, points) -> str:
    headers = ["problem", "rtol/atol", *labels]
    rows = []
    for p in problems:
        for tol in p.tols:
            cells = []
            for lab in labels:
                pt = points[p.name, tol, lab]
                cells.append(f"{pt.nfev} / {pt.err:.1e} / {pt.rejected}")
            rows.append([p.name, fmt_tol(tol), *cells])
    return markdown_table(headers, rows)


def work_ratios(problems, labels, points, baseline: str) -> dict:
    """``{(problem, label): geomean over tolerances of nfev / baseline nfev at equal error}``.

    The baseline's work at a given error is read off its own work–precision curve for that
    problem: ``log nfev`` interpolated piecewise linearly in ``log error`` between its points,
    and beyond them extended with the slope of a least-squares line through them (kept between
    the slopes of orders 3 and 12: few steps make the curve steeper than the method's order)."""
    out = {}
    for p in problems:
        base = sorted((points[p.name, tol, baseline] for tol in p.tols), key=lambda b: -b.err)
        x = np.array([-math.log(max(b.err, 1e-300)) for b in base])
        y = np.array([math.log(b.nfev) for b in base])
        slope = np.polyfit(x, y, 1)[0] if len(base) > 1 and np.ptp(x) > 0 else 1 / ORDER
        slope = min(max(slope, 1 / 12), 1 / 3)

        def log_work(e, x=x, y=y, slope=slope):
            xe = -math.log(max(e, 1e-300))
            if xe < x[0]:
                return y[0] + slope * (xe - x[0])
            if xe > x[-1]:
                return y[-1] + slope * (xe - x[-1])
            return float(np.interp(xe, x, y))

        for lab in labels:
            logs = [
                math.log(points[p.name, tol, lab].nfev) - log_work(points[p.name, tol, lab].err)
                for tol in p.tols
            ]
            out[p.name, lab] = math.exp(statistics.fmean(logs))
    return out


def summary(problems, labels, points, baseline: str) -> str:
    """The work ratios per problem; their geometric mean and worst over the float64 problems
    (``neural32``'s errors are roundoff); the float32 neural field's steps per member at the
    example's tolerance; all rejected steps."""
    ratios = work_ratios(problems, labels, points, baseline)
    headers = ["problem", *labels]
    rows = [[p.name, *(f"{ratios[p.name, lab]:.2f}" for lab in labels)] for p in problems]
    f64 = [p for p in problems if not p.name.startswith("neural32")]
    if f64:
        logs = {lab: [math.log(ratios[p.name, lab]) for p in f64] for lab in labels}
        rows.append(
            [
                "geomean (float64)",
                *(f"{math.exp(statistics.fmean(logs[lab])):.2f}" for lab in labels),
            ]
        )
        rows.append(["worst (float64)", *(f"{math.exp(max(logs[lab])):.2f}" for lab in labels)])
    n32 = [p for p in problems if p.name.startswith("neural32")]
    if n32:
        tol = NEURAL32_TOLS[0]
        steps = [
            statistics.fmean(
                points[p.name, tol, lab].accepted + points[p.name, tol, lab].rejected for p in n32
            )
            for lab in labels
        ]
        rows.append([f"neural32 steps/member at {fmt_tol(tol)}", *(f"{x:.2f}" for x in steps)])
    rej = [
        sum(points[p.name, tol, lab].rejected for p in problems for tol in p.tols) for lab in labels
    ]
    rows.append(["rejected (all)", *map(str, rej)])
    return markdown_table(headers, rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"Tsit5; {', '.join(QUICK_PROBLEMS)} (1 member); 2 tolerances",
    )
    p.add_argument(
        "--problems",
        default=None,
        help="comma-separated, from: neural,neural32," + ",".join(CLASSIC),
    )
    p.add_argument("--tols", type=float, nargs="+", default=None, help="rtol = atol values")
    p.add_argument("--members", type=int, default=4, help="neural-field batch members")
    p.add_argument("--solvers", default=None, help="comma-separated: Tsit5,Dopri5")
    p.add_argument(
        "--variants", default="default,pi34", help=f"odegrad controllers: {list(VARIANTS)}"
    )
    p.add_argument("--baseline", default=None, help="method label for the work ratios")
    p.add_argument("--no-diffrax", action="store_true")
    p.add_argument("--no-scipy", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    names = (
        args.problems.split(",")
        if args.problems
        else (QUICK_PROBLEMS if args.quick else ["neural", "neural32", *CLASSIC])
    )
    tols = args.tols or (QUICK_TOLS if args.quick else TOLS)
    solvers = (
        args.solvers.split(",")
        if args.solvers
        else (["Tsit5"] if args.quick else ["Tsit5", "Dopri5"])
    )
    variants = args.variants.split(",")
    problems = []
    for name in names:
        if name == "neural":
            ntols = NEURAL_TOLS[:1] + NEURAL_TOLS[-1:] if args.quick else NEURAL_TOLS
            problems.extend(neural_problems(1 if args.quick else args.members, ntols))
        elif name == "neural32":
            problems.extend(
                neural_problems(1 if args.quick else args.members, NEURAL32_TOLS, jnp.float32)
            )
        else:
            problems.append(classic_problem(name, tols))
    methods = []
    for solver in solvers:
        methods.extend(OdegradMethod(solver, v) for v in variants)
        if not args.no_diffrax:
            methods.append(DiffraxMethod(solver))
    if not args.no_scipy:
        methods.append(ScipyMethod())
    labels = [m.label for m in methods]
    warm_up_jax()
    print(environment())
    print(
        "float64 (neural32: float32); cells: nfev / max-norm error at t1 vs scipy DOP853 at "
        "1e-13 / rejected steps\n"
    )
    t0 = time.perf_counter()
    points = measure(problems, methods)
    print(table(problems, labels, points))
    baseline = args.baseline or labels[0]
    print(f"\nWork at equal error relative to {baseline} (nfev ratio; < 1 is cheaper):\n")
    print(summary(problems, labels, points, baseline))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
