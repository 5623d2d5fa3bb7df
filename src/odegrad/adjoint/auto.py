"""``og.Auto``: pick an adjoint method from the problem, and say why."""

from __future__ import annotations

from dataclasses import dataclass

import jax

from .._kinks import jacobian_jumps
from .._loop import LoopOutput, RuntimeGrid
from .._step import _is_concrete
from .._tree import tightest_tolerance
from .._tuning import tuning
from .backward_pieces import unseen_time_switches
from .base import AbstractAdjoint, Problem
from .continuous import Interpolating
from .discrete import CHOSEN_BY_AUTO, Discrete
from .forward import Forward


@dataclass(frozen=True)
class Auto(AbstractAdjoint):
    """Choose the adjoint from the problem's size, step count, memory budget and solver.

    Rules, in order:

    1. A step grid known at trace time (``Fixed``/``StepTo``): :class:`Discrete` — JAX's own
       reverse pass over one ``lax.scan`` when every step fits in ``memory_budget``, else binomial
       checkpointing. Exact, and the fastest reverse pass there is.
    2. Adaptive steps with at most ``forward_max_inputs`` inputs (default 32, from the tuning
       table; states + differentiable parameters; when solving, only traced ones count: a
       concrete ``y0`` carries no derivative): :class:`Forward` — the sensitivities ride along
       the one forward solve and no backward solve is needed. Where ``f`` has kinks (below) they
       are put under the step-size controller's error control.
    3. Otherwise, for a smooth ``f``: :class:`Discrete` (exact gradient of the adaptive solve,
       memory bounded by the budget through binomial checkpointing).
    4. Otherwise (``f`` has kinks) with ``rtol < kink_rtol`` (default 1e-3):
       :class:`Interpolating`, whose backward solve controls the error of the adjoint itself.
       At looser tolerances :class:`Discrete` stays: its kink error grows like ``sqrt(tol)``,
       the continuous adjoint's like ``tol``, and at 1e-3 the two are within 2x (ReLU MLP
       against CVODES: 1.9e-2 and 8.7e-3; at 1e-4: 1.1e-2 and 2.0e-3; at 1e-6: 2.2e-3 and
       1.8e-5), while the backward solve costs far more under ``jax.vmap`` with dense saves.

    Kinks: ``abs``, ``max``/``min``, ``relu``, ``clip``, ``where`` on a state-dependent test,
    ``sign``, ``floor``, ``argmax``, ``sort``, ... of the state or the parameters, found in the
    JVP of ``f`` at trace time (:mod:`odegrad._kinks`). Across a kink the Jacobian of ``f``
    jumps; a gradient that holds the adaptive steps fixed (:class:`Discrete`, and
    :class:`Forward` without error control on its sensitivities) is then off by about the square
    root of the tolerance, however small the state's error. On seed 000 (an ``abs`` model, tol
    1e-10) that was 2e-3 against CVODES for :class:`Discrete` and 1e-6 for the two chosen here.
    Where ``f`` also switches branch in time without events or ``og.Adaptive(jump_ts=)``
    (``where(t < c)``, a table lookup by ``t``), Interpolating's backward solve would step
    across those times unseen (its error norm leaves ``dL/dp`` out), far more than the tolerance
    off: :class:`Discrete` is kept, and the explanation says so.

    It never chooses :class:`Backsolve`, whose gradient can drift. ``og.explain_adjoint`` reports
    the choice with its numbers.

    Stiff problems: with an implicit solver (``og.ImplicitEuler``, ``og.Kvaerno3``,
    ``og.Kvaerno5``, ``og.Rodas5P``) the same rules pick :class:`Forward` or :class:`Discrete`,
    which differentiate the implicit steps themselves (one linear solve per stage and direction,
    or one transposed solve per stage in reverse), so the gradient is as stable as the forward
    solve. Auto never integrates an adjoint ODE there: backwards in time it would need the
    implicit solver again and, for Backsolve, a re-integration of the stiff state that is
    unstable.

    Example:
        >>> og.solve(f, y0, (0.0, 1.0), args, adjoint=og.Auto())
    """

    memory_budget: int | None = None
    forward_max_inputs: int | None = None
    kink_rtol: float = 1e-3

    def choose(self, problem: Problem, traced_only: bool = False) -> tuple[AbstractAdjoint, str]:
        """The method and the paragraph that explains it. ``traced_only`` counts only inputs
        that are traced (concrete arrays, e.g. a ``y0`` closed over, carry no derivative)."""

        def size(tree):
            leaves = jax.tree.leaves(tree)
            if traced_only:
                leaves = [x for x in leaves if isinstance(x, jax.core.Tracer)]
            return sum(int(x.size) for x in leaves)

        n_state, n_params = size(problem.y0), size(problem.args_diff)
        n_in = n_state + n_params
        steps = problem.static_steps
        size = f"{n_state} state entries and {n_params} differentiable parameters"
        if jax.numpy.iscomplexobj(jax.tree.leaves(problem.y0)[0]):
            chosen = Discrete(None, self.memory_budget)
            return chosen, (
                f"Auto chose Discrete(checkpoints={chosen.policy(problem).checkpoints!r}) for "
                f"{size}: the state is complex, and only the discrete adjoint differentiates a "
                "complex state (through JAX's own VJP of each step, which needs no "
                f"holomorphic f); {chosen.policy(problem).text}."
            )
        if problem.plan.dense:
            chosen = Discrete(None, self.memory_budget)
            policy = chosen.policy(problem)
            text = (
                f"Auto chose Discrete(checkpoints={policy.checkpoints!r}) for {size}: "
                "SaveAt(dense=True), and only the discrete adjoint differentiates the dense "
                f"output (sol.evaluate); {policy.text}."
            )
            if problem.kinks:
                text += (
                    f" Note: {jacobian_jumps(problem.kinks, problem.events)}: across a kink "
                    "this gradient may be off from the ODE's by about sqrt(tol); without dense "
                    "output Auto would choose an error-controlled method."
                )
            return chosen, text
        stiff = ""
        if getattr(problem.solver, "implicit", False):
            stiff = (
                f" The solver {problem.solver!r} is implicit (stiff problem): this method "
                "differentiates its implicit steps directly (implicit function theorem, one "
                "linear solve per stage), stable wherever the forward solve is; a continuous "
                "adjoint such as Backsolve would be unstable here and is never chosen."
            )
        forward_max = (
            tuning().forward_max_inputs
            if self.forward_max_inputs is None
            else self.forward_max_inputs
        )
        kinks = problem.kinks
        kinked = jacobian_jumps(kinks, problem.events) if kinks else ""
        if steps is None and n_in <= forward_max:
            forward = Forward()
            controlled, how = forward.controls(problem)
            if not kinks or controlled:
                text = (
                    f"Auto chose Forward(): {size} make {n_in} sensitivity directions "
                    f"(<= {forward_max}), and the step count is adaptive, so carrying "
                    "the sensitivities through the one forward solve is cheaper than any "
                    f"backward solve; {how}."
                ) + stiff
                return forward, text
        rtol = getattr(problem.control, "rtol", None)
        rtol = None if rtol is None else tightest_tolerance(rtol)
        loose = rtol is not None and _is_concrete(rtol) and float(rtol) >= self.kink_rtol
        adaptive = steps is None and not isinstance(problem.control, RuntimeGrid)
        unseen = unseen_time_switches(problem) if adaptive and kinks and not loose else []
        if adaptive and kinks and not loose and not unseen:
            chosen = Interpolating(memory_budget=self.memory_budget)
            policy = chosen.policy(problem)
            text = (
                f"Auto chose Interpolating(checkpoints={policy.checkpoints!r}) for {size}: "
                f"{kinked}, and across a kink a gradient that holds the adaptive steps fixed "
                "(Discrete) is off by about sqrt(tol); Interpolating solves the adjoint ODE "
                "backwards under its own error control, on the forward solve's dense output; "
                f"{policy.text}."
            )
            if getattr(problem.solver, "implicit", False):
                text += (
                    f" The solver {problem.solver!r} is implicit: the adjoint ODE is solved "
                    f"with {problem.solver.adjoint_solver()!r}."
                )
            return chosen, text
        chosen = Discrete(None, self.memory_budget)
        policy = chosen.policy(problem)
        count = (
            "an adaptive step count"
            if adaptive
            else "a fixed grid whose step count is known at run time"
        )
        where = (
            f"{steps} steps known at trace time"
            if steps is not None
            else f"{count} (at most max_steps={problem.max_steps}) and {n_in} > {forward_max} "
            "inputs, too many for forward sensitivities"
        )
        text = (
            f"Auto chose Discrete(checkpoints={policy.checkpoints!r}) for {size} and {where}: "
            f"the exact gradient of the discretised solve (step sizes held fixed); {policy.text}."
        ) + stiff
        if unseen:
            text += (
                f" Note: {kinked}, where Interpolating would be chosen, but f also switches "
                f"branch in time at {', '.join(unseen)}, which its backward solve would step "
                "across unseen (its error control leaves dL/dp out: far more than the "
                "tolerance off); pass events=og.switching_events(f, t0, y0, args) or "
                "step=og.Adaptive(jump_ts=...) and Interpolating is chosen."
            )
        elif kinks and loose and adaptive:
            text += (
                f" Note: {kinked}; at rtol={float(rtol):g} (>= kink_rtol={self.kink_rtol:g}) "
                "the error this adds across kinks (about sqrt(tol)) is within a small factor "
                "of the solve's own, so the cheaper discrete adjoint stays; a tighter rtol "
                "switches to Interpolating."
            )
        elif kinks:  # a fixed grid: the steps are the user's, and so is the discretisation
            text += (
                f" Note: {kinked}; with steps fixed in advance this is the exact gradient of "
                "the computed solution, which differs from the ODE's gradient by O(dt) on "
                "the steps that cross a kink. An adaptive step (og.Adaptive) puts that error "
                "under control."
            )
        return chosen, text

    def run(self, problem: Problem) -> LoopOutput:
        chosen = self.choose(problem, traced_only=True)[0]
        token = CHOSEN_BY_AUTO.set(True)
        try:
            return chosen.run(problem)
        finally:
            CHOSEN_BY_AUTO.reset(token)

    def describe(self, problem: Problem) -> str:
        return self.choose(problem)[1]
