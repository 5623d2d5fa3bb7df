"""Reverse-mode derivatives with respect to the times: ``t0``, ``t1`` and ``SaveAt(ts)``.

Every adjoint holds the time grid constant. The saved states depend on the times as the ODE's
solution does (Hairer, Nørsett and Wanner, *Solving ODEs I*, I.14):

* a state saved at time ``s`` (a save time, or ``t1``): ``d y(s) / d s = f(s, y(s))``;
* the start: moving ``t0`` with ``y0`` held shifts the whole trajectory,
  ``d y(s) / d t0 = -(d y(s) / d y0) f(t0, y0)``, so ``dL/dt0 = -<a0, f(t0, y0)>`` with ``a0``
  the cotangent of ``y0`` through every saved state after ``t0`` (the row that
  ``SaveAt(t0=True)`` saves is ``y0`` itself and does not move).

:func:`solve_with_time_derivatives` wraps the solve in a custom VJP that adds these to the
adjoint's gradient, one evaluation of ``f`` per saved row. They are the ODE's derivatives: the
discretised solve's differ from them by its error, like the continuous adjoints' gradients.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._saveat import SaveAt
from ._step import Fixed, StepTo
from ._tracers import differentiated, forward_mode
from ._tree import hoist_rhs, lift_tracers, split_arrays
from .adjoint import Auto, Discrete
from .adjoint.base import instantiate_zeros, perturbed_leaves, primal_values, refuse_perturbed


def solve_with_time_derivatives(solve, f, y0, t_span, args, options: dict):
    """``solve(f, y0, t_span, args, **options)`` whose ``sol.ts`` and ``sol.ys`` have
    reverse-mode derivatives with respect to ``t_span`` and ``SaveAt(ts)`` too."""
    saveat = options["saveat"] or SaveAt(t1=True)
    options = {**options, "saveat": saveat}
    _check_supported(saveat, options)
    arrays, rebuild, arrays_of = split_arrays(args)
    partitioned = options["solver"] is not None and options["solver"].partitioned
    # Under jax.grad(jax.jit(loss)) the rules below are traced after the jit trace: what they
    # use of it must be their arguments. f's closure joins the differentiable arrays; traced
    # options (og.Fixed(dt), tolerances) are held constant.
    f_conv, f_consts = _explicit_rhs(f, partitioned, t_span, y0, arrays, rebuild)
    # (saveat's ts come in the times: its other fields are never traced)
    opts, with_opts = lift_tracers({k: v for k, v in options.items() if k != "saveat"})

    def rhs_of(consts):
        """The user's f (a pair when partitioned) on the user's args, from hoisted consts."""
        if partitioned:
            return tuple(
                (lambda t, y, a, c=c, k=k: c(t, y, arrays_of(a), *consts[k]))
                for k, c in enumerate(f_conv)
            )
        return lambda t, y, a: f_conv(t, y, arrays_of(a), *consts)

    def outputs(times, y0, arrays, opts):
        if differentiated(times):  # an outer derivative of the times: its rules are first-order
            raise NotImplementedError(
                "og.solve: second derivatives with respect to t_span or SaveAt(ts) are not "
                "supported (first derivatives are, in reverse and in forward mode)."
            )
        t0, t1, ts = times
        user_arrays, consts = arrays
        inner = {**with_opts(opts), "saveat": dataclasses.replace(saveat, ts=ts)}
        sol = solve(rhs_of(consts), y0, (t0, t1), rebuild(user_arrays), **inner)
        return (sol.ts, sol.ys), (sol.stats, sol.result)

    def rhs(t, y, arrays):
        t = jnp.asarray(t, jnp.finfo(jnp.result_type(*jax.tree.leaves(y))).dtype)  # as f's
        user_arrays, consts = arrays
        f, a = rhs_of(consts), rebuild(user_arrays)
        if partitioned:
            (f_u, f_v), (u, v) = f, y
            return f_u(t, v, a), f_v(t, u, a)
        return f(t, y, a)

    first = 1 if saveat.t0 else 0  # the t0 row saves y0 itself: it does not move with t0
    moving = lambda tree: jax.tree.map(lambda x: x[first:], tree)

    @jax.custom_vjp
    def run(times, y0, arrays, opts):
        return outputs(times, y0, arrays, opts)

    # which inputs a derivative reaches: known in the forward rule, read by the backward one
    reached = {}

    def run_fwd(times, y0, arrays, opts):
        refuse_perturbed(opts)  # a tolerance or og.Fixed(dt) being differentiated
        # differentiate the solve only in what a derivative reaches, so that og.Auto inside
        # counts those inputs alone (a concrete y0 of 200 entries made it leave Forward); y0's
        # cotangent also gives t0's
        reached["y0"] = any(perturbed_leaves(y0)) or perturbed_leaves(times)[0]
        reached["arrays"] = moving = perturbed_leaves(arrays)
        times, y0, arrays, opts = primal_values((times, y0, arrays, opts))
        leaves, tree = jax.tree.flatten(arrays)
        fixed = [x for x, m in zip(leaves, moving, strict=True) if not m]

        def solve_in(y, moving_leaves):
            it, rest = iter(moving_leaves), iter(fixed)
            a = jax.tree.unflatten(tree, [next(it) if m else next(rest) for m in moving])
            return outputs(times, y if reached["y0"] else y0, a, opts)

        moving_leaves = [x for x, m in zip(leaves, moving, strict=True) if m]
        y_in = y0 if reached["y0"] else ()
        (ts, ys), pullback, aux = jax.vjp(solve_in, y_in, moving_leaves, has_aux=True)
        return ((ts, ys), aux), (pullback, times, y0, arrays, ts, ys)

    def cotangents_of(pullback, ct, y0, arrays):
        """``(ct_y0, ct_arrays)`` from the forward rule's pullback (zeros where unreached)."""
        ct_y, ct_moving = pullback(ct)
        leaves, tree = jax.tree.flatten(arrays)
        it = iter(ct_moving)
        moving = reached["arrays"]
        ct_a = [next(it) if m else jnp.zeros_like(x) for x, m in zip(leaves, moving, strict=True)]
        ct_y0 = ct_y if reached["y0"] else jax.tree.map(jnp.zeros_like, y0)
        return ct_y0, jax.tree.unflatten(tree, ct_a)

    def run_bwd(res, ct):
        pullback, times, y0, arrays, ts, ys = res
        ct_ts, ct_ys = instantiate_zeros(ct[0])
        ct_y0, ct_arrays = cotangents_of(pullback, (jnp.zeros_like(ts), ct_ys), y0, arrays)
        # each saved row's time: its own cotangent, and the state's motion <ct, f(t, y)>
        moved = lambda t, y, c: _dot(c, rhs(t, y, arrays))
        per_row = ct_ts[first:] + jax.vmap(moved)(ts[first:], moving(ys), moving(ct_ys))
        t0, t1, save_ts = times
        n_ts = 0 if save_ts is None else jnp.shape(save_ts)[0]
        a0 = ct_y0  # less the t0 row's own cotangent, which reached y0 unchanged
        if saveat.t0:
            a0 = jax.tree.map(lambda c, r: c - r[0], ct_y0, ct_ys)
        ct_t0 = (ct_ts[0] if saveat.t0 else 0) - _dot(a0, rhs(t0, y0, arrays))
        ct_t1 = per_row[n_ts] if saveat.t1 else 0
        cts = (_like(ct_t0, t0), _like(ct_t1, t1), _like(per_row[:n_ts], save_ts))
        return cts, ct_y0, ct_arrays, None  # the options: held constant

    run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)

    # forward mode (jax.jvp, jacfwd), which a custom VJP refuses: the same derivatives pushed
    # forward, y0's tangent less f(t0, y0) dt0 through the solve
    @functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
    def run_forward_mode(times, y0, arrays, opts):
        return outputs(times, y0, arrays, opts)

    @run_forward_mode.defjvp
    def _(opts, primals, tangents):
        times, y0, arrays = primals
        (d_t0, d_t1, d_ts), d_y0, d_arrays = tangents
        t0, _, save_ts = times
        f0 = rhs(t0, y0, arrays)
        shifted = jax.tree.map(lambda d, g: d - g * d_t0, d_y0, f0)
        (ts, ys), (d_ts_out, d_ys), aux = jax.jvp(
            lambda y, a: outputs(times, y, a, opts), (y0, arrays), (shifted, d_arrays), has_aux=True
        )
        row = lambda d: jnp.reshape(jnp.asarray(d, ts.dtype), (-1,))
        d_times = [row(d_t0)] if saveat.t0 else []
        d_times += [] if save_ts is None else [row(d_ts)]
        d_times += [row(d_t1)] if saveat.t1 else []
        d_row = jnp.concatenate(d_times)
        motion = jax.vmap(lambda t, y, d: jax.tree.map(lambda g: g * d, rhs(t, y, arrays)))(
            ts[first:], moving(ys), d_row[first:]
        )
        d_ys = jax.tree.map(lambda d, m: d.at[first:].add(m), d_ys, motion)
        if saveat.t0:  # the t0 row is y0: its tangent is y0's, not the shifted one
            d_ys = jax.tree.map(lambda d, g: d.at[0].add(g * d_t0), d_ys, f0)
        zeros = jax.tree.map(lambda x: np.zeros(jnp.shape(x), jax.dtypes.float0), aux)
        return ((ts, ys), aux), ((d_row + 0 * d_ts_out, d_ys), zeros)

    t0, t1 = t_span
    times = (t0, t1, saveat.ts)
    arrays = (arrays, f_consts)
    # forward mode from the inputs: under jax.jit JAX refuses a custom VJP's forward mode only
    # when lowering, after this returns
    if forward_mode((times, y0, arrays)):
        (ts, ys), (stats, result) = run_forward_mode(times, y0, arrays, opts)
    else:
        (ts, ys), (stats, result) = run(times, y0, arrays, opts)
    return ts, ys, stats, result


def _explicit_rhs(f, partitioned: bool, t_span, y0, arrays, rebuild):
    """``(conv, consts)``: ``f`` (each of a pair) as ``conv(t, y, arrays, *consts)`` on the
    array leaves of ``args``, every traced value it closes over in ``consts``
    (:func:`~odegrad._tree.hoist_rhs`)."""
    # the solve calls f with its times in the state's real dtype, whatever the span's (a
    # float64 span of a float32 state under x64 made f's hoisted jaxpr refuse float32 times)
    t = jax.ShapeDtypeStruct((), jnp.finfo(jnp.result_type(*jax.tree.leaves(y0))).dtype)
    on_arrays = lambda g: lambda t, y, a: g(t, y, rebuild(a))
    g = tuple(on_arrays(h) for h in f) if partitioned else on_arrays(f)
    return hoist_rhs(g, partitioned, t, y0, arrays)


def _like(c, t):
    """A cotangent ``c`` shaped and typed like the time ``t`` (``None`` for ``None``)."""
    if t is None:
        return None
    return jnp.broadcast_to(c, jnp.shape(t)).astype(jnp.result_type(t))


def _dot(a: Any, b: Any):
    """``<a, b>`` summed over the leaves of two pytrees of one structure: ``Re sum(a b)``, JAX's
    pairing of a cotangent with a tangent (no conjugate: for a complex state ``jnp.vdot`` gave
    a wrong time derivative)."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return sum(jnp.real(jnp.sum(x * y)) for x, y in pairs)


def _unsupported(saveat, options: dict) -> list[str]:
    """What of this solve has no derivative with respect to the times."""
    unsupported = {
        "SaveAt(fn=...)": saveat.fn is not None,
        "SaveAt(steps=True)": saveat.steps,
        "SaveAt(dense=True)": saveat.dense,
        "events=": options.get("events") is not None,
        "step=og.StepTo(ts)": isinstance(options.get("step"), StepTo),
    }
    return [name for name, on in unsupported.items() if on]


def may_differentiate_times(t_span, saveat, options: dict) -> bool:
    """Whether the times of a solve that supports their derivatives are traced (under
    ``jax.jit``): a ``jax.grad`` outside the jit may differentiate them, unseen here."""
    if not isinstance(t_span, tuple | list) or not isinstance(saveat, SaveAt | None):
        return False  # og.solve's checks explain
    saveat = saveat or SaveAt(t1=True)
    times = [t for t in (*t_span, saveat.ts) if t is not None]
    traced = any(isinstance(t, jax.core.Tracer) for t in jax.tree.leaves(times))
    if not traced or _unsupported(saveat, options):
        return False
    # A concrete span on an og.Fixed grid may run as a plain scan (Discrete("all"), which
    # og.Auto() picks there), whose derivatives JAX takes itself in both modes: this custom
    # VJP would refuse a jax.jvp outside the jit (the save times' derivative is then the
    # interpolant's, the discretised solve's).
    step, adjoint = options.get("step"), options.get("adjoint")
    static = isinstance(step, Fixed) and not isinstance(step.dt, jax.core.Tracer)
    static = static and not any(isinstance(t, jax.core.Tracer) for t in t_span)
    return not (static and (adjoint is None or isinstance(adjoint, Auto | Discrete)))


def _check_supported(saveat, options: dict) -> None:
    used = _unsupported(saveat, options)
    if used:
        raise ValueError(
            f"og.solve: t_span or SaveAt(ts) is being differentiated, which is supported for "
            f"states saved at t0, t1 and SaveAt(ts), not with {', '.join(used)}. To "
            "differentiate with respect to a time span T there, solve on s in [0, 1] with the "
            "vector field scaled, f_s(s, y, (T, args)) = T * f(t0 + s T, y, args), and pass T "
            "inside args; or wrap the times in jax.lax.stop_gradient if their derivative is "
            "not wanted."
        )
