"""Step-size choice: a fixed grid known up front, or an error-controlled adaptive step.

``Fixed`` and ``StepTo`` describe a grid whose step count is known at trace time, so the forward
loop is a ``lax.scan``. ``Adaptive`` runs a ``lax.while_loop`` with a PI controller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._tree import rms_error_ratio, tolerance_leaves


def _is_concrete(x) -> bool:
    try:
        np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return False
    return True


def _as_time(t, tdtype):
    """Times as numpy when concrete (so that step counts stay static under jit), else traced."""
    if _is_concrete(t):
        return np.asarray(t, dtype=tdtype)
    return jnp.asarray(t, tdtype)


class AbstractStep:
    """How the solve chooses its steps."""


@dataclass(frozen=True)
class Fixed(AbstractStep):
    """Constant steps: ``n = ceil((t1 - t0) / dt)`` of them, the last landing on ``t1``.

    The actual step is ``(t1 - t0) / n``, never longer than ``dt`` (an explicit scheme's
    stability limit holds; diffrax's ``ConstantStepSize`` likewise), so that the grid ends
    exactly at ``t1``; a quotient within 1e-6 over an integer (``1 / 0.1``) counts as that
    integer. With concrete ``t_span`` and ``dt`` the count is static and the solve is one
    ``lax.scan``.

    Example:
        >>> step = og.Fixed(0.01)   # 100 steps over t_span=(0, 1)
    """

    dt: float

    def __post_init__(self):
        if _is_concrete(self.dt):
            dt = float(np.asarray(self.dt))
            if not dt > 0 or not math.isfinite(dt):
                raise ValueError(
                    f"Fixed(dt={dt}): dt must be positive and finite; the direction of "
                    "integration comes from t_span (t1 < t0 integrates backwards)."
                )


@dataclass(frozen=True)
class StepTo(AbstractStep):
    """Step exactly from one time of ``ts`` to the next; ``ts[0] == t0`` and ``ts[-1] == t1``.

    Example:
        >>> step = og.StepTo(jnp.linspace(0.0, 1.0, 101))   # 100 steps
    """

    ts: jax.Array

    def __post_init__(self):
        if jnp.ndim(self.ts) != 1 or jnp.shape(self.ts)[0] < 2:
            raise ValueError(
                f"StepTo(ts): ts must be a 1-d array of at least 2 times, got shape "
                f"{jnp.shape(self.ts)}."
            )


#: Floor on the previous error ratio in the controller's proportional term. That term damps
#: step-size oscillation near the tolerance; a previous ratio far below it (the start, a smooth
#: stretch, float32 roundoff, where the error estimate is mostly noise) has nothing to damp,
#: and under the 1e-4 floor of Hairer & Wanner's DOPRI5 it only slowed the step's growth: on a
#: float32 neural ODE 6.0 steps per member at rtol=1e-3 became 4.9 with 1e-2, error still
#: ~3e-6, other problems unchanged within noise (``benchmarks/work_precision.py``). With the
#: default gains and q = 4 the strongest damping, 0.01^0.08 = 0.69, is DOPRI5's own
#: (1e-4^0.04).
PREV_RATIO_FLOOR = 1e-2

#: Gustafsson's PI.3.4 gains ``(pcoeff, icoeff)``, the solvers' default (see :class:`Adaptive`).
PI34_GAINS = (0.4, 0.3)


def _check_times(name: str, ts) -> None:
    """Refuse ``Adaptive(jump_ts=)`` / ``(step_ts=)`` that are not a 1-d array of real times."""
    if ts is None:
        return
    dtype = np.asarray(ts).dtype if _is_concrete(ts) else jnp.result_type(ts)
    if not (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating)):
        raise TypeError(
            f"Adaptive({name}=...): {name} must hold real numbers (times), got dtype {dtype}."
        )
    shape = np.shape(ts) if _is_concrete(ts) else ts.shape
    if len(shape) != 1:
        raise ValueError(
            f"Adaptive({name}=...): {name} must be a 1-d array of times, got shape {shape}; "
            "pass jnp.ravel(times) or None."
        )
    if _is_concrete(ts) and np.isnan(np.asarray(ts, float)).any():
        raise ValueError(
            f"Adaptive({name}=...): {name} holds nan; every entry must be a time (inf pads: it "
            "is never reached)."
        )


@dataclass(frozen=True)
class Adaptive(AbstractStep):
    """Error-controlled steps with a PI controller (Gustafsson; Hairer & Wanner II, IV.2).

    A step is accepted when ``e = RMS(err / (atol + rtol * max(|y0|, |y1|))) <= 1``. The next step
    is ``dt * clip(safety * e^(-beta1) * max(e_prev, 0.01)^beta2, factormin, factormax)`` (the
    floor 1e-4 for implicit solvers, Hairer & Wanner's), at
    most ``dt`` after a rejection, where ``e_prev`` is the last accepted step's ``e`` (1 before
    the first), ``beta1 = (pcoeff + icoeff) / (q + 1)``, ``beta2 = pcoeff / (q + 1)`` and ``q``
    is the embedded order. ``pcoeff=0, icoeff=1`` is the elementary (I) controller,
    ``safety * e^(-1/(q+1))``, which diffrax's ``PIDController`` uses by default (with
    ``q + 2``).

    Gains left ``None`` are the solver's (``AbstractSolver.pi_gains``):

    * explicit Runge–Kutta: ``pcoeff=0.2, icoeff=0.65``, DOPRI5's controller (``beta2 = 0.04``,
      ``beta1 = 0.2 - 0.75 beta2``; Hairer, Nørsett & Wanner I, II.4). On
      ``benchmarks/work_precision.py`` it reached a given float64 error in as few evaluations
      as PI.3.4 below, the I controller, diffrax and scipy's RK45 (within the ~10% noise of that
      measure); on a float32 neural ODE, whose error estimates are far below the tolerance, it
      grows the step faster: 4.0 steps per member against PI.3.4's 4.9 at the same error.
    * implicit, Rosenbrock and stabilised solvers: ``pcoeff=0.4, icoeff=0.3``, Gustafsson's
      PI.3.4 (Söderlind, "Automatic control and adaptive time-stepping", Numer. Algorithms 31,
      2002; "Digital filters in adaptive time-stepping", ACM TOMS 29, 2003). With DOPRI5's
      gains ROCK4 rejected 4x more steps on Robertson's problem.

    ``dt0=None`` picks the first step by Hairer & Wanner's algorithm (I, II.4, p. 169).
    ``dtmax`` caps every step, forward and in the continuous adjoints' backward solves
    (scipy's ``max_step``, diffrax's ``dtmax``): events are found by a sign change of ``cond``
    between a step's ends, so a ``cond`` that crosses and comes back within one step goes
    unseen; a step shorter than the shortest excursion sees it. ``dtmin``: a step the
    controller would reject below this size fails the solve (``Result.dt_underflow``) rather
    than shrinking further.

    ``rtol`` and ``atol`` may be given per entry (CVODES' vector ``abstol``, SciML's vector
    tolerances): an array (or a list of numbers) shaped like a single-array state, or a pytree of
    the state's structure whose leaves broadcast against its leaves (Robertson's chemistry:
    ``atol=[1e-8, 1e-14, 1e-6]``). Implicit solvers' Newton tests and the continuous adjoints'
    backward solves (whose state is not ``y``) use the tightest entry.

    ``jump_ts``: times where ``f`` jumps or kinks in ``t`` (the knots of a piecewise-constant
    or ``jnp.interp`` input, dose times), known in advance. A step that would cross one ends
    on it and the solver restarts there (a fresh first stage, as after an event); each step's
    stages read time strictly inside the jumps around its start, an ulp in, so no step
    straddles a jump and none evaluates ``f`` at one, where either side may be taken. Without it the
    controller finds each jump by rejecting steps. The times are constants of the
    discretisation, like step sizes: a derivative reaching them is refused. To differentiate with
    respect to a switching time, write it into ``f`` as a comparison and use
    ``og.switching_events`` (which also finds the times itself). Times outside the span are
    ignored. The continuous adjoints' backward solves stop at them too. (diffrax's
    ``ClipStepSizeController(jump_ts=)``, SciML's ``tstops`` with ``d_discontinuities``.)

    ``step_ts``: times every solve lands a step on, without a restart (``f`` is smooth
    there): data times whose states should be step ends rather than interpolated, or kinks of
    ``f`` in ``t`` (a ``jnp.interp`` input's knots) that need no fresh first stage. The
    continuous adjoints' backward solves land on them too. (diffrax's ``step_ts``, SciML's
    ``tstops``.)

    Example:
        >>> step = og.Adaptive(rtol=1e-8, atol=1e-8)
        >>> i_control = og.Adaptive(rtol=1e-6, atol=1e-6, pcoeff=0.0, icoeff=1.0)
        >>> knots = jnp.arange(1.0, 10.0)   # a piecewise-constant input changes at each
        >>> step = og.Adaptive(jump_ts=knots)
        >>> step = og.Adaptive(step_ts=jnp.linspace(0.0, 10.0, 11))  # steps end on the data
        >>> step = og.Adaptive(dtmax=0.05)  # no step longer than 0.05
    """

    rtol: float = 1e-6
    atol: float = 1e-6
    dt0: float | None = None
    safety: float = 0.9
    factormin: float = 0.2
    factormax: float = 10.0
    dtmin: float | None = None
    pcoeff: float | None = None
    icoeff: float | None = None
    jump_ts: Any = None
    step_ts: Any = None
    dtmax: float | None = None

    def __post_init__(self):
        for name in ("jump_ts", "step_ts"):
            _check_times(name, getattr(self, name))
        for name in ("rtol", "atol"):
            v = getattr(self, name)
            for leaf in jax.tree.leaves(v):
                if isinstance(leaf, str) or not _is_concrete(leaf):
                    continue
                try:
                    ok = bool(np.all(np.asarray(leaf, float) >= 0))
                except (TypeError, ValueError):
                    ok = False
                if not ok:
                    raise ValueError(
                        f"Adaptive({name}={v}): tolerances must be non-negative numbers: one "
                        "for every entry, or an array (a pytree) of them like the state."
                    )
        rtols, atols = jax.tree.leaves(self.rtol), jax.tree.leaves(self.atol)
        if all(_is_concrete(x) for x in rtols + atols):
            no_rtol = all(float(np.max(np.asarray(x))) == 0 for x in rtols)
            if no_rtol and any(float(np.min(np.asarray(x))) == 0 for x in atols):
                raise ValueError(
                    "Adaptive: rtol and atol cannot both be zero (for any entry): the error "
                    "of an entry at 0 would be divided by 0."
                )
        for name in ("dt0", "dtmin", "dtmax"):
            v = getattr(self, name)
            if v is not None and _is_concrete(v) and not float(np.asarray(v)) > 0:
                none = "an automatic first step" if name == "dt0" else "no bound"
                raise ValueError(
                    f"Adaptive({name}={v}): {name} must be a positive step size (or None for "
                    f"{none}); the direction comes from t_span."
                )
        if all(v is not None and _is_concrete(v) for v in (self.dtmin, self.dtmax)):
            if not float(np.asarray(self.dtmin)) <= float(np.asarray(self.dtmax)):
                raise ValueError(
                    f"Adaptive(dtmin={self.dtmin}, dtmax={self.dtmax}): dtmin must not exceed "
                    "dtmax."
                )
        for name in ("pcoeff", "icoeff"):
            v = getattr(self, name)
            if v is not None and _is_concrete(v) and not float(np.asarray(v)) >= 0:
                raise ValueError(f"Adaptive({name}={v}): the gains must be non-negative.")
        if all(v is not None and _is_concrete(v) for v in (self.pcoeff, self.icoeff)):
            p, i = float(np.asarray(self.pcoeff)), float(np.asarray(self.icoeff))
            if not p + i > 0:
                raise ValueError(
                    f"Adaptive(pcoeff={p}, icoeff={i}): the gains cannot both be zero (the step "
                    "would not respond to the error)."
                )

    # -- the controller, in forward time tau ---------------------------------------------------
    def error_ratio(self, err, y0, y1):
        return rms_error_ratio(err, y0, y1, self.rtol, self.atol)

    def next_factor(
        self, ratio, ratio_prev, q: int, floor: float = PREV_RATIO_FLOOR, gains=PI34_GAINS
    ):
        """Step-size factor from the current and previous error ratios (PI control);
        ``floor``: the solver's floor on ``ratio_prev`` (implicit solvers keep 1e-4);
        ``gains``: the solver's ``(pcoeff, icoeff)``, for those left ``None`` here."""
        pcoeff = gains[0] if self.pcoeff is None else self.pcoeff
        icoeff = gains[1] if self.icoeff is None else self.icoeff
        beta1 = (pcoeff + icoeff) / (q + 1)
        beta2 = pcoeff / (q + 1)
        ratio = jnp.maximum(ratio, 1e-10)
        factor = self.safety * ratio ** (-beta1) * jnp.maximum(ratio_prev, floor) ** beta2
        return jnp.clip(factor, self.factormin, self.factormax)

    def initial_step(self, f, t0, y0, f0, args, order: int, span):
        """Hairer & Wanner's starting step (Solving ODEs I, II.4): one extra evaluation of f."""
        if self.dt0 is not None:
            return jnp.minimum(jnp.asarray(self.dt0, span.dtype), span)
        leaves0, leavesf = jax.tree.leaves(y0), jax.tree.leaves(f0)
        rtols, atols = tolerance_leaves(self.rtol, y0, "rtol"), tolerance_leaves(self.atol, y0)
        scale = [a + r * jnp.abs(y) for y, r, a in zip(leaves0, rtols, atols, strict=True)]
        n = max(sum(int(np.prod(jnp.shape(y))) for y in leaves0), 1)

        def norm(vals):
            return jnp.sqrt(
                sum(jnp.sum(jnp.square(jnp.abs(v) / s)) for v, s in zip(vals, scale, strict=True))
                / n
            )

        d0, d1 = norm(leaves0), norm(leavesf)
        h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / d1)
        h0 = jnp.minimum(h0, span)
        y1 = jax.tree.map(lambda y, k: y + h0 * k, y0, f0)
        f1 = f(t0 + h0, y1, args)
        d2 = norm([a - b for a, b in zip(jax.tree.leaves(f1), leavesf, strict=True)]) / h0
        dmax = jnp.maximum(d1, d2)
        h1 = jnp.where(
            dmax <= 1e-15,
            jnp.maximum(1e-6, h0 * 1e-3),
            (0.01 / jnp.maximum(dmax, jnp.finfo(span.dtype).tiny)) ** (1.0 / (order + 1)),
        )
        return jnp.minimum(jnp.minimum(100 * h0, h1), span).astype(span.dtype)


def control_times(control, name: str, s, tdtype):
    """``control``'s times ``name`` (``"jump_ts"``, ``"step_ts"``) in forward time
    ``tau = s t``, ascending, as constants (no derivative flows to them), or ``None``."""
    ts = getattr(control, name, None)
    if ts is None:
        return None
    return jnp.sort(lax.stop_gradient(s * jnp.ravel(jnp.asarray(ts, tdtype))))


def jump_times(control, s, tdtype):
    """``control``'s ``jump_ts`` (:func:`control_times`)."""
    return control_times(control, "jump_ts", s, tdtype)


def next_jump(jumps, tau):
    """The first of the ascending ``jumps`` after ``tau`` (``inf`` past the last)."""
    k = jnp.searchsorted(jumps, tau, side="right")
    inf = jnp.asarray(jnp.inf, jumps.dtype)
    return jnp.where(k < jumps.shape[0], jumps[jnp.minimum(k, jumps.shape[0] - 1)], inf)


def time_inside_jumps(jumps, tau, s):
    """For a step from forward time ``tau`` (``s``: the direction), a map of real time ``t``
    (``s * tau`` at the step's start) to itself moved strictly between the jumps around
    ``tau``, an ulp inside: a stage on a jump, or a step starting on one, reads the step's own
    side of it. The value only: a derivative in ``t`` passes as through the identity."""
    if jumps is None:
        return lambda t: t
    k = jnp.searchsorted(jumps, tau, side="right")
    n, inf = jumps.shape[0], jnp.asarray(jnp.inf, jumps.dtype)
    before = jnp.where(k > 0, jumps[jnp.maximum(k - 1, 0)], -inf)
    after = jnp.where(k < n, jumps[jnp.minimum(k, n - 1)], inf)
    lo, hi = jnp.nextafter(before, inf), jnp.nextafter(after, -inf)

    def inside(t):
        return t + lax.stop_gradient(s * jnp.clip(s * t, lo, hi) - t)

    return inside


def between_jumps(f, jumps, tau, s):
    """``f`` for a step from forward time ``tau``, its time moved by :func:`time_inside_jumps`."""
    if jumps is None:
        return f
    inside = time_inside_jumps(jumps, tau, s)
    return lambda t, y, args: f(inside(t), y, args)


def landed_on_jump(jumps, tau, tau_next):
    """Whether the step from ``tau`` whose successor starts at ``tau_next`` ended on a jump,
    past which the loop restarted the solver (read from the recorded times, as replays know
    them: a step that stops short of the next jump ends before it)."""
    return tau_next >= next_jump(jumps, tau)


class StepDecision(NamedTuple):
    """What :func:`adapt_step` decided about one attempted step."""

    accept: Any  #: its error is within tolerance and its state finite
    h_next: Any  #: the next step size to try
    ratio: Any  #: the error ratio the next decision sees as the previous one
    underflow: Any  #: rejected, and the next step would fall below the floor (or is nan)
    nonfinite: Any  #: ``y1`` (or, ``finite=None``, the error estimate) holds an inf or a nan


def adapt_step(
    control, error, y0, y1, finite, h, ratio_prev, q, prev_floor, h_min, gains
) -> StepDecision:
    """Accept or reject a step of size ``h`` from ``y0`` to ``y1`` and size the next one: the
    one answer to "how is a step accepted" (the loops call nothing else).

    ``e = control.error_ratio(error, y0, y1)`` (``inf`` when ``finite`` is false or ``e`` is
    not finite; ``finite=None`` where ``e`` is nan whenever ``y1`` is not finite); the
    step is accepted when ``e <= 1``; the next step is ``h * control.next_factor(e, e_prev)``,
    at most ``h`` after a rejection (:class:`Adaptive`). ``q``: the embedded order;
    ``prev_floor``: the solver's floor on ``e_prev``; ``h_min``: the smallest step allowed;
    ``gains``: the solver's ``(pcoeff, icoeff)`` for those the control leaves ``None``. Step
    sizes are constants of the discretisation: no derivative flows through the decision.
    ``control`` may be a wrapper whose ``error_ratio`` sees part of the state (a seminorm).
    """
    ratio = lax.stop_gradient(control.error_ratio(error, y0, y1))
    nonfinite = jnp.isnan(ratio) if finite is None else ~finite
    ok = jnp.isfinite(ratio) if finite is None else finite & jnp.isfinite(ratio)
    ratio = jnp.where(ok, ratio, jnp.inf)
    accept = ratio <= 1
    factor = control.next_factor(ratio, ratio_prev, q, prev_floor, gains)
    h_next = h * jnp.where(accept, factor, jnp.minimum(factor, 1.0))
    if control.dtmax is not None:
        h_next = jnp.minimum(h_next, jnp.asarray(control.dtmax, h_next.dtype))
    # a nan step size (from a non-finite y0 or f at t0) never compares below the floor: it
    # underflows too, rather than being retried until max_steps
    underflow = ~accept & ~(h_next >= h_min)
    return StepDecision(accept, h_next, jnp.where(accept, ratio, ratio_prev), underflow, nonfinite)
