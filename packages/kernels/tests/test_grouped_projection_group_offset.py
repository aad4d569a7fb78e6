"""grouped_projection with local experts: `group_offset`.

`kernel` holds groups [offset, offset + g) of the G >= g in `group_sizes`; every other
row is zero with zero gradient. Checked three ways:
  - the tilings every kernel is built from (group_metadata's visits, the Mosaic GPU row
    tile table) over every zero-group pattern for G <= 8, every local count g and every
    offset: each row is visited once, by its own local group or as a zero row;
  - the XLA backend and the reference over every zero-group pattern for G = 8, at both
    ends and in the middle, values and gradients;
  - every backend (the Pallas ones through their interpreters) on a sample of patterns,
    with the offset traced, against the reference.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.kernels.grouped_matmul import (
    MosaicTpuBlockSizes,
    TritonBlockSizes,
    grouped_projection,
)
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu as mgpu
from pallasite.kernels.grouped_matmul.group_metadata import local_groups, make_group_metadata
from pallasite.reference import parity
from pallasite.reference.grouped_projection import grouped_projection as reference
from pallasite.reference.grouped_projection import grouped_projection_per_group

M, K, N = 40, 16, 24
BLOCKS = {
    "xla": None,
    "pallas_triton": TritonBlockSizes(16, 16, 16, group_m=1),
    "pallas_mosaic_tpu": MosaicTpuBlockSizes(16, 128, 128),
    "pallas_mosaic_gpu": mgpu.MosaicGpuBlockSizes(block_m=64, block_n=64, block_k=64, stages=2,
                                                  grid_block_n=1),
}


def _patterns(total_groups: int):
    """Every zero-group pattern: which of the G groups are empty."""
    return [np.array(bits, bool) for bits in itertools.product([False, True], repeat=total_groups)]


def _sizes(empty: np.ndarray, m: int, seed: int) -> np.ndarray:
    """Group sizes with exactly the `empty` groups empty, summing to at most m."""
    rng = np.random.default_rng(seed)
    sizes = np.where(empty, 0, rng.integers(1, max(m // len(empty), 2), len(empty)))
    return sizes.astype(np.int32)


# ------------------------------------------------------------------ the tilings


def _owner_of_rows(total_groups, sizes, offset, g, m):
    """Per row: its local group (0..g-1) or g (no local group), from the sizes directly."""
    ends = np.cumsum(sizes)
    starts = ends - sizes
    owner = np.full(m, g)
    for i in range(g):
        j = offset + i
        if 0 <= j < total_groups:
            owner[starts[j]:ends[j]] = i
    return owner


@functools.lru_cache(maxsize=None)
def _visits_fn(total_groups, g, m, tile, aligned):
    def visits(sizes, offset):
        local, row_start = local_groups(sizes, offset, g)
        meta = make_group_metadata(local, m, tile, aligned=aligned, include_tail=True,
                                   row_start=row_start)
        return meta.group, meta.start, meta.end
    return jax.jit(jax.vmap(visits))


@functools.lru_cache(maxsize=None)
def _tile_table_fn(total_groups, g, m, block_m):
    def table(sizes, offset):
        local, row_start = local_groups(sizes, offset, g)
        return mgpu._row_tile_table(local, m, block_m, row_start)
    return jax.jit(jax.vmap(table))


@pytest.mark.parametrize("total_groups", range(1, 9))
def test_every_tiling_visits_each_row_once_by_its_owner(total_groups):
    """Every zero-group pattern, local count and offset: Triton's (unaligned) and Mosaic
    TPU's (aligned) visits and the Mosaic GPU tile table."""
    m, tile = 24, 8
    patterns = _patterns(total_groups)
    sizes = np.stack([_sizes(p, m, seed) for seed, p in enumerate(patterns)])
    for g in range(1, total_groups + 1):
        for offset in range(total_groups - g + 1):
            owners = [_owner_of_rows(total_groups, s, offset, g, m) for s in sizes]
            offsets = np.full(len(sizes), offset, np.int32)
            for aligned in (False, True):
                group, start, end = (np.asarray(a) for a in _visits_fn(
                    total_groups, g, m, tile, aligned)(sizes, offsets))
                for p, owner in enumerate(owners):
                    seen = np.full(m, -1)
                    for v in range(group.shape[1]):
                        rows = slice(start[p, v], end[p, v])
                        assert (seen[rows] == -1).all(), f"row visited twice: {sizes[p]}"
                        seen[rows] = group[p, v]
                    np.testing.assert_array_equal(
                        seen, owner, err_msg=f"sizes {sizes[p]}, g={g}, offset={offset}, "
                                             f"aligned={aligned}")
            table, count = (np.asarray(a) for a in _tile_table_fn(
                total_groups, g, m, tile)(sizes, offsets))
            for p, owner in enumerate(owners):
                seen = np.full(m, -1)  # zero tiles (rows of no local group) carry g
                for t in range(count[p, 0]):
                    seg, _, first, rows = table[p, :, t]
                    assert (seen[first:first + rows] == -1).all(), "row in two tiles"
                    seen[first:first + rows] = seg
                np.testing.assert_array_equal(seen, owner, err_msg=f"sizes {sizes[p]}")


def test_local_groups_outside_the_range_are_empty():
    sizes = jnp.asarray([3, 4, 5], jnp.int32)
    local, start = local_groups(sizes, jnp.int32(2), 3)
    assert local.tolist() == [5, 0, 0] and int(start) == 7
    local, start = local_groups(sizes, jnp.int32(-1), 2)
    assert local.tolist() == [0, 3] and int(start) == 0
    local, start = local_groups(sizes, jnp.int32(5), 2)
    assert local.tolist() == [0, 0] and int(start) == 12
    local, start = local_groups(sizes, None, 3)
    assert local.tolist() == [3, 4, 5] and start is None


# ---------------------------------------------------------- values and gradients


def _inputs(g, seed=0):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (M, K), jnp.float32)
    w = jax.random.normal(kw, (g, K, N), jnp.float32)
    dy = jax.random.normal(kd, (M, N), jnp.float32)
    return x, w, dy


@functools.lru_cache(maxsize=None)
def _vjp_fn(name):
    """y, dx, dkernel of one implementation, jitted once with sizes and offset traced."""
    if name == "reference":
        project = functools.partial(grouped_projection_per_group,
                                    precision=jax.lax.Precision.HIGHEST)
    else:
        project = functools.partial(grouped_projection, interpret_on_cpu=True,
                                    implementation=name, block_sizes=BLOCKS[name])

    @jax.jit
    def run(x, w, sizes, offset, dy):
        y, vjp = jax.vjp(lambda x, w: project(x, w, sizes, jnp.bfloat16, group_offset=offset),
                         x, w)
        return (y,) + vjp(dy.astype(y.dtype))

    return run


def _check(name, x, w, sizes, offset, dy):
    got = _vjp_fn(name)(x, w, jnp.asarray(sizes), jnp.int32(offset), dy)
    want = _vjp_fn("reference")(x, w, jnp.asarray(sizes), jnp.int32(offset), dy)
    owner = _owner_of_rows(len(sizes), sizes, offset, w.shape[0], M)
    foreign = owner == w.shape[0]
    what = f"{name} sizes={sizes.tolist()} offset={offset}"
    for label, a, b in zip(("y", "dx", "dkernel"), got, want):
        parity.assert_close(a, b, dtype="bfloat16", what=f"{what} {label}")
    assert not np.asarray(got[0], np.float32)[foreign].any(), f"{what}: foreign rows of y"
    assert not np.asarray(got[1])[foreign].any(), f"{what}: foreign rows of dx"


@pytest.mark.parametrize("g", [1, 3, 8])
def test_xla_every_zero_group_pattern(g):
    """G = 8: all 256 zero-group patterns at both ends and in the middle."""
    x, w, dy = _inputs(g)
    total_groups = 8
    for seed, pattern in enumerate(_patterns(total_groups)):
        sizes = _sizes(pattern, M, seed)
        for offset in sorted({0, (total_groups - g) // 2, total_groups - g}):
            _check("xla", x, w, sizes, offset, dy)


SAMPLED = [  # (sizes over G = 6, local g, offset)
    (np.array([5, 0, 7, 3, 0, 9], np.int32), 2, 0),  # first end, one empty local group
    (np.array([5, 0, 7, 3, 0, 9], np.int32), 2, 4),  # last end: rows past the total follow
    (np.array([6, 6, 6, 6, 6, 6], np.int32), 3, 2),  # middle, every row in some group
    (np.array([0, 0, 0, 0, 0, 0], np.int32), 2, 2),  # every group empty
    (np.array([9, 8, 0, 0, 7, 6], np.int32), 2, 2),  # local groups empty, rows around them
    (np.array([1, 0, 30, 0, 0, 1], np.int32), 1, 2),  # one hot group
]


@pytest.mark.parametrize("name", list(BLOCKS))
def test_every_backend_on_sampled_patterns(name):
    for sizes, g, offset in SAMPLED:
        x, w, dy = _inputs(g, seed=g)
        _check(name, x, w, sizes, offset, dy)


def test_default_order_and_reference_forms_agree():
    """implementation=None with an offset, and the two reference forms."""
    sizes = np.array([4, 9, 0, 12, 5], np.int32)
    x, w, dy = _inputs(2)
    got = grouped_projection(x, w, jnp.asarray(sizes), jnp.bfloat16, group_offset=2)
    want = reference(x, w, jnp.asarray(sizes), jnp.bfloat16, group_offset=2,
                     precision=jax.lax.Precision.HIGHEST)
    parity.assert_close(got, want, dtype="bfloat16", what="default order")
    per_group = grouped_projection_per_group(x, w, jnp.asarray(sizes), jnp.bfloat16,
                                             group_offset=2, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_array_equal(np.asarray(want, np.float32), np.asarray(per_group, np.float32))


def test_bad_group_offset_is_refused():
    x, w, _ = _inputs(2)
    sizes = jnp.asarray([4, 9, 0, 12, 5], jnp.int32)
    with pytest.raises(ValueError, match="group_offset=4"):
        grouped_projection(x, w, sizes, jnp.bfloat16, group_offset=4)
    with pytest.raises(ValueError, match="group_offset=-1"):
        grouped_projection(x, w, sizes, jnp.bfloat16, group_offset=-1)
    with pytest.raises(TypeError, match="group_offset must be an integer scalar"):
        grouped_projection(x, w, sizes, jnp.bfloat16, group_offset=1.0)
    with pytest.raises(ValueError, match="G >= g"):
        grouped_projection(x, w, sizes[:1], jnp.bfloat16, group_offset=0)
    with pytest.raises(ValueError, match="length g=2"):  # without an offset: G == g
        grouped_projection(x, w, sizes, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["pallas_mosaic_gpu", "pallas_triton", "xla"])
def test_gpu_local_experts(name):
    """The compiled kernels, several tiles per group, at both ends and in the middle."""
    if not jax.devices()[0].platform == "gpu":
        pytest.skip("needs a GPU")
    m, k, n = 4096, 512, 1024
    sizes = np.array([700, 0, 900, 300, 512, 600, 400, 500], np.int32)  # 3912 < m
    kx, kw, kd = jax.random.split(jax.random.key(11), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    dy = jax.random.normal(kd, (m, n), jnp.float32)
    for g, offset in ((4, 0), (4, 4), (3, 2), (1, 1)):
        w = jax.random.normal(kw, (g, k, n), jnp.float32) / np.sqrt(k)

        @functools.partial(jax.jit, static_argnums=5)
        def run(x, w, sizes, offset, dy, project):
            y, vjp = jax.vjp(lambda x, w: project(x, w, sizes, jnp.bfloat16,
                                                   group_offset=offset), x, w)
            return (y,) + vjp(dy.astype(y.dtype))

        got = run(x, w, jnp.asarray(sizes), jnp.int32(offset), dy,
                  functools.partial(grouped_projection, implementation=name))
        want = run(x, w, jnp.asarray(sizes), jnp.int32(offset), dy,
                   functools.partial(reference, precision=jax.lax.Precision.HIGHEST))
        owner = _owner_of_rows(len(sizes), sizes, offset, g, m)
        for label, a, b in zip(("y", "dx", "dkernel"), got, want):
            parity.assert_close(a, b, dtype="bfloat16", what=f"{name} g={g} {offset} {label}")
        assert not np.asarray(got[0], np.float32)[owner == g].any(), "foreign rows of y"
