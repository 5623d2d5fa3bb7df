"""The reverse sweep of ``adjoint/checkpointing.py`` on a counting chain: ``x_{k+1} = x_k + 1``
from ``x_0 = 0``, so ``x_k = k`` and the adjoint, the sum of the states met by the reverse steps,
is ``n (n - 1) / 2`` whatever the schedule; the forward steps taken are counted."""

from __future__ import annotations

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
        (50, 40, 55),  # a tail of 11: 55 re-taken, the schedule would take 58
        (50, 30, 68),  # a tail of 21 would re-take 210: the schedule, 68
    ],
)
def test_prefix_takes_the_cheaper_reverse(n, slots, taken):
    adjoint, steps = reversed_with(n, slots, prefix=True)
    assert adjoint == n * (n - 1) / 2
    assert steps == taken


def fewest_steps(n, s):
    """The fewest forward steps reversing ``n`` steps with ``s`` free slots besides the first
    state, by dynamic programming over the first split (``m`` steps, a slot taken there)."""
    best = [[0] * (s + 1) for _ in range(n + 1)]
    for length in range(2, n + 1):
        best[length][0] = length * (length - 1) // 2
        for k in range(1, s + 1):
            best[length][k] = min(
                m + best[length - m][k - 1] + best[m][k] for m in range(1, length)
            )
    return best[n][s]


@pytest.mark.parametrize("n, slots", [(13, 12), (60, 10), (100, 4), (200, 8), (7, 2), (2000, 64)])
def test_schedule_takes_the_fewest_steps(n, slots):
    # the schedule from x0 alone, slots - 1 free: the fewest steps any schedule takes (the
    # recurrence, where small enough; Griewank and Walther's count)
    adjoint, steps = reversed_with(n, slots, prefix=False)
    assert adjoint == n * (n - 1) / 2
    assert steps == round(float(revolve_steps(n, slots - 1)))
    if n <= 200:
        assert steps == fewest_steps(n, slots - 1)
