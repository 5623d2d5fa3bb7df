"""Eager calls: ``og.solve`` called in a Python loop, outside ``jax.jit``, as from a notebook.

Lotka–Volterra (Tsit5, rtol = atol = 1e-6, 20 saves on [0, 10]) and diffrax's neural-ODE field
(an equinox MLP 2 -> 64 -> 64 -> 2 passed as ``args``), each solved ``--calls`` times with new
initial values. Reported per contestant: the first call (trace and compile), the second, and
the median of the calls after (what a loop pays per iteration). Contestants: odegrad's
``og.solve``, diffrax's ``diffeqsolve`` (wrapped in ``eqx.filter_jit`` by diffrax), and
SciPy's ``solve_ivp`` (RK45, on the Lotka–Volterra problem), each where installed.

    python benchmarks/eager.py
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import odegrad as og

RTOL = ATOL = 1e-6
TS = np.linspace(0.0, 10.0, 20)


def lotka_volterra(t, y, a):
    return jnp.stack([a[0] * y[0] - a[1] * y[0] * y[1], a[3] * y[0] * y[1] - a[2] * y[1]])


def _times(call, n_calls):
    out = []
    for i in range(n_calls):
        t = time.perf_counter()
        jax.block_until_ready(call(i))
        out.append(time.perf_counter() - t)
    return out[0], out[1], statistics.median(out[2:])


def contestants(n_calls):
    a = jnp.asarray([1.5, 1.0, 3.0, 1.0])
    y0 = lambda i: jnp.asarray([1.0 + 0.01 * i, 1.0])
    rows = {}
    step = og.Adaptive(RTOL, ATOL)
    rows["odegrad, Lotka-Volterra"] = _times(
        lambda i: og.solve(lotka_volterra, y0(i), (0.0, 10.0), a, step=step,
                           saveat=og.SaveAt(ts=TS)).ys,
        n_calls,
    )  # fmt: skip
    have_diffrax = importlib.util.find_spec("diffrax") is not None
    if have_diffrax:
        import diffrax as dfx

        term = dfx.ODETerm(lotka_volterra)
        ctrl = dfx.PIDController(rtol=RTOL, atol=ATOL)
        rows["diffrax, Lotka-Volterra"] = _times(
            lambda i: dfx.diffeqsolve(term, dfx.Tsit5(), 0.0, 10.0, None, y0(i), a,
                                      stepsize_controller=ctrl, saveat=dfx.SaveAt(ts=TS)).ys,
            n_calls,
        )  # fmt: skip
    if importlib.util.find_spec("scipy") is not None:
        from scipy.integrate import solve_ivp

        an = np.asarray(a)
        rhs = lambda t, y: [an[0] * y[0] - an[1] * y[0] * y[1], an[3] * y[0] * y[1] - an[2] * y[1]]
        rows["scipy solve_ivp (RK45), Lotka-Volterra"] = _times(
            lambda i: solve_ivp(rhs, (0.0, 10.0), np.asarray(y0(i)), t_eval=TS, rtol=RTOL,
                                atol=ATOL).y,
            n_calls,
        )  # fmt: skip
    if importlib.util.find_spec("equinox") is not None:
        import equinox as eqx

        mlp = eqx.nn.MLP(2, 2, 64, 2, activation=jax.nn.softplus, final_activation=jnp.tanh,
                         key=jax.random.PRNGKey(0))  # fmt: skip
        field = lambda t, y, m: m(y)
        ts = np.linspace(0.0, 10.0, 100)
        step3 = og.Adaptive(1e-3, 1e-6)
        rows["odegrad, neural field"] = _times(
            lambda i: og.solve(field, y0(i), (0.0, 10.0), mlp, step=step3,
                               saveat=og.SaveAt(ts=ts)).ys,
            n_calls,
        )  # fmt: skip
        if have_diffrax:
            ctrl3 = dfx.PIDController(rtol=1e-3, atol=1e-6)
            rows["diffrax, neural field"] = _times(
                lambda i: dfx.diffeqsolve(dfx.ODETerm(field), dfx.Tsit5(), 0.0, 10.0, None,
                                          y0(i), mlp, stepsize_controller=ctrl3,
                                          saveat=dfx.SaveAt(ts=ts)).ys,
                n_calls,
            )  # fmt: skip
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=30, help="calls per contestant (at least 3)")
    args = ap.parse_args(argv)
    rows = contestants(max(args.calls, 3))
    where = f"{jax.default_backend()}, jax {jax.__version__}"
    print(f"Eager calls, {args.calls} per contestant ({where})\n")
    print("| contestant | first call | second call | each call after (median) |")
    print("|---|--:|--:|--:|")
    for name, (first, second, rest) in rows.items():
        print(f"| {name} | {first * 1e3:.0f} ms | {second * 1e3:.1f} ms | {rest * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
