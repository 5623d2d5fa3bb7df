"""What every adjoint method sees: the problem, normalised to forward time and explicit args."""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from .._batching import member_cond
from .._kinks import Kink, find_kinks
from .._loop import LoopOutput, scan_loop, while_loop
from .._recorders import Recorder
from .._saving import SavePlan
from .._step import between_jumps, jump_times, landed_on_jump
from .._tracers import forward_mode
from .._tree import lift_tracers, tree_size
from .._tuning import tuning

PyTree = Any


@dataclass
class Problem:
    """A solve, normalised by ``og.solve``.

    Times are in forward time ``tau = direction * t`` (``tau1 > tau0``); ``f(t, y, args)`` takes
    real time and ``plan.fn`` takes ``tau``. Neither closes over anything that needs a gradient:
    closed-over arrays were moved into ``args``, and ``with_args(diff)`` rebuilds ``args`` from
    its differentiable leaves and ``args_static`` (the integer and boolean ones).
    """

    solver: Any
    f: Any
    direction: Any
    y0: PyTree
    args: PyTree
    args_diff: list
    combine: Any  # combine(args_diff, args_static) -> args
    tau0: Any
    tau1: Any
    grid: Any  # a static-length step grid, or None for while-loop stepping
    control: Any  # Adaptive or RuntimeGrid when grid is None
    plan: SavePlan
    max_steps: int
    progress: Any = None  # a pair of progress bars (forward, backward), or None
    #: members of the ``jax.vmap`` batch this solve is traced in (memory budgets are for all)
    batch: int = 1
    #: ``user_args(args)``: the user's own ``args`` (non-array leaves included) from ours
    user_args: Any = None
    #: ``user_arrays(like)``: the array leaves of a pytree shaped like the user's ``args``
    user_arrays: Any = None
    #: the solve's events (:class:`~odegrad._events.EventSet`), or None
    events: Any = None
    #: ``og.solve(throw=...)``: a failed backward solve raises, not only returns nan
    throw: bool = True
    #: the leaves of ``args`` that are not differentiable (integer and boolean arrays)
    args_static: list = dataclasses.field(default_factory=list)
    #: ``plan.fn`` in real time, ``fn(t, y, args)``: rebuilt with a traced ``direction``
    save_fn: Any = None

    @property
    def static_steps(self) -> int | None:
        return None if self.grid is None else self.grid.shape[0] - 1

    @property
    def always_moves(self) -> bool:
        """Whether the solve takes at least one step: a concrete span does unless t1 == t0;
        one traced under ``jax.jit`` may be empty, and its saves at t0 are then
        ``fn(t0, y0)`` written by no step (``_loop._saves_at_start``)."""
        if any(isinstance(t, jax.core.Tracer) for t in (self.tau0, self.tau1)):
            return False
        return bool(np.asarray(self.tau1) != np.asarray(self.tau0))  # (numpy: jit traces jnp)

    @property
    def runs_on(self) -> bool:
        """Whether the forward loop runs on to the end past a non-finite value (a static grid's
        scan, or a while loop that does not test each step: ``_loop.checks_each_step``)."""
        from .._loop import checks_each_step

        return self.grid is not None or not checks_each_step(self.control, self.events)

    def with_args(self, args_diff) -> PyTree:
        return self.combine(args_diff, self.args_static)

    def traced_constants(self) -> tuple[list, Any]:
        """``(consts, with_consts)``: the problem's traced values other than ``y0`` and
        ``args_diff`` (times, the step grid, ``args_static``, tolerances), and
        ``with_consts(values)``, this problem with ``values`` in their place.

        The adjoints' custom VJPs take them as arguments (:func:`custom_vjp_solve`): closed
        over, they would be one trace's tracers used in another, as when ``jax.grad`` of a
        ``jax.jit``-ed loss traces the backward rule after the jit trace ended ("No constant
        handler"). Concrete values stay in place."""
        fields = (
            self.direction, self.tau0, self.tau1, self.grid, self.control, self.plan.ts,
            self.args_static, self.solver,
        )  # fmt: skip
        consts, rebuild = lift_tracers(fields)
        if not consts:
            return [], lambda values: self

        def with_consts(values):
            s, tau0, tau1, grid, control, ts, static, solver = rebuild(values)
            plan = dataclasses.replace(self.plan, ts=ts)
            if self.save_fn is not None:
                save_fn = self.save_fn
                plan = dataclasses.replace(plan, fn=lambda tau, y, a: save_fn(s * tau, y, a))
            return dataclasses.replace(
                self, direction=s, tau0=tau0, tau1=tau1, grid=grid, control=control,
                plan=plan, args_static=static, solver=solver,
            )  # fmt: skip

        return consts, with_consts

    @functools.cached_property
    def kinks(self) -> tuple[Kink, ...]:
        """Where ``f``'s Jacobian in the state or the differentiable parameters jumps
        (:func:`~odegrad._kinks.find_kinks`; read from the jaxpr, nothing runs)."""
        if self.solver.partitioned:  # f is a pair; its kinks are not looked for
            return ()
        f = lambda t, y, a: self.f(t, y, self.with_args(a))
        if self.events is not None and self.events.hold is not None:
            f = self.events.hold.between_events(f)  # held switches: smooth inside each step
        return find_kinks(
            f,
            self.direction * self.tau0,
            self.y0,
            self.args_diff,
        )

    def forward(self, y0=None, args=None, record: tuple[Recorder, ...] = ()) -> LoopOutput:
        """The forward solve; ``record``: what a reverse pass asks the while loop to keep."""
        y0 = self.y0 if y0 is None else y0
        args = self.args if args is None else args
        if self.grid is not None:
            return scan_loop(
                self.solver,
                self.f,
                args,
                # (a concrete grid stays one: the saves' slots are counted from it in numpy)
                held_constant(self.grid) if isinstance(self.grid, jax.core.Tracer) else self.grid,
                y0,
                plan=self.plan,
                s=self.direction,
                progress=self.progress,
            )
        return while_loop(
            self.solver,
            self.f,
            args,
            y0,
            tau0=self.tau0,
            tau1=self.tau1,
            control=self.control,
            plan=self.plan,
            max_steps=self.max_steps,
            record=record,
            s=self.direction,
            progress=self.progress,
            events=self.events,
        )

    def replay_event(self, rec, k, starts, res, args):
        """Recorded step ``k`` again, after its step ``res`` was re-taken: if it ended with an
        event (``rec["ev"][k]``: the row of ``sol.events``, or -1), the state just after it, the
        solver state restarted there and ``(t*, y-)``, all differentiable (see
        :mod:`odegrad._events`); else ``res``'s own ``(y1, state)`` and placeholders."""
        events, solver, s = self.events, self.solver, self.direction
        row = rec["ev"][k]
        which = rec["which"][jnp.maximum(row, 0)]

        def fired(_):
            z = solver.interpolate(res.dense, rec["theta"][k])
            t_star, y_minus, y_plus = events.jump(which, s * starts[k + 1], z, args, s)
            return y_plus, self.init_state(y_plus, args, starts[k + 1]), (t_star, y_minus)

        def quiet(_):
            return res.y1, res.state, (s * starts[k + 1], res.y1)

        return member_cond(row >= 0, fired, quiet, None)

    def event_cotangent(self, row, which, ct):
        """The cotangents of ``(t*, y-)`` of row ``row`` of ``sol.events`` (zeros for -1),
        ``sol.ts[-1]``'s included for a terminal event (there ``t1 = direction * t*``);
        ``which``: the log's event indices."""
        r = jnp.maximum(row, 0)
        has = row >= 0
        terminal = self.events.is_terminal(which[r])
        ct_t = ct.events.ts[r] + jnp.where(terminal, self.direction * ct.t1, 0)
        ct_y = jax.tree.map(lambda c: jnp.where(has, c[r], 0), ct.events.ys)
        return jnp.where(has, ct_t, 0), ct_y

    def without_scan_tap(self) -> Problem:
        """This problem for adjoints that define their own reverse pass (no tap in the scan)."""
        if self.progress is None:
            return self
        return dataclasses.replace(
            self, progress=dataclasses.replace(self.progress, scan_tap=False)
        )

    @property
    def replays_retries(self) -> bool:
        """Whether a replay must know which steps followed a rejection: an adaptive solve with a
        solver that revises its state after a step (``AbstractSolver.after_step``)."""
        from .._loop import RuntimeGrid
        from ..solvers.base import AbstractSolver

        hook = type(self.solver).after_step
        adaptive = self.grid is None and not isinstance(self.control, RuntimeGrid)
        return adaptive and hook is not AbstractSolver.after_step

    def step(self, tau, h, y, args, state, retried=None, next_start=None):
        """One solver step from forward time ``tau`` with forward-time size ``h``. Adjoints
        replay steps: ``state`` and the result's state are what they checkpoint
        (``solver.compact_state``), revised by ``solver.after_step`` as the forward loop
        revised it once the step was accepted. ``retried``: the step followed a rejection (a
        ``StepRecord(retries=True)`` row), so the loop had revised ``state`` after that
        rejection first (a no-op on a state checkpointed after it). ``next_start``: where the
        next step starts (forward time), which tells whether this one ended at one of
        ``Adaptive(jump_ts=)``'s jumps, past which the loop restarted the solver."""
        s, solver = self.direction, self.solver
        if retried is not None:
            state = solver.after_step(self.f, s * tau, y, args, state, False, retried)[0]
        res = solver.step(self.f_held(s * tau, y, args), s * tau, s * h, y, args, state)
        # the end as the loop computes it (tau + h), so that a refresh sees the same time
        state = solver.after_step(self.f, s * (tau + h), res.y1, args, res.state, True, False)[0]
        state = solver.compact_state(state)
        jumps = jump_times(self.control, s, jnp.result_type(tau))
        if jumps is not None:
            if next_start is None:
                raise AssertionError("Problem.step: a solve with jump_ts replays with next_start")
            landed = landed_on_jump(jumps, tau, next_start)

            def restarted(_):
                t = s * next_start
                fresh = solver.restart(self.f_held(t, res.y1, args), t, res.y1, args, state)
                return solver.compact_state(fresh)

            state = member_cond(landed, restarted, lambda _: state, None)
        return res._replace(state=state)

    def init_state(self, y, args, tau=None):
        """The solver's carried state at ``(tau, y)`` (default: the start), as adjoints
        checkpoint it."""
        t = self.direction * (self.tau0 if tau is None else tau)
        return self.solver.compact_state(self.solver.init(self.f_held(t, y, args), t, y, args))

    def f_held(self, t, y, args):
        """``f`` for a step from ``(t, y)`` (real time), as the forward loop steps it: with
        ``og.switching_events``' switches held there (:meth:`EventSet.held`)."""
        f = self.f if self.events is None else self.events.held(self.f, t, y, args, self.direction)
        jumps = jump_times(self.control, self.direction, jnp.result_type(t))
        return between_jumps(f, jumps, self.direction * t, self.direction)

    def state_bytes(self) -> int:
        """Bytes of one state plus the solver's carried state."""
        st = jax.eval_shape(self.init_state, self.y0, self.args)
        leaves = jax.tree.leaves(self.y0) + jax.tree.leaves(st)
        itemsize = max((jax.numpy.result_type(x).itemsize for x in leaves), default=8)
        return itemsize * (tree_size(self.y0) + tree_size(st))

    def checkpoint_bytes(self) -> int:
        """Bytes of one binomial-schedule checkpoint: ``y`` alone when the solver's state is
        recomputed from it (``solver.state_from_y``), else ``y`` and that state."""
        if not self.solver.state_from_y:
            return self.state_bytes()
        leaves = jax.tree.leaves(self.y0)
        return sum(int(jax.numpy.size(x)) * jax.numpy.result_type(x).itemsize for x in leaves)

    def checkpoints_keep_state(self, checkpoints: int) -> bool:
        """Whether ``checkpoints`` binomial-schedule checkpoints may keep the solver's state
        beside ``y`` when it can be recomputed from ``y``: while all of them together (the
        whole batch) take at most ``Tuning.kept_solver_state_bytes`` more for it, which spares
        one evaluation of ``f`` per reverse step."""
        extra = self.state_bytes() - self.checkpoint_bytes()
        return checkpoints * extra * max(self.batch, 1) <= tuning().kept_solver_state_bytes


def refuse_dense_cotangent(adjoint_name: str, dense_ct) -> None:
    """Raise, at trace time, where a cotangent reaches the dense output (``sol.evaluate``) of a
    solve whose adjoint has no derivative for it (a custom VJP with ``symbolic_zeros=True``
    sees a ``SymbolicZero`` for every output nothing differentiates): a zero would be a
    silently wrong gradient."""
    is_zero = lambda c: isinstance(c, SymbolicZero)
    if any(not is_zero(c) for c in jax.tree.leaves(dense_ct, is_leaf=is_zero)):
        raise ValueError(
            f"{adjoint_name} does not differentiate the dense output: a gradient flows through "
            "sol.evaluate(t), which it would count as zero. Use adjoint=og.Discrete() (og.Auto() "
            "picks it when SaveAt(dense=True)), or save those times with SaveAt(ts=...)."
        )


def primal_values(tree):
    """The values of a ``custom_vjp`` forward rule's inputs under ``symbolic_zeros=True``."""
    return jax.tree.map(lambda p: p.value, tree, is_leaf=_is_primal)


def perturbed_leaves(tree) -> list[bool]:
    """Which leaves of a ``custom_vjp`` forward rule's input ``tree`` (under
    ``symbolic_zeros=True``) a derivative reaches."""
    return [p.perturbed for p in jax.tree.leaves(tree, is_leaf=_is_primal)]


def instantiate_zeros(ct):
    """``ct`` with each ``SymbolicZero`` leaf an array of zeros."""
    is_zero = lambda c: isinstance(c, SymbolicZero)
    return jax.tree.map(
        lambda c: jnp.zeros(c.shape, c.dtype) if is_zero(c) else c, ct, is_leaf=is_zero
    )


class CustomRule(NamedTuple):
    """An adjoint's reverse pass for one problem: ``primal(y0, args_diff) -> LoopOutput``,
    ``fwd(y0, args_diff) -> (LoopOutput, residuals)`` and ``bwd(residuals, ct) -> (ct_y0,
    ct_args_diff)``, as ``jax.custom_vjp`` takes them."""

    primal: Callable
    fwd: Callable
    bwd: Callable


def custom_vjp_solve(
    problem: Problem, rule: Callable[[Problem], CustomRule], symbolic_zeros: bool = False
) -> LoopOutput:
    """The solve with ``rule(problem)``'s reverse pass, a ``jax.custom_vjp`` of ``(y0,
    args_diff)`` whose rules see the problem rebuilt from their own arguments
    (:meth:`Problem.traced_constants`), so that they close over no other trace's values.
    ``symbolic_zeros``: ``fwd`` gets JAX's ``CustomVJPPrimal`` inputs and ``bwd`` its
    ``SymbolicZero`` cotangents.

    Under forward-mode autodiff (``jax.jvp``, ``jacfwd``), which JAX refuses for a custom VJP,
    ``primal`` runs instead: the plain loops differentiate forward exactly (step sizes as
    constants) and forward mode never needs stored states. Forward mode is recognised from the
    inputs (under ``jax.jit`` JAX raises its refusal only when the program is lowered, after the
    solve has returned), else from JAX's error."""
    consts, with_consts = problem.traced_constants()

    def primal(y0, args_diff, consts):
        return rule(with_consts(consts)).primal(y0, args_diff)

    @jax.custom_vjp
    def solve(y0, args_diff, consts):
        return primal(y0, args_diff, consts)

    def solve_fwd(y0, args_diff, consts):
        refuse_perturbed(consts)
        consts = primal_values(consts)
        if not symbolic_zeros:
            y0, args_diff = primal_values((y0, args_diff))
        out, res = rule(with_consts(consts)).fwd(y0, args_diff)
        return out, (res, consts)

    def solve_bwd(res, ct):
        res, consts = res
        if not symbolic_zeros:
            ct = instantiate_zeros(ct)
        ct_y0, ct_args = rule(with_consts(consts)).bwd(res, ct)
        return ct_y0, ct_args, None  # the constants' cotangents: zero (see solve_fwd)

    solve.defvjp(solve_fwd, solve_bwd, symbolic_zeros=True)
    args = (problem.y0, problem.args_diff, consts)
    if forward_mode(args):
        return primal(*args)
    try:
        return solve(*args)
    except TypeError as e:
        if "forward-mode" not in str(e):
            raise
        return primal(*args)


def _is_primal(p) -> bool:
    return isinstance(p, CustomVJPPrimal)


HOLDS_CONSTANT = (
    "og.solve: a derivative reaches a value the solve holds constant: a tolerance, "
    "og.Fixed(dt), a step grid, or t_span/SaveAt(ts) with events, StepTo or "
    "SaveAt(fn/steps/dense) (times have derivatives otherwise, but SaveAt(ts) made "
    "inside a jax.jit on a fixed grid only with jax.jit outside the jax.grad). Wrap it in "
    "jax.lax.stop_gradient; for a span T, solve on s in [0, 1] with "
    "f_s(s, y, (T, args)) = T * f(t0 + s T, y, args)."
)


def refuse_perturbed(consts) -> None:
    """Raise where a derivative reaches values a custom VJP holds constant (``consts``, its
    ``CustomVJPPrimal`` inputs under ``symbolic_zeros=True``): their cotangent would be a
    silent zero. Times traced under ``jax.jit`` get here when a ``jax.grad`` outside it
    differentiates them where they have no derivative."""
    if any(p.perturbed for p in jax.tree.leaves(consts, is_leaf=_is_primal)):
        raise ValueError(HOLDS_CONSTANT)


@jax.custom_jvp
def held_constant(x):
    """The identity, refusing a derivative (in either mode): a static grid's plain scan, which
    JAX differentiates itself, reads its step grid through this, so that a grid traced under
    ``jax.jit`` and differentiated by a ``jax.grad`` outside it raises as every custom-VJP
    adjoint does (og.solve refuses a derivative it can see; one outside a jit it cannot),
    rather than returning the discretisation's dependence on its steps for some adjoints."""
    return x


@held_constant.defjvp
def _held_constant_jvp(primals, tangents):
    raise ValueError(HOLDS_CONSTANT)


class AbstractAdjoint(abc.ABC):
    """How reverse-mode gradients of a solve are computed.

    ``run`` returns the forward :class:`~odegrad._loop.LoopOutput`; its reverse pass is whatever
    the method defines (a custom VJP, or JAX's own autodiff of a ``lax.scan``).
    """

    @abc.abstractmethod
    def run(self, problem: Problem) -> LoopOutput: ...

    def describe(self, problem: Problem) -> str:
        return repr(self)
