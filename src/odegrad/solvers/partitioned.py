"""Partitioned (symplectic) methods: ``y = (u, v)``, ``du/dt = f_u(t, v)``, ``dv/dt = f_v(t, u)``.

These take ``f = (f_u, f_v)``. They have no error estimate (use ``og.Fixed`` or ``og.StepTo``) and
interpolate linearly inside a step, which matches their order (at most 2).
"""

from __future__ import annotations

import jax

from .base import AbstractSolver, StepResult


def _axpy(a, x, y):
    return jax.tree.map(lambda xi, yi: yi + a * xi, x, y)


class _Partitioned(AbstractSolver):
    partitioned = True

    def interpolate(self, dense, theta):
        (u0, v0), (u1, v1) = dense
        lerp = lambda a, b: jax.tree.map(lambda x, y: x + theta * (y - x), a, b)
        return (lerp(u0, u1), lerp(v0, v1))


class SemiImplicitEuler(_Partitioned):
    """Symplectic Euler: ``u1 = u0 + dt f_u(t0, v0)``, then ``v1 = v0 + dt f_v(t1, u1)``. Order 1.

    Example:
        >>> og.solve((f_u, f_v), (u0, v0), (0.0, 1.0), solver=og.SemiImplicitEuler(),
        ...          step=og.Fixed(1e-3))
    """

    order = 1
    step_evals = 1

    def init(self, f, t0, y0, args):
        return ()

    def step(self, f, t0, dt, y0, args, state):
        f_u, f_v = f
        u0, v0 = y0
        u1 = _axpy(dt, f_u(t0, v0, args), u0)
        v1 = _axpy(dt, f_v(t0 + dt, u1, args), v0)
        y1 = (u1, v1)
        return StepResult(y1, None, (y0, y1), ())


class Leapfrog(_Partitioned):
    """Velocity Verlet (Störmer–Verlet), order 2, symplectic and time-reversible.

    ``v_half = v0 + dt/2 f_v(t0, u0)``, ``u1 = u0 + dt f_u(t0 + dt/2, v_half)``,
    ``v1 = v_half + dt/2 f_v(t1, u1)``; ``f_v(t1, u1)`` is carried to the next step.

    Example:
        >>> og.solve((lambda t, v, a: v, lambda t, u, a: -u), (1.0, 0.0), (0.0, 10.0),
        ...          solver=og.Leapfrog(), step=og.Fixed(0.01))
    """

    order = 2
    init_evals = 1
    step_evals = 1

    def init(self, f, t0, y0, args):
        return f[1](t0, y0[0], args)

    def step(self, f, t0, dt, y0, args, accel0):
        f_u, f_v = f
        u0, v0 = y0
        v_half = _axpy(0.5 * dt, accel0, v0)
        u1 = _axpy(dt, f_u(t0 + 0.5 * dt, v_half, args), u0)
        accel1 = f_v(t0 + dt, u1, args)
        v1 = _axpy(0.5 * dt, accel1, v_half)
        y1 = (u1, v1)
        return StepResult(y1, None, (y0, y1), accel1)
