"""Seed 001's 3-d heat diffusion on several processes (``jax.distributed``), with its gradient.

    python examples/multiprocess_diffusion.py [--processes 2] [--n 12] [--steps 10] [--quick]

Starts ``--processes`` worker processes on this machine (one CPU device each, gloo collectives
over localhost). Together they hold the temperature field and the heat-capacity field ``Ci``
sharded along x, one slab per process; they solve with ROCK2 and the Interpolating adjoint and
compute the loss (sum of the final field) and its gradient with respect to ``lam`` and the whole
``Ci`` field, exchanging only halo planes between neighbouring processes. The launcher then
solves the same problem in one process on one device and compares: they must agree to 1e-12
(float64). On a cluster, run the worker part (``--process-id``) once per host with the
coordinator's address instead.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np


def _problem(a):
    import jax.numpy as jnp

    from odegrad.problems import diffusion3d

    return diffusion3d(a.n, dtype=jnp.float64, steps=a.steps)


def _loss(a, p, rhs):
    import jax.numpy as jnp

    import odegrad as og

    def loss(lam, Ci, T0):  # T0 an argument: a multi-process array cannot be closed over
        sol = og.solve(
            rhs,
            T0,
            (0.0, p.t1),
            (lam, Ci),
            solver=og.ROCK2(p.spectral_radius) if a.solver == "rock2" else og.Tsit5(),
            step=og.Adaptive(rtol=a.tol, atol=a.tol),
            adjoint=og.Interpolating(),
            max_steps=a.max_steps,
        )
        return jnp.sum(sol.ys[-1])

    return loss


def worker(a) -> None:
    """One process of the distributed run: its slab of the fields, its share of the work."""
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the default in jax 0.10
    jax.distributed.initialize(
        coordinator_address=f"localhost:{a.port}",
        num_processes=a.processes,
        process_id=a.process_id,
        initialization_timeout=60,
    )
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    p = _problem(a)
    mesh = jax.make_mesh((jax.device_count(),), ("x",))  # one device per process here
    field = NamedSharding(mesh, P("x"))

    def global_array(x, sharding):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    T0 = global_array(p.T0, field)
    Ci = global_array(p.Ci, field)
    lam = global_array(p.lam, NamedSharding(mesh, P()))
    rhs = p.sharded_rhs(mesh, P("x"))
    t0 = time.perf_counter()
    value_and_grad = (
        jax.jit(jax.value_and_grad(_loss(a, p, rhs), argnums=(0, 1))).lower(lam, Ci, T0).compile()
    )
    t1 = time.perf_counter()
    value, (g_lam, g_ci) = jax.block_until_ready(value_and_grad(lam, Ci, T0))
    seconds = time.perf_counter() - t1
    compile_s = t1 - t0
    mine = [s.index for s in g_ci.addressable_shards]
    g_full = multihost_utils.process_allgather(g_ci, tiled=True)  # for the check only
    if a.process_id == 0:
        np.savez(
            a.out,
            value=np.asarray(value),
            g_lam=np.asarray(g_lam),
            g_ci=np.asarray(g_full),
            seconds=seconds,
            compile_seconds=compile_s,
        )
    print(
        f"process {a.process_id}: owns the dL/dCi block {mine}; compile {compile_s:.2f} s, "
        f"run {seconds:.2f} s",
        flush=True,
    )
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(a) -> dict:
    """Start the workers, run the single-process reference here, compare; returns the figures."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.npz")
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)  # one CPU device per process
        env["JAX_PLATFORMS"] = "cpu"
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        common = [f"--{k}={v}" for k, v in (("n", a.n), ("steps", a.steps), ("tol", a.tol))]
        common.append(f"--solver={a.solver}")
        common += [f"--max-steps={a.max_steps}", f"--processes={a.processes}", f"--port={port}"]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, *common, f"--process-id={i}", f"--out={out}"], env=env
            )
            for i in range(a.processes)
        ]
        t0 = time.perf_counter()
        try:
            codes = [proc.wait(timeout=a.timeout) for proc in procs]
        finally:
            for proc in procs:  # only the processes started here
                if proc.poll() is None:
                    proc.kill()
        wall = time.perf_counter() - t0
        if any(codes):
            raise RuntimeError(f"worker processes exited with codes {codes}")
        got = dict(np.load(out))

    import jax

    jax.config.update("jax_enable_x64", True)
    p = _problem(a)
    ref = jax.jit(jax.value_and_grad(_loss(a, p, p.rhs), argnums=(0, 1)))
    value, (g_lam, g_ci) = ref(p.lam, p.Ci, p.T0)

    def rel(x, y):
        x, y = np.asarray(x), np.asarray(y)
        return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))

    figures = {
        "processes": a.processes,
        "n": a.n,
        "loss": float(value),
        "rel_loss": rel(got["value"], value),
        "rel_g_lam": rel(got["g_lam"], g_lam),
        "rel_g_ci": rel(got["g_ci"], g_ci),
        "worker_seconds": float(got["seconds"]),
        "worker_compile_seconds": float(got["compile_seconds"]),
        "wall_seconds": wall,
    }
    return figures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--n", type=int, default=12, help="grid points per dimension")
    ap.add_argument("--steps", type=int, default=10, help="horizon in explicit-stable steps")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument(
        "--solver",
        choices=["rock2", "tsit5"],
        default="rock2",
        help="rock2 (the seed's) or tsit5 (compiles about 3x faster: the CI test uses it)",
    )
    ap.add_argument("--max-steps", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="--solver=tsit5, for CI")
    ap.add_argument("--timeout", type=float, default=120, help="seconds for the workers")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--process-id", type=int, help=argparse.SUPPRESS)  # worker mode
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.solver = "tsit5"
    if a.n % a.processes:
        ap.error(f"--n={a.n} must be divisible by --processes={a.processes}")
    if a.process_id is not None:
        worker(a)
        return 0
    figures = launch(a)
    worst = max(figures["rel_loss"], figures["rel_g_lam"], figures["rel_g_ci"])
    print(
        f"{a.processes} processes vs 1, n={a.n}^3: loss {figures['loss']:.10g}; largest "
        f"relative difference (loss, dL/dlam, dL/dCi) {worst:.1e}; workers "
        f"{figures['worker_seconds']:.2f} s for the gradient (compile "
        f"{figures['worker_compile_seconds']:.1f} s), {figures['wall_seconds']:.1f} s wall"
    )
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1)
    return 0 if worst <= 1e-12 else 1


if __name__ == "__main__":
    sys.exit(main())
