"""dx and dkernel of recipe="fp8" with the output gradient quantized once.

dx reads dy in 1 x 128 blocks, dkernel in token blocks aligned to groups. Quantized by
each product apart, dy is read twice; `grads` quantizes it both ways in one pass
(quantization's `rows_and_token_blocks`) and hands the results to a backend's two
pre-quantized products, `gmm_quantized` (dx) and `tgmm_quantized` (dkernel). The values
are the same as the two products' own: the same blocks, the same oracle functions.

ops.py takes this path where dy, x and the kernel are whole on the device that runs it
(no mesh, or the local arrays of a caller's shard_map); where the sharding planners place
dx's and dkernel's operands apart, each product quantizes its own.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from pallasite.kernels.grouped_matmul.group_metadata import local_groups
from pallasite.kernels.grouped_matmul.token_blocks import token_blocks

FP8 = jnp.float8_e4m3fn


def check(**operands) -> None:
    """TypeError naming an operand that is not floating up to fp32, or group sizes that
    are not int32 (what every fp8 product quantizes)."""
    group_sizes = operands.pop("group_sizes")
    for name, a in operands.items():
        if not jnp.issubdtype(a.dtype, jnp.floating) or jnp.dtype(a.dtype).itemsize > 4:
            raise TypeError(f"fp8 grouped products quantize floating operands up to fp32; "
                            f"{name} is {jnp.dtype(a.dtype).name}")
    if group_sizes.dtype != jnp.int32:
        raise TypeError(f"group_sizes must be int32, got {group_sizes.dtype}")


def grads(products: ModuleType, quantizer: ModuleType, dy: jax.Array, x: jax.Array,
          kernel: jax.Array, group_sizes: jax.Array, *, group_offset=None, dx_dtype: Any,
          dk_dtype: Any, block_sizes=None, interpret: bool = False,
          quantizer_interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(dx [m, k], dkernel [g, k, n]) of dy [m, n], x [m, k] and kernel [g, k, n]
    (groups [group_offset, group_offset + g) of group_sizes; all when None).
    products: the backend's fp8 module; quantizer: the quantization module it reads
    its operands from, run with `quantizer_interpret`."""
    check(dy=dy, x=x, kernel=kernel, group_sizes=group_sizes)
    m = dy.shape[0]
    g = kernel.shape[0]
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    table = token_blocks(sizes, m, row_start=row_start)
    q = dict(interpret=quantizer_interpret)
    dy_rows, dy_row_scales_t, dy_t, dy_t_scales = quantizer.rows_and_token_blocks(
        dy, table.start, table.rows, FP8, **q)
    kernel_q, kernel_scales = quantizer.weight_blocks(kernel, FP8, transpose=False, **q)
    dx = products.gmm_quantized(dy_rows, dy_row_scales_t, kernel_q, kernel_scales, group_sizes,
                                group_offset=group_offset, out_dtype=dx_dtype,
                                block_sizes=block_sizes, interpret=interpret, product="dx")
    x_t, x_scales = quantizer.token_blocks(x, table.start, table.rows, FP8, **q)
    dk = products.tgmm_quantized(x_t, x_scales, dy_t, dy_t_scales, table.first, table.count,
                                 out_dtype=dk_dtype, block_sizes=block_sizes,
                                 interpret=interpret, m=m)
    return dx, dk
