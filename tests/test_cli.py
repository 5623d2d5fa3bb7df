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
