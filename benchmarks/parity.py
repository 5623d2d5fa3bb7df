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
  diffusion (float32);
* ``neural_ode.py``: an equinox MLP as ``args``, the solve vmapped over 256 trajectories,
  forward and train step with ``Auto()`` and ``Interpolating()`` (``throw=True``, float32);
* events: ``vmap(grad)`` of a terminal event's time (64 members, ``Auto()``) and a bouncing
  ball's gradient with ``Interpolating()`` (float64);
* stencil: ROCK2 with adaptive steps on a 128 x 128 diffusion, vmapped over 8 members;
* seed001: ROCK2 on seed 001's 160^3 float64 diffusion, fixed and adaptive steps, and the
  gradient of the fixed-step solve.

Every workload runs with odegrad's defaults where the script does (``throw=True``, ``Auto()``).

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


def neural_ode_workloads(tag: str) -> dict:
    """What users train: an equinox MLP as ``args``, ``Auto()`` and ``throw=True`` (defaults),
    the solve vmapped over B = 256 trajectories, forward and a jitted train step."""
    import equinox as eqx

    jax.config.update("jax_enable_x64", False)
    nn = load_script("neural_ode", tag)
    args = nn.parse_args(["--batches", "256", "--no-torch", "--no-diffrax"])
    g = nn.Group(args, nn.Data(256, jnp.float32), "B=256", args.width, 256, False)
    out = {}
    for name in ("auto", "interpolating"):
        make_solve = lambda name=name: nn.batched(g, nn.odegrad_solver(g, name))

        def make_fwd(make_solve=make_solve):
            solve = make_solve()
            return lambda params, y0s: solve(eqx.combine(params, g.static), y0s)

        def make_grad(make_solve=make_solve):
            solve = make_solve()

            def loss(params, y0s, target):
                return jnp.mean((solve(eqx.combine(params, g.static), y0s)[0] - target) ** 2)

            return jax.value_and_grad(loss)

        for kind, make, inputs in (
            ("forward", make_fwd, (g.params, g.y0s)),
            ("gradient", make_grad, (g.params, g.y0s, g.target)),
        ):
            out[("neural ODE vmap 256", name, kind)] = (compile_timed(make, inputs), inputs)
    return out


def events_workloads(tag: str) -> dict:
    """A terminal event's time under ``vmap(grad)`` (64 drop heights, ``Auto()``), and a
    bouncing ball's final state differentiated by ``Interpolating()`` (the event log and the
    continuous adjoints' jump conditions)."""
    import odegrad as og

    jax.config.update("jax_enable_x64", True)
    fall = lambda t, y, a: jnp.stack([y[1], -a["g"]])
    floor = lambda t, y, a: y[0]
    bounce = lambda t, y, a: jnp.stack([y[0], -a["e"] * y[1]])
    hit = og.Event(floor, direction=-1)
    bounces = og.Event(floor, direction=-1, terminal=False, update=bounce)
    step = og.Adaptive(rtol=1e-10, atol=1e-10)

    def t_star(p):
        sol = og.solve(fall, p[:2], (0.0, 5.0), {"g": p[2]}, events=hit, step=step)
        return sol.ts[-1]

    def final(p):
        args = {"g": p[2], "e": p[3]}
        sol = og.solve(fall, p[:2], (0.0, 3.0), args, events=bounces, step=step,
                       adjoint=og.Interpolating())  # fmt: skip
        return jnp.sum(sol.ys[-1] ** 2)

    batch = jnp.stack([jnp.linspace(0.5, 4.0, 64), jnp.full(64, 2.0), jnp.full(64, 9.81)], 1)
    p_bounce = (jnp.asarray([1.0, 0.0, 9.81, 0.8]),)
    return {
        ("events", "grad t*, vmap 64", "gradient"): (
            compile_timed(lambda: jax.vmap(jax.grad(t_star)), (batch,)),
            (batch,),
        ),
        ("events", "bouncing ball", "gradient"): (
            compile_timed(lambda: jax.grad(final), p_bounce),
            p_bounce,
        ),
    }


def stencil_workloads(tag: str) -> dict:
    """ROCK2 (default power-iteration estimate) with adaptive steps on a 128 x 128 periodic
    diffusion, vmapped over 8 diffusivities: the members' estimates age apart under vmap."""
    import odegrad as og

    jax.config.update("jax_enable_x64", False)
    n = 128

    def f(t, y, a):
        lap = jnp.roll(y, 1, 0) + jnp.roll(y, -1, 0) + jnp.roll(y, 1, 1) + jnp.roll(y, -1, 1)
        return a * (lap - 4 * y) * n * n

    y0 = jnp.sin(jnp.linspace(0, 6, n))[:, None] * jnp.cos(jnp.linspace(0, 3, n))[None, :]
    a = (jnp.linspace(0.5, 1.0, 8),)

    def make():
        step = og.Adaptive(1e-5, 1e-5)
        one = lambda a_: og.solve(f, y0, (0.0, 0.02), a_, solver=og.ROCK2(), step=step).ys[-1]
        return jax.vmap(one)

    return {("ROCK2 adaptive 128^2", "vmap 8", "forward"): (compile_timed(make, a), a)}


def seed001_workloads(tag: str) -> dict:
    """Seed 001's 3-d diffusion at 160^3 float64 (fields out of cache), ``og.ROCK2()`` with its
    defaults: 4 fixed steps and adaptive steps at ``rtol = atol = 1e-4``, as in
    ``diffusion3d.py``; and the gradient of the fixed-step solve."""
    import odegrad as og
    from odegrad.problems import diffusion3d

    jax.config.update("jax_enable_x64", True)
    p = diffusion3d(160, dtype=jnp.float64)
    args = (p.T0, (p.lam, p.Ci))
    out = {}
    for name, step in (("fixed", og.Fixed(p.t1 / 4)), ("adaptive", og.Adaptive(1e-4, 1e-4))):

        def make(step=step):
            return lambda T0, a: (
                og.solve(p.rhs, T0, (0.0, p.t1), a, solver=og.ROCK2(), step=step).ys
            )

        out[("ROCK2 160^3 float64", name, "forward")] = (compile_timed(make, args), args)

    def make_grad():  # the default adjoint, fixed steps (docs/stencil.md's gradient figure)
        def loss(T0, a):
            sol = og.solve(p.rhs, T0, (0.0, p.t1), a, solver=og.ROCK2(), step=og.Fixed(p.t1 / 4))
            return jnp.sum(sol.ys[-1] ** 2)

        return jax.grad(loss, argnums=(0, 1))

    out[("ROCK2 160^3 float64", "fixed", "gradient")] = (compile_timed(make_grad, args), args)
    return out


WORKLOADS = {
    "lotka_volterra": lotka_volterra_workloads,
    "wave_scan_parity": wave_workloads,
    "adjoints": adjoints_workloads,
    "neural_ode": neural_ode_workloads,
    "events": events_workloads,
    "stencil": stencil_workloads,
    "seed001": seed001_workloads,
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
