"""Accuracy and step counts of odegrad's adaptive solvers against diffrax's, float64.

For classic non-stiff problems (``tests/reference_problems.py``: Lotka–Volterra, damped
pendulum, Lorenz on ``[0, 1]``, FitzHugh–Nagumo, Brusselator, forced oscillator, a linear
3x3 system; plus the Arenstorf orbit over one period) and the solver pairs

    odegrad Tsit5 / diffrax Tsit5, Dopri5 / Dopri5, Dopri8 / Dopri8, BS3 / Bosh3,

each library solves with its default adaptive controller at ``rtol = atol = tol``
(odegrad ``og.Adaptive(tol, tol)``, a PI controller; diffrax ``PIDController(tol, tol)``,
an I controller by default), the state saved at the final time only. Reported per case:

* ``err``: the max-norm error of the final state against a tight reference: ``expm(A t1) y0``
  for the linear system, scipy ``solve_ivp(method="DOP853", rtol=atol=1e-13)`` otherwise;
* ``steps (acc/rej)``: all steps taken, with the accepted and rejected ones;
* the ratios odegrad / diffrax of the error and of the step count.

The contract checked (per solver, worst over the problems): odegrad is at least as accurate as
diffrax (error ratio <= 1; "<= 2" is reported as within a small factor) with at most 1.5x its
steps.

    python benchmarks/accuracy.py                 # tol 1e-9, all problems
    python benchmarks/accuracy.py --tol 1e-9 1e-6
    python benchmarks/accuracy.py --quick         # 3 problems, Tsit5 and BS3
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _timing import environment, markdown_table, warm_up_jax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

import reference_problems as rp  # noqa: E402

#: odegrad solver name -> diffrax solver name.
SOLVERS = {"Tsit5": "Tsit5", "Dopri5": "Dopri5", "Dopri8": "Dopri8", "BS3": "Bosh3"}
QUICK_SOLVERS = ["Tsit5", "BS3"]
QUICK_PROBLEMS = ["lotka_volterra", "lorenz", "arenstorf"]

ERR_STRICT = 1.0  # "at least as accurate"
ERR_LOOSE = 2.0  # "within a small factor"
STEPS_MAX = 1.5
MAX_STEPS = 200_000


def _arenstorf_rhs(t, y, p, m):
    # restricted three-body problem (Hairer, Norsett & Wanner I, II.0): a periodic orbit
    x, z, vx, vz = y[0], y[1], y[2], y[3]
    mu = p[0]
    mu_ = 1.0 - mu
    d1 = m.sqrt((x + mu) * (x + mu) + z * z)
    d2 = m.sqrt((x - mu_) * (x - mu_) + z * z)
    d1, d2 = d1 * d1 * d1, d2 * d2 * d2
    ax = x + 2.0 * vz - mu_ * (x + mu) / d1 - mu * (x - mu_) / d2
    az = z - 2.0 * vx - mu_ * z / d1 - mu * z / d2
    return m.stack([vx, vz, ax, az])


def arenstorf() -> rp.Problem:
    """Arenstorf orbit, one period ``t1 = 17.0652...``, params ``(mu,)``."""
    return rp.Problem(
        "arenstorf",
        _arenstorf_rhs,
        [0.994, 0.0, 0.0, -2.00158510637908252240537862224],
        [0.012277471],
        17.0652165601579625588917206249,
        description="Arenstorf orbit (one period)",
    )


def problems() -> dict[str, rp.Problem]:
    out = {n: rp.get_problem(n) for n in rp.NONSTIFF if n not in ("linear", "van_der_pol")}
    out["arenstorf"] = arenstorf()
    out["linear"] = rp.get_problem("linear")
    return out


def reference(problem: rp.Problem) -> np.ndarray:
    """The final state: ``expm`` for the linear system, else DOP853 at rtol = atol = 1e-13."""
    if problem.name == "linear":
        from scipy.linalg import expm

        n = problem.n
        a = problem.params.reshape(n, n)
        return expm(a * (problem.t1 - problem.t0)) @ problem.y0
    from scipy.integrate import solve_ivp

    sol = solve_ivp(
        lambda t, y: problem.rhs(t, y, problem.params, rp.NUMPY),
        (problem.t0, problem.t1),
        problem.y0,
        method="DOP853",
        rtol=1e-13,
        atol=1e-13,
    )
    if not sol.success:
        raise RuntimeError(f"reference solve failed for {problem.name}: {sol.message}")
    return sol.y[:, -1]


@dataclass
class Run:
    y1: np.ndarray
    steps: int
    accepted: int
    rejected: int


def odegrad_solver(problem: rp.Problem, name: str):
    """``run(tol) -> Run``: odegrad, jitted once (the tolerance is a traced argument)."""
    import odegrad as og

    f = rp.jax_rhs(problem)
    solver = getattr(og, name)()

    @jax.jit
    def go(y0, p, tol):
        sol = og.solve(
            f,
            y0,
            (problem.t0, problem.t1),
            p,
            solver=solver,
            step=og.Adaptive(rtol=tol, atol=tol),
            max_steps=MAX_STEPS,
        )
        return sol.ys[-1], sol.stats["steps"], sol.stats["accepted"], sol.stats["rejected"]

    def run(tol):
        y1, n, a, r = go(jnp.asarray(problem.y0), jnp.asarray(problem.params), tol)
        return Run(np.asarray(y1).reshape(-1), int(n), int(a), int(r))

    return run


def diffrax_solver(problem: rp.Problem, name: str):
    """``run(tol) -> Run``: diffrax with ``PIDController(tol, tol)`` (its defaults otherwise)."""
    import diffrax as dfx

    f = rp.jax_rhs(problem)
    solver = getattr(dfx, name)()

    @jax.jit
    def go(y0, p, tol):
        sol = dfx.diffeqsolve(
            dfx.ODETerm(f),
            solver,
            problem.t0,
            problem.t1,
            None,
            y0,
            p,
            saveat=dfx.SaveAt(t1=True),
            stepsize_controller=dfx.PIDController(rtol=tol, atol=tol),
            max_steps=MAX_STEPS,
        )
        s = sol.stats
        return sol.ys[-1], s["num_steps"], s["num_accepted_steps"], s["num_rejected_steps"]

    def run(tol):
        y1, n, a, r = go(jnp.asarray(problem.y0), jnp.asarray(problem.params), tol)
        return Run(np.asarray(y1).reshape(-1), int(n), int(a), int(r))

    return run


@dataclass
class Case:
    problem: str
    solver: str
    tol: float
    og: Run
    dfx: Run
    err_og: float
    err_dfx: float

    @property
    def err_ratio(self) -> float:
        if self.err_dfx == 0:
            return 1.0 if self.err_og == 0 else math.inf
        return self.err_og / self.err_dfx

    @property
    def steps_ratio(self) -> float:
        return self.og.steps / self.dfx.steps


def compare(problem: rp.Problem, solver: str, tols, ref: np.ndarray | None = None) -> list[Case]:
    """One :class:`Case` per tolerance for ``problem`` and the odegrad ``solver`` and its twin."""
    if ref is None:
        ref = reference(problem)
    run_og = odegrad_solver(problem, solver)
    run_dfx = diffrax_solver(problem, SOLVERS[solver])
    out = []
    for tol in tols:
        a, b = run_og(tol), run_dfx(tol)
        out.append(
            Case(
                problem.name,
                solver,
                tol,
                a,
                b,
                float(np.max(np.abs(a.y1 - ref))),
                float(np.max(np.abs(b.y1 - ref))),
            )
        )
    return out


def _steps(r: Run) -> str:
    return f"{r.steps} ({r.accepted}/{r.rejected})"


def _verdict(c: Case) -> str:
    marks = []
    if c.err_ratio > ERR_LOOSE:
        marks.append("ERR")
    elif c.err_ratio > ERR_STRICT:
        marks.append("err~")
    if c.steps_ratio > STEPS_MAX:
        marks.append("STEPS")
    return " ".join(marks) or "ok"


def table(cases: list[Case]) -> str:
    headers = [
        "problem",
        "solver",
        "tol",
        "err og",
        "err dfx",
        "err og/dfx",
        "steps og (acc/rej)",
        "steps dfx (acc/rej)",
        "steps og/dfx",
        "",
    ]
    rows = [
        [
            c.problem,
            c.solver,
            f"{c.tol:.0e}",
            f"{c.err_og:.2e}",
            f"{c.err_dfx:.2e}",
            f"{c.err_ratio:.2f}",
            _steps(c.og),
            _steps(c.dfx),
            f"{c.steps_ratio:.2f}",
            _verdict(c),
        ]
        for c in cases
    ]
    return markdown_table(headers, rows)


def summary(cases: list[Case]) -> list[str]:
    """One line per (solver, tol): worst and geometric-mean ratios and the contract verdict."""
    lines = []
    keys = sorted(
        {(c.solver, c.tol) for c in cases}, key=lambda k: (list(SOLVERS).index(k[0]), k[1])
    )
    for solver, tol in keys:
        cs = [c for c in cases if c.solver == solver and c.tol == tol]
        we = max(cs, key=lambda c: c.err_ratio)
        ws = max(cs, key=lambda c: c.steps_ratio)
        ge = math.exp(statistics.fmean([math.log(max(c.err_ratio, 1e-300)) for c in cs]))
        gs = math.exp(statistics.fmean([math.log(c.steps_ratio) for c in cs]))
        if we.err_ratio <= ERR_STRICT:
            acc = "at least as accurate"
        elif we.err_ratio <= ERR_LOOSE:
            acc = f"within {ERR_LOOSE:g}x"
        else:
            acc = "LESS ACCURATE"
        steps_ok = ws.steps_ratio <= STEPS_MAX
        ok = we.err_ratio <= ERR_LOOSE and steps_ok
        lines.append(
            f"- {solver} @ {tol:.0e}: worst err ratio {we.err_ratio:.2f} ({we.problem}), "
            f"geomean {ge:.2f}; worst steps ratio {ws.steps_ratio:.2f} ({ws.problem}), "
            f"geomean {gs:.2f} -> accuracy: {acc}; steps: "
            f"{'ok' if steps_ok else f'OVER {STEPS_MAX}x'}; contract "
            f"{'HOLDS' if ok else 'FAILS'}"
        )
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tol", type=float, nargs="+", default=[1e-9], help="rtol = atol values")
    p.add_argument("--quick", action="store_true", help=f"only {QUICK_PROBLEMS} x {QUICK_SOLVERS}")
    p.add_argument("--problems", default=None, help="comma-separated problem names")
    p.add_argument("--solvers", default=None, help=f"comma-separated, from {list(SOLVERS)}")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    probs = problems()
    names = QUICK_PROBLEMS if args.quick else list(probs)
    solvers = QUICK_SOLVERS if args.quick else list(SOLVERS)
    if args.problems:
        names = args.problems.split(",")
    if args.solvers:
        solvers = args.solvers.split(",")
    warm_up_jax()
    print(environment())
    print(
        "float64; odegrad og.Adaptive(tol, tol) vs diffrax PIDController(tol, tol); err = max-norm"
        " error at t1 vs expm (linear) or scipy DOP853 at 1e-13\n"
    )
    t0 = time.perf_counter()
    cases: list[Case] = []
    for name in names:
        ref = reference(probs[name])
        for solver in solvers:
            cases.extend(compare(probs[name], solver, args.tol, ref))
    cases.sort(key=lambda c: (c.tol, list(SOLVERS).index(c.solver), names.index(c.problem)))
    print(table(cases))
    print()
    print(
        f"Contract: error ratio <= {ERR_STRICT:g} (<= {ERR_LOOSE:g}: within a small factor) and "
        f"steps ratio <= {STEPS_MAX:g}. Marks: err~ = ratio in ({ERR_STRICT:g}, {ERR_LOOSE:g}],"
        f" ERR = over {ERR_LOOSE:g}, STEPS = over {STEPS_MAX:g}."
    )
    lines = summary(cases)
    print("\n".join(lines))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0 if all(line.endswith("HOLDS") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
