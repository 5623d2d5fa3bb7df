"""Linear algebra for the implicit solvers: solves with ``M = I - c J`` on flat state vectors.

Every implicit method here needs ``x = M^{-1} b`` with ``M = I - c J``, ``J = df/dy`` at some
point and ``c = gamma * dt``. Two ways:

* ``"dense"``: ``J`` from :func:`jax.jacfwd` (one batched pass of ``n`` Jacobian-vector
  products), ``M`` LU-factorised once and reused for every solve that shares ``c`` and ``J``;
* ``"gmres"``: matrix-free Newton–Krylov: ``M v = v - c * jvp(f, y, v)``, solved by restarted
  GMRES (:func:`jax.scipy.sparse.linalg.gmres`), optionally with a user preconditioner that
  approximates ``M^{-1}``.

Both are written as :func:`jax.lax.custom_linear_solve` (dense through ``jnp.linalg`` /
``lu_solve``), so they are transposable: reverse-mode differentiation through a solve is one
solve with ``M^T``, never a differentiated iteration.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jax import lax
from jax.scipy.sparse.linalg import gmres

from .._batching import member_cond
from .._tuning import tuning

LINEAR_SOLVERS = ("auto", "dense", "gmres")


def check_linear_solver(name, owner: str) -> str:
    if name not in LINEAR_SOLVERS:
        raise ValueError(
            f"{owner}(linear_solver={name!r}): use 'dense' (LU of I - gamma*dt*J, small "
            f"states), 'gmres' (matrix-free Newton-Krylov, large states) or 'auto' (dense up "
            f"to {tuning().dense_max} state entries, else gmres)."
        )
    return name


def resolve(name: str, n: int) -> str:
    """The concrete linear solver for a state of ``n`` entries."""
    if name == "auto":
        return "dense" if n <= tuning().dense_max else "gmres"
    return name


def jacobian(fx, x):
    """Dense ``d fx / dx`` (``n x n``) of a flat function by one batched forward pass."""
    return jax.jacfwd(fx)(x)


class DenseSolve:
    """``b -> (I - c J)^{-1} b`` by one LU factorisation (differentiable in ``J`` and ``c``)."""

    def __init__(self, jac, c):
        self.lu = iteration_lu(jac, c)

    def __call__(self, b):
        return jsl.lu_solve(self.lu, b)


def krylov(matvec, b, *, tol, restart, maxiter, precond=None, atol=0.0, precond_t=None):
    """``matvec^{-1} b`` by restarted GMRES, with a transpose rule for reverse mode.

    Unlike calling :func:`~jax.scipy.sparse.linalg.gmres` directly, the tolerance of the
    transposed solve (reverse mode) is relative to its own right-hand side, not the primal one.
    ``precond_t`` preconditions the transposed solve (default: ``precond``).
    """

    def solve(mv, rhs):
        x, _ = gmres(
            mv,
            rhs,
            tol=tol,
            atol=atol,
            restart=restart,
            maxiter=maxiter,
            M=precond,
            solve_method="incremental",
        )
        return x

    def transpose_solve(vm, rhs):
        # the preconditioner approximates M^{-1}; without precond_t, for M^T it is only a
        # guess, which affects the iteration count, not the answer
        x, _ = gmres(
            vm,
            rhs,
            tol=tol,
            atol=0.0,
            restart=restart,
            maxiter=maxiter,
            M=precond if precond_t is None else precond_t,
            solve_method="incremental",
        )
        return x

    return lax.custom_linear_solve(matvec, b, solve=solve, transpose_solve=transpose_solve)


class KrylovSolve:
    """``b -> (I - c J)^{-1} b`` matrix-free, ``J v`` by :func:`jax.jvp` of ``fx`` at ``x``."""

    def __init__(self, fx, x, c, *, tol, restart, maxiter, precond=None):
        _, self.jvp = jax.linearize(fx, x)
        self.c = c
        self.kw = {"tol": tol, "restart": restart, "maxiter": maxiter, "precond": precond}

    def matvec(self, v):
        return v - self.c * self.jvp(v)

    def __call__(self, b):
        return krylov(self.matvec, b, **self.kw)


def iteration_lu(jac, c):
    """The LU factorisation (``jax.scipy.linalg.lu_factor``) of ``M = I - c J``."""
    return jsl.lu_factor(jnp.eye(jac.shape[0], dtype=jac.dtype) - c * jac)


class DenseNewton:
    """Newton linear algebra, dense: the LU of ``M = I - c J`` (given, from
    :func:`iteration_lu`), refreshed on request to the LU of the residual's exact Jacobian at
    the iterate."""

    exact = False

    def __init__(self, lu):
        self.lu0 = lu

    def init(self):
        return self.lu0

    def solve(self, lu, z, residual):
        return jsl.lu_solve(lu, residual(z))

    def refresh(self, lu, z, residual, pred):
        refresh = lambda: jsl.lu_factor(jax.jacfwd(residual)(z))
        return member_cond(pred, refresh, lambda: lu, differentiable=False)


class KrylovNewton:
    """Newton linear algebra, matrix-free: GMRES on the exact JVP of the residual at the
    current iterate (Newton–Krylov; nothing is stale, nothing to refresh)."""

    exact = True

    def __init__(self, *, tol, restart, maxiter, precond=None, atol=0.0):
        self.kw = {"tol": tol, "restart": restart, "maxiter": maxiter, "precond": precond}
        self.kw["atol"] = atol

    def init(self):
        return ()

    def solve(self, data, z, residual):
        r, jvp = jax.linearize(residual, z)
        return krylov(jvp, r, **self.kw)

    def refresh(self, data, z, residual, pred):
        return data


def tangent_solver(kind: str, gmres_kw: dict, precond=None, lu=None):
    """``tangent_solve(g, b)`` for :func:`jax.lax.custom_root`: ``g`` is the residual linearised
    at the root (``g = I - c J(z*)``, exact), solved densely, by GMRES, or (dense systems of
    ``Tuning.preconditioned_min`` entries or more, given Newton's ``lu`` of ``I - c J0``) by GMRES
    preconditioned with that LU (and its transpose for the transposed solve): ``J0`` differs
    from ``J(z*)`` by what Newton's contraction rate measured, so a few iterations reach
    ``tol``. All transposable."""
    if kind == "dense" and (lu is None or lu[0].shape[0] < tuning().preconditioned_min):

        def solve(g, b):
            mat = jax.jacfwd(g)(jnp.zeros_like(b))
            return jnp.linalg.solve(mat, b)

        return solve
    if kind == "dense":
        # tighter than the matrix-free default: each iteration is cheap here
        eps = float(jnp.finfo(lu[0].dtype).eps)
        kw = dict(gmres_kw, tol=max(1e-2 * gmres_kw["tol"], 10 * eps))
        fwd = lambda v: jsl.lu_solve(lu, v)
        bwd = lambda v: jsl.lu_solve(lu, v, trans=1)
        return lambda g, b: krylov(g, b, precond=fwd, precond_t=bwd, **kw)

    def solve(g, b):
        return krylov(g, b, precond=precond, **gmres_kw)

    return solve
