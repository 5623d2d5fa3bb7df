"""Implicit solvers in float32 near its limit: steps, evaluations, Jacobians and error.

Robertson and a Van der Pol oscillator (``eps = 1e-3``) in float32 with Kvaerno5, Kvaerno3
(with and without dense Jacobian reuse, ``jacobian_reuse_rate``) and Rodas5P. The error is the
RMS of ``(y - y_ref) / (atol + rtol |y_ref|)`` at the end, ``y_ref`` a float64 Rodas5P solve at
rtol 1e-10; Jacobians are counted by a callback around the solvers' Jacobian. The first row is
the case where keeping t0's Jacobian used to stall Kvaerno5 (3000 steps to t = 4.5 of 100).

Run: ``python benchmarks/float32_stiff.py``
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import odegrad as og
from odegrad.solvers import _linear

jax.config.update("jax_enable_x64", True)

_count = [0]
_jacobian = _linear.jacobian


def _counted(f, x):
    jax.debug.callback(lambda: _count.__setitem__(0, _count[0] + 1))
    return _jacobian(f, x)


def robertson(t, y, args):
    return jnp.stack([
        -0.04 * y[0] + 1e4 * y[1] * y[2],
        0.04 * y[0] - 1e4 * y[1] * y[2] - 3e7 * y[1] ** 2,
        3e7 * y[1] ** 2,
    ])  # fmt: skip


def van_der_pol(t, y, args):
    return jnp.stack([y[1], ((1 - y[0] ** 2) * y[1] - y[0]) / 1e-3])


PROBLEMS = {  # name: (f, y0, span, rtol, atol)
    "Robertson [0, 100], rtol 1e-5": (robertson, [1.0, 0, 0], (0.0, 100.0), 1e-5,
                                      [1e-7, 1e-11, 1e-7]),
    "Robertson [0, 1e5], rtol 1e-4": (robertson, [1.0, 0, 0], (0.0, 1e5), 1e-4,
                                      [1e-8, 1e-10, 1e-8]),
    "Robertson [0, 1e5], rtol 1e-6": (robertson, [1.0, 0, 0], (0.0, 1e5), 1e-6,
                                      [1e-8, 1e-12, 1e-8]),
    "Van der Pol [0, 2], rtol 1e-5": (van_der_pol, [2.0, 0], (0.0, 2.0), 1e-5, 1e-7),
}  # fmt: skip
SOLVERS = {
    "Kvaerno5": lambda: og.Kvaerno5(),
    "Kvaerno5, reuse 0": lambda: og.Kvaerno5(jacobian_reuse_rate=0.0),
    "Kvaerno3": lambda: og.Kvaerno3(),
    "Kvaerno3, reuse 0": lambda: og.Kvaerno3(jacobian_reuse_rate=0.0),
    "Rodas5P": lambda: og.Rodas5P(),
}


def main() -> None:
    _linear.jacobian = _counted
    print("| problem (float32) | solver | result | steps (rejected) | f evals | Jacobians | "
          "err / tol |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, (f, y0, span, rtol, atol) in PROBLEMS.items():
        ref = og.solve(f, jnp.asarray(y0, jnp.float64), span, solver=og.Rodas5P(),
                       step=og.Adaptive(1e-10, 1e-14), max_steps=100_000).ys[-1]  # fmt: skip
        scale = np.asarray(atol) + rtol * np.abs(np.asarray(ref))
        for label, make in SOLVERS.items():
            solver, at = make(), jnp.asarray(atol, jnp.float32)
            run = jax.jit(lambda y, s=solver, at=at: og.solve(
                f, y, span, solver=s, step=og.Adaptive(rtol, at), max_steps=20_000, throw=False
            ))  # fmt: skip
            _count[0] = 0
            sol = run(jnp.asarray(y0, jnp.float32))
            jax.effects_barrier()
            err = np.sqrt(np.mean(((np.asarray(sol.ys[-1], np.float64) - ref) / scale) ** 2))
            st = sol.stats
            print(f"| {name} | {label} | {og.Result(int(sol.result)).name} | "
                  f"{int(st['accepted']) + int(st['rejected'])} ({int(st['rejected'])}) | "
                  f"{int(st['rhs_evals'])} | {_count[0]} | {err:.2g} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
