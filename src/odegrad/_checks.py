"""The inputs of :func:`odegrad.solve`, checked when the solve is traced: each error names the
argument at fault and the fix (a wrong type, a span, a right-hand side of the wrong shape, a
tolerance the state's dtype cannot resolve, a time being differentiated that must not be)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._saveat import SaveAt
from ._step import AbstractStep, Adaptive, Fixed, StepTo, _as_time, _is_concrete
from ._tracers import differentiated
from ._tree import tightest_tolerance
from .adjoint.auto import Auto
from .adjoint.base import AbstractAdjoint
from .solvers.base import AbstractSolver


def check_types(f, solver, step, saveat, adjoint, max_steps):
    if not isinstance(solver, AbstractSolver):
        raise TypeError(f"solver={solver!r} is not an odegrad solver; use e.g. og.Tsit5().")
    if solver.partitioned:
        if not (isinstance(f, tuple | list) and len(f) == 2 and all(map(callable, f))):
            raise TypeError(
                f"solver={solver!r} is partitioned: pass f=(f_u, f_v) with "
                "du/dt = f_u(t, v, args), dv/dt = f_v(t, u, args), and y0=(u0, v0)."
            )
    elif not callable(f):
        if isinstance(f, tuple | list):
            raise TypeError(
                f"f is a pair of functions but solver={solver!r} is not partitioned: use "
                "og.SemiImplicitEuler() or og.Leapfrog(), or pass one f(t, y, args)."
            )
        raise TypeError(f"f must be callable f(t, y, args) -> dy/dt, got {f!r}.")
    if not isinstance(step, AbstractStep):
        raise TypeError(f"step={step!r}: use og.Adaptive(...), og.Fixed(dt) or og.StepTo(ts).")
    if not isinstance(saveat, SaveAt):
        raise TypeError(f"saveat={saveat!r}: use og.SaveAt(...).")
    if not isinstance(adjoint, AbstractAdjoint):
        raise TypeError(f"adjoint={adjoint!r}: use e.g. og.Auto() or og.Discrete().")
    if not isinstance(max_steps, int | np.integer) or max_steps < 1:
        raise ValueError(f"max_steps={max_steps!r} must be a positive int.")
    if isinstance(step, Adaptive) and not solver.adaptive:
        raise ValueError(
            f"step=og.Adaptive(...) needs an error estimate, which solver={solver!r} does not "
            "have: use step=og.Fixed(dt) / og.StepTo(ts), or an embedded method such as "
            "og.Tsit5()."
        )


def check_complex_state(solver, adjoint):
    """A complex state: explicit and partitioned solvers step it as they step a real one (the
    error norm takes moduli); ``Discrete`` differentiates those steps through JAX's own VJP,
    which treats each complex entry as two real ones, so ``f`` need not be holomorphic (a
    ``|psi|^2`` term). The other adjoints and solvers build real matrices from one direction per
    entry (sensitivities, propagators, Jacobians, spectral radii), and are refused."""
    from .adjoint.discrete import Discrete
    from .solvers.explicit_rk import ExplicitRK
    from .solvers.partitioned import _Partitioned

    if not isinstance(solver, ExplicitRK | _Partitioned):
        raise TypeError(
            f"y0 is complex, which solver={solver!r} does not support: use an explicit "
            "Runge-Kutta method (og.Tsit5(), og.Dopri5(), og.Dopri8(), og.RK4(), ...) or a "
            "partitioned one, or pass the real and imaginary parts as a real state "
            "(y0 = (psi.real, psi.imag))."
        )
    if not isinstance(adjoint, Auto | Discrete):
        raise TypeError(
            f"y0 is complex, which adjoint={adjoint!r} does not support: use og.Discrete() "
            "(og.Auto() picks it), or pass the real and imaginary parts as a real state "
            "(y0 = (psi.real, psi.imag))."
        )


def as_state(y0):
    def leaf(x):
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
                raise TypeError(
                    f"y0 has a leaf of dtype {x.dtype}; the state must be floating point: "
                    "pass e.g. jnp.asarray(y0, dtype=float)."
                )
            raise TypeError(
                f"y0 has a leaf of dtype {x.dtype}; the state must be real or complex floats."
            )
        return x

    if not jax.tree.leaves(y0):
        raise ValueError("y0 has no arrays: pass the initial state as a pytree of arrays.")
    y0 = jax.tree.map(leaf, y0)
    dtypes = {x.dtype for x in jax.tree.leaves(y0)}
    if len(dtypes) > 1:
        raise TypeError(
            f"y0 mixes dtypes {sorted(map(str, dtypes))}; use one floating dtype for the state."
        )
    return y0


def check_times_constant(t_span, step, saveat):
    """Raise where a step size or a step grid is being differentiated (``jax.grad``/``jax.jvp``
    through ``Fixed(dt)`` or ``StepTo(ts)``): the adjoints take the step grid as constant and
    their custom derivative rules cannot return its cotangent, so JAX would fail with a leaked
    tracer, deep inside, after the solve. (``t_span`` and ``SaveAt(ts)`` have derivatives of
    their own, :mod:`odegrad._times`; here only when traced by ``explain_adjoint``.)"""
    inputs = {"t_span": t_span}
    if isinstance(step, Fixed):
        inputs["Fixed(dt)"] = step.dt
    if isinstance(step, StepTo):
        inputs["StepTo(ts)"] = step.ts
    if saveat.ts is not None:
        inputs["SaveAt(ts)"] = saveat.ts
    if isinstance(step, Adaptive) and differentiated(step.jump_ts):
        raise ValueError(
            "og.solve: Adaptive(jump_ts) is being differentiated (jax.grad or jax.jvp reaches "
            "it). Jump times are where steps end, constants like step sizes; a derivative with "
            "respect to a switching time is the jump of f times that time's derivative, which "
            "only an event gives: write the switch into f as a comparison (t < tau) and pass "
            "events=og.switching_events(f, t0, y0, args). Where the times are data that no "
            "differentiated value moves, wrap them in jax.lax.stop_gradient."
        )
    for name, value in inputs.items():
        if differentiated(value):
            raise ValueError(
                f"og.solve: {name} is being differentiated (jax.grad or jax.jvp reaches it). "
                "The step grid is held constant by every adjoint: a solution's dependence on "
                "its step sizes is its discretisation error, not a derivative of the ODE's. "
                "Wrap it in jax.lax.stop_gradient; derivatives with respect to t0, t1 and "
                "SaveAt(ts) are available with og.Adaptive() and og.Fixed(dt)."
            )


def check_t_span(t_span, tdtype):
    if not isinstance(t_span, tuple | list) or len(t_span) != 2:
        raise ValueError(f"t_span={t_span!r} must be a pair (t0, t1).")
    t0, t1 = (_as_time(t, tdtype) for t in t_span)
    if t0.ndim or t1.ndim:
        raise ValueError(f"t_span entries must be scalars, got shapes {t0.shape}, {t1.shape}.")
    if _is_concrete(t0) and _is_concrete(t1):
        a, b = float(t0), float(t1)
        if not (np.isfinite(a) and np.isfinite(b)):
            raise ValueError(f"t_span=({a}, {b}) must be finite.")
    return t0, t1


def check_precision(step: Adaptive, dtype) -> None:
    """Refuse a half-precision state whose dtype cannot resolve the relative tolerance: every
    step's error would be rounding (float16 at the default rtol failed at t0 as "non-finite",
    bfloat16 as "step size underflow")."""
    eps = float(jnp.finfo(dtype).eps)
    rtol = tightest_tolerance(step.rtol)
    if jnp.dtype(dtype).itemsize < 4 and _is_concrete(rtol) and float(rtol) < 10 * eps:
        raise ValueError(
            f"og.Adaptive(rtol={float(rtol):g}) is below what a {jnp.dtype(dtype).name} state "
            f"resolves (its eps is {eps:.3g}): solve in float32 (y0.astype(jnp.float32)), or "
            f"pass rtol >= {10 * eps:.2g}."
        )


def called_as(name: str, signature: str, call, wrapped: str = "f(t, y)"):
    """``call()``, where a wrong number of arguments says how ``name`` is called."""
    try:
        return call()
    except TypeError as e:
        if "positional argument" not in str(e):
            raise
        raise TypeError(
            f"{name}{signature} failed: {e}. odegrad calls {name}{signature} (diffrax's order); "
            f"wrap a function of fewer arguments, e.g. lambda t, y, args: {wrapped}."
        ) from e


def check_rhs(f, solver, t0, y0, args):
    """``f`` must return the structure, shapes and dtype of ``y0`` (checked by tracing once)."""
    if solver.partitioned:
        if not (isinstance(y0, tuple | list) and len(y0) == 2):
            raise ValueError(
                f"solver={solver!r} is partitioned: y0 must be a pair (u0, v0), got "
                f"{jax.tree.structure(y0)}."
            )
        pairs = [("f_u", f[0], y0[1], y0[0]), ("f_v", f[1], y0[0], y0[1])]
    else:
        pairs = [("f", f, y0, y0)]
    for name, fun, arg, like in pairs:
        out = called_as(name, "(t, y, args)", lambda: jax.eval_shape(fun, t0, arg, args))
        want = jax.eval_shape(lambda: like)
        if jax.tree.structure(out) != jax.tree.structure(want):
            raise ValueError(
                f"{name} returned structure {jax.tree.structure(out)} but the state it "
                f"differentiates has structure {jax.tree.structure(want)}; return dy/dt with "
                "the same pytree structure as y0."
            )
        for o, w in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
            if o.shape != w.shape:
                raise ValueError(
                    f"{name} returned a leaf of shape {o.shape} where the state has shape "
                    f"{w.shape}; dy/dt must have the shapes of y0."
                )
            if o.dtype != w.dtype:
                raise ValueError(
                    f"{name} returned dtype {o.dtype} where the state has {w.dtype}; cast the "
                    f"result (e.g. .astype({w.dtype})) or give y0 the dtype f computes in."
                )


#: ``Fixed(dt)`` takes ``ceil(span / dt)`` steps, never longer than ``dt`` (an explicit PDE
#: scheme's stability limit), but a quotient a rounding error over an integer (``1 / 0.1``,
#: float32 times) counts as that integer: its steps are then at most this much longer than dt.
