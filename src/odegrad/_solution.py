"""The result of a solve: saved values, dense output, statistics and a status code."""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.numpy as jnp


class Result(enum.IntEnum):
    """Why a solve stopped. ``sol.result`` holds one of these as an integer array."""

    success = 0
    max_steps_reached = 1
    step_size_underflow = 2
    nonfinite = 3

    @property
    def message(self) -> str:
        return _MESSAGES[self]


_MESSAGES = {
    Result.success: "success",
    Result.max_steps_reached: (
        "max_steps was reached before t1; raise max_steps=..., loosen the tolerances, or use a "
        "stiff solver if the problem is stiff"
    ),
    Result.step_size_underflow: (
        "the step size fell below the floor (the problem may be stiff or singular here); try a "
        "stiff solver or check f for a blow-up"
    ),
    Result.nonfinite: (
        "the state became non-finite (inf/nan); check f and the initial state, or take smaller "
        "steps"
    ),
}


@jax.tree_util.register_pytree_node_class
class Solution:
    """What ``og.solve`` returns.

    Attributes:
        ts: saved times (leading axis = save index).
        ys: saved values, a pytree like ``y0`` (or like ``SaveAt.fn``'s output) with a leading
            save axis.
        stats: ``{"steps", "accepted", "rejected", "rhs_evals"}`` as integer arrays.
        result: an integer array holding a :class:`Result`.
    """

    def __init__(self, ts, ys, stats, result, dense=None, solver=None, direction=1.0):
        self.ts = ts
        self.ys = ys
        self.stats = stats
        self.result = result
        self._dense = dense  # (step start times, step sizes, per-step dense data, n_steps)
        self._solver = solver
        self._direction = direction

    def tree_flatten(self):
        return (self.ts, self.ys, self.stats, self.result, self._dense, self._direction), (
            self._solver,
        )

    @classmethod
    def tree_unflatten(cls, aux, children):
        ts, ys, stats, result, dense, direction = children
        return cls(ts, ys, stats, result, dense, aux[0], direction)

    def evaluate(self, t) -> Any:
        """The solution at time(s) ``t`` from the dense output (needs ``SaveAt(dense=True)``).

        Example:
            >>> sol = og.solve(f, y0, (0.0, 1.0), saveat=og.SaveAt(dense=True))
            >>> sol.evaluate(jnp.linspace(0.0, 1.0, 50))
        """
        if self._dense is None:
            raise ValueError(
                "sol.evaluate(t) needs dense output: pass saveat=og.SaveAt(dense=True, ...)."
            )
        t = jnp.asarray(t)
        if t.ndim > 0:
            return jax.vmap(self.evaluate)(t)
        from ._loop import dense_evaluate

        return dense_evaluate(self._solver, self._dense, self._direction * t)

    def __repr__(self) -> str:
        shapes = jax.tree.map(lambda x: getattr(x, "shape", x), self.ys)
        return f"Solution(ts={getattr(self.ts, 'shape', None)}, ys={shapes}, result={self.result})"


def result_message(code: int, t, step) -> str:
    return f"og.solve failed at t={float(t):.6g} (step {int(step)}): {Result(int(code)).message}."


def check_result(result, locate):
    """Raise (eagerly, or through a host callback under jit) when ``result`` is not success;
    ``locate()`` gives the failure's ``(t, step)`` (traced only into the failure branch)."""

    def _raise(code, t_, step_):
        import numpy as np

        code_arr, t_arr, s_arr = np.asarray(code), np.asarray(t_), np.asarray(step_)
        bad = np.flatnonzero(code_arr.reshape(-1) != 0)
        if bad.size:
            i = bad[0]
            raise RuntimeError(
                result_message(code_arr.reshape(-1)[i], t_arr.reshape(-1)[i], s_arr.reshape(-1)[i])
                + " Pass throw=False to get sol.result instead of an error."
            )

    if isinstance(result, jax.core.Tracer):
        # only a failed solve pays for the trip to the host (under vmap both branches run)
        def fail(r):
            jax.debug.callback(_raise, r, *locate())

        jax.lax.cond(jnp.any(result != 0), fail, lambda r: None, result)
    else:
        _raise(result, *locate())
