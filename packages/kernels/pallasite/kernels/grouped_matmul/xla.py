"""The XLA backend: jax.lax.ragged_dot under the kernels' contract.

The fallback for every platform and input the kernels refuse. Same gmm/tgmm contract as
the Pallas backends: fp32 accumulation (preferred_element_type), one rounding, rows past
the total zero, empty groups zero. On the H200 it is far slower than the kernels and runs
out of memory on the DeepSeek-V3 shape (see docs/performance.md), so it is last in line.

Non-finite weights stay in their group's rows (`ragged_product`, which the plain-JAX path
shares): ragged_dot may multiply a group's weights by the zeroed rows of other groups
(0 * inf = NaN in every row), so the product runs on the finite part of the weights, and
each row of a group whose weights hold a non-finite value in a column's contraction is
NaN in that column, as the kernels give. Rows of no group (past the total, other experts
with a group_offset) stay zero. The cost is a masked copy of the weights and a [g, n]
lookup per row: on a TPU v5e (2026-12-07, docs/performance.md) that made this path 3.4x
a bare ragged_dot's forward time at qwen3's shape and 1.45x at mixtral's. On the
platforms in CONTAIN_ONLY_NONFINITE_ON (TPUs) the weights are checked first, one
all-finite reduction, and a lax.cond runs the bare product when they are all finite:
there the forward took 1.38x and 1.24x ragged_dot's time, with the same values bit for
bit. Not on GPUs: XLA's GPU runtime may read a lax.cond's predicate on the host, a round
trip per call, and no GPU has timed it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallasite.kernels.grouped_matmul import bilinear
from pallasite.kernels.grouped_matmul.group_metadata import local_groups

_DIMS = jax.lax.RaggedDotDimensionNumbers

# ONE_GROUP: with a single group the products are dense dots under the row mask, not
# ragged ones. On a TPU v5e (jax 0.10.2's libtpu, 2026-12-07) XLA's compiler failed on
# jax.lax.ragged_dot with one group ("RET_CHECK failure ... mask_aggregator.cc"): its
# contraction form (the weight gradient) at every shape tried, the forward at m=50,
# k=24, n=40. One local expert is common under expert parallelism.

# The lowering platforms (jax.lax.platform_dependent's names) on which non-finite weights
# are contained only when there are some (module docstring). TPU v5e, 2026-12-07
# (tools/sweeps/grouped_projection_xla_tpu.py): forward 9.79 -> 3.96 ms at qwen3's shape,
# 42.0 -> 35.9 at mixtral's; forward+backward 21.7 -> 13.2 and 167.0 -> 155.6.
CONTAIN_ONLY_NONFINITE_ON: tuple[str, ...] = ("tpu",)


def _row_mask(m: int, group_sizes: Int[Array, "g"], row_start=None) -> jax.Array:
    """[m, 1]: the rows of some group, [row_start, row_start + total)."""
    rows = jnp.arange(m, dtype=jnp.int32)
    first = jnp.int32(0) if row_start is None else row_start
    return ((rows >= first) & (rows < first + jnp.sum(group_sizes, dtype=jnp.int32)))[:, None]


def _from_row_zero(group_sizes, row_start):
    """ragged_dot's group sizes start at row 0: the rows before row_start join the first
    group (their results are masked out, so they only cost ragged_dot's work)."""
    if row_start is None:
        return group_sizes
    return group_sizes.at[0].add(row_start.astype(group_sizes.dtype))


@dataclasses.dataclass(frozen=True)
class RaggedDot:
    """(lhs [m, k], rhs [g, k, n] (or [g, n, k] with transpose_rhs), group_sizes,
    row_start) -> [m, n] in `accumulate`: rows [row_start, row_start + total) times their
    group's rhs, every other row zero. Bilinear in (lhs, rhs), and hashable, so the
    plain-JAX path can run it as a bilinear.call primitive."""

    transpose_rhs: bool
    accumulate: np.dtype

    def __call__(self, lhs, rhs, group_sizes, row_start):
        contract = 2 if self.transpose_rhs else 1
        if rhs.shape[0] == 1:  # one group: a dense product under the row mask (ONE_GROUP)
            out = jax.lax.dot_general(lhs, rhs[0], (([1], [contract - 1]), ([], [])),
                                      preferred_element_type=self.accumulate)
        else:
            dims = _DIMS(dot_dimension_numbers=(([1], [contract]), ([], [])),
                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
            out = jax.lax.ragged_dot_general(lhs, rhs, _from_row_zero(group_sizes, row_start),
                                             dims, preferred_element_type=self.accumulate)
        return jnp.where(_row_mask(lhs.shape[0], group_sizes, row_start), out,
                         jnp.zeros((), out.dtype))


def ragged_product(lhs, rhs, group_sizes, row_start=None, *, transpose_rhs: bool = False,
                   accumulate=jnp.float32, any_order: bool = False) -> jax.Array:
    """[m, n] in `accumulate`: rows [row_start, row_start + sum(group_sizes)) times their
    group's rhs ([g, k, n], or [g, n, k] with transpose_rhs), every other row zero; a
    non-finite weight reaches only its own group's rows (module docstring). Plain JAX
    with no custom rules. any_order (the plain-JAX path, plain.py): the product runs as a
    bilinear.call, which JAX differentiates to any order and vmaps in every derivative
    (jax.jacfwd, jax.hessian); ragged_dot alone batches only on leading axes. That path
    always contains non-finite weights; the other, lowered for a platform in
    CONTAIN_ONLY_NONFINITE_ON, checks the weights first and contains only when some are
    non-finite."""
    first = jnp.int32(0) if row_start is None else row_start
    product = RaggedDot(transpose_rhs, np.dtype(accumulate))
    contained = functools.partial(contained_product, product, any_order=any_order)
    if any_order or not CONTAIN_ONLY_NONFINITE_ON:
        return contained(lhs, rhs, group_sizes, first)

    def checked(lhs, rhs, group_sizes, first):
        return jax.lax.cond(jnp.isfinite(rhs).all(), product, contained,
                            lhs, rhs, group_sizes, first)

    return jax.lax.platform_dependent(lhs, rhs, group_sizes, first, default=contained,
                                      **dict.fromkeys(CONTAIN_ONLY_NONFINITE_ON, checked))


def contained_product(product: RaggedDot, lhs, rhs, group_sizes, first, *,
                      any_order: bool = False) -> jax.Array:
    """`product` with each group's non-finite weights kept to that group's rows: the
    product runs on the finite part of the weights, and the rows of a group whose
    weights feed column j a non-finite value are NaN in column j."""
    rhs_contract = 2 if product.transpose_rhs else 1
    finite = jnp.isfinite(rhs)
    operands = (lhs, jnp.where(finite, rhs, jnp.zeros((), rhs.dtype)), group_sizes, first)
    out = bilinear.call(product, *operands) if any_order else product(*operands)
    # [g, n]: the group's weights feeding column j hold a non-finite value; looked up
    # per row by its group (rows of no group stay zero).
    bad = ~finite.all(axis=rhs_contract)
    ends = first + jnp.cumsum(group_sizes.astype(jnp.int32))
    rows = jnp.arange(lhs.shape[0], dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), rhs.shape[0] - 1)
    mine = _row_mask(lhs.shape[0], group_sizes, first)
    return jnp.where(bad[group] & mine, jnp.asarray(jnp.nan, out.dtype), out)


def gmm(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "g k n"] | Float[Array, "g n k"],
    group_sizes: Int[Array, "G"],
    *,
    group_offset=None,
    transpose_rhs: bool = False,
    out_dtype=None,
    block_sizes=None,
    interpret: bool = False,
) -> Float[Array, "m n"]:
    """[m, k] x [g, k, n] (or [g, n, k] with transpose_rhs) -> [m, n], per group of rows;
    rhs holds groups [group_offset, group_offset + g) of group_sizes (all when None)."""
    del block_sizes, interpret
    group_sizes, row_start = local_groups(group_sizes, group_offset, rhs.shape[0])
    out = ragged_product(lhs, rhs, group_sizes, row_start, transpose_rhs=transpose_rhs)
    return out.astype(out_dtype or lhs.dtype)


def tgmm(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "m n"],
    group_sizes: Int[Array, "G"],
    *,
    num_groups: int | None = None,
    group_offset=None,
    out_dtype=None,
    block_sizes=None,
    interpret: bool = False,
) -> Float[Array, "g k n"]:
    """[m, k], [m, n] -> [g, k, n]: per group, lhs_g^T @ rhs_g (zeros for empty groups);
    the groups are [group_offset, group_offset + g) of group_sizes (all when None)."""
    del block_sizes, interpret
    num_groups = num_groups or group_sizes.shape[0]
    out_dtype = out_dtype or lhs.dtype
    group_sizes, row_start = local_groups(group_sizes, group_offset, num_groups)
    mine = _row_mask(lhs.shape[0], group_sizes, row_start)
    lhs = jnp.where(mine, lhs, 0)
    # Rows before the groups join the first one, and a dense product (one group,
    # ONE_GROUP) reads every row: mask both sides then.
    if row_start is not None or num_groups == 1:
        rhs = jnp.where(mine, rhs, 0)
    if num_groups == 1:
        out = jax.lax.dot_general(lhs, rhs, (([0], [0]), ([], [])),
                                  preferred_element_type=jnp.float32)[None]
        return out.astype(out_dtype)
    group_sizes = _from_row_zero(group_sizes, row_start)
    dims = _DIMS(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    out = jax.lax.ragged_dot_general(
        lhs, rhs, group_sizes, dims, preferred_element_type=jnp.float32
    )
    return out.astype(out_dtype)
