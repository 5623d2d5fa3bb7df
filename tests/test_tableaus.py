"""Butcher tableaus: structure, and the Runge–Kutta order conditions via rooted trees."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from odegrad.solvers.tableaus import ALL_TABLEAUS, ButcherTableau

MAX_TREE_ORDER = 8
REL_TOL = 1e-12
# A violated order condition must miss by at least this much (relative) to count as failing.
FAIL_MARGIN = 1e-8
THETAS = (0.1, 0.25, 0.5, 0.7, 0.9, 1.0)

# A rooted tree is the sorted tuple of its children's subtrees; the single vertex is ().
Tree = tuple


@cache
def trees_of_order(n: int) -> tuple[Tree, ...]:
    """All rooted trees with ``n`` vertices, each once, in canonical form."""
    if n == 1:
        return ((),)
    found: set[Tree] = set()
    for tree in trees_of_order(n - 1):
        found.update(_grow(tree))
    return tuple(sorted(found))


def _grow(tree: Tree) -> set[Tree]:
    """Every tree obtained from ``tree`` by attaching one new leaf to one vertex."""
    grown = {tuple(sorted((*tree, ())))}
    for i, child in enumerate(tree):
        for bigger in _grow(child):
            grown.add(tuple(sorted((*tree[:i], bigger, *tree[i + 1 :]))))
    return grown


def rho(tree: Tree) -> int:
    return 1 + sum(rho(child) for child in tree)


def gamma(tree: Tree) -> int:
    out = rho(tree)
    for child in tree:
        out *= gamma(child)
    return out


def stage_weights(A: np.ndarray, tree: Tree) -> np.ndarray:
    """The vector Φ_i(τ): product over the root's children of ``A @ Φ(child)``."""
    out = np.ones(A.shape[0])
    for child in tree:
        out = out * (A @ stage_weights(A, child))
    return out


def full_a(tab: ButcherTableau) -> np.ndarray:
    s = tab.stages
    A = np.zeros((s, s))
    for i, row in enumerate(tab.a, start=1):
        A[i, : len(row)] = row
    return A


def order_defects(A: np.ndarray, weights: np.ndarray, order: int, theta: float = 1.0):
    """Relative defects of Σ w_i Φ_i(τ) = θ^ρ/γ for every tree of exactly ``order`` vertices."""
    absA = np.abs(A)
    out = []
    for tree in trees_of_order(order):
        value = weights @ stage_weights(A, tree)
        target = theta**order / gamma(tree)
        scale = max(1.0, float(np.abs(weights) @ stage_weights(absA, tree)))
        out.append(abs(value - target) / scale)
    return np.array(out)


def dense_weights(tab: ButcherTableau, theta: float) -> np.ndarray:
    D = np.asarray(tab.dense)
    powers = theta ** np.arange(1, D.shape[1] + 1)
    return D @ powers


PARAMS = pytest.mark.parametrize("name", list(ALL_TABLEAUS))
DENSE = [name for name, tab in ALL_TABLEAUS.items() if tab.dense is not None]
EMBEDDED = [name for name, tab in ALL_TABLEAUS.items() if tab.b_error is not None]


def test_tree_counts():
    # OEIS A000081: 1, 1, 2, 4, 9, 20, 48, 115.
    counts = [len(trees_of_order(n)) for n in range(1, MAX_TREE_ORDER + 1)]
    assert counts == [1, 1, 2, 4, 9, 20, 48, 115]


def test_expected_tableaus():
    assert set(ALL_TABLEAUS) == {
        "euler",
        "heun",
        "midpoint",
        "ralston",
        "rk4",
        "bs3",
        "tsit5",
        "dopri5",
        "dopri8",
    }
    assert all(isinstance(tab, ButcherTableau) for tab in ALL_TABLEAUS.values())


@PARAMS
def test_shapes(name):
    tab = ALL_TABLEAUS[name]
    s = tab.stages
    assert len(tab.c) == s
    assert tab.c[0] == 0.0
    assert len(tab.a) == s - 1
    assert [len(row) for row in tab.a] == list(range(1, s))
    if tab.b_error is not None:
        assert len(tab.b_error) == s
        assert tab.embedded_order is not None and tab.embedded_order < tab.order
    else:
        assert tab.embedded_order is None
    if tab.dense is not None:
        assert len(tab.dense) == s
        assert len({len(row) for row in tab.dense}) == 1
        assert tab.dense_order is not None and tab.dense_order <= tab.order
    else:
        assert tab.dense_order is None
    assert tab.order + 1 <= MAX_TREE_ORDER + 1


@PARAMS
def test_row_sums_and_consistency(name):
    tab = ALL_TABLEAUS[name]
    for i, row in enumerate(tab.a, start=1):
        scale = max(1.0, float(np.sum(np.abs(row))))
        assert abs(sum(row) - tab.c[i]) <= REL_TOL * scale, f"row {i}"
    assert abs(sum(tab.b) - 1.0) <= REL_TOL * max(1.0, float(np.sum(np.abs(tab.b))))
    if tab.b_error is not None:
        assert abs(sum(tab.b_error)) <= REL_TOL * max(1.0, float(np.sum(np.abs(tab.b_error))))
    if tab.fsal:
        assert tab.c[-1] == 1.0
        assert tab.a[-1] == tab.b[:-1]
        assert tab.b[-1] == 0.0


@PARAMS
def test_order_conditions(name):
    tab = ALL_TABLEAUS[name]
    A, b = full_a(tab), np.asarray(tab.b)
    for order in range(1, tab.order + 1):
        defects = order_defects(A, b, order)
        assert defects.max() <= REL_TOL, f"order {order}: {defects.max():.3g}"
    # The method is not of higher order: some condition of order + 1 fails clearly.
    assert order_defects(A, b, tab.order + 1).max() > FAIL_MARGIN


@pytest.mark.parametrize("name", EMBEDDED)
def test_embedded_order_conditions(name):
    tab = ALL_TABLEAUS[name]
    A = full_a(tab)
    b_hat = np.asarray(tab.b) - np.asarray(tab.b_error)
    for order in range(1, tab.embedded_order + 1):
        defects = order_defects(A, b_hat, order)
        assert defects.max() <= REL_TOL, f"order {order}: {defects.max():.3g}"
    assert order_defects(A, b_hat, tab.embedded_order + 1).max() > FAIL_MARGIN


@pytest.mark.parametrize("name", DENSE)
def test_dense_endpoint(name):
    tab = ALL_TABLEAUS[name]
    D = np.asarray(tab.dense)
    np.testing.assert_allclose(D.sum(axis=1), tab.b, rtol=0, atol=REL_TOL * np.abs(D).max())
    np.testing.assert_array_equal(dense_weights(tab, 0.0), 0.0)


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("theta", THETAS)
def test_dense_order_conditions(name, theta):
    tab = ALL_TABLEAUS[name]
    A, w = full_a(tab), dense_weights(tab, theta)
    for order in range(1, tab.dense_order + 1):
        defects = order_defects(A, w, order, theta)
        assert defects.max() <= REL_TOL, f"order {order}: {defects.max():.3g}"


@pytest.mark.parametrize("name", DENSE)
def test_dense_order_is_sharp(name):
    # Away from the end points the interpolant is not of order dense_order + 1.
    tab = ALL_TABLEAUS[name]
    A, w = full_a(tab), dense_weights(tab, 0.5)
    assert order_defects(A, w, tab.dense_order + 1, 0.5).max() > FAIL_MARGIN


def test_order_check_detects_a_perturbed_coefficient():
    tab = ALL_TABLEAUS["dopri5"]
    A, b = full_a(tab), np.array(tab.b)
    b[2] += 1e-9
    b[3] -= 1e-9  # keeps sum(b) == 1, so only higher-order conditions notice
    assert order_defects(A, b, 2).max() > REL_TOL
