"""Jumps at known times: a piecewise-constant input read from a data table, with and without
``og.Adaptive(jump_ts=)``, side by side with diffrax's ``ClipStepSizeController(jump_ts=)``.

``y' = -k y + u(t)``, ``u`` constant on each of 20 intervals of ``[0, 10]`` (values from a
table, looked up with ``jnp.searchsorted``: no switch reader sees it). ``y(10)`` and its
gradient in ``(k, u)``, vmapped over 64 decay rates, against the closed form (a product of
exponentials). Tsit5, ``rtol = atol = 1e-8``, float64, each solver's defaults otherwise.

    python benchmarks/jump_ts.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import odegrad as og  # noqa: E402
from _timing import fmt_time, interleaved_medians, markdown_table  # noqa: E402

KNOTS = jnp.linspace(0.0, 10.0, 21)
VALS = jnp.asarray(np.random.default_rng(0).uniform(-1.0, 2.0, 20))
RATES = jnp.linspace(0.3, 1.5, 64)
TOL = 1e-8


def table(t, y, p):
    return -p["k"] * y + p["u"][jnp.searchsorted(KNOTS[1:-1], t, side="right")]


def exact(p, y0=0.5):
    y = y0
    for i in range(20):
        u = p["u"][i] / p["k"]
        y = u + (y - u) * jnp.exp(-p["k"] * (KNOTS[i + 1] - KNOTS[i]))
    return y


def odegrad_solve(adjoint, jumps):
    step = og.Adaptive(TOL, TOL, jump_ts=jumps)
    return lambda p: og.solve(table, 0.5, (0.0, 10.0), p, adjoint=adjoint, step=step)


def diffrax_loss(jumps, adjoint=None):
    try:
        import diffrax as dfx
    except ImportError:
        return None

    def loss(p):
        ctrl = dfx.PIDController(rtol=TOL, atol=TOL)
        if jumps is not None:  # (diffrax >= 0.7; before, PIDController(jump_ts=))
            ctrl = dfx.ClipStepSizeController(ctrl, jump_ts=jumps)
        kw = {} if adjoint is None else {"adjoint": getattr(dfx, adjoint)()}
        return dfx.diffeqsolve(dfx.ODETerm(table), dfx.Tsit5(), 0.0, 10.0, None, 0.5, p,
                               stepsize_controller=ctrl, max_steps=16384, **kw).ys  # fmt: skip

    return loss


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    inner = KNOTS[1:-1]
    want = jax.vmap(lambda k: jax.grad(exact)({"k": k, "u": VALS}))(RATES)
    solves = {
        "odegrad Auto, no jump_ts": odegrad_solve(og.Auto(), None),
        "odegrad Auto, jump_ts": odegrad_solve(og.Auto(), inner),
        "odegrad Interpolating, no jump_ts": odegrad_solve(og.Interpolating(), None),
        "odegrad Interpolating, jump_ts": odegrad_solve(og.Interpolating(), inner),
    }
    losses, stats = {}, {}
    for name, solve in solves.items():
        losses[name] = lambda p, solve=solve: solve(p).ys[-1]
        st = solve({"k": 0.8, "u": VALS}).stats
        stats[name] = f"{int(st['accepted'])} / {int(st['rejected'])} / {int(st['rhs_evals'])}"
    for name, jumps, adjoint in [
        ("diffrax default, no jump_ts", None, None),
        ("diffrax default, jump_ts", inner, None),
        ("diffrax BacksolveAdjoint, jump_ts", inner, "BacksolveAdjoint"),
    ]:
        loss = diffrax_loss(jumps, adjoint)
        if loss is not None:
            losses[name], stats[name] = (lambda p, loss=loss: loss(p)[-1]), ""
    rows, calls = [], {}
    for name, loss in losses.items():
        fn = jax.jit(jax.vmap(lambda k, loss=loss: jax.value_and_grad(loss)({"k": k, "u": VALS})))
        start = time.perf_counter()
        got = jax.block_until_ready(fn(RATES)[1])
        compile_s = time.perf_counter() - start
        err_k, err_u = (
            float(jnp.max(jnp.abs(got[n] - want[n])) / jnp.max(jnp.abs(want[n]))) for n in "ku"
        )
        rows.append([name, stats[name], f"{err_k:.1e}", f"{err_u:.1e}", f"{compile_s:.2f} s"])
        calls[name] = lambda fn=fn: fn(RATES)
    t = interleaved_medians(calls, args.rounds, 5)
    for row in rows:
        row += [fmt_time(t[row[0]].median), fmt_time(t[row[0]].best)]
    print(f"\n### a 20-step table input: y(10), d y(10)/d(k, u), vmap 64 rates, rtol {TOL:g}\n")
    head = ["method", "steps / rejected / evals (k = 0.8)", "dy/dk error (rel)",
            "dy/du error (rel)", "first call (compile)", "median", "min"]  # fmt: skip
    print(markdown_table(head, rows))


if __name__ == "__main__":
    main()
