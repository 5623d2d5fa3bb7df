"""``python -m odegrad demo``, run in-process on a small grid: it prints, plots, and the
recovered heat-capacity field gets closer to the truth."""

from __future__ import annotations

import re

import pytest

from odegrad import cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _field_errors(text: str) -> list[float]:
    """The ``field err`` column of the per-iteration lines."""
    e = r"(-?\d\.\d+e[+-]\d+)"
    rows = re.findall(rf"^\s*\d+\s+{e}\s+{e}\s+{e}\s+\S+\s+\S+\s*$", text, flags=re.M)
    return [float(err) for _, _, err in rows]


def test_demo_heat_recovers_ci(tmp_path, capsys):
    pytest.importorskip("optax")
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo"
    rc = cli.main(["demo", "--n", "10", "--iters", "20", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "compiled the loss-and-gradient step in" in text
    assert "nan" not in text.lower()

    errors = _field_errors(text)
    assert len(errors) == 20, text
    final = re.search(r"initial (\S+) -> final (\S+) \(decreased", text)
    assert final is not None, text
    initial_err, final_err = float(final.group(1)), float(final.group(2))
    assert initial_err == pytest.approx(errors[0], rel=1e-3)
    assert final_err < 0.5 * initial_err

    for name in ("loss.png", "ci.png"):
        path = out / name
        assert path.is_file(), name
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR" and len(data) > 1000, name


def test_demo_lv_without_optax(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "lv"
    rc = cli.main(["demo", "--problem", "lv", "--no-optax", "--iters", "60", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "built-in Adam" in text
    assert len(_field_errors(text)) == 60, text
    assert re.search(r"initial \S+ -> final \S+ \(decreased", text), text
    for name in ("loss.png", "fit.png"):
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE, name


# --- bench: the aggregation of the scripts' --json results (fake ones, not the benchmarks) ------

FAKE_DOCS = [
    {
        "schema": 1,
        "benchmark": "wave_scan_parity",
        "environment": "fake machine",
        "settings": "N=8",
        "rows": [
            {"problem": "wave", "method": "scan", "library": "lax.scan",
             "forward_s": 0.010, "gradient_s": 0.030, "compile_gradient_s": 1.0},
            {"problem": "wave", "method": "scan + checkpoint", "library": "lax.scan",
             "forward_s": 0.011, "gradient_s": 0.040, "compile_gradient_s": 1.5},
            {"problem": "wave", "method": "odegrad StepTo(t)", "library": "odegrad",
             "forward_s": 0.012, "gradient_s": 0.060, "compile_gradient_s": 2.0},
            {"problem": "wave", "method": "diffrax StepTo", "library": "diffrax",
             "forward_s": 0.024, "gradient_s": 0.120, "compile_gradient_s": 4.0},
        ],
        "notes": [],
    },
    {
        "schema": 1,
        "benchmark": "lotka_volterra",
        "environment": "fake machine",
        "settings": "rtol=1e-6",
        "rows": [
            {"problem": "LV", "method": "odegrad Auto()", "library": "odegrad",
             "forward_s": 1e-4, "gradient_s": 5e-4, "compile_gradient_s": 3.0},
            {"problem": "LV", "method": "torchdiffeq dopri5 odeint_adjoint",
             "library": "torchdiffeq", "forward_s": 2e-3, "gradient_s": 1e-2,
             "compile_gradient_s": None},
        ],
        "notes": ["LV note"],
    },
]  # fmt: skip


def _cells(table: str) -> dict:
    """``(problem, quantity) -> {column: cell}`` of the summary's markdown table."""
    lines = [ln for ln in table.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    out = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        out[(cells[0], cells[1])] = dict(zip(header, cells, strict=True))
    return out


def test_bench_summary_table_and_chart(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    paths = []
    for doc in FAKE_DOCS:
        paths.append(tmp_path / f"{doc['benchmark']}.json")
        paths[-1].write_text(json.dumps(doc))
    docs = cli.load_bench_json(paths)
    text = cli.summarize_bench(docs, tmp_path / "out")

    header = next(ln for ln in text.splitlines() if ln.startswith("| problem"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "problem", "quantity", "odegrad", "lax.scan", "diffrax", "torchdiffeq",
    ]  # fmt: skip
    cells = _cells(text)
    # the fastest method of each library (the plain scan), ratios to odegrad's time
    assert cells[("wave", "gradient")]["odegrad"] == "60 ms"
    assert cells[("wave", "gradient")]["lax.scan"] == "30 ms (0.50x)"
    assert cells[("wave", "gradient")]["diffrax"] == "120 ms (2.00x)"
    assert cells[("wave", "gradient")]["torchdiffeq"] == "—"
    assert cells[("wave", "compile gradient")]["lax.scan"] == "1 s (0.50x)"
    assert cells[("LV", "gradient")]["torchdiffeq"] == "10 ms (20.00x)"
    assert cells[("LV", "forward")]["odegrad"] == "100 µs"
    assert cells[("LV", "compile gradient")]["torchdiffeq"] == "—"
    assert "lax.scan: scan," in text and "LV note" in text

    png = tmp_path / "out" / "bench.png"
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000
    assert f"wrote {png}" in text


def test_bench_runs_scripts_and_aggregates(tmp_path, capfd):
    """``bench`` passes --quick and --json to each script and summarises what they wrote."""
    pytest.importorskip("matplotlib")
    import json

    bench = tmp_path / "benchmarks"
    bench.mkdir()
    for doc in FAKE_DOCS:
        (bench / f"{doc['benchmark']}.py").write_text(
            "import json, sys\n"
            'assert "--quick" in sys.argv\n'
            'path = sys.argv[sys.argv.index("--json") + 1]\n'
            f"json.dump({json.dumps(doc)!r} and json.loads({json.dumps(doc)!r}), "
            'open(path, "w"))\n'
            'if __name__ == "__main__":\n    print("fake table")\n'
        )
    out = tmp_path / "out"
    rc = cli.main(["bench", "--quick", "--dir", str(bench), "--out", str(out)])
    text = capfd.readouterr().out
    assert rc == 0, text
    assert text.count("fake table") == 2
    assert "## odegrad bench summary" in text
    assert _cells(text)[("wave", "gradient")]["diffrax"] == "120 ms (2.00x)"
    assert (out / "bench.png").read_bytes()[:8] == PNG_SIGNATURE
