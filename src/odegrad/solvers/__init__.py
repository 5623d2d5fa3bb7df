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
from .partitioned import Leapfrog, SemiImplicitEuler
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
    "Leapfrog",
    "Midpoint",
    "Ralston",
    "SemiImplicitEuler",
    "StepResult",
    "Tsit5",
    "tableaus",
]
