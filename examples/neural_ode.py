"""A neural ODE trained with optax through og.solve: the setting of diffrax's neural-ODE example.

The data are trajectories of the known dynamics ``y' = (z_1, -z_0)``, ``z = y / (1 + y)`` (the
data ODE of diffrax's example). There are 256 initial conditions drawn uniformly from
``[-0.6, 1]^2`` and each is saved at 100 times on ``[0, 10]``. The model is ``y' = mlp(y)``:
an equinox MLP 2 -> 2 (width 64, depth 2, softplus, final tanh) inside an ``eqx.Module``,
passed to ``og.solve`` as ``args``. Each step takes a minibatch of 32 trajectories. The solve
is ``jax.vmap``-ed over the minibatch (Tsit5, rtol 1e-3, atol 1e-6, the default adjoint
``og.Auto()``) and the loss is the mean squared error against the data. One
``eqx.filter_jit``-ed step computes ``eqx.filter_value_and_grad`` of the loss and applies
Adam (optax, learning rate 3e-3).

As in diffrax's example, the first third of the steps fits only the first 10% of each
trajectory, which keeps the fit out of poor local minima; the rest fits all of it.
Everything is seeded, so two runs print the same losses (on the same machine and jax).

Prints the loss every ``--print-every`` steps and the final loss on the whole data set. Writes
``trajectory.png`` (true vs learned trajectories in the phase plane) and ``loss.png`` into
``--out``.

    python examples/neural_ode.py                   # 600 steps, about 20 s on 2 CPU cores
    python examples/neural_ode.py --quick           # 60 steps
    python examples/neural_ode.py --steps 2000 --out my-folder
"""

from __future__ import annotations

import argparse
import os
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import odegrad as og

T1, N_SAVES = 10.0, 100
DATASET, BATCH = 256, 32
STEP = og.Adaptive(rtol=1e-3, atol=1e-6)


class Func(eqx.Module):
    """The learned vector field ``y' = mlp(y)``."""

    mlp: eqx.nn.MLP

    def __init__(self, key, width=64, depth=2):
        self.mlp = eqx.nn.MLP(
            2,
            2,
            width,
            depth,
            activation=jax.nn.softplus,
            final_activation=jax.nn.tanh,
            key=key,
        )

    def __call__(self, t, y, args):
        return self.mlp(y)


def vector_field(t, y, func):
    """``og.solve``'s right-hand side: the module passed as ``args`` is the vector field."""
    return func(t, y, None)


def true_dynamics(t, y, args):
    z = y / (1 + y)
    return jnp.stack([z[1], -z[0]])


def make_data(key):
    ts = jnp.linspace(0.0, T1, N_SAVES)
    y0s = jax.random.uniform(key, (DATASET, 2), minval=-0.6, maxval=1.0)
    tight = og.Adaptive(rtol=1e-6, atol=1e-6)

    def one(y0):
        return og.solve(true_dynamics, y0, (0.0, T1), None, step=tight, saveat=og.SaveAt(ts=ts)).ys

    return ts, jax.jit(jax.vmap(one))(y0s)  # ys: (256, 100, 2); ys[:, 0] are the y0s


def predict(model, ts, y0s):
    """The learned trajectories from each initial condition, at the save times ``ts``."""

    def one(y0):
        sol = og.solve(vector_field, y0, (ts[0], ts[-1]), model, step=STEP, saveat=og.SaveAt(ts=ts))
        return sol.ys

    return jax.vmap(one)(y0s)


def loss_fn(model, ts, ys):
    return jnp.mean((predict(model, ts, ys[:, 0]) - ys) ** 2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="optimiser steps (default 600)")
    ap.add_argument("--quick", action="store_true", help="60 steps")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (3e-3)")
    ap.add_argument("--print-every", type=int, default=25)
    ap.add_argument("--out", default="neural-ode-out", help="folder for the two PNG plots")
    args = ap.parse_args(argv)
    n_steps = 60 if args.quick else args.steps

    data_key, model_key = jax.random.split(jax.random.PRNGKey(5678))
    ts, ys = make_data(data_key)
    model = Func(model_key)
    optim = optax.adam(args.lr)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    print(
        f"neural ODE on {jax.devices()[0].platform}: MLP 2-64-64-2 as args, {DATASET} "
        f"trajectories x {N_SAVES} saves on [0, {T1:g}], minibatch {BATCH}, Adam lr {args.lr:g}"
    )
    why = og.explain_adjoint(
        vector_field, ys[0, 0], (0.0, T1), model, step=STEP, saveat=og.SaveAt(ts=ts)
    )
    print(f"  {why.split(':')[0]}")

    @eqx.filter_jit
    def train_step(model, opt_state, ts, ys):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, ts, ys)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optim.update(grads, opt_state, params)
        return loss, eqx.apply_updates(model, updates), opt_state

    full_loss = eqx.filter_jit(loss_fn)
    initial = float(full_loss(model, ts, ys))
    print(f"  initial loss on all {DATASET} trajectories, all {N_SAVES} saves: {initial:.6f}")

    rng = np.random.default_rng(0)  # the minibatches
    losses, t_start = [], time.perf_counter()
    for step in range(n_steps):
        n_t = N_SAVES // 10 if step < n_steps // 3 else N_SAVES  # the first 10%, then all
        batch = rng.choice(DATASET, BATCH, replace=False)
        t0 = time.perf_counter()
        loss, model, opt_state = train_step(model, opt_state, ts[:n_t], ys[batch, :n_t])
        loss = float(loss)
        losses.append(loss)
        if step == 0 or step == n_steps // 3:
            print(
                f"  (compiled the train step for {n_t} saves in {time.perf_counter() - t0:.1f} s)"
            )
        if step % args.print_every == 0 or step == n_steps - 1:
            print(f"  step {step:4d}  saves {n_t:3d}  loss {loss:.6f}")
    final = float(full_loss(model, ts, ys))
    print(
        f"final loss on all {DATASET} trajectories, all {N_SAVES} saves: {final:.6f} "
        f"(initial {initial:.6f}; {n_steps} steps in {time.perf_counter() - t_start:.1f} s)"
    )
    plot(args.out, ts, ys, eqx.filter_jit(predict)(model, ts, ys[:4, 0]), losses, n_steps)


def plot(out, ts, ys, learned, losses, n_steps):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for i in range(learned.shape[0]):
        (line,) = ax.plot(
            ys[i, :, 0], ys[i, :, 1], lw=2, alpha=0.5, label="true" if i == 0 else None
        )
        ax.plot(
            learned[i, :, 0],
            learned[i, :, 1],
            "--",
            color=line.get_color(),
            label="learned" if i == 0 else None,
        )
        ax.plot(ys[i, 0, 0], ys[i, 0, 1], "o", color=line.get_color())
    ax.set_xlabel("$y_0$")
    ax.set_ylabel("$y_1$")
    ax.set_title(f"neural ODE after {n_steps} steps: 4 trajectories, t in [0, {T1:g}]")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "trajectory.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(losses)
    ax.axvline(n_steps // 3, color="gray", ls=":", label="10% -> 100% of each trajectory")
    ax.set_xlabel("step")
    ax.set_ylabel("minibatch MSE")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=120)
    plt.close(fig)
    print(f"wrote {os.path.join(out, 'trajectory.png')} and {os.path.join(out, 'loss.png')}")


if __name__ == "__main__":
    main()
