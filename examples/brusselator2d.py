"""A stiff PDE: the 2-d Brusselator (reaction–diffusion) on a 32x32 periodic grid, solved with
matrix-free Newton–Krylov (GMRES) and differentiated with respect to a parameter.

    u_t = A + u^2 v - (B + 1) u + alpha Lap(u)
    v_t = B u - u^2 v           + alpha Lap(v)

on the unit square (Hairer & Wanner, Solving ODEs II, IV.10: A = 1, B = 3.4, alpha = 0.1). The
diffusion makes it stiff (eigenvalues down to ``-8 alpha / dx^2 = -819``): explicit solvers take
thousands of steps. The state is a pytree ``(u, v)`` of two 32x32 arrays (2048 unknowns), so
``og.Kvaerno5()`` picks ``linear_solver="gmres"``; the preconditioner inverts the diffusion part
``I - c alpha Lap`` exactly by FFT and then the pointwise 2x2 reaction Jacobian, leaving GMRES
only the (small) coupling of the two to resolve: one or two Krylov iterations per Newton step.

    python examples/brusselator2d.py           # t in [0, 10]
    python examples/brusselator2d.py --quick   # t in [0, 1], about 15 s (mostly compilation)
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

import odegrad as og  # noqa: E402

N = 32
DX = 1.0 / N


def laplacian(w):
    """Periodic 5-point Laplacian."""
    return (
        jnp.roll(w, 1, 0) + jnp.roll(w, -1, 0) + jnp.roll(w, 1, 1) + jnp.roll(w, -1, 1) - 4 * w
    ) / DX**2


def brusselator(t, y, p):
    u, v = y
    a, b, alpha = p["A"], p["B"], p["alpha"]
    uuv = u * u * v
    return (a + uuv - (b + 1) * u + alpha * laplacian(u), b * u - uuv + alpha * laplacian(v))


def fft_preconditioner(t, y, p, c):
    """``(I - c alpha Lap)^{-1}`` for each species, exactly, by FFT (periodic grid)."""
    k = jnp.arange(N)
    s = jnp.sin(jnp.pi * k / N) ** 2
    lam = -4.0 / DX**2 * (s[:, None] + s[None, :])  # eigenvalues of the Laplacian
    denom = (1.0 - c * p["alpha"] * lam)[:, : N // 2 + 1]  # the half spectrum of a real field

    def apply(w):
        return tuple(jnp.fft.irfft2(jnp.fft.rfft2(x) / denom, s=(N, N)) for x in w)

    return apply


def preconditioner(t, y, p, c):
    """``M^{-1}`` for ``M = I - c J``, ``J = alpha Lap + R(y)``, approximated by the product
    ``(I - c R)^{-1} (I - c alpha Lap)^{-1}``: the diffusion inverted exactly by FFT, then the
    reaction's 2x2 Jacobian ``R`` at each grid point (at the step start ``y``) by its closed-form
    inverse. The splitting error is ``O(c^2)``, so GMRES needs a few iterations per solve."""
    u, v = y
    r11 = 2 * u * v - (p["B"] + 1)
    r12 = u * u
    r21 = p["B"] - 2 * u * v
    r22 = -u * u
    m11, m12, m21, m22 = 1 - c * r11, -c * r12, -c * r21, 1 - c * r22
    det = m11 * m22 - m12 * m21
    diffusion = fft_preconditioner(t, y, p, c)

    def apply(w):
        a, b = diffusion(w)
        return ((m22 * a - m12 * b) / det, (m11 * b - m21 * a) / det)

    return apply


def initial_state():
    x = jnp.arange(N) * DX
    xx, yy = jnp.meshgrid(x, x, indexing="ij")
    u0 = 22.0 * yy * (1 - yy) ** 1.5
    v0 = 27.0 * xx * (1 - xx) ** 1.5
    return (u0, v0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (t1 = 1)")
    args = ap.parse_args(argv)
    t1 = 1.0 if args.quick else 10.0
    params = {"A": jnp.asarray(1.0), "B": jnp.asarray(3.4), "alpha": jnp.asarray(0.1)}
    y0 = initial_state()
    solver = og.Kvaerno5(preconditioner=preconditioner)
    step = og.Adaptive(rtol=1e-6, atol=1e-8)

    def loss_of(sol):
        u, v = sol.ys
        return jnp.mean(u[-1] ** 2) + jnp.mean(v[-1])

    def loss(p):
        return loss_of(og.solve(brusselator, y0, (0.0, t1), p, solver=solver, step=step))

    solve = jax.jit(lambda p: og.solve(brusselator, y0, (0.0, t1), p, solver=solver, step=step))
    t0 = time.perf_counter()
    sol = jax.block_until_ready(solve(params))
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    sol = jax.block_until_ready(solve(params))
    t_run = time.perf_counter() - t0
    stats = {k: int(v) for k, v in sol.stats.items()}
    print(
        f"2-d Brusselator {N}x{N} (2048 unknowns), t in [0, {t1:g}], Kvaerno5 + GMRES, "
        "FFT x block preconditioner"
    )
    print(f"  forward: {t_run * 1e3:.1f} ms (first call with compilation {t_first:.1f} s), {stats}")
    why = og.explain_adjoint(brusselator, y0, (0.0, t1), params, solver=solver, step=step)
    print(f"  {why.split(':')[0]}")

    grad = jax.jit(jax.value_and_grad(loss))
    t0 = time.perf_counter()
    value, g = jax.block_until_ready(grad(params))
    t_grad = time.perf_counter() - t0
    t0 = time.perf_counter()
    value, g = jax.block_until_ready(grad(params))
    t_grad2 = time.perf_counter() - t0
    print(
        f"  loss = {float(value):.10f}; gradient in {t_grad2 * 1e3:.1f} ms "
        f"(first call {t_grad:.1f} s)"
    )
    lossj = lambda p: loss_of(solve(p))  # the compiled forward solve: no third compilation
    eps = 1e-5
    for name in ("B", "alpha"):
        hi = dict(params, **{name: params[name] + eps})
        lo = dict(params, **{name: params[name] - eps})
        fd = (float(lossj(hi)) - float(lossj(lo))) / (2 * eps)
        print(
            f"  dloss/d{name}: {float(g[name]): .8e}   finite differences {fd: .8e}   "
            f"relative difference {abs(float(g[name]) - fd) / abs(fd):.1e}"
        )


if __name__ == "__main__":
    main()
