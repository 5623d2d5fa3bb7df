"""Gradient accuracy of every adjoint on right-hand sides with kinks, against CVODES.

Two problems whose right-hand sides are continuous but not smooth:

* seed 000 (``abs`` of a vector, 33 states, the 16 x 32 matrix ``Z`` as parameters), loss
  ``ys[index][0]`` with saves at 0, 0.1, ..., 2; flat state ``[c; a]`` and pytree ``(c, a)``;
  five kinks on ``[0, 2]``;
* a ReLU MLP field ``y' = W2 relu(W1 y + b1) + b2`` on ``R^2`` (hidden width 16), loss
  ``sum(ys**2)`` over 11 saves on ``[0, 5]``, gradient with respect to the weights and ``y0``;
  six kinks.

The reference gradients come from :mod:`tests.kink_references`: CVODES (through CasADi),
integrated piece by piece between the kinks, at ``rtol = atol = 1e-12`` (accurate to ~1e-9).
Every odegrad adjoint (and, on seed 000 where diffrax is installed, diffrax's recursive
checkpointing and backsolve adjoints) solves with Tsit5, adaptive steps at ``rtol = atol = tol``,
``max_steps = 100_000``. Printed: one markdown table of
``norm(g - g_ref) / norm(g_ref)`` (rows: adjoints; columns: cases). A float32 case compares
the float32 gradient with the float64 reference. A cell reads ``raised`` when the gradient
raised (the message is printed above the table) and ``—`` where the case was not run.

    python benchmarks/kinks.py            # all cases
    python benchmarks/kinks.py --quick    # seed 000 ys[-1] and the MLP at 1e-8

A last table takes one kink on fixed grids (``og.Fixed(dt)``), where every adjoint returns the
derivative of the discrete solve, against the closed form.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from dataclasses import dataclass

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import odegrad as og  # noqa: E402
from _timing import environment, interleaved_medians, markdown_table, warm_up_jax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

import kink_references as kr  # noqa: E402

ADJOINTS = {
    "Auto": og.Auto,
    "Discrete": og.Discrete,
    "Forward": og.Forward,
    "Backsolve": og.Backsolve,
    "Interpolating": og.Interpolating,
    "Quadrature": og.Quadrature,
}
DIFFRAX = ("RecursiveCheckpointAdjoint", "BacksolveAdjoint")
MAX_STEPS = 100_000


@dataclass(frozen=True)
class Case:
    label: str
    problem: str  # "seed-flat", "seed-tree" or "relu"
    tol: float
    dtype: str = "float64"
    index: int = -1


CASES = [
    Case("seed ys[-1] 1e-10", "seed-flat", 1e-10),
    Case("seed ys[19] 1e-10", "seed-flat", 1e-10, index=19),
    Case("seed tree ys[-1] 1e-10", "seed-tree", 1e-10),
    Case("seed f32 ys[-1] 1e-5", "seed-flat", 1e-5, "float32"),
    Case("ReLU 1e-10", "relu", 1e-10),
    Case("ReLU 1e-8", "relu", 1e-8),
]
QUICK = ("seed ys[-1] 1e-10", "ReLU 1e-8")


def reference(case: Case) -> np.ndarray:
    """The flattened CVODES gradient (float64, whatever the case's dtype)."""
    if case.problem == "relu":
        _, grads = kr.relu_mlp_cvodes_gradient()
        return np.concatenate([grads[k].ravel() for k in ("W1", "b1", "W2", "b2", "y0")])
    return kr.seed000_cvodes_gradient(kr.seed000_z(), case.index)[1].ravel()


def _seed_setup(case: Case):
    dtype = jnp.dtype(case.dtype)
    if case.problem == "seed-flat":
        f = kr.seed000_f_flat
        y0 = jnp.concatenate([jnp.zeros(1, dtype), jnp.ones(kr.SEED_M, dtype)])

        def pick(ys):
            return ys[case.index][0]
    else:
        f = kr.seed000_f_tree
        y0 = (jnp.zeros((), dtype), jnp.ones(kr.SEED_M, dtype))

        def pick(ys):
            return ys[0][case.index]

    t_span = (jnp.asarray(0.0, dtype), jnp.asarray(2.0, dtype))
    return f, y0, t_span, jnp.asarray(kr.SEED_TS, dtype), pick, jnp.asarray(kr.seed000_z(), dtype)


def odegrad_gradient(case: Case, adjoint) -> np.ndarray:
    def solve(f, y0, t_span, args, ts):
        return og.solve(
            f,
            y0,
            t_span,
            args,
            solver=og.Tsit5(),
            step=og.Adaptive(rtol=case.tol, atol=case.tol),
            saveat=og.SaveAt(ts=ts),
            adjoint=adjoint,
            max_steps=MAX_STEPS,
        )

    if case.problem == "relu":
        ts = jnp.asarray(kr.RELU_TS)
        params = {k: jnp.asarray(v) for k, v in kr.relu_mlp_params().items()}

        def loss(params, y0):
            return jnp.sum(solve(kr.relu_mlp_f, y0, (0.0, 5.0), params, ts).ys ** 2)

        gp, gy = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, jnp.asarray(kr.RELU_Y0))
        return np.concatenate([np.asarray(gp[k]).ravel() for k in ("W1", "b1", "W2", "b2")] + [gy])

    form = "flat" if case.problem == "seed-flat" else "tree"
    fn = kr.seed000_value_and_grad(adjoint, form, case.index, case.dtype, case.tol)
    g = fn(jnp.asarray(kr.seed000_z(), case.dtype))[1]
    return np.asarray(g, dtype=np.float64).ravel()


def diffrax_gradient(case: Case, name: str) -> np.ndarray | None:
    if case.problem == "relu":
        return None
    import diffrax as dfx

    f, y0, t_span, ts, pick, z = _seed_setup(case)

    def loss(z):
        sol = dfx.diffeqsolve(
            dfx.ODETerm(f),
            dfx.Tsit5(),
            t_span[0],
            t_span[1],
            None,
            y0,
            args=z,
            saveat=dfx.SaveAt(ts=ts),
            stepsize_controller=dfx.PIDController(rtol=case.tol, atol=case.tol),
            adjoint=getattr(dfx, name)(),
            max_steps=MAX_STEPS,
        )
        return pick(sol.ys)

    return np.asarray(jax.jit(jax.grad(loss))(z), dtype=np.float64).ravel()


def rel_err(g: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(g - ref) / np.linalg.norm(ref))


def cell(make, ref: np.ndarray) -> str:
    try:
        g = make()
    except Exception as err:  # a failed solve or Backsolve's drift check: report, go on
        print(f"  raised {type(err).__name__}: {str(err).splitlines()[0][:160]}", flush=True)
        return "raised"
    if g is None:
        return "—"
    if not np.all(np.isfinite(g)):
        return "nan"
    return f"{rel_err(g, ref):.1e}"


def smooth_cost_rows(quick: bool) -> list[list[str]]:
    """What error control of the sensitivities costs where it is not needed: ``Forward`` with
    steps held fixed against ``Forward(control_sensitivities=True)`` on smooth problems, the
    gradient of ``sum(ys)`` over 11 saves (time per call, accepted steps, error vs CVODES)."""
    from cvodes import cvodes_gradient
    from reference_problems import get_problem, jax_rhs

    cases = [("lotka_volterra", 1e-6), ("lotka_volterra", 1e-10), ("lorenz", 1e-8)]
    rows = []
    for name, tol in cases[:1] if quick else cases:
        prob = get_problem(name)
        f, ts = jax_rhs(prob), np.asarray(prob.ts(11))
        _, gy0, gp = cvodes_gradient(prob, ts=ts, weights=np.ones((ts.size, prob.n)))
        ref = np.concatenate([gy0, gp])
        cells, calls = {}, {}
        for label, controlled in (("held", False), ("controlled", True)):
            adjoint = og.Forward(control_sensitivities=controlled)

            def loss(y0, p, adjoint=adjoint):
                sol = og.solve(
                    f,
                    y0,
                    (prob.t0, prob.t1),
                    p,
                    step=og.Adaptive(rtol=tol, atol=tol),
                    saveat=og.SaveAt(ts=jnp.asarray(ts)),
                    adjoint=adjoint,
                    max_steps=MAX_STEPS,
                )
                return jnp.sum(sol.ys), sol.stats["accepted"]

            grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
            args = (jnp.asarray(prob.y0), jnp.asarray(prob.params))
            (gy, gpp), steps = grad(*args)
            calls[label] = lambda grad=grad, args=args: grad(*args)
            cells[label] = (int(steps), rel_err(np.concatenate([gy, gpp]), ref))
        times = interleaved_medians(calls, rounds=7, number=5)
        held, ctrl = ((times[k].median, *cells[k]) for k in ("held", "controlled"))
        rows.append(
            [f"{name} tol {tol:g}"]
            + [f"{1e6 * c[0]:.0f} µs, {c[1]} steps, {c[2]:.1e}" for c in (held, ctrl)]
            + [f"{ctrl[0] / held[0]:.2f}x"]
        )
    return rows


def fixed_grid_rows():
    """Rows: relative gradient error of ``y(2)`` in ``(y0, k)`` for ``y' = -k |y| - c``
    (``y0 = 1``, ``k = 1``, ``c = 0.5``; one kink, where ``y`` crosses 0) on fixed grids, against
    the closed form, with and without ``og.switching_events(kinks=True)``."""
    c, big_t = 0.5, 2.0

    def exact(y0, k):  # y falls to 0 at t0 like (y0 + c/k) e^{-kt} - c/k, then y' = k y - c
        t0 = jnp.log((y0 + c / k) / (c / k)) / k
        return (c / k) * (1 - jnp.exp(k * (big_t - t0)))

    f = lambda t, y, k: -k * jnp.abs(y) - c
    want = np.asarray(jax.grad(exact, (0, 1))(1.0, 1.0))
    kinks = og.switching_events(f, 0.0, 1.0, 1.0, kinks=True)
    rows = []
    for label, events in (("no event", None), ("switching_events(kinks=True)", kinks)):
        for name in ("Auto", "Discrete", "Interpolating"):
            row = [f"{name}, {label}"]
            for dt in (1e-2, 1e-3, 1e-4):
                loss = lambda y0, k, dt=dt, name=name, events=events: og.solve(
                    f, y0, (0.0, big_t), k, step=og.Fixed(dt), events=events, max_steps=30_000,
                    adjoint=ADJOINTS[name](),
                ).ys[-1]  # fmt: skip
                g = np.asarray(jax.jit(jax.grad(loss, (0, 1)))(1.0, 1.0))
                row.append(f"{np.linalg.norm(g - want) / np.linalg.norm(want):.1e}")
            rows.append(row)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"only the cases {QUICK}")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    warm_up_jax()
    cases = [c for c in CASES if c.label in QUICK] if args.quick else CASES
    print(environment())
    refs = {}
    for case in cases:
        t0 = time.perf_counter()
        refs[case.label] = reference(case)
        print(f"CVODES reference {case.label}: {time.perf_counter() - t0:.1f} s", flush=True)

    rows = []
    for name, make_adjoint in ADJOINTS.items():
        row = [f"odegrad {name}"]
        for case in cases:
            t0 = time.perf_counter()
            row.append(
                cell(lambda case=case: odegrad_gradient(case, make_adjoint()), refs[case.label])
            )
            print(
                f"{name} / {case.label}: {row[-1]} ({time.perf_counter() - t0:.1f} s)", flush=True
            )
        rows.append(row)
    if importlib.util.find_spec("diffrax") is not None:
        for name in DIFFRAX:
            row = [f"diffrax {name}"]
            for case in cases:
                t0 = time.perf_counter()
                row.append(cell(lambda case=case: diffrax_gradient(case, name), refs[case.label]))
                print(
                    f"{name} / {case.label}: {row[-1]} ({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
            rows.append(row)

    print()
    print("relative gradient error against CVODES, norm(g - g_ref) / norm(g_ref):")
    print()
    print(markdown_table(["adjoint", *(c.label for c in cases)], rows))
    print()
    print("cost of error-controlled sensitivities on smooth problems (Forward, grad of sum(ys)):")
    print()
    headers = ["problem", "steps held fixed", "sensitivities controlled", "time ratio"]
    print(markdown_table(headers, smooth_cost_rows(args.quick)))
    print()
    print("fixed grids, y' = -k|y| - c, relative error of d y(2) / d(y0, k) (closed form):")
    print()
    headers = ["adjoint", "Fixed(1e-2)", "Fixed(1e-3)", "Fixed(1e-4)"]
    print(markdown_table(headers, fixed_grid_rows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
