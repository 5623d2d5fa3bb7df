"""The documentation builds cleanly (``mkdocs build --strict``) and the examples it walks
through run (``python examples/<name>.py --quick``), each in a subprocess from the repo root."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_TIMEOUT_S = 300


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's end-of-life banner
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip(
            "mkdocs is not installed: pip install mkdocs-material 'mkdocstrings[python]' "
            "(both are in the `test` extra)"
        )
    proc = _run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def test_api_reference_names_every_public_name():
    import re

    import odegrad as og

    documented = set(re.findall(r"::: odegrad\.(\w+)", (ROOT / "docs" / "api.md").read_text()))
    modules = {"solvers", "stencil"}  # rendered as modules (odegrad.solvers.tableaus, stencil)
    assert set(og.__all__) - documented - modules == set()


def _run_example(name: str) -> str:
    proc = _run([sys.executable, str(ROOT / "examples" / name), "--quick"], EXAMPLE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_example_mixed_state_gpu():
    """Seed 000 (about 20 s on 2 CPU cores)."""
    out = _run_example("mixed_state_gpu.py")
    assert "largest relative difference between adjoints" in out


@pytest.mark.slow  # a long compile; the docs' other examples stay in the default run
def test_example_diffusion3d():
    """Seed 001 (about 11 s on 2 CPU cores)."""
    out = _run_example("diffusion3d.py")
    assert "finite differences" in out


def test_example_wave_scan_parity():
    """Seed 004 (a few seconds)."""
    out = _run_example("wave_scan_parity.py")
    assert "max |gradient difference|" in out


@pytest.mark.slow
def test_example_brusselator2d():
    """Issue 6: a stiff PDE with GMRES and a parameter gradient (about 15 s wall on 2 busy CPU
    cores, mostly compilation)."""
    out = _run_example("brusselator2d.py")
    assert "finite differences" in out


@pytest.mark.slow  # a long compile; the default run covers its mechanism: an equinox module as
# args (test_batched.py::test_equinox_module_as_args_matches_closure), vmapped gradients equal
# to each member's (test_batched.py::test_vmap_gradient_equals_each_member) and an optax fit
# through og.solve (test_cli.py::test_demo_heat_recovers_ci)
def test_example_neural_ode():
    """Issue 12: an equinox MLP as args, trained with optax under vmap (about 17 s)."""
    pytest.importorskip("equinox")
    pytest.importorskip("optax")
    out = _run_example("neural_ode.py")
    assert "final loss on all 256 trajectories" in out


@pytest.mark.slow  # a long compile; the docs' other examples stay in the default run
def test_example_bouncing_ball():
    """Issue 14: restitution and drop height fitted through the bounces (about 10 s); the
    fit must land near the truth, not merely run."""
    pytest.importorskip("optax")
    out = _run_example("bouncing_ball.py")
    fitted = {
        line.split()[0].rstrip(":"): float(line.split()[2].rstrip(","))
        for line in out.splitlines()
        if "fitted" in line
    }
    assert abs(fitted["h0"] - 1.2) < 0.05 and abs(fitted["e"] - 0.8) < 0.03, out


@pytest.mark.slow  # two fits, each compiled (about 20 s)
def test_example_infusion():
    """An infusion's stop time is fitted only with the events og.switching_events reads from
    f's where; without them its gradient is 0 and it stays at the first guess."""
    pytest.importorskip("optax")
    out = _run_example("infusion.py")
    with_events, without = out.split("without events:")
    fitted = [
        {ln.split()[0].rstrip(":"): float(ln.split()[2].rstrip(",")) for ln in part.splitlines()
         if "fitted" in ln}
        for part in (with_events, without)
    ]  # fmt: skip
    assert abs(fitted[0]["tau"] - 2.0) < 0.1 and abs(fitted[0]["k"] - 0.35) < 0.02, out
    assert fitted[1]["tau"] == 1.2, out
