"""Block-scaled fp8 quantization and the fp8 grouped projection: the plain-JAX oracles.

Quantization. An array is cut into blocks of `block_shape` (the last block along a
dimension may be partial); each block gets one fp32 scale, `amax(|block|) / max_finite`
(448 for e4m3), and its values become `x / scale` rounded to the fp8 dtype (computed as
`x * (max_finite / amax)`, the form the kernels use too). An all-zero block gets scale 1
and zero values, never NaN; a block holding a NaN or an infinity gets a non-finite scale,
so the non-finite value spreads over its own block and no further. Dequantizing multiplies
each value by its block's scale.

Token blocks. The weight gradient contracts tokens, so its operands are quantized in
blocks of 128 rows x 1 column (one scale per column per block). A block must never mix
two groups' rows: the blocks start at each group's first row (a group of 300 rows has
blocks of 128, 128 and 44 rows). `token_block_ids` numbers them: the rows before the
first group (with local experts) form one segment, each group one, the rows past the
last group one more, and each segment is cut into 128-row blocks from its own start.

The fp8 recipe (DeepSeek-V3's): the forward multiplies `Q(x)` (1 x 128 blocks along k)
by `Q(kernel)` (1 x 128 x 128 blocks); the backward computes dx = Q(dy) Q(kernel)^T with
dy in 1 x 128 blocks along n, and dkernel_g = Qt(x_g)^T Qt(dy_g) in token blocks. Every
product sums exactly (fp32, HIGHEST) over the dequantized operands and rounds once: this
is the contract the kernels are held to (theirs promote the tensor cores' partial sums to
fp32 after each 128-deep step). Gradients are straight-through: they go to x and kernel
in their own dtypes as if the quantization were the identity.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer, Shaped

from pallasite.reference.grouped_projection import (
    gmm_reference,
    tgmm_reference,
    validate_grouped_projection,
)

__all__ = [
    "FP8_DTYPES",
    "TOKEN_BLOCK",
    "max_finite",
    "amax",
    "magnitude_bits",
    "amax_of_bits",
    "scale_and_inverse",
    "to_fp8",
    "quantize_blocks",
    "dequantize_blocks",
    "token_block_ids",
    "quantize_token_blocks",
    "dequantize_token_blocks",
    "quantized_rows",
    "quantized_kernel",
    "quantized_tokens",
    "grouped_projection_fp8",
    "grouped_projection_quantized",
]

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
# Rows per token block of the weight gradient's operands; also the k depth of one scale
# step in every fp8 product.
TOKEN_BLOCK = 128


def max_finite(dtype) -> float:
    """The largest finite value of `dtype` (448 for float8_e4m3fn)."""
    return float(jnp.finfo(dtype).max)


def _check_fp8(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in [np.dtype(d) for d in FP8_DTYPES]:
        raise TypeError(f"dtype must be one of {[np.dtype(d).name for d in FP8_DTYPES]}, "
                        f"got {dtype.name}")
    return dtype


def check_block_shape(shape: tuple[int, ...], block_shape) -> tuple[int, ...]:
    """`block_shape` as a tuple of positive ints of `shape`'s rank (ValueError otherwise)."""
    try:
        block = tuple(int(b) for b in block_shape)
    except TypeError:
        raise ValueError(f"block_shape must be a sequence of ints, got {block_shape!r}") from None
    if len(block) != len(shape) or min(block, default=1) < 1:
        raise ValueError(f"block_shape {block_shape!r} must hold one positive int per "
                         f"dimension of the array's shape {tuple(shape)}")
    return block


def scales_shape(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """ceil(shape / block): one scale per (possibly partial) block."""
    return tuple(-(-s // b) for s, b in zip(shape, block))


def amax(x: Array, axis=None) -> Array:
    """max |x| over `axis`, NaN where any value there is NaN or infinite.

    One integer max over the magnitudes' bits (magnitude_bits): a non-negative float's
    bits order as its value does, and every non-finite one sits above the largest finite
    one. A float max would not do: on a GPU it drops NaN operands (PTX max.f32 returns
    the other one)."""
    return amax_of_bits(jnp.max(magnitude_bits(x), axis=axis))


def magnitude_bits(x: Array) -> Array:
    """|x|'s fp32 bits as int32 (the sign bit cleared): ordered as |x| for finite values,
    infinities and NaNs at 0x7F800000 and above."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF


def amax_of_bits(top: Array) -> Array:
    """The largest magnitude from its bits (magnitude_bits' max): NaN if non-finite."""
    return jnp.where(top >= 0x7F800000, jnp.nan,
                     jax.lax.bitcast_convert_type(top, jnp.float32))


def scale_and_inverse(amax: Array, dtype) -> tuple[Array, Array]:
    """(scale, 1 / scale) of blocks whose largest magnitude is `amax`: amax / max_finite,
    and 1 for an all-zero block (inverse 0: its values are zeros)."""
    top = max_finite(dtype)
    zero = amax == 0
    scale = jnp.where(zero, 1.0, amax / top)
    inverse = jnp.where(zero, 0.0, top / jnp.where(zero, 1.0, amax))
    return scale.astype(jnp.float32), inverse.astype(jnp.float32)


def to_fp8(x: Array, inverse: Array, dtype) -> Array:
    """x * inverse, held to the dtype's finite range (rounding can step past it), cast.
    The clip is two selects, not a min and a max, which on a GPU would turn a NaN into
    the bound."""
    top = max_finite(dtype)
    y = x.astype(jnp.float32) * inverse
    y = jnp.where(y > top, top, jnp.where(y < -top, -top, y))
    return y.astype(dtype)


def widen(values: Shaped[Array, "..."]) -> Float[Array, "..."]:
    """fp8 values as fp32, with their rounding kept where they were just quantized.

    XLA's GPU compiler, which allows excess precision by default, folds a chain of float
    converts such as f32 -> fp8 -> f32 into nothing (its SimplifyFPConversions pass): a
    quantize-dequantize round trip in one jitted program would then skip the fp8 rounding
    on a GPU, and the oracle would no longer be what the kernels compute (seen on an H200
    with jax 0.11.2: the dkernel oracle came out unquantized, 3.6% from the kernels). An
    optimization barrier between the two converts keeps the chain."""
    return jax.lax.optimization_barrier(values).astype(jnp.float32)


def _blocked(x: Array, block: tuple[int, ...]) -> Array:
    """x zero-padded to whole blocks and reshaped to [n0, b0, n1, b1, ...]."""
    counts = scales_shape(x.shape, block)
    pad = [(0, c * b - s) for s, b, c in zip(x.shape, block, counts)]
    x = jnp.pad(x, pad)
    return x.reshape([d for c, b in zip(counts, block) for d in (c, b)])


def quantize_blocks(
    x: Float[Array, "..."], block_shape, dtype=jnp.float8_e4m3fn
) -> tuple[Shaped[Array, "..."], Float[Array, "..."]]:
    """(values in `dtype` of x's shape, fp32 scales of shape ceil(x.shape / block_shape))."""
    dtype = _check_fp8(dtype)
    block = check_block_shape(x.shape, block_shape)
    blocks = _blocked(x.astype(jnp.float32), block)
    block_axes = tuple(range(1, blocks.ndim, 2))
    scale, inverse = scale_and_inverse(amax(blocks, block_axes), dtype)
    values = to_fp8(blocks, jnp.expand_dims(inverse, block_axes), dtype)
    values = values.reshape([d * b for d, b in zip(scale.shape, block)])
    return values[tuple(slice(0, s) for s in x.shape)], scale


def dequantize_blocks(values: Shaped[Array, "..."], scales: Float[Array, "..."], block_shape,
                      dtype=jnp.float32) -> Float[Array, "..."]:
    """values * their blocks' scales, in `dtype`."""
    block = check_block_shape(values.shape, block_shape)
    if tuple(scales.shape) != scales_shape(values.shape, block):
        raise ValueError(f"scales shape {scales.shape} does not match values {values.shape} "
                         f"in blocks of {block}")
    full = scales
    for axis, b in enumerate(block):
        full = jnp.repeat(full, b, axis=axis)
    full = full[tuple(slice(0, s) for s in values.shape)]
    return (widen(values) * full).astype(dtype)


def token_block_ids(group_sizes: Integer[Array, "G"], m: int, *, row_start=None,
                    num_groups: int | None = None,
                    block: int = TOKEN_BLOCK) -> tuple[Integer[Array, "m"], int]:
    """(the token block of each of the m rows, a static bound on the number of blocks).

    The segments are the rows before `row_start` (0 when None), the `num_groups` groups of
    `group_sizes` (all of them when None) from there on, and the rows past the last; each
    is cut into `block`-row blocks from its own first row, numbered in row order. Sizes
    are clipped to the m rows (negative sizes count as empty)."""
    g = group_sizes.shape[0] if num_groups is None else num_groups
    sizes = jnp.maximum(group_sizes[:g].astype(jnp.int32), 0)
    first = jnp.zeros((), jnp.int32) if row_start is None else jnp.asarray(row_start, jnp.int32)
    first = jnp.clip(first, 0, m)
    ends = jnp.minimum(first + jnp.cumsum(sizes), m)
    seg_end = jnp.concatenate([first[None], ends, jnp.full((1,), m, jnp.int32)])
    seg_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), seg_end[:-1]])
    seg_blocks = (seg_end - seg_start + block - 1) // block
    seg_base = jnp.cumsum(seg_blocks) - seg_blocks
    rows = jnp.arange(m, dtype=jnp.int32)
    seg = jnp.sum(rows[:, None] >= seg_end[None, :], axis=1)  # the segment holding each row
    seg = jnp.minimum(seg, g + 1)
    ids = seg_base[seg] + (rows - seg_start[seg]) // block
    return ids.astype(jnp.int32), m // block + g + 3


def quantize_token_blocks(
    x: Float[Array, "m c"], block_ids: Integer[Array, "m"], num_blocks: int,
    dtype=jnp.float8_e4m3fn,
) -> tuple[Shaped[Array, "m c"], Float[Array, "nb c"]]:
    """(values [m, c], scales [num_blocks, c]): one scale per column of each token block
    (`token_block_ids`); blocks no row falls in get scale 1."""
    dtype = _check_fp8(dtype)
    x32 = x.astype(jnp.float32)
    def per_block(reduce, values):
        return reduce(values, block_ids, num_segments=num_blocks, indices_are_sorted=True)

    exponent = jax.lax.bitcast_convert_type(x32, jnp.int32) & 0x7F800000
    nonfinite = exponent == 0x7F800000
    top = jnp.maximum(per_block(jax.ops.segment_max, jnp.where(nonfinite, 0.0, jnp.abs(x32))),
                      0)  # empty blocks: -inf
    bad = per_block(jax.ops.segment_max, nonfinite.astype(jnp.float32)) > 0
    top = jnp.where(bad, jnp.nan, top)  # NaN if any value is not finite (amax)
    scale, inverse = scale_and_inverse(top, dtype)
    return to_fp8(x32, inverse[block_ids], dtype), scale


def dequantize_token_blocks(values: Shaped[Array, "m c"], scales: Float[Array, "nb c"],
                            block_ids: Integer[Array, "m"]) -> Float[Array, "m c"]:
    return widen(values) * scales[block_ids]


# ------------------------------------------------------------------ the fp8 projection


def quantized_rows(a: Array, dtype=jnp.float8_e4m3fn) -> Array:
    """a [m, c] through 1 x 128 blocks along c, dequantized to fp32: what the fp8
    products multiply in place of a forward or dx lhs."""
    values, scales = quantize_blocks(a, (1, TOKEN_BLOCK), dtype)
    return dequantize_blocks(values, scales, (1, TOKEN_BLOCK))


def quantized_kernel(kernel: Array, dtype=jnp.float8_e4m3fn) -> Array:
    """kernel [g, k, n] through 1 x 128 x 128 blocks, dequantized to fp32."""
    values, scales = quantize_blocks(kernel, (1, TOKEN_BLOCK, TOKEN_BLOCK), dtype)
    return dequantize_blocks(values, scales, (1, TOKEN_BLOCK, TOKEN_BLOCK))


def quantized_tokens(a: Array, group_sizes: Array, dtype=jnp.float8_e4m3fn) -> Array:
    """a [m, c] through 128-row token blocks aligned to the groups, dequantized to fp32:
    what the fp8 dkernel contracts."""
    ids, bound = token_block_ids(group_sizes, a.shape[0])
    values, scales = quantize_token_blocks(a, ids, bound, dtype)
    return dequantize_token_blocks(values, scales, ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_projection(x, kernel, group_sizes, compute, dtype):
    out, _ = _fp8_forward(x, kernel, group_sizes, compute, dtype)
    return out


def _fp8_forward(x, kernel, group_sizes, compute, dtype):
    out = gmm_reference(quantized_rows(x, dtype), quantized_kernel(kernel, dtype), group_sizes)
    protos = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), kernel.dtype))
    return out.astype(compute), (x, kernel, group_sizes, protos)


def _fp8_backward(compute, dtype, residuals, dy):
    x, kernel, group_sizes, (x_proto, k_proto) = residuals
    dy = dy.astype(compute)
    dx = gmm_reference(quantized_rows(dy, dtype), quantized_kernel(kernel, dtype), group_sizes,
                       transpose_rhs=True)
    dk = tgmm_reference(quantized_tokens(x, group_sizes, dtype), quantized_tokens(dy, group_sizes, dtype),
                        group_sizes, kernel.shape[0])
    return dx.astype(x_proto.dtype), dk.astype(k_proto.dtype), None


_fp8_projection.defvjp(_fp8_forward, _fp8_backward)


def grouped_projection_fp8(
    x: Float[Array, "m k"],
    kernel: Float[Array, "g k n"],
    group_sizes: Integer[Array, "g"],
    compute,
    *,
    dtype=jnp.float8_e4m3fn,
) -> Float[Array, "m n"]:
    """The fp8 training recipe's oracle (module docstring): `[m, n]` in `compute`, rows
    past the total zero; differentiable, dx in x.dtype and dkernel in kernel.dtype."""
    validate_grouped_projection(x, kernel, group_sizes, compute)
    return _fp8_projection(x, kernel, group_sizes, np.dtype(compute), np.dtype(dtype))


def grouped_projection_quantized(
    x_values: Shaped[Array, "m k"], x_scales: Float[Array, "m kb"],
    kernel_values: Shaped[Array, "g k n"], kernel_scales: Float[Array, "g kb nb"],
    group_sizes: Integer[Array, "g"], compute,
) -> Float[Array, "m n"]:
    """The product of pre-quantized operands (x in 1 x 128 blocks, the kernel in
    1 x 128 x 128 blocks), summed exactly in fp32 and rounded once to `compute`."""
    x = dequantize_blocks(x_values, x_scales, (1, TOKEN_BLOCK))
    kernel = dequantize_blocks(kernel_values, kernel_scales, (1, TOKEN_BLOCK, TOKEN_BLOCK))
    return gmm_reference(x, kernel, group_sizes).astype(compute)
