"""Weak scaling of seed 001's 3-d heat diffusion over 1, 2, 4 and 8 devices.

Each device holds one ``block^3`` slab of the temperature and heat-capacity fields (global grid
``(block * mx, block * my, block)`` on an ``mx x my`` mesh: 1x1, 2x1, 2x2, 4x2), and the fields
are sharded with the halo-exchange right-hand side ``Diffusion3D.sharded_rhs``. Per device count,
in its own process (``XLA_FLAGS=--xla_force_host_platform_device_count=N``, or the real devices
with ``--real``), it reports:

* time per step of the forward solve (ROCK2, fixed steps) and of its gradient (Interpolating
  adjoint, dL/dlam and the whole dL/dCi), interleaved median (min) over rounds;
* per-device memory: the compiled gradient's temporary buffers plus its arguments, per device
  (``memory_analysis()``);
* bytes each device sends per step: the collective-permute operands of one right-hand-side
  evaluation read from the compiled HLO (checked against the analytic halo count) times the
  evaluations per step.

    python benchmarks/scaling.py [--block 32] [--devices 1 2 4 8] [--steps 10] [--quick]

On CPU the forced devices share the machine's cores (and every collective is a rendezvous of
threads), so the time per step grows with the device count there: the table measures the
overhead of the scheme, not a speed-up. On real GPUs (``--real``) the time per step should stay
flat.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MESHES = {1: (1, 1), 2: (2, 1), 4: (2, 2), 8: (4, 2)}
_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1}


def hlo_permute_bytes(hlo: str) -> int:
    """Bytes of every ``collective-permute`` result in an HLO module text (static count)."""
    total = 0
    for m in re.finditer(r"= (\w+)\[([\d,]*)\][^=]*? collective-permute(?:-start)?\(", hlo):
        dims = [int(d) for d in m.group(2).split(",") if d]
        n = 1
        for d in dims:
            n *= d
        total += n * _DTYPE_BYTES.get(m.group(1), 8)
    return total


def worker(a) -> dict:
    """One device count, in this process: the figures of one table row."""
    import jax

    jax.config.update("jax_enable_x64", a.dtype == "float64")
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import odegrad as og
    from _timing import interleaved_medians, warm_up_jax
    from odegrad.problems import Diffusion3D, diffusion3d
    from odegrad.stencil import halo_bytes

    warm_up_jax()
    d = a.worker
    mx, my = MESHES[d]
    if len(jax.devices()) < d:
        raise SystemExit(f"{d} devices wanted, {len(jax.devices())} present")
    mesh = jax.make_mesh((mx, my), ("x", "y"), devices=jax.devices()[:d])
    dtype = jnp.dtype(a.dtype)
    b = a.block
    shape = (b * mx, b * my, b)
    # seed 001's fields, on the weak-scaling grid (the same spacing for every device count)
    base = diffusion3d(b, dtype=dtype)
    h = base.spacing[0]
    idx = [np.arange(m) * h for m in shape]
    X, Y, Z = np.meshgrid(*idx, indexing="ij")
    c = [m * h / 2 for m in shape]
    T0 = 100 * np.exp(-(((X - c[0]) / 2) ** 2) - ((Y - c[1]) / 2) ** 2 - ((Z - c[2]) / 2) ** 2)
    Ci = 1.0 / (1.0 + 5 * np.exp(-((X - c[0]) ** 2) - (Y - c[1]) ** 2 - (Z - c[2] / 1.5) ** 2))
    p = Diffusion3D(
        n=b,
        spacing=base.spacing,
        T0=jnp.asarray(T0, dtype),
        Ci=jnp.asarray(Ci, dtype),
        lam=jnp.asarray(1.0, dtype),
        dt_explicit=base.dt_explicit,
        t1=base.t1,
    )
    field = NamedSharding(mesh, P("x", "y"))
    T = jax.device_put(p.T0, field)
    C = jax.device_put(p.Ci, field)
    lam = jax.device_put(p.lam, NamedSharding(mesh, P()))
    rhs = p.sharded_rhs(mesh)
    dt = a.dt_factor * p.dt_explicit
    t1 = a.steps * dt
    solver = og.ROCK2(p.spectral_radius)

    def solve(T0, lam, Ci, adjoint=None):
        return og.solve(
            rhs, T0, (0.0, t1), (lam, Ci), solver=solver, step=og.Fixed(dt), adjoint=adjoint
        )

    def forward(T0, lam, Ci):
        sol = solve(T0, lam, Ci)
        return sol.ys[-1], sol.stats["rhs_evals"]

    def loss(lam, Ci, T0):
        return jnp.sum(solve(T0, lam, Ci, og.Interpolating()).ys[-1])

    fwd = jax.jit(forward).lower(T, lam, C).compile()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(lam, C, T).compile()
    rhs_c = jax.jit(lambda T_, C_: rhs(0.0, T_, (lam, C_))).lower(T, C).compile()
    evals = int(fwd(T, lam, C)[1])
    timings = interleaved_medians(
        {"forward": lambda: fwd(T, lam, C), "gradient": lambda: grad(lam, C, T)},
        a.rounds,
        a.number,
        a.budget,
    )
    mem = grad.memory_analysis()
    per_device = int(mem.temp_size_in_bytes) + int(mem.argument_size_in_bytes)
    hlo_bytes = hlo_permute_bytes(rhs_c.as_text())
    analytic = halo_bytes(shape, P("x", "y"), mesh, 1, dtype.itemsize, corners=False)
    return {
        "devices": d,
        "mesh": f"{mx}x{my}",
        "grid": "x".join(map(str, shape)),
        "forward_step_s": timings["forward"].median / a.steps,
        "forward_step_min_s": timings["forward"].best / a.steps,
        "gradient_step_s": timings["gradient"].median / a.steps,
        "gradient_step_min_s": timings["gradient"].best / a.steps,
        "evals_per_step": evals / a.steps,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "device_bytes": per_device,
        "halo_bytes_rhs_hlo": hlo_bytes,
        "halo_bytes_rhs_analytic": analytic,
        "halo_bytes_step": hlo_bytes * evals / a.steps,
        "reduced": timings["forward"].reduced or timings["gradient"].reduced,
    }


def run_worker(d: int, a) -> dict:
    env = dict(os.environ)
    if not a.real:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={d}"
        env.setdefault("JAX_PLATFORMS", "cpu")
    src = os.path.join(HERE, "..", "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, src, env.get("PYTHONPATH")]))
    argv = [sys.executable, os.path.abspath(__file__), f"--worker={d}"]
    for k in ("block", "steps", "dt_factor", "rounds", "number", "budget", "dtype"):
        argv.append(f"--{k.replace('_', '-')}={getattr(a, k)}")
    if a.real:
        argv.append("--real")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout)
    if proc.returncode:
        raise RuntimeError(f"{d} devices failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", type=int, default=32, help="grid points per device and axis")
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8], choices=list(MESHES))
    ap.add_argument("--steps", type=int, default=10, help="fixed ROCK2 steps per solve")
    ap.add_argument("--dt-factor", type=float, default=20.0, help="step / explicit-stable step")
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument("--real", action="store_true", help="use the real devices (GPUs), not forced")
    ap.add_argument("--quick", action="store_true", help="block 16, 1, 2 and 4 devices, 3 rounds")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    from _timing import add_timing_args

    add_timing_args(ap, rounds=5, number=1, budget=60.0)
    a = ap.parse_args(argv)
    if a.quick:
        a.block, a.devices, a.rounds = 16, [1, 2, 4], 3
    if a.worker is not None:
        print(json.dumps(worker(a)))
        return

    import jax

    from _timing import environment, fmt_bytes, fmt_time, markdown_table, result_row, write_json

    jax.config.update("jax_enable_x64", a.dtype == "float64")  # for the environment line

    rows, table = [], []
    base = None
    for d in a.devices:
        r = run_worker(d, a)
        rows.append(r)
        base = base or r
        eff = base["gradient_step_s"] / r["gradient_step_s"]
        mark = "*" if r["reduced"] else ""
        table.append(
            [
                f"{d} ({r['mesh']})",
                r["grid"],
                f"{fmt_time(r['forward_step_s'])} ({fmt_time(r['forward_step_min_s'])}){mark}",
                f"{fmt_time(r['gradient_step_s'])} ({fmt_time(r['gradient_step_min_s'])}){mark}",
                f"{eff:.2f}",
                f"{r['evals_per_step']:.1f}",
                fmt_bytes(r["temp_bytes"]),
                fmt_bytes(r["device_bytes"]),
                f"{r['halo_bytes_rhs_hlo'] / 1024:.1f} KiB",
                f"{r['halo_bytes_rhs_analytic'] / 1024:.1f} KiB",
                f"{r['halo_bytes_step'] / 1024:.1f} KiB",
            ]
        )
    print(environment())
    kind = "real devices" if a.real else "forced host devices sharing the CPU cores"
    print(
        f"weak scaling, {a.block}^3 {a.dtype} per device, ROCK2 Fixed({a.dt_factor:g} x explicit "
        f"dt), {a.steps} steps, {kind}; median (min) of {a.rounds} rounds\n"
    )
    print(
        markdown_table(
            [
                "devices (mesh)",
                "global grid",
                "forward / step",
                "gradient / step",
                "efficiency (gradient)",
                "rhs evals / step",
                "temp / device",
                "memory / device",
                "halo / rhs (HLO)",
                "halo / rhs (analytic)",
                "halo sent / step",
            ],
            table,
        )
    )
    print(
        "\nefficiency = gradient time per step on 1 device / on N (1.00 = perfect weak scaling);"
        " memory / device = temporaries + arguments of the compiled gradient; halo = the messages"
        " of one device per right-hand side (two slabs per sharded axis; the forward pass only,"
        " the reverse pass sends as much again per evaluation)."
    )
    write_json(
        a.json,
        "scaling",
        [
            result_row(
                f"diffusion3d weak {r['devices']} devices",
                "ROCK2 Fixed + Interpolating",
                "odegrad",
                forward=r["forward_step_s"],
                gradient=r["gradient_step_s"],
            )
            for r in rows
        ],
        settings=f"block={a.block} steps={a.steps} dt_factor={a.dt_factor} dtype={a.dtype}",
    )


if __name__ == "__main__":
    main()
