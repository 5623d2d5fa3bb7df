"""``og.Auto``: pick an adjoint method from the problem, and say why."""

from __future__ import annotations

from dataclasses import dataclass

from .._loop import LoopOutput
from .base import AbstractAdjoint, Problem
from .discrete import DEFAULT_MEMORY_BUDGET, Discrete


@dataclass(frozen=True)
class Auto(AbstractAdjoint):
    """Choose the adjoint from the problem's size, step count, memory budget and solver.

    Current rule: the exact discrete adjoint, :class:`Discrete` with ``checkpoints=None``, which
    keeps every step while that fits in ``memory_budget`` and otherwise recomputes under a
    binomial schedule. It never chooses a method whose gradient can silently drift (Backsolve).
    ``og.explain_adjoint`` reports the choice with its numbers.

    Example:
        >>> og.solve(f, y0, (0.0, 1.0), args, adjoint=og.Auto())
    """

    memory_budget: int = DEFAULT_MEMORY_BUDGET

    def choose(self, problem: Problem) -> tuple[AbstractAdjoint, str]:
        chosen = Discrete(None, self.memory_budget)
        resolved = chosen.resolve(problem)
        per_state = problem.state_bytes()
        n = problem.static_steps
        steps = (
            f"{n} steps (known at trace time)"
            if n is not None
            else (f"an adaptive step count (at most max_steps={problem.max_steps})")
        )
        if resolved == "all":
            why = (
                f"keeping every step costs at most "
                f"{_mib(per_state * (n if n is not None else problem.max_steps))} of states, "
                f"within the {_mib(self.memory_budget)} budget, so nothing is recomputed"
            )
        else:
            why = (
                f"keeping every step would exceed the {_mib(self.memory_budget)} budget, so "
                f"{resolved} checkpoints of {_mib(per_state)} each are kept and the rest "
                "recomputed on a binomial (revolve) schedule"
            )
        text = (
            f"Auto chose Discrete(checkpoints={resolved!r}) for a state of "
            f"{per_state} bytes (with the solver's carried stage) and {steps}: the exact "
            f"gradient of the discretised solve; {why}."
        )
        return chosen, text

    def run(self, problem: Problem) -> LoopOutput:
        return self.choose(problem)[0].run(problem)

    def describe(self, problem: Problem) -> str:
        return self.choose(problem)[1]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3g} MiB"
