"""Group metadata: which rows each program of a grouped kernel owns.

Rows of the left operand are sorted by group; group i owns rows
[offsets[i], offsets[i+1]). A grouped kernel runs one program per *visit*: a
(group, row range) pair of at most `tile` rows. Two tilings are built here, once per
call, in plain JAX (a few small int32 ops, cheap next to the matmul):

- `aligned=False` (Pallas Triton): each group is cut into tiles starting at the group's
  own first row, so no tile straddles two groups and no row is computed twice; a tile
  reads rows at an arbitrary offset, which a pointer-based kernel does with masks.
- `aligned=True` (Mosaic TPU): visits are the intersections of groups with the
  tile-aligned row blocks `[j*tile, (j+1)*tile)`, because TPU blocks must be aligned;
  a block shared by two groups is visited once per group, consecutively, and each visit
  stores only its own rows.

The rows past `sum(group_sizes)` form one more pseudo-group, id `num_groups`, when
`include_tail=True`, so the kernel writes zeros there (the contract) without a second
pass over the output. With local experts (`group_offset`, see `local_groups`) the groups
start at `row_start`; the rows before it are a second zero piece with the same id.
`visit_empty=True` gives every empty group one empty visit, which
a kernel reducing per group (tgmm) needs to write that group's zeros.

The number of visits is data dependent, but bounded statically: at most
`cdiv(m, tile) + num_groups + 2` (each of the `num_groups + 2` pieces adds at most one
partial tile). Visits past the real count repeat the last real visit's group and tile
with an empty row range, so a kernel that revisits an output block keeps it resident
and a per-group reduction does not close early.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int


class GroupMetadata(NamedTuple):
    """Per-visit arrays, each int32 [num_visits] except `offsets` ([num_groups + 1])."""

    offsets: Int[Array, "g1"]  # row where group i starts; offsets[g] = sum(group_sizes)
    group: Int[Array, "v"]  # group id of the visit (num_groups = rows past the total)
    start: Int[Array, "v"]  # first row of the visit
    end: Int[Array, "v"]  # one past its last row (end == start: nothing to do)
    tile: Int[Array, "v"]  # aligned row block (start // tile for aligned tilings)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_visits(m: int, num_groups: int, tile: int) -> int:
    """The static bound on visits: the grid size of a grouped kernel."""
    return cdiv(m, tile) + num_groups + 2


INT32_MAX = 2**31 - 1


def group_offsets(group_sizes: Int[Array, "g"], row_start=None) -> Int[Array, "g1"]:
    """[r, r+s0, r+s0+s1, ...] with r = row_start (0 when None): where each group starts,
    and where the last one ends.

    Traced sizes are not checked (api.py), so this is the one reading of them every
    backend shares: a negative size is an empty group, and the sums saturate at
    INT32_MAX instead of wrapping (saturating_cumsum), so the offsets never decrease and
    a total past m stays past m: callers cut at row m, and no kernel reads before a
    group's first row or past the array. row_start comes from these same offsets
    (local_groups), so adding it cannot wrap either."""
    ends = saturating_cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    return offsets if row_start is None else offsets + jnp.asarray(row_start, jnp.int32)


def saturating_cumsum(sizes: Int[Array, "g"]) -> Int[Array, "g"]:
    """The running sums of non-negative int32 `sizes`, each capped at INT32_MAX: int32's
    own cumsum wraps to negative offsets. In uint32 the sums are exact up to the first
    one past INT32_MAX (two int32 values sum below 2**32); it and every later one (which
    may wrap) become INT32_MAX. No loop: one cumsum, one cummax."""
    ends = jnp.cumsum(sizes.astype(jnp.uint32), dtype=jnp.uint32)
    past = jax.lax.cummax((ends > INT32_MAX).astype(jnp.int32), axis=0) > 0
    return jnp.where(past, INT32_MAX, ends).astype(jnp.int32)


def segment_of(ends: Int[Array, "s"], positions: Int[Array, "t"]) -> Int[Array, "t"]:
    """For each position, how many of the non-decreasing segment `ends` are <= it: the
    index of the segment it falls in (searchsorted, side="right").

    One fused compare-and-count over every (position, segment) pair. jnp.searchsorted's
    default binary search is a while loop of tiny kernels that the host issues one by
    one, which made short grouped calls host-bound (docs/performance.md, "one-pass tile
    table")."""
    return jnp.searchsorted(ends, positions, side="right", method="compare_all")


def local_groups(group_sizes: Int[Array, "G"], group_offset, num_groups: int):
    """The sizes of groups [group_offset, group_offset + num_groups) of `group_sizes` and
    the row where the first of them starts: (int32 [num_groups], int32 scalar), or (all
    the sizes, None) when group_offset is None (all groups, from row 0). Either way the
    sizes are those group_offsets reads (a negative size is 0): every backend starts here,
    so none sees a size the kernels' offsets would not.

    This is how a kernel holding only some experts' weights (expert parallelism) sees the
    global sorted rows: its groups are contiguous, from row_start on; every other row
    belongs to no local group (zero output, never read by tgmm). Indices outside
    [0, G) are empty groups, so a traced offset never reads out of bounds."""
    offsets = group_offsets(group_sizes)
    if group_offset is None:
        return jnp.diff(offsets), None
    index = jnp.asarray(group_offset, jnp.int32) + jnp.arange(num_groups + 1, dtype=jnp.int32)
    bounds = offsets[jnp.clip(index, 0, group_sizes.shape[0])]
    return jnp.diff(bounds), bounds[0]


def make_group_metadata(
    group_sizes: Int[Array, "g"],
    m: int,
    tile: int,
    *,
    aligned: bool,
    include_tail: bool,
    visit_empty: bool = False,
    row_start=None,
) -> GroupMetadata:
    """The visits of a grouped kernel over `m` rows in tiles of `tile` rows; the groups
    start at row `row_start` (0 when None)."""
    num_groups = group_sizes.shape[0]
    offsets = group_offsets(group_sizes, row_start)
    first_row = jnp.minimum(offsets[0], m)
    total = jnp.minimum(offsets[-1], m)
    starts = jnp.minimum(offsets[:-1], m)
    ends = jnp.minimum(offsets[1:], m)
    ids = jnp.arange(num_groups, dtype=jnp.int32)
    if include_tail:  # rows before the groups and past them: zero pieces, id num_groups
        zero = jnp.zeros((1,), jnp.int32)
        starts = jnp.concatenate([zero, starts, total[None]])
        ends = jnp.concatenate([first_row[None], ends, jnp.full((1,), m, jnp.int32)])
        ids = jnp.concatenate([zero + num_groups, ids, zero + num_groups])
    sizes = ends - starts

    if aligned:
        first = starts // tile
        counts = jnp.where(sizes > 0, cdiv_traced(ends, tile) - first, 0)
    else:
        first = jnp.zeros_like(starts)
        counts = cdiv_traced(sizes, tile)
    if visit_empty:
        counts = jnp.where(sizes == 0, 1, counts)

    bound = num_visits(m, num_groups, tile)
    visit_ends = jnp.cumsum(counts, dtype=jnp.int32)
    real = visit_ends[-1]
    v = jnp.arange(bound, dtype=jnp.int32)
    # Visits past the real count are padding: copies of the last real visit.
    vv = jnp.maximum(jnp.minimum(v, real - 1), 0)
    piece = segment_of(visit_ends, vv)
    piece = jnp.clip(piece, 0, starts.shape[0] - 1).astype(jnp.int32)
    local = jnp.maximum(vv - (visit_ends[piece] - counts[piece]), 0)

    if aligned:
        tile_id = first[piece] + local
        start = jnp.maximum(starts[piece], tile_id * tile)
        end = jnp.minimum(ends[piece], (tile_id + 1) * tile)
    else:
        start = starts[piece] + local * tile
        end = jnp.minimum(start + tile, ends[piece])
        tile_id = start // tile
    end = jnp.maximum(end, start)  # empty visits of empty groups
    padding = v >= real
    end = jnp.where(padding, start, end)
    tile_id = jnp.clip(tile_id, 0, max(cdiv(m, tile) - 1, 0))
    return GroupMetadata(
        offsets=offsets,
        group=ids[piece],
        start=start.astype(jnp.int32),
        end=end.astype(jnp.int32),
        tile=tile_id.astype(jnp.int32),
    )


def cdiv_traced(a: jax.Array, b: int) -> jax.Array:
    return (a + (b - 1)) // b
