"""The result of a solve: saved values, dense output, statistics and a status code."""

from __future__ import annotations

import enum
import logging
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._batching import any_member, max_member
from ._tree import hoist_closure


class Result(enum.IntEnum):
    """Why a solve stopped. ``sol.result`` holds one of these as an integer array.

    * ``success``: reached ``t1``.
    * ``max_steps_reached``: ran out of steps before ``t1``.
    * ``step_size_underflow``: an adaptive step shrank below the floor.
    * ``nonfinite``: the state became inf or nan.
    * ``nonfinite_y0``: the initial state ``y0`` holds inf or nan (the solve failed at ``t0``).
    * ``nonfinite_f0``: ``y0`` is finite but ``f(t0, y0, args)`` is not (the solve failed at
      ``t0``): a non-finite ``args`` leaf, or ``f`` itself at ``t0``.
    * ``max_events_reached``: more events than ``max_events``.
    * ``invalid_save_times``: traced ``SaveAt(ts)`` out of order or outside ``t_span`` (concrete
      ones raise when the solve is traced).
    * ``invalid_t_span``: a traced ``t_span`` holds inf or nan (a concrete one raises).
    * ``invalid_step_times``: a traced ``StepTo(ts)`` (or ``t_span``) whose ``ts`` do not run
      strictly from ``t0`` to ``t1`` (concrete ones raise).

    With ``throw=True`` the error names the leaf at fault (``y0['x']``, ``args['k']``).
    """

    success = 0
    max_steps_reached = 1
    step_size_underflow = 2
    nonfinite = 3
    nonfinite_y0 = 4
    nonfinite_f0 = 5
    max_events_reached = 6
    invalid_save_times = 7
    invalid_t_span = 8
    invalid_step_times = 9

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
    Result.nonfinite_y0: "the initial state y0 is not finite (inf/nan); check the inputs",
    Result.nonfinite_f0: (
        "the initial derivative f(t0, y0, args) is not finite (inf/nan) while y0 is; check args "
        "and the right-hand side f at t0"
    ),
    Result.max_events_reached: (
        "more events happened than max_events allows (the solve stopped at the first one that "
        "did not fit); pass a larger max_events, unless the events repeat at one time: a "
        "solution that slides along a switching surface (f pushing into it from both sides, "
        "Filippov; a sign(v) friction at rest) makes og.switching_events' events fire after "
        "every step, which no max_events ends; smooth that switch (a steep tanh) instead"
    ),
    Result.invalid_save_times: (
        "SaveAt(ts) must be sorted in the direction of integration (ascending for t1 > t0, "
        "descending for t1 < t0) and lie inside t_span; checked when the solve ran, as ts "
        "(or t_span) was traced"
    ),
    Result.invalid_t_span: (
        "t_span holds inf or nan (t0 and t1 must be finite); checked when the solve ran, as "
        "t_span was traced"
    ),
    Result.invalid_step_times: (
        "StepTo(ts) must run strictly monotonically from ts[0] == t0 to ts[-1] == t1; checked "
        "when the solve ran, as ts (or t_span) was traced"
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
            ``rhs_evals`` counts the evaluations of ``f`` made, the stabilised methods'
            power-iteration JVPs included; the implicit and Rosenbrock methods' Jacobians
            (``jax.jacfwd``, and a Rosenbrock step's ``df/dt``) are not counted.
        result: an integer array holding a :class:`Result`.
        events: the :class:`~odegrad._events.EventLog` (``ts``, ``which``, ``ys``, ``count``)
            of a solve with ``events=``, else None.
    """

    def __init__(self, ts, ys, stats, result, dense=None, solver=None, direction=1.0, events=None):
        self.ts = ts
        self.ys = ys
        self.stats = stats
        self.result = result
        self.events = events
        self._dense = dense  # (step starts, step sizes, per-step dense data, n_steps, y0)
        self._solver = solver
        self._direction = direction

    def tree_flatten(self):
        children = (self.ts, self.ys, self.stats, self.result, self._dense, self._direction)
        return (*children, self.events), (self._solver,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        ts, ys, stats, result, dense, direction, events = children
        return cls(ts, ys, stats, result, dense, aux[0], direction, events)

    def evaluate(self, t) -> Any:
        """The solution at time(s) ``t`` from the dense output (needs ``SaveAt(dense=True)``):
        ``nan`` outside the span the solve covered (``t_span``, or up to a terminal event).

        Example:
            >>> sol = og.solve(f, y0, (0.0, 1.0), saveat=og.SaveAt(dense=True))
            >>> sol.evaluate(jnp.linspace(0.0, 1.0, 50))
        """
        if self._dense is None:
            raise ValueError(
                "sol.evaluate(t) needs dense output: pass saveat=og.SaveAt(dense=True, ...)."
            )
        if jnp.ndim(self._dense[0]) > 1:
            raise ValueError(
                "sol.evaluate(t): this Solution holds a batch of solves (it came out of "
                "jax.vmap); evaluate each member: jax.vmap(lambda s: s.evaluate(t))(sol)."
            )
        t = jnp.asarray(t)
        if t.ndim > 0:
            return jax.vmap(self.evaluate)(t)
        from ._loop import dense_evaluate

        tau = self._direction * t
        value = dense_evaluate(self._solver, self._dense, tau)
        starts, sizes, _, n, y_start = self._dense
        # a span traced to t1 == t0 takes no step: the solution there is y0
        value = jax.tree.map(lambda v, y: jnp.where(n == 0, y, v), value, y_start)
        # (past the ends the interpolant extrapolates: 0.266 for exp(-1.5) = 0.223)
        # (a while loop's rows hold the end after the last step; a scan's hold n steps' starts)
        rows = starts.shape[0]
        last = jnp.maximum(n - 1, 0)
        hi = jnp.where(n < rows, starts[jnp.minimum(n, rows - 1)], starts[last] + sizes[last])
        slack = 8 * jnp.finfo(starts.dtype).eps * (jnp.abs(starts[0]) + jnp.abs(hi))
        inside = (tau >= starts[0] - slack) & (tau <= hi + slack)
        return jax.tree.map(lambda v: jnp.where(inside, v, jnp.nan), value)

    def __repr__(self) -> str:
        shapes = jax.tree.map(lambda x: getattr(x, "shape", x), self.ys)
        return f"Solution(ts={getattr(self.ts, 'shape', None)}, ys={shapes}, result={self.result})"


class SolveFailure(RuntimeError):
    """A failed solve or backward solve with ``throw=True`` (internal: catch ``RuntimeError``.
    Eager calls raise it as is; under ``jax.jit`` JAX wraps it in a ``JaxRuntimeError``, also a
    ``RuntimeError``, whose text ends with ours)."""


class _QuietSolveFailures(logging.Filter):
    """JAX logs each exception a callback raises, traceback and all, before raising it again
    wrapped: every failed solve under ``jax.jit`` printed its error twice. Only ours are hidden."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], SolveFailure))


logging.getLogger("jax._src.callback").addFilter(_QuietSolveFailures())


def result_message(code: int, t, step, member: str = "", body: str | None = None) -> str:
    """The error text for a failed solve; ``body`` (say, naming the leaf at fault) replaces the
    code's own message."""
    body = Result(int(code)).message if body is None else body
    where = ", ".join(x for x in (f"step {int(step)}" if step >= 0 else "", member) if x)
    return f"og.solve failed at t={float(t):.6g}{f' ({where})' if where else ''}: {body}."


def _raise_first_failure(code, t, step, info=None, describe=None, block=None):
    """Raise for the first member whose ``code`` is not success (host side, NumPy arrays).

    ``describe(code, info)`` gets that member's slice of ``info`` (a pytree of arrays whose
    leading axes, if any, are the batch's) and may return the message's body, or None for the
    code's own message. ``block``: ``(index, count, size)`` of this device's block of a batch
    split over ``count`` devices in blocks of ``size`` along its first axis
    (:func:`~odegrad.ensemble`), whose members are named by their place in the whole batch."""
    code = np.asarray(code)
    t, step = (np.broadcast_to(np.asarray(x), np.shape(code)) for x in (t, step))
    bad = np.flatnonzero(code.reshape(-1) != 0)
    if not bad.size:
        return
    i = bad[0]
    member = ""
    if code.ndim:
        where, shape = list(np.unravel_index(i, code.shape)), code.shape
        if block is not None and shape[0] == block[2]:  # (else batched by an inner vmap alone)
            where[0] += int(np.asarray(block[0]).reshape(-1)[0]) * shape[0]  # (axes of 1 added)
            shape = (shape[0] * block[1], *shape[1:])
        which = int(where[0]) if len(where) == 1 else tuple(map(int, where))
        member = f"batch member {which} of a batch of {shape}"
        if bad.size > 1:
            member += f"; {bad.size} members failed"
    body = None
    if describe is not None:

        def of_member(x):
            x = np.asarray(x)
            x = np.broadcast_to(x, code.shape + x.shape[code.ndim :])
            return x.reshape((code.size, *x.shape[code.ndim :]))[i]

        body = describe(int(code.reshape(-1)[i]), jax.tree.map(of_member, info))
    raise SolveFailure(
        result_message(code.reshape(-1)[i], t.reshape(-1)[i], step.reshape(-1)[i], member, body)
        + " Pass throw=False to get sol.result instead of an error."
    )


def host_check(host, outputs, failed, *operands, prepare=None):
    """``outputs`` unchanged; when ``failed`` (an unbatched bool) ``host(*prepare(*operands))``
    runs first on the host (NumPy arrays, the batch's axes leading), to raise or warn.
    ``prepare`` (default: the identity) is traced into the failure branch alone: device work
    that only a failure needs.

    The branch gives a token (an int32 zero) that every output leaf is made to depend on
    (:func:`_tie`): the check cannot be dead-code eliminated while any output is used, and the
    outputs do not pass through the conditional (a ``lax.cond`` over a solve's outputs cost
    XLA:CPU 0.09-0.15 s of compile time on seed 004's wave). ``jax.pure_callback`` rather than
    ``jax.debug.callback``: a program with an effect leaves JAX's C++ dispatch path (measured:
    a tiny jitted function 5.5 -> 63 us per call), while a pure callback in an untaken branch
    costs nothing.

    Example:
        >>> y = host_check(lambda d: warnings.warn(f"drift {d}"), y, any_member(d > 1), d)
    """
    return _host_check(host, prepare, outputs, failed, *operands)


@partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _failure_token(host, prepare, failed, *operands):
    def fail(operands_):
        prepared = operands_ if prepare is None else prepare(*operands_)

        def run(probe, *prepared_):
            host(*prepared_)
            # under vmap the token has the batch's axes, which the probe (a scalar, with
            # axes of size 1 added by "expand_dims") counts
            batch = np.broadcast_shapes(
                *(np.shape(x)[: np.ndim(probe)] for x in (probe, *jax.tree.leaves(prepared_)))
            )
            return np.zeros(batch, np.int32)

        def callback(*prepared_):
            probe = jnp.zeros((), jnp.int32)
            token = jax.ShapeDtypeStruct((), jnp.int32)
            return jax.pure_callback(run, token, probe, *prepared_, vmap_method="expand_dims")

        from ._scaleout import failure_mesh

        mesh = failure_mesh()
        if mesh is None:
            return callback(*prepared)
        # On a mesh a callback runs on device 0 alone, and an error it raises stops device 0
        # while the others wait for its token in a collective: XLA aborts the process after
        # 40 s. Inside a shard_map over every axis it runs on each device (given what the
        # others are given: the operands summarised, see _initial._summarised), and each
        # raises.
        every = jax.sharding.PartitionSpec()
        return jax.shard_map(callback, mesh=mesh, in_specs=every, out_specs=every, check_vma=False)(
            *prepared
        )

    return jax.lax.cond(failed, fail, lambda _: jnp.zeros((), jnp.int32), operands)


@_failure_token.defjvp
def _failure_token_jvp(host, prepare, primals, tangents):
    # an integer: nothing to differentiate (a pure callback has no derivative rule of its own,
    # and forward-over-reverse meets this one with tangents)
    token = _failure_token(host, prepare, *primals)
    return token, np.zeros(token.shape, jax.dtypes.float0)


def _tie(outputs, token):
    """``outputs``, each leaf made to depend on ``token`` (always 0) through its first entry,
    which is kept: ``select(token == 0, entry, 0)`` written back in place. XLA removes an
    optimization barrier before its last dead-code pass, and with it a check that no output
    reads. The token is reduced over the batch (:func:`max_member`), so that an unbatched
    output stays unbatched under ``vmap``."""
    ok = max_member(token) == 0

    def tie(x):
        x = jnp.asarray(x)
        if x.size == 0:
            return x
        first = lax.slice(x, (0,) * x.ndim, (1,) * x.ndim)
        kept = jnp.where(ok, first, jnp.zeros_like(first))
        return lax.dynamic_update_slice(x, kept, (0,) * x.ndim) if x.ndim else kept

    return jax.tree.map(tie, outputs)


@partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _host_check(host, prepare, outputs, failed, *operands):
    return _tie(outputs, _failure_token(host, prepare, failed, *operands))


@_host_check.defjvp
def _host_check_jvp(host, prepare, primals, tangents):
    # Under jax.grad the primal outputs are dead code, and their tie with them. The tangents
    # are scaled by a 1 tied to the same token: the reverse pass needs it, so the forward pass
    # runs the check (one multiply per output entry).
    outputs, failed, *operands = primals
    token = _failure_token(host, prepare, failed, *operands)
    one = _tie(jnp.ones((), jnp.float32), token)

    def scale(dx):
        if dx.dtype == jax.dtypes.float0:
            return dx
        return dx * one.astype(dx.dtype)

    return _tie(outputs, token), jax.tree.map(scale, tangents[0])


def _primal_array(x) -> np.ndarray:
    """``x`` as a NumPy array, through the derivative tracers of an eager ``jax.jacfwd`` or
    ``jax.grad`` (whose ``result`` is concrete while the values it locates are not)."""
    while isinstance(x, jax.core.Tracer) and hasattr(x, "primal"):
        x = x.primal
    return np.asarray(x)


def check_result(outputs, result, gather, locate, describe=None):
    """``outputs`` (any pytree of arrays), raising when ``result`` is not success.

    ``gather()``, traced only into the failure branch, gives what the host needs to word the
    error: ``locate(*gather())`` (host side, NumPy arrays whose leading axes are the batch's,
    ``result`` having none of its own) returns the failure's ``(t, step, code, info)``: the
    code to report (``result`` made more precise) and a pytree of arrays from which
    ``describe(code, info)`` may word the error for the failing member instead of the code's
    own message. Finding where on the host keeps reductions out of the program.

    Free on a successful solve, also under ``jax.vmap`` (the branch predicate is reduced over
    the batch by :func:`any_member`); a failing member of a batch is named in the error."""

    from ._scaleout import ensemble_block

    block = ensemble_block()

    def raise_first(*gathered):
        if block is not None:
            *gathered, index = gathered
        t, step, code, info = locate(*gathered)
        _raise_first_failure(code, t, step, info, describe, block and (index, *block[1:]))

    if not isinstance(result, jax.core.Tracer):
        if np.any(np.asarray(result) != 0):  # eager: gather() only on failure, as under jit
            raise_first(*jax.tree.map(_primal_array, gather()))
        return outputs
    # what gather() closes over enters as operands (a derivative rule may not close over them)
    if block is not None:  # this device's place in the batch, as the last thing gathered
        gather_here = gather
        gather = lambda: (*gather_here(), block[0])
    gather, consts = hoist_closure(gather)
    failed = any_member(jnp.any(result != 0))
    return host_check(raise_first, outputs, failed, *consts, prepare=gather)
