"""Classic ODE test problems, each written once for every backend.

A problem's right-hand side is ``rhs(t, y, p, m)``: ``t`` a scalar time, ``y`` the state vector,
``p`` the parameter vector, and ``m`` a small math namespace (:data:`JNP` or :data:`CASADI`)
that supplies ``sin, cos, exp, log, sqrt, tanh, abs`` and ``stack`` (a list of scalars -> a vector).
Written against ``m``, the same function yields a JAX right-hand side (:func:`jax_rhs`) and a
CasADi symbolic one (:func:`casadi_rhs`), so the CVODES reference in :mod:`tests.cvodes`
integrates exactly the equations the JAX code under test integrates.

``y[i]`` and ``p[i]`` index both a ``jax.Array`` and a CasADi ``SX``/``MX`` column, so the
right-hand sides only ever index, do arithmetic, and call ``m``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

__all__ = [
    "CASADI",
    "JNP",
    "PROBLEMS",
    "Problem",
    "brusselator",
    "casadi_rhs",
    "damped_pendulum",
    "fitzhugh_nagumo",
    "forced_oscillator",
    "get_problem",
    "jax_rhs",
    "linear",
    "lorenz",
    "lotka_volterra",
    "robertson",
    "van_der_pol",
]


# ---------------------------------------------------------------------------------------------
# math namespaces


def _make_jnp_namespace() -> SimpleNamespace:
    import jax.numpy as jnp

    return SimpleNamespace(
        name="jax",
        sin=jnp.sin,
        cos=jnp.cos,
        exp=jnp.exp,
        log=jnp.log,
        sqrt=jnp.sqrt,
        tanh=jnp.tanh,
        abs=jnp.abs,
        stack=lambda xs: jnp.stack([jnp.asarray(x) for x in xs]),
    )


def _make_casadi_namespace() -> SimpleNamespace:
    import casadi as ca

    return SimpleNamespace(
        name="casadi",
        sin=ca.sin,
        cos=ca.cos,
        exp=ca.exp,
        log=ca.log,
        sqrt=ca.sqrt,
        tanh=ca.tanh,
        abs=ca.fabs,
        stack=lambda xs: ca.vertcat(*xs),
    )


class _Lazy:
    """A namespace built on first attribute access (imports jax/casadi only when used)."""

    def __init__(self, factory: Callable[[], SimpleNamespace]):
        self._factory = factory
        self._ns: SimpleNamespace | None = None

    def __getattr__(self, item: str) -> Any:
        if item.startswith("_"):
            raise AttributeError(item)
        if self._ns is None:
            self._ns = self._factory()
        return getattr(self._ns, item)


JNP = _Lazy(_make_jnp_namespace)
"""Math namespace over ``jax.numpy``; ``stack`` returns a 1-d ``jax.Array``."""

CASADI = _Lazy(_make_casadi_namespace)
"""Math namespace over CasADi; ``stack`` returns an ``SX``/``MX`` column."""

NUMPY = SimpleNamespace(
    name="numpy",
    sin=np.sin,
    cos=np.cos,
    exp=np.exp,
    log=np.log,
    sqrt=np.sqrt,
    tanh=np.tanh,
    abs=np.abs,
    stack=lambda xs: np.array(xs, dtype=np.float64),
)
"""Math namespace over NumPy (an independent evaluation of each right-hand side)."""


# ---------------------------------------------------------------------------------------------
# problem container


@dataclass(eq=False)
class Problem:
    """An initial-value problem ``y' = rhs(t, y, p)``, ``y(t0) = y0`` on ``[t0, t1]``.

    Attributes:
        name: identifier (key in :data:`PROBLEMS`).
        rhs: ``rhs(t, y, p, m) -> dy/dt`` written against a math namespace ``m``.
        y0: default initial state, 1-d float64 array.
        params: default parameters, 1-d float64 array.
        t1: default final time.
        stiff: whether an implicit method is needed in practice.
        t0: initial time.
        description: one line about the problem.
    """

    name: str
    rhs: Callable[..., Any]
    y0: np.ndarray
    params: np.ndarray
    t1: float
    stiff: bool = False
    t0: float = 0.0
    description: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.y0 = np.asarray(self.y0, dtype=np.float64).reshape(-1)
        self.params = np.asarray(self.params, dtype=np.float64).reshape(-1)

    @property
    def n(self) -> int:
        """State dimension."""
        return self.y0.shape[0]

    @property
    def n_params(self) -> int:
        """Number of parameters."""
        return self.params.shape[0]

    def ts(self, num: int = 11) -> np.ndarray:
        """``num`` equally spaced save times on ``[t0, t1]``."""
        return np.linspace(self.t0, self.t1, num)

    def numpy_rhs(self) -> Callable[[float, np.ndarray, np.ndarray], np.ndarray]:
        """``f(t, y, p) -> np.ndarray`` evaluated through CasADi (for scipy's ``solve_ivp``)."""
        fun, _ = _casadi_numeric(self)
        return lambda t, y, p: np.asarray(fun(t, y, p)).reshape(-1)

    def numpy_jac(self) -> Callable[[float, np.ndarray, np.ndarray], np.ndarray]:
        """``J(t, y, p) = d rhs / d y`` as a dense array, evaluated through CasADi."""
        _, jac = _casadi_numeric(self)
        return lambda t, y, p: np.asarray(jac(t, y, p))


def jax_rhs(problem: Problem) -> Callable[[Any, Any, Any], Any]:
    """The problem's right-hand side as ``f(t, y, args) -> dy/dt`` with ``args`` the params."""

    def f(t, y, args):
        return problem.rhs(t, y, args, JNP)

    f.__name__ = f"{problem.name}_rhs"
    return f


def casadi_rhs(problem: Problem, sym: str = "SX"):
    """CasADi symbols ``(t, x, p, ode)`` for the problem; ``sym`` is ``"SX"`` or ``"MX"``."""
    import casadi as ca

    kind = getattr(ca, sym)
    t = kind.sym("t")
    x = kind.sym("x", problem.n)
    p = kind.sym("p", problem.n_params)
    ode = problem.rhs(t, x, p, CASADI)
    return t, x, p, ode


_NUMERIC_CACHE: dict[int, tuple] = {}


def _casadi_numeric(problem: Problem):
    key = id(problem)
    if key not in _NUMERIC_CACHE:
        import casadi as ca

        t, x, p, ode = casadi_rhs(problem)
        fun = ca.Function(f"{problem.name}_f", [t, x, p], [ode])
        jac = ca.Function(f"{problem.name}_J", [t, x, p], [ca.jacobian(ode, x)])
        _NUMERIC_CACHE[key] = (problem, fun, jac)
    return _NUMERIC_CACHE[key][1:]


# ---------------------------------------------------------------------------------------------
# right-hand sides


def _lotka_volterra(t, y, p, m):
    # prey x, predator z: x' = a x - b x z ; z' = -c z + d x z
    x, z = y[0], y[1]
    a, b, c, d = p[0], p[1], p[2], p[3]
    return m.stack([a * x - b * x * z, -c * z + d * x * z])


def _damped_pendulum(t, y, p, m):
    # theta'' = -damping theta' - (g/L) sin(theta)
    th, om = y[0], y[1]
    damping, g_over_l = p[0], p[1]
    return m.stack([om, -damping * om - g_over_l * m.sin(th)])


def _lorenz(t, y, p, m):
    x, v, z = y[0], y[1], y[2]
    sigma, rho, beta = p[0], p[1], p[2]
    return m.stack([sigma * (v - x), x * (rho - z) - v, x * v - beta * z])


def _fitzhugh_nagumo(t, y, p, m):
    # v' = v - v^3/3 - w + I ; w' = (v + a - b w) / tau
    v, w = y[0], y[1]
    a, b, tau, current = p[0], p[1], p[2], p[3]
    return m.stack([v - v * v * v / 3.0 - w + current, (v + a - b * w) / tau])


def _brusselator(t, y, p, m):
    # x' = A + x^2 z - (B + 1) x ; z' = B x - x^2 z
    x, z = y[0], y[1]
    a, b = p[0], p[1]
    return m.stack([a + x * x * z - (b + 1.0) * x, b * x - x * x * z])


def _forced_oscillator(t, y, p, m):
    # y'' + c y' + k y = A sin(w t)  (explicit time dependence)
    x, v = y[0], y[1]
    c, k, amp, w = p[0], p[1], p[2], p[3]
    return m.stack([v, -c * v - k * x + amp * m.sin(w * t)])


def _robertson(t, y, p, m):
    y1, y2, y3 = y[0], y[1], y[2]
    k1, k2, k3 = p[0], p[1], p[2]
    return m.stack(
        [
            -k1 * y1 + k3 * y2 * y3,
            k1 * y1 - k3 * y2 * y3 - k2 * y2 * y2,
            k2 * y2 * y2,
        ]
    )


def _van_der_pol(t, y, p, m):
    # x'' = mu (1 - x^2) x' - x, as a first-order system
    x, v = y[0], y[1]
    mu = p[0]
    return m.stack([v, mu * (1.0 - x * x) * v - x])


def _make_linear_rhs(n: int):
    def rhs(t, y, p, m):
        # y' = A y with A = p.reshape(n, n) (row-major)
        return m.stack([sum(p[i * n + j] * y[j] for j in range(n)) for i in range(n)])

    return rhs


# ---------------------------------------------------------------------------------------------
# factories


def lotka_volterra(a=1.5, b=1.0, c=3.0, d=1.0, y0=(1.0, 1.0), t1=10.0) -> Problem:
    """Predator–prey, params ``(a, b, c, d)``: ``x' = a x - b x z``, ``z' = -c z + d x z``."""
    return Problem(
        "lotka_volterra",
        _lotka_volterra,
        y0,
        [a, b, c, d],
        t1,
        description="Lotka–Volterra predator–prey",
    )


def damped_pendulum(damping=0.25, g_over_l=5.0, y0=(1.0, 0.0), t1=10.0) -> Problem:
    """Pendulum ``theta'' = -damping theta' - (g/L) sin theta``, params ``(damping, g/L)``."""
    return Problem(
        "damped_pendulum",
        _damped_pendulum,
        y0,
        [damping, g_over_l],
        t1,
        description="damped nonlinear pendulum",
    )


def lorenz(sigma=10.0, rho=28.0, beta=8.0 / 3.0, y0=(1.0, 1.0, 1.0), t1=1.0) -> Problem:
    """Lorenz system, params ``(sigma, rho, beta)``; keep ``t1 <= 1`` (chaos)."""
    return Problem("lorenz", _lorenz, y0, [sigma, rho, beta], t1, description="Lorenz '63")


def fitzhugh_nagumo(a=0.7, b=0.8, tau=12.5, current=0.5, y0=(-1.0, 1.0), t1=20.0) -> Problem:
    """FitzHugh–Nagumo neuron, params ``(a, b, tau, I)``."""
    return Problem(
        "fitzhugh_nagumo",
        _fitzhugh_nagumo,
        y0,
        [a, b, tau, current],
        t1,
        description="FitzHugh–Nagumo",
    )


def brusselator(a=1.0, b=3.0, y0=(1.5, 3.0), t1=10.0) -> Problem:
    """Two-species Brusselator ODE, params ``(A, B)`` (limit cycle for ``B > 1 + A^2``)."""
    return Problem("brusselator", _brusselator, y0, [a, b], t1, description="Brusselator")


def forced_oscillator(c=0.1, k=4.0, amp=1.0, w=1.5, y0=(1.0, 0.0), t1=10.0) -> Problem:
    """``y'' + c y' + k y = A sin(w t)``, params ``(c, k, A, w)``; explicitly time dependent."""
    return Problem(
        "forced_oscillator",
        _forced_oscillator,
        y0,
        [c, k, amp, w],
        t1,
        description="forced damped linear oscillator (explicit t)",
    )


def robertson(k1=0.04, k2=3e7, k3=1e4, y0=(1.0, 0.0, 0.0), t1=100.0) -> Problem:
    """Robertson chemical kinetics (stiff), params ``(k1, k2, k3)``."""
    return Problem(
        "robertson",
        _robertson,
        y0,
        [k1, k2, k3],
        t1,
        stiff=True,
        description="Robertson chemical kinetics",
    )


def van_der_pol(mu=1000.0, y0=(2.0, 0.0), t1=None, name=None) -> Problem:
    """Van der Pol ``x'' = mu (1 - x^2) x' - x``, param ``(mu,)``; stiff for large ``mu``.

    Defaults: ``t1 = 500`` for ``mu >= 100`` (stiff), else ``t1 = 10``.
    """
    stiff = mu >= 100.0
    if t1 is None:
        t1 = 500.0 if stiff else 10.0
    if name is None:
        name = "van_der_pol_stiff" if stiff else "van_der_pol"
    return Problem(
        name, _van_der_pol, y0, [mu], t1, stiff=stiff, description=f"Van der Pol, mu={mu:g}"
    )


def linear(a=None, y0=(1.0, -0.5, 0.25), t1=2.0) -> Problem:
    """Linear ``y' = A y`` with params ``A.ravel()`` (row-major); closed form ``expm(A t) y0``."""
    if a is None:
        a = np.array([[-0.5, 1.0, 0.0], [-1.0, -0.3, 0.2], [0.1, 0.0, -0.8]])
    a = np.asarray(a, dtype=np.float64)
    n = a.shape[0]
    if a.shape != (n, n) or len(y0) != n:
        raise ValueError("A must be square and match y0")
    return Problem(
        "linear",
        _make_linear_rhs(n),
        y0,
        a.ravel(),
        t1,
        description="linear constant-coefficient system",
        extra={"n": n},
    )


PROBLEMS: dict[str, Problem] = {
    p.name: p
    for p in (
        lotka_volterra(),
        damped_pendulum(),
        lorenz(),
        fitzhugh_nagumo(),
        brusselator(),
        forced_oscillator(),
        robertson(),
        van_der_pol(mu=1.0),
        van_der_pol(mu=1000.0),
        linear(),
    )
}
"""All default problems by name."""

NONSTIFF = [name for name, p in PROBLEMS.items() if not p.stiff]
STIFF = [name for name, p in PROBLEMS.items() if p.stiff]


def get_problem(name: str) -> Problem:
    """The default problem called ``name``."""
    return PROBLEMS[name]
