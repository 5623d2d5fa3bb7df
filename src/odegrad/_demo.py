"""``python -m odegrad demo``: inverse problems solved by gradient descent through ``og.solve``.

``heat`` (the default) recovers the heat-capacity field of seed 001's 3-d heat diffusion from
noisy final temperatures; ``lv`` fits the four Lotka-Volterra parameters to noisy counts.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

# --- demo: inverse problems solved by gradient descent through og.solve --------------------------
#
# ``heat`` (the default): recover seed 001's heat-capacity field Ci from the noisy final
# temperature of its 3-d diffusion. ``lv``: fit the four Lotka-Volterra parameters to noisy
# prey/predator counts. Both share the optimiser set-up, the compiled fit loop and the loss plot.


def _make_optimizer(use_optax: bool, lr: float):
    """``(init, update, description)``: Adam from optax, or a minimal built-in Adam without it.

    ``update(grad, state, params) -> (new_params, new_state)``.
    """
    optax = None
    if use_optax:
        try:
            import optax
        except ImportError:
            optax = None
    if optax is not None:
        opt = optax.adam(lr)

        def update(g, state, x):
            updates, state = opt.update(g, state, x)
            return optax.apply_updates(x, updates), state

        return opt.init, update, f"Adam (optax), learning rate {lr:g}"

    why = "disabled by --no-optax" if not use_optax else "optax is not installed"
    print(
        f"NOTE: {why}; using a minimal built-in Adam instead. "
        'For optax: pip install "odegrad[demo]" (or pip install optax).'
    )
    import jax.numpy as jnp

    b1, b2, eps = 0.9, 0.999, 1e-8  # optax.adam's defaults

    def init(x):
        return (jnp.zeros_like(x), jnp.zeros_like(x), jnp.zeros((), jnp.int32))

    def update(g, state, x):
        m, v, k = state
        k = k + 1
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1 ** k.astype(x.dtype))
        v_hat = v / (1 - b2 ** k.astype(x.dtype))
        return x - lr * m_hat / (jnp.sqrt(v_hat) + eps), (m, v, k)

    return init, update, f"Adam (built-in), learning rate {lr:g}"


def _fit(loss_fn, x0, optimizer, iters: int, error_fn, error_label: str):
    """Minimise ``loss_fn`` from ``x0``; one printed line per iteration.

    The loss-and-gradient step is jitted and compiled once (its compile time is printed).
    ``error_fn(x) -> float`` measures the distance of ``x`` to the truth. Returns
    ``(x, losses, errors, loop seconds, step)``; ``losses[i]``, ``errors[i]`` are at the
    iterate *before* update ``i``, and ``step(x, state)[2]`` evaluates the loss at any ``x``.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    init, update, _ = optimizer
    loss_and_grad = jax.value_and_grad(loss_fn)

    def step(x, state):
        loss, g = loss_and_grad(x)
        x_new, state = update(g, state, x)
        return x_new, state, loss, jnp.sqrt(jnp.sum(g * g))

    x, state = x0, init(x0)
    t0 = time.perf_counter()
    step_c = jax.jit(step).lower(x, state).compile()  # loss-and-grad compiled once
    print(f"compiled the loss-and-gradient step in {time.perf_counter() - t0:.2f} s")
    print(f"{'iter':>5} {'loss':>11} {'|grad|':>10} {error_label:>10} {'ms':>7} {'elapsed s':>9}")
    losses, errors = [], []
    t_loop = time.perf_counter()
    for i in range(iters):
        t_it = time.perf_counter()
        x_new, state, loss, gnorm = step_c(x, state)
        loss, gnorm = float(loss), float(gnorm)  # waits for the step
        now = time.perf_counter()
        err = error_fn(x)
        losses.append(loss)
        errors.append(err)
        print(
            f"{i:5d} {loss:11.4e} {gnorm:10.3e} {err:10.3e} {1e3 * (now - t_it):7.1f} "
            f"{now - t_loop:9.2f}",
            flush=True,
        )
        if not (np.isfinite(loss) and np.isfinite(gnorm)):
            print("the loss or its gradient is not finite (NaN/inf); stopping.")
            break
        x = x_new
    return x, losses, errors, time.perf_counter() - t_loop, step_c


def _report_fit(losses, errors, final_loss, final_error, loop_s, noise_loss, what) -> bool:
    """Print the summary of a fit; ``True`` when it is finite and the error went down."""
    import numpy as np

    n = len(losses)
    print(
        f"\n{n} iterations in {loop_s:.2f} s ({1e3 * loop_s / max(n, 1):.1f} ms per iteration); "
        f"final loss {final_loss:.4e} (at the truth, i.e. the noise: {noise_loss:.4e})"
    )
    ok = bool(np.isfinite(final_loss) and np.isfinite(final_error))
    if not ok:
        print("FAILED: the fit produced NaN/inf.")
        return False
    if n == 0:
        print(f"{what}: {final_error:.3e} (no iterations run)")
        return True
    decreased = final_error < errors[0]
    print(
        f"{what}: initial {errors[0]:.3e} -> final {final_error:.3e} "
        + (
            f"(decreased {errors[0] / max(final_error, 1e-30):.1f}x)"
            if decreased
            else "(did NOT decrease)"
        )
    )
    return decreased


def _have_matplotlib() -> bool:
    if importlib.util.find_spec("matplotlib") is None:
        print('matplotlib is not installed: no plots (pip install "odegrad[plot]").')
        return False
    return True


def _plot_loss(out: Path, losses, errors, error_label: str, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(losses, label="loss")
    ax.semilogy(errors, label=error_label)
    ax.set_xlabel("iteration")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- heat: recover seed 001's heat-capacity field ------------------------------------------------

HEAT_LENGTH = 10.0  # the box is [0, 10]^3
# The anomalies of 1/Ci - cp_min: amplitude and centre (x, y, z) of each; the width is 1.
HEAT_TRUE = ((5.0, 10 / 1.5, 5.0, 10 / 1.5), (5.0, 10 / 3.0, 5.0, 10 / 1.5))  # seed 001
HEAT_INIT = ((2.0, 6.0, 4.5, 6.0), (2.0, 4.0, 5.5, 6.0))  # the starting guess of the fit
HEAT_T1 = 100 * (HEAT_LENGTH / 15) ** 2 / 8.1  # seed 001's horizon: 100 stable steps on 16^3
HEAT_NOISE = 0.01  # Gaussian noise, 1 % of the peak final temperature
HEAT_TOL = 1e-4  # rtol = atol of the ROCK2 steps (float32)


def heat_capacity(theta, X, Y, Z, cp_min=1.0):
    """``Ci = 1 / (cp_min + sum_k A_k exp(-|x - c_k|^2))``, ``theta[k] = (log A_k, c_k / 10)``."""
    import jax.numpy as jnp

    anomalies = 0.0
    for k in range(theta.shape[0]):
        amp = jnp.exp(theta[k, 0])
        cx, cy, cz = (HEAT_LENGTH * theta[k, j] for j in (1, 2, 3))
        anomalies = anomalies + amp * jnp.exp(-((X - cx) ** 2) - (Y - cy) ** 2 - (Z - cz) ** 2)
    return 1.0 / (cp_min + anomalies)


def _theta(params):
    import numpy as np

    p = np.asarray(params, dtype=np.float64)
    return np.concatenate([np.log(p[:, :1]), p[:, 1:] / HEAT_LENGTH], axis=1).astype(np.float32)


def _anomalies(theta):
    """``(amplitude, cx, cy, cz)`` per anomaly, sorted by ``cx`` (the fit may swap the two)."""
    import numpy as np

    t = np.asarray(theta, dtype=np.float64)
    p = np.concatenate([np.exp(t[:, :1]), HEAT_LENGTH * t[:, 1:]], axis=1)
    return p[np.argsort(p[:, 1])]


def demo_heat(out, iters, lr, seed, use_optax=True, n=16) -> int:
    t_start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import odegrad as og
    from odegrad.problems import diffusion3d

    p = diffusion3d(n, dtype=jnp.float32)
    x = np.arange(n) * p.spacing[0]
    X, Y, Z = (jnp.asarray(a, jnp.float32) for a in np.meshgrid(x, x, x, indexing="ij"))
    theta_true = jnp.asarray(_theta(HEAT_TRUE))
    theta_init = jnp.asarray(_theta(HEAT_INIT))
    Ci_true = heat_capacity(theta_true, X, Y, Z)
    solver = og.ROCK2(spectral_radius=p.spectral_radius)
    solve_kw = dict(
        solver=solver, step=og.Adaptive(rtol=HEAT_TOL, atol=HEAT_TOL), adjoint=og.Interpolating()
    )

    def final_temperature(Ci):
        return og.solve(p.rhs, p.T0, (0.0, HEAT_T1), (p.lam, Ci), **solve_kw).ys[-1]

    clean = np.asarray(jax.jit(final_temperature)(Ci_true))
    sigma = HEAT_NOISE * float(np.max(np.abs(clean)))
    rng = np.random.default_rng(seed)
    obs = jnp.asarray(clean + sigma * rng.standard_normal(clean.shape), jnp.float32)

    def loss_fn(theta):
        """Mean squared misfit of the final temperature, in units of the noise variance."""
        T = final_temperature(heat_capacity(theta, X, Y, Z))
        return jnp.mean((T - obs) ** 2) / sigma**2

    Ci_true_np = np.asarray(Ci_true, dtype=np.float64)

    def field_error(theta):
        Ci = np.asarray(heat_capacity(theta, X, Y, Z), dtype=np.float64)
        return float(np.linalg.norm(Ci - Ci_true_np) / np.linalg.norm(Ci_true_np))

    optimizer = _make_optimizer(use_optax, 0.05 if lr is None else lr)
    print(
        f"odegrad demo: recover the heat-capacity field Ci of seed 001's 3-d heat diffusion "
        f"(dT/dt = lam Ci laplacian(T), {n}^3 grid, t in [0, {HEAT_T1:.3g}]) from the final "
        f"temperature observed at all {n**3} grid points with Gaussian noise "
        f"({HEAT_NOISE:.0%} of its peak, sigma {sigma:.3g})."
    )
    print(
        "Ci = 1 / (1 + two Gaussian anomalies of width 1): the unknowns are the amplitude and "
        "centre (x, y, z) of each, 8 numbers, fitted as (log amplitude, centre / 10)."
    )
    print(
        f"Solver ROCK2(spectral_radius=...), Adaptive(rtol=atol={HEAT_TOL:g}), float32; gradients "
        f"by jax.grad through og.solve with adjoint og.Interpolating(); {optimizer[2]}; "
        f"{iters} iterations; JAX backend {jax.default_backend()}."
    )
    theta, losses, errors, loop_s, step_c = _fit(
        loss_fn, theta_init, optimizer, iters, field_error, "field err"
    )
    final_loss = float(step_c(theta, optimizer[0](theta))[2])
    noise_loss = float(step_c(theta_true, optimizer[0](theta_true))[2])
    final_error = field_error(theta)
    ok = _report_fit(
        losses, errors, final_loss, final_error, loop_s, noise_loss,
        "relative L2 error of Ci |Ci - Ci_true| / |Ci_true|",
    )  # fmt: skip
    print(f"{'anomaly':>8} {'':>9} {'amplitude':>9} {'x':>6} {'y':>6} {'z':>6}")
    for k, (a_true, a_init, a_fit) in enumerate(
        zip(_anomalies(theta_true), _anomalies(theta_init), _anomalies(theta), strict=True)
    ):
        for label, a in (("true", a_true), ("initial", a_init), ("recovered", a_fit)):
            print(f"{k + 1:>8} {label:>9} {a[0]:9.3f} {a[1]:6.3f} {a[2]:6.3f} {a[3]:6.3f}")

    if _have_matplotlib():
        out = Path(out)
        paths = [_plot_loss(out, losses, errors, "relative L2 error of Ci", "Ci recovery")]
        fields = {
            "initial guess": np.asarray(heat_capacity(theta_init, X, Y, Z)),
            "recovered": np.asarray(heat_capacity(theta, X, Y, Z)),
            "true": Ci_true_np,
        }
        paths.append(_plot_slices(out, fields, x, final_error))
        print("wrote " + ", ".join(str(q) for q in paths))
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0 if ok else 1


def _plot_slices(out: Path, fields, x, final_error) -> Path:
    """The fields on the mid-plane ``y = x[n // 2]`` (through both anomalies), one colour scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    j = len(x) // 2
    vmin = min(float(np.min(f[:, j, :])) for f in fields.values())
    vmax = max(float(np.max(f[:, j, :])) for f in fields.values())
    fig, axes = plt.subplots(1, len(fields), figsize=(4 * len(fields) + 1, 4), sharey=True)
    extent = (x[0], x[-1], x[0], x[-1])
    for ax, (label, f) in zip(axes, fields.items(), strict=True):
        im = ax.imshow(
            f[:, j, :].T, origin="lower", extent=extent, vmin=vmin, vmax=vmax, cmap="viridis"
        )
        ax.set_title(label)
        ax.set_xlabel("x")
    axes[0].set_ylabel("z")
    fig.colorbar(im, ax=list(axes), label="Ci")
    fig.suptitle(f"heat capacity Ci on the plane y = {x[j]:.2f} (final error {final_error:.2e})")
    path = out / "ci.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- lv: Lotka-Volterra parameters -------------------------------------------------------------

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


def demo_lv(out, iters, lr, seed, use_optax=True) -> int:
    t_start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import odegrad as og

    optimizer = _make_optimizer(use_optax, 0.05 if lr is None else lr)
    y0 = jnp.asarray(Y0, jnp.float32)
    ts_fine = jnp.linspace(0.0, T1, N_FINE, dtype=jnp.float32)
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

    def param_error(logp):
        p = np.exp(np.asarray(logp, dtype=np.float64))
        return float(np.linalg.norm(p - p_true) / np.linalg.norm(p_true))

    print(
        "odegrad demo --problem lv: fit the 4 Lotka-Volterra parameters (alpha, beta, gamma, "
        f"delta) to {N_OBS} noisy observations ({NOISE:.0%} log-normal noise) of prey and "
        f"predator on t in [0, {T1:g}]."
    )
    print(
        f"Solver Tsit5, Adaptive(rtol=1e-6, atol=1e-6); gradients by jax.grad through og.solve "
        f"(adjoint og.Auto()); {optimizer[2]}, on log-parameters; {iters} iterations; "
        f"JAX backend {jax.default_backend()}."
    )
    explain = og.explain_adjoint(
        lotka_volterra, y0, (0.0, T1), jnp.asarray(p_init), saveat=og.SaveAt(ts=ts_obs), **solve_kw
    )
    print(f"adjoint: {explain}")
    logp0 = jnp.log(jnp.asarray(p_init))
    logp, losses, errors, loop_s, step_c = _fit(
        loss_fn, logp0, optimizer, iters, param_error, "param err"
    )
    p_fit = np.exp(np.asarray(logp))
    final_loss = float(step_c(logp, optimizer[0](logp))[2])
    noise_loss = float(step_c(jnp.log(jnp.asarray(p_true)), optimizer[0](logp))[2])
    ok = _report_fit(
        losses, errors, final_loss, param_error(logp), loop_s, noise_loss,
        "relative parameter error |p - p_true| / |p_true|",
    )  # fmt: skip
    print(f"{'parameter':>10} {'true':>8} {'initial':>8} {'recovered':>10} {'rel. error':>10}")
    for name, pt, pi, pf in zip(PARAM_NAMES, p_true, p_init, p_fit, strict=True):
        print(f"{name:>10} {pt:8.4f} {pi:8.4f} {pf:10.4f} {abs(pf - pt) / abs(pt):10.2%}")

    if _have_matplotlib():
        out = Path(out)
        curves = {
            "true": np.asarray(trajectory(jnp.asarray(p_true))),
            "initial guess": np.asarray(trajectory(jnp.asarray(p_init))),
            "fitted": np.asarray(trajectory(jnp.asarray(p_fit))),
        }
        paths = [
            _plot_loss(out, losses, errors, "relative parameter error", "Lotka-Volterra fit"),
            _plot_lv(out, np.asarray(ts_fine), curves, ts_obs, obs),
        ]
        print("wrote " + ", ".join(str(q) for q in paths))
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0 if ok else 1


def _plot_lv(out, ts_fine, curves, ts_obs, obs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

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
    return fit_path


DEMOS = {"heat": demo_heat, "lv": demo_lv}


def run_demo(
    out: str = "odegrad-demo",
    iters: int | None = None,
    lr: float | None = None,
    seed: int = 0,
    use_optax: bool = True,
    problem: str = "heat",
    n: int = 16,
) -> int:
    """Run one demo; ``iters=None`` takes the problem's default (heat 150, lv 300)."""
    if problem == "heat":
        return demo_heat(out, 150 if iters is None else iters, lr, seed, use_optax, n=n)
    return demo_lv(out, 300 if iters is None else iters, lr, seed, use_optax)


# --- bench: run the benchmark scripts of a source checkout ---------------------------------------

#: The suite ``python -m odegrad bench`` runs (in this order); name others to run them.
