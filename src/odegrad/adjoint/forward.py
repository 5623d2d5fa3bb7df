"""Forward sensitivities: ``S = d(saved values)/d(y0, args)`` carried through the forward solve.

The forward pass runs the solve once with a batch of tangents (``jax.vmap`` of ``jax.jvp``), one
per input direction, so the sensitivities ride along with the state step by step (step sizes are
constants: the controller sees only the primal). The reverse pass then contracts the output
cotangents with ``S`` — no backward solve at all. Cost grows with the number of inputs
``n_y0 + n_args``; it is the fastest method when that number is small.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from .._loop import LoopOutput
from .base import AbstractAdjoint, Problem, call_custom_vjp


@dataclass(frozen=True)
class Forward(AbstractAdjoint):
    """Forward-mode sensitivities, usable under ``jax.grad``.

    Memory is ``O(outputs * inputs)``; compute is one solve with ``inputs`` extra tangent lanes.
    Also the method to use for ``jax.jvp`` / ``jax.jacfwd`` through adaptive solves.

    Example:
        >>> og.solve(f, y0, (0.0, 10.0), params, adjoint=og.Forward())
    """

    def describe(self, problem: Problem) -> str:
        n_in = _input_size(problem)
        return f"Forward() with {n_in} sensitivity directions"

    def run(self, problem: Problem) -> LoopOutput:
        problem = problem.without_scan_tap()

        def primal(y0, args_diff):
            out = problem.forward(y0, problem.with_args(args_diff))
            return out._replace(record={})

        def differentiable(out: LoopOutput):
            return (out.y1, out.ts_ys, out.steps_ys)

        _, unravel = ravel_pytree((problem.y0, problem.args_diff))

        @jax.custom_vjp
        def solve(y0, args_diff):
            return primal(y0, args_diff)

        def solve_fwd(y0, args_diff):
            x, _ = ravel_pytree((y0, args_diff))
            basis = jnp.eye(x.size, dtype=x.dtype)

            def tangent(v):
                # primal and tangents in one pass; the primal does not depend on v
                return jax.jvp(lambda x_: primal(*unravel(x_)), (x,), (v,))

            out, sens = jax.vmap(tangent, out_axes=(None, 0))(basis)
            sens = differentiable(sens)  # leading axis: input direction
            return out, (sens, out.stats["accepted"])

        def solve_bwd(res, ct: LoopOutput):
            sens, accepted = res
            n = jax.tree.leaves(sens)[0].shape[0]
            if ct.steps_ys is not None:  # rows after the last step are padding: no cotangent
                ct = ct._replace(
                    steps_ys=jax.tree.map(
                        lambda c: jnp.where(
                            (jnp.arange(c.shape[0]) < accepted).reshape(-1, *[1] * (c.ndim - 1)),
                            c,
                            0,
                        ),
                        ct.steps_ys,
                    )
                )
            cts = differentiable(ct)
            total = jnp.zeros((n,), jax.tree.leaves(sens)[0].dtype)
            for s_leaf, c_leaf in zip(jax.tree.leaves(sens), jax.tree.leaves(cts), strict=True):
                total = total + jnp.tensordot(
                    s_leaf.reshape(n, -1), c_leaf.reshape(-1).astype(s_leaf.dtype), axes=1
                )
            return unravel(total)

        solve.defvjp(solve_fwd, solve_bwd)
        return call_custom_vjp(solve, primal, problem.y0, problem.args_diff)


def _input_size(problem: Problem) -> int:
    return sum(int(x.size) for x in jax.tree.leaves((problem.y0, problem.args_diff)))
