"""Shared helpers for the benchmarks: interleaved median timing, compile timing, markdown tables.

Every benchmark measures all of its contestants in one process, interleaved (each round times
each contestant ``number`` calls back to back, in a fresh random order), and reports the
median over rounds of the time per call. Interleaving spreads slow drifts of the machine (thermal
state, other processes) evenly over the contestants instead of penalising whoever runs last.
"""

from __future__ import annotations

import gc
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from odegrad._bench import fmt_seconds as _fmt_auto_unit


def add_timing_args(p, rounds: int, number: int, budget: float) -> None:
    """The timing options every benchmark script shares."""
    p.add_argument(
        "--rounds", type=int, default=rounds, help="interleaved rounds (median over them)"
    )
    p.add_argument("--number", type=int, default=number, help="calls per contestant per round")
    p.add_argument("--compile-reps", type=int, default=2, help="cold compiles per contestant")
    p.add_argument(
        "--budget",
        type=float,
        default=budget,
        help="seconds one contestant may spend in the timing loop before its schedule is cut",
    )
    p.add_argument(
        "--stat",
        choices=["median", "min"],
        default="median",
        help="which statistic of the rounds the ratios use (both are printed)",
    )


#: glibc settings that keep freed memory for reuse: by default a block over 32 MiB is mapped
#: fresh on every allocation, so each call of a program on large fields page-faults every page
#: it writes (~0.4 ms per MiB on the development machine; docs/stencil.md)
REUSE_MALLOC = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**36),
}


def add_malloc_arg(p) -> None:
    """``--malloc {default,reuse}``: see :func:`apply_malloc`."""
    p.add_argument(
        "--malloc",
        choices=["default", "reuse"],
        default="default",
        help="reuse: glibc keeps freed memory (no page faults on each call's fresh buffers)",
    )


def apply_malloc(choice: str) -> None:
    """With ``reuse``, start the script again under :data:`REUSE_MALLOC` (glibc reads these at
    start-up); print which allocator the figures below were taken with."""
    if choice == "reuse" and any(os.environ.get(k) != v for k, v in REUSE_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **REUSE_MALLOC})
    print(f"allocator: {choice}")


def block(x: Any) -> Any:
    """Wait for every JAX array in ``x`` (other leaves, e.g. torch tensors, are already done)."""
    return jax.block_until_ready(x)


@dataclass
class Timing:
    """Seconds per call: the median (and the min) over the rounds a contestant took part in."""

    median: float
    samples: list[float]  # seconds per call, one per round
    reduced: bool = False  # too slow for the full schedule: fewer rounds and/or calls

    @property
    def best(self) -> float:
        """The fastest round: on a busy machine, the closest to the undisturbed time."""
        return min(self.samples)


def interleaved_medians(
    fns: dict[str, Callable[[], Any]],
    rounds: int,
    number: int,
    budget_s: float | None = None,
) -> dict[str, Timing]:
    """Median seconds per call of each ``fns[name]()``, measured interleaved.

    Each call is waited for (:func:`block`) before the next starts, as a user would. Two calls
    of each are made first as a warm-up (a ``jax.jit`` function compiles on the first; the
    second's time plans the schedule). ``budget_s`` bounds the time one contestant may take:
    one whose warm-up call shows it would exceed it makes one call per round in the first
    rounds only, or, when even that does not fit, its warm-up call is its only sample. So a
    pathologically slow case still gets a number without stalling the whole benchmark; the
    result says ``reduced``.
    """
    names = list(fns)
    plan: dict[str, tuple[int, int]] = {}  # name -> (rounds it takes part in, calls per round)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for name in names:
        block(fns[name]())  # (a jax.jit function compiles on its first call)
        t0 = time.perf_counter()
        block(fns[name]())
        warm = time.perf_counter() - t0
        if budget_s is None or warm * rounds * number <= budget_s:
            plan[name] = (rounds, number)
        elif warm >= budget_s / 2:  # no room for more: the warm-up call is the one sample
            plan[name] = (0, 0)
            samples[name].append(warm)
        else:
            plan[name] = (max(1, min(rounds, int(budget_s / warm))), 1)
    rng = random.Random(0)  # a fresh order every round, so that no contestant always follows
    # the same one (e.g. a torch call whose worker threads still spin for a while afterwards)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            for name in rng.sample(names, len(names)):
                n_rounds, calls = plan[name]
                if r >= n_rounds:
                    continue
                fn = fns[name]
                t0 = time.perf_counter()
                for _ in range(calls):
                    block(fn())
                samples[name].append((time.perf_counter() - t0) / calls)
            gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    out = {}
    for name in names:
        n_rounds, calls = plan[name]
        out[name] = Timing(
            statistics.median(samples[name]),
            samples[name],
            reduced=(n_rounds, calls) != (rounds, number),
        )
    return out


@dataclass
class Compiled:
    """An AOT-compiled function, with the median seconds taken to trace+lower and to compile,
    and ``call``: the same function through ``jax.jit``, as users call it, which the timings
    use. (JAX dispatches an ahead-of-time compiled program that holds a host callback, such
    as a ``throw=True`` check, by its Python path: ~80 us more per call than ``jax.jit``.)
    ``call`` compiles on its first call, the timings' warm-up."""

    fn: Any  # jax.stages.Compiled
    lower_s: float
    compile_s: float
    call: Any = None

    @property
    def total_s(self) -> float:
        return self.lower_s + self.compile_s

    def temp_bytes(self) -> int | None:
        """XLA's temporary-buffer size for one call (``memory_analysis().temp_size_in_bytes``)."""
        try:
            stats = self.fn.memory_analysis()
        except Exception:  # not every backend reports it
            return None
        return None if stats is None else int(stats.temp_size_in_bytes)


def compile_timed(make: Callable[[], Callable], args: Sequence[Any], reps: int = 1) -> Compiled:
    """``jax.jit(make()).lower(*args).compile()``, timed cold ``reps`` times (median).

    ``make`` must build a fresh Python function each time, and JAX's in-memory caches are
    cleared before each repetition, so every repetition pays the full tracing, lowering and XLA
    compilation a user pays on first call (:func:`warm_up_jax` turns the persistent
    compilation cache off).
    """
    lower_s, compile_s, compiled = [], [], None
    for _ in range(max(1, reps)):
        jax.clear_caches()
        fn = make()
        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        lower_s.append(t1 - t0)
        compile_s.append(t2 - t1)
    med = statistics.median
    return Compiled(compiled, med(lower_s), med(compile_s), jax.jit(make()))


def warm_up_jax() -> None:
    """Pay JAX's one-time start-up costs (backend, first compile) outside any measurement.

    Also turns JAX's persistent compilation cache off, so that compile times are cold ones.
    """
    jax.config.update("jax_enable_compilation_cache", False)
    block(jax.jit(lambda x: x + 1)(1.0))


# --- formatting -----------------------------------------------------------------------------


def fmt_time(seconds: float | None) -> str:
    """Seconds in s, ms or µs, three significant digits."""
    return _fmt_auto_unit(seconds, "n/a")


def fmt_timing(t: Timing | None) -> str:
    """``median (min)``, with ``*`` when measured on a reduced schedule."""
    if t is None:
        return "n/a"
    mark = "*" if t.reduced else ""
    return f"{fmt_time(t.median)} ({fmt_time(t.best)}){mark}"


def fmt_seconds(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f}"


def fmt_compile(c: Compiled | None) -> str:
    """``total (trace+lower part)`` in seconds."""
    return "n/a" if c is None else f"{c.total_s:.2f} ({c.lower_s:.2f})"


def fmt_ratio(value: float | None, ref: float | None) -> str:
    if value is None or ref is None or ref <= 0:
        return "n/a"
    return f"{value / ref:.2f}x"


def fmt_bytes(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


def fmt_diff(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2e}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row):
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "| " + " | ".join(parts) + " |"

    sep = "|" + "|".join(
        (":" + "-" * (w + 1)) if i == 0 else ("-" * (w + 1) + ":") for i, w in enumerate(widths)
    )
    return "\n".join([line(cells[0]), sep + "|", *(line(r) for r in cells[1:])])


def load_average() -> str:
    try:
        return "load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "load average n/a"


def odegrad_revision() -> str:
    """odegrad's version and, in a git checkout, its commit (``+dirty`` with local changes)."""
    try:
        import odegrad
    except ImportError:
        return "odegrad not installed"
    text = f"odegrad {getattr(odegrad, '__version__', '?')}"
    src = os.path.dirname(os.path.abspath(odegrad.__file__))
    try:
        rev = subprocess.run(
            ["git", "-C", src, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        dirty = subprocess.run(
            ["git", "-C", src, "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return text
    if rev.returncode == 0:
        text += f" @ {rev.stdout.strip()}" + ("+dirty" if dirty.stdout.strip() else "")
    return text


def environment() -> str:
    """One line naming the software and machine (and how busy it is), to print above tables."""
    dev = jax.devices()[0]
    return (
        f"{odegrad_revision()}, jax {jax.__version__} ({dev.platform}, {dev.device_kind}), "
        f"python {platform.python_version()}, {os.cpu_count()} CPU cores, x64="
        f"{jax.config.jax_enable_x64}, {load_average()}"
    )


# --- machine-readable results (``--json PATH``), aggregated by ``python -m odegrad bench`` ----

#: The libraries the summary of ``python -m odegrad bench`` puts side by side, in this order.
LIBRARIES = ("odegrad", "lax.scan", "diffrax", "torchdiffeq", "scipy")


def result_row(
    problem: str,
    method: str,
    library: str,
    forward: Timing | float | None = None,
    gradient: Timing | float | None = None,
    compile_forward: Compiled | float | None = None,
    compile_gradient: Compiled | float | None = None,
) -> dict:
    """One key row of a benchmark for ``--json``: seconds per call (the median of a
    :class:`Timing`, or a given number) and cold compile seconds (trace+lower + XLA compile)."""
    if library not in LIBRARIES:
        raise ValueError(f"library {library!r} is not one of {LIBRARIES}")

    def secs(x):
        if x is None:
            return None
        if isinstance(x, Timing):
            return x.median
        if isinstance(x, Compiled):
            return x.total_s
        return float(x)

    return {
        "problem": problem,
        "method": method,
        "library": library,
        "forward_s": secs(forward),
        "gradient_s": secs(gradient),
        "compile_forward_s": secs(compile_forward),
        "compile_gradient_s": secs(compile_gradient),
    }


def write_json(
    path: str | None, benchmark: str, rows: Sequence[dict], settings: str = "", notes=()
) -> None:
    """Write ``rows`` (:func:`result_row`) to ``path`` as JSON; nothing when ``path`` is None."""
    if not path:
        return
    import json

    doc = {
        "schema": 1,
        "benchmark": benchmark,
        "environment": environment(),
        "settings": settings,
        "rows": list(rows),
        "notes": list(notes),
    }
    dirname = os.path.dirname(os.path.abspath(path))
    os.makedirs(dirname, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")
