"""``og.Auto``: pick an adjoint method from the problem, and say why."""

from __future__ import annotations

from dataclasses import dataclass

import jax

from .._loop import LoopOutput
from .._tuning import tuning
from .base import AbstractAdjoint, Problem
from .discrete import Discrete
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
       the one forward solve and no backward solve is needed.
    3. Otherwise :class:`Discrete` (exact gradient of the adaptive solve, memory bounded by the
       budget through binomial checkpointing).

    It never chooses :class:`Backsolve`, whose gradient can drift. ``og.explain_adjoint`` reports
    the choice with its numbers.

    Stiff problems: with an implicit solver (``og.ImplicitEuler``, ``og.Kvaerno3``,
    ``og.Kvaerno5``, ``og.Rodas5``) the same rules pick :class:`Forward` or :class:`Discrete`,
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
        if steps is None and n_in <= forward_max:
            text = (
                f"Auto chose Forward(): {size} make {n_in} sensitivity directions "
                f"(<= {forward_max}), and the step count is adaptive, so carrying "
                "the sensitivities through the one forward solve is cheaper than any backward "
                "solve."
            ) + stiff
            return Forward(), text
        chosen = Discrete(None, self.memory_budget)
        policy = chosen.policy(problem)
        where = (
            f"{steps} steps known at trace time"
            if steps is not None
            else f"an adaptive step count (at most max_steps={problem.max_steps}) and "
            f"{n_in} > {forward_max} inputs, too many for forward sensitivities"
        )
        text = (
            f"Auto chose Discrete(checkpoints={policy.checkpoints!r}) for {size} and {where}: "
            f"the exact gradient of the discretised solve; {policy.text}."
        ) + stiff
        return chosen, text

    def run(self, problem: Problem) -> LoopOutput:
        return self.choose(problem, traced_only=True)[0].run(problem)

    def describe(self, problem: Problem) -> str:
        return self.choose(problem)[1]
