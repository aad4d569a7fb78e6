"""pallasite.kernels.quantize and its Pallas Triton quantizers: the same values and scales
as the XLA forms (bit for bit in the interpreter, NaN and infinities included), every
layout the fp8 products read, the public API's checks, lowering for CUDA from the CPU,
and, on a GPU, the compiled quantizers against the XLA forms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_export_testlib import TRITON_CALL, cuda_module
from pallasite.kernels import BlockScaled, quantize
from pallasite.kernels.grouped_matmul.token_blocks import token_blocks
from pallasite.kernels.quantization import pallas_triton, xla
from pallasite.reference import quantization as ref

F8 = jnp.float8_e4m3fn


def _same(a, b):
    """Bit-for-bit equal as fp32, NaN where NaN."""
    np.testing.assert_array_equal(np.asarray(jnp.asarray(a).astype(jnp.float32)),
                                  np.asarray(jnp.asarray(b).astype(jnp.float32)))


def _x(m, c, seed=0, dtype=jnp.bfloat16, scale=3.0):
    x = jax.random.normal(jax.random.key(seed), (m, c), jnp.float32) * scale
    # A NaN, an infinity and an all-zero 128-column block of one row: contained each.
    x = x.at[5, 3].set(jnp.nan).at[7, min(c - 1, 130)].set(jnp.inf)
    return x.at[9, :min(c, 128)].set(0.0).astype(dtype)


@pytest.fixture(params=[False, True], ids=["fp32_amax", "narrow_amax"])
def amax_form(request, monkeypatch):
    """Both of the kernels' amax forms (pallas_triton.NARROW_AMAX): over a fp32 copy of
    the tile, and over a 16-bit input's own bits."""
    monkeypatch.setattr(pallas_triton, "NARROW_AMAX", request.param)
    return request.param


@pytest.mark.parametrize("m,c", [(300, 260), (64, 128), (7, 100)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_rows_match_the_xla_form(m, c, dtype, amax_form):
    x = _x(m, c, dtype=dtype)
    for got, want in zip(pallas_triton.rows(x, F8, interpret=True), xla.rows(x, F8)):
        assert got.shape == want.shape and got.dtype == want.dtype
        _same(got, want)


def _used_columns(start, rows):
    used = np.asarray(rows) > 0
    return np.concatenate([np.arange(128 * t, 128 * t + 128) for t in range(len(used)) if used[t]])


@pytest.mark.parametrize("sizes,row_start,m", [
    ([100, 0, 150, 30], None, 300),   # an empty group, rows past the total
    ([300], None, 300),               # one group of whole and partial blocks
    ([50, 60, 70], 40, 256),          # local experts from row 40
    ([0, 0], None, 64),               # every group empty
])
def test_token_blocks_match_the_xla_form(sizes, row_start, m, amax_form):
    x = _x(m, 200, seed=1)
    table = token_blocks(jnp.asarray(sizes, jnp.int32), m, row_start=row_start)
    got = pallas_triton.token_blocks(x, table.start, table.rows, F8, interpret=True)
    want = xla.token_blocks(x, table.start, table.rows, F8)
    cols = _used_columns(table.start, table.rows)
    _same(got[0][:, cols], want[0][:, cols])  # unused blocks are never read
    _same(got[1], want[1])
    plain = pallas_triton.token_blocks(x, table.start, table.rows, F8, transpose=False,
                                       interpret=True)
    _same(plain[0], xla.token_blocks(x, table.start, table.rows, F8, transpose=False)[0])


def test_token_blocks_agree_with_the_oracle_numbering():
    sizes = jnp.array([100, 0, 150, 30], jnp.int32)
    table = token_blocks(sizes, 300)
    ids, _ = ref.token_block_ids(sizes, 300)
    starts = np.asarray(table.start)[np.asarray(ids)]
    rows = np.arange(300)
    assert ((rows >= starts) & (rows < starts + 128)).all()
    np.testing.assert_array_equal(table.first, [0, 1, 1, 3])
    np.testing.assert_array_equal(table.count, [1, 0, 2, 1])


def test_token_block_sums_saturate_instead_of_wrapping():
    table = token_blocks(jnp.array([100, 2**31 - 60], jnp.int32), 256)
    assert int(jnp.sum(table.rows)) == 256 and (np.asarray(table.rows) >= 0).all()


@pytest.mark.parametrize("transpose", [False, True])
def test_weight_blocks_match_the_xla_form(transpose, amax_form):
    w = jax.random.normal(jax.random.key(2), (3, 200, 300)).astype(jnp.bfloat16)
    w = w.at[1, 5, 140].set(jnp.nan)
    for got, want in zip(pallas_triton.weight_blocks(w, F8, transpose=transpose, interpret=True),
                         xla.weight_blocks(w, F8, transpose=transpose)):
        _same(got, want)


def test_offsets_fit_only_where_32_bits_cover_every_element():
    fits = pallas_triton.offsets_fit
    assert fits((256, 7168, 2048), jnp.bfloat16)  # 7.5 GB: 64-bit offsets
    assert not fits((256, 7168, 2048), F8)  # over 2**31 elements, at most 2**32 bytes
    assert fits((128, 7168, 2048), F8) and fits((512, 7168, 2048), F8)
    assert fits((2**31,), F8) and not fits((2**31 + 1,), F8) and not fits((2**32,), F8)
    assert fits((2**32 + 1,), F8) and fits((2**30, 2), jnp.bfloat16)


def test_oversized_fp8_values_never_reach_a_pallas_triton_store(monkeypatch):
    """At DeepSeek-V3's weight size (and for activations past 2**31 fp8 values) every
    quantizer takes its XLA form, traced abstractly: nothing is allocated."""
    s = jax.ShapeDtypeStruct
    seen = []
    real = pallas_triton.pl.pallas_call

    def spy(body, *a, **kw):
        seen.append(kw.get("name"))
        return real(body, *a, **kw)

    monkeypatch.setattr(pallas_triton.pl, "pallas_call", spy)
    for transpose in (False, True):
        out = jax.eval_shape(lambda w: pallas_triton.weight_blocks(w, F8, transpose=transpose),
                             s((256, 7168, 2048), jnp.bfloat16))
        assert out[0].dtype == F8
        assert out[0].shape == ((256, 2048, 7168) if transpose else (256, 7168, 2048))
    assert seen == []
    big = s((2**20 + 1, 2**11), jnp.bfloat16)  # over 2**31 fp8 values
    jax.eval_shape(lambda x: pallas_triton.rows(x, F8), big)
    jax.eval_shape(lambda x: pallas_triton.token_blocks(
        x, jnp.zeros((2**13,), jnp.int32), jnp.ones((2**13,), jnp.int32), F8,
        transpose=False), big)
    assert seen == []
    small = s((8, 512, 1024), jnp.bfloat16)  # the kernels still take what fits
    jax.eval_shape(lambda w: pallas_triton.weight_blocks(w, F8, transpose=True), small)
    assert seen == ["quantize_weight_blocks"]


@pytest.mark.parametrize("block", [(1, 128), (128, 1), (1, 128, 128), (2, 64)])
@pytest.mark.parametrize("implementation", ["pallas_triton", "xla"])
def test_quantize_gives_the_oracle_values(block, implementation):
    x = _x(300, 260, seed=3)
    if len(block) == 3:
        x = x.reshape(3, 100, 260)
    got = quantize(x, block, implementation=implementation, interpret_on_cpu=True)
    values, scales = ref.quantize_blocks(x, block)
    assert isinstance(got, BlockScaled) and got.block_shape == block
    _same(got.values, values)
    _same(got.scales, scales)
    _same(got.dequantize(), ref.dequantize_blocks(values, scales, block))


def test_quantize_default_order_on_cpu_is_the_oracle():
    x = _x(64, 256)
    got = jax.jit(lambda a: quantize(a, (1, 128)))(x)
    _same(got.values, ref.quantize_blocks(x, (1, 128))[0])


def test_block_scaled_is_a_pytree_through_jit_and_vmap():
    xs = jnp.stack([_x(64, 256, seed=s, dtype=jnp.float32) for s in range(3)])
    batched = jax.vmap(lambda a: quantize(a, (1, 128)))(xs)
    assert batched.values.shape == (3, 64, 256) and batched.scales.shape == (3, 64, 2)
    one = jax.jit(lambda b: b.dequantize())(quantize(xs[1], (1, 128)))
    _same(one, jax.vmap(lambda v, s: ref.dequantize_blocks(v, s, (1, 128)))(
        batched.values, batched.scales)[1])


def test_quantize_refuses_bad_input_by_name():
    with pytest.raises(ValueError, match="block_shape"):
        quantize(jnp.ones((4, 256)), (128,))
    with pytest.raises(TypeError, match="dtype"):
        quantize(jnp.ones((4, 256)), (1, 128), jnp.int8)
    with pytest.raises(TypeError, match="floating"):
        quantize(jnp.ones((4, 256), jnp.int32), (1, 128))
    with pytest.raises(ValueError, match="implementation"):
        quantize(jnp.ones((4, 256)), (1, 128), implementation="cuda")
    with pytest.raises(ValueError, match="scales shape"):
        BlockScaled(jnp.ones((4, 256), F8), jnp.ones((4, 3)), (1, 128)).check()
    with pytest.raises(TypeError, match="fp8"):
        BlockScaled(jnp.ones((4, 256)), jnp.ones((4, 2)), (1, 128)).check()


def test_zero_size_input_gives_empty_values():
    got = quantize(jnp.zeros((0, 256)), (1, 128))
    assert got.values.shape == (0, 256) and got.scales.shape == (0, 2)


@pytest.mark.parametrize("kind", ["rows", "token_blocks", "weight_blocks"])
def test_quantizers_lower_for_cuda_from_cpu(kind):
    s = jax.ShapeDtypeStruct
    if kind == "rows":
        f, args = (lambda a: pallas_triton.rows(a, F8)), (s((4096, 512), jnp.bfloat16),)
    elif kind == "token_blocks":
        f = lambda a, st, r: pallas_triton.token_blocks(a, st, r, F8)  # noqa: E731
        args = (s((4096, 512), jnp.bfloat16), s((40,), jnp.int32), s((40,), jnp.int32))
    else:
        f = lambda w: pallas_triton.weight_blocks(w, F8, transpose=True)  # noqa: E731
        args = (s((8, 512, 1024), jnp.bfloat16),)
    assert TRITON_CALL in cuda_module(f, *args)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_compiled_fp8_cast_saturates_as_the_clip_does():
    """What the compiled quantizers rely on to leave out the oracle's clip
    (pallas_triton._to_fp8): Triton's fp32 -> e4m3 cast holds values past 448 (a
    rounding step over it, far over it, infinities) at +-448 and keeps NaN."""
    from jax.experimental import pallas as pl

    x = jnp.array([448.0, 448.5, 464.0, 500.0, 1e30, jnp.inf, -448.7, -1e30, -jnp.inf,
                   jnp.nan, 0.0, -0.0, 1.0, 3.3e-3, 240.0, 447.9] * 2, jnp.float32)

    def cast(x_ref, o_ref):
        o_ref[...] = x_ref[...].astype(F8)

    got = pl.pallas_call(cast, out_shape=jax.ShapeDtypeStruct(x.shape, F8),
                         compiler_params=pallas_triton._params())(x)
    _same(got, ref.to_fp8(x, jnp.float32(1.0), F8))


@pytest.mark.gpu
@pytest.mark.parametrize("m,c", [(4096, 2048), (1000, 300)])
def test_compiled_quantizers_match_the_xla_forms(m, c, amax_form):
    x = _x(m, c, seed=5)
    for got, want in zip(jax.jit(lambda a: pallas_triton.rows(a, F8))(x), xla.rows(x, F8)):
        _close_fp8(got, want)
    sizes = jnp.asarray(np.diff(np.linspace(0, m, 9).astype(np.int32)), jnp.int32)
    table = token_blocks(sizes, m)
    got = jax.jit(lambda a: pallas_triton.token_blocks(a, table.start, table.rows, F8))(x)
    want = xla.token_blocks(x, table.start, table.rows, F8)
    cols = _used_columns(table.start, table.rows)
    _close_fp8(got[0][:, cols], want[0][:, cols])
    _close_fp8(got[1], want[1])
    w = x[: (m // 8) * 8].reshape(8, m // 8, c)
    for got, want in zip(jax.jit(lambda a: pallas_triton.weight_blocks(a, F8, transpose=True))(w),
                         xla.weight_blocks(w, F8, transpose=True)):
        _close_fp8(got, want)


@pytest.mark.gpu
@pytest.mark.gpu_memory_hog
@pytest.mark.parametrize("transpose", [False, True])
def test_compiled_weight_blocks_past_2_31_fp8_values(transpose):
    """256 x 7168 x 2048 (DeepSeek-V3's experts, past 32-bit offsets: the XLA form) on
    the device, groups before and after where the offsets would wrap (147 on), against
    the XLA form of each group alone."""
    w = jax.random.normal(jax.random.key(6), (256, 7168, 2048), jnp.bfloat16)
    values, scales = jax.jit(lambda a: pallas_triton.weight_blocks(a, F8, transpose=transpose))(w)
    assert values.dtype == F8
    for gi in (0, 146, 147, 255):
        want = xla.weight_blocks(w[gi:gi + 1], F8, transpose=transpose)
        _close_fp8(values[gi:gi + 1], want[0])
        _close_fp8(scales[gi:gi + 1], want[1])


def _close_fp8(got, want):
    """Equal but for a GPU's division rounding: scales within 2 ulp, values within one
    fp8 step, at most 1e-4 of them differing at all."""
    a = np.asarray(jnp.asarray(got).astype(jnp.float32))
    b = np.asarray(jnp.asarray(want).astype(jnp.float32))
    assert (np.isnan(a) == np.isnan(b)).all()
    ok = ~np.isnan(a)
    np.testing.assert_allclose(a[ok], b[ok], rtol=2**-3, atol=0)
    assert (a[ok] != b[ok]).mean() <= 1e-4
