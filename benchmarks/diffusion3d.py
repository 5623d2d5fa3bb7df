"""Seed 001's 3-d heat diffusion: memory throughput (T_eff) of the right-hand side, of ROCK2's
forward solve and its gradient, against the machine's memory bandwidth — ParallelStencil's
metric, measured out of cache.

``T_eff = A_eff / t`` with ``A_eff`` = 3 arrays (read T, read Ci, write dT/dt) of ``n^3`` values
per right-hand-side evaluation. The reference is a copy of one array of at least 256 MB (read it,
write one), far larger than any cache, so its bandwidth is the memory's: a copy of a 7 MB field
runs from a 32 MB L3 cache at 2.5x that and flatters every ratio. The grids of interest (160^3 and
192^3, 33 and 57 MB per float64 field) do not fit in cache either.

Each size and dtype measures ``og.ROCK2()`` with its defaults (power iteration for the spectral
radius) on fixed steps and on adaptive steps (``rtol = atol = --tol``), ``og.ROCK2`` given the
spectral radius on the same fixed steps, and with its power iteration run to all 20 products
(``power_rtol=0``, no stopping rule), and the gradient of ``sum(T(t1)^2)`` (default adjoint)
for both step choices; the same with the rhs written as one operator, ``lam * Ci *
laplacian(T, h, pad=True)`` (rows marked ``rhs_padded``: the seed's values in a kernel XLA:CPU
vectorises, where the seed's ``set_inner`` form runs as scalar code); one fused ROCK stage
alone, in place (XLA:CPU's kernel for a stage);
the same traffic as the rhs and as a stage without the stencil (the ceilings this machine's
memory sets for those rows: a kernel that reads two fields and writes a third moves four, the
written lines being read first); diffrax (Tsit5, forward) at the smallest size. Also ROCK2 vs
Tsit5 right-hand-side evaluations over a long horizon. The single-kernel rows (rhs, stage,
ceilings) time one kernel per call, so on a GPU, where a kernel on these fields takes ~0.1 ms,
they include the call's dispatch; the solves' rows run tens of kernels per call.

    python benchmarks/diffusion3d.py                       # 96, 160, 192; float64 and float32
    python benchmarks/diffusion3d.py --quick               # 32 and 48, quick
    python benchmarks/diffusion3d.py --sizes 160 --dtypes float64 --rounds 5
    python benchmarks/diffusion3d.py --malloc reuse        # glibc keeps freed memory (below)

``--malloc reuse`` re-runs the script with glibc told to keep freed memory for reuse
(``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2^36``). XLA:CPU allocates a
program's temporary buffer and its outputs on every call; by default glibc maps blocks over 32 MiB
fresh (and a worker thread's arena may be unmapped between calls), so each call page-faults every
page it writes, ~0.4 ms per MiB here: ``x + 1`` on a 31 MiB field took 9.8 ms against 1.4 ms
with the memory reused. Both configurations are what a user may run; the default is the default.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import odegrad as og
from _timing import (
    add_malloc_arg,
    apply_malloc,
    fmt_ratio,
    fmt_time,
    interleaved_medians,
    markdown_table,
    result_row,
    warm_up_jax,
    write_json,
)
from odegrad.problems import diffusion3d

COPY_BYTES = 256 * 2**20  #: the reference copy's array: out of every cache
FIXED_STEPS = 4  #: fixed ROCK2 steps over the span (25 explicit-stable steps each)
PADDED = ", rhs_padded"  #: the rows whose rhs is ``lam Ci laplacian(T, h, pad=True)``


COPY_PASSES = (4, 12)  #: passes of the reference copy per call, two counts: see copy_call


def copy_call(dtype, passes: int):
    """``(call, bytes)``: one call of ``passes`` passes of ``x <- 1.0001 x`` on a ``COPY_BYTES``
    array (read one, write one), in one loop of one call, and the bytes it moves. The
    bandwidth is taken from the difference of two pass counts (:data:`COPY_PASSES`), so the
    call's dispatch and synchronisation cancel: on an H200 one pass per call read 1.39 TB/s in
    float64 and 8 passes 2.75 TB/s, which solve to ~0.17 ms per pass (3.2 TB/s) and ~0.22 ms per
    call. In place: the input is donated, so no call writes into freshly mapped pages (without
    the donation this machine's page faults cap the same copy at 8 GB/s against 51 GB/s).
    Timed in the same interleaved rounds as the solves, so that the machine's drift over a run
    (its copy read 30-52 GB/s in one day) leaves the ratios."""
    n = COPY_BYTES // jnp.dtype(dtype).itemsize

    def one_pass(i, x):  # the barrier keeps XLA from folding the passes into one
        return jax.lax.optimization_barrier(x * 1.0001)

    copy = jax.jit(lambda x: jax.lax.fori_loop(0, passes, one_pass, x), donate_argnums=0)
    state = {"x": copy(jnp.ones(n, dtype))}

    def one():
        state["x"] = copy(state["x"])
        return state["x"]

    return one, 2 * n * jnp.dtype(dtype).itemsize * passes


def fused_stage(p, pars, rhs):
    """A call of one ROCK stage ``u <- mu u1 + nu u + k f(u1)`` alone, writing over ``u`` (its
    buffer donated): one pass that reads ``u1``, ``u`` and ``Ci`` and writes ``u``, the most a
    stage inside a solve can be: what XLA:CPU's stencil kernel gives a stage, the reference for
    the solves' rows (in float32 a solve's power-iteration JVPs, 3 arrays, run faster).
    ``lam`` is a constant of the call: inside a solve XLA hoists ``lam * Ci`` out of the stage
    loop, and a traced ``lam`` multiplied inside the stencil slows XLA:CPU's kernel ~1.5x."""
    lam, ci = pars
    return _in_place(lambda u1, u, c: 1.3 * u1 - 0.3 * u + 1e-3 * rhs(0.0, u1, (lam, c)), p, ci)


def streaming_stage(p, pars):
    """:func:`fused_stage` without the stencil, ``u <- mu u1 + nu u + k Ci u1``: the same four
    arrays streamed once, the ceiling of a stage on this machine's memory system."""
    return _in_place(lambda u1, u, c: 1.3 * u1 - 0.3 * u + 1e-3 * c * u1, p, pars[1])


def streaming_rhs(p, pars):
    """The rhs's traffic without the stencil, ``out <- Ci T`` into a donated buffer: read two
    fields, write a third (which the CPU reads first: write-allocate), the ceiling of the rhs row
    (the in-place copy reads and writes the same lines, so it pays no write-allocate)."""
    return _in_place(lambda T, out, c: c * T, p, pars[1])


def _in_place(fn, p, ci):
    """A call of ``u <- fn(T0, u, Ci)`` with ``u``'s buffer donated."""
    call = jax.jit(fn, donate_argnums=1)
    state = {"u": call(p.T0, p.T0 + 0, ci)}

    def one():
        state["u"] = call(p.T0, state["u"], ci)
        return state["u"]

    return one


def run_size(n, dtype, rounds, args, with_diffrax):
    p = diffusion3d(n, dtype=dtype)
    field = n**3 * jnp.dtype(dtype).itemsize
    pars = (p.lam, p.Ci)
    fixed = og.Fixed(p.t1 / FIXED_STEPS)
    adaptive = og.Adaptive(rtol=args.tol, atol=args.tol)
    variants = {
        "ROCK2(), fixed steps": (og.ROCK2(), fixed, p.rhs),
        "ROCK2(spectral_radius), fixed steps": (og.ROCK2(p.spectral_radius), fixed, p.rhs),
        # the power iteration without its 1 % stopping rule: 20 products, not ~12
        "ROCK2(power_rtol=0), fixed steps": (og.ROCK2(power_rtol=0.0), fixed, p.rhs),
        f"ROCK2(), adaptive {args.tol:g}": (og.ROCK2(), adaptive, p.rhs),
    }
    with_gradient = {"ROCK2(), fixed steps", f"ROCK2(), adaptive {args.tol:g}"}
    if args.padded:
        for name in list(with_gradient):
            solver, step, _ = variants[name]
            variants[name + PADDED] = (solver, step, p.rhs_padded)
            with_gradient.add(name + PADDED)

    rhs = jax.jit(lambda T, a: p.rhs(0.0, T, a)).lower(p.T0, pars).compile()
    (copy_lo, bytes_lo), (copy_hi, bytes_hi) = (copy_call(dtype, k) for k in COPY_PASSES)
    fns = {
        "copy": copy_lo,
        "copy, more passes": copy_hi,
        "rhs": lambda: rhs(p.T0, pars),
        "stage": fused_stage(p, pars, p.rhs),
        "streaming rhs": streaming_rhs(p, pars),
        "streaming stage": streaming_stage(p, pars),
    }
    if args.padded:
        fns["stage" + PADDED] = fused_stage(p, pars, p.rhs_padded)
    evals, steps, compile_s, adjoint_choice = {}, {}, {}, {}
    for name, (solver, step, f) in variants.items():

        def forward(T0, a, solver=solver, step=step, f=f):
            sol = og.solve(f, T0, (0.0, p.t1), a, solver=solver, step=step)
            return sol.ys[-1], sol.stats["rhs_evals"], sol.stats["steps"]

        t0 = time.perf_counter()
        fwd = jax.jit(forward).lower(p.T0, pars).compile()
        compile_s[name] = time.perf_counter() - t0
        evals[name], steps[name] = (int(v) for v in fwd(p.T0, pars)[1:])
        fns[name] = lambda fwd=fwd: fwd(p.T0, pars)
        if name in with_gradient:
            kw = dict(solver=solver, step=step)
            adjoint_choice[name] = og.explain_adjoint(f, p.T0, (0.0, p.t1), pars, **kw)
            loss = lambda T0, a, forward=forward: jnp.sum(forward(T0, a)[0] ** 2)
            t0 = time.perf_counter()
            grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(p.T0, pars).compile()
            compile_s[name + " gradient"] = time.perf_counter() - t0
            fns[name + " gradient"] = lambda grad=grad: grad(p.T0, pars)
    if with_diffrax:
        import diffrax as dfx

        term = dfx.ODETerm(p.rhs)
        ctrl = dfx.PIDController(args.tol, args.tol)
        solve = lambda T0, a: (
            dfx.diffeqsolve(
                term,
                dfx.Tsit5(),
                0.0,
                p.t1,
                None,
                T0,
                a,
                stepsize_controller=ctrl,
                max_steps=100_000,
            ).ys
        )
        t0 = time.perf_counter()
        dfx_fwd = jax.jit(solve).lower(p.T0, pars).compile()
        compile_s["diffrax"] = time.perf_counter() - t0
        fns[f"diffrax Tsit5, adaptive {args.tol:g}"] = lambda: dfx_fwd(p.T0, pars)
    t = interleaved_medians(fns, rounds, 1, budget_s=90)
    bandwidth = (bytes_hi - bytes_lo) / (t["copy, more passes"].best - t["copy"].best)

    def teff(n_evals, seconds):
        rate = 3 * field * n_evals / seconds
        return f"{rate / 1e9:.1f} GB/s", f"{rate / bandwidth:.2f}"

    copy_row = "memory copy, 256 MiB (passes {} - {})".format(*reversed(COPY_PASSES))
    rows = [[copy_row, "", "", f"{bandwidth / 1e9:.1f} GB/s", "1.00"]]
    rows.append(["rhs (3 arrays)", fmt_time(t["rhs"].best), "1", *teff(1, t["rhs"].best)])
    rows.append(["one fused ROCK stage, in place", fmt_time(t["stage"].best), "1",
                 *teff(1, t["stage"].best)])  # fmt: skip
    if args.padded:
        rows.append([f"one fused ROCK stage, in place{PADDED}", fmt_time(t["stage" + PADDED].best),
                     "1", *teff(1, t["stage" + PADDED].best)])  # fmt: skip
    # the memory system's ceilings for those two rows: the same traffic without the stencil
    for name, label in [("streaming rhs", "rhs's traffic, no stencil: Ci T into a buffer"),
                        ("streaming stage", "stage's traffic, no stencil, in place")]:  # fmt: skip
        rows.append([f"  ceiling: {label}", fmt_time(t[name].best), "", *teff(1, t[name].best)])
    for name in variants:
        rows.append(
            [name, fmt_time(t[name].best), str(evals[name]), *teff(evals[name], t[name].best)]
        )
        if name in with_gradient:
            g = t[name + " gradient"].best
            rows.append([f"  gradient (Auto), {fmt_ratio(g, t[name].best)} of forward",
                         fmt_time(g), "", "", ""])  # fmt: skip
    for name in fns:
        if name.startswith("diffrax"):
            rows.append([name, fmt_time(t[name].best), "", "", ""])
    print(f"\n### {n}^3, {jnp.dtype(dtype).name} (best of {rounds})\n")
    print(markdown_table(["what", "time", "rhs evals", "T_eff", "T_eff / T_copy"], rows))
    for name, text in adjoint_choice.items():  # what the gradient rows recompute, if anything
        print(f"\n{name}: {steps[name]} steps. {text}")

    problem = f"diffusion3d {n}^3 {jnp.dtype(dtype).name} ROCK2"
    main = f"ROCK2(), adaptive {args.tol:g}"
    out = [
        result_row(
            problem,
            "odegrad ROCK2() Auto()",
            "odegrad",
            t[main].best,
            t[main + " gradient"].best,
            compile_s[main],
            compile_s[main + " gradient"],
        )
    ]
    notes = []
    for name in ("ROCK2(), fixed steps", "ROCK2(), fixed steps" + PADDED):
        if name in variants:
            ratio = (3 * field * evals[name] / t[name].best) / bandwidth
            notes.append(
                f"{problem}: default {name.replace('fixed steps', f'on {FIXED_STEPS} fixed steps')}"
                f" T_eff / T_copy(256 MiB) = {ratio:.2f} ({evals[name]} rhs evals, best of "
                f"{rounds})"
            )
    return out, "; ".join(notes)


def evals_comparison(dtype, args):
    """ROCK2 vs Tsit5 over 2000 explicit-stable steps' worth of time."""
    p = diffusion3d(24, dtype=dtype, steps=2000)
    rows = []
    for name, solver in [
        ("Tsit5", og.Tsit5()),
        ("ROCK2", og.ROCK2(p.spectral_radius)),
        ("ROCK2 (power iteration)", og.ROCK2()),
    ]:
        t0 = time.perf_counter()
        sol = og.solve(
            p.rhs,
            p.T0,
            (0.0, p.t1),
            (p.lam, p.Ci),
            solver=solver,
            step=og.Adaptive(args.tol, args.tol),
            max_steps=100_000,
        )
        rows.append(
            [
                name,
                int(sol.stats["steps"]),
                int(sol.stats["rhs_evals"]),
                f"{time.perf_counter() - t0:.2f} s",
            ]
        )
    print("\n### rhs evaluations over 2000 explicit-stable steps (24^3)\n")
    print(markdown_table(["solver", "steps", "rhs evals", "wall (incl. compile)"], rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", type=int, nargs="+", default=[96, 160, 192])
    # seed 001's ParallelStencil code runs Float64
    ap.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-diffrax", dest="diffrax", action="store_false")
    ap.add_argument(
        "--no-padded",
        dest="padded",
        action="store_false",
        help="skip the rows of the rhs written as laplacian(T, h, pad=True)",
    )
    ap.add_argument("--json", default=None, help="write the key rows (largest size) to this file")
    add_malloc_arg(ap)
    args = ap.parse_args()
    apply_malloc(args.malloc)
    warm_up_jax()
    jax.config.update("jax_enable_x64", True)  # float32 arrays stay float32
    sizes = [32, 48] if args.quick else args.sizes
    rounds = 2 if args.quick else args.rounds
    results = []
    for name in args.dtypes:
        dtype = jnp.dtype(name)
        for i, n in enumerate(sizes):
            results.append(run_size(n, dtype, rounds, args, args.diffrax and i == 0))
    evals_comparison(jnp.dtype(args.dtypes[0]), args)
    rows = [r for out, _ in results for r in out]
    write_json(
        args.json,
        "diffusion3d",
        rows,
        settings=f"rtol=atol={args.tol:g}; times are the best of the rounds",
        notes=[note for _, note in results],
    )


if __name__ == "__main__":
    main()
