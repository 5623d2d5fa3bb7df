"""Solvers: explicit Runge–Kutta tableaus, partitioned and stabilised explicit methods."""

from . import tableaus
from .base import AbstractSolver, StepResult
from .explicit_rk import (
    BS3,
    RK4,
    Dopri5,
    Dopri8,
    Euler,
    ExplicitRK,
    Heun,
    Midpoint,
    Ralston,
    Tsit5,
)
from .implicit import ImplicitEuler, Kvaerno3, Kvaerno5
from .partitioned import Leapfrog, SemiImplicitEuler
from .rosenbrock import Rodas5, Rodas5P
from .stabilized import RKC, ROCK2, ROCK4

__all__ = [
    "BS3",
    "RK4",
    "RKC",
    "ROCK2",
    "ROCK4",
    "AbstractSolver",
    "Dopri5",
    "Dopri8",
    "Euler",
    "ExplicitRK",
    "Heun",
    "ImplicitEuler",
    "Kvaerno3",
    "Kvaerno5",
    "Leapfrog",
    "Midpoint",
    "Ralston",
    "Rodas5",
    "Rodas5P",
    "SemiImplicitEuler",
    "StepResult",
    "Tsit5",
    "tableaus",
]
