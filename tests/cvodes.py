"""An independent reference: SUNDIALS CVODES through CasADi, with its sensitivities.

The right-hand side is the very function the JAX code integrates (see
:mod:`tests.reference_problems`), built symbolically in CasADi; integration and derivatives are
entirely CasADi/CVODES, so nothing here shares code with ``odegrad``. By default
(``method="auto"``) non-stiff problems use Adams–Moulton and stiff ones BDF, both with Newton
iterations and a dense direct linear solver.

* :func:`cvodes_solve` — states at the save times ``ts``, shape ``(len(ts), n)``.
* :func:`cvodes_gradient` — ``loss = sum_{k,i} weights[k, i] * y_i(ts[k])`` and its gradient
  with respect to ``y0`` and ``params``. Any smooth loss ``L(ys)`` of the saved states is covered
  by passing ``weights = dL/dys`` evaluated on our side (the chain rule does the rest).
  ``mode="forward"`` (default) uses forward sensitivities: CasADi integrates the augmented
  variational system with CVODES, so the sensitivities are under error control.
  ``mode="adjoint"`` uses CVODES's checkpointed adjoint; it is a cross-check only (less accurate,
  and on stiff problems it needs ``rtol, atol >= 1e-10``: CVodeB gives up at 1e-12).
* :func:`cvodes_jacobian` — ``dys/dy0`` and ``dys/dparams`` at every save time.

Accuracy observed at the default ``rtol = atol = 1e-12`` (default problems, 11 save times,
against scipy DOP853/Radau at 1e-13/1e-12 on the states and on the variational system):
states ~1e-11 (non-stiff, Adams) and ~1e-10 (stiff, BDF) relative to the solution's scale;
forward-mode gradients 1e-12 to 4e-10 relative; adjoint-mode gradients 1e-9 to 2e-7.

Built integrators and derivative functions are cached per (problem, ts, tolerances, options).
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:  # imported as ``tests.cvodes``
    from .reference_problems import Problem, casadi_rhs
except ImportError:  # imported as ``cvodes`` with ``tests/`` on sys.path (pytest's default)
    from reference_problems import Problem, casadi_rhs

__all__ = ["cvodes_gradient", "cvodes_jacobian", "cvodes_solve"]

DEFAULT_MAX_NUM_STEPS = 500_000

_CACHE: dict[tuple, Any] = {}


def _ca():
    import casadi

    return casadi


def _check_ts(problem: Problem, ts) -> np.ndarray:
    ts = np.asarray(ts, dtype=np.float64).reshape(-1)
    if ts.size == 0:
        raise ValueError("ts must be non-empty")
    if np.any(np.diff(ts) <= 0):
        raise ValueError("ts must be strictly increasing")
    if ts[0] < problem.t0:
        raise ValueError(f"ts must start at or after t0={problem.t0}")
    return ts


def _merged_options(problem: Problem, method: str, options: dict | None) -> dict:
    """User ``options`` plus the multistep method: ``"auto"`` is Adams unless ``problem.stiff``."""
    if method == "auto":
        method = "bdf" if problem.stiff else "adams"
    if method.lower() not in ("bdf", "adams"):
        raise ValueError(f"method must be 'auto', 'bdf' or 'adams', got {method!r}")
    merged = {"linear_multistep_method": method.lower()}
    merged.update(options or {})
    return merged


def _options(rtol: float, atol: float, max_num_steps: int, extra: dict | None) -> dict:
    opts = {
        "reltol": float(rtol),
        "abstol": float(atol),
        "max_num_steps": int(max_num_steps),
        # forward sensitivities take part in the error control (CasADi >= 3.6 integrates them as
        # augmented states anyway, which CVODES always error-controls)
        "fsens_err_con": True,
        "disable_internal_warnings": True,
    }
    if extra:
        opts.update(extra)
    return opts


def _key(problem, ts, rtol, atol, max_num_steps, options, what):
    opt_key = tuple(sorted((options or {}).items()))
    return (
        id(problem),
        what,
        tuple(ts.tolist()),
        float(rtol),
        float(atol),
        int(max_num_steps),
        repr(opt_key),
    )


def _integrator(problem: Problem, ts: np.ndarray, rtol, atol, max_num_steps, options):
    """The CasADi ``integrator`` Function with output grid ``ts`` (outputs ``xf``: n x K)."""
    key = _key(problem, ts, rtol, atol, max_num_steps, options, "F")
    if key not in _CACHE:
        ca = _ca()
        t, x, p, ode = casadi_rhs(problem, "SX")
        dae = {"x": x, "p": p, "t": t, "ode": ode}
        F = ca.integrator(
            f"cvodes_{problem.name}",
            "cvodes",
            dae,
            float(problem.t0),
            [float(v) for v in ts],
            _options(rtol, atol, max_num_steps, options),
        )
        _CACHE[key] = (problem, F)  # keep ``problem`` alive so its id() stays unique
    return _CACHE[key][1]


def _y0_params(problem: Problem, y0, params):
    y0 = problem.y0 if y0 is None else np.asarray(y0, dtype=np.float64).reshape(-1)
    params = problem.params if params is None else np.asarray(params, dtype=np.float64).reshape(-1)
    if y0.shape != (problem.n,):
        raise ValueError(f"y0 has shape {y0.shape}, expected ({problem.n},)")
    if params.shape != (problem.n_params,):
        raise ValueError(f"params has shape {params.shape}, expected ({problem.n_params},)")
    return y0, params


def cvodes_solve(
    problem: Problem,
    y0=None,
    params=None,
    ts=None,
    rtol: float = 1e-12,
    atol: float = 1e-12,
    *,
    method: str = "auto",
    max_num_steps: int = DEFAULT_MAX_NUM_STEPS,
    options: dict | None = None,
) -> np.ndarray:
    """Solve ``y' = rhs(t, y, params)``, ``y(t0) = y0``; states at ``ts``, shape ``(K, n)``.

    ``y0``/``params``/``ts`` default to the problem's own (``ts`` to ``[t0, t1]`` with 11 points).
    ``ts`` must be strictly increasing and ``>= problem.t0``; ``ts[0] == t0`` returns ``y0``.
    ``method``: ``"auto"`` (Adams–Moulton for non-stiff problems, BDF for ``problem.stiff``),
    ``"adams"`` or ``"bdf"``; both with Newton iterations and a dense direct linear solver.
    ``options`` are extra CasADi CVODES options, applied last (e.g. ``{"max_order": 3}``).
    """
    y0, params = _y0_params(problem, y0, params)
    ts = _check_ts(problem, problem.ts() if ts is None else ts)
    options = _merged_options(problem, method, options)
    F = _integrator(problem, ts, rtol, atol, max_num_steps, options)
    res = F(x0=y0, p=params)
    return np.asarray(res["xf"]).reshape(problem.n, ts.size).T.copy()


def _derivative_function(problem, ts, rtol, atol, max_num_steps, options, mode):
    """A CasADi Function for the sensitivities of the saved states.

    ``mode="forward"``: ``z = [y0; p] -> (xf, J)`` with ``J = d vec(xf) / d z`` (column-major
      ``vec``), from ``n + n_params`` forward directions (an augmented variational system that
      CasADi hands to CVODES, so the sensitivities are part of the error control).
    ``mode="adjoint"``: ``(z, W) -> (xf, loss, g)`` with ``loss = <W, xf>`` and
      ``g = d loss / d z`` by one reverse sweep (CVODES adjoint with checkpointing).
    """
    key = _key(problem, ts, rtol, atol, max_num_steps, options, mode)
    if key not in _CACHE:
        ca = _ca()
        n, m, K = problem.n, problem.n_params, ts.size
        z = ca.MX.sym("z", n + m)
        if mode == "forward":
            F = _integrator(problem, ts, rtol, atol, max_num_steps, options)
            xf = F(x0=z[:n], p=z[n:])["xf"]  # n x K
            J = ca.jtimes(ca.vec(xf), z, ca.MX.eye(n + m), False)
            fun = ca.Function(f"fwd_{problem.name}", [z], [xf, J])
        elif mode == "adjoint":
            # parameter gradients are backward quadratures: put them under error control too
            opts = {"quad_err_con": True, **(options or {})}
            F = _integrator(problem, ts, rtol, atol, max_num_steps, opts)
            xf = F(x0=z[:n], p=z[n:])["xf"]  # n x K
            W = ca.MX.sym("W", n, K)
            loss = ca.dot(W, xf)
            g = ca.jtimes(loss, z, ca.MX.ones(1, 1), True)
            fun = ca.Function(f"adj_{problem.name}", [z, W], [xf, loss, g])
        else:
            raise ValueError(f"mode must be 'forward' or 'adjoint', got {mode!r}")
        _CACHE[key] = (problem, fun)
    return _CACHE[key][1]


def cvodes_jacobian(
    problem: Problem,
    y0=None,
    params=None,
    ts=None,
    rtol: float = 1e-12,
    atol: float = 1e-12,
    *,
    method: str = "auto",
    max_num_steps: int = DEFAULT_MAX_NUM_STEPS,
    options: dict | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Forward sensitivities: ``(ys, dys_dy0, dys_dparams)``.

    Shapes ``(K, n)``, ``(K, n, n)`` and ``(K, n, n_params)``:
    ``dys_dy0[k, i, j] = d y_i(ts[k]) / d y0_j``, ``dys_dparams[k, i, j] = d y_i(ts[k]) / d p_j``.
    """
    y0, params = _y0_params(problem, y0, params)
    ts = _check_ts(problem, problem.ts() if ts is None else ts)
    options = _merged_options(problem, method, options)
    fun = _derivative_function(problem, ts, rtol, atol, max_num_steps, options, "forward")
    xf, J = fun(np.concatenate([y0, params]))
    n, K = problem.n, ts.size
    ys = np.asarray(xf).reshape(n, K).T.copy()
    # rows of J are vec(xf) (column-major: index k * n + i) -> (K, n, n + m)
    J = np.asarray(J).reshape(K, n, -1)
    return ys, J[:, :, :n].copy(), J[:, :, n:].copy()


def cvodes_gradient(
    problem: Problem,
    y0=None,
    params=None,
    ts=None,
    weights=None,
    rtol: float = 1e-12,
    atol: float = 1e-12,
    *,
    mode: str = "forward",
    method: str = "auto",
    max_num_steps: int = DEFAULT_MAX_NUM_STEPS,
    options: dict | None = None,
) -> tuple[float, np.ndarray, np.ndarray]:
    """``(loss, dloss/dy0, dloss/dparams)`` for ``loss = sum_{k,i} weights[k,i] y_i(ts[k])``.

    ``weights`` has shape ``(len(ts), n)`` (default: all ones); for a loss ``L(ys)`` pass
    ``weights = dL/dys``. ``mode`` is ``"forward"`` (forward sensitivities, the accurate
    reference) or ``"adjoint"`` (CVODES adjoint, a cross-check; use ``rtol = atol = 1e-10`` on
    stiff problems). Returns a float and two 1-d arrays of lengths ``n`` and ``n_params``.
    """
    y0, params = _y0_params(problem, y0, params)
    ts = _check_ts(problem, problem.ts() if ts is None else ts)
    options = _merged_options(problem, method, options)
    n, K = problem.n, ts.size
    weights = np.ones((K, n)) if weights is None else np.asarray(weights, dtype=np.float64)
    if weights.shape != (K, n):
        raise ValueError(f"weights has shape {weights.shape}, expected ({K}, {n})")
    if mode == "forward":
        ys, dy0, dp = cvodes_jacobian(
            problem, y0, params, ts, rtol, atol, max_num_steps=max_num_steps, options=options
        )
        loss = float(np.sum(weights * ys))
        g_y0 = np.einsum("ki,kij->j", weights, dy0)
        g_p = np.einsum("ki,kij->j", weights, dp)
        return loss, g_y0, g_p
    fun = _derivative_function(problem, ts, rtol, atol, max_num_steps, options, mode)
    _, loss, g = fun(np.concatenate([y0, params]), weights.T)
    g = np.asarray(g).reshape(-1)
    return float(loss), g[:n].copy(), g[n:].copy()
