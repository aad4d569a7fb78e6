"""The fp8 products in XLA: dequantize, then the fp32 ragged products of xla.py.

The fallback of recipe="fp8" and of pre-quantized operands wherever the fp8 kernels do
not run (TPU, CPU, GPUs before sm89): it computes what the kernels compute (the same
block quantization, every product summed exactly in fp32 over the dequantized operands,
rounded once), at the bf16 path's cost or more, without fp8's speed. Same backend
contract as pallas_mosaic_gpu_fp8.py: `gmm`/`tgmm` quantize floating operands first;
`gmm_quantized`/`tgmm_quantized` take them quantized, in the kernels' layouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from pallasite.kernels.grouped_matmul import xla
from pallasite.kernels.grouped_matmul.group_metadata import local_groups
from pallasite.kernels.quantization import xla as quantize
from pallasite.reference import quantization as ref

BLOCK = ref.TOKEN_BLOCK
FP8 = jnp.float8_e4m3fn


def refusal(compute, operands, *, target: str | None) -> str | None:
    """XLA runs everywhere."""
    del compute, operands, target
    return None


def _exact(fn, *args, **kwargs):
    """fn with fp32 dots at full precision (not TF32 on a GPU)."""
    with jax.default_matmul_precision("float32"):
        return fn(*args, **kwargs)


def _dequantize_rows(values, scales_t):
    return ref.dequantize_blocks(values, scales_t.T, (1, BLOCK))


def _dequantize_weights(values, scales):
    return ref.dequantize_blocks(values, scales, (1, BLOCK, BLOCK))


def gmm_quantized(
    lhs: Shaped[Array, "m k"], lhs_scales_t: Float[Array, "kb m"],
    rhs: Shaped[Array, "g n k"], rhs_scales: Float[Array, "g nb kb"],
    group_sizes: Int[Array, " G"], *, group_offset=None, out_dtype=jnp.bfloat16,
    block_sizes=None, interpret: bool = False, product: str = "forward",
) -> Float[Array, "m n"]:
    """pallas_mosaic_gpu_fp8.gmm_quantized's product: rhs [g, n, k] (K-major)."""
    del block_sizes, interpret, product
    lhs32 = _dequantize_rows(lhs, lhs_scales_t)
    rhs32 = _dequantize_weights(rhs, rhs_scales)
    return _exact(xla.gmm, lhs32, rhs32, group_sizes, group_offset=group_offset,
                  transpose_rhs=True, out_dtype=out_dtype)


def gmm(lhs: Float[Array, "m k"], rhs: Float[Array, "g kn nk"], group_sizes: Int[Array, " G"],
        *, group_offset=None, transpose_rhs: bool = False, out_dtype=None, block_sizes=None,
        interpret: bool = False) -> Float[Array, "m n"]:
    """The forward (rhs [g, k, n]) or dx (transpose_rhs) in fp8 (module docstring)."""
    lhs_q, lhs_scales_t = quantize.rows(lhs, FP8)
    rhs_q, rhs_scales = quantize.weight_blocks(rhs, FP8, transpose=not transpose_rhs)
    return gmm_quantized(lhs_q, lhs_scales_t, rhs_q, rhs_scales, group_sizes,
                         group_offset=group_offset, out_dtype=out_dtype or lhs.dtype)


def tgmm(lhs: Float[Array, "m k"], rhs: Float[Array, "m n"], group_sizes: Int[Array, " G"],
         *, num_groups: int | None = None, group_offset=None, out_dtype=None, block_sizes=None,
         interpret: bool = False) -> Float[Array, "g k n"]:
    """dkernel in fp8: both operands in token blocks aligned to the local groups."""
    del block_sizes, interpret
    m = lhs.shape[0]
    g = group_sizes.shape[0] if num_groups is None else num_groups
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    ids, bound = ref.token_block_ids(sizes, m, row_start=row_start)

    def through_blocks(a):
        values, scales = ref.quantize_token_blocks(a, ids, bound, FP8)
        return ref.dequantize_token_blocks(values, scales, ids)

    return _exact(xla.tgmm, through_blocks(lhs), through_blocks(rhs), group_sizes,
                  num_groups=g, group_offset=group_offset, out_dtype=out_dtype or lhs.dtype)
