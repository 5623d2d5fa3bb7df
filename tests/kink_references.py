"""CVODES reference gradients for two right-hand sides with kinks (``abs``, ReLU).

* seed 000 (``../shared/seeds/000_*.txt``): ``ca = [c; a]``, ``a`` of size 32, parameters ``Z``
  (16 x 32), ``abs`` in the rates; :func:`seed000_cvodes_gradient` gives ``d ys[index][0] / dZ``.
* a ReLU MLP vector field ``y' = W2 relu(W1 y + b1) + b2`` on ``R^2`` with fixed random weights
  (:func:`relu_mlp_params`, :func:`relu_mlp_f`); :func:`relu_mlp_cvodes_gradient` gives the
  gradient of ``sum(ys**2)`` over 11 saves with respect to every weight and ``y0``.

A kink makes the right-hand side continuous but its Jacobian not, and CVODES integrated straight
across one loses accuracy there: on seed 000 at ``rtol = atol = 1e-12`` its forward and adjoint
gradients differ by 6e-7 and are 7e-8 off the piecewise result below. So the integration is split
at the kinks: SciPy's DOP853 (an independent code) locates every zero crossing of the switching
functions (``Ka_j`` for seed 000, the hidden pre-activations for the MLP), a Newton step moves
each onto the CVODES trajectory, and between two crossings each ``abs``/``relu`` is replaced by
``sign * x``, a smooth right-hand side that CVODES integrates to full accuracy. Gradients chain
through the pieces with the crossing times held fixed, which is exact here: the right-hand side
is continuous across a switching surface, so the jump term ``(f+ - f-) dtau/dp`` of the
sensitivities vanishes.

Each piece is a :class:`reference_problems.Problem` (``t0`` at the crossing) run by
:mod:`tests.cvodes`. Measured at ``rtol = atol = 1e-12`` (2 CPU cores):

* seed 000, 5 crossings: CVODES adjoint mode (the default here) takes ~3 s per ``index``,
  forward sensitivities (545 directions) ~13 s for all saves at once; the two agree to 8e-10,
  and both move by < 1e-9 at 1e-13.
* ReLU MLP, 6 crossings: forward (the default) and adjoint take ~0.6 s each and agree to 1e-10;
  1e-12 against 1e-13 differs by 7e-10.

Results are cached per process, keyed on the parameters' bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

try:  # imported as ``tests.kink_references``
    from .cvodes import cvodes_gradient, cvodes_jacobian, cvodes_solve
    from .reference_problems import NUMPY, Problem
except ImportError:  # imported as ``kink_references`` with ``tests/`` on sys.path
    from cvodes import cvodes_gradient, cvodes_jacobian, cvodes_solve
    from reference_problems import NUMPY, Problem

__all__ = [
    "RELU_HIDDEN",
    "RELU_TS",
    "RELU_Y0",
    "SEED_M",
    "SEED_N",
    "SEED_TS",
    "kink_times",
    "relu_mlp_cvodes_gradient",
    "relu_mlp_f",
    "relu_mlp_loss_weights",
    "relu_mlp_params",
    "relu_mlp_problem",
    "seed000_cvodes_gradient",
    "seed000_f_flat",
    "seed000_f_tree",
    "seed000_problem",
    "seed000_z",
]

#: SciPy DOP853 tolerance for locating crossings: as tight as it allows, so that the Newton step
#: of :func:`_refine` starts within ~1e-10 (on seed 000 a crossing 1e-9 late moves the gradient
#: by 3e-9).
DETECT_TOL = 1e-13


# ---------------------------------------------------------------------------------------------
# piecewise-smooth machinery


@dataclass(frozen=True)
class Kinked:
    """``y' = rhs(t, y, p)`` whose only non-smoothness is in ``abs``/``relu`` of ``switch``.

    ``make_rhs(signs)`` returns a :class:`Problem` right-hand side ``rhs(t, y, p, m)``:
    with ``signs=None`` the true one, else the smooth one valid where
    ``sign(switch(y, p)) == signs``. ``switch(y, p)`` evaluates the switching functions in NumPy.
    """

    name: str
    make_rhs: Callable
    switch: Callable[[np.ndarray, np.ndarray], np.ndarray]
    t0: float
    t1: float


def _problem(k: Kinked, y0, params, signs=None, t0=None, t1=None) -> Problem:
    return Problem(
        k.name,
        k.make_rhs(signs),
        y0,
        params,
        k.t1 if t1 is None else t1,
        t0=k.t0 if t0 is None else t0,
    )


def _detect(k: Kinked, y0, params):
    from scipy.integrate import solve_ivp

    params = np.asarray(params, dtype=np.float64).reshape(-1)
    y0 = np.asarray(y0, dtype=np.float64)
    f = _problem(k, y0, params).numpy_rhs()
    n_switch = np.asarray(k.switch(y0, params)).size
    events = [lambda t, y, j=j: k.switch(y, params)[j] for j in range(n_switch)]
    sol = solve_ivp(
        lambda t, y: f(t, y, params),
        (k.t0, k.t1),
        y0,
        method="DOP853",
        rtol=DETECT_TOL,
        atol=DETECT_TOL,
        events=events,
        dense_output=True,
    )
    if sol.status != 0:
        raise RuntimeError(f"{k.name}: kink detection failed: {sol.message}")
    kinks = sorted((float(t), j) for j, te in enumerate(sol.t_events) for t in te)
    return kinks, sol.sol


def kink_times(k: Kinked, y0, params) -> list[tuple[float, int]]:
    """Every ``(t, j)`` in ``(t0, t1)`` at which ``switch(y, p)[j]`` changes sign, sorted."""
    return _detect(k, y0, params)[0]


def _refine(k: Kinked, prob: Problem, j: int, t: float, y: np.ndarray) -> float:
    """One Newton step on ``switch(y(t), p)[j] = 0`` from the CVODES state ``y`` at ``t``."""
    p = prob.params
    f = np.asarray(prob.rhs(t, y, p, NUMPY))
    h = 1e-6 / max(1.0, float(np.max(np.abs(f))))
    dg = (k.switch(y + h * f, p)[j] - k.switch(y - h * f, p)[j]) / (2 * h)
    return t - k.switch(y, p)[j] / dg


def _pieces(k: Kinked, y0, params, ts, rtol, atol):
    """Split ``[t0, t1]`` at the kinks; per piece ``(problem, seg_ts, loc)``.

    ``seg_ts`` is the piece's output grid (the saves inside it plus its end) and ``loc`` the
    positions of those saves in it. The states at the piece starts come from a CVODES pass
    without sensitivities, the sign patterns from DOP853's dense output mid-piece.

    DOP853 and CVODES states differ by ~1e-11, which moves a crossing by up to ~3e-10 and the
    seed-000 gradient by ~1e-9; so each crossing time is moved by a Newton step to where the
    CVODES state crosses (then ``|switch| < 1e-14``).
    """
    ts = np.asarray(ts, dtype=np.float64)
    params = np.asarray(params, dtype=np.float64).reshape(-1)
    kinks, dense = _detect(k, y0, params)
    ends = [t for t, _ in kinks] + [k.t1]
    pieces = []
    a, y = k.t0, np.asarray(y0, dtype=np.float64)
    for i, b in enumerate(ends):
        if b <= a:
            raise RuntimeError(f"{k.name}: two kinks at one time {a}")
        inside = (ts > a) & (ts <= b) if i else (ts >= a) & (ts <= b)
        saves = ts[inside]
        signs = np.sign(k.switch(dense(0.5 * (a + b)), params))
        prob = _problem(k, y, params, signs=signs, t0=a, t1=b)
        ys = cvodes_solve(prob, ts=np.unique(np.r_[saves, b]), rtol=rtol, atol=atol)
        if i < len(kinks):
            j = kinks[i][1]
            b_new = _refine(k, prob, j, b, ys[-1])
            # keep every save on the side DOP853 put it, and the crossings in order
            lo = max(a, saves[-1]) if saves.size else a
            hi = min(ts[ts > b][0] if np.any(ts > b) else np.inf, ends[i + 1])
            if lo < b_new < hi and b_new != b:
                b = prob.t1 = b_new
                ys = cvodes_solve(prob, ts=np.unique(np.r_[saves, b]), rtol=rtol, atol=atol)
        seg_ts = np.unique(np.r_[saves, b])
        # a piece's sign pattern must hold up to its end, where only the crossing one reaches 0
        s_end = k.switch(ys[-1], params) * signs
        if i < len(kinks):
            s_end[kinks[i][1]] = 1.0
        if np.any(s_end <= 0):
            raise RuntimeError(f"{k.name}: a switching function changed sign inside [{a}, {b}]")
        pieces.append((prob, seg_ts, np.searchsorted(seg_ts, saves)))
        a, y = b, ys[-1]
    return pieces


def piecewise_jacobian(k: Kinked, y0, params, ts, rtol=1e-12, atol=1e-12):
    """``(ys, dys/dy0, dys/dparams)`` at ``ts`` by forward sensitivities chained over pieces."""
    y0 = np.asarray(y0, dtype=np.float64)
    params = np.asarray(params, dtype=np.float64).reshape(-1)
    ts = np.asarray(ts, dtype=np.float64)
    n, n_p = y0.size, params.size
    ys = np.empty((ts.size, n))
    dy0 = np.empty((ts.size, n, n))
    dp = np.empty((ts.size, n, n_p))
    s_y, s_p = np.eye(n), np.zeros((n, n_p))  # d y(piece start) / d (y0, params)
    pieces = _pieces(k, y0, params, ts, rtol, atol)
    for prob, seg_ts, loc in pieces:
        ys_k, j_y, j_p = cvodes_jacobian(prob, ts=seg_ts, rtol=rtol, atol=atol)
        out = np.searchsorted(ts, seg_ts[loc])
        ys[out] = ys_k[loc]
        dy0[out] = j_y[loc] @ s_y
        dp[out] = j_y[loc] @ s_p + j_p[loc]
        s_y, s_p = j_y[-1] @ s_y, j_y[-1] @ s_p + j_p[-1]
    return ys, dy0, dp


def piecewise_solve(k: Kinked, y0, params, ts, rtol=1e-12, atol=1e-12) -> np.ndarray:
    """The states at ``ts``, integrated piece by piece."""
    ts = np.asarray(ts, dtype=np.float64)
    ys = np.empty((ts.size, np.asarray(y0).size))
    pieces = _pieces(k, y0, params, ts, rtol, atol)
    for prob, seg_ts, loc in pieces:
        ys[np.searchsorted(ts, seg_ts[loc])] = cvodes_solve(prob, ts=seg_ts, rtol=rtol, atol=atol)[
            loc
        ]
    return ys


def piecewise_gradient(k: Kinked, y0, params, ts, weights, rtol=1e-12, atol=1e-12, mode="forward"):
    """``(loss, dloss/dy0, dloss/dparams)`` for ``loss = sum(weights * ys)``.

    ``mode="forward"`` contracts :func:`piecewise_jacobian`; ``mode="adjoint"`` runs CVODES's
    adjoint piece by piece, last first, the adjoint state at a piece start becoming the weight
    of the previous piece's end.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if mode == "forward":
        ys, dy0, dp = piecewise_jacobian(k, y0, params, ts, rtol, atol)
        return (
            float(np.sum(weights * ys)),
            np.einsum("ki,kij->j", weights, dy0),
            np.einsum("ki,kij->j", weights, dp),
        )
    if mode != "adjoint":
        raise ValueError(f"mode must be 'forward' or 'adjoint', got {mode!r}")
    ts = np.asarray(ts, dtype=np.float64)
    params = np.asarray(params, dtype=np.float64).reshape(-1)
    pieces = _pieces(k, y0, params, ts, rtol, atol)
    lam = np.zeros(np.asarray(y0).size)
    g_p = np.zeros(params.size)
    loss = 0.0
    for prob, seg_ts, loc in reversed(pieces):
        w = np.zeros((seg_ts.size, prob.n))
        w[loc] = weights[np.searchsorted(ts, seg_ts[loc])]
        loss += float(np.sum(w * cvodes_solve(prob, ts=seg_ts, rtol=rtol, atol=atol)))
        w[-1] += lam
        _, lam, g = cvodes_gradient(
            prob, ts=seg_ts, weights=w, rtol=rtol, atol=atol, mode="adjoint"
        )
        g_p += g
    return loss, lam, g_p


# ---------------------------------------------------------------------------------------------
# seed 000

SEED_N, SEED_M = 16, 32
SEED_TS = np.linspace(0.0, 2.0, 21)


def seed000_z() -> np.ndarray:
    """The seed's ``Z`` (16 x 32), as ``seed_z`` in ``tests/test_continuous_adjoints.py``."""
    return np.random.default_rng(1234).standard_normal((SEED_N, SEED_M))


def _seed_rates(a, z):
    import jax.numpy as jnp

    a_unit = a / jnp.sum(a)
    w_unit = z @ a_unit
    ka_unit = z.T @ w_unit
    z_unit = jnp.dot(jnp.abs(ka_unit), a_unit)
    aka = a * ka_unit / z_unit
    return jnp.sum(aka) / SEED_M, -jnp.abs(aka)


def seed000_f_flat(t, ca, z):
    """The seed's right-hand side in ``jax.numpy``, ``ca = [c; a]`` one vector."""
    import jax.numpy as jnp

    dc, da = _seed_rates(ca[1:], z)
    return jnp.concatenate([dc[None], da])


def seed000_f_tree(t, ca, z):
    """The same with the pytree state ``ca = (c, a)``."""
    return _seed_rates(ca[1], z)


@functools.cache
def seed000_value_and_grad(adjoint, form="flat", index=-1, dtype_name="float64", tol=1e-10):
    """The jitted ``z -> (L, dL/dz)`` of odegrad's solve of the seed, ``L = ys[index][0]``: Tsit5
    at ``rtol = atol = tol``, saves at ``SEED_TS``, ``form`` "flat" (``[c; a]``) or "tree"
    (``(c, a)``). Cached per argument set, so tests share compiled functions."""
    import jax
    import jax.numpy as jnp

    import odegrad as og

    dtype = jnp.dtype(dtype_name)
    ts = jnp.asarray(SEED_TS, dtype)
    if form == "flat":
        f, y0 = seed000_f_flat, jnp.concatenate([jnp.zeros(1, dtype), jnp.ones(SEED_M, dtype)])
    else:
        f, y0 = seed000_f_tree, (jnp.zeros((), dtype), jnp.ones(SEED_M, dtype))

    def cost(z):
        sol = og.solve(
            f,
            y0,
            (jnp.asarray(0.0, dtype), jnp.asarray(2.0, dtype)),
            z,
            solver=og.Tsit5(),
            step=og.Adaptive(rtol=tol, atol=tol),
            saveat=og.SaveAt(ts=ts),
            adjoint=adjoint,
            max_steps=100_000,
        )
        return sol.ys[index][0] if form == "flat" else sol.ys[0][index]

    return jax.jit(jax.value_and_grad(cost))


def _seed_make_rhs(signs):
    # |Ka_j| and |a_j Ka_j / z| share the sign of Ka_j (a > 0 and z > 0 on the trajectory)
    def rhs(t, y, p, m):
        a = [y[1 + j] for j in range(SEED_M)]
        total = sum(a)
        a_unit = [aj / total for aj in a]
        w = [sum(p[i * SEED_M + j] * a_unit[j] for j in range(SEED_M)) for i in range(SEED_N)]
        ka = [sum(p[i * SEED_M + j] * w[i] for i in range(SEED_N)) for j in range(SEED_M)]

        def abs_j(x, j):
            return m.abs(x) if signs is None else float(signs[j]) * x

        z = sum(abs_j(ka[j], j) * a_unit[j] for j in range(SEED_M))
        aka = [a[j] * ka[j] / z for j in range(SEED_M)]
        return m.stack([sum(aka) / SEED_M] + [-abs_j(aka[j], j) for j in range(SEED_M)])

    return rhs


def _seed_switch(y, p):
    a = y[1:]
    zmat = p.reshape(SEED_N, SEED_M)
    return zmat.T @ (zmat @ (a / np.sum(a)))


SEED000 = Kinked("seed000", _seed_make_rhs, _seed_switch, 0.0, 2.0)


def seed000_problem(z=None) -> Problem:
    """Seed 000 as a :class:`Problem` (``abs`` kinks and all; params ``Z.ravel()``)."""
    z = seed000_z() if z is None else np.asarray(z, dtype=np.float64)
    return _problem(SEED000, _seed_y0(), z.ravel())


def _seed_y0() -> np.ndarray:
    return np.r_[0.0, np.ones(SEED_M)]


@functools.cache
def _seed000_jacobian(z_bytes: bytes, rtol: float, atol: float):
    z = np.frombuffer(z_bytes, dtype=np.float64)
    ys, _, dp = piecewise_jacobian(SEED000, _seed_y0(), z, SEED_TS, rtol, atol)
    return ys, dp


@functools.cache
def _seed000_adjoint(z_bytes: bytes, index: int, rtol: float, atol: float):
    z = np.frombuffer(z_bytes, dtype=np.float64)
    weights = np.zeros((SEED_TS.size, 1 + SEED_M))
    weights[index, 0] = 1.0
    value, _, g = piecewise_gradient(
        SEED000, _seed_y0(), z, SEED_TS, weights, rtol, atol, "adjoint"
    )
    return value, g


def seed000_cvodes_gradient(
    z: np.ndarray | None = None,
    index: int = -1,
    rtol: float = 1e-12,
    atol: float = 1e-12,
    *,
    mode: str = "adjoint",
) -> tuple[float, np.ndarray]:
    """``(L, dL/dZ)`` for ``L = ys[index][0]``, the saves at ``SEED_TS`` (0, 0.1, ..., 2).

    ``z`` (default :func:`seed000_z`) is taken as float64. ``mode="forward"`` (forward
    sensitivities, the reference) gives every save from one solve, so all ``index`` values of
    one ``z`` share it; ``mode="adjoint"`` (CVODES adjoint) is a faster cross-check. Cached.
    """
    z = seed000_z() if z is None else np.asarray(z, dtype=np.float64)
    if z.shape != (SEED_N, SEED_M):
        raise ValueError(f"z has shape {z.shape}, expected ({SEED_N}, {SEED_M})")
    z_bytes = np.ascontiguousarray(z).tobytes()
    if mode == "forward":
        ys, dp = _seed000_jacobian(z_bytes, float(rtol), float(atol))
        value, g = float(ys[index, 0]), dp[index, 0]
    elif mode == "adjoint":
        index = index % SEED_TS.size
        value, g = _seed000_adjoint(z_bytes, index, float(rtol), float(atol))
    else:
        raise ValueError(f"mode must be 'forward' or 'adjoint', got {mode!r}")
    return value, g.reshape(SEED_N, SEED_M).copy()


# ---------------------------------------------------------------------------------------------
# ReLU MLP vector field

RELU_HIDDEN = 16
RELU_Y0 = np.array([1.0, -0.5])
RELU_TS = np.linspace(0.0, 5.0, 11)
_RELU_KEYS = ("W1", "b1", "W2", "b2")


def relu_mlp_params() -> dict[str, np.ndarray]:
    """``W1 (16, 2), b1 (16,), W2 (2, 16), b2 (2,)``: standard normal from ``default_rng(0)``
    (drawn in that order), each scaled by ``1/sqrt(fan_in)``.

    From ``RELU_Y0`` on ``[0, 5]`` six hidden units change sign (at t ~ 0.90, 1.10, 1.17, 2.53,
    4.43, 4.58) and ``y`` drifts from ``(1, -0.5)`` to about ``(-0.6, 5.8)``.
    """
    rng = np.random.default_rng(0)
    h = RELU_HIDDEN
    w1 = rng.standard_normal((h, 2)) / np.sqrt(2)
    b1 = rng.standard_normal(h) / np.sqrt(2)
    w2 = rng.standard_normal((2, h)) / np.sqrt(h)
    b2 = rng.standard_normal(2) / np.sqrt(h)
    return {"W1": w1, "b1": b1, "W2": w2, "b2": b2}


def relu_mlp_f(t, y, params):
    """``W2 relu(W1 y + b1) + b2`` in ``jax.numpy`` (``params`` as :func:`relu_mlp_params`)."""
    import jax

    return params["W2"] @ jax.nn.relu(params["W1"] @ y + params["b1"]) + params["b2"]


def _relu_flat(params) -> np.ndarray:
    return np.concatenate([np.asarray(params[key], dtype=np.float64).ravel() for key in _RELU_KEYS])


def _relu_unflat(flat: np.ndarray) -> dict[str, np.ndarray]:
    h = RELU_HIDDEN
    shapes = {"W1": (h, 2), "b1": (h,), "W2": (2, h), "b2": (2,)}
    out, start = {}, 0
    for key in _RELU_KEYS:
        size = int(np.prod(shapes[key]))
        out[key] = flat[start : start + size].reshape(shapes[key]).copy()
        start += size
    return out


def _relu_make_rhs(signs):
    # relu(x) = (x + |x|) / 2 exactly in floating point; on a piece it is x or 0
    h = RELU_HIDDEN
    o_b1, o_w2, o_b2 = 2 * h, 3 * h, 5 * h

    def rhs(t, y, p, m):
        pre = [p[2 * i] * y[0] + p[2 * i + 1] * y[1] + p[o_b1 + i] for i in range(h)]
        if signs is None:
            act = [(x + m.abs(x)) / 2 for x in pre]
        else:
            act = [x if signs[i] > 0 else 0.0 * x for i, x in enumerate(pre)]
        return m.stack(
            [sum(p[o_w2 + r * h + i] * act[i] for i in range(h)) + p[o_b2 + r] for r in range(2)]
        )

    return rhs


def _relu_switch(y, p):
    h = RELU_HIDDEN
    return p[: 2 * h].reshape(h, 2) @ y + p[2 * h : 3 * h]


RELU_MLP = Kinked("relu_mlp", _relu_make_rhs, _relu_switch, 0.0, 5.0)


def relu_mlp_problem(params=None, y0=None) -> Problem:
    """The MLP field as a :class:`Problem` (params flat: ``W1, b1, W2, b2`` row-major)."""
    params = relu_mlp_params() if params is None else params
    y0 = RELU_Y0 if y0 is None else y0
    return _problem(RELU_MLP, y0, _relu_flat(params))


def relu_mlp_loss_weights(ys: np.ndarray) -> np.ndarray:
    """``dL/dys`` for ``L = sum(ys**2)``."""
    return 2.0 * np.asarray(ys)


@functools.cache
def _relu_gradient(flat_bytes: bytes, y0_bytes: bytes, rtol: float, atol: float, mode: str):
    flat = np.frombuffer(flat_bytes, dtype=np.float64)
    y0 = np.frombuffer(y0_bytes, dtype=np.float64)
    ys = piecewise_solve(RELU_MLP, y0, flat, RELU_TS, rtol, atol)
    _, g_y0, g_p = piecewise_gradient(
        RELU_MLP, y0, flat, RELU_TS, relu_mlp_loss_weights(ys), rtol, atol, mode
    )
    return float(np.sum(ys**2)), g_y0, g_p


def relu_mlp_cvodes_gradient(
    params=None, y0=None, rtol: float = 1e-12, atol: float = 1e-12, *, mode: str = "forward"
) -> tuple[float, dict[str, np.ndarray]]:
    """``(L, grads)`` for ``L = sum(ys**2)`` over the saves ``RELU_TS`` (11 times on [0, 5]).

    ``grads`` has the keys of :func:`relu_mlp_params` plus ``"y0"``. ``y0`` defaults to
    ``RELU_Y0``. ``mode`` as in :func:`piecewise_gradient`.
    """
    params = relu_mlp_params() if params is None else params
    y0 = RELU_Y0 if y0 is None else np.asarray(y0, dtype=np.float64)
    flat = np.ascontiguousarray(_relu_flat(params))
    value, g_y0, g_p = _relu_gradient(
        flat.tobytes(), np.ascontiguousarray(y0).tobytes(), float(rtol), float(atol), mode
    )
    grads = _relu_unflat(g_p)
    grads["y0"] = g_y0.copy()
    return value, grads
