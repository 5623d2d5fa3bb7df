"""Progress bars for long solves: tqdm on stderr, fed by host callbacks from compiled loops.

A loop reports only when the completed fraction crosses the next multiple of 5%, so a solve pays
at most ~20 trips to the host (forward) plus ~20 (reverse pass), whatever its step count, and the
bar is redrawn at most 10 times a second.
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_BARS: dict = {}
_DRAWN: dict = {}  # key -> last redraw (time.monotonic())
_KEYS = itertools.count()
_STEP = 5  # percent between reports


def _update(key, desc, pct):
    import tqdm

    pct = int(np.min(np.asarray(pct)))  # under vmap: the slowest member of the batch
    bar = _BARS.get(key)
    if bar is None:
        bar = _BARS[key] = tqdm.tqdm(
            total=100, desc=desc, file=sys.stderr, unit="%", bar_format="{l_bar}{bar}| {n}%"
        )
    bar.n = min(pct, 100)
    now = time.monotonic()
    if pct >= 100 or now - _DRAWN.get(key, 0.0) >= 0.1:
        bar.refresh()
        _DRAWN[key] = now
    if pct >= 100:
        bar.close()
        _BARS.pop(key, None)
        _DRAWN.pop(key, None)


class Progress:
    """One progress bar, reported from traced code through :meth:`advance`."""

    def __init__(self, desc: str):
        try:
            import tqdm  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "progress=True needs tqdm: pip install 'odegrad[progress]' (or pip install tqdm)."
            ) from e
        self.desc = desc
        self.key = next(_KEYS)

    def advance(self, fraction, last):
        """Report ``fraction`` (0..1) if it passed the whole percent ``last``; returns the new
        ``last``. Cheap when nothing is reported: one compare and a not-taken branch."""
        pct = jnp.floor(100 * jnp.clip(fraction, 0.0, 1.0)).astype(jnp.int32)
        pct = pct - pct % _STEP
        report = jnp.any(pct > last)
        lax.cond(
            report,
            lambda p: jax.debug.callback(partial(_update, self.key, self.desc), p),
            lambda p: None,
            pct,
        )
        return jnp.maximum(pct, last)

    def every(self, k, n, fraction):
        """Report ``fraction`` on every ``n // 20``-th of ``n`` iterations (no carried state)."""
        stride = jnp.maximum(1, jnp.asarray(n) // (100 // _STEP))
        pct = jnp.floor(100 * jnp.clip(fraction, 0.0, 1.0)).astype(jnp.int32)
        lax.cond(
            jnp.any((k % stride == 0) | (pct >= 100)),
            lambda p: jax.debug.callback(partial(_update, self.key, self.desc), p),
            lambda p: None,
            pct,
        )

    def tap(self, y, k, n, fraction):
        """Identity on ``y`` whose reverse pass reports ``fraction`` every ``n // 20``-th ``k``
        (for the reverse pass that JAX derives from a ``lax.scan``)."""
        stride = jnp.maximum(1, jnp.asarray(n) // (100 // _STEP))
        flag = ((k % stride == 0) | (k == 0)).astype(jnp.float32)
        bar = self

        @jax.custom_vjp
        def tap(y, frac, flag):
            return y

        def fwd(y, frac, flag):
            return y, (frac, flag)

        def bwd(res, ct):
            frac, flag = res
            pct = jnp.floor(100 * jnp.clip(frac, 0.0, 1.0)).astype(jnp.int32)
            lax.cond(
                jnp.any(flag > 0.5),
                lambda p: jax.debug.callback(partial(_update, bar.key, bar.desc), p),
                lambda p: None,
                pct,
            )
            return ct, jnp.zeros_like(frac), jnp.zeros_like(flag)

        tap.defvjp(fwd, bwd)
        return tap(y, lax.stop_gradient(jnp.asarray(fraction, jnp.float32)), flag)


@dataclass(frozen=True)
class Bars:
    """The forward and reverse bars of one solve."""

    forward: Progress
    backward: Progress
    scan_tap: bool = True


def bars() -> Bars:
    return Bars(Progress("og.solve"), Progress("og.solve reverse"))
