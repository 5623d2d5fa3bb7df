"""Neural ODE training step (diffrax's neural-ODE example): odegrad vs diffrax vs torchdiffeq.

The workload is the configuration of diffrax's neural-ODE example. The vector field is an
equinox MLP 2 -> 2 (width 64, depth 2, softplus, final tanh) in a module
``Func(eqx.Module)``, ``Func.__call__(t, y, args) = self.mlp(y)``, passed to the solver as
``args``. The data is 100 save times ``linspace(0, 10, 100)``, Tsit5 with ``rtol=1e-3`` and
``atol=1e-6``, and a batch of B initial conditions drawn uniformly from ``[-0.6, 1]^2`` (fixed
seed). The targets are the trajectories of diffrax's data ODE ``y' = (z_1, -z_0)`` with
``z = y / (1 + y)``, solved once at a tight tolerance. The loss is the mean squared error of the
``jax.vmap``-ed solve against the targets.

Measured per batch size B (``--batches``, default 32,256,1024):

* **forward**: ``jax.jit(jax.vmap(solve))``, the time per call;
* **train step**: ``eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, y0s, target)``,
  the time per call (the default adjoint, the default ``throw``). This is what a training
  loop calls.
* **compile**: the cold trace+lower + XLA compile of that step, done through
  ``jax.jit(fn).lower(...).compile()`` with the model split by ``eqx.partition`` into its
  arrays (arguments) and the rest (closed over);
* **temp**: that compiled step's ``memory_analysis().temp_size_in_bytes``;
* **steps**: the steps the solver took (accepted + rejected), for batch member 0 and the most
  any member took (a vmapped loop runs until its slowest member is done, so the maximum sets
  the batch's cost). odegrad reports ``sol.stats["steps"]`` and diffrax
  ``sol.stats["num_steps"]``.
* **rel Δ grad**: the relative 2-norm difference of the flattened gradient from diffrax's
  default. Both libraries' solves err by ~1e-3 at this tolerance and may step differently,
  so differences of that order are expected.

Contestants, timed interleaved within each (variant, B) group:

* odegrad with ``og.Auto()`` (the default), and with each adjoint named by ``--adjoints``
  (Discrete, Forward, Backsolve, Interpolating, Quadrature);
* odegrad ``og.Auto()`` with ``throw=False``, which skips the step-limit check;
* diffrax ``diffeqsolve(ODETerm(func), Tsit5(), 0, 10, dt0=None, y0, args=model,
  saveat=SaveAt(ts=ts), stepsize_controller=PIDController(rtol, atol))`` with its default
  ``RecursiveCheckpointAdjoint()``, and with ``BacksolveAdjoint()``;
* torchdiffeq ``dopri5`` when it is importable (it has no Tsit5), not with ``--quick``. It
  solves the batch as one ``(B, 2)`` state, with backprop through the solver (untested: torch
  was not installed where this script was written).

Variants (``--variants``):

* ``vmap``: the above, for each B of ``--batches``;
* ``wide``: the same with MLP width 256, at B = ``--wide-batch`` (256);
* ``stacked``: batch as state. ``--stacked-batch`` (256) initial conditions are stacked into
  ONE ``(256, 2)`` state and solved once, with the vector field ``jax.vmap(mlp)`` over the
  rows and no vmap of the solve. The error norm, and so the step sequence, is then shared by
  the whole batch.

Ratios (``/ dfx``) are time / diffrax-default time (else to odegrad ``Auto()``), using the
``--stat`` of the rounds. A contestant whose compiled step would need more than
``--max-temp-gib`` of temporary memory is compiled but not run. Forward sensitivities of the
wide MLP (67k parameters) need that much.

    python benchmarks/neural_ode.py                     # full run (long on a small CPU)
    python benchmarks/neural_ode.py --quick             # B=32, Auto + diffrax, < 1 minute
    python benchmarks/neural_ode.py --batches 256 --adjoints all --variants vmap,stacked
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from _timing import (
    add_timing_args,
    compile_timed,
    environment,
    fmt_bytes,
    fmt_compile,
    fmt_diff,
    fmt_ratio,
    fmt_timing,
    interleaved_medians,
    load_average,
    markdown_table,
    result_row,
    warm_up_jax,
    write_json,
)

T0, T1, N_SAVES = 0.0, 10.0, 100
DEPTH = 2

#: --adjoints names -> the odegrad adjoint they build.
ADJOINTS = {
    "auto": ("Auto", ()),
    "discrete": ("Discrete", ()),
    "forward": ("Forward", ()),
    "backsolve": ("Backsolve", ()),
    "interpolating": ("Interpolating", ()),
    "quadrature": ("Quadrature", ()),
}
VARIANTS = ("vmap", "wide", "stacked")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="32,256,1024", help="batch sizes B of the vmap variant")
    p.add_argument("--width", type=int, default=64, help="MLP width of the vmap/stacked variants")
    p.add_argument("--wide-width", type=int, default=256, help="MLP width of the wide variant")
    p.add_argument("--wide-batch", type=int, default=256, help="B of the wide variant")
    p.add_argument("--stacked-batch", type=int, default=256, help="rows of the stacked state")
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated, from: {', '.join(VARIANTS)} (default: all; --quick: vmap)",
    )
    p.add_argument("--rtol", type=float, default=1e-3)
    p.add_argument("--atol", type=float, default=1e-6)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument(
        "--adjoints",
        default=None,
        help=f"comma-separated odegrad adjoints, from: {', '.join(ADJOINTS)}, or 'all' "
        "(default: all; with --quick: auto)",
    )
    add_timing_args(p, rounds=10, number=3, budget=20.0)
    p.add_argument(
        "--max-temp-gib",
        type=float,
        default=16.0,
        help="do not run a train step whose compiled temporary memory exceeds this",
    )
    p.add_argument("--no-diffrax", action="store_true")
    p.add_argument(
        "--no-diffrax-backsolve",
        action="store_true",
        help="skip diffrax's BacksolveAdjoint (16-76 s per call at B = 256 and 1024)",
    )
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--json", default=None, help="write the key rows to this JSON file")
    p.add_argument(
        "--quick",
        action="store_true",
        help="B=32, vmap variant, odegrad Auto() + diffrax default only; 3 rounds x 2 calls, "
        "1 compile",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.number, args.compile_reps = 3, 2, 1
        args.budget = min(args.budget, 2.0)
        args.batches = "32"
    if args.variants is None:
        args.variants = "vmap" if args.quick else ",".join(VARIANTS)
    args.variants = [v.strip() for v in args.variants.split(",")]
    if bad := [v for v in args.variants if v not in VARIANTS]:
        p.error(f"--variants: unknown {bad}; choose from {list(VARIANTS)}")
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.adjoints is None:
        args.adjoints = "auto" if args.quick else "all"
    names = list(ADJOINTS) if args.adjoints == "all" else args.adjoints.split(",")
    names = [n.strip() for n in names]
    if bad := [n for n in names if n not in ADJOINTS]:
        p.error(f"--adjoints: unknown {bad}; choose from {list(ADJOINTS)}")
    if "auto" not in names:
        names.insert(0, "auto")  # the throw=False row and the fallback reference need it
    args.adjoints = names
    return args


# --- the model and the data -----------------------------------------------------------------


def make_model(width: int, key, dtype):
    """diffrax's example's ``Func``: an equinox MLP 2 -> 2, depth 2, softplus, final tanh."""
    import equinox as eqx

    class Func(eqx.Module):
        mlp: eqx.nn.MLP

        def __init__(self, key):
            self.mlp = eqx.nn.MLP(
                2,
                2,
                width,
                DEPTH,
                activation=jax.nn.softplus,
                final_activation=jax.nn.tanh,
                dtype=dtype,
                key=key,
            )

        def __call__(self, t, y, args):
            return self.mlp(y)

    return Func(key)


def vector_field(t, y, func):
    """One member: the module passed as ``args`` is the vector field."""
    return func(t, y, None)


def stacked_vector_field(t, y, func):
    """Batch as state: ``y`` is ``(B, 2)``, the MLP applied to each row."""
    return jax.vmap(func, in_axes=(None, 0, None))(t, y, None)


def spiral(t, y, args):
    """diffrax's example's data ODE."""
    z = y / (1 + y)
    return jnp.stack([z[1], -z[0]])


class Data:
    """The initial conditions (``n`` of them, one fixed key) and their target trajectories."""

    def __init__(self, n: int, dtype):
        import odegrad as og

        self.ts = jnp.linspace(T0, T1, N_SAVES, dtype=dtype)
        self.y0s = jax.random.uniform(
            jax.random.PRNGKey(5678), (n, 2), dtype=dtype, minval=-0.6, maxval=1.0
        )
        tol = 1e-8 if jnp.dtype(dtype) == jnp.float64 else 1e-6
        step = og.Adaptive(rtol=tol, atol=tol)
        saveat = og.SaveAt(ts=self.ts)
        solve = jax.jit(
            jax.vmap(lambda y0: og.solve(spiral, y0, (T0, T1), None, step=step, saveat=saveat).ys)
        )
        self.targets = solve(self.y0s)  # (n, 100, 2)


# --- the contestants: batch_solve(model, y0s) -> (ys laid out like the target, steps) -------


def odegrad_solver(s, adjoint_name: str, throw: bool = True):
    import odegrad as og

    cls_name, cls_args = ADJOINTS[adjoint_name]
    adjoint = getattr(og, cls_name)(*cls_args)
    step = og.Adaptive(rtol=s.args.rtol, atol=s.args.atol)
    saveat = og.SaveAt(ts=s.ts)
    f = stacked_vector_field if s.stacked else vector_field

    def solve_one(model, y0):
        sol = og.solve(
            f,
            y0,
            (T0, T1),
            model,
            solver=og.Tsit5(),
            step=step,
            saveat=saveat,
            adjoint=adjoint,
            throw=throw,
        )
        return sol.ys, sol.stats["steps"]

    return solve_one


def diffrax_solver(s, backsolve: bool = False):
    import diffrax as dfx

    f = stacked_vector_field if s.stacked else vector_field
    kwargs = {"adjoint": dfx.BacksolveAdjoint()} if backsolve else {}

    def solve_one(model, y0):
        sol = dfx.diffeqsolve(
            dfx.ODETerm(f),
            dfx.Tsit5(),
            T0,
            T1,
            None,
            y0,
            args=model,
            saveat=dfx.SaveAt(ts=s.ts),
            stepsize_controller=dfx.PIDController(rtol=s.args.rtol, atol=s.args.atol),
            **kwargs,
        )
        return sol.ys, sol.stats["num_steps"]

    return solve_one


def batched(s, solve_one):
    """The vmap variants vmap the solve; the stacked variant solves the ``(B, 2)`` state once."""
    if s.stacked:
        return solve_one  # ys: (100, B, 2), steps: a scalar
    return jax.vmap(solve_one, in_axes=(None, 0))  # ys: (B, 100, 2), steps: (B,)


def jax_contestants(s) -> dict:
    """label -> (library, factory of a fresh batch_solve)."""
    out = {}
    if importlib.util.find_spec("odegrad") is not None:
        import odegrad as og

        for name in s.args.adjoints:
            cls_name, cls_args = ADJOINTS[name]
            if hasattr(og, cls_name):
                label = f"odegrad {cls_name}({', '.join(map(repr, cls_args))})"
                out[label] = ("odegrad", lambda name=name: batched(s, odegrad_solver(s, name)))
        if not s.args.quick:
            out["odegrad Auto(), throw=False"] = (
                "odegrad",
                lambda: batched(s, odegrad_solver(s, "auto", throw=False)),
            )
    if not s.args.no_diffrax and importlib.util.find_spec("diffrax") is not None:
        out["diffrax RecursiveCheckpointAdjoint()"] = (
            "diffrax",
            lambda: batched(s, diffrax_solver(s)),
        )
        if not (s.args.quick or s.args.no_diffrax_backsolve):
            out["diffrax BacksolveAdjoint()"] = (
                "diffrax",
                lambda: batched(s, diffrax_solver(s, backsolve=True)),
            )
    return out


def torch_contestant(s):
    """``(label, forward(), train_step(), nfe counter)`` for torchdiffeq, or None.

    torchdiffeq solves the batch as one ``(B, 2)`` state (its usual way), with ``dopri5``
    and backprop through the solver.
    """
    a = s.args
    if a.quick or a.no_torch or s.stacked or importlib.util.find_spec("torchdiffeq") is None:
        return None
    import torch
    from torchdiffeq import odeint

    torch.manual_seed(0)
    tdtype = torch.float64 if s.args.dtype == "float64" else torch.float32

    class Func(torch.nn.Module):
        def __init__(self):
            super().__init__()
            w = s.width
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(2, w),
                torch.nn.Softplus(),
                torch.nn.Linear(w, w),
                torch.nn.Softplus(),
                torch.nn.Linear(w, 2),
                torch.nn.Tanh(),
            ).to(tdtype)
            self.nfe = 0

        def forward(self, t, y):
            self.nfe += 1
            return self.mlp(y)

    func = Func()
    y0s = torch.tensor(np.asarray(s.y0s), dtype=tdtype)
    ts = torch.tensor(np.asarray(s.ts), dtype=tdtype)
    target = torch.tensor(np.asarray(s.target).transpose(1, 0, 2), dtype=tdtype)  # (100, B, 2)

    def forward():
        with torch.no_grad():
            return odeint(func, y0s, ts, rtol=a.rtol, atol=a.atol, method="dopri5")

    def train_step():
        ys = odeint(func, y0s, ts, rtol=a.rtol, atol=a.atol, method="dopri5")
        loss = ((ys - target) ** 2).mean()
        grads = torch.autograd.grad(loss, tuple(func.parameters()))
        return loss.detach(), grads

    return "torchdiffeq dopri5 odeint (batch as state)", forward, train_step, func


# --- one (variant, B) group ---------------------------------------------------------------------


class Group:
    """One table section: a model width, a batch, and whether the batch is one stacked state."""

    def __init__(self, args, data: Data, label: str, width: int, batch: int, stacked: bool):
        import equinox as eqx

        self.args, self.label, self.width, self.batch, self.stacked = (
            args,
            label,
            width,
            batch,
            stacked,
        )
        dtype = jnp.dtype(args.dtype)
        self.model = make_model(width, jax.random.PRNGKey(0), dtype)
        self.params, self.static = eqx.partition(self.model, eqx.is_array)
        self.ts = data.ts
        self.y0s = data.y0s[:batch]
        self.target = data.targets[:batch]  # (B, 100, 2)
        if stacked:
            self.target = jnp.swapaxes(self.target, 0, 1)  # (100, B, 2): the solve's layout
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(self.params))
        self.problem = f"neural ODE MLP 2-{width}-{width}-2 ({n_params} params), " + (
            f"batch as one ({batch}, 2) state" if stacked else f"vmap B={batch}"
        )


def log(msg: str) -> None:
    """Progress on stderr (the table goes to stdout at the end)."""
    print(msg, file=sys.stderr, flush=True)


def flat(tree) -> np.ndarray:
    import equinox as eqx

    leaves = jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in leaves])


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def first_line(e: BaseException, n: int = 160) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text if len(text) <= n else text[: n - 3] + "..."


def run_group(g: Group, rows: list, json_rows: list, errors: list) -> None:
    import equinox as eqx

    a = g.args
    inputs_f = (g.params, g.y0s)
    inputs_g = (g.params, g.y0s, g.target)
    fwd, grad, results, steps, calls, status, library = {}, {}, {}, {}, {}, {}, {}
    contestants = jax_contestants(g)

    # 1. every AOT compile first: compile_timed clears JAX's caches, filter_jit's included.
    for name, (lib, make) in contestants.items():
        library[name] = lib

        def make_fwd(make=make):
            batch_solve = make()

            def forward(params, y0s):
                return batch_solve(eqx.combine(params, g.static), y0s)

            return forward

        def make_grad(make=make):
            batch_solve = make()

            def loss(model, y0s, target):
                return jnp.mean((batch_solve(model, y0s)[0] - target) ** 2)

            def step(params, y0s, target):
                return eqx.filter_value_and_grad(loss)(eqx.combine(params, g.static), y0s, target)

            return step

        log(f"[{g.label}] compiling {name}")
        try:
            fwd[name] = compile_timed(make_fwd, inputs_f, a.compile_reps)
            grad[name] = compile_timed(make_grad, inputs_g, a.compile_reps)
            log(f"[{g.label}]   train step compiled in {grad[name].total_s:.1f} s")
        except Exception as e:  # report it in the table and go on
            status[name] = f"error: {first_line(e)}"
            errors.append((g.problem, name, e))
            continue
        temp = grad[name].temp_bytes()
        if temp is not None and temp > a.max_temp_gib * 2**30:
            status[name] = f"not run: temp {temp / 2**30:.1f} GiB > --max-temp-gib"

    # 2. run each once (values, steps) and compile the user's filter_jit train step
    for name, (_, make) in contestants.items():
        if name in status:
            continue
        batch_solve = make()

        def loss(model, y0s, target, batch_solve=batch_solve):
            return jnp.mean((batch_solve(model, y0s)[0] - target) ** 2)

        train_step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
        try:
            _, st = jax.device_get(fwd[name].fn(*inputs_f))
            value, grads = jax.device_get(grad[name].fn(*inputs_g))
            jax.block_until_ready(train_step(g.model, g.y0s, g.target))
        except Exception as e:
            status[name] = f"error: {first_line(e)}"
            errors.append((g.problem, name, e))
            continue
        st = np.asarray(st)
        steps[name] = str(int(st)) if st.ndim == 0 else f"{int(st[0])} / {int(st.max())}"
        results[name] = (float(value), flat(grads))
        calls[f"{name}|fwd"] = lambda c=fwd[name].call: c(*inputs_f)
        calls[f"{name}|step"] = lambda ts=train_step: ts(g.model, g.y0s, g.target)

    torch_run = None if g.stacked else torch_contestant(g)
    if torch_run is not None:
        name, forward, train_step, module = torch_run
        library[name] = "torchdiffeq"
        try:
            module.nfe = 0
            forward()
            steps[name] = f"{module.nfe} f evals (whole batch)"
            loss, gs = train_step()
            results[name] = (float(loss), np.concatenate([x.detach().numpy().ravel() for x in gs]))
            calls[f"{name}|fwd"] = forward
            calls[f"{name}|step"] = train_step
        except Exception as e:
            status[name] = f"error: {first_line(e)}"
            errors.append((g.problem, name, e))

    # 3. the timing, interleaved within the group
    log(f"[{g.label}] timing {len(calls)} calls, interleaved")
    timing = interleaved_medians(calls, a.rounds, a.number, budget_s=a.budget)
    stat = (lambda t: t.median) if a.stat == "median" else (lambda t: t.best)
    ref = next((n for n in results if n.startswith("diffrax Recursive")), None)
    ref = ref or next(iter(results), None)

    def ref_value(key):
        return None if ref is None else stat(timing[f"{ref}|{key}"])

    ref_cg = grad[ref].total_s if ref in grad else None
    ref_mem = grad[ref].temp_bytes() if ref in grad else None
    for name in library:
        if name not in results:
            rows.append([f"{g.label}: {name}", status.get(name, "n/a"), *[""] * 10])
            continue
        tf, tg = timing[f"{name}|fwd"], timing[f"{name}|step"]
        mem = grad[name].temp_bytes() if name in grad else None
        torch_grad = library[name] == "torchdiffeq"  # torch's parameters are not equinox's
        rows.append(
            [
                f"{g.label}: {name}",
                fmt_timing(tf),
                fmt_ratio(stat(tf), ref_value("fwd")),
                fmt_timing(tg),
                fmt_ratio(stat(tg), ref_value("step")),
                fmt_compile(grad.get(name)),
                fmt_ratio(grad[name].total_s if name in grad else None, ref_cg),
                fmt_bytes(mem),
                fmt_ratio(mem, ref_mem),
                steps[name],
                f"{results[name][0]:.6g}",
                "n/a" if torch_grad else fmt_diff(rel(results[name][1], results[ref][1])),
            ]
        )
        json_rows.append(
            result_row(g.problem, name, library[name], tf, tg, fwd.get(name), grad.get(name))
        )


def main(argv=None):
    args = parse_args(argv)
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    t_start = time.perf_counter()
    if importlib.util.find_spec("equinox") is None:  # a clean skip inside `odegrad bench`
        print("benchmarks/neural_ode.py: skipped, it needs equinox (pip install equinox)")
        return
    warm_up_jax()
    import odegrad as og

    groups = []
    sizes = [1]
    if "vmap" in args.variants:
        sizes += args.batches
    if "wide" in args.variants:
        sizes.append(args.wide_batch)
    if "stacked" in args.variants:
        sizes.append(args.stacked_batch)
    data = Data(max(sizes), args.dtype)
    if "vmap" in args.variants:
        groups += [Group(args, data, f"B={b}", args.width, b, False) for b in args.batches]
    if "wide" in args.variants:
        w, b = args.wide_width, args.wide_batch
        groups.append(Group(args, data, f"width {w}, B={b}", w, b, False))
    if "stacked" in args.variants:
        b = args.stacked_batch
        groups.append(Group(args, data, f"stacked ({b}, 2)", args.width, b, True))

    rows, json_rows, errors = [], [], []
    for g in groups:
        run_group(g, rows, json_rows, errors)

    with_diffrax = not args.no_diffrax and importlib.util.find_spec("diffrax") is not None
    r = "/ dfx" if with_diffrax else "/ Auto"
    headers = [
        "group: method",
        f"forward {args.stat} (min)",
        r,
        f"train step {args.stat} (min)",
        r,
        "compile step s (lower)",
        r,
        "temp (step)",
        r,
        "steps (member 0 / max)",
        "loss",
        "rel Δ grad",
    ]
    print("## Neural ODE (diffrax's example): training step, odegrad vs diffrax\n")
    print(environment())
    print(
        f"MLP 2->2 depth {DEPTH} softplus/tanh as args, {N_SAVES} saves on [{T0:g}, {T1:g}], "
        f"Tsit5 rtol={args.rtol:g} atol={args.atol:g}, {args.dtype}, MSE loss; "
        f"{args.rounds} interleaved rounds x {args.number} calls, time per call; ratios "
        f"({r}) use the {args.stat} and are to "
        f"{'diffrax' if with_diffrax else 'odegrad Auto()'}'s within each group; compile = "
        f"cold trace+lower + XLA compile of the train step (of which trace+lower), median of "
        f"{args.compile_reps}; temp = its memory_analysis().temp_size_in_bytes\n"
    )
    print(markdown_table(headers, rows))
    print(
        f"\nrel Δ grad: against {'diffrax' if with_diffrax else 'odegrad Auto()'}'s gradient "
        "(2-norm over all MLP parameters)."
    )
    g0 = groups[0]
    kwargs = {
        "solver": og.Tsit5(),
        "step": og.Adaptive(rtol=args.rtol, atol=args.atol),
        "saveat": og.SaveAt(ts=g0.ts),
    }
    if not g0.stacked:
        text = og.explain_adjoint(vector_field, g0.y0s[0], (T0, T1), g0.model, **kwargs)
        print(f"og.explain_adjoint (one member, width {g0.width}): {text}")
    for g in groups:
        if g.stacked:
            text = og.explain_adjoint(stacked_vector_field, g.y0s, (T0, T1), g.model, **kwargs)
            print(f"og.explain_adjoint ({g.label}): {text}")
    for problem, name, e in errors:
        print(f"\n{problem}, {name} failed:\n  {type(e).__name__}: {str(e)[:2000]}")
    write_json(
        args.json,
        "neural_ode",
        json_rows,
        settings=f"MLP depth {DEPTH} softplus/tanh, {N_SAVES} saves on [{T0:g}, {T1:g}], "
        f"Tsit5 rtol={args.rtol:g} atol={args.atol:g}, {args.dtype}; gradient = one "
        "eqx.filter_jit(eqx.filter_value_and_grad(loss)) training step",
    )
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f} s; {load_average()}")


if __name__ == "__main__":
    main()
