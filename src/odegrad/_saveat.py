"""What a solve stores: the ends, given times, every step, a function of the state, dense output."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._step import _as_time, _is_concrete


@dataclass(frozen=True)
class SaveAt:
    """Which values ``og.solve`` returns in ``sol.ts`` / ``sol.ys``.

    Rows are stored in the order ``t0``, then ``ts`` (or every step), then ``t1``.

    Args:
        t0: save the initial state.
        t1: save the final state.
        ts: save at these times (sorted in the direction of integration, inside ``t_span``),
            read from the solver's dense interpolant; steps are not shortened to hit them.
        steps: save after every step. Fixed step counts give exactly that many rows; adaptive
            solves give ``max_steps`` rows, those after the last step filled with ``inf``.
        fn: ``fn(t, y, args)`` applied to the state before it is stored (saves memory).
        dense: keep the dense output so that ``sol.evaluate(t)`` works anywhere in ``t_span``.

    Example:
        >>> saveat = og.SaveAt(ts=jnp.linspace(0.0, 1.0, 11), fn=lambda t, y, args: y[0])
    """

    t0: bool = False
    t1: bool = False
    ts: Any = None
    steps: bool = False
    fn: Callable | None = None
    dense: bool = False

    def __post_init__(self):
        if self.ts is not None and self.steps:
            raise ValueError(
                "SaveAt: give either ts=... or steps=True, not both (use dense=True to also "
                "evaluate the solution anywhere)."
            )
        if self.ts is not None:
            shape = getattr(self.ts, "shape", None)
            shape = np.shape(self.ts) if shape is None else shape
            if len(shape) != 1 or shape[0] == 0:
                raise ValueError(
                    f"SaveAt(ts): ts must be 1-d with at least one time, got shape "
                    f"{tuple(shape)}; to save nothing in between, leave ts=None."
                )
        if not (self.t0 or self.t1 or self.ts is not None or self.steps or self.dense):
            raise ValueError(
                "SaveAt() saves nothing: set t0, t1, ts, steps or dense (the default of "
                "og.solve is SaveAt(t1=True))."
            )
        if self.fn is not None and not callable(self.fn):
            raise TypeError(f"SaveAt(fn=...): fn must be callable fn(t, y, args), got {self.fn!r}.")


def check_save_times(ts, t0, t1, s, tdtype):
    """``SaveAt(ts)`` in forward time, raising where concrete times are out of order or outside
    the span (traced ones: :func:`save_times_valid`)."""
    ts = _as_time(ts, tdtype)
    if _is_concrete(ts) and _is_concrete(s):
        tau = float(s) * np.asarray(ts)
        if np.any(np.diff(tau) < 0):
            raise ValueError(
                "SaveAt(ts): ts must be sorted in the direction of integration "
                "(ascending for t1 > t0, descending for t1 < t0)."
            )
        if _is_concrete(t0) and _is_concrete(t1) and tau.size:
            lo, hi = sorted((float(t0), float(t1)))
            bad = np.asarray(ts)[(np.asarray(ts) < lo) | (np.asarray(ts) > hi)]
            if bad.size:
                raise ValueError(
                    f"SaveAt(ts): times {bad[:3].tolist()} lie outside t_span=({float(t0)}, "
                    f"{float(t1)}); save times must be inside the span."
                )
    return s * ts


def save_times_valid(ts_tau, tau0, tau1):
    """Whether save times (forward time), traced, are sorted and inside the span: a scalar
    the solve's result turns into ``Result.invalid_save_times`` (None: checked when traced)."""
    if ts_tau is None or (_is_concrete(ts_tau) and _is_concrete(tau0) and _is_concrete(tau1)):
        return None
    ts_tau = jnp.asarray(ts_tau)
    sorted_ = jnp.all(ts_tau[1:] >= ts_tau[:-1])
    return sorted_ & jnp.all((ts_tau >= tau0) & (ts_tau <= tau1))
