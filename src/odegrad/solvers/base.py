"""The solver interface: a solver knows how to take one step and how to interpolate inside it."""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

from .._step import PI34_GAINS

PyTree = Any


class StepResult(NamedTuple):
    """One step from ``(t0, y0)`` to ``t0 + dt``.

    Attributes:
        y1: the new state.
        error: the local error estimate (same structure as ``y1``), or ``None``.
        dense: whatever :meth:`AbstractSolver.interpolate` needs for this step (includes ``y0``,
            ``y1`` and ``dt`` as the solver sees fit).
        state: the solver's carried state (e.g. the first-same-as-last stage) for the next step,
            before :meth:`AbstractSolver.after_step` revises it: whoever chains steps applies
            that hook (the loops, ``Problem.step``).
        evals: optional integer count of right-hand-side evaluations this step really made, for
            solvers whose count varies at run time (the stabilised methods); ``None`` means
            :attr:`AbstractSolver.step_evals`. The loops sum it into ``stats["rhs_evals"]``.
    """

    y1: PyTree
    error: PyTree | None
    dense: PyTree
    state: PyTree
    evals: Any = None


class AbstractSolver(abc.ABC):
    """A one-step method.

    Subclasses set ``order`` (and ``embedded_order`` when they estimate their local error) and
    implement :meth:`init`, :meth:`step` and :meth:`interpolate`. ``step`` must be a pure function
    of its inputs so that the adjoints can re-run and differentiate it.
    """

    order: int
    embedded_order: int | None = None
    partitioned: bool = False

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "after_rejection" in vars(cls):  # a hook the loops no longer call: fail, not ignore
            raise TypeError(
                f"{cls.__name__} defines after_rejection(f, t, y, args, state, rejected), which "
                "the loops no longer call: define after_step(f, t, y, args, state, accepted, "
                "rejected) instead (the state the next attempt starts from, after a step "
                "that was accepted or rejected)."
            )

    #: floor on the previous error ratio in the step-size controller (see ``og.Adaptive``)
    prev_ratio_floor: float = 1e-2
    #: ``(pcoeff, icoeff)`` of the step-size controller where ``og.Adaptive`` leaves them ``None``
    #: (Gustafsson's PI.3.4; explicit Runge–Kutta uses DOPRI5's, see ``og.Adaptive``)
    pi_gains: tuple[float, float] = PI34_GAINS
    #: right-hand-side evaluations made by :meth:`init` and by each :meth:`step`.
    init_evals: int = 0
    step_evals: int = 1
    #: ``init(f, t, y, args)`` reproduces the carried state at any accepted step (true for the
    #: FSAL stage ``f(t, y)``), so checkpoints may keep ``y`` alone and recompute the state.
    state_from_y: bool = True

    @property
    def step_residuals(self) -> int:
        """States (each ``y`` with the carried solver state) that JAX's reverse mode keeps for
        one step of a grid known at trace time, what ``Discrete`` prices when it considers
        keeping every step: by default one per stage and two more."""
        return self.step_evals + 2

    @abc.abstractmethod
    def init(self, f, t0, y0, args) -> PyTree:
        """The carried state before the first step."""

    @abc.abstractmethod
    def step(self, f, t0, dt, y0, args, state) -> StepResult:
        """Advance one step of size ``dt`` (positive: the loops run in forward time)."""

    @abc.abstractmethod
    def interpolate(self, dense, theta) -> PyTree:
        """The state at ``t0 + theta * dt``, ``0 <= theta <= 1``, from one step's ``dense``."""

    def adjoint_solver(self) -> AbstractSolver:
        """The solver a continuous adjoint integrates backwards with by default: this one."""
        return self

    def with_user_args(self, user_args) -> AbstractSolver:
        """This solver for internal use, where ``f`` receives odegrad's extended ``args``:
        ``user_args(args)`` recovers the user's. Solvers that call user functions taking
        ``args`` (e.g. a spectral-radius bound) wrap them here; ``user_args=None`` means the
        solver integrates some other system (a backward adjoint) and must drop them."""
        return self

    def max_step(self, state):
        """The largest stable step size ``|dt|`` for the next step from the carried ``state``, or
        ``None`` (no limit; the default). The adaptive loop clips its proposed steps to it."""
        return None

    def after_step(self, f, t, y, args, state, accepted, rejected):
        """``(state, evals)``: the carried state the next attempt starts from at ``(t, y)``,
        and the right-hand-side evaluations spent on it, after the members ``accepted`` had
        their step accepted (``(t, y)`` its end, ``state`` the step's own) or ``rejected``
        (``(t, y)`` where the retry starts, ``state`` the one the rejected step started from);
        bools, batched under vmap, both false for a member that did not step. The default keeps
        ``state`` (no evaluations); the stabilised methods refresh their spectral-radius
        estimate here. The loops call it once per attempt, after choosing between the step's
        state and the old one, so a part of the state that :meth:`step` passes through costs
        no select; replays (``Problem.step``) call it after every step they retake and, with
        ``rejected``, before each that followed a rejection. Applied again with ``rejected`` to
        a state it returned that way, it must leave it unchanged: checkpoints keep states
        after it."""
        return state, 0

    @property
    def restart_evals(self) -> int:
        """The right-hand-side evaluations :meth:`restart` makes (the loops' count): by
        default :meth:`init`'s."""
        return self.init_evals

    def restart(self, f, t, y, args, state):
        """The carried state after a jump in ``f`` at ``(t, y)`` (``og.Adaptive(jump_ts=)``),
        from the one the step that ended there left: by default :meth:`init`'s, whose first
        stage (FSAL) is then evaluated on the jump's far side. Replays take the same."""
        return self.init(f, t, y, args)

    def resume_state(self, state):
        """What of a solve's final carried ``state`` is worth handing to a solve that continues
        from its end (:meth:`init_from`'s ``previous``; a continuous adjoint's next backward
        interval): ``None`` (the default) when :meth:`init` is as cheap as any reuse; the
        stabilised methods hand on their spectral-radius estimate."""
        return None

    def init_from(self, f, t0, y0, args, previous):
        """``(state, evals)``: the carried state before the first step of a solve that starts
        where another one ended with ``resume_state(state) == previous``, and the right-hand-side
        evaluations spent on it. ``previous`` may hold nan (nothing known yet); the default
        ignores it and calls :meth:`init`."""
        return self.init(f, t0, y0, args), self.init_evals

    def compact_state(self, state):
        """What the adjoints checkpoint of a carried ``state``: the default keeps it all;
        solvers that carry caches (an implicit solver's Jacobian) drop them here. :meth:`step`
        must accept the compact state and return a compact one (adjoints replay from it)."""
        return state

    @property
    def adaptive(self) -> bool:
        return self.embedded_order is not None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.__dict__.items()))))
