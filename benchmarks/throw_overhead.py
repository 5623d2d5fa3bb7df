"""What the default ``throw=True`` costs a successful solve: time per call and compile time,
against ``throw=False``, in one process, interleaved.

Workloads (float64 Lotka–Volterra, Tsit5, ``rtol = atol = 1e-6``, ``og.Auto()``):

* ``single``: one jitted solve, ``SaveAt(t1)``: ~70 us, where a fixed cost per call shows most;
* ``single, 50 saves``: the same with ``SaveAt(ts)`` of 50 times;
* ``vmap 64``: the single solve vmapped over 64 initial states;
* ``fixed grid``: ``og.Fixed(0.01)`` (1000 steps), 50 saves: the check tests the saved rows
  and the final state for inf and nan (a solve with adaptive steps tests each step anyway).

A successful solve's check runs no host callback: the error's callback sits in a branch taken
only on failure (``odegrad._solution.host_check``). What is left is that branch's conditional
and operands, and ``sol.result``, which ``throw=False`` skips when nothing reads it.

    python benchmarks/throw_overhead.py [--rounds 40] [--number 100]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import odegrad as og
from _timing import (
    compile_timed,
    environment,
    fmt_compile,
    fmt_timing,
    interleaved_medians,
    markdown_table,
    warm_up_jax,
)


def lotka_volterra(t, y, a):
    x, z = y[0], y[1]
    return jnp.stack([a[0] * x - a[1] * x * z, -a[2] * z + a[3] * x * z])


def workloads():
    """name -> (make(throw) -> fresh function, arguments)."""
    a = jnp.array([1.5, 1.0, 3.0, 1.0])
    ts = jnp.linspace(0.0, 10.0, 50)

    def solver(saveat=None, step=None):
        def make(throw):
            def solve(y0, a):
                return og.solve(
                    lotka_volterra, y0, (0.0, 10.0), a, saveat=saveat, step=step, throw=throw
                ).ys

            return solve

        return make

    def batched(make_one):
        return lambda throw: jax.vmap(make_one(throw), (0, None))

    y0 = jnp.array([1.0, 1.0])
    y0s = y0 + jnp.linspace(0.0, 0.5, 64)[:, None]
    return {
        "single": (solver(), (y0, a)),
        "single, 50 saves": (solver(og.SaveAt(ts=ts)), (y0, a)),
        "vmap 64": (batched(solver()), (y0s, a)),
        "fixed grid, 50 saves": (solver(og.SaveAt(ts=ts), og.Fixed(0.01)), (y0, a)),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--number", type=int, default=100)
    ap.add_argument("--compile-reps", type=int, default=3)
    args = ap.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    warm_up_jax()
    compiled, calls = {}, {}
    for name, (make, inputs) in workloads().items():
        for throw in (True, False):
            c = compile_timed(lambda make=make, throw=throw: make(throw), inputs, args.compile_reps)
            compiled[name, throw] = c
            # called through jax.jit, as users do: an ahead-of-time compiled program holding a
            # host callback (taken or not) is dispatched by JAX's Python path, ~80 us a call
            jitted = jax.jit(make(throw))
            calls[f"{name}|{throw}"] = lambda f=jitted, inputs=inputs: f(*inputs)
    times = interleaved_medians(calls, args.rounds, args.number)
    rows = []
    for name in workloads():
        on, off = times[f"{name}|True"], times[f"{name}|False"]
        rows.append(
            [
                name,
                fmt_timing(on),
                fmt_timing(off),
                f"{on.median / off.median:.3f}x",
                fmt_compile(compiled[name, True]),
                fmt_compile(compiled[name, False]),
            ]
        )
    print("## throw=True against throw=False on a successful solve\n")
    print(environment())
    print(
        f"{args.rounds} interleaved rounds x {args.number} calls, time per call, median (min); "
        f"compile = trace+lower + XLA compile, cold (of which trace+lower), median of "
        f"{args.compile_reps}\n"
    )
    headers = ["workload", "throw=True", "throw=False", "ratio", "compile, throw", "compile, no"]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
