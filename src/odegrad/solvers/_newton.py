"""Simplified Newton iterations for one implicit stage, differentiated by the implicit function
theorem.

The stage equation is ``r(z) = 0``. The primal solve iterates ``z <- z - M^{-1} r(z)`` with an
approximate iteration matrix ``M``: dense, the Jacobian at the step start (a "simplified" or
"chord" Newton method), rebuilt at the iterate when the contraction is too slow; GMRES, the
exact JVP at the iterate (Newton–Krylov). It stops by Hairer & Wanner's test (Solving ODEs II,
IV.8): with the contraction rate ``theta_k = |dz_k| / |dz_{k-1}|`` and
``eta_k = theta_k / (1 - theta_k)``, the iterate is converged once ``eta_k |dz_k| <= 1`` in
the scaled norm ``RMS(dz / (atol + rtol |z|))``; it has failed when ``theta_k >= 1`` with an
up-to-date matrix (divergence), when a value is not finite, or after ``max_iters`` iterations.
The increments are those the iterate really took (an increment below half an ulp of an entry
moves nothing): an iterate converged to the arithmetic's resolution stops there.

:func:`stage_root` wraps this in :func:`jax.lax.custom_root`: derivatives (forward and reverse)
of the root are ``-(dr/dz)^{-1} dr/dparams`` at the root, with the exact ``dr/dz``. Reverse mode
thus costs one transposed linear solve per stage and never differentiates the iterations.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _norm(dz, scale):
    return jnp.sqrt(jnp.mean(jnp.square(dz / scale)))


def newton(residual, z0, linsys, scale, max_iters: int):
    """Chord-Newton iterations from ``z0``; returns ``(z, failed, rate, iterations)``.

    ``rate`` is the slowest contraction ``theta`` seen (0 when the first increment was already
    converged; ``inf`` when the matrix had to be rebuilt): the caller reuses its Jacobian for
    the next step only when this is small.

    ``linsys`` supplies the linear algebra (``DenseNewton`` / ``KrylovNewton`` in ``_linear``):
    ``init()`` the matrix data (the LU of ``M`` at the step start), ``solve(data, z, residual)``
    returns ``M^{-1} residual(z)``, ``refresh(data, z, residual, pred)`` rebuilds the matrix at
    the iterate when ``pred``: when the contraction is too slow to converge in the iterations
    left (or ``theta > 1/2``); from then on this is Newton's method, and divergence counts as
    failure only with a rebuilt (or exact) matrix. ``scale`` is ``atol + rtol * |z|``.
    """
    dtype = z0.dtype
    one = jnp.asarray(1.0, dtype)
    tiny = jnp.finfo(dtype).tiny

    def cond(c):
        k, _, _, done, failed, _, _, _ = c
        return (~done) & (~failed) & (k < max_iters)

    def body(c):
        k, z, n_prev, _, _, fresh, data, rate = c
        dz = linsys.solve(data, z, residual)
        z_new = z - dz
        # the increment z really took: below half an ulp of z an entry does not move, and a
        # converged iterate's increments keep their size while the iterate stays put (theta =
        # 1, read as divergence: Kvaerno5 in float32 failed every stage past the first at a
        # step of 15 ulps of t, atol 3e-8)
        n = _norm(z - z_new, scale)
        z = z_new
        theta = jnp.where(k == 0, 0.0, n / jnp.maximum(n_prev, tiny))
        eta = theta / jnp.maximum(1 - theta, jnp.finfo(dtype).eps)
        # first iteration: no rate yet; accept only an increment well below the tolerance
        done = jnp.isfinite(n) & jnp.where(k == 0, n <= 1e-2, eta * n <= 1)
        # too slow to converge within the iterations left (Hairer's test), or contracting
        # poorly: rebuild the matrix at the iterate (from then on this is Newton's method)
        remaining = max_iters - 1 - k
        hopeless = theta**remaining / jnp.maximum(1 - theta, 1e-30) * n > 1
        slow = (k > 0) & ((theta > 0.5) | hopeless) & ~done
        refresh = slow & jnp.isfinite(n) & (not linsys.exact)
        failed = ~jnp.isfinite(n) | (fresh & ~done & (k > 0) & (theta >= 1))
        data = linsys.refresh(data, z, residual, refresh)
        n_keep = jnp.where(jnp.isfinite(n), n, one)
        rate = jnp.maximum(rate, jnp.where(refresh | ~jnp.isfinite(theta), jnp.inf, theta))
        return k + 1, z, n_keep, done, failed & ~done, fresh | refresh, data, rate

    init = (
        jnp.asarray(0),
        z0,
        one,
        jnp.asarray(False),
        jnp.asarray(False),
        jnp.asarray(linsys.exact),
        linsys.init(),
        jnp.zeros((), dtype),
    )
    k, z, _, done, failed, _, _, rate = lax.while_loop(cond, body, init)
    return z, failed | ~done, rate, k


def stage_root(residual, z0, linsys, scale, max_iters: int, tangent_solve):
    """The root of ``residual`` near ``z0``, a failure flag, Newton's contraction rate and its
    iteration count (see :func:`newton`); differentiable by the implicit function theorem (see
    the module docstring). ``residual`` may close over traced values (the stage's explicit
    part, ``dt``, ``args``): their derivatives flow to the root."""

    def run(f, guess):
        z, failed, rate, iters = newton(f, guess, linsys, scale, max_iters)
        # float flags: custom_root's JVP gives aux outputs zero tangents of their own dtype,
        # which JAX rejects for booleans and integers (they need float0)
        return z, (failed.astype(z.dtype), rate, iters.astype(z.dtype))

    z, aux = lax.custom_root(residual, z0, run, tangent_solve, has_aux=True)
    failed, rate, iters = lax.stop_gradient(aux)
    return z, failed > 0, rate, iters.astype(jnp.int32)
