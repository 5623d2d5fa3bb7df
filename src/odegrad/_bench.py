"""``python -m odegrad bench``: run the benchmark scripts of a source checkout and merge their
key rows into one table and a chart."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

KNOWN_BENCHMARKS = (
    "wave_scan_parity.py",
    "lotka_volterra.py",
    "diffusion3d.py",
    "stiff.py",
    "neural_ode.py",
)
#: scripts that compare odegrad with itself, not with other libraries (run by hand)
NOT_IN_BENCH = ("parity.py",)


def _is_odegrad_checkout(root: Path) -> bool:
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or not (root / "benchmarks").is_dir():
        return False
    try:
        return 'name = "odegrad"' in pyproject.read_text(encoding="utf-8")
    except OSError:
        return False


def find_benchmarks_dir() -> Path | None:
    """``benchmarks/`` of the checkout this package runs from (editable install), else of cwd."""
    here = Path(__file__).resolve().parent  # <root>/src/odegrad in a checkout
    for root in (here.parent.parent, Path.cwd()):
        if _is_odegrad_checkout(root):
            return root / "benchmarks"
    return None


def benchmark_scripts(bench_dir: Path) -> list[Path]:
    scripts = []
    for path in sorted(bench_dir.glob("*.py")):
        if path.name.startswith("_") or path.name in NOT_IN_BENCH:
            continue
        try:
            if "__main__" not in path.read_text(encoding="utf-8"):
                continue  # a helper module, not a script
        except OSError:
            continue
        scripts.append(path)
    order = {name: i for i, name in enumerate(KNOWN_BENCHMARKS)}
    return sorted(scripts, key=lambda p: (order.get(p.name, len(order)), p.name))


def run_bench(
    quick: bool, names: list[str], bench_dir: str | None, out: str | Path = "odegrad-bench"
) -> int:
    """Run the benchmark scripts (each its own process, its own tables), then print one summary
    table of their ``--json`` key rows and plot it into ``out``."""
    found = Path(bench_dir) if bench_dir else find_benchmarks_dir()
    if found is None or not found.is_dir():
        where = bench_dir or "the source checkout of this odegrad, or the current directory"
        print(
            f"No benchmarks/ folder found in {where}. The benchmarks are not part of the "
            "installed package (e.g. a wheel): clone the odegrad repository, "
            'pip install -e ".[bench]", and run `python -m odegrad bench` inside the clone '
            "(or pass --dir PATH/TO/benchmarks).",
            file=sys.stderr,
        )
        return 2
    scripts = benchmark_scripts(found)
    if names:
        wanted = {n if n.endswith(".py") else n + ".py" for n in names}
        missing = wanted - {p.name for p in scripts}
        if missing:
            print(f"not in {found}: {', '.join(sorted(missing))}", file=sys.stderr)
            return 2
        scripts = [p for p in scripts if p.name in wanted]
    else:
        scripts = [p for p in scripts if p.name in KNOWN_BENCHMARKS]  # the suite
    if not scripts:
        print(f"{found} holds no benchmark scripts yet.")
        return 0
    root = found.parent
    out = Path(out)
    json_dir = out / "json"
    json_dir.mkdir(parents=True, exist_ok=True)
    results, json_paths = [], []
    t_all = time.perf_counter()
    for script in scripts:
        cmd = [sys.executable, str(script), *(["--quick"] if quick else [])]
        json_path = json_dir / f"{script.stem}.json"
        json_path.unlink(missing_ok=True)
        if _accepts_json(script):
            cmd += ["--json", str(json_path.resolve())]
            json_paths.append(json_path)
        print(f"=== {script.relative_to(root)} {'--quick' if quick else ''}".rstrip(), flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=root, env=os.environ.copy())
        dt = time.perf_counter() - t0
        results.append((script.name, rc, dt))
        print(f"=== {script.name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {dt:.1f} s\n")
    print("benchmark scripts:")
    for name, rc, dt in results:
        print(f"  {name:<32} {'ok' if rc == 0 else f'FAILED (exit {rc})':<18} {dt:7.1f} s")
    docs = load_bench_json([p for p in json_paths if p.is_file()])
    if docs:
        print()
        print(summarize_bench(docs, out))
    print(f"\nbench total {time.perf_counter() - t_all:.0f} s")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


def _accepts_json(script: Path) -> bool:
    try:
        return '"--json"' in script.read_text(encoding="utf-8")
    except OSError:
        return False


#: The libraries of the summary, in its column order (``benchmarks/_timing.py`` LIBRARIES).
BENCH_LIBRARIES = ("odegrad", "lax.scan", "diffrax", "torchdiffeq", "scipy")
BENCH_QUANTITIES = (
    ("gradient_s", "gradient"),
    ("forward_s", "forward"),
    ("compile_gradient_s", "compile gradient"),
)


def load_bench_json(paths) -> list[dict]:
    """The documents the benchmark scripts wrote with ``--json``, in the order given."""
    import json

    docs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            docs.append(json.load(f))
    return docs


def fmt_seconds(seconds: float | None, missing: str = "—") -> str:
    """Seconds in s, ms or µs, three significant digits (``missing`` for None)."""
    if seconds is None:
        return missing
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def bench_summary(docs) -> tuple[list[str], dict]:
    """``(problems, best)``: ``best[problem][library]`` is that library's fastest method on the
    problem (by gradient time, else forward time), as its row of the JSON."""
    problems, best = [], {}
    for doc in docs:
        for row in doc.get("rows", []):
            prob, lib = row["problem"], row["library"]
            if prob not in best:
                problems.append(prob)
                best[prob] = {}

            def key(r):
                return (r.get("gradient_s") is None, r.get("gradient_s") or r.get("forward_s") or 0)

            if lib not in best[prob] or key(row) < key(best[prob][lib]):
                best[prob][lib] = row
    return problems, best


def bench_table(docs) -> str:
    """One markdown table: per problem and quantity, each library's time and its ratio to
    odegrad's (``x``: the library takes that many times odegrad's time)."""
    problems, best = bench_summary(docs)
    libs = [lib for lib in BENCH_LIBRARIES if any(lib in best[p] for p in problems)]
    libs += sorted({lib for p in problems for lib in best[p]} - set(libs))
    headers = ["problem", "quantity", *libs]
    rows = []
    for prob in problems:
        ref = best[prob].get("odegrad")
        for field, label in BENCH_QUANTITIES:
            if all(best[prob][lib].get(field) is None for lib in best[prob]):
                continue
            cells = [prob, label]
            for lib in libs:
                row = best[prob].get(lib)
                value = None if row is None else row.get(field)
                cell = fmt_seconds(value)
                ref_value = None if ref is None else ref.get(field)
                if value is not None and ref_value and lib != "odegrad":
                    cell += f" ({value / ref_value:.2f}x)"
                cells.append(cell)
            rows.append(cells)
    cells = [headers, *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def plot_bench(docs, out: Path) -> Path:
    """Bar chart (log scale) of each library's gradient time per problem: ``out/bench.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    problems, best = bench_summary(docs)
    libs = [lib for lib in BENCH_LIBRARIES if any(lib in best[p] for p in problems)]
    libs += sorted({lib for p in problems for lib in best[p]} - set(libs))
    x = np.arange(len(problems))
    width = 0.8 / max(1, len(libs))
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(problems) + 2), 4.5))
    for i, lib in enumerate(libs):
        values = [
            (best[p].get(lib) or {}).get("gradient_s") or np.nan for p in problems
        ]  # nan: not measured, no bar
        bars = ax.bar(x + (i - (len(libs) - 1) / 2) * width, values, width, label=lib)
        for b, v in zip(bars, values, strict=True):
            if np.isfinite(v):
                ax.annotate(
                    fmt_seconds(v), (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                    fontsize=7, rotation=90, xytext=(0, 2), textcoords="offset points",
                )  # fmt: skip
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([textwrap.fill(p, 22) for p in problems], fontsize=8)
    ax.set_xlim(-0.5, len(problems) - 0.5)
    ax.set_ylabel("gradient time per call (s, log scale)")
    ax.set_title("odegrad bench: gradient time per problem (each library's fastest method)")
    ax.legend(fontsize="small")
    ax.margins(y=0.25)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summarize_bench(docs, out: str | Path) -> str:
    """The summary: the table, the method behind each cell, notes, and the chart's path."""
    problems, best = bench_summary(docs)
    lines = ["## odegrad bench summary", ""]
    envs = sorted({d.get("environment", "") for d in docs} - {""})
    lines += envs[:1] + ([""] if envs else [])
    lines.append(bench_table(docs))
    lines.append("")
    lines.append(
        "Time per call (median over interleaved rounds; diffusion3d: the best); ratios "
        "(Nx) are to odegrad's on the same problem. Each cell is the library's fastest method:"
    )
    for prob in problems:
        chosen = ", ".join(f"{lib}: {row['method']}" for lib, row in best[prob].items())
        lines.append(f"- {prob}: {chosen}")
    for doc in docs:
        if doc.get("settings"):
            lines.append(f"- {doc['benchmark']} settings: {doc['settings']}")
        lines += [f"- {note}" for note in doc.get("notes", [])]
    if importlib.util.find_spec("matplotlib") is not None:
        lines.append(f"\nwrote {plot_bench(docs, Path(out))}")
    else:
        lines.append('\nmatplotlib is not installed: no chart (pip install "odegrad[plot]").')
    return "\n".join(lines)


# --- entry point ---------------------------------------------------------------------------------
