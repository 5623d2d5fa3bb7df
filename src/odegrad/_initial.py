"""A non-finite initial state ``y0`` or initial derivative ``f(t0, y0, args)``.

Either makes the first step non-finite, and the loops report what follows: an adaptive solve
rejects its steps at ``t0`` (a nan first step size stops it at once), a fixed grid runs on to
``t1``. Such a failure is recoded as ``Result.nonfinite_y0`` or ``Result.nonfinite_f0`` in
branches taken only when a solve failed before its first accepted step (:func:`refined_result`
for ``throw=False``, :func:`failure_locator` in the error's branch), so a successful solve
computes nothing for it; they evaluate ``f`` once. :func:`describe` words the error on the host
from leaf paths fixed at trace time. A concrete ``y0`` is checked before anything runs
(:func:`check_concrete_state`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._batching import any_member
from ._solution import Result
from ._tree import is_array, tree_all_finite

PyTree = Any

_KINDS = {1: "nan", 2: "inf", 3: "-inf"}
_FIX_Y0 = "check the inputs (y0 must be finite)"


def _failed_at_start(problem, out, tau0):
    """Members that failed before their first accepted step (a scan, or a while loop that does
    not test each step, never stops: any of its ``nonfinite`` results)."""
    if problem.runs_on:
        return out.result == Result.nonfinite
    # a checked loop's time moves with each accepted step, and only then: asking its time
    # rather than its count of accepted steps spares the loop a counter on every step
    return (out.result != Result.success) & (out.fail_t == tau0)


def _initial_derivative(problem, y):
    t0, f, args = problem.direction * problem.tau0, problem.f, problem.args
    if problem.solver.partitioned:
        return (f[0](t0, y[1], args), f[1](t0, y[0], args))
    return f(t0, y, args)


def _all_finite(tree):
    # sum(x - x) is 0, or nan from an inf or nan: one fused pass per leaf
    return jnp.isfinite(sum(jnp.sum(x - x) for x in jax.tree.leaves(tree)))


def refined_result(problem, out, y_start):
    """``out.result`` recoded as ``Result.nonfinite_y0`` / ``nonfinite_f0`` where a solve failed
    before its first accepted step because ``y0`` / ``f(t0, y0, args)`` holds inf or nan.

    ``y_start`` is ``y0`` as the loop left it for such a member: a while loop's final state
    (it never moved), a scan's ``y0``. ``f`` is evaluated in a branch taken only when some member
    failed so (for ``throw=False``; with ``throw=True`` :func:`failure_locator` does this in the
    error's own branch)."""
    at_start = _failed_at_start(problem, out, problem.tau0)

    def recode():
        y_ok = _all_finite(y_start)
        f_ok = _all_finite(_initial_derivative(problem, y_start))
        code = jnp.where(~y_ok, Result.nonfinite_y0, jnp.where(~f_ok, Result.nonfinite_f0, 0))
        return jnp.where(at_start & (code != 0), code, out.result).astype(jnp.int32)

    if not isinstance(at_start, jax.core.Tracer):  # eager: decide here, compile no branch
        return recode() if np.any(np.asarray(at_start)) else out.result
    return lax.cond(any_member(jnp.any(at_start)), recode, lambda: out.result)


#: ``info`` of :func:`failure_locator`, 8 ints: the first inf or nan of y0 and of f(t0, y0, args)
#: as (flat index over all leaves, kind), of the array leaves of args as (leaf, flat index,
#: kind), and the first non-finite array f closes over; -1 where none. Kind: 1 nan, 2 inf,
#: 3 -inf.
_INFO = 8


def _summarised(x) -> bool:
    """Whether a leaf goes to the error's callback as two ints, its first inf or nan and its kind
    (:func:`_summary`), rather than whole: on a mesh, where a sharded leaf sent to a host
    callback is gathered onto one device first (XLA's "[SPMD] Involuntary full
    rematerialization"; :func:`~odegrad._scaleout.failure_mesh`).
    Elsewhere the leaves go whole: the summary's reductions cost XLA:CPU compile time (measured:
    +0.4 s for three 100 x 100 leaves), the transfer happens only when a solve failed."""
    from ._scaleout import failure_mesh

    size = int(np.prod(jnp.shape(x)))
    inexact = jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    return inexact and 1 < size < 2**31 and failure_mesh() is not None


def _summary(x):
    """``[flat index, kind]`` (int32) of the first inf or nan of ``x``, ``[-1, 0]`` where none: two
    reductions over an index built from iotas, no reshape, so a sharded ``x`` is reduced where
    it lies."""
    x = jnp.asarray(x)
    strides = np.cumprod((1, *x.shape[::-1]))[-2::-1] if x.ndim else ()
    flat = sum(
        (lax.broadcasted_iota(jnp.int32, x.shape, d) * int(k) for d, k in enumerate(strides)),
        jnp.zeros(x.shape, jnp.int32),
    )
    bad = ~jnp.isfinite(x)
    first = jnp.min(jnp.where(bad, flat, x.size))
    kinds = jnp.where(jnp.isnan(x), 1, jnp.where(jnp.real(x) < 0, 3, 2))
    kind = jnp.max(jnp.where(bad & (flat == first), kinds, 0))
    return jnp.stack([jnp.where(first < x.size, first, -1), kind]).astype(jnp.int32)


def _summaries(leaves, which) -> list:
    """``leaves``, those flagged in ``which`` (:func:`_summarised`) as their :func:`_summary`."""
    return [_summary(x) if s else x for x, s in zip(leaves, which, strict=True)]


def _first_entry(leaves, summarised=None) -> tuple[int, int, int]:
    """``(leaf, flat index in it, kind)`` of the first inf or nan of ``leaves`` (NumPy), some
    given as their :func:`_summary` (``summarised``)."""
    summarised = summarised or (False,) * len(leaves)
    for i, (x, s) in enumerate(zip(leaves, summarised, strict=True)):
        x = np.asarray(x).reshape(-1)
        if s:
            if x[0] >= 0:
                return i, int(x[0]), int(x[1])
            continue
        if not np.issubdtype(x.dtype, np.inexact):
            continue
        bad = np.flatnonzero(~np.isfinite(x))
        if bad.size:
            v = x[bad[0]]
            return i, int(bad[0]), 1 if np.isnan(v) else (3 if np.real(v) < 0 else 2)
    return -1, -1, 0


def _locate_on_host(code, at_start, y, f0, arrays, consts, summarised, y_sizes):
    """Host side of :func:`failure_locator` for ``y0`` and ``f(t0, y0, args)``, for every member
    (leading axes of ``code``). ``summarised``: which leaves of each of the four came as their
    :func:`_summary`; ``y_sizes``: the state's leaves' sizes (one member's)."""
    code, at_start = np.asarray(code), np.asarray(at_start)
    batch = code.shape
    y_of, f_of, a_of, c_of = summarised

    def member(tree, i):
        return [np.broadcast_to(x, batch + x.shape[len(batch) :])[i] for x in tree]

    out_code, info = code.copy(), np.full((*batch, _INFO), -1, np.int32)
    sizes = np.cumsum([0, *y_sizes])
    for i in np.ndindex(batch):
        row = info[i]
        y_leaf, y_at, y_kind = _first_entry(member(y, i), y_of)
        f_leaf, f_at, f_kind = _first_entry(member(f0, i), f_of)
        if y_leaf >= 0:
            row[0:2] = sizes[y_leaf] + y_at, y_kind
        if f_leaf >= 0:
            row[2:4] = sizes[f_leaf] + f_at, f_kind
        row[4:7] = _first_entry(member(arrays, i), a_of)
        row[7] = _first_entry(member(consts, i), c_of)[0]
        if at_start[i] and y_leaf >= 0:
            out_code[i] = Result.nonfinite_y0
        elif at_start[i] and f_leaf >= 0:
            out_code[i] = Result.nonfinite_f0
    return out_code.astype(np.int32), info


def _rows_summarised(loop):
    """``loop`` with each large saved row (``ts_ys``, ``steps_ys``) replaced by 0, or nan where
    it holds an inf or nan: what :func:`~odegrad._failure.locate_failure` reads of it on the host
    (on a mesh, see :func:`_summarised`)."""

    def rows(x):
        if x is None or not any(_summarised(r) for r in jax.tree.leaves(x)):
            return x
        n = jax.tree.leaves(x)[0].shape[0]
        finite = jax.vmap(tree_all_finite)(x) if n else jnp.zeros((0,), bool)
        return jnp.where(finite, 0.0, jnp.nan)

    return loop._replace(ts_ys=rows(loop.ts_ys), steps_ys=rows(loop.steps_ys))


def failure_locator(problem, out, y_start, t0):
    """``(gather, locate)`` for :func:`~odegrad._solution.check_result`. ``gather()``, traced
    only into the error's branch, takes the loop's output (its saved rows locate a non-finite
    value), ``y0`` as the loop left it, ``f(t0, y0, args)`` (one evaluation of ``f``), the
    array leaves of ``args`` and the arrays ``f`` closes over. ``locate`` finds on the host,
    member by member, where the solve failed (:func:`~odegrad._failure.locate_failure` on NumPy
    arrays) and whether ``y0`` or ``f(t0, y0, args)`` is at fault (:func:`_locate_on_host`):
    the reductions that takes would cost XLA:CPU ~30 ms of compile time each in the program,
    in a branch that a successful solve never runs."""
    from ._failure import AT_STEP, locate_failure

    # only what locating needs: the branch's operands are computed and kept on every call,
    # also where nothing else reads them (the rejected-step and evaluation counts, rows)
    stats = {"steps": out.stats["steps"]}  # the loop's own count (max_steps)
    loop = out._replace(y1=None, dense=None, stats=stats, record={}, accumulated=None)
    loop = loop._replace(events=None, h=None, resume=None)
    if out.fail_t is not None:  # a checked loop says where it stopped: no rows to search
        loop = loop._replace(t1=None, ts_ys=None, steps_ts=None, steps_ys=None)
    grid = problem.grid
    # a traced grid (StepTo of traced times) goes to the host as an operand: a closure over
    # it would leak its tracer into the callback
    traced_grid = grid is not None and isinstance(grid, jax.core.Tracer)

    y_leaves = jax.tree.leaves(y_start)
    y_sizes = [int(np.prod(jnp.shape(x))) for x in y_leaves]
    summarised = [tuple(map(_summarised, x)) for x in (y_leaves, y_leaves, *problem.args[:2])]

    def gather():
        f0 = jax.tree.leaves(_initial_derivative(problem, y_start))
        leaves = (y_leaves, f0, *problem.args[:2])
        start = [_summaries(x, w) for x, w in zip(leaves, summarised, strict=True)]
        ran = (_rows_summarised(loop), problem.plan.ts, problem.tau0, t0, problem.direction)
        ran = (*ran, grid) if traced_grid else ran
        return jax.tree.map(jnp.asarray, ran), start

    def locate(ran, start):
        nb = np.ndim(ran[0].result)  # the batch's axes: a member's result is a scalar
        batch = np.broadcast_shapes(*(np.shape(x)[:nb] for x in jax.tree.leaves((ran, start))))
        ran = jax.tree.map(lambda x: np.broadcast_to(x, batch + np.shape(x)[nb:]), ran)
        out_, save_times, tau0, t0_, s, *given = ran
        tau, step, how = np.zeros(batch), np.zeros(batch, np.int64), np.zeros(batch, np.int64)
        for i in np.ndindex(batch):
            o, ts, tau0_i, *g = jax.tree.map(lambda x: x[i], (out_, save_times, tau0, *given))
            tau[i], step[i], how[i] = locate_failure(o, g[0] if g else grid, ts, tau0_i, xp=np)
        at_start = _failed_at_start(problem, out_, tau0)
        code, info = _locate_on_host(out_.result, at_start, *start, summarised, y_sizes)
        # a non-finite y0 or f(t0, y0, args) fails at the start, though a scan runs on
        initial = code != out_.result
        return (
            np.where(initial, t0_, s * tau),
            np.where(initial, 0, step),
            code,
            (info, np.where(initial, AT_STEP, how)),
        )

    return gather, locate


def leaf_paths(tree: PyTree) -> list[str]:
    """Each leaf's pytree path as text: ``[1]``, ``['k']``, ``.mlp.layers[0].weight``."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(path) for path, _ in flat]


def state_names(y0_user: PyTree) -> list[str]:
    """``y0[1]``, ``y0['a']``: each leaf of the initial state by its path."""
    return ["y0" + p for p in leaf_paths(y0_user)]


def _entry_text(name: str, shape: tuple, entry: int, kind: int) -> str:
    """``"<name> holds nan at index (i, j)"`` (no index for a scalar)."""
    index = tuple(int(i) for i in np.unravel_index(entry, shape)) if shape else ()
    where = f" at index {index}" if shape else ""
    return f"{name} holds {_KINDS.get(kind, 'inf or nan')}{where}"


_RUNS_ON = (
    "a fixed grid runs on past a non-finite value; SaveAt(steps=True) locates the step where "
    "it first appeared"
)
_FIX_NONFINITE = "check f and the initial state, or take smaller steps"
_STIFF_SOLVER_FAILED = {
    Result.max_steps_reached: (
        "max_steps was reached before t1 with an implicit solver; raise max_steps=... or "
        "loosen the tolerances (float32 resolves little below rtol=1e-5), and look where the "
        "steps shrank (SaveAt(steps=True)): a fast transient or a blow-up in f"
    ),
    Result.step_size_underflow: (
        "the step size fell below the floor with an implicit solver: f may blow up or be "
        "singular here (check f near this t){}"
    ),
}
_NEWTON_FAILED = (
    ", or Newton kept failing (try max_newton_iters=..., or og.Rodas5P(), which needs no "
    "Newton iterations)"
)


def describe(problem, y0_user: PyTree, args_user: PyTree, saves_fn: bool = False):
    """``describe(code, info)`` for :func:`~odegrad._solution.check_result`: the error's body for
    ``Result.nonfinite_y0`` and ``Result.nonfinite_f0`` from :func:`failure_locator`'s ``info``
    (one member's), and for ``Result.nonfinite`` where the loop ran on past it (``info``'s
    ``how``, :func:`~odegrad._failure.locate_failure`); ``None`` for other codes. Names and
    shapes are fixed here, at trace time. ``saves_fn``: the saves are ``SaveAt(fn)``'s, which
    may be what is not finite."""
    y_paths = leaf_paths(y0_user)
    y_shapes = [tuple(jnp.shape(x)) for x in jax.tree.leaves(problem.y0)]
    starts = np.cumsum([0] + [int(np.prod(s)) for s in y_shapes])
    if problem.solver.partitioned:
        # du/dt = f_u(t, v, args) and dv/dt = f_v(t, u, args), with y0 = (u0, v0)
        halves = {"[0]": "f_u(t0, v0, args)", "[1]": "f_v(t0, u0, args)"}
        f_names = [halves[p[:3]] + p[3:] for p in y_paths]
    else:
        f_names = ["f(t0, y0, args)" + p for p in y_paths]
    y_names = ["y0" + p for p in y_paths]
    flat_args = jax.tree_util.tree_flatten_with_path(args_user)[0]
    a_names = ["args" + jax.tree_util.keystr(p) for p, x in flat_args if is_array(x)]
    a_shapes = [tuple(jnp.shape(x)) for x in problem.args[0]]
    # Python numbers in args are constants of the trace: a non-finite one is known now
    static_bad = [
        f"args{jax.tree_util.keystr(p)} is {x}"
        for p, x in flat_args
        if isinstance(x, float | complex) and not is_array(x) and not np.isfinite(x)
    ]
    c_names = [f"an array of shape {jnp.shape(c)} that f closes over" for c in problem.args[1]]

    def entry(names, flat, kind):
        leaf = int(np.searchsorted(starts, flat, side="right")) - 1
        return _entry_text(names[leaf], y_shapes[leaf], int(flat - starts[leaf]), int(kind))

    def ran_on(how):
        what = "the state, or SaveAt(fn) of it," if saves_fn else "the state"
        if how == AT_SAVE:
            return (
                f"{what} was first non-finite (inf/nan) at this save time, so it became so at "
                f"or before it ({_RUNS_ON}); {_FIX_NONFINITE}"
            )
        if how == AT_END:
            return (
                f"the state was non-finite (inf/nan) at the end of the solve ({_RUNS_ON}); "
                f"{_FIX_NONFINITE}"
            )
        if saves_fn and problem.runs_on:  # located by the first non-finite saved row
            return f"{what} became non-finite (inf/nan); check f, fn and the initial state"
        return None

    from ._failure import AT_END, AT_SAVE
    from ._loop import RuntimeGrid
    from .solvers.implicit import _ESDIRK

    fixed_steps = isinstance(problem.control, RuntimeGrid)
    stiff_solver = getattr(problem.solver, "implicit", False)
    newton = _NEWTON_FAILED if isinstance(problem.solver, _ESDIRK) else ""

    def body(code, info):
        info, how = info
        if code == Result.nonfinite:
            return ran_on(int(how))
        if code == Result.max_steps_reached and fixed_steps:
            return (
                "max_steps was reached before t1: the fixed steps of this span (with any that "
                "events cut short) number more than max_steps; pass a larger max_steps or a "
                "larger step size"
            )
        if code in (Result.max_steps_reached, Result.step_size_underflow) and stiff_solver:
            # (the codes' own messages suggest a stiff solver)
            return _STIFF_SOLVER_FAILED[code].format(newton)
        if code == Result.nonfinite_y0:
            return f"the initial state y0 is not finite: {entry(y_names, *info[0:2])}; {_FIX_Y0}"
        if code != Result.nonfinite_f0:
            return None
        bad_f = entry(f_names, *info[2:4])
        head = f"the initial derivative f(t0, y0, args) is not finite while y0 is: {bad_f}"
        a, c = int(info[4]), int(info[7])
        if a >= 0:
            bad_arg = _entry_text(a_names[a], a_shapes[a], int(info[5]), int(info[6]))
        else:
            bad_arg = next(iter(static_bad), None)
        if bad_arg is not None:
            return f"{head}, and {bad_arg}; check args (or f, if it should handle that value)"
        if c >= 0:
            return f"{head}, and {c_names[c]} holds inf or nan; check the constants f uses"
        return (
            f"{head}, though args are finite; check the right-hand side f at t0 (a division by "
            "zero, a log or sqrt outside its domain, an overflow)"
        )

    return body


#: states of at most this many entries are checked for inf and nan on the host
_HOST_CHECK_ENTRIES = 1 << 16


def check_concrete_state(y0: PyTree, names: list[str]) -> None:
    """Raise a ``ValueError`` naming the first leaf of ``y0`` that holds inf or nan, when the
    leaves are concrete (eager calls, constants under ``jax.jit``); traced leaves are left to
    the run-time check. A small state is checked on the host (no program to compile for each
    new shape); a large one by one device reduction and one small transfer."""
    leaves = jax.tree.leaves(y0)
    concrete = [i for i, x in enumerate(leaves) if not isinstance(x, jax.core.Tracer)]
    if not concrete:
        return
    if sum(int(np.size(leaves[i])) for i in concrete) <= _HOST_CHECK_ENTRIES:
        ok = np.array([np.isfinite(np.asarray(leaves[i])).all() for i in concrete])
    else:
        with jax.ensure_compile_time_eval():
            ok = np.asarray(_finite_flags([leaves[i] for i in concrete]))
    if ok.all():
        return
    i = concrete[int(np.argmin(ok))]
    x = np.asarray(leaves[i])
    e = int(np.argmin(np.isfinite(x).reshape(-1)))
    v = x.reshape(-1)[e]
    kind = 1 if np.isnan(v) else (3 if np.real(v) < 0 else 2)
    bad = _entry_text(names[i], x.shape, e, kind)
    raise ValueError(f"the initial state y0 is not finite: {bad}; {_FIX_Y0}.")


@jax.jit
def _finite_flags(leaves):
    return jnp.stack([jnp.isfinite(jnp.sum(x - x)) for x in leaves])
