"""Block quantization through Pallas Triton (CUDA GPUs from sm89), in the fp8 kernels'
layouts, one pass over the input each.

- `rows`: x [m, c] in 1 x 128 blocks (the activations and the output gradient as the
  forward and dx read them). A program takes `ROWS` rows x 128 columns, finds each row's
  amax, writes the fp8 values and the scales transposed, `[c / 128, m]`, so a kernel's
  row tile reads its scales as one contiguous run per k step.
- `token_blocks`: x [m, c] in 128 x 1 blocks given by their first rows and row counts
  (grouped_matmul/token_blocks.py aligns them to groups). A
  program takes one block's (up to) 128 rows x `COLUMNS` columns, finds each column's
  amax and writes the values transposed, `[c, 128 * bound]` (the zeros past the block's
  rows included), so the weight gradient contracts whole, aligned 128-token steps.
- `weight_blocks`: w [g, k, n] in 1 x 128 x 128 blocks; with `transpose` the values are
  written [g, n, k] (the forward's K-major layout: fp8 wgmma reads both operands K-major).

Pallas Triton (jax 0.11.2) addresses an array with 32-bit signed offsets unless the array
holds more than 2**32 bytes. A 1-byte array of more than 2**31 elements and at most 2**32
(2-4 GiB of fp8: DeepSeek-V3's 256 experts of 7168 x 2048 on one device) therefore
overflows them, and stores land before the array. `offsets_fit` says when that happens;
every quantizer takes its XLA form there. (A weight kernel that stored uint16 pairs of fp8
values, the same bytes in half the elements, ran at 1.36 TB/s on those DeepSeek-V3
weights, against 1.93 for the XLA form, on an H200 on 2026-12-03: docs/performance.md.)

The scale and rounding are the oracle's functions (pallasite.reference.quantization),
traced into the kernel body, so both compute the same expressions; the one exception is
the clip to the finite range before the cast, which a compiled kernel leaves to the cast
itself (`_to_fp8`). Loads and stores are masked: no dimension needs padding. Each
element is read once (2 bytes for bf16) and written once (1 byte), plus the scales.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallasite.kernels import cost, sharding
from pallasite.kernels.quantization import xla
from pallasite.reference import quantization as ref

BLOCK = ref.TOKEN_BLOCK
# Rows per program of `rows`, columns per program of `token_blocks`, and their warps.
ROWS = 64
COLUMNS = 64
NUM_WARPS = 4
TOKEN_NUM_WARPS = 4
# Whether compiled kernels leave the clip to the cast (`_to_fp8`); False keeps the
# oracle's selects (a sweep knob: tools/sweeps/fp8_quantizers.py --cast-variants).
SATURATING_CAST = True
# Whether a 16-bit input's amax is taken over its own bits (_magnitude_bits), the tile
# kept in its dtype until the cast, rather than over a fp32 copy (a sweep knob:
# tools/sweeps/fp8_quantizers.py --token-variants). Compiled for sm_90 (triton 3.6,
# mixtral's x in bf16) it takes the token-block kernel from 109 registers to 64 (the
# occupancy limit from 4 programs an SM to 8) and the untransposed weight kernel from 162
# to 128; the rows and transposed weight kernels keep 56 and 96. Off until timed.
NARROW_AMAX = False


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def offsets_fit(shape: tuple[int, ...], dtype) -> bool:
    """Whether Pallas Triton's offsets into an array of this shape and dtype stay exact:
    it takes 64-bit offsets only past 2**32 bytes, so 32-bit ones must cover every
    element index (module docstring)."""
    size = math.prod(shape)
    return size <= 2**31 or size * np.dtype(dtype).itemsize > 2**32  # index size - 1


def _ok(offset, size: int, limit: int):
    return offset + jnp.arange(size, dtype=jnp.int32) < limit


def _params(num_warps: int = NUM_WARPS):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def _to_fp8(x, inverse, fp8, interpret: bool):
    """ref.to_fp8 as a kernel computes it. Compiled, Triton casts fp32 to fp8 with
    `cvt.rn.satfinite` (sm89 and later), which holds a value rounded past the finite
    range at the bound and keeps NaN: what the oracle's clip does, so the clip's two
    compares and selects per value are left out for e4m3 (tests/test_quantize.py
    checks that cast on a GPU). The interpreter casts as XLA does (NaN past the range)
    and keeps the clip, as e5m2 does."""
    if interpret or not SATURATING_CAST or np.dtype(fp8) != np.dtype(jnp.float8_e4m3fn):
        return ref.to_fp8(x, inverse, fp8)
    return (x.astype(jnp.float32) * inverse).astype(fp8)


def _magnitude_bits(x):
    """|x|'s bits with the sign cleared, ordered as |x| with every non-finite value above
    the finite ones (ref.magnitude_bits): for a 16-bit float its own bits (int16), so a
    tile's amax needs no fp32 copy of it in registers; otherwise those of its fp32 value."""
    if NARROW_AMAX and x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.int16) & jnp.int16(0x7FFF)
    return ref.magnitude_bits(x)


def _amax_of_bits(top, dtype):
    """ref.amax_of_bits of _magnitude_bits' max, for values of `dtype`: the largest
    magnitude in fp32, NaN if non-finite (a 16-bit value widens exactly, inf and NaN
    included)."""
    if top.dtype == jnp.int16:
        top = ref.magnitude_bits(jax.lax.bitcast_convert_type(top, dtype))
    return ref.amax_of_bits(top)


def _cost(x, outputs, fp8):
    """Per element the multiply by the inverse scale, the one op pl.estimate_cost counts
    (not the abs, the clip's compares and selects, or the cast)."""
    body = lambda a: ref.to_fp8(jnp.abs(a), jnp.float32(1.0), fp8)  # noqa: E731
    return cost.estimate(body, cost.struct(x.shape, jnp.float32), inputs=(x,), outputs=outputs)


# --------------------------------------------------------------------------- rows


def _rows_kernel(x_ref, v_ref, s_ref, *, m, c, fp8, interpret):
    r0, j = pl.program_id(0) * ROWS, pl.program_id(1)
    row_ok = _ok(r0, ROWS, m)
    col_ok = _ok(j * BLOCK, BLOCK, c)
    mask = row_ok[:, None] & col_ok[None, :]
    at = (pl.ds(r0, ROWS), pl.ds(j * BLOCK, BLOCK))
    x = plgpu.load(x_ref.at[at], mask=mask, other=0.0)
    top = _amax_of_bits(jnp.max(_magnitude_bits(x), axis=1), x.dtype)
    scale, inverse = ref.scale_and_inverse(top, fp8)
    plgpu.store(v_ref.at[at], _to_fp8(x, inverse[:, None], fp8, interpret), mask=mask)
    plgpu.store(s_ref.at[j, pl.ds(r0, ROWS)], scale, mask=row_ok)


def rows(x: jax.Array, dtype, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [m, c] -> (values [m, c] in `dtype`, scales [ceil(c / 128), m] fp32)."""
    m, c = x.shape
    if not (offsets_fit((m, c), dtype) and offsets_fit(x.shape, x.dtype)):
        return xla.rows(x, dtype)
    out = (sharding.out_struct((m, c), dtype, like=x),
           sharding.out_struct((_cdiv(c, BLOCK), m), jnp.float32, like=x))
    return pl.pallas_call(
        functools.partial(_rows_kernel, m=m, c=c, fp8=dtype, interpret=interpret),
        out_shape=out,
        grid=(_cdiv(m, ROWS), _cdiv(c, BLOCK)),
        compiler_params=_params(),
        interpret=interpret,
        cost_estimate=_cost(x, out, dtype),
        name="quantize_rows",
    )(x)


# --------------------------------------------------------------------------- token blocks


def _token_kernel(start_ref, rows_ref, x_ref, v_ref, s_ref, *, c, fp8, transpose, interpret):
    t, j = pl.program_id(0), pl.program_id(1)
    start, count = start_ref[t], rows_ref[t]
    cols = pl.ds(j * COLUMNS, COLUMNS)
    col_ok = _ok(j * COLUMNS, COLUMNS, c)

    @pl.when(count > 0)
    def _():
        row_ok = jnp.arange(BLOCK, dtype=jnp.int32) < count
        x = plgpu.load(x_ref.at[pl.ds(start, BLOCK), cols],
                       mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        top = _amax_of_bits(jnp.max(_magnitude_bits(x), axis=0), x.dtype)
        scale, inverse = ref.scale_and_inverse(top, fp8)
        values = _to_fp8(x, inverse[None, :], fp8, interpret)
        if transpose:  # the whole block, zeros past `count` (a select: NaN-safe)
            values = jnp.where(row_ok[:, None], values, jnp.zeros_like(values))
            plgpu.store(v_ref.at[cols, pl.ds(t * BLOCK, BLOCK)], values.T,
                        mask=col_ok[:, None])
        else:
            plgpu.store(v_ref.at[pl.ds(start, BLOCK), cols], values,
                        mask=row_ok[:, None] & col_ok[None, :])
        plgpu.store(s_ref.at[t, cols], scale, mask=col_ok)

    @pl.when(count == 0)  # an unused block: scale 1 (its values are never read)
    def _():
        plgpu.store(s_ref.at[t, cols], jnp.ones((COLUMNS,), jnp.float32), mask=col_ok)


def token_blocks(x: jax.Array, start: jax.Array, rows: jax.Array, dtype, *, transpose: bool = True,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [m, c] in the blocks of rows [start[t], start[t] + rows[t]) (rows <= 128; 0 for
    an unused block) -> (values [c, 128 * bound] (transpose) or [m, c], scales
    [bound, c]), bound = len(start)."""
    m, c = x.shape
    shape = (c, BLOCK * start.shape[0]) if transpose else (m, c)
    if not (offsets_fit(shape, dtype) and offsets_fit(x.shape, x.dtype)):
        return xla.token_blocks(x, start, rows, dtype, transpose=transpose)
    out = (sharding.out_struct(shape, dtype, like=x),
           sharding.out_struct((start.shape[0], c), jnp.float32, like=x))
    return pl.pallas_call(
        functools.partial(_token_kernel, c=c, fp8=dtype, transpose=transpose,
                          interpret=interpret),
        out_shape=out,
        grid=(start.shape[0], _cdiv(c, COLUMNS)),
        compiler_params=_params(TOKEN_NUM_WARPS),
        interpret=interpret,
        cost_estimate=_cost(x, (start, rows) + out, dtype),
        name="quantize_token_blocks",
    )(start, rows, x)


# --------------------------------------------------------------------------- weights


def _block_amax(w):
    """amax of a 2-D block, one axis at a time: Pallas Triton lowers a reduction over two
    axes with the operand's rank in its sharding, which fails under a mesh (jax 0.11.2)."""
    return _amax_of_bits(jnp.max(jnp.max(_magnitude_bits(w), axis=1), axis=0), w.dtype)


def _weight_kernel(w_ref, v_ref, s_ref, *, k, n, fp8, transpose, interpret):
    gi, kb, nb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    mask = _ok(kb * BLOCK, BLOCK, k)[:, None] & _ok(nb * BLOCK, BLOCK, n)[None, :]
    ks, ns = pl.ds(kb * BLOCK, BLOCK), pl.ds(nb * BLOCK, BLOCK)
    w = plgpu.load(w_ref.at[gi, ks, ns], mask=mask, other=0.0)
    scale, inverse = ref.scale_and_inverse(_block_amax(w), fp8)
    values = _to_fp8(w, inverse, fp8, interpret)
    if transpose:
        plgpu.store(v_ref.at[gi, ns, ks], values.T, mask=mask.T)
        plgpu.store(s_ref.at[gi, nb, kb], scale)
    else:
        plgpu.store(v_ref.at[gi, ks, ns], values, mask=mask)
        plgpu.store(s_ref.at[gi, kb, nb], scale)


def weight_blocks(w: jax.Array, dtype, *, transpose: bool,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """w [g, k, n] -> (values [g, k, n], scales [g, kb, nb]), or with `transpose`
    ([g, n, k], [g, nb, kb]). The XLA form where 32-bit offsets would not reach every
    value (module docstring)."""
    g, k, n = w.shape
    kb, nb = _cdiv(k, BLOCK), _cdiv(n, BLOCK)
    shape, scales = ((g, n, k), (g, nb, kb)) if transpose else ((g, k, n), (g, kb, nb))
    if not (offsets_fit(shape, dtype) and offsets_fit(w.shape, w.dtype)):
        return xla.weight_blocks(w, dtype, transpose=transpose)
    out = (sharding.out_struct(shape, dtype, like=w),
           sharding.out_struct(scales, jnp.float32, like=w))
    return pl.pallas_call(
        functools.partial(_weight_kernel, k=k, n=n, fp8=dtype, transpose=transpose,
                          interpret=interpret),
        out_shape=out,
        grid=(g, kb, nb),
        compiler_params=_params(),
        interpret=interpret,
        cost_estimate=_cost(w, out, dtype),
        name="quantize_weight_blocks",
    )(w)
