"""Where a seed-001 solve's time goes, kernel by kernel: one call of a jitted ROCK2 forward solve
or gradient on an ``n^3`` grid, recorded with ``jax.profiler`` and summed by kernel kind (XLA:CPU
thunks, or the GPU's kernels), with each kind's count and the bytes a pass over one field moves.

    python benchmarks/kernel_profile.py 160 float64 fixed
    python benchmarks/kernel_profile.py 160 float64 adaptive grad
    python benchmarks/kernel_profile.py 256 float32 fixed grad --top 25
    python benchmarks/kernel_profile.py 16 float64 adaptive grad --tol 1e-6 --adjoint interpolating
    python benchmarks/kernel_profile.py 160 float64 fixed grad --padded   # laplacian(pad=True)

A kind is a kernel's name without its numeric suffix (``multiply_add_fusion.12`` and
``loop_multiply_add_fusion_3`` count under ``multiply_add_fusion``); containers (``while``,
``cond``) are listed apart, since their time includes the kernels they run. The sum of the
kernels against the call's wall time shows what the kernels do not account for (dispatch,
synchronisation, host work). See docs/stencil.md.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time

import jax
import jax.numpy as jnp

import odegrad as og
from odegrad.problems import diffusion3d

_ADJOINTS = {
    "auto": og.Auto,
    "discrete": og.Discrete,
    "interpolating": og.Interpolating,
    "quadrature": og.Quadrature,
}
_CONTAINERS = ("while", "cond", "conditional", "call")
_HOST = ("PjitFunction", "CommonPjRt", "ThunkExecutor", "$", "SlinkyThreadPool", "end: ")


def kind(name: str) -> str:
    """``multiply_add_fusion.12`` / ``loop_multiply_add_fusion_3`` -> ``multiply_add_fusion``."""
    name = re.sub(r"([._]\d+)?(\.clone)*([._]\d+)?$", "", name)
    return re.sub(r"^(loop|input)_", "", name)


def kernel_times(
    trace_dir: str, on_device: bool
) -> tuple[collections.Counter, collections.Counter]:
    """Microseconds and counts per kernel kind in the one trace under ``trace_dir``."""
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    events = json.load(gzip.open(path))["traceEvents"]
    device_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and "/device:" in str(e.get("args", {}).get("name", ""))
    }
    times, counts = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or e["name"].startswith(_HOST):
            continue
        if on_device and e["pid"] not in device_pids:
            continue
        k = kind(e["name"])
        if k in _CONTAINERS:
            k = f"[{k}]"
        times[k] += e["dur"]
        counts[k] += 1
    return times, counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int)
    ap.add_argument("dtype", choices=["float64", "float32"])
    ap.add_argument("steps", choices=["fixed", "adaptive"])
    ap.add_argument("what", nargs="?", default="forward", choices=["forward", "grad"])
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--tol", type=float, default=1e-4, help="rtol = atol of adaptive steps")
    ap.add_argument(
        "--adjoint",
        default="auto",
        choices=list(_ADJOINTS),
        help="the gradient's adjoint (default og.Auto(); seed 001's example: interpolating)",
    )
    ap.add_argument(
        "--padded",
        action="store_true",
        help="the rhs as lam * Ci * laplacian(T, h, pad=True) instead of the seed's set_inner form",
    )
    a = ap.parse_args(argv)
    if a.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    p = diffusion3d(a.n, dtype=getattr(jnp, a.dtype))
    step = og.Adaptive(rtol=a.tol, atol=a.tol) if a.steps == "adaptive" else og.Fixed(p.t1 / 4)
    adjoint = _ADJOINTS[a.adjoint]()

    rhs = p.rhs_padded if a.padded else p.rhs

    def forward(T0, pars):
        sol = og.solve(rhs, T0, (0.0, p.t1), pars, solver=og.ROCK2(), step=step, adjoint=adjoint)
        return sol.ys[-1]

    def loss(T0, pars):
        return jnp.sum(forward(T0, pars) ** 2)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1)) if a.what == "grad" else forward)
    pars = (p.lam, p.Ci)
    jax.block_until_ready(fn(p.T0, pars))
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(p.T0, pars))
        walls.append(time.perf_counter() - t0)
    on_device = jax.default_backend() != "cpu"
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(fn(p.T0, pars))
        times, counts = kernel_times(d, on_device)
    field_mb = a.n**3 * jnp.dtype(a.dtype).itemsize / 2**20
    leaf = sum(v for k, v in times.items() if not k.startswith("["))
    print(
        f"## {a.n}^3 {a.dtype}, ROCK2 {a.steps} steps, {a.what} with {a.adjoint} "
        f"({jax.devices()[0].device_kind}); "
        f"a field is {field_mb:.1f} MiB"
    )
    print(
        f"wall {1e3 * min(walls):.2f} ms (best of 3, untraced); {sum(counts.values())} kernels "
        f"sum to {leaf / 1e3:.2f} ms in the traced call\n"
    )
    print("| kernel kind | time | count | per call |")
    print("|---|--:|--:|--:|")
    for k, v in times.most_common(a.top):
        print(f"| {k[:60]} | {v / 1e3:.2f} ms | {counts[k]} | {v / counts[k]:.0f} µs |")


if __name__ == "__main__":
    main()
