"""Adjoint (reverse-mode) methods for ``og.solve``."""

from .auto import Auto
from .base import AbstractAdjoint, Problem
from .continuous import Backsolve, Interpolating, Quadrature
from .discrete import Discrete
from .forward import Forward

__all__ = [
    "AbstractAdjoint",
    "Auto",
    "Backsolve",
    "Discrete",
    "Forward",
    "Interpolating",
    "Problem",
    "Quadrature",
]
