"""The reverse sweep of ``adjoint/checkpointing.py`` on a counting chain: ``x_{k+1} = x_k + 1``
from ``x_0 = 0``, so ``x_k = k`` and the adjoint, the sum of the states met by the reverse steps,
is ``n (n - 1) / 2`` whatever the schedule; the forward steps taken are counted."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from odegrad.adjoint.checkpointing import reverse_steps, revolve_steps


def reversed_with(n, slots, prefix):
    taken = [0]

    def advance(k, x):
        jax.debug.callback(lambda: taken.__setitem__(0, taken[0] + 1))
        return x + 1.0

    kept = jnp.arange(slots, dtype=jnp.float32) if prefix else None
    adjoint = reverse_steps(
        advance, lambda k, x, a: a + x, n, jnp.float32(0), jnp.float32(0), slots, prefix=kept
    )
    return float(jax.block_until_ready(adjoint)), taken[0]


@pytest.mark.parametrize(
    "n, slots, taken",
    [
        (12, 12, 0),  # every state kept
        (13, 12, 1),  # a tail of 2: one step re-taken
        (50, 40, 55),  # a tail of 11: 55 re-taken, the schedule would re-take 59
        (50, 30, 69),  # a tail of 21 would re-take 210: the schedule, 69
    ],
)
def test_prefix_takes_the_cheaper_reverse(n, slots, taken):
    adjoint, steps = reversed_with(n, slots, prefix=True)
    assert adjoint == n * (n - 1) / 2
    assert steps == taken


@pytest.mark.parametrize("n, slots, exact", [(13, 12, True), (50, 30, True), (200, 8, False)])
def test_schedule_within_its_sweeps(n, slots, exact):
    # the schedule from x0 alone, s = slots - 1 slots free: at least Griewank and Walther's
    # minimum t n - C(s + t, t - 1) steps (reached in the first two), at most t sweeps of n
    adjoint, steps = reversed_with(n, slots, prefix=False)
    assert adjoint == n * (n - 1) / 2
    s = slots - 1
    t = next(t for t in range(1, n) if math.comb(s + t, s) >= n)
    least = round(float(revolve_steps(n, s)))
    assert least == t * n - math.comb(s + t, t - 1)
    assert (steps == least) if exact else (least < steps <= t * n)
