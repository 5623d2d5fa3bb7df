"""Adjoint (reverse-mode) methods for ``og.solve``."""

from .auto import Auto
from .base import AbstractAdjoint, Problem
from .discrete import Discrete

__all__ = ["AbstractAdjoint", "Auto", "Discrete", "Problem"]
