"""Tests for odegrad.stencil: every operator against explicit numpy loops, in 1-, 2- and 3-d."""

import jax

jax.config.update("jax_enable_x64", True)

import itertools  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import odegrad.stencil as st  # noqa: E402

# name -> (kind, axes the stencil acts along (None: every axis), inner points of the others)
SPECS = {
    **{f"d_{c}a": ("d", (k,), False) for k, c in enumerate("xyz")},
    **{f"d_{c}i": ("d", (k,), True) for k, c in enumerate("xyz")},
    **{f"d2_{c}a": ("d2", (k,), False) for k, c in enumerate("xyz")},
    **{f"d2_{c}i": ("d2", (k,), True) for k, c in enumerate("xyz")},
    "all": ("sel", (), False),
    "inn": ("sel", None, False),
    **{f"inn_{c}": ("sel", (k,), False) for k, c in enumerate("xyz")},
    "inn_xy": ("sel", (0, 1), False),
    "inn_xz": ("sel", (0, 2), False),
    "inn_yz": ("sel", (1, 2), False),
    "maxloc": ("max", None, False),
    "minloc": ("min", None, False),
}
for _kind in ("av", "harm"):
    SPECS[_kind] = (_kind, None, False)
    for _suffix, _axes in [("x", (0,)), ("y", (1,)), ("z", (2,)), ("xy", (0, 1)),
                           ("xz", (0, 2)), ("yz", (1, 2))]:  # fmt: skip
        SPECS[f"{_kind}_{_suffix}a"] = (_kind, _axes, False)
        SPECS[f"{_kind}_{_suffix}i"] = (_kind, _axes, True)

SHAPES = {1: (7,), 2: (5, 6), 3: (4, 5, 6)}


def supported(name):
    axes = SPECS[name][1] or ()
    return [nd for nd in (1, 2, 3) if nd > max(axes, default=-1)]


def rand(shape, seed=0):
    # strictly positive so that the harmonic means are well defined
    return np.random.default_rng(seed).uniform(0.5, 2.0, size=shape)


def unit(nd, k, step=1):
    return np.array([step if j == k else 0 for j in range(nd)])


def reference(name, A):
    """Explicit point-by-point loop implementation of operator `name`."""
    kind, axes, inner = SPECS[name]
    nd = A.ndim
    axes = tuple(range(nd)) if axes is None else axes
    if kind in ("max", "min"):
        trim = [2] * nd
    else:
        width = {"d": 1, "av": 1, "harm": 1, "d2": 2, "sel": 2}[kind]
        trim = [width if k in axes else (2 if inner else 0) for k in range(nd)]
    out = np.empty([n - t for n, t in zip(A.shape, trim, strict=True)])
    for o in np.ndindex(*out.shape):
        b = np.array([o[k] + (1 if inner and k not in axes else 0) for k in range(nd)])
        at = lambda idx: A[tuple(idx)]
        if kind == "d":
            val = at(b + unit(nd, axes[0])) - at(b)
        elif kind == "d2":
            e = unit(nd, axes[0])
            val = at(b + 2 * e) - 2 * at(b + e) + at(b)
        elif kind == "sel":
            val = at(b + np.array([1 if k in axes else 0 for k in range(nd)]))
        elif kind in ("av", "harm"):
            pts = []
            for corner in itertools.product((0, 1), repeat=len(axes)):
                shift = np.zeros(nd, dtype=int)
                shift[list(axes)] = corner
                pts.append(at(b + shift))
            val = np.mean(pts) if kind == "av" else len(pts) / np.sum(1 / np.array(pts))
        else:
            c = np.array(o) + 1
            pts = [at(c)] + [at(c + s * unit(nd, k)) for k in range(nd) for s in (-1, 1)]
            val = max(pts) if kind == "max" else min(pts)
        out[o] = val
    return out


CASES = [(name, nd) for name in SPECS for nd in supported(name)]


def test_specs_cover_public_api():
    assert set(SPECS) | {"laplacian", "set_inner"} == set(st.__all__)
    for name in st.__all__:
        doc = getattr(st, name).__doc__
        # the first line states the formula and the output shape, as in the docs' tables
        assert doc and "shape" in doc.strip().splitlines()[0], name


@pytest.mark.parametrize(("name", "nd"), CASES)
def test_against_numpy_loops(name, nd):
    A = rand(SHAPES[nd], seed=nd)
    got = getattr(st, name)(jnp.asarray(A))
    want = reference(name, A)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-13, atol=1e-13)
    # numpy input works too
    np.testing.assert_allclose(np.asarray(getattr(st, name)(A)), want, rtol=1e-13, atol=1e-13)


def test_literal_3d_formulas():
    """A few operators transcribed index by index from ParallelStencil's 3-d macros."""
    nx, ny, nz = 4, 5, 6
    A = rand((nx, ny, nz), seed=7)
    d_xi = np.empty((nx - 1, ny - 2, nz - 2))
    d2_yi = np.empty((nx - 2, ny - 2, nz - 2))
    av_xyi = np.empty((nx - 1, ny - 1, nz - 2))
    harm = np.empty((nx - 1, ny - 1, nz - 1))
    for i, j, k in np.ndindex(*d_xi.shape):
        d_xi[i, j, k] = A[i + 1, j + 1, k + 1] - A[i, j + 1, k + 1]
    for i, j, k in np.ndindex(*d2_yi.shape):
        c = A[i + 1, j + 1, k + 1]
        d2_yi[i, j, k] = (A[i + 1, j + 2, k + 1] - c) - (c - A[i + 1, j, k + 1])
    for i, j, k in np.ndindex(*av_xyi.shape):
        av_xyi[i, j, k] = (A[i, j, k + 1] + A[i + 1, j, k + 1]
                           + A[i, j + 1, k + 1] + A[i + 1, j + 1, k + 1]) / 4  # fmt: skip
    for i, j, k in np.ndindex(*harm.shape):
        harm[i, j, k] = 8 / sum(1 / A[i + a, j + b, k + c]
                                for a, b, c in itertools.product((0, 1), repeat=3))  # fmt: skip
    for op, want in [(st.d_xi, d_xi), (st.d2_yi, d2_yi), (st.av_xyi, av_xyi), (st.harm, harm)]:
        np.testing.assert_allclose(np.asarray(op(A)), want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_laplacian(nd):
    A = rand(SHAPES[nd], seed=3)
    h = [0.5, 0.25, 2.0][:nd]
    want = np.empty([n - 2 for n in A.shape])
    for o in np.ndindex(*want.shape):
        c = np.array(o) + 1
        want[o] = sum((A[tuple(c + unit(nd, k))] - 2 * A[tuple(c)] + A[tuple(c - unit(nd, k))])
                      / h[k] ** 2 for k in range(nd))  # fmt: skip
    np.testing.assert_allclose(np.asarray(st.laplacian(A, h)), want, rtol=1e-12)
    scalar = st.laplacian(A, 0.5)
    np.testing.assert_allclose(np.asarray(scalar), np.asarray(st.laplacian(A, [0.5] * nd)))
    with pytest.raises(ValueError, match=r"^laplacian: spacing has 4 entries .*ndim="):
        st.laplacian(A, [1.0] * 4)
    for pad in (False, True):  # (pad=True gave nan on its boundary cells, the other inf inside)
        with pytest.raises(ValueError, match=r"^laplacian: spacing=.* holds 0"):
            st.laplacian(A, [1.0] * (nd - 1) + [0.0], pad=pad)


@pytest.mark.parametrize(
    "shape",  # one shape per dimension by default; the smallest and odd-ordered ones slow
    [(5,), (4, 6), (5, 4, 7)]
    + [pytest.param(s, marks=pytest.mark.slow) for s in ((3, 3), (3, 3, 3), (6, 3, 4))],
)
def test_padded_laplacian_is_set_inner_of_laplacian(shape):
    # pad=True runs its own primitives (merged last axes, a transpose of its own): the values
    # and tangents of the composition it replaces to the last bit, its cotangents to rounding
    # (jitted, XLA may contract the two programs differently: spacings of powers of two here)
    A = jnp.asarray(rand(shape, seed=6))
    dA = jnp.asarray(rand(shape, seed=7))
    h = (0.5, 0.25, 2.0)[: len(shape)]

    def composed(X):
        return st.set_inner(jnp.zeros_like(X), st.laplacian(X, h))

    def padded(X):
        return st.laplacian(X, h, pad=True)

    def close(a, b):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-14 * float(jnp.max(jnp.abs(b))))

    for f in (lambda fn: fn, jax.jit):
        np.testing.assert_array_equal(f(padded)(A), f(composed)(A))
        np.testing.assert_array_equal(
            jax.jvp(f(padded), (A,), (dA,))[1], jax.jvp(f(composed), (A,), (dA,))[1]
        )
        close(jax.vjp(f(padded), A)[1](dA)[0], jax.vjp(f(composed), A)[1](dA)[0])
    # the transpose of the transpose, and second derivatives through both
    (t,) = jax.linear_transpose(padded, A)(dA)
    (tt,) = jax.linear_transpose(lambda c: jax.linear_transpose(padded, A)(c)[0], A)(A)
    close(tt, padded(A))
    close(t, jax.vjp(composed, A)[1](dA)[0])
    hvp = jax.jvp(jax.grad(lambda X: jnp.sum(jnp.sin(padded(X)))), (A,), (dA,))[1]
    close(hvp, jax.jvp(jax.grad(lambda X: jnp.sum(jnp.sin(composed(X)))), (A,), (dA,))[1])
    batch = jnp.stack([A, 2 * A, A + 1])
    np.testing.assert_array_equal(jax.vmap(padded)(batch), jax.vmap(composed)(batch))
    vjps = jax.vmap(lambda X, C: jax.vjp(padded, X)[1](C)[0], in_axes=(0, 1))
    cts = jnp.stack([dA, -dA, A], axis=1)
    close(vjps(batch, cts), jnp.stack([jax.vjp(composed, A)[1](c)[0] for c in (dA, -dA, A)]))
    # the spacing stays differentiable
    dh = jax.grad(lambda hx: jnp.sum(st.laplacian(A, (hx, *h[1:]), pad=True) ** 2))(h[0])
    want = jax.grad(lambda hx: jnp.sum(st.laplacian(A, (hx, *h[1:])) ** 2))(h[0])
    np.testing.assert_allclose(dh, want, rtol=1e-13)
    with pytest.raises(ValueError, match=r"^laplacian: needs at least 3 points along axis 0"):
        st.laplacian(jnp.ones((2, *shape[1:])), h, pad=True)


def test_padded_laplacian_types_and_symbolic_shapes():
    # eager and jitted calls type the result alike (a weak input stays weak), and a shape that
    # jax.export leaves symbolic takes the composed form (the merged axis needs static sizes)
    from jax._src.lax.lax import _convert_element_type  # (JAX has no public weak cast)

    A = jnp.asarray(rand((4, 5, 6), seed=9))
    weak = _convert_element_type(A, A.dtype, weak_type=True)
    f32 = jnp.ones(A.shape, jnp.float32)
    for X in (A, weak):
        eager = st.laplacian(X, 0.5, pad=True)
        jitted = jax.jit(lambda X: st.laplacian(X, 0.5, pad=True))(X)
        assert eager.weak_type == jitted.weak_type == X.weak_type
        assert (eager + f32).dtype == (jitted + f32).dtype
    shape = jax.export.symbolic_shape("a, b, c", constraints=("a >= 3", "b >= 3", "c >= 3"))
    exported = jax.export.export(jax.jit(lambda X: st.laplacian(X, 0.5, pad=True)))(
        jax.ShapeDtypeStruct(shape, jnp.float64)
    )
    B = jnp.asarray(rand((4, 5, 6), seed=10))
    np.testing.assert_allclose(exported.call(B), st.laplacian(B, 0.5, pad=True), rtol=1e-15)


def test_padded_laplacian_gradient_against_differences():
    A = rand((5, 4, 6), seed=8)
    _fd_check(lambda X: jnp.sum(jnp.tanh(st.laplacian(X, (0.5, 0.7, 0.9), pad=True)) ** 2), A)


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_set_inner(nd):
    A = rand(SHAPES[nd], seed=4)
    V = rand([n - 2 for n in A.shape], seed=5)
    got = np.asarray(st.set_inner(A, V))
    want = A.copy()
    for o in np.ndindex(*V.shape):
        want[tuple(np.array(o) + 1)] = V[o]
    np.testing.assert_array_equal(got, want)
    assert np.all(np.asarray(st.inn(st.set_inner(A, 3.0))) == 3.0)  # scalar broadcast
    np.testing.assert_array_equal(np.asarray(st.set_inner(A, V)), got)  # A is not mutated
    with pytest.raises(ValueError, match=r"^set_inner: values of shape"):
        st.set_inner(A, np.ones([n - 1 for n in A.shape]))


def _fd_check(f, x, n_entries=8, eps=1e-6):
    """Compare jax.grad(f) with central differences on a few entries of x."""
    g = np.asarray(jax.grad(f)(jnp.asarray(x)))
    flat = np.random.default_rng(1).choice(x.size, size=min(n_entries, x.size), replace=False)
    for idx in flat:
        e = np.zeros(x.size)
        e[idx] = eps
        e = e.reshape(x.shape)
        fd = (f(x + e) - f(x - e)) / (2 * eps)
        np.testing.assert_allclose(g.flat[idx], fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "name", ["d_xa", "d_yi", "d2_zi", "d2_xa", "av", "av_xzi", "harm_yi", "harm_xya", "maxloc"]
)
def test_gradients(name):
    op = getattr(st, name)
    A = rand(SHAPES[3], seed=11)
    _fd_check(lambda X: jnp.sum(op(X) ** 2), A)


def test_gradients_laplacian_and_set_inner():
    A = rand(SHAPES[3], seed=12)
    _fd_check(lambda X: jnp.sum(st.laplacian(X, (0.5, 0.7, 0.9)) ** 2), A)
    _fd_check(lambda h: jnp.sum(st.laplacian(jnp.asarray(A), (h[0], h[1], h[2])) ** 2),
              np.array([0.5, 0.7, 0.9]), n_entries=3)  # fmt: skip
    V = rand((2, 3, 4), seed=13)
    _fd_check(lambda v: jnp.sum(st.set_inner(jnp.asarray(A), v) ** 3), V)
    _fd_check(lambda X: jnp.sum(st.set_inner(X, jnp.asarray(V)) ** 3), A)


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_jit(nd):
    A = jnp.asarray(rand(SHAPES[nd], seed=21))
    for name in SPECS:
        if nd in supported(name):
            op = getattr(st, name)
            np.testing.assert_allclose(np.asarray(jax.jit(op)(A)), np.asarray(op(A)), rtol=1e-14)
    h = (0.1, 0.2, 0.3)[:nd]
    lap = jax.jit(st.laplacian)
    np.testing.assert_allclose(np.asarray(lap(A, h)), np.asarray(st.laplacian(A, h)), rtol=1e-14)
    rhs = jax.jit(lambda T: st.set_inner(jnp.zeros_like(T), st.laplacian(T, h)))
    assert rhs(A).shape == A.shape


def test_vmap_over_batch():
    B = jnp.asarray(rand((3, *SHAPES[2]), seed=22))
    got = jax.vmap(st.d2_yi)(B)
    np.testing.assert_allclose(np.asarray(got), np.stack([st.d2_yi(b) for b in B]))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_wrong_ndim(name):
    op = getattr(st, name)
    bad = [nd for nd in (0, 1, 2, 3, 4) if nd not in supported(name)]
    for nd in bad:
        A = np.ones((4,) * nd)
        with pytest.raises(ValueError, match=rf"^{name}: expected a .*array, got ndim={nd}$"):
            op(A)


def test_wrong_ndim_helpers():
    for nd in (0, 4):
        with pytest.raises(ValueError, match=rf"^laplacian: .*ndim={nd}"):
            st.laplacian(np.ones((4,) * nd), 1.0)
        with pytest.raises(ValueError, match=rf"^set_inner: .*ndim={nd}"):
            st.set_inner(np.ones((4,) * nd), 0.0)


def test_too_few_points():
    # an interior stencil needs 3 points along every axis; fewer would give an empty result
    with pytest.raises(ValueError, match=r"^d2_xi: needs at least 3 points along axis 2 \(z\)"):
        st.d2_xi(np.ones((5, 5, 2)))
    cases = [(st.d_xa, (1, 4), 2, 0), (st.d2_xa, (2, 4), 3, 0), (st.d_yi, (4, 1), 2, 1),
             (st.inn, (2, 4), 3, 0), (st.av, (1, 4), 2, 0), (st.maxloc, (4, 2), 3, 1)]  # fmt: skip
    for op, shape, n, axis in cases:
        with pytest.raises(ValueError, match=rf"needs at least {n} points along axis {axis}"):
            op(np.ones(shape))
        assert op(np.ones(tuple(max(m, n) for m in shape))).size > 0
    with pytest.raises(ValueError, match="1-d or 2-d or 3-d"):
        st.inn(np.ones((3, 3, 3, 3)))
    with pytest.raises(TypeError, match="laplacian: spacing"):
        st.laplacian(np.ones((4, 4)), "ab")
    with pytest.raises(TypeError, match="laplacian: spacing"):
        st.laplacian(np.ones((4, 4)), np.ones((2, 2)))


def test_heat_rhs_example():
    """The seed-001 heat-diffusion right-hand side from docs/stencil.md."""
    T = rand((5, 6, 7), seed=31)
    Ci = rand(T.shape, seed=32)
    lam, dx, dy, dz = 0.8, 0.5, 0.4, 0.3

    def heat_rhs(T, lam, Ci, dx, dy, dz):
        interior = (
            lam * st.inn(Ci) * (st.d2_xi(T) / dx**2 + st.d2_yi(T) / dy**2 + st.d2_zi(T) / dz**2)
        )
        return st.set_inner(jnp.zeros_like(T), interior)

    want = np.zeros_like(T)
    for i, j, k in itertools.product(*(range(1, n - 1) for n in T.shape)):
        lap = ((T[i + 1, j, k] - 2 * T[i, j, k] + T[i - 1, j, k]) / dx**2
               + (T[i, j + 1, k] - 2 * T[i, j, k] + T[i, j - 1, k]) / dy**2
               + (T[i, j, k + 1] - 2 * T[i, j, k] + T[i, j, k - 1]) / dz**2)  # fmt: skip
        want[i, j, k] = lam * Ci[i, j, k] * lap
    got = jax.jit(heat_rhs)(T, lam, Ci, dx, dy, dz)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
    via_lap = st.set_inner(jnp.zeros_like(T), lam * st.inn(Ci) * st.laplacian(T, (dx, dy, dz)))
    np.testing.assert_allclose(np.asarray(via_lap), want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------- derivative rules of the linear stencils
#
# d_*, d2_*, av* carry a custom_jvp whose tangent is written so that reverse mode pads the
# cotangent once and combines slices of it (docs/stencil.md, Performance). Below: its values
# against JAX's own transpose of the plain slicing, forward mode, vmap, and the single pad.

LINEAR = [name for name in SPECS if SPECS[name][0] in ("d", "d2", "av")]
LINEAR_CASES = [(name, nd) for name in LINEAR for nd in supported(name)]


# float32 in 3-d (which also runs compiled) in the default run: one operator per kind and
# axis pattern (one axis whole, one axis inner, two axes inner, every axis)
FLOAT32_QUICK = ("d_xa", "d2_yi", "av_xzi", "av")
# float64 in 1-d and 2-d in the default run: each kind whole and inner on each axis there
FLOAT64_LOW_QUICK = ("d_xa", "d_yi", "d2_xi", "d2_ya", "av", "av_xi", "av_ya", "av_xya")


def _dtype_cases():
    """float32 repeats float64's mechanism (the rule is the same code for every dtype) at a
    looser tolerance: slow tier (each case compiles on its own, ~1 s), except the 3-d cases of
    ``FLOAT32_QUICK``; float64 runs every operator in 3-d by default and those of
    ``FLOAT64_LOW_QUICK`` in 1-d and 2-d (the same rules on fewer axes), and
    ``test_reverse_pass_pads_once`` compiles every operator's float32 VJP and JVP."""

    def quick(name, nd, dt):
        if dt is np.float64:
            return nd == 3 or name in FLOAT64_LOW_QUICK
        return nd == 3 and name in FLOAT32_QUICK

    return [
        pytest.param(name, nd, dt, marks=() if quick(name, nd, dt) else pytest.mark.slow)
        for name, nd in LINEAR_CASES
        for dt in (np.float32, np.float64)
    ]


TOL = {np.float32: (1e-6, 1e-6), np.float64: (1e-14, 1e-14)}  # rtol, atol per unit scale


def plain(name, A):
    """Operator ``name`` as plain slicing, with JAX's own derivatives (the reference)."""
    kind, axes, inner = SPECS[name]
    nd = A.ndim
    axes = tuple(range(nd)) if axes is None else axes
    offsets = (0, 1, 2) if kind == "d2" else (0, 1)
    trim = [max(offsets) if k in axes else (2 if inner else 0) for k in range(nd)]
    views = []
    for combo in itertools.product(offsets, repeat=len(axes)):
        shift = [1 if inner else 0] * nd
        for a, o in zip(axes, combo, strict=True):
            shift[a] = o
        views.append(A[tuple(slice(s, n - t + s) for s, n, t in zip(shift, A.shape, trim, strict=True))])  # fmt: skip  # noqa: E501
    if kind == "d":
        return views[1] - views[0]
    if kind == "d2":
        m, c, p = views
        return (p - c) - (c - m)
    return sum(views[1:], views[0]) / len(views)


def _close(got, want, dtype, scale=1.0):
    rtol, atol = TOL[dtype]
    assert got.dtype == want.dtype == dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize(("name", "nd", "dtype"), _dtype_cases())
def test_vjp_equals_linear_transpose(name, nd, dtype):
    op = getattr(st, name)
    A = jnp.asarray(rand(SHAPES[nd], seed=41), dtype)
    ct = jnp.asarray(np.random.default_rng(42).standard_normal(jax.eval_shape(op, A).shape), dtype)
    # the reference (JAX's own transpose of the plain slicing) and the gradients through a
    # non-linear consumer, op's and the plain slicing's, as one compiled program (eager, each
    # slice and pad compiles on its own); op's VJP and transpose themselves run eagerly below
    f = lambda X: jnp.sum(jnp.sin(op(X)))
    g = lambda X: jnp.sum(jnp.sin(plain(name, X)))
    want, grad_f, grad_g = jax.jit(
        lambda a, c: (jax.linear_transpose(lambda X: plain(name, X), a)(c)[0],
                      jax.grad(f)(a), jax.grad(g)(a))
    )(A, ct)  # fmt: skip
    got = jax.vjp(op, A)[1](ct)[0]
    _close(got, want, dtype, scale=np.max(np.abs(ct)))
    if nd == 3:  # compiled (XLA merges the pads): the same values
        _close(jax.jit(lambda c: jax.vjp(op, A)[1](c)[0])(ct), want, dtype, np.max(np.abs(ct)))
    _close(jax.linear_transpose(op, A)(ct)[0], want, dtype, scale=np.max(np.abs(ct)))
    # and against JAX's own vjp of the plain slicing, with a non-linear consumer
    _close(grad_f, grad_g, dtype)


@pytest.mark.parametrize(("name", "nd", "dtype"), _dtype_cases())
def test_jvp_equals_operator(name, nd, dtype):
    op = getattr(st, name)
    A = jnp.asarray(rand(SHAPES[nd], seed=43), dtype)
    dA = jnp.asarray(np.random.default_rng(44).standard_normal(A.shape), dtype)
    y, dy = jax.jvp(op, (A,), (dA,))
    # the tangent repeats the primal's arithmetic: the same bits as the operator on dA
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain(name, A)))
    np.testing.assert_array_equal(np.asarray(dy), np.asarray(plain(name, dA)))
    if nd == 3:
        _, dy_jit = jax.jit(lambda a, d: jax.jvp(op, (a,), (d,)))(A, dA)
        _close(dy_jit, plain(name, dA), dtype, scale=np.max(np.abs(dA)))
    if dtype is np.float32 or nd == 3:
        return
    # the Jacobian, by forward and by reverse mode (batched rules: one compiled program, not
    # an eager compile per batched slice and pad)
    jf, jf_plain, jr = jax.jit(
        lambda a: (jax.jacfwd(op)(a), jax.jacfwd(lambda X: plain(name, X))(a), jax.jacrev(op)(a))
    )(A)
    np.testing.assert_array_equal(np.asarray(jf), np.asarray(jf_plain))
    np.testing.assert_allclose(np.asarray(jr), np.asarray(jf), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_laplacian_derivatives(nd, dtype):
    A = jnp.asarray(rand(SHAPES[nd], seed=45), dtype)
    h = (0.5, 0.25, 2.0)[:nd]
    ref = lambda X: sum(plain(f"d2_{c}i", X) / h[k] ** 2 for k, c in enumerate("xyz"[:nd]))
    ct = jnp.asarray(np.random.default_rng(46).standard_normal([n - 2 for n in A.shape]), dtype)
    want = jax.linear_transpose(ref, A)(ct)[0]
    _close(jax.vjp(lambda X: st.laplacian(X, h), A)[1](ct)[0], want, dtype, 16 * np.max(np.abs(ct)))
    dA = jnp.asarray(np.random.default_rng(47).standard_normal(A.shape), dtype)
    _, dy = jax.jvp(lambda X: st.laplacian(X, h), (A,), (dA,))
    np.testing.assert_array_equal(np.asarray(dy), np.asarray(st.laplacian(dA, h)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_heat_rhs_vjp(dtype):
    """Seed 001's rhs: the gradient in every argument against JAX's own rules."""
    T = jnp.asarray(rand((6, 7, 8), seed=48), dtype)
    Ci = jnp.asarray(rand(T.shape, seed=49), dtype)
    lam = jnp.asarray(0.8, dtype)
    dx, dy, dz = 0.5, 0.4, 0.3

    def rhs(T, lam, Ci, d2x, d2y, d2z, inn):
        lap = d2x(T) / dx**2 + d2y(T) / dy**2 + d2z(T) / dz**2
        return st.set_inner(jnp.zeros_like(T), lam * inn(Ci) * lap)

    ct = jnp.asarray(np.random.default_rng(50).standard_normal(T.shape), dtype)
    ops = (st.d2_xi, st.d2_yi, st.d2_zi, st.inn)
    ref_ops = (
        *(lambda X, n=n: plain(n, X) for n in ("d2_xi", "d2_yi", "d2_zi")),
        lambda X: X[1:-1, 1:-1, 1:-1],
    )
    got = jax.jit(lambda *a: jax.vjp(lambda *b: rhs(*b, *ops), *a)[1](ct))(T, lam, Ci)
    want = jax.jit(lambda *a: jax.vjp(lambda *b: rhs(*b, *ref_ops), *a)[1](ct))(T, lam, Ci)
    for g, w in zip(got, want, strict=True):
        _close(g, w, dtype, scale=float(np.max(np.abs(np.asarray(w)))))


def test_vmap_of_derivatives():
    B = jnp.asarray(rand((3, *SHAPES[3]), seed=51))
    for name in ("d2_xa", "av_xzi"):
        op = getattr(st, name)
        f = lambda X, op=op: jnp.sum(jnp.sin(op(X)))
        want = np.stack([np.asarray(jax.grad(f)(b)) for b in B])
        np.testing.assert_allclose(np.asarray(jax.vmap(jax.grad(f))(B)), want, rtol=1e-14)
        batched = lambda X, f=f: jnp.sum(jax.vmap(f)(X))
        np.testing.assert_allclose(np.asarray(jax.grad(batched)(B)), want, rtol=1e-14)
        tangents = jax.vmap(lambda b, op=op: jax.jvp(op, (b,), (b,))[1])(B)
        np.testing.assert_array_equal(np.asarray(tangents), np.stack([op(b) for b in B]))


@pytest.mark.parametrize("name", LINEAR)
def test_reverse_pass_pads_once(name):
    """The compiled VJP pads the cotangent once, however many views the stencil has; the
    compiled JVP is plain slicing again."""
    op = getattr(st, name)
    A = jnp.ones((6, 7, 8), jnp.float32)
    ct = jnp.ones(op(A).shape, jnp.float32)
    hlo = jax.jit(lambda c: jax.vjp(op, A)[1](c)).lower(ct).compile().as_text()
    assert hlo.count(" pad(") == 1, hlo
    hlo = jax.jit(lambda a, d: jax.jvp(op, (a,), (d,))).lower(A, A).compile().as_text()
    assert hlo.count(" pad(") == 0, hlo


@pytest.mark.slow  # 20 s; laplacian(pad=True)'s own rules run in the default tier above
def test_padded_rhs_solves_and_differentiates_like_the_seed_form():
    # seed 001's rhs as one operator: the same ROCK2 solve (power iteration included, whose
    # JVPs run the primitive's linear rule) and the same gradient, through the Discrete adjoint
    import odegrad as og
    from odegrad.problems import diffusion3d

    p = diffusion3d(10, dtype=jnp.float64)

    def loss(rhs, T0, args):
        sol = og.solve(rhs, T0, (0.0, p.t1), args, solver=og.ROCK2(), step=og.Fixed(p.t1 / 3))
        return jnp.sum(sol.ys[-1] ** 2)

    args = (p.lam, p.Ci)
    want, gwant = jax.value_and_grad(lambda *a: loss(p.rhs, *a), argnums=(0, 1))(p.T0, args)
    got, ggot = jax.value_and_grad(lambda *a: loss(p.rhs_padded, *a), argnums=(0, 1))(p.T0, args)
    np.testing.assert_allclose(got, want, rtol=1e-13)
    for g, w in zip(jax.tree.leaves(ggot), jax.tree.leaves(gwant), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12 * float(jnp.max(jnp.abs(w))))
