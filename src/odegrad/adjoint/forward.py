"""Forward sensitivities: ``S = d(saved values)/d(y0, args)`` carried through the forward solve.

The forward pass runs the solve once with a batch of tangents (``jax.vmap`` of ``jax.jvp``), one
per input direction, so the sensitivities ride along with the state step by step (step sizes are
constants: the controller sees only the primal). The reverse pass then contracts the output
cotangents with ``S`` — no backward solve at all. Cost grows with the number of inputs
``n_y0 + n_args``; it is the fastest method when that number is small.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
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
        # the save buffer carries one lane per direction under the vmap below
        problem = dataclasses.replace(
            problem,
            plan=dataclasses.replace(
                problem.plan, lanes=problem.plan.lanes * max(_input_size(problem), 1)
            ),
        )

        def primal(y0, args_diff):
            out = problem.forward(y0, problem.with_args(args_diff))
            return out._replace(record={})

        def differentiable(out: LoopOutput):
            return (out.y1, out.ts_ys, out.steps_ys)

        leaves0, treedef = jax.tree.flatten((problem.y0, problem.args_diff))
        specs = [jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)) for v in leaves0]
        directions = {}  # which input leaves are differentiated, learnt in the forward rule

        @jax.custom_vjp
        def solve(y0, args_diff):
            return primal(y0, args_diff)

        def solve_fwd(y0, args_diff):
            # symbolic zeros tell which inputs are being differentiated: only those get
            # sensitivity directions (a closed-over y0, say, costs nothing)
            wrapped = jax.tree.leaves((y0, args_diff), is_leaf=_is_primal)
            values = [w.value for w in wrapped]
            live = tuple(i for i, w in enumerate(wrapped) if w.perturbed)
            directions["live"] = live
            x, unravel_live = ravel_pytree([values[i] for i in live])

            def rebuild(x_):
                full = list(values)
                for i, v in zip(live, unravel_live(x_), strict=True):
                    full[i] = v
                return jax.tree.unflatten(treedef, full)

            def tangent(v):
                # primal and tangents in one pass; the primal does not depend on v
                return jax.jvp(lambda x_: primal(*rebuild(x_)), (x,), (v,))

            basis = jnp.eye(x.size, dtype=x.dtype if x.size else jnp.float32)
            out, sens = jax.vmap(tangent, out_axes=(None, 0))(basis)
            sens = differentiable(sens)  # leading axis: input direction
            return out, (sens, out.stats["accepted"], x)

        def solve_bwd(res, ct: LoopOutput):
            sens, accepted, x = res
            live = directions["live"]
            n = x.size
            ct = jax.tree.map(
                lambda c: jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c,
                ct,
                is_leaf=lambda c: isinstance(c, SymbolicZero),
            )
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
            total = jnp.zeros((n,), x.dtype)
            for s_leaf, c_leaf in zip(jax.tree.leaves(sens), jax.tree.leaves(cts), strict=True):
                total = total + jnp.tensordot(
                    s_leaf.reshape(n, -1), c_leaf.reshape(-1).astype(s_leaf.dtype), axes=1
                )
            out = [jnp.zeros(sd.shape, sd.dtype) for sd in specs]
            _, unravel_live = ravel_pytree([out[i] for i in live])
            for i, v in zip(live, unravel_live(total), strict=True):
                out[i] = v
            return tuple(jax.tree.unflatten(treedef, out))

        solve.defvjp(solve_fwd, solve_bwd, symbolic_zeros=True)
        return call_custom_vjp(solve, primal, problem.y0, problem.args_diff)


def _is_primal(x) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _input_size(problem: Problem) -> int:
    return sum(int(x.size) for x in jax.tree.leaves((problem.y0, problem.args_diff)))
