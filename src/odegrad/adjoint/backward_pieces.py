"""Pieces of the continuous adjoints' backward pass (:mod:`~odegrad.adjoint.adjoint_ode`) that
read none of its state: the products with ``f``'s VJP, a solver state that knows nothing yet, the
report of a failed backward solve, and the trace-time warning of switches in time it cannot see.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._solution import Result, SolveFailure
from .._switches import time_switch_labels
from .._warn import warn_user
from .base import Problem


def unseen_time_switches(problem: Problem) -> list[str]:
    """Where ``f`` switches branch in time (:func:`~odegrad._switches.time_switch_labels`) while
    the solve says nothing of where (no events, no ``jump_ts``): a continuous adjoint's backward
    solve, whose error norm leaves ``dL/dp`` out (a seminorm), steps across those times unseen,
    and ``dL/dp`` is off there by far more than the tolerance. ``[]`` when there are none."""
    if problem.solver.partitioned or problem.events is not None or problem.grid is not None:
        return []
    if getattr(problem.control, "jump_ts", None) is not None:
        return []
    try:
        t0 = problem.direction * problem.tau0
        return time_switch_labels(problem.f, t0, problem.y0, problem.args)
    except Exception:  # a reader's limit is no reason to refuse the solve: none found
        return []


def warn_unseen_switches(name: str, problem: Problem) -> None:
    """Warn at trace time of :func:`unseen_time_switches` (``Auto`` avoids them, a continuous
    adjoint chosen by hand warns)."""
    labels = unseen_time_switches(problem)
    if labels:
        warn_user(
            f"og.{name}(): f switches branch in time at {', '.join(labels)}, and the solve has "
            "no events there: the backward solve's steps cross those times unseen (its error "
            "control leaves dL/dp out), so dL/dp is off there by far more than the tolerance "
            "(a jump: a fraction of a step; jnp.interp's knots: 5e-5 at rtol 1e-10). "
            "Pass events=og.switching_events(f, t0, y0, args) (every adjoint then adds the "
            "crossing's term), or step=og.Adaptive(jump_ts=...) for switches at known times, or "
            "use adjoint=og.Discrete()."
            + (
                " (step_ts lands steps there but does not restart the solver, which a jump in "
                "f's value needs: pass such times as jump_ts; at kinks, such as jnp.interp's "
                "knots, step_ts is enough.)"
                if getattr(problem.control, "step_ts", None) is not None
                else ""
            )
        )


def report_backward_failure(name: str, max_steps: int, code, t) -> None:
    """Host side: the backward solve of some member failed; name why and where."""
    code, t = np.asarray(code).ravel(), np.asarray(t).ravel()
    k = int(np.argmax(code != 0))  # (the members whose failure raises)
    why = {
        int(Result.max_steps_reached): f"ran out of steps (max_steps={max_steps} per interval)",
        int(Result.step_size_underflow): "took a step too small (the adjoint system is stiff)",
        int(Result.nonfinite): (
            "went non-finite from a finite adjoint (it overflowed, or an implicit solver's "
            "Newton iterations failed at every step size: in float32, loosen its atol)"
        ),
    }.get(int(code[k]), f"failed ({Result(int(code[k])).name})")
    member = f" (batch member {k})" if code.size > 1 else ""
    raise SolveFailure(
        f"og.{name}: the backward (adjoint) solve {why} at t={float(t[k]):.6g}{member}, so the "
        "gradient is nan. Raise max_steps=, loosen the adjoint's step (its tolerances are the "
        f"forward's tightest; e.g. og.{name}(step=og.Adaptive(rtol=1e-5, atol=1e-5))), or use "
        "og.Discrete()."
    )


def unknown_resume(solver, z, args, tdtype):
    """A :meth:`~odegrad.solvers.base.AbstractSolver.resume_state` for the backward state ``z``
    that holds nothing yet (nan), so that ``init_from`` starts afresh; ``None`` for solvers
    that hand on nothing."""

    def resume(z_):
        t = jnp.zeros((), tdtype)
        return solver.resume_state(solver.init(lambda t_, y_, a_: y_, t, z_, args))

    def unknown(x):
        return jnp.full(x.shape, jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else 0, x.dtype)

    return jax.tree.map(unknown, jax.eval_shape(resume, z))


def vjps(f, problem: Problem):
    """``(f, vjp, vjp_columns, vjp_state)`` with the products taken by ``jax.vjp`` of ``f``."""

    def vjp(t, y, args_diff, ct):
        _, pull = jax.vjp(lambda y_, a_: f(t, y_, problem.with_args(a_)), y, args_diff)
        return pull(ct)

    def vjp_columns(t, y, args_diff, ct):
        # one product over the columns: dL/dp summed inside it (for a dense layer a
        # matrix product), not one parameter-sized cotangent per column
        each = lambda a_: jax.vmap(lambda t_, y_: f(t_, y_, problem.with_args(a_)))
        _, pull = jax.vjp(lambda y_, a_: each(a_)(t, y_), y, args_diff)
        return pull(ct)

    def vjp_state(t, y, args_diff, cts):
        # columns at one point: f linearised once, its transpose applied per column
        out, pull = jax.vjp(lambda y_: f(t, y_, problem.with_args(args_diff)), y)
        return out, jax.vmap(pull)(cts)[0]

    return f, vjp, vjp_columns, vjp_state
