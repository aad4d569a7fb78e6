"""The XLA backend: jax.lax.ragged_dot under the kernels' contract.

The fallback for every platform and input the kernels refuse. Same gmm/tgmm contract as
the Pallas backends: fp32 accumulation (preferred_element_type), one rounding, rows past
the total zero, empty groups zero. On the H200 it is far slower than the kernels and runs
out of memory on the DeepSeek-V3 shape (see docs/performance.md), so it is last in line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_DIMS = jax.lax.RaggedDotDimensionNumbers


def _row_mask(m: int, group_sizes: Int[Array, "g"]) -> jax.Array:
    total = jnp.sum(group_sizes, dtype=jnp.int32)
    return (jnp.arange(m, dtype=jnp.int32) < total)[:, None]


def gmm(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "g k n"] | Float[Array, "g n k"],
    group_sizes: Int[Array, "g"],
    *,
    transpose_rhs: bool = False,
    out_dtype=None,
    block_sizes=None,
    interpret: bool = False,
) -> Float[Array, "m n"]:
    """[m, k] x [g, k, n] (or [g, n, k] with transpose_rhs) -> [m, n], per group of rows."""
    del block_sizes, interpret
    out_dtype = out_dtype or lhs.dtype
    rhs_contract = 2 if transpose_rhs else 1
    dims = _DIMS(
        dot_dimension_numbers=(([1], [rhs_contract]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    out = jax.lax.ragged_dot_general(
        lhs, rhs, group_sizes, dims, preferred_element_type=jnp.float32
    )
    return jnp.where(_row_mask(lhs.shape[0], group_sizes), out, 0).astype(out_dtype)


def tgmm(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "m n"],
    group_sizes: Int[Array, "g"],
    *,
    num_groups: int | None = None,
    out_dtype=None,
    block_sizes=None,
    interpret: bool = False,
) -> Float[Array, "g k n"]:
    """[m, k], [m, n] -> [g, k, n]: per group, lhs_g^T @ rhs_g (zeros for empty groups)."""
    del block_sizes, interpret
    num_groups = num_groups or group_sizes.shape[0]
    out_dtype = out_dtype or lhs.dtype
    lhs = jnp.where(_row_mask(lhs.shape[0], group_sizes), lhs, 0)
    dims = _DIMS(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    out = jax.lax.ragged_dot_general(
        lhs, rhs, group_sizes, dims, preferred_element_type=jnp.float32
    )
    return out.astype(out_dtype)
