"""Fit a bouncing ball's restitution and drop height to noisy heights, through its events.

A ball dropped from ``h0`` falls under gravity and bounces off the floor, where its velocity
flips and shrinks by the restitution coefficient ``e``: an ``og.Event`` on ``h = 0`` (falling)
with ``update`` ``v -> -e v``, non-terminal, so the solve goes on after each bounce. The data
are the heights of a ball with ``h0 = 1.2`` m, ``e = 0.8`` at 60 times on ``[0, 1.5]`` s, with
Gaussian noise of 2 cm. Starting from ``h0 = 0.9``, ``e = 0.65``, Adam (optax) minimises the mean
squared error; the gradient flows through every bounce time (the implicit function theorem on
the event condition, see docs/events.md) with the default adjoint ``og.Auto()``.

Prints the loss and the parameters as it goes, the fitted parameters against the true ones at
the end, and writes ``fit.png`` (data, truth, first guess and fit) and ``loss.png`` into
``--out``.

    python examples/bouncing_ball.py            # 300 steps, a few seconds after compiling
    python examples/bouncing_ball.py --quick    # 60 steps
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import odegrad as og

jax.config.update("jax_enable_x64", True)

G = 9.81
T1, N_OBS, NOISE = 1.5, 60, 0.02
TRUE = {"h0": 1.2, "e": 0.8}
# A ball with e < 1 bounces infinitely often before a finite time (Zeno): from h0 = 0.9 that
# time passes T1 once e < 0.56, so the first guess stays above it
GUESS = {"h0": 0.9, "e": 0.65}


def fall(t, y, args):
    return jnp.stack([y[1], -G * jnp.ones_like(y[0])])


BOUNCE = og.Event(
    lambda t, y, p: y[0],
    direction=-1,
    terminal=False,
    update=lambda t, y, p: jnp.stack([y[0], -p["e"] * y[1]]),
)


def heights(p, ts):
    """The ball's height at ``ts`` for parameters ``p = {"h0", "e"}``."""
    sol = og.solve(
        fall,
        jnp.stack([p["h0"], jnp.zeros_like(p["h0"])]),
        (0.0, ts[-1]),
        p,
        events=BOUNCE,
        saveat=og.SaveAt(ts=ts),
        step=og.Adaptive(rtol=1e-8, atol=1e-8),
    )
    return sol.ys[:, 0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="optimiser steps (default 300)")
    ap.add_argument("--quick", action="store_true", help="60 steps")
    ap.add_argument("--lr", type=float, default=0.02, help="Adam's learning rate (0.02)")
    ap.add_argument("--out", default="bouncing-ball-out", help="folder for the two PNG plots")
    args = ap.parse_args(argv)
    steps = 60 if args.quick else args.steps

    ts = jnp.linspace(0.0, T1, N_OBS + 1)[1:]
    true = {k: jnp.asarray(v) for k, v in TRUE.items()}
    rng = np.random.default_rng(0)
    data = heights(true, ts) + NOISE * rng.standard_normal(N_OBS)

    def loss(p):
        return jnp.mean((heights(p, ts) - data) ** 2)

    opt = optax.adam(args.lr)

    @jax.jit
    def step(p, state):
        value, grad = jax.value_and_grad(loss)(p)
        updates, state = opt.update(grad, state, p)
        return optax.apply_updates(p, updates), state, value

    p = {k: jnp.asarray(v) for k, v in GUESS.items()}
    state = opt.init(p)
    start = time.perf_counter()
    losses = []
    for k in range(steps):
        p, state, value = step(p, state)
        losses.append(float(value))
        if k % max(steps // 10, 1) == 0 or k == steps - 1:
            print(f"step {k:4d}  loss {value:.3e}  h0 {float(p['h0']):.4f}  e {float(p['e']):.4f}")
    print(f"{steps} steps in {time.perf_counter() - start:.1f} s (compilation included)")
    print(f"final loss {float(loss(p)):.3e} (noise variance {NOISE**2:.1e})")
    for k in TRUE:
        print(f"  {k}: fitted {float(p[k]):.4f}, true {TRUE[k]}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    fine = jnp.linspace(0.0, T1, 600)[1:]
    guess = {k: jnp.asarray(v) for k, v in GUESS.items()}
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(ts, data, ".", color="k", label="noisy heights")
    ax.plot(fine, heights(true, fine), color="C0", label="truth")
    ax.plot(fine, heights(guess, fine), "--", color="C7", label="first guess")
    ax.plot(fine, heights(p, fine), color="C3", label="fit")
    ax.set_xlabel("t [s]")
    ax.set_ylabel("height [m]")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "fit.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.semilogy(losses)
    ax.set_xlabel("step")
    ax.set_ylabel("mean squared error")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "loss.png"), dpi=120)
    print(f"wrote {args.out}/fit.png and {args.out}/loss.png")


if __name__ == "__main__":
    main()
