"""Scale-out: sharded solves with halo exchange, ensembles over devices, several processes.

Several devices are simulated with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``, which
must be set before JAX starts: those tests run this file as a script in a subprocess (``python
tests/test_scaleout.py CASE``), which prints one JSON line of measured figures for the test to
check. The 2-process test runs ``examples/multiprocess_diffusion.py`` (``jax.distributed`` on
localhost, gloo CPU collectives).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(ROOT, "src")


def run_case(case: str, devices: int, timeout: float = 600) -> dict:
    env = dict(os.environ)
    # the suite's compile-time flags (conftest.py) are kept: without them a case compiles ~2x longer
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), case],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"case {case!r} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    # the error's host callback is sent summaries of sharded leaves, not the leaves, which XLA
    # would gather onto one device (in a branch that a successful solve never runs)
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------
# the cases, run in a subprocess with several devices
# ------------------------------------------------------------------------------------------------


def _rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _spec(x) -> list:
    """The sharding spec of ``x``, padded with None to its rank (comparable across axis types)."""
    spec = list(x.sharding.spec)
    return [list(e) if isinstance(e, tuple) else e for e in spec + [None] * (x.ndim - len(spec))]


def case_stencil() -> dict:
    """Sharded right-hand sides (generic wrapper, hand-written, overlapped) equal the unsharded
    one, values and VJPs, on several meshes and both axis types; no all-gather in the program."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import odegrad as og
    from odegrad.problems import diffusion3d

    p = diffusion3d(12, dtype=jnp.float64)
    args = (p.lam, p.Ci)
    ref = jax.jit(p.rhs)(0.0, p.T0, args)
    w = jnp.sin(jnp.arange(p.T0.size, dtype=jnp.float64)).reshape(p.T0.shape)

    def vjp_of(rhs, T, Ci):
        return jax.vjp(lambda T_, C_: rhs(0.0, T_, (p.lam, C_)), T, Ci)[1](w)

    ref_vjp = jax.jit(lambda T, C: vjp_of(p.rhs, T, C))(p.T0, p.Ci)
    worst, worst_vjp, gathers, permutes, specs_ok = 0.0, 0.0, 0, 0, True
    for types in (AxisType.Explicit, AxisType.Auto):
        for shape, spec in [((2, 2), P("x", "y")), ((4, 1), P("x")), ((2, 2), P(None, ("x", "y")))]:
            mesh = jax.make_mesh(shape, ("x", "y"), axis_types=(types, types))
            sh = NamedSharding(mesh, spec)
            T, Ci = jax.device_put(p.T0, sh), jax.device_put(p.Ci, sh)
            variants = {
                "sharded": og.stencil.sharded(p.rhs, mesh, (P(), spec, (P(), spec)), spec),
                "hand": p.sharded_rhs(mesh, spec),
                "overlap": p.sharded_rhs(mesh, spec, overlap=True),
            }
            for rhs in variants.values():
                fwd = jax.jit(lambda T_, C_, rhs=rhs: rhs(0.0, T_, (p.lam, C_)))
                compiled = fwd.lower(T, Ci).compile()  # one compile: its text and its values
                out, hlo = compiled(T, Ci), compiled.as_text()
                gathers += hlo.count("all-gather")
                permutes += hlo.count("collective-permute")
                g = jax.jit(lambda T_, C_, rhs=rhs: vjp_of(rhs, T_, C_))(T, Ci)
                worst = max(worst, _rel(out, ref))
                worst_vjp = max(worst_vjp, *(_rel(a, b) for a, b in zip(g, ref_vjp, strict=True)))
                want = _spec(T)
                specs_ok &= _spec(out) == want and all(_spec(x) == want for x in g)
    # exchange_halo, periodic, against numpy
    mesh = jax.make_mesh((4,), ("x",))
    x = np.arange(16.0)
    ext = jax.jit(
        jax.shard_map(
            lambda b: og.stencil.exchange_halo(b, ("x",), 2, periodic=True),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
        )
    )(jax.device_put(x, NamedSharding(mesh, P("x"))))
    want = np.concatenate([np.concatenate([np.roll(x, 2)[4 * i : 4 * i + 2], x[4 * i : 4 * i + 4],
                                           np.roll(x, -2)[4 * i + 2 : 4 * i + 4]])
                           for i in range(4)])  # fmt: skip
    return {
        "max_rel": worst,
        "max_rel_vjp": worst_vjp,
        "all_gathers": gathers,
        "collective_permutes": permutes,
        "specs_ok": bool(specs_ok),
        "periodic_err": float(np.max(np.abs(np.asarray(ext) - want))),
    }


def _diffusion_case(n: int, tol: float, explicit: bool = True) -> dict:
    """Seed 001 with ROCK2 + Interpolating on a 2x2 mesh against one device: loss, dL/dlam and
    the whole dL/dCi, compiled temporary memory per device, where the gradient lives."""
    import time

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import odegrad as og
    from odegrad.problems import diffusion3d

    p = diffusion3d(n, dtype=jnp.float64)

    def value_and_grad(rhs):
        def loss(lam, Ci, T0):
            sol = og.solve(
                rhs,
                T0,
                (0.0, p.t1),
                (lam, Ci),
                solver=og.ROCK2(p.spectral_radius),
                step=og.Adaptive(tol, tol),
                adjoint=og.Interpolating(),
            )
            return jnp.sum(sol.ys[-1])

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    def measure(fn, args):
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        t1 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        t2 = time.perf_counter()
        temp = compiled.memory_analysis().temp_size_in_bytes
        return out, temp, t1 - t0, t2 - t1

    one = jax.devices()[:1]
    mesh1 = jax.make_mesh((1,), ("x",), devices=one)
    rep1 = NamedSharding(mesh1, P())
    args1 = tuple(jax.device_put(x, rep1) for x in (p.lam, p.Ci, p.T0))
    (v1, (gl1, gc1)), temp1, c1, r1 = measure(value_and_grad(p.rhs), args1)

    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(kind, kind))
    field = NamedSharding(mesh, P("x", "y"))
    args4 = (p.lam, jax.device_put(p.Ci, field), jax.device_put(p.T0, field))
    (v4, (gl4, gc4)), temp4, c4, r4 = measure(value_and_grad(p.sharded_rhs(mesh)), args4)
    return {
        "n": n,
        "rel_loss": _rel(v4, v1),
        "rel_g_lam": _rel(gl4, gl1),
        "rel_g_ci": _rel(gc4, gc1),
        "temp_1": int(temp1),
        "temp_4": int(temp4),
        "temp_ratio": temp4 / temp1,
        "g_ci_devices": sorted(s.device.id for s in gc4.addressable_shards),
        "g_ci_shard_shape": list(gc4.addressable_shards[0].data.shape),
        "g_ci_spec": _spec(gc4),
        "ci_spec": _spec(args4[1]),
        "compile_s": [c1, c4],
        "run_s": [r1, r4],
    }


def case_diffusion_small() -> dict:
    return _diffusion_case(16, 1e-4)


def case_diffusion_48() -> dict:
    return _diffusion_case(48, 1e-6)


def case_adjoints() -> dict:
    """Every adjoint keeps a sharded state and args sharded, and agrees with one device: a 2-d
    heat equation on a 4-device mesh with the generic :func:`og.stencil.sharded` right-hand side."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import odegrad as og
    import odegrad.stencil as st

    n = 16
    x = np.linspace(0, 1, n)
    u0 = jnp.asarray(np.outer(np.sin(np.pi * x), np.sin(2 * np.pi * x)) + 0.1)
    kappa = jnp.asarray(1.0 + 0.5 * np.outer(x, 1 - x))

    def rhs(t, u, k):
        return st.set_inner(jnp.zeros_like(u), st.inn(k) * st.laplacian(u, 1.0 / (n - 1)))

    mesh = jax.make_mesh((4,), ("x",))
    field = P("x")
    srhs = og.stencil.sharded(rhs, mesh, (P(), field, field), field)
    sh = NamedSharding(mesh, field)
    us, ks = jax.device_put(u0, sh), jax.device_put(kappa, sh)
    adjoints = {
        "Discrete": (og.Discrete(), og.Fixed(1e-4)),
        "Discrete(3)": (og.Discrete(checkpoints=3), og.Fixed(1e-4)),
        "Interpolating": (og.Interpolating(), og.Adaptive(1e-6, 1e-6)),
        "Interpolating(3)": (og.Interpolating(checkpoints=3), og.Adaptive(1e-6, 1e-6)),
        "Quadrature": (og.Quadrature(), og.Adaptive(1e-6, 1e-6)),
        "Backsolve": (og.Backsolve(on_drift="warn"), og.Adaptive(1e-6, 1e-6)),
    }
    out = {}
    for name, (adjoint, step) in adjoints.items():

        def loss(u, k, f, adjoint=adjoint, step=step):
            sol = og.solve(f, u, (0.0, 2e-3), k, step=step, adjoint=adjoint, max_steps=64)
            return jnp.sum(sol.ys[-1] ** 2)

        g1 = jax.jit(jax.grad(lambda u, k: loss(u, k, rhs), argnums=(0, 1)))(u0, kappa)
        g4 = jax.jit(jax.grad(lambda u, k: loss(u, k, srhs), argnums=(0, 1)))(us, ks)
        out[name] = {
            "rel": max(_rel(a, b) for a, b in zip(g4, g1, strict=True)),
            "specs": [_spec(g) for g in g4],
        }
    return out


def case_ensemble() -> dict:
    """A parameter sweep: ``og.ensemble`` of ``value_and_grad`` over lam, the batch sharded over
    4 devices, equals solving member by member."""
    import jax
    import jax.numpy as jnp

    import odegrad as og
    from odegrad.problems import diffusion3d

    p = diffusion3d(8, dtype=jnp.float64, steps=10)

    def loss(lam):
        sol = og.solve(p.rhs, p.T0, (0.0, p.t1), (lam, p.Ci), step=og.Adaptive(1e-6, 1e-6))
        return jnp.sum(sol.ys[-1] ** 2)

    mesh = jax.make_mesh((4,), ("batch",))
    lams = jnp.linspace(0.5, 2.0, 8)
    values, grads = jax.jit(og.ensemble(jax.value_and_grad(loss), mesh))(lams)
    one = jax.jit(jax.value_and_grad(loss))
    ref = [one(lam) for lam in lams]
    try:  # a failed member is named by its place in the whole batch, not its device's block
        jax.block_until_ready(jax.jit(og.ensemble(loss, mesh))(lams.at[5].set(jnp.inf)))
        failed = "no error"
    except Exception as e:  # the callback's error, wrapped by XLA
        failed = str(e).splitlines()[-1]
    return {
        "rel_values": _rel(values, jnp.stack([r[0] for r in ref])),
        "rel_grads": _rel(grads, jnp.stack([r[1] for r in ref])),
        "devices": sorted(s.device.id for s in grads.addressable_shards),
        "spec": _spec(grads),
        "failed": failed,
    }


def case_sharding_types() -> dict:
    """What sharding adds to the types: a state sharded over a mesh with Explicit axes
    (``jax.make_mesh``'s default) with the save times or ``t1`` traced (made inside
    ``jax.jit``, or differentiated) solves as unsharded, and ``jax.grad`` without ``jax.jit``
    says to add it; ``laplacian(pad=True)`` inside ``jax.shard_map`` keeps the varying manual
    axes its gradient's types need."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import odegrad as og

    f = lambda t, y, a: a * (jnp.roll(y, 1) - 2 * y + jnp.roll(y, -1))
    y0 = jnp.sin(jnp.linspace(0, 2 * np.pi, 64, endpoint=False)) + 1.0
    mesh = jax.make_mesh((4,), ("x",))
    ys = jax.device_put(y0, NamedSharding(mesh, P("x")))

    def saves(y):
        return og.solve(f, y, (0.0, 0.1), 2.0, saveat=og.SaveAt(ts=jnp.array([0.05, 0.1]))).ys

    def end(T, y):
        return og.solve(f, y, (0.0, T), 2.0).ys.sum()

    d_end = jax.jit(jax.grad(end, argnums=(0, 1)))
    out = {
        "saves": _rel(jax.jit(saves)(ys), saves(y0)),
        "d_end": max(_rel(a, b) for a, b in zip(d_end(0.1, ys), d_end(0.1, y0), strict=True)),
    }
    try:
        jax.grad(end, argnums=1)(0.1, ys)
        out["eager_grad"] = "no error"
    except ValueError as e:
        out["eager_grad"] = str(e)

    auto = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    A = jnp.asarray(np.random.default_rng(0).standard_normal((12, 5, 4)))
    lap = lambda X: X + og.stencil.laplacian(X, (0.5, 0.25, 2.0), pad=True)
    blocks = jax.jit(jax.shard_map(lap, mesh=auto, in_specs=P("x"), out_specs=P("x")))
    g = jax.grad(lambda X: jnp.sum(blocks(X) ** 2))(A)
    ref = jax.grad(lambda X: sum(jnp.sum(lap(X[i : i + 3]) ** 2) for i in range(0, 12, 3)))(A)
    out["shard_map_grad"] = _rel(g, ref)
    # A failed sharded solve raises (a callback on device 0 alone raising left the others
    # waiting for it in a collective: XLA aborted the process), naming what one device would.
    blow = lambda t, y, a: jnp.where(t > 0.05, y / 0.0, -y)
    cases = {
        "nan_y0": (y0.at[37].set(jnp.nan), {}),
        "runs_on": (y0, {"step": og.Fixed(0.01), "saveat": og.SaveAt(steps=True)}),
    }
    for name, (y, kw) in cases.items():
        run = jax.jit(lambda y, kw=kw: og.solve(blow, y, (0, 0.1), **kw).ys)
        for where, y_ in (("one", y), ("mesh", jax.device_put(y, NamedSharding(mesh, P("x"))))):
            try:
                jax.block_until_ready(run(y_))
                out[f"{name}_{where}"] = "no error"
            except Exception as e:  # the callback's error, wrapped by XLA
                out[f"{name}_{where}"] = str(e).splitlines()[-1]
    # over Auto axes no context names the mesh: odegrad's own shard_map notes it
    sblow = og.stencil.sharded(blow, auto, (P(), P("x"), P()), P("x"))
    try:
        run = jax.jit(lambda y: og.solve(sblow, y, (0, 0.1), step=og.Fixed(0.01)).ys)
        jax.block_until_ready(run(jax.device_put(y0, NamedSharding(auto, P("x")))))
        out["auto_stencil"] = "no error"
    except Exception as e:
        out["auto_stencil"] = str(e).splitlines()[-1]
    return out


# ------------------------------------------------------------------------------------------------
# the tests
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # 14-38 s on 2 cores: kept out of the default run's 15 minutes
def test_sharded_stencils_exchange_halos_only():
    r = run_case("stencil", 4)
    assert r["max_rel"] < 1e-14, r
    assert r["max_rel_vjp"] < 1e-14, r
    assert r["all_gathers"] == 0 and r["collective_permutes"] > 0, r
    assert r["specs_ok"], r
    assert r["periodic_err"] == 0.0, r


def _check_diffusion(r):
    assert r["rel_loss"] <= 1e-12 and r["rel_g_lam"] <= 1e-12, r
    assert r["rel_g_ci"] <= 1e-12, r
    assert r["temp_ratio"] <= 0.45, r
    assert r["g_ci_devices"] == [0, 1, 2, 3], r
    assert r["g_ci_spec"] == r["ci_spec"] == ["x", "y", None], r
    n = r["n"]
    assert r["g_ci_shard_shape"] == [n // 2, n // 2, n], r


@pytest.mark.slow
def test_sharded_diffusion_equals_one_device():
    """Seed 001 (16^3, ROCK2, Interpolating) on a 2x2 mesh: equal to one device, <= 0.45 of
    its temporary memory per device, gradient spread over the 4 devices."""
    _check_diffusion(run_case("diffusion_small", 4))


@pytest.mark.slow
def test_sharded_diffusion_48_equals_one_device():
    """The issue's figures: 48^3, ROCK2 + Interpolating, 2x2 mesh."""
    _check_diffusion(run_case("diffusion_48", 4, timeout=1200))


@pytest.mark.slow
def test_every_adjoint_keeps_sharding():
    r = run_case("adjoints", 4)
    for name, v in r.items():
        assert v["rel"] < 1e-10, (name, v)
        assert v["specs"] == [["x", None], ["x", None]], (name, v)


def test_sharding_types():
    r = run_case("sharding_types", 4)
    assert r["saves"] < 1e-14 and r["d_end"] < 1e-12, r
    assert "put jax.jit around the transformation" in r["eager_grad"], r
    assert r["shard_map_grad"] < 1e-14, r
    assert "y0 holds nan at index (37,)" in r["nan_y0_mesh"], r
    for name in ("nan_y0", "runs_on"):
        assert "og.solve failed at t=" in r[f"{name}_one"], r
        assert r[f"{name}_mesh"] == r[f"{name}_one"], r
    assert "og.solve failed at t=0.1 (step 10)" in r["auto_stencil"], r


def test_ensemble_over_devices():
    r = run_case("ensemble", 4)
    assert r["rel_values"] < 1e-12 and r["rel_grads"] < 1e-12, r
    assert r["devices"] == [0, 1, 2, 3] and r["spec"] == ["batch"], r
    assert "(step 0, batch member 5 of a batch of (8,))" in r["failed"], r


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    """2 processes with jax.distributed (gloo over localhost) solve the sharded diffusion and
    its gradient; the result equals the single-process run."""
    out = tmp_path / "figures.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "multiprocess_diffusion.py"),
            "--solver=tsit5",
            f"--json={out}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert max(r["rel_loss"], r["rel_g_lam"], r["rel_g_ci"]) <= 1e-12, r


def test_errors_name_the_argument():
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import odegrad as og
    from odegrad.problems import diffusion3d

    mesh = jax.make_mesh((1,), ("x",))
    with pytest.raises(TypeError, match="mesh="):
        og.stencil.sharded(lambda x: x, "mesh", (P("x"),), P("x"))
    with pytest.raises(ValueError, match="halo="):
        og.stencil.sharded(lambda x: x, mesh, (P("x"),), P("x"), halo=0)
    with pytest.raises(ValueError, match="axis="):
        og.ensemble(lambda x: x, mesh, axis="batch")
    with pytest.raises(ValueError, match="axes="):
        jax.shard_map(
            lambda b: og.stencil.exchange_halo(b, ("x",)), mesh=mesh, in_specs=P(), out_specs=P()
        )(jnp.zeros((4, 4)))
    with pytest.raises(ValueError, match="divisible"):
        diffusion3d(10).sharded_rhs(jax.sharding.AbstractMesh((3,), ("x",)), P("x"))


if __name__ == "__main__":
    import jax

    jax.config.update("jax_enable_x64", True)
    print(json.dumps(globals()[f"case_{sys.argv[1]}"]()))
