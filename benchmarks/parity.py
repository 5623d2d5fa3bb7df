"""Did a change cost speed? The working tree against a git ref, interleaved in one process.

The ref's ``src/odegrad`` is exported with ``git archive`` and imported as a second package,
``odegrad_ref`` (odegrad imports itself relatively); while a workload is built and compiled for
the ref, ``sys.modules["odegrad"]`` points at it, so the benchmark scripts' own workload
builders trace the ref's code. Every compiled call of both trees is then timed in one
:func:`~_timing.interleaved_medians` schedule, side by side, which cancels the drift of a busy
machine that separate runs suffer (here +-15 % between runs of the same code).

Workloads, from the scripts they reproduce:

* ``lotka_volterra.py``: forward and gradient with ``Auto()``, ``Discrete('all')``,
  ``Discrete(8)`` (float64, 20 saves, rtol = atol = 1e-6);
* ``wave_scan_parity.py``: forward and gradient of ``StepTo(t)``, ``Fixed(dt)`` traced and
  static span (seed 004, N = 64, 2000 steps, float32);
* ``adjoints.py``: the gradient with every adjoint, Lotka–Volterra (float64) and the N x N
  diffusion (float32).

    python benchmarks/parity.py --ref HEAD [--rounds 30] [--number 3]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import importlib.util
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile

import jax
import jax.numpy as jnp

from _timing import compile_timed, interleaved_medians, markdown_table, warm_up_jax

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def import_ref(ref: str, into: pathlib.Path):
    """Git ``ref``'s odegrad, imported as the package ``odegrad_ref``."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, "src/odegrad"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    (into / "ref.tar").write_bytes(archive)
    with tarfile.open(into / "ref.tar") as tar:
        tar.extractall(into, filter="data")
    (into / "src" / "odegrad").rename(into / "odegrad_ref")
    sys.path.insert(0, str(into))
    return importlib.import_module("odegrad_ref")


@contextlib.contextmanager
def odegrad_is(module):
    """``import odegrad`` gives ``module`` (for building and tracing one tree's workloads)."""
    saved = sys.modules["odegrad"]
    sys.modules["odegrad"] = module
    try:
        yield
    finally:
        sys.modules["odegrad"] = saved


def load_script(name: str, tag: str):
    """A fresh copy of ``benchmarks/<name>.py`` (its ``import odegrad`` is the current one)."""
    spec = importlib.util.spec_from_file_location(f"{name}_{tag}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def lotka_volterra_workloads(tag: str) -> dict:
    jax.config.update("jax_enable_x64", True)
    lv = load_script("lotka_volterra", tag)
    s = lv.Setup(lv.parse_args(["--no-torch", "--no-diffrax"]))
    out = {}
    for name in ("auto", "discrete-all", "discrete-8"):

        def make_fwd(name=name):
            solve, ys_of, _ = lv.make_odegrad(s, name)
            return lambda p: ys_of(solve(p))

        def make_grad(name=name):
            solve, ys_of, _ = lv.make_odegrad(s, name)
            return jax.value_and_grad(lambda p: jnp.sum(ys_of(solve(p)) ** 2))

        for kind, make in (("forward", make_fwd), ("gradient", make_grad)):
            out[("Lotka–Volterra", name, kind)] = (compile_timed(make, (s.params,)), (s.params,))
    return out


def wave_workloads(tag: str) -> dict:
    jax.config.update("jax_enable_x64", False)
    wave = load_script("wave_scan_parity", tag)
    p = wave.Wave(64, 2000, jnp.dtype("float32"))
    inputs = (p.fields, p.t)
    out = {}
    for kind in ("stepto", "fixed-traced", "fixed-static"):
        make = lambda kind=kind: wave.make_odegrad(p, kind)
        out[("wave N=64", kind, "forward")] = (compile_timed(make, inputs), inputs)
        grad = lambda make=make: wave.gradient_of(make())
        out[("wave N=64", kind, "gradient")] = (compile_timed(grad, inputs), inputs)
    return out


def adjoints_workloads(tag: str) -> dict:
    adj = load_script("adjoints", tag)
    out = {}
    for x64, problem in ((True, adj.lotka_volterra), (False, lambda: adj.diffusion(64))):
        jax.config.update("jax_enable_x64", x64)
        title, make_loss, args = problem()
        for name, adjoint in adj.ADJOINTS.items():
            compiled = compile_timed(lambda adjoint=adjoint: make_loss(adjoint()), args)
            out[(title.split(" (")[0], name, "gradient")] = (compiled, args)
    return out


WORKLOADS = {
    "lotka_volterra": lotka_volterra_workloads,
    "wave_scan_parity": wave_workloads,
    "adjoints": adjoints_workloads,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="HEAD", help="the git ref to compare with (default HEAD)")
    ap.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workload sets")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--number", type=int, default=3)
    ap.add_argument(
        "--hlo",
        action="store_true",
        help="also compare each workload's optimised HLO (metadata stripped): the same program "
        "runs at the same speed, whatever the machine's noise",
    )
    a = ap.parse_args()
    warm_up_jax()
    import odegrad

    with tempfile.TemporaryDirectory() as tmp:
        trees = {"ref": import_ref(a.ref, pathlib.Path(tmp)), "work": odegrad}
        calls, keys, hlo = {}, [], {}
        for set_name in a.only.split(","):
            for tree, module in trees.items():
                with odegrad_is(module):
                    for key, (compiled, args) in WORKLOADS[set_name](tree).items():
                        calls["|".join((*key, tree))] = lambda c=compiled.fn, a_=args: c(*a_)
                        if a.hlo:
                            hlo[(key, tree)] = _program(compiled.fn.as_text())
                        keys += [key] if key not in keys else []
        timing = interleaved_medians(calls, a.rounds, a.number)
    rows = []
    for key in keys:
        ref, work = (timing["|".join((*key, tree))].median for tree in ("ref", "work"))
        rows.append([*key, f"{ref * 1e3:.4g} ms", f"{work * 1e3:.4g} ms", f"{work / ref:.3f}"])
        if a.hlo:
            rows[-1].append(_compare(hlo[(key, "ref")], hlo[(key, "work")]))
    print(f"\n### working tree vs {a.ref}: median of {a.rounds} interleaved rounds\n")
    head = ["problem", "method", "", a.ref, "working tree", "ratio"]
    print(markdown_table(head + (["optimised HLO"] if a.hlo else []), rows))


def _program(text: str) -> collections.Counter:
    """How many instructions of each opcode an optimised HLO module has (names, operand order
    and the loop carry's layout differ between equivalent programs; the work they do does not)."""
    ops = collections.Counter()
    for line in text.splitlines():
        _, eq, rhs = line.partition(" = ")
        if not eq:
            continue
        if rhs.startswith("("):  # a tuple type: skip to its closing parenthesis
            depth = 0
            for i, ch in enumerate(rhs):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    rhs = rhs[i + 1 :]
                    break
        else:
            rhs = rhs.partition(" ")[2]
        op = re.match(r"\s*([a-z][a-z0-9-]*)\(", rhs)
        if op:
            ops[op.group(1)] += 1
    return ops


def _compare(ref: collections.Counter, work: collections.Counter) -> str:
    if ref == work:
        return f"same ops ({sum(ref.values())})"
    diff = {op: work[op] - ref[op] for op in ref.keys() | work.keys() if work[op] != ref[op]}
    return ", ".join(f"{n:+d} {op}" for op, n in sorted(diff.items()))


if __name__ == "__main__":
    main()
