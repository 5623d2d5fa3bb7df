"""Shared test set-up: float64 by default, and a few small problems with exact solutions.

Float32 tests build float32 arrays explicitly (with x64 on, ``jnp.float32`` arrays stay float32).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass

# The suite is bound by compile time. Two XLA:CPU settings make it cheaper, neither changes XLA's
# own passes (fusion, buffer assignment, so memory_analysis); results move by round-off at most:
# no LLVM optimisation of the kernels (931 s against ~1200 s, 2 cores), and the older (LLVM IR)
# fusion emitters in place of the MLIR ones (583 s against 973 s, 2026-12-07, jaxlib 0.10.2).
# XLA is retiring the latter and aborts on a flag it does not know, so a child process tries it
# first (once: pytest-xdist's workers inherit the answer). Set before JAX starts its backend; a
# user's XLA_FLAGS are kept.
_LEGACY = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


if "ODEGRAD_TEST_XLA_FLAGS" not in os.environ:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        flags += " --xla_backend_optimization_level=0"
    if "xla_cpu_use_fusion_emitters" not in flags and _xla_accepts(_LEGACY):
        flags += " " + _LEGACY
    os.environ["XLA_FLAGS"] = os.environ["ODEGRAD_TEST_XLA_FLAGS"] = flags.strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from scipy.linalg import expm  # noqa: E402


@dataclass(frozen=True)
class LinearProblem:
    """``y' = A y``, ``y(0) = y0``: the exact solution is ``expm(A t) y0`` at any ``t``."""

    a: np.ndarray
    y0: np.ndarray

    def f(self, t, y, a):
        return a @ y

    def exact(self, ts) -> np.ndarray:
        """The exact state at each time of ``ts`` (shape ``(len(ts), n)``), or at a scalar ``t``."""
        ts_arr = np.asarray(ts, dtype=np.float64)
        rows = np.stack([expm(self.a * t) @ self.y0 for t in ts_arr.reshape(-1)])
        return rows.reshape(*ts_arr.shape, -1)


# A lightly damped rotation plus a decaying mode: oscillatory, non-normal, eigenvalues
# -0.4 +- 2i and -0.8 (approximately), so nothing is trivially exact for a polynomial method.
LINEAR_A = np.array([[-0.5, 2.0, 0.0], [-2.0, -0.3, 0.2], [0.1, 0.0, -0.8]])
LINEAR_Y0 = np.array([1.0, -0.5, 0.25])


@pytest.fixture(scope="session")
def linear() -> LinearProblem:
    return LinearProblem(LINEAR_A, LINEAR_Y0)


@pytest.fixture(scope="session")
def linear_args():
    """``(y0, A)`` of :func:`linear` as float64 JAX arrays."""
    return jnp.asarray(LINEAR_Y0), jnp.asarray(LINEAR_A)


@pytest.fixture
def retune(monkeypatch):
    """``retune(field=value, ...)``: trace the rest of the test with those tuning fields changed
    (see ``odegrad._tuning``); restored afterwards."""
    from odegrad import _tuning

    def change(**changes):
        table = dataclasses.replace(_tuning.tuning(), **changes)
        monkeypatch.setattr(_tuning, "_override", [table])

    return change
