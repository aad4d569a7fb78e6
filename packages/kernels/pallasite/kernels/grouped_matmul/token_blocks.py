"""The token-block table: where each 128-row block of the weight gradient's operands sits.

The operands of the fp8 weight gradient (x and dy, contracted over tokens) are quantized
in blocks of 128 rows that never mix two groups (pallasite.reference.quantization,
`token_block_ids`): every segment (the rows before the first local group, each local
group, the rows past the last) is cut into blocks from its own first row. The quantized
operands are stored transposed, `[columns, 128 * num_blocks]`, block t in columns
[128 t, 128 t + 128), its rows past the segment's end zero: so a group's tokens are whole,
aligned 128-token steps, which is what the tensor cores contract and what TMA loads.

Built once per call in plain JAX; every array is int32 and static in shape.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallasite.kernels.grouped_matmul.group_metadata import segment_of
from pallasite.reference.quantization import TOKEN_BLOCK


@dataclasses.dataclass(frozen=True)
class TokenBlocks:
    """start[t], rows[t]: the first row and row count (0..128; 0 for unused blocks) of
    block t, for t < bound. first[i], count[i]: local group i's first block and number
    of blocks (0 for an empty group)."""

    start: jax.Array
    rows: jax.Array
    first: jax.Array
    count: jax.Array

    @property
    def bound(self) -> int:
        return self.start.shape[0]


def bound(m: int, num_groups: int, block: int = TOKEN_BLOCK) -> int:
    """A static bound on the blocks of m rows in num_groups + 2 segments."""
    return m // block + num_groups + 3


def token_blocks(group_sizes: jax.Array, m: int, *, num_groups: int | None = None,
                 row_start=None, block: int = TOKEN_BLOCK) -> TokenBlocks:
    """The table for m sorted rows: the rows before `row_start` (0 when None), then the
    `num_groups` groups of `group_sizes` (all when None), then the rest. Sizes are
    clipped to the rows there are (negative sizes are empty groups)."""
    g = group_sizes.shape[0] if num_groups is None else num_groups
    sizes = jnp.maximum(group_sizes[:g].astype(jnp.int32), 0)
    first_row = jnp.zeros((), jnp.int32) if row_start is None else jnp.asarray(row_start, jnp.int32)
    first_row = jnp.clip(first_row, 0, m)
    # A cumulative sum that saturates at m instead of wrapping past 2**31.
    ends = jnp.minimum(first_row + jnp.cumsum(jnp.minimum(sizes, m)), m)
    seg_end = jnp.concatenate([first_row[None], ends, jnp.full((1,), m, jnp.int32)])
    seg_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), seg_end[:-1]])
    seg_blocks = (seg_end - seg_start + block - 1) // block
    seg_last = jnp.cumsum(seg_blocks)
    seg_base = seg_last - seg_blocks
    t = jnp.arange(bound(m, g, block), dtype=jnp.int32)
    seg = jnp.minimum(segment_of(seg_last, t), g + 1)
    start = seg_start[seg] + (t - seg_base[seg]) * block
    rows = jnp.clip(seg_end[seg] - start, 0, block)
    rows = jnp.where(t < seg_last[-1], rows, 0)
    return TokenBlocks(start=start.astype(jnp.int32), rows=rows.astype(jnp.int32),
                       first=seg_base[1:g + 1].astype(jnp.int32),
                       count=seg_blocks[1:g + 1].astype(jnp.int32))


def group_table(first: jax.Array, count: jax.Array) -> jax.Array:
    """first and count as one int32 [2, g] array: what the fp8 weight-gradient kernels
    read. A stack, so that the kernel's operand is a buffer of its own: XLA on a GPU
    may hand a custom call a slice operand (first and count are slices of the segment
    table) as an offset into the sliced buffer, and Mosaic GPU refuses an operand that
    is not 256-byte aligned (seen on an H200, jax 0.11.2: "Input buffer 0 is not
    256-byte aligned" once the group sizes were not constants)."""
    return jnp.stack([first, count]).astype(jnp.int32)
