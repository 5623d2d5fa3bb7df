"""Continuous adjoints with many save times: the saves as columns of the backward steps, or the
backward solve stopping at every save, and which one ``Tuning.column_width`` picks.

Each problem is differentiated with ``og.Interpolating()``, 100 saves, Tsit5 at
``rtol = 1e-4``, ``atol = 1e-6``, float32, jitted ``jax.grad`` of the mean square of the saves:

* ``columns``: the saves ride as columns whatever ``f`` (``column_width=None``);
* ``stops``: the backward solve stops at every save (``adjoint_columns=0``);
* ``default``: the backend's rule (on CPU: columns while the widest array ``f`` computes from
  ``y``, over the batch, has at most 512 entries; ``widest`` below).

Problems: ``tanh(A y)`` with ``n = 128`` (a matrix-vector product that the columns turn into a
matrix product); 2-d heat diffusion on 16^2 and 48^2 grids (5-point stencil); the neural ODE of
``benchmarks/neural_ode.py`` (MLP 2 -> 64 -> 64 -> 2, softplus, as ``args``) with its batch
stacked into one ``(B, 2)`` state, B = 16 and 256. Best of ``--rounds`` interleaved calls.

    python benchmarks/columns.py
    python benchmarks/columns.py --problems mlp256 --rounds 3
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp

import odegrad as og
from _timing import environment, fmt_time, interleaved_medians, markdown_table
from odegrad._tuning import tuned
from odegrad.adjoint.columns import widest_value


def mlp_stack(batch):
    key = jax.random.PRNGKey(0)
    mlp = eqx.nn.MLP(2, 2, 64, 2, activation=jax.nn.softplus, final_activation=jnp.tanh, key=key)
    y0 = jax.random.uniform(jax.random.PRNGKey(1), (batch, 2), minval=-0.6, maxval=1.0)
    return (lambda t, y, m: jax.vmap(m)(y)), y0, mlp, 10.0


def dense_tanh(n):
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n)) / jnp.sqrt(n) - 0.5 * jnp.eye(n)
    return (lambda t, y, a: jnp.tanh(a @ y)), jnp.ones(n), a, 10.0


def diffusion2d(n):
    def f(t, u, k):
        up = jnp.pad(u, 1, mode="edge")
        lap = up[2:, 1:-1] + up[:-2, 1:-1] + up[1:-1, 2:] + up[1:-1, :-2] - 4 * u
        return k * lap * n * n / 100

    x = jnp.linspace(0, 1, n)
    u0 = jnp.exp(-20 * ((x[:, None] - 0.5) ** 2 + (x[None] - 0.4) ** 2))
    return f, u0, jnp.full((n, n), 0.01), 1.0


PROBLEMS = {
    "tanh128": lambda: dense_tanh(128),
    "diff16": lambda: diffusion2d(16),
    "diff48": lambda: diffusion2d(48),
    "mlp16": lambda: mlp_stack(16),
    "mlp256": lambda: mlp_stack(256),
}
VARIANTS = {"columns": {"column_width": None}, "stops": {"adjoint_columns": 0}, "default": {}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problems", default=",".join(PROBLEMS))
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    print(environment())
    rows = []
    for name in a.problems.split(","):
        f, y0, args, t1 = PROBLEMS[name]()
        arrays = eqx.filter(args, eqx.is_array)
        width = widest_value(lambda y, a_: f(0.0, y, eqx.combine(a_, args)), y0, arrays)
        calls = {}
        for variant in VARIANTS:
            with tuned(**VARIANTS[variant]):
                loss_grad = eqx.filter_jit(eqx.filter_grad(_loss(f, y0, t1)))
                loss_grad(args)  # traced and compiled under the variant's tuning
            calls[variant] = lambda g=loss_grad: g(args)
        t = interleaved_medians(calls, a.rounds, 1)
        best = {v: t[v].best for v in VARIANTS}
        ratio = best["default"] / min(best["columns"], best["stops"])
        rows.append([name, y0.size, width, *(fmt_time(best[v]) for v in VARIANTS), f"{ratio:.2f}x"])
    headers = ["problem", "state", "widest", *VARIANTS, "default / faster"]
    print(markdown_table(headers, rows))


def _loss(f, y0, t1):
    ts = jnp.linspace(0.0, t1, 100)

    def loss(args):
        sol = og.solve(
            f,
            y0,
            (0.0, t1),
            args,
            solver=og.Tsit5(),
            step=og.Adaptive(1e-4, 1e-6),
            saveat=og.SaveAt(ts=ts),
            adjoint=og.Interpolating(),
        )
        return jnp.mean(sol.ys**2)

    return loss


if __name__ == "__main__":
    main()
