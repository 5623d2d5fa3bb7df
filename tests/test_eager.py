"""Eager ``og.solve`` calls compile once per configuration (odegrad/_eager.py), and a cache hit
never returns a result computed with stale closed-over values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odegrad as og
from odegrad import _eager

Y0 = jnp.asarray([1.0, 2.0])


def _entries() -> int:
    return len(_eager._cache)


def _cached(f, *args, **kw):
    """``og.solve`` called twice, so that the second call compiles and caches it."""
    og.solve(f, *args, **kw)
    return og.solve(f, *args, **kw)


def test_second_eager_call_reuses_the_compiled_solve():
    f = lambda t, y, k: -k * y
    kw = dict(saveat=og.SaveAt(ts=np.linspace(0.0, 1.0, 5)))
    n = _entries()
    first = og.solve(f, Y0, (0.0, 1.0), 1.5, **kw)  # runs uncached, and is remembered
    assert _entries() == n
    og.solve(f, Y0, (0.0, 1.0), 1.5, **kw)  # compiles
    assert _entries() == n + 1
    # new argument values (arrays of the same shapes), same configuration: no new entry
    second = og.solve(f, 2 * Y0, (0.0, 1.0), 1.5, **kw)
    assert _entries() == n + 1
    np.testing.assert_allclose(second.ys, 2 * np.asarray(first.ys), rtol=1e-6)
    want = np.exp(-1.5 * np.linspace(0.0, 1.0, 5))[:, None] * 2 * np.asarray(Y0)
    np.testing.assert_allclose(second.ys, want, rtol=1e-5)
    # the same as under jax.jit, step for step
    jitted = jax.jit(lambda y: og.solve(f, y, (0.0, 1.0), 1.5, **kw))(2 * Y0)
    np.testing.assert_array_equal(second.stats["steps"], jitted.stats["steps"])
    # another configuration is another entry
    for _ in range(2):
        og.solve(f, Y0, (0.0, 2.0), 1.5, **kw)
    assert _entries() == n + 2


def test_rebound_global_array_is_not_stale():
    global RATE
    RATE = jnp.asarray(2.0)
    f = lambda t, y, a: -RATE * y
    a = _cached(f, Y0, (0.0, 1.0)).ys[-1]
    RATE = jnp.asarray(1.0)
    b = og.solve(f, Y0, (0.0, 1.0)).ys[-1]
    np.testing.assert_allclose(a, np.exp(-2.0) * np.asarray(Y0), rtol=1e-5)
    np.testing.assert_allclose(b, np.exp(-1.0) * np.asarray(Y0), rtol=1e-5)


def test_numpy_array_mutated_in_place_is_not_stale():
    rates = np.asarray([2.0, 1.0])
    f = lambda t, y, a: -rates * y
    a = _cached(f, Y0, (0.0, 1.0)).ys[-1]
    rates[0] = 1.0
    b = og.solve(f, Y0, (0.0, 1.0)).ys[-1]
    np.testing.assert_allclose(a, np.exp([-2.0, -1.0]) * np.asarray(Y0), rtol=1e-5)
    np.testing.assert_allclose(b, np.exp(-1.0) * np.asarray(Y0), rtol=1e-5)


def test_python_level_switch_is_not_stale():
    mode = {"fast": True}
    f = lambda t, y, a: (-2.0 if mode["fast"] else -1.0) * y
    a = _cached(f, Y0, (0.0, 1.0), solver=og.ROCK2()).ys[-1]
    mode["fast"] = False
    b = og.solve(f, Y0, (0.0, 1.0), solver=og.ROCK2()).ys[-1]
    np.testing.assert_allclose(a, np.exp(-2.0) * np.asarray(Y0), rtol=1e-4)
    np.testing.assert_allclose(b, np.exp(-1.0) * np.asarray(Y0), rtol=1e-4)


def test_static_args_leaves_and_uncacheable_options_still_solve():
    # a string and a function among the args: static leaves, keyed by value and identity
    f = lambda t, y, a: a["act"](-a["k"] * y) if a["mode"] == "act" else -a["k"] * y
    args = {"act": jnp.tanh, "k": jnp.asarray(1.0), "mode": "plain"}
    n = _entries()
    got = _cached(f, Y0, (0.0, 1.0), args).ys[-1]
    assert _entries() == n + 1
    np.testing.assert_allclose(got, np.exp(-1.0) * np.asarray(Y0), rtol=1e-5)
    # a preconditioner(t, y, args, c) is not f-shaped: the call takes the uncached path
    n = _entries()
    pre = lambda t, y, a, c: lambda v: v
    solver = og.Kvaerno5(linear_solver="gmres", preconditioner=pre)
    sol = _cached(lambda t, y, a: -y, Y0, (0.0, 1.0), solver=solver)
    assert _entries() == n
    np.testing.assert_allclose(sol.ys[-1], np.exp(-1.0) * np.asarray(Y0), rtol=1e-4)


def test_failures_still_raise_from_the_cached_call():
    f = lambda t, y, a: y**2  # blows up at t = 1 / y0
    for _ in range(3):  # uncached, compiling, cached
        with pytest.raises(Exception, match=r"max_steps|non-finite|blew"):
            og.solve(f, Y0, (0.0, 1.0), max_steps=64)
    with pytest.raises(ValueError, match="y0"):  # the eager check of a non-finite y0
        og.solve(f, jnp.asarray([1.0, jnp.nan]), (0.0, 1.0))


def test_a_tuning_override_is_not_served_the_default_program():
    from odegrad._tuning import tuned

    f = lambda t, y, a: -y
    n = _entries()
    _cached(f, Y0, (0.0, 3.0))
    with tuned(memory_budget=2**10):  # read at trace time: another program
        _cached(f, Y0, (0.0, 3.0))
    assert _entries() == n + 2
