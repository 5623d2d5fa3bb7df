"""odegrad: gradients of differential-equation solutions in JAX."""

from . import solvers, stencil
from ._events import Event, EventLog
from ._saveat import SaveAt
from ._scaleout import ensemble
from ._solution import Result, Solution
from ._solve import explain_adjoint, solve
from ._step import Adaptive, Fixed, StepTo
from ._switches import switching_events
from .adjoint import (
    AbstractAdjoint,
    Auto,
    Backsolve,
    Discrete,
    Forward,
    Interpolating,
    Quadrature,
)
from .solvers import (
    BS3,
    RK4,
    RKC,
    ROCK2,
    ROCK4,
    AbstractSolver,
    Dopri5,
    Dopri8,
    Euler,
    ExplicitRK,
    Heun,
    ImplicitEuler,
    Kvaerno3,
    Kvaerno5,
    Leapfrog,
    Midpoint,
    Ralston,
    Rodas5,
    Rodas5P,
    SemiImplicitEuler,
    Tsit5,
)

__version__ = "0.1.0"

__all__ = [
    "BS3",
    "RK4",
    "RKC",
    "ROCK2",
    "ROCK4",
    "AbstractAdjoint",
    "AbstractSolver",
    "Adaptive",
    "Auto",
    "Backsolve",
    "Discrete",
    "Dopri5",
    "Dopri8",
    "Euler",
    "Event",
    "EventLog",
    "ExplicitRK",
    "Fixed",
    "Forward",
    "Heun",
    "ImplicitEuler",
    "Interpolating",
    "Kvaerno3",
    "Kvaerno5",
    "Leapfrog",
    "Midpoint",
    "Quadrature",
    "Ralston",
    "Result",
    "Rodas5",
    "Rodas5P",
    "SaveAt",
    "SemiImplicitEuler",
    "Solution",
    "StepTo",
    "Tsit5",
    "ensemble",
    "explain_adjoint",
    "solve",
    "solvers",
    "stencil",
    "switching_events",
]
