"""Forward sensitivities: ``S = d(saved values)/d(y0, args)`` carried through the forward solve.

Two ways to carry them, one per input direction, then contract the output cotangents with ``S``
in the reverse pass (no backward solve at all; cost grows with ``n_y0 + n_args``):

* **steps held fixed** (``control_sensitivities=False``): the solve runs once with a batch of
  tangents (``jax.vmap`` of ``jax.jvp``). Step sizes are constants, the controller sees only the
  state: this is the exact derivative of the discretised solve, as :class:`Discrete`.
* **sensitivities under error control** (``True``; CVODES' ``errconS``): the solve integrates
  the augmented system ``y' = f``, ``S' = (df/dy) S + df/dp`` and the controller's error norm is
  ``max(||e_y||, max_i ||e_S_i||)``, so ``S`` is the ODE's sensitivity to the tolerance. Where
  ``f``'s Jacobian jumps (``abs``, ``max``, ``relu``, ``where``: see :mod:`odegrad._kinks`) the
  first way is off by ``O(sqrt(tol))`` and this one is not (Hindmarsh et al., "SUNDIALS",
  ACM TOMS 31(3), 2005, section 4 on ``errconS``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.flatten_util import ravel_pytree

from .._kinks import jacobian_jumps
from .._loop import LoopOutput, RuntimeGrid
from .._tracers import forward_mode
from .._tree import tolerance_leaves, tree_size
from .._warn import warn_user
from .base import (
    HOLDS_CONSTANT,
    AbstractAdjoint,
    CustomRule,
    Problem,
    custom_vjp_solve,
    instantiate_zeros,
    refuse_dense_cotangent,
)


@dataclass(frozen=True)
class Forward(AbstractAdjoint):
    """Forward-mode sensitivities, usable under ``jax.grad``.

    Memory is ``O(outputs * inputs)``; compute is one solve with ``inputs`` extra tangent lanes.
    Also the method to use for ``jax.jvp`` / ``jax.jacfwd`` through adaptive solves.

    ``control_sensitivities``: put the sensitivities under the step-size controller's error
    control (see the module docstring). ``None`` (default) does so when ``f`` has kinks and the
    steps are adaptive with an explicit solver; ``True`` whenever the steps are adaptive and the
    solver explicit; ``False`` never (the exact derivative of the discretised solve).

    Example:
        >>> og.solve(f, y0, (0.0, 10.0), params, adjoint=og.Forward())
    """

    control_sensitivities: bool | None = None

    def controls(self, problem: Problem) -> tuple[bool, str]:
        """Whether the sensitivities are under error control here, and why, in words."""
        if problem.grid is not None or isinstance(problem.control, RuntimeGrid):
            return False, "steps fixed in advance: the derivative of the discretised solve"
        if self.control_sensitivities is False:
            return False, "steps held fixed (control_sensitivities=False)"
        if problem.solver.partitioned or getattr(problem.solver, "implicit", False):
            why = "implicit" if getattr(problem.solver, "implicit", False) else "partitioned"
            return False, (
                f"steps held fixed: the {why} solver {problem.solver!r} differentiates its own "
                "steps (error control of the sensitivities is for explicit solvers)"
            )
        if problem.plan.dense:
            return False, "steps held fixed: SaveAt(dense=True) needs the state's own steps"
        if problem.events is not None:
            return False, "steps held fixed: events jump the state (error control is without)"
        if self.control_sensitivities:
            return True, "sensitivities under error control (control_sensitivities=True)"
        if problem.kinks:
            return True, (
                "sensitivities under error control, because "
                + jacobian_jumps(problem.kinks, problem.events)
            )
        return False, "steps held fixed: f is smooth, the derivative of the discretised solve"

    def describe(self, problem: Problem) -> str:
        return (
            f"Forward() with {_input_size(problem)} sensitivity directions; "
            + (self.controls(problem)[1])
        )

    def run(self, problem: Problem) -> LoopOutput:
        controlled, why = self.controls(problem)
        if self.control_sensitivities and not controlled:  # asked for, and not possible here
            warn_user(
                f"og.Forward(control_sensitivities=True) does not apply to this solve: {why}."
            )
        problem = problem.without_scan_tap()
        lanes = problem.plan.lanes
        # the save buffer carries one lane per direction under the vmap below
        problem = dataclasses.replace(
            problem,
            plan=dataclasses.replace(
                problem.plan, lanes=problem.plan.lanes * max(_input_size(problem), 1)
            ),
        )

        def differentiable(out: LoopOutput):
            log = () if out.events is None else (out.events.ts, out.events.ys)
            return (out.y1, out.ts_ys, out.steps_ys, out.t1, *log)

        leaves0, treedef = jax.tree.flatten((problem.y0, problem.args_diff))
        specs = [jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)) for v in leaves0]
        directions = {}  # which input leaves are differentiated, learnt in the forward rule

        def rule(problem: Problem) -> CustomRule:
            def primal(y0, args_diff, problem=problem):
                out = problem.forward(y0, problem.with_args(args_diff))
                return out._replace(record={})

            # a solve that is not differentiated runs the plain loop, its save chunks sized
            # for one lane (Lotka-Volterra, 50 saves: 2 chunks instead of 10, a switch branch
            # each)
            plain_plan = dataclasses.replace(problem.plan, lanes=lanes)
            plain = dataclasses.replace(problem, plan=plain_plan)

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
                if controlled:
                    y0_, args_ = rebuild(x)
                    dy0, dargs = jax.vmap(lambda v: jax.jvp(rebuild, (x,), (v,))[1])(basis)
                    out, sens = _augmented_solve(problem, y0_, args_, dy0, dargs)
                else:
                    out, sens = jax.vmap(tangent, out_axes=(None, 0))(basis)
                    sens = differentiable(sens)  # leading axis: input direction
                n_events = None if out.events is None else out.events.count
                return out, (sens, (out.stats["accepted"], n_events), x)

            def solve_bwd(res, ct: LoopOutput):
                sens, (accepted, n_events), x = res
                live = directions["live"]
                n = x.size
                refuse_dense_cotangent("og.Forward()", ct.dense)
                ct = instantiate_zeros(ct)
                if ct.steps_ys is not None:  # rows after the last step are padding: no cotangent
                    ct = ct._replace(
                        steps_ys=jax.tree.map(
                            lambda c: jnp.where(
                                (jnp.arange(c.shape[0]) < accepted).reshape(
                                    -1, *[1] * (c.ndim - 1)
                                ),
                                c,
                                0,
                            ),
                            ct.steps_ys,
                        )
                    )
                if ct.events is not None:  # rows after the last event: padding, no cotangent
                    rows = lambda c: (jnp.arange(c.shape[0]) < n_events).reshape(
                        -1, *[1] * (c.ndim - 1)
                    )
                    log = jax.tree.map(
                        lambda c: jnp.where(rows(c), c, 0), (ct.events.ts, ct.events.ys)
                    )
                    ct = ct._replace(events=ct.events._replace(ts=log[0], ys=log[1]))
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

            return CustomRule(partial(primal, problem=plain), solve_fwd, solve_bwd)

        if controlled and forward_mode((problem.y0, problem.args_diff)):
            if not problem.plan.steps:
                return _controlled_tangent_solve(problem, lanes)
            warn_user(
                "og.Forward() under jax.jvp/jax.jacfwd with SaveAt(steps=True): the steps are "
                "held fixed (controlling the sensitivities would move the steps the rows are "
                "saved at), so the derivative is the discretised solve's, off by ~sqrt(tol) "
                f"where f has kinks. Differentiate with jax.grad for {why}."
            )
        return custom_vjp_solve(problem, rule, symbolic_zeros=True)


def _controlled_tangent_solve(problem: Problem, lanes: int) -> LoopOutput:
    """The solve under forward-mode autodiff (``jax.jvp``, ``jax.jacfwd``) with its tangent from
    :func:`_augmented_solve` along the one direction JAX pushes (``jax.jacfwd`` vmaps it), the
    sensitivities under error control as under ``jax.grad``. The primal is the plain solve's,
    which no tangent reaches (so ``jax.jacfwd``'s primal stays unbatched); the tangent's solve
    takes its own steps. (A ``jax.custom_jvp``: JAX refuses forward mode through the custom VJP
    the reverse pass uses, and its fallback differentiates the loops with the steps held.)"""
    consts, with_consts = problem.traced_constants()
    plain = lambda p: dataclasses.replace(p, plan=dataclasses.replace(p.plan, lanes=lanes))

    def run(y0, args_diff, consts):
        p = plain(with_consts(consts))
        return p.forward(y0, p.with_args(args_diff))._replace(record={})

    solve = jax.custom_jvp(run)

    def solve_jvp(primals, tangents):
        y0, args_diff, consts = primals
        dy0, dargs, dconsts = tangents
        if not all(isinstance(t, SymbolicZero) for t in jax.tree.leaves(dconsts)):
            raise ValueError(HOLDS_CONSTANT)
        dy0, dargs = instantiate_zeros((dy0, dargs))
        out = run(y0, args_diff, consts)
        one = lambda tree: jax.tree.map(lambda x: jnp.asarray(x)[None], tree)
        p = plain(with_consts(consts))
        _, (dy1, dts_ys, _, _) = _augmented_solve(p, y0, args_diff, one(dy0), one(dargs))
        tangent = jax.tree.map(_zero_tangent, out)
        first = lambda tree: None if tree is None else jax.tree.map(lambda x: x[0], tree)
        return out, tangent._replace(y1=first(dy1), ts_ys=first(dts_ys))

    solve.defjvp(solve_jvp, symbolic_zeros=True)
    return solve(problem.y0, problem.args_diff, consts)


def _zero_tangent(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def _augmented_solve(problem: Problem, y0, args_diff, dy0, dargs):
    """Solve ``(y, S)`` with ``S' = (df/dy) S + (df/dp) dp`` under one error control.

    Returns the state's :class:`LoopOutput` and the sensitivities of ``(y1, ts_ys, steps_ys)``,
    input direction leading. ``dy0``, ``dargs``: the directions (leading axis) in ``y0``/``args``.
    """
    f, fn, combine = problem.f, problem.plan.fn, problem.with_args

    def directional(g, y, ad, s_y):
        """``g(y, ad)`` and its derivative along each direction ``(s_y[i], dargs[i])``."""
        return jax.vmap(lambda s, d: jax.jvp(g, (y, ad), (s, d)), out_axes=(None, 0))(s_y, dargs)

    def f_aug(t, y_s, ad):
        return directional(lambda y, a: f(t, y, combine(a)), y_s[0], ad, y_s[1])

    def fn_aug(tau, y_s, ad):
        return directional(lambda y, a: fn(tau, y, combine(a)), y_s[0], ad, y_s[1])

    aug = dataclasses.replace(
        problem,
        f=f_aug,
        y0=(y0, dy0),
        args=args_diff,
        args_diff=args_diff,
        combine=lambda a, static: a,
        args_static=[],
        save_fn=None,
        control=_SensitivityNorm(problem.control, tree_size(y0)),
        plan=dataclasses.replace(problem.plan, fn=fn_aug, fn_reads_args=True, fn_is_state=False),
    )
    out = aug.forward()
    n_rows = out.stats["accepted"]

    def leading(tree, rows=None):
        """Direction axis first; rows past the last step (padding) carry no sensitivity."""
        if tree is None:
            return None
        tree = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), tree)
        if rows is None:
            return tree
        return jax.tree.map(
            lambda x: jnp.where(
                (jnp.arange(x.shape[1]) < rows).reshape(1, -1, *[1] * (x.ndim - 2)), x, 0
            ),
            tree,
        )

    def first(pair):
        return None if pair is None else pair[0]

    def second(pair):
        return None if pair is None else pair[1]

    n_dirs = jax.tree.leaves(dy0)[0].shape[0]
    t1_sens = jnp.zeros((n_dirs,), jnp.result_type(out.t1))  # no events here: t1 is fixed
    sens = (
        out.y1[1],
        leading(second(out.ts_ys)),
        leading(second(out.steps_ys), n_rows),
        t1_sens,
    )
    out = out._replace(
        y1=out.y1[0], ts_ys=first(out.ts_ys), steps_ys=first(out.steps_ys), record={}
    )
    return out, sens


@dataclass(frozen=True)
class _SensitivityNorm:
    """An :class:`~odegrad.Adaptive` controller over ``(y, S)`` whose error ratio is the largest
    of the state's and each direction's (CVODES' ``errconS``); the first step is the state's."""

    base: Any
    n_state: int

    def __getattr__(self, name):
        return getattr(self.base, name)

    def error_ratio(self, err, y0, y1):
        ratio = self.base.error_ratio(err[0], y0[0], y1[0])
        num = 0.0
        rtols = tolerance_leaves(self.base.rtol, y0[0], "rtol")
        atols = tolerance_leaves(self.base.atol, y0[0], "atol")
        leaves = (jax.tree.leaves(x[1]) for x in (err, y0, y1))
        for e, a, b, rt, at in zip(*leaves, rtols, atols, strict=True):
            scale = at + rt * jnp.maximum(jnp.abs(a), jnp.abs(b))
            num = num + jnp.sum(jnp.square(e / scale).reshape(e.shape[0], -1), axis=1)
        per_direction = jnp.sqrt(num / max(self.n_state, 1))
        return jnp.maximum(ratio, jnp.max(per_direction, initial=0.0))

    def initial_step(self, f, t0, y0, f0, args, order, span):
        return self.base.initial_step(
            lambda t, y, a: f(t, (y, y0[1]), a)[0], t0, y0[0], f0[0], args, order, span
        )


def _is_primal(x) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _input_size(problem: Problem) -> int:
    return sum(int(x.size) for x in jax.tree.leaves((problem.y0, problem.args_diff)))
