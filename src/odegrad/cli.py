"""Command line: ``python -m odegrad demo`` and ``python -m odegrad bench``.

``demo`` fits the four Lotka-Volterra parameters to noisy observations by gradient descent
through ``og.solve``; ``bench`` runs the benchmark scripts of a source checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

# --- demo: a small inverse problem ---------------------------------------------------------------

PARAM_NAMES = ("alpha", "beta", "gamma", "delta")
P_TRUE = (1.5, 1.0, 3.0, 1.0)  # prey growth, predation, predator death, predator growth
P_INIT = (1.2, 0.8, 2.5, 0.8)  # the starting guess of the fit
Y0 = (1.0, 1.0)  # prey, predator at t = 0
T1 = 10.0
N_OBS = 20  # observations at t = 0.5, 1.0, ..., 10.0
N_FINE = 201  # plotting grid t = 0, 0.05, ..., 10 (every 10th point is an observation time)
NOISE = 0.05  # multiplicative (log-normal) observation noise


def lotka_volterra(t, y, p):
    """Lotka-Volterra.

    ``d(prey)/dt = alpha prey - beta prey pred``, ``d(pred)/dt = delta prey pred - gamma pred``.
    """
    import jax.numpy as jnp

    alpha, beta, gamma, delta = p[0], p[1], p[2], p[3]
    prey, pred = y[0], y[1]
    return jnp.stack([alpha * prey - beta * prey * pred, delta * prey * pred - gamma * pred])


def run_demo(out: str, iters: int, lr: float | None, seed: int, use_optax: bool = True) -> int:
    t_start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import odegrad as og

    optax = None
    if use_optax:
        try:
            import optax
        except ImportError:
            optax = None
    if optax is None:
        why = "disabled by --no-optax" if not use_optax else "optax is not installed"
        print(
            f"NOTE: {why}; falling back to plain gradient descent (expect a slower fit). "
            'For Adam: pip install "odegrad[demo]" (or pip install optax).'
        )

    if lr is None:
        lr = 0.05 if optax is not None else 0.01  # plain descent oscillates at 0.05 here
    y0 = jnp.asarray(Y0)
    ts_fine = jnp.linspace(0.0, T1, N_FINE)
    obs_idx = np.arange(1, N_OBS + 1) * ((N_FINE - 1) // N_OBS)
    ts_obs = ts_fine[obs_idx]
    solve_kw = dict(solver=og.Tsit5(), step=og.Adaptive(rtol=1e-6, atol=1e-6))

    @jax.jit
    def trajectory(p):  # (N_FINE, 2): prey and predator on the plotting grid
        return og.solve(
            lotka_volterra, y0, (0.0, T1), p, saveat=og.SaveAt(ts=ts_fine), **solve_kw
        ).ys

    p_true = np.asarray(P_TRUE, dtype=np.float32)
    p_init = np.asarray(P_INIT, dtype=np.float32)
    clean = np.asarray(trajectory(jnp.asarray(p_true)))
    rng = np.random.default_rng(seed)
    obs = clean[obs_idx] * np.exp(NOISE * rng.standard_normal((N_OBS, 2))).astype(np.float32)
    obs_j = jnp.asarray(obs)

    def loss_fn(logp):
        """Mean squared error of log(prey), log(predator) at the observation times."""
        sol = og.solve(
            lotka_volterra, y0, (0.0, T1), jnp.exp(logp), saveat=og.SaveAt(ts=ts_obs), **solve_kw
        )
        return jnp.mean((jnp.log(sol.ys) - jnp.log(obs_j)) ** 2)

    loss_and_grad = jax.value_and_grad(loss_fn)  # reverse mode, og.Auto() adjoint
    logp = jnp.log(jnp.asarray(p_init))
    if optax is not None:
        opt = optax.adam(lr)
        opt_state = opt.init(logp)

        def step(logp, opt_state):
            loss, g = loss_and_grad(logp)
            updates, opt_state = opt.update(g, opt_state, logp)
            return optax.apply_updates(logp, updates), opt_state, loss, jnp.linalg.norm(g)

        method = f"Adam (optax), learning rate {lr:g}"
    else:
        opt_state = ()

        def step(logp, opt_state):
            loss, g = loss_and_grad(logp)
            return logp - lr * g, opt_state, loss, jnp.linalg.norm(g)

        method = f"plain gradient descent, learning rate {lr:g}"

    print(
        "odegrad demo: fit the 4 Lotka-Volterra parameters (alpha, beta, gamma, delta) to "
        f"{N_OBS} noisy observations ({NOISE:.0%} log-normal noise) of prey and predator on "
        f"t in [0, {T1:g}]."
    )
    print(
        f"Solver Tsit5, Adaptive(rtol=1e-6, atol=1e-6); gradients by jax.grad through og.solve "
        f"(adjoint og.Auto()); {method}, on log-parameters; {iters} iterations; "
        f"JAX backend {jax.default_backend()}."
    )
    explain = og.explain_adjoint(
        lotka_volterra, y0, (0.0, T1), jnp.asarray(p_init), saveat=og.SaveAt(ts=ts_obs), **solve_kw
    )
    print(f"adjoint: {explain}")
    t0 = time.perf_counter()
    step_c = jax.jit(step).lower(logp, opt_state).compile()  # loss-and-grad compiled once
    print(f"compiled the loss-and-gradient step in {time.perf_counter() - t0:.2f} s")

    def param_error(logp_np):
        p = np.exp(logp_np)
        return float(np.linalg.norm(p - p_true) / np.linalg.norm(p_true))

    print(f"{'iter':>5} {'loss':>11} {'|grad|':>10} {'param err':>10} {'ms':>7} {'elapsed ms':>10}")
    losses, errors = [], []
    t_loop = time.perf_counter()
    for i in range(iters):
        t_it = time.perf_counter()
        logp_new, opt_state, loss, gnorm = step_c(logp, opt_state)
        loss, gnorm = float(loss), float(gnorm)  # waits for the step
        now = time.perf_counter()
        # loss and |grad| are evaluated at the parameters before this update.
        err = param_error(np.asarray(logp))
        losses.append(loss)
        errors.append(err)
        print(
            f"{i:5d} {loss:11.4e} {gnorm:10.3e} {err:10.3e} {1e3 * (now - t_it):7.2f} "
            f"{1e3 * (now - t_loop):10.1f}",
            flush=True,
        )
        if not np.isfinite(loss):
            print("the loss is not finite; stopping.")
            break
        logp = logp_new
    loop_s = time.perf_counter() - t_loop

    p_fit = np.exp(np.asarray(logp))
    final_loss = float(step_c(logp, opt_state)[2])  # the step returns the loss at its input
    floor_loss = float(step_c(jnp.log(jnp.asarray(p_true)), opt_state)[2])
    print(
        f"\n{len(losses)} iterations in {loop_s:.2f} s "
        f"({1e3 * loop_s / max(len(losses), 1):.2f} ms per iteration); final loss "
        f"{final_loss:.4e} (at the true parameters, i.e. the noise: {floor_loss:.4e})"
    )
    print(f"{'parameter':>10} {'true':>8} {'initial':>8} {'recovered':>10} {'rel. error':>10}")
    for name, pt, pi, pf in zip(PARAM_NAMES, p_true, p_init, p_fit, strict=True):
        print(f"{name:>10} {pt:8.4f} {pi:8.4f} {pf:10.4f} {abs(pf - pt) / abs(pt):10.2%}")
    print(f"relative parameter error |p - p_true| / |p_true|: {param_error(np.log(p_fit)):.3e}")

    if importlib.util.find_spec("matplotlib") is None:
        print('matplotlib is not installed: no plots (pip install "odegrad[plot]").')
    else:
        curves = {
            "true": np.asarray(trajectory(jnp.asarray(p_true))),
            "initial guess": np.asarray(trajectory(jnp.asarray(p_init))),
            "fitted": np.asarray(trajectory(jnp.asarray(p_fit))),
        }
        paths = _plot_demo(Path(out), losses, errors, np.asarray(ts_fine), curves, ts_obs, obs)
        print("wrote " + ", ".join(str(p) for p in paths))
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


def _plot_demo(out, losses, errors, ts_fine, curves, ts_obs, obs):
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(losses, label="loss")
    ax.semilogy(errors, label="relative parameter error")
    ax.set_xlabel("iteration")
    ax.set_title("Lotka-Volterra fit")
    ax.legend()
    fig.tight_layout()
    loss_path = out / "loss.png"
    fig.savefig(loss_path, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    styles = {"true": ("k", "-"), "initial guess": ("tab:gray", ":"), "fitted": ("tab:red", "--")}
    for k, (ax, name) in enumerate(zip(axes, ("prey", "predator"), strict=True)):
        for label, ys in curves.items():
            color, ls = styles[label]
            ax.plot(ts_fine, ys[:, k], color=color, linestyle=ls, label=label)
        ax.plot(np.asarray(ts_obs), obs[:, k], "o", color="tab:blue", ms=4, label="data")
        ax.set_ylabel(name)
    axes[0].legend(loc="upper right", fontsize="small")
    axes[1].set_xlabel("t")
    fig.suptitle("data vs fitted trajectories")
    fig.tight_layout()
    fit_path = out / "fit.png"
    fig.savefig(fit_path, dpi=120)
    plt.close(fig)
    return [loss_path, fit_path]


# --- bench: run the benchmark scripts of a source checkout ---------------------------------------

KNOWN_BENCHMARKS = ("wave_scan_parity.py", "lotka_volterra.py")  # run first, in this order


def _is_odegrad_checkout(root: Path) -> bool:
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or not (root / "benchmarks").is_dir():
        return False
    try:
        return 'name = "odegrad"' in pyproject.read_text(encoding="utf-8")
    except OSError:
        return False


def find_benchmarks_dir() -> Path | None:
    """``benchmarks/`` of the checkout this package runs from (editable install), else of cwd."""
    here = Path(__file__).resolve().parent  # <root>/src/odegrad in a checkout
    for root in (here.parent.parent, Path.cwd()):
        if _is_odegrad_checkout(root):
            return root / "benchmarks"
    return None


def benchmark_scripts(bench_dir: Path) -> list[Path]:
    scripts = []
    for path in sorted(bench_dir.glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            if "__main__" not in path.read_text(encoding="utf-8"):
                continue  # a helper module, not a script
        except OSError:
            continue
        scripts.append(path)
    order = {name: i for i, name in enumerate(KNOWN_BENCHMARKS)}
    return sorted(scripts, key=lambda p: (order.get(p.name, len(order)), p.name))


def run_bench(quick: bool, names: list[str], bench_dir: str | None) -> int:
    found = Path(bench_dir) if bench_dir else find_benchmarks_dir()
    if found is None or not found.is_dir():
        where = bench_dir or "the source checkout of this odegrad, or the current directory"
        print(
            f"No benchmarks/ folder found in {where}. The benchmarks are not part of the "
            "installed package (e.g. a wheel): clone the odegrad repository, "
            'pip install -e ".[bench]", and run `python -m odegrad bench` inside the clone '
            "(or pass --dir PATH/TO/benchmarks).",
            file=sys.stderr,
        )
        return 2
    scripts = benchmark_scripts(found)
    if names:
        wanted = {n if n.endswith(".py") else n + ".py" for n in names}
        missing = wanted - {p.name for p in scripts}
        if missing:
            print(f"not in {found}: {', '.join(sorted(missing))}", file=sys.stderr)
            return 2
        scripts = [p for p in scripts if p.name in wanted]
    if not scripts:
        print(f"{found} holds no benchmark scripts yet.")
        return 0
    root = found.parent
    results = []
    for script in scripts:
        cmd = [sys.executable, str(script), *(["--quick"] if quick else [])]
        print(f"=== {script.relative_to(root)} {'--quick' if quick else ''}".rstrip(), flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=root, env=os.environ.copy())
        dt = time.perf_counter() - t0
        results.append((script.name, rc, dt))
        print(f"=== {script.name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {dt:.1f} s\n")
    print("benchmark summary:")
    for name, rc, dt in results:
        print(f"  {name:<32} {'ok' if rc == 0 else f'FAILED (exit {rc})':<18} {dt:7.1f} s")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


# --- entry point ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    parser = argparse.ArgumentParser(
        prog="odegrad" if argv0 == "odegrad" else "python -m odegrad",
        description="odegrad: solve ODEs in JAX and differentiate their solutions.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench}")
    demo = sub.add_parser(
        "demo", help="fit Lotka-Volterra parameters to noisy data by gradient descent"
    )
    demo.add_argument(
        "--out", default="odegrad-demo", help="folder for the PNG plots (default ./odegrad-demo)"
    )
    demo.add_argument("--iters", type=int, default=300, help="optimiser iterations (default 300)")
    demo.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate (default 0.05 for Adam, 0.01 without optax)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the observation noise")
    demo.add_argument("--no-optax", action="store_true", help=argparse.SUPPRESS)
    bench = sub.add_parser("bench", help="run the benchmark scripts of a source checkout")
    bench.add_argument("--quick", action="store_true", help="pass --quick to every script")
    bench.add_argument("--dir", default=None, help="the benchmarks folder (default: found)")
    bench.add_argument("names", nargs="*", help="only these scripts (e.g. lotka_volterra)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.iters < 0:
            parser.error("--iters must be >= 0")
        return run_demo(args.out, args.iters, args.lr, args.seed, use_optax=not args.no_optax)
    if args.command == "bench":
        return run_bench(args.quick, args.names, args.dir)
    parser.print_help()
    return 0
