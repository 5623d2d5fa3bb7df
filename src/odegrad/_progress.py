"""Progress bars for long solves: tqdm on stderr, fed by host callbacks from compiled loops.

A loop reports only when the completed fraction crosses the next multiple of 5%, so a solve pays
at most ~20 trips to the host (forward) plus ~20 (reverse pass), whatever its step count, and the
bar is redrawn at most 10 times a second.

Static grids (:func:`chunked_scan`) go further: the scan is split into 20 chunks with no
per-step test at all, and the host, having timed the first chunk, says which chunk reports next,
so that a solve reports about every 0.1 s: a 3 ms solve makes three trips to the host, not 40.
"""

from __future__ import annotations

import atexit
import itertools
import sys
import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

_BARS: dict = {}
_DRAWN: dict = {}  # key -> (percent, time.monotonic()) of its last redraw
_KEYS = itertools.count()
_STEP = 5  # percent between reports
_CHUNKS = 100 // _STEP  # chunks of a static-grid scan
_INTERVAL = 0.1  # seconds between reports the chunked scan aims for
#: key -> ((time, percent) of the running solve's first report, seconds per percent last measured)
_TIMES: dict = {}
#: the ``control`` a reporting scan starts with: report at 0%, reverse stride 1%.
START = (0, 1)


def _update(key, desc, pct):
    """Move bar ``key`` to ``pct``; redraw at most every 0.1 s, and on first reaching 100%.

    A bar lives as long as its traced solve is called: a jitted solve run again reuses it rather
    than paying tqdm's set-up each time (about 0.1 ms, more than a small solve costs). Finished
    bars are closed when another solve's bar opens.
    """
    import tqdm

    pct = min(int(np.min(np.asarray(pct))), 100)  # under vmap: the slowest member of the batch
    bar = _BARS.get(key)
    if bar is None:
        for k in [k for k, (p, _) in _DRAWN.items() if p >= 100]:
            _BARS.pop(k).close()
            _DRAWN.pop(k)
        bar = _BARS[key] = tqdm.tqdm(
            total=100, desc=desc, file=sys.stderr, unit="%", bar_format="{l_bar}{bar}| {n}%"
        )
    bar.n = pct
    drawn_pct, drawn_at = _DRAWN.get(key, (-1, 0.0))
    now = time.monotonic()
    if now - drawn_at >= _INTERVAL or (pct >= 100 and drawn_pct < 100):
        bar.refresh()
        _DRAWN[key] = (pct, now)


def close_bars():
    """Close every open progress bar (each prints its final line)."""
    for bar in _BARS.values():
        bar.close()
    _BARS.clear()
    _DRAWN.clear()


atexit.register(close_bars)


def _host_report(key, desc, pct):
    """Host side of a report at ``pct`` percent: draw, then return ``[the percent at which to
    report next, the stride in percent between reverse-pass reports]``, chosen from the measured
    speed so that reports come about every 0.1 s (a fast solve reports only at its start and end).
    """
    pct = min(int(pct), 100)
    _update(key, desc, pct)
    now = time.monotonic()
    start, per_pct = _TIMES.get(key, (None, None))
    if start is None or pct <= start[1]:  # a new run of this solve begins
        _TIMES[key] = ((now, pct), per_pct)
        if per_pct is None:  # never timed: report once more to measure
            return np.array([pct + 1, 1], np.int32)
    else:
        per_pct = max((now - start[0]) / (pct - start[1]), 1e-12)
        _TIMES[key] = (start, per_pct)
    if pct >= 100:
        return np.array([101, 100], np.int32)
    stride = int(np.ceil(_INTERVAL / per_pct))
    # a reverse pass costs about twice the forward per percent
    return np.array([min(pct + stride, 100), int(np.ceil(_INTERVAL / (2 * per_pct)))], np.int32)


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

    def report(self, pct, control):
        """Report ``pct`` (an int32 percent) when it reaches ``control[0]``; returns the new
        ``control`` from :func:`_host_report`. Cheap otherwise: one compare, a branch not taken.
        Not for a while loop that may be batched (see :meth:`advance`)."""
        host = partial(_host_report, self.key, self.desc)

        # JAX cannot batch a conditional around an io_callback, and the decision is the batch's:
        # under vmap, report when the slowest member reaches the threshold.
        @jax.custom_batching.custom_vmap
        def report(pct, control):
            return lax.cond(
                pct >= control[0],
                lambda p: io_callback(host, jax.ShapeDtypeStruct((2,), jnp.int32), p),
                lambda p: control,
                pct,
            )

        @report.def_vmap
        def _(axis_size, in_batched, pct, control):
            pct = jnp.min(pct) if in_batched[0] else pct
            control = jnp.max(control, axis=0) if in_batched[1] else control
            return report(pct, control), False

        return report(pct, control)

    def advance(self, fraction, last):
        """Report the completed ``fraction`` (0..1) of a while loop each time it passes the next
        multiple of 5% above ``last`` (start: -1); returns the new ``last``. A while loop may be
        batched with a batched predicate, where JAX allows no callback that returns a value, so
        this one only draws."""
        host = partial(_update, self.key, self.desc)

        @jax.custom_batching.custom_vmap
        def report(pct, last):
            lax.cond(pct > last, lambda p: jax.debug.callback(host, p), lambda p: None, pct)
            return jnp.maximum(pct, last)

        @report.def_vmap
        def _(axis_size, in_batched, pct, last):
            pct = jnp.min(pct) if in_batched[0] else pct
            last = jnp.max(last) if in_batched[1] else last
            return report(pct, last), False

        pct = jnp.floor(100 * jnp.clip(fraction, 0.0, 1.0)).astype(jnp.int32)
        return report(pct - pct % _STEP, last)

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

    def tap(self, y, report, fraction):
        """Identity on ``y`` whose reverse pass reports ``fraction`` where ``report`` holds (for
        the reverse pass that JAX derives from a ``lax.scan``)."""
        flag = jnp.asarray(report).astype(jnp.float32)
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


def chunked_scan(body, carry, xs, n: int, bars: Bars):
    """``lax.scan(body, carry, xs)`` over ``n`` steps, reporting progress between chunks.

    The steps run as an outer scan over (up to) 20 chunks of an inner scan, then a scan over the
    remainder, so the step loop itself carries no test. Under reverse-mode autodiff each chunk's
    carry passes a tap that reports the reverse pass, on the chunks the forward host chose.
    """
    chunks = min(_CHUNKS, n)
    size = n // chunks
    main = chunks * size
    head = jax.tree.map(lambda x: x[:main].reshape(chunks, size, *x.shape[1:]), xs)
    tail = jax.tree.map(lambda x: x[main:], xs)

    def outer(oc, xm):
        c, control = oc
        m, x = xm
        if bars.scan_tap:
            stride = jnp.maximum(1, control[1] * chunks // 100)
            c = bars.backward.tap(c, (m % stride == 0) | (m == 0), 1 - m / chunks)
        c, out = lax.scan(body, c, x)
        return (c, bars.forward.report((m + 1) * 100 // chunks, control)), out

    control0 = jnp.array(START, jnp.int32)
    (carry, _), out = lax.scan(outer, (carry, control0), (jnp.arange(chunks), head))
    out = jax.tree.map(lambda o: o.reshape(main, *o.shape[2:]), out)
    if main < n:
        carry, out_tail = lax.scan(body, carry, tail)
        out = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, out_tail)
    return carry, out
