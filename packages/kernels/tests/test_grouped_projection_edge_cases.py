"""grouped_projection edge cases: zero-size m, k, n; vmap over any operand subset;
forward mode and higher orders; float64 under x64; non-finite weights; each of these with
a group_offset (local experts) too; a single backend's own error; every spelling of a
precision in ragged_dot_runs. CPU: the XLA path and the
Pallas interpreters; the `gpu` tests run the compiled kernels on the same cases.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.kernels import grouped_projection, ragged_dot_runs
from pallasite.kernels.grouped_matmul import TritonBlockSizes, api, ops
from pallasite.reference.grouped_projection import grouped_projection as reference

SMALL = TritonBlockSizes(block_m=16, block_n=16, block_k=16, group_m=2)
ON_CPU = ["xla", "pallas_triton", "pallas_mosaic_tpu"]


def _inputs(m=40, k=24, n=20, g=4, sizes=(9, 0, 14, 10), dtype=jnp.float32):
    key = jax.random.key(3)
    x = jax.random.normal(key, (m, k), dtype)
    kernel = jax.random.normal(jax.random.fold_in(key, 1), (g, k, n), dtype)
    return x, kernel, jnp.asarray(sizes, jnp.int32)


def _project(name, compute=jnp.float32, **kw):
    blocks = SMALL if name == "pallas_triton" else None
    return lambda x, k, s: grouped_projection(x, k, s, compute, interpret_on_cpu=True,
                                              implementation=name, block_sizes=blocks, **kw)


# ------------------------------------------------------------------- zero sizes


@pytest.mark.parametrize("name", list(api.IMPLEMENTATIONS))
@pytest.mark.parametrize("m,k,n", [(0, 24, 20), (40, 0, 20), (40, 24, 0)],
                         ids=["m0", "k0", "n0"])
def test_zero_size_gives_zeros_and_zero_gradients(name, m, k, n):
    """Every backend by name: zeros of [m, n] in compute, zero gradients of the operands'
    shapes and dtypes; nothing is built (the Mosaic GPU kernel could not run here)."""
    x = jnp.ones((m, k), jnp.float32)
    kernel = jnp.ones((4, k, n), jnp.bfloat16)
    sizes = jnp.zeros((4,), jnp.int32) if m == 0 else jnp.asarray([10, 0, 20, 5], jnp.int32)
    f = _project(name, jnp.bfloat16)
    y = f(x, kernel, sizes)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16 and not np.asarray(y).any()
    dx, dk = jax.grad(lambda x, k: jnp.sum(f(x, k, sizes).astype(jnp.float32) ** 2),
                      argnums=(0, 1))(x, kernel)
    assert dx.shape == x.shape and dx.dtype == x.dtype and not np.asarray(dx).any()
    assert dk.shape == kernel.shape and dk.dtype == kernel.dtype
    assert not np.asarray(dk, np.float32).any()


# ------------------------------------------------------------------- vmap


@pytest.mark.parametrize("name", ["xla", "pallas_triton"])
@pytest.mark.parametrize("batched", [(0,), (1,), (2,), (0, 1), (0, 1, 2)],
                         ids=["x", "kernel", "sizes", "x_kernel", "all"])
def test_vmap_over_any_subset(name, batched):
    """vmap over any subset of (x, kernel, group_sizes), values and gradients, equals a
    loop of unbatched calls."""
    x, kernel, sizes = _inputs()
    stacked = [x, kernel, sizes]
    for i in batched:
        t = stacked[i]
        stacked[i] = jnp.stack([t, t[::-1] if i == 2 else t * 0.5 + 1])
    in_axes = tuple(0 if i in batched else None for i in range(3))
    f = _project(name)
    got = jax.vmap(f, in_axes=in_axes)(*stacked)
    loss = lambda *a: jnp.sum(jax.vmap(f, in_axes=in_axes)(*a) ** 2)  # noqa: E731
    dx, dk = jax.grad(loss, argnums=(0, 1))(*stacked)
    sums = [0.0, 0.0]  # an unbatched operand's gradient sums over the batch
    for j in range(2):
        one = [stacked[i][j] if i in batched else stacked[i] for i in range(3)]
        np.testing.assert_allclose(got[j], f(*one), rtol=1e-6, atol=1e-6)
        want = jax.grad(lambda x, k: jnp.sum(f(x, k, one[2]) ** 2), argnums=(0, 1))(*one[:2])
        for i, (g, w) in enumerate(zip((dx, dk), want)):
            if i in batched:
                np.testing.assert_allclose(g[j], w, rtol=1e-5, atol=1e-5)
            else:
                sums[i] = sums[i] + w
    for i, g in enumerate((dx, dk)):
        if i not in batched:
            np.testing.assert_allclose(g, sums[i], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------- forward mode, higher order


def test_jvp_linearize_and_second_order_on_the_default_path():
    """jax.jvp and grad of grad work (the plain-JAX path) and agree with the reference: the product is bilinear, so the tangent is
    f(dx, k) + f(x, dk), and the reference's backward is plain JAX."""
    x, kernel, sizes = _inputs()
    f = lambda x, k: grouped_projection(x, k, sizes, jnp.float32)  # noqa: E731
    dx, dk = jnp.cos(x), jnp.sin(kernel)
    y, t = jax.jvp(f, (x, kernel), (dx, dk))
    np.testing.assert_allclose(y, f(x, kernel), rtol=1e-6)
    np.testing.assert_allclose(t, f(dx, kernel) + f(x, dk), rtol=1e-5, atol=1e-5)
    # jax.linearize traces as reverse mode does (the kernels' custom_vjp); its linear
    # function transposes, but JAX refuses to apply a custom_vjp's linearization forward
    # (docs/grouped_projection.md): jax.jvp is the forward-mode way in.
    _, lin = jax.linearize(f, x, kernel)
    ct = jax.linear_transpose(lin, x, kernel)(t)
    assert ct[0].shape == x.shape and ct[1].shape == kernel.shape
    with pytest.raises(TypeError, match="custom_vjp"):
        lin(dx, dk)
    ref = lambda x, k: reference(x, k, sizes, jnp.float32)  # noqa: E731

    def second(fn):
        inner = lambda x, k: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(fn(x, k))))(x) ** 2)  # noqa: E731
        return jax.grad(inner, argnums=(0, 1))(x, kernel)

    for got, want in zip(second(f), second(ref)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def _dense(x, kernel, sizes, group_offset=0):
    """The grouped product as one masked einsum (plain jnp: JAX differentiates and
    batches it in every mode)."""
    ends = jnp.cumsum(sizes)
    rows = jnp.arange(x.shape[0])[:, None]
    groups = group_offset + jnp.arange(kernel.shape[0])[None, :]
    mask = (rows >= (ends - sizes)[groups]) & (rows < ends[groups])
    return jnp.einsum("mk,gkn,mg->mn", x, kernel, mask.astype(x.dtype),
                      precision=jax.lax.Precision.HIGHEST)


SMALL_SHAPES = dict(m=12, k=6, n=5, g=3, sizes=(4, 0, 6))  # rows 10, 11 of no group


@pytest.mark.parametrize("group_offset", [None, 1], ids=["all_groups", "group_offset"])
@pytest.mark.parametrize("mode", ["jacfwd", "hessian", "jvp_of_grad", "grad_of_grad_kernel",
                                  "vmap_of_jvp"])
def test_forward_mode_and_higher_orders_in_every_combination(mode, group_offset):
    """The plain-JAX path (plain.py) under every composition of jvp, vjp and vmap agrees
    with a masked einsum. jax.jacfwd and jax.hessian (vmaps of a jvp) used to reach
    ragged_dot's missing batching rule."""
    x, kernel, sizes = _inputs(**SMALL_SHAPES)
    offset = 0
    if group_offset is not None:  # the kernel holds groups [1, 3) of the three
        kernel, offset = kernel[1:], group_offset
    f = lambda x, k: grouped_projection(x, k, sizes, jnp.float32,  # noqa: E731
                                        group_offset=group_offset)
    dense = lambda x, k: _dense(x, k, sizes, offset)  # noqa: E731
    scalar = lambda f: lambda x, k: jnp.sum(jnp.sin(f(x, k)))  # noqa: E731
    run = {
        "jacfwd": lambda f: jax.jacfwd(f, argnums=(0, 1))(x, kernel),
        "hessian": lambda f: jax.hessian(scalar(f), argnums=(0, 1))(x, kernel),
        "jvp_of_grad": lambda f: jax.jvp(jax.grad(scalar(f), argnums=(0, 1)), (x, kernel),
                                         (jnp.cos(x), jnp.sin(kernel)))[1],
        "grad_of_grad_kernel": lambda f: jax.grad(lambda x, k: jnp.sum(
            jax.grad(scalar(f), argnums=1)(x, k) ** 2), argnums=(0, 1))(x, kernel),
        "vmap_of_jvp": lambda f: jax.vmap(lambda t: jax.jvp(f, (x, kernel), (t, kernel))[1])(
            jnp.stack([x, jnp.cos(x)])),
    }[mode]
    for got, want in zip(jax.tree.leaves(run(f)), jax.tree.leaves(run(dense))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["pallas_triton", "pallas_mosaic_tpu", "pallas_mosaic_gpu"])
@pytest.mark.parametrize("mode", ["jvp", "second_order", "hessian"])
def test_pallas_backends_refuse_beyond_first_order_clearly(name, mode):
    """A named Pallas backend stops with an error saying 'first-order reverse mode' and
    naming the backend that does the rest ('xla'), before any kernel is built."""
    x, kernel, sizes = _inputs()
    f = lambda x: grouped_projection(x, kernel, sizes, jnp.float32, interpret_on_cpu=True,  # noqa: E731
                                     implementation=name)
    run = {"jvp": lambda: jax.jvp(f, (x,), (x,)),
           "second_order": lambda: jax.grad(lambda x: jnp.sum(jax.grad(
               lambda x: jnp.sum(f(x) ** 2))(x) ** 2))(x),
           "hessian": lambda: jax.hessian(lambda r: jnp.sum(f(x.at[:2].set(r))))(x[:2])}[mode]
    with pytest.raises(NotImplementedError, match="first-order reverse mode.*'xla'"):
        run()


def test_first_order_through_a_pallas_backend_still_runs():
    x, kernel, sizes = _inputs()
    f = _project("pallas_triton")
    g = jax.grad(lambda x: jnp.sum(f(x, kernel, sizes) ** 2))(x)
    want = jax.grad(lambda x: jnp.sum(reference(x, kernel, sizes, jnp.float32) ** 2))(x)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- float64


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


def test_float64_compute_sums_in_float64(x64):
    """x64 with float64 compute: the kernels refuse, and the result and its gradients sit
    at float64 rounding from numpy's float64 products."""
    x, kernel, sizes = _inputs(dtype=jnp.float64)
    y = grouped_projection(x, kernel, sizes, jnp.float64)
    assert y.dtype == jnp.float64
    xs, ks, ss = np.asarray(x), np.asarray(kernel), np.asarray(sizes)
    want = np.zeros(y.shape)
    start = 0
    for i, size in enumerate(ss):
        want[start:start + size] = xs[start:start + size] @ ks[i]
        start += size
    assert np.abs(np.asarray(y) - want).max() / np.abs(want).max() < 1e-14
    dk = jax.grad(lambda k: jnp.sum(grouped_projection(x, k, sizes, jnp.float64)))(kernel)
    assert dk.dtype == jnp.float64
    np.testing.assert_allclose(dk[0], xs[:9].sum(0)[:, None] * np.ones((1, 20)), rtol=1e-14)


def test_float64_with_only_kernels_named_says_why(x64):
    x, kernel, sizes = _inputs(dtype=jnp.float64)
    with pytest.raises(RuntimeError, match="float64"):
        grouped_projection(x, kernel, sizes, jnp.float64, implementation="pallas_triton")


# ------------------------------------------------------------------- non-finite weights


def _poisoned(value):
    x, kernel, sizes = _inputs()
    return x, kernel.at[1, 3, 5].set(value).at[2, 0, 7].set(value), sizes  # group 1 empty


@pytest.mark.parametrize("name", ["pallas_triton", "pallas_mosaic_tpu"])
@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_weights_stay_in_their_group_kernels(name, value):
    _check_contained(_project(name), value)


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_weights_stay_in_their_group_plain_path(value):
    """The plain-JAX path (forward mode, higher orders, float64) contains them too."""
    x, kernel, sizes = _poisoned(value)
    f = lambda x: grouped_projection(x, kernel, sizes, jnp.float32)  # noqa: E731
    y, _ = jax.jvp(f, (x,), (x,))
    _check_rows(y, sizes)


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_weights_stay_in_their_group_xla_backend(value):
    _check_contained(_project("xla"), value)


@pytest.mark.parametrize("value", [None, np.nan, np.inf], ids=["finite", "nan", "inf"])
@pytest.mark.parametrize("group_offset", [None, 1], ids=["all_groups", "offset"])
def test_contain_only_nonfinite_form_is_bitwise_the_same(monkeypatch, value, group_offset):
    """The form TPUs run (xla.CONTAIN_ONLY_NONFINITE_ON: a lax.cond on the weights being
    finite) gives the XLA backend's values and gradients bit for bit, finite weights or
    not, local experts included: on the bare product's branch as on the containing one.
    Run here by naming the CPU among its platforms."""
    from pallasite.kernels.grouped_matmul import xla

    x, kernel, sizes = _poisoned(value) if value is not None else _inputs()
    kernel = kernel[group_offset or 0:]
    f = _project("xla", jnp.bfloat16, group_offset=group_offset)
    dy = jax.random.normal(jax.random.key(5), (x.shape[0], kernel.shape[2]), jnp.float32)

    def run():
        y, vjp = jax.vjp(lambda x, k: f(x, k, sizes).astype(jnp.float32), x, kernel)
        return [np.asarray(t, np.float32) for t in (y, *vjp(dy))]

    monkeypatch.setattr(xla, "CONTAIN_ONLY_NONFINITE_ON", ())
    contained = run()
    monkeypatch.setattr(xla, "CONTAIN_ONLY_NONFINITE_ON", ("cpu",))
    checked = run()
    for name, a, b in zip(("y", "dx", "dkernel"), contained, checked):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert np.isfinite(checked[0]).all() == (value is None)


def test_contain_only_nonfinite_form_lowers_for_tpus_only(monkeypatch):
    """Lowered for a TPU the XLA backend checks the weights (one more is_finite than the
    always-containing form, and branches); lowered for a GPU it holds only the
    always-containing form's checks, and compiled for this CPU it has no conditional
    left (jax.lax.platform_dependent's constant choice is folded away)."""
    from pallasite.kernels.grouped_matmul import xla

    x, kernel, sizes = _inputs()

    def fresh():  # a cached trace would not see the flag
        return jax.jit(lambda x, k, s: xla.gmm(x, k, s))

    def ops(platform):
        text = jax.export.export(fresh(), platforms=[platform])(x, kernel, sizes).mlir_module()
        return re.findall(r"\bstablehlo\.\w+", text)

    def conditionals():
        return fresh().lower(x, kernel, sizes).compile().as_text().count("conditional(")

    assert xla.CONTAIN_ONLY_NONFINITE_ON == ("tpu",)
    default = {p: ops(p) for p in ("tpu", "cuda")}
    assert conditionals() == 0
    monkeypatch.setattr(xla, "CONTAIN_ONLY_NONFINITE_ON", ())
    always = {p: ops(p) for p in ("tpu", "cuda")}
    is_finite, case = "stablehlo.is_finite", "stablehlo.case"
    assert default["tpu"].count(is_finite) == always["tpu"].count(is_finite) + 1
    assert default["tpu"].count(case) > always["tpu"].count(case)
    assert default["cuda"].count(is_finite) == always["cuda"].count(is_finite)
    monkeypatch.setattr(xla, "CONTAIN_ONLY_NONFINITE_ON", ("cpu",))
    assert conditionals() == 1


def _check_contained(f, value):
    x, kernel, sizes = _poisoned(value)
    _check_rows(f(x, kernel, sizes), sizes)


def _check_rows(y, sizes):
    """Rows of groups 0 and 3 and past the total finite; group 2's rows non-finite only
    in column 7."""
    y = np.asarray(y, np.float32)
    ends = np.cumsum(np.asarray(sizes))
    assert np.isfinite(y[:ends[0]]).all() and np.isfinite(y[ends[2]:]).all()
    group2 = y[ends[1]:ends[2]]
    assert not np.isfinite(group2[:, 7]).any()
    assert np.isfinite(np.delete(group2, 7, axis=1)).all()


# ------------------------------------------------------------------- group_offset
# Local experts: kernel holds groups [2, 5) of six; rows of groups 0, 1 and 5 and the row
# past the total are zero with zero gradient on every path above.

OFFSET_SIZES = (5, 7, 9, 0, 14, 4)  # 39 of 40 rows; groups 2-4 are rows [12, 35)
OFFSET, LOCAL = 2, slice(12, 35)


def _offset_inputs(m=40, k=24, n=20):
    x, kernel, _ = _inputs(m=m, k=k, n=n, g=3, sizes=(0, 0, 0))
    return x, kernel, jnp.asarray(OFFSET_SIZES, jnp.int32)


def _outside(y):
    """The rows of no local group."""
    return np.concatenate([np.asarray(y[:LOCAL.start], np.float32),
                           np.asarray(y[LOCAL.stop:], np.float32)])


@pytest.mark.parametrize("name", list(api.IMPLEMENTATIONS))
@pytest.mark.parametrize("m,k,n", [(0, 24, 20), (40, 0, 20), (40, 24, 0)],
                         ids=["m0", "k0", "n0"])
def test_zero_size_with_group_offset(name, m, k, n):
    x, kernel = jnp.ones((m, k), jnp.float32), jnp.ones((3, k, n), jnp.bfloat16)
    sizes = (jnp.zeros((6,), jnp.int32) if m == 0 else jnp.asarray(OFFSET_SIZES, jnp.int32))
    f = _project(name, jnp.bfloat16, group_offset=OFFSET)
    y = f(x, kernel, sizes)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16 and not np.asarray(y).any()
    dx, dk = jax.grad(lambda x, k: jnp.sum(f(x, k, sizes).astype(jnp.float32) ** 2),
                      argnums=(0, 1))(x, kernel)
    assert dx.shape == x.shape and not np.asarray(dx).any()
    assert dk.shape == kernel.shape and not np.asarray(dk, np.float32).any()


def test_plain_path_honours_group_offset():
    """jvp and second order (the plain-JAX path) with local experts agree with the
    reference; rows of other groups are zero, in value, tangent and gradient."""
    x, kernel, sizes = _offset_inputs()
    f = lambda x, k: grouped_projection(x, k, sizes, jnp.float32, group_offset=OFFSET)  # noqa: E731
    ref = lambda x, k: reference(x, k, sizes, jnp.float32, group_offset=OFFSET,  # noqa: E731
                                 precision=jax.lax.Precision.HIGHEST)
    dx, dk = jnp.cos(x), jnp.sin(kernel)
    y, t = jax.jvp(f, (x, kernel), (dx, dk))
    np.testing.assert_allclose(y, ref(x, kernel), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(t, ref(dx, kernel) + ref(x, dk), rtol=1e-5, atol=1e-5)
    assert not _outside(y).any() and not _outside(t).any()

    def second(fn):
        inner = lambda x, k: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(fn(x, k))))(x) ** 2)  # noqa: E731
        return jax.grad(inner, argnums=(0, 1))(x, kernel)

    got, want = second(f), second(ref)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    assert not _outside(got[0]).any()


@pytest.mark.parametrize("name", ["xla", "pallas_triton"])
def test_vmap_with_group_offset(name):
    """vmap over x and a batched group_offset equals a loop of unbatched calls."""
    x, kernel, sizes = _offset_inputs()
    xs, offsets = jnp.stack([x, x * 0.5 + 1]), jnp.asarray([OFFSET, 0], jnp.int32)
    f = lambda x, o: _project(name, group_offset=o)(x, kernel, sizes)  # noqa: E731
    got = jax.vmap(f)(xs, offsets)
    dk = jax.grad(lambda k: jnp.sum(jax.vmap(
        lambda x, o: _project(name, group_offset=o)(x, k, sizes))(xs, offsets) ** 2))(kernel)
    want_dk = 0.0
    for j in range(2):
        np.testing.assert_allclose(got[j], f(xs[j], offsets[j]), rtol=1e-6, atol=1e-6)
        want_dk = want_dk + jax.grad(lambda k: jnp.sum(_project(name, group_offset=offsets[j])(
            xs[j], k, sizes) ** 2))(kernel)
    np.testing.assert_allclose(dk, want_dk, rtol=1e-5, atol=1e-5)


def _check_offset_rows(y):
    """Rows of no local group zero; global group 4 (rows [21, 35)) non-finite only in
    column 7; global group 2 (rows [12, 21)) finite (the poisoned local group 1, global
    group 3, is empty)."""
    y = np.asarray(y, np.float32)
    assert not _outside(y).any()
    assert np.isfinite(y[12:21]).all()
    group4 = y[21:35]
    assert not np.isfinite(group4[:, 7]).any()
    assert np.isfinite(np.delete(group4, 7, axis=1)).all()


@pytest.mark.parametrize("name", ["xla", "pallas_triton", "pallas_mosaic_tpu", "plain"])
@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_weights_stay_in_their_group_with_group_offset(name, value):
    x, kernel, sizes = _offset_inputs()
    kernel = kernel.at[1, 3, 5].set(value).at[2, 0, 7].set(value)
    if name == "plain":  # forward mode: the plain-JAX path
        y, _ = jax.jvp(lambda x: grouped_projection(x, kernel, sizes, jnp.float32,
                                                    group_offset=OFFSET), (x,), (x,))
    else:
        y = _project(name, group_offset=OFFSET)(x, kernel, sizes)
    _check_offset_rows(y)


# ------------------------------------------------------------------- one backend's error


def test_single_backend_failure_raises_its_own_error(monkeypatch, caplog):
    """The default path on CPU has one backend (xla): its error comes through as itself,
    not wrapped in an ExceptionGroup, and nothing logs 'trying the next'."""
    x, kernel, sizes = _inputs()

    class Boom(RuntimeError):
        pass

    def fail(*args, **kwargs):
        raise Boom("xla could not")

    monkeypatch.setattr(ops, "project", fail)
    with caplog.at_level(logging.WARNING), pytest.raises(Boom, match="xla could not"):
        grouped_projection(x, kernel, sizes, jnp.float32)
    assert "trying" not in caplog.text
    with pytest.raises(Boom):
        grouped_projection(x, kernel, sizes, jnp.float32, implementation=["xla"])


# ------------------------------------------------------------------- ragged_dot_runs


P, A = jax.lax.Precision, jax.lax.DotAlgorithmPreset
DEFAULTS = [None, "default", "DEFAULT", "fastest", "bfloat16", P.DEFAULT, A.DEFAULT,
            (None, P.DEFAULT)]
MORE = ["high", "HIGH", "tensorfloat32", "bfloat16_3x", P.HIGH, "highest", "float32",
        P.HIGHEST, A.TF32_TF32_F32, "tf32_tf32_f32", A.F32_F32_F32, (P.DEFAULT, P.HIGH)]


@pytest.mark.parametrize("precision", DEFAULTS + MORE, ids=repr)
def test_every_spelling_of_a_precision_agrees(precision):
    """fp32 compute runs only at the default precision, however it is spelled (TF32 asked
    for by name is HIGH: refused, as Precision.HIGH is); 16-bit compute at any."""
    assert ragged_dot_runs(jnp.float32, (), precision) == (precision in DEFAULTS)
    assert ragged_dot_runs(jnp.bfloat16, (), precision)


@pytest.mark.parametrize("config", ["tensorfloat32", "high", "highest"])
def test_configured_default_precision_is_read(config):
    with jax.default_matmul_precision(config):
        assert not ragged_dot_runs(jnp.float32)
    with jax.default_matmul_precision("bfloat16"):
        assert ragged_dot_runs(jnp.float32)


@pytest.mark.parametrize("kwargs", [dict(compute=None), dict(compute="int32"),
                                    dict(compute=jnp.float32, precision="fast"),
                                    dict(compute=jnp.float32, precision=3),
                                    dict(compute=jnp.float32, precision=(None,)),
                                    dict(compute=jnp.float32, operands=(None,))],
                         ids=["None", "int32", "bad_name", "int", "one_tuple", "operand_None"])
def test_bad_arguments_are_type_errors(kwargs):
    with pytest.raises(TypeError):
        ragged_dot_runs(**kwargs)


@pytest.mark.parametrize("implementation", [None, "xla", "pallas_triton",
                                            ("pallas_triton", "xla")], ids=repr)
@pytest.mark.parametrize("interpret_on_cpu", [False, True])
@pytest.mark.parametrize("m", [40, 0])
def test_compute_none_is_a_type_error_on_every_path(implementation, interpret_on_cpu, m):
    """np.dtype(None) is float64: unchecked, the default path ran float64 cut to fp32."""
    x, kernel, sizes = _inputs()
    with pytest.raises(TypeError, match="compute must be a floating dtype; got None"):
        grouped_projection(x[:m], kernel, sizes * (m > 0), None, interpret_on_cpu,
                           implementation=implementation)
    with pytest.raises(TypeError, match="compute must be a floating dtype; got None"):
        reference(x[:m], kernel, sizes * (m > 0), None)


# ------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["pallas_triton", "pallas_mosaic_gpu"])
def test_gpu_edge_cases(name):
    """The compiled kernels: zero sizes, vmap, containment of non-finite weights, and the
    first-order error (bf16, where Mosaic GPU runs)."""
    x, kernel, sizes = _inputs(m=512, k=128, n=256, sizes=(200, 0, 150, 100))
    x, kernel = x.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16)
    f = lambda x, k, s: grouped_projection(x, k, s, jnp.bfloat16, implementation=name)  # noqa: E731
    for m, k, n in ((0, 128, 256), (512, 0, 256), (512, 128, 0)):
        s = jnp.zeros((4,), jnp.int32) if m == 0 else sizes
        y = f(jnp.ones((m, k), jnp.bfloat16), jnp.ones((4, k, n), jnp.bfloat16), s)
        assert y.shape == (m, n) and not np.asarray(y, np.float32).any()
    got = jax.vmap(f, in_axes=(0, None, None))(jnp.stack([x, 2 * x]), kernel, sizes)
    np.testing.assert_allclose(np.asarray(got[1], np.float32),
                               np.asarray(f(2 * x, kernel, sizes), np.float32))
    poisoned = kernel.at[1, 3, 5].set(jnp.nan).at[2, 0, 7].set(jnp.nan)
    _check_rows(f(x, poisoned, sizes), sizes)
    with pytest.raises(NotImplementedError, match="first-order reverse mode"):
        jax.jvp(lambda x: f(x, kernel, sizes), (x,), (x,))


# ------------------------------------------------------------------- traced group sizes


@pytest.mark.parametrize("sizes,message", [((10, -5, 20, 5), "negative"),
                                           ((20, 20, 20, 20), "more than the 40 rows")])
def test_checkify_path_checks_traced_group_sizes(sizes, message):
    """Traced sizes pass grouped_projection unchecked; checked_group_sizes under
    jax.experimental.checkify reports negative and oversized ones."""
    from jax.experimental import checkify

    from pallasite.kernels import checked_group_sizes

    x, kernel, _ = _inputs()
    f = jax.jit(checkify.checkify(lambda x, k, s: grouped_projection(
        x, k, checked_group_sizes(s, x.shape[0]), jnp.float32)))
    err, _ = f(x, kernel, jnp.asarray(sizes, jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        err.throw()
    err, y = f(x, kernel, jnp.asarray((9, 0, 14, 10), jnp.int32))
    err.throw()
    assert y.shape == (40, 20)


# Traced sizes the static checks cannot see. Every path (each backend, the plain-JAX path,
# local experts) reads them as group_metadata.group_offsets does: a negative size is an
# empty group, and the groups are cut at row m, however large the total (an int32 sum
# that would wrap included).
TRACED_PATHS = ["xla", "pallas_triton", "pallas_mosaic_tpu", "pallas_mosaic_gpu", "plain"]


def _traced(name, compute, **kw):
    """The path `name` under jit, the group sizes traced."""
    if name == "plain":  # forward mode takes the plain-JAX path
        def f(x, k, s):
            return jax.jvp(lambda x: grouped_projection(x, k, s, compute, **kw),
                           (x,), (x,))[0]
        return jax.jit(f)
    return jax.jit(_project(name, compute, **kw))


def _check_as_sizes(name, given, meant, **kw):
    """`given` traced gives what `meant` gives, values and (but on the plain path)
    gradients, every value finite. Mosaic GPU takes 16-bit compute only."""
    x, kernel, _ = _offset_inputs() if "group_offset" in kw else _inputs()
    compute, tol = (jnp.bfloat16, 1e-2) if name == "pallas_mosaic_gpu" else (jnp.float32, 1e-4)
    given, meant = jnp.asarray(given, jnp.int32), jnp.asarray(meant, jnp.int32)
    f = _traced(name, compute, **kw)
    ref = lambda x, k, s: reference(x, k, s, compute,  # noqa: E731
                                    precision=jax.lax.Precision.HIGHEST, **kw)
    got = np.asarray(f(x, kernel, given), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(ref(x, kernel, meant), np.float32),
                               rtol=tol, atol=tol)
    if name == "plain":
        return
    loss = lambda f, s: lambda x, k: jnp.sum(jnp.sin(f(x, k, s).astype(jnp.float32)))  # noqa: E731
    got = jax.grad(loss(f, given), argnums=(0, 1))(x, kernel)
    want = jax.grad(loss(ref, meant), argnums=(0, 1))(x, kernel)
    for g, w in zip(got, want):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", TRACED_PATHS)
@pytest.mark.parametrize("given,meant", [
    ((9, 0, 2**31 - 60, 100), (9, 0, 31, 0)),   # the int32 sum wraps to a negative
    ((100, 2**31 - 60, 7, 1), (40, 0, 0, 0)),
    ((2**31 - 1,) * 4, (40, 0, 0, 0)),
], ids=["wraps_negative", "wraps_past_first", "all_max"])
def test_traced_sizes_whose_sum_wraps_are_cut_at_m(name, given, meant):
    _check_as_sizes(name, given, meant)


@pytest.mark.parametrize("name", TRACED_PATHS)
def test_traced_sizes_whose_sum_wraps_with_group_offset(name):
    """Local experts [2, 5) of six: their first row and sizes come from the same sums."""
    _check_as_sizes(name, (5, 7, 9, 2**31 - 30, 14, 4), (5, 7, 9, 19, 0, 0),
                    group_offset=OFFSET)


def test_checkify_reports_a_total_whose_int32_sum_wraps():
    from jax.experimental import checkify

    from pallasite.kernels import checked_group_sizes

    x, kernel, _ = _inputs()
    f = jax.jit(checkify.checkify(lambda x, k, s: grouped_projection(
        x, k, checked_group_sizes(s, x.shape[0]), jnp.float32)))
    err, _ = f(x, kernel, jnp.asarray((9, 0, 2**31 - 60, 100), jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match="more than the 40 rows"):
        err.throw()


@pytest.mark.parametrize("name", TRACED_PATHS)
@pytest.mark.parametrize("given,meant", [
    ((10, -5, 20, 5), (10, 0, 20, 5)),
    ((-2**31, 9, 0, 14), (0, 9, 0, 14)),
    ((9, 0, 14, -1), (9, 0, 14, 0)),
], ids=["middle", "first_min", "last"])
def test_traced_negative_sizes_are_empty_groups(name, given, meant):
    _check_as_sizes(name, given, meant)


@pytest.mark.parametrize("name", TRACED_PATHS)
def test_traced_negative_sizes_with_group_offset(name):
    _check_as_sizes(name, (5, -7, 9, 0, -14, 4), (5, 0, 9, 0, 0, 4), group_offset=OFFSET)


def _shard_sizes(sizes, rows, shards):
    """layouts.local_group_sizes of every row shard (the rows-sharded path), traced."""
    from pallasite.kernels.grouped_matmul import layouts

    f = jax.jit(lambda s, i: layouts.local_group_sizes(s, rows, i))
    return np.stack([np.asarray(f(jnp.asarray(sizes, jnp.int32), jnp.int32(i)))
                     for i in range(shards)])


def _cut(meant, rows, shards):
    """The sizes `meant` within each shard of `rows` rows (numpy)."""
    ends = np.cumsum(meant)
    lo = np.arange(shards)[:, None] * rows
    return np.clip(ends, lo, lo + rows) - np.clip(ends - meant, lo, lo + rows)


def test_row_shards_read_negative_sizes_as_empty_groups():
    np.testing.assert_array_equal(_shard_sizes((10, -5, 20, 5), 16, 3),
                                  _cut(np.array([10, 0, 20, 5]), 16, 3))


def test_row_shards_cut_a_total_whose_int32_sum_wraps():
    np.testing.assert_array_equal(_shard_sizes((9, 0, 2**31 - 60, 100), 16, 3),
                                  _cut(np.array([9, 0, 39, 0]), 16, 3))
