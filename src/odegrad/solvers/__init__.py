"""Solvers: explicit Runge–Kutta tableaus and partitioned methods."""

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

__all__ = [
    "BS3",
    "RK4",
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
