"""Mosaic GPU (Hopper) grouped projection: gmm / tgmm parity, metadata, config, lowering.

CPU (no mark): config validation, argument errors, the row-tile table's invariants, the
kernels through the Mosaic GPU interpreter on tiny shapes (uninitialised memory and
out-of-bounds reads are NaN there, so an unwritten row or an unmasked row fails), the
CUDA lowering (exported from the CPU under an abstract H200 mesh: layout inference and
the TMA/wgmma lowering run, nothing executes). Sharding: test_grouped_projection_sharding.
GPU (-m gpu, an H200): the parity grid against the fp32 reference, total < m, empty and
skewed groups, the warp-specialised gmm on three of them, gradients through the public
API, and the default order by rows per group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_export_testlib import cuda_module
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu as mgpu
from pallasite.reference.grouped_projection import gmm_reference, tgmm_reference
from pallasite.reference.inputs import one_group_sizes, random_group_sizes, skewed_group_sizes
from pallasite.reference.parity import EXACT_FP32, assert_close

BF16 = jnp.bfloat16
SMALL = mgpu.MosaicGpuBlockSizes(block_m=64, block_n=64, block_k=64, stages=2, grid_block_n=2)


def _operands(key, m, k, n, g, dtype=BF16):
    kx, kw, kd = jax.random.split(key, 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (g, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
    return x, w, dy


def _f32(*xs):
    return [x.astype(jnp.float32) for x in xs]


# ----------------------------------------------------------------------------- config


def test_block_sizes_validation():
    with pytest.raises(ValueError, match="block_m"):
        mgpu.MosaicGpuBlockSizes(block_m=96)
    with pytest.raises(ValueError, match="stages"):
        mgpu.MosaicGpuBlockSizes(stages=0)
    with pytest.raises(ValueError, match="registers"):
        mgpu.MosaicGpuBlockSizes(block_m=256, block_n=256)
    with pytest.raises(ValueError, match="grid_block_n"):
        mgpu.MosaicGpuBlockSizes(grid_block_n=True)
    for bad in (2, -1, True):
        with pytest.raises(ValueError, match="delay_release"):
            mgpu.MosaicGpuBlockSizes(delay_release=bad)
    with pytest.raises(ValueError, match="pingpong needs warp_specialized"):
        mgpu.MosaicGpuBlockSizes(pingpong=True)
    with pytest.raises(ValueError, match="pingpong must be a bool"):
        mgpu.MosaicGpuBlockSizes(warp_specialized=True, pingpong=1)
    for bad in (0, 32, 96, 256, True):
        with pytest.raises(ValueError, match="epilogue_block_n"):
            mgpu.MosaicGpuBlockSizes(block_n=128, epilogue_block_n=bad)
    bs = mgpu.MosaicGpuBlockSizes()
    with pytest.raises(dataclasses_error()):
        bs.block_m = 64  # frozen


def dataclasses_error():
    return dataclasses.FrozenInstanceError


def test_resolve_block_sizes():
    from pallasite.kernels.grouped_matmul import config

    pick = mgpu.resolve_block_sizes
    # Output widths of an even count of 128-column halves: the cooperative
    # warp-specialised kernel, with 192-row tiles where groups average 1024 rows or
    # more; an odd count (1408, 5504): the ping-pong kernel, whose 128-column tiles
    # leave no half idle, whatever the group sizes. m, k, n are the projection's, so dx
    # writes k columns.
    assert pick(None, product="forward", m=32768, k=4096, n=14336, g=8) == mgpu.GMM_LARGE_TILES
    assert pick(None, product="dx", m=32768, k=5504, n=2048, g=32) == mgpu.GMM_PINGPONG
    assert pick(None, product="forward", m=65536, k=7168, n=2048, g=256) == mgpu.GMM_WARP_SPECIALIZED
    assert pick(None, product="dx", m=65536, k=768, n=2048, g=128) == mgpu.GMM_WARP_SPECIALIZED
    assert pick(None, product="forward", m=32768, k=2048, n=1408, g=64) == mgpu.GMM_PINGPONG
    assert pick(None, product="dx", m=32768, k=5504, n=2048, g=16) == mgpu.GMM_PINGPONG
    assert pick(None, product="dx", m=32768, k=2048, n=1408, g=64) == mgpu.GMM_WARP_SPECIALIZED
    assert pick(None, product="dkernel", m=32768, k=2048, n=1408, g=64) == mgpu.TGMM_WARP_SPECIALIZED
    # Otherwise the one-warpgroup kernel, by rows per group.
    assert pick(None, product="forward", m=32768, k=4096, n=14272, g=8) == mgpu.GMM_LARGE_GROUPS
    assert pick(None, product="dx", m=65536, k=320, n=2048, g=128) == mgpu.GMM_SMALL_GROUPS
    assert pick(None, product="dkernel", m=65536, k=2048, n=768, g=128) == mgpu.TGMM_WARP_SPECIALIZED
    assert pick(None, product="dkernel", m=65536, k=2048, n=320, g=128) == mgpu.TGMM_DEFAULT
    assert pick(SMALL, product="dx", m=1, k=1, n=1, g=1) is SMALL
    per = config.GroupedProjectionBlockSizes(dx=SMALL)
    assert pick(per, product="dx", m=1, k=1, n=1, g=1) is SMALL
    assert pick(per, product="forward", m=64, k=1, n=1, g=1) == mgpu.GMM_SMALL_GROUPS
    with pytest.raises(TypeError, match="MosaicGpuBlockSizes"):
        pick(config.TritonBlockSizes(), product="forward", m=1, k=1, n=1, g=1)


def test_bad_inputs_fail_before_any_kernel():
    x, w, dy = _operands(jax.random.key(0), 64, 64, 64, 2)
    gs = jnp.array([30, 34], jnp.int32)
    with pytest.raises(ValueError, match="lhs"):
        mgpu.gmm(x[0], w, gs)
    with pytest.raises(ValueError, match="k mismatch"):
        mgpu.gmm(x[:, :32], w, gs)
    with pytest.raises(ValueError, match="group_sizes"):
        mgpu.gmm(x, w, gs[:1])
    with pytest.raises(TypeError, match="int32"):
        mgpu.gmm(x, w, gs.astype(jnp.float32))
    with pytest.raises(TypeError, match="16-bit"):
        mgpu.gmm(x.astype(jnp.float32), w.astype(jnp.float32), gs)
    with pytest.raises(TypeError, match="compute dtype"):
        mgpu.gmm(x, w.astype(jnp.float16), gs)
    with pytest.raises(ValueError, match="share m"):
        mgpu.tgmm(x, dy[:32], gs)
    with pytest.raises(ValueError, match="group_sizes"):
        mgpu.tgmm(x, dy, gs, num_groups=3)
    with pytest.raises(ValueError, match=r"G >= 2"):  # local experts: G >= g
        mgpu.gmm(x, w, gs[:1], group_offset=jnp.int32(0))
    with pytest.raises(ValueError, match=r"must be \[2\]"):  # without an offset: G == g
        mgpu.gmm(x, w, jnp.array([10, 10, 10], jnp.int32))


# ----------------------------------------------------------------------------- tile table


def test_row_tile_table_has_no_loop():
    """The tile table is one pass of compares, not a binary search: that is a while loop
    of tiny kernels the host issues one by one, which made a short forward host-bound
    (docs/performance.md, "one-pass tile table")."""
    table = lambda s: mgpu._row_tile_table(s, 4096, 128, jnp.int32(40))  # noqa: E731
    text = str(jax.make_jaxpr(table)(jnp.ones((64,), jnp.int32)))
    assert "scan[" not in text and "while[" not in text


@pytest.mark.parametrize("sizes,m,bm", [
    ([70, 0, 100], 200, 64),
    ([0, 0, 0], 128, 64),
    ([128, 64, 1, 7, 9], 256, 64),
    ([3, 5, 0, 250, 2], 304, 128),
    ([1000], 1000, 192),
])
def test_row_tile_table_covers_each_group_row_once(sizes, m, bm):
    table, count = mgpu._row_tile_table(jnp.array(sizes, jnp.int32), m, bm)
    seg, load, first, rows = np.asarray(table)
    count = int(count[0])
    g = len(sizes)
    assert count <= table.shape[1]
    owner = np.repeat(np.arange(g + 1), list(sizes) + [m - sum(sizes)])
    seen = np.zeros(m, np.int32)
    for t in range(count):
        r = np.arange(first[t], first[t] + rows[t])
        seen[r] += 1
        assert (owner[r] == seg[t]).all(), f"tile {t} straddles segments"
        assert load[t] % 8 == 0 and 0 <= load[t] <= m - bm
        assert load[t] <= first[t] and first[t] + rows[t] <= load[t] + bm
    # Every row once: a group's by its tiles, rows past the total by zero tiles (seg g).
    np.testing.assert_array_equal(seen, np.ones(m, np.int32))
    assert (rows[:count] > 0).all() and (rows[count:] == 0).all()


# ----------------------------------------------------------------------------- interpreter

# (m, k, n, group sizes): skewed, empty groups, total < m, m not a multiple of 8,
# m < block_m, one group holding everything, every group empty.
INTERPRET_CASES = [
    (200, 64, 128, [70, 0, 100]),
    (131, 64, 64, [3, 60, 1, 0, 57]),
    (40, 64, 128, [17, 0, 20]),
    (128, 64, 64, [0, 128, 0]),
    (96, 64, 64, [0, 0, 0]),
]


@pytest.mark.parametrize("m,k,n,sizes", INTERPRET_CASES)
def test_interpret_gmm_and_dx(m, k, n, sizes):
    gs = jnp.array(sizes, jnp.int32)
    x, w, dy = _operands(jax.random.key(m), m, k, n, len(sizes))
    out = mgpu.gmm(x, w, gs, out_dtype=jnp.float32, block_sizes=SMALL, interpret=True)
    assert_close(out, gmm_reference(*_f32(x, w), gs), dtype=jnp.float32, tol=EXACT_FP32,
                 what="gmm")
    dx = mgpu.gmm(dy, w, gs, transpose_rhs=True, out_dtype=jnp.float32, block_sizes=SMALL,
                  interpret=True)
    assert_close(dx, gmm_reference(*_f32(dy, w), gs, transpose_rhs=True), dtype=jnp.float32,
                 tol=EXACT_FP32, what="dx")
    total = sum(sizes)
    assert (np.asarray(dx)[total:] == 0).all() and (np.asarray(out)[total:] == 0).all()


SMALL_WS = mgpu.MosaicGpuBlockSizes(block_m=64, block_n=64, block_k=64, stages=2,
                                    grid_block_n=2, warp_specialized=True)
# 128-column halves stored in two 64-column strips through one slot per consumer (where
# n is whole 128-column halves; 64-column widths fit block_n to 64, one strip).
STRIPED_WS = dataclasses.replace(SMALL_WS, block_n=128, epilogue_block_n=64)
# ... with each stage released a step late (the H200 dkernel default's shape).
STRIPED_WS_DELAYED = dataclasses.replace(STRIPED_WS, delay_release=1)
# k and n multiples of 64, so both gmm and dx take the warp-specialised kernel; an odd
# number of 64-column halves (192, 64) leaves the last tile's second half past the edge.
INTERPRET_WS_CASES = [
    (200, 128, 256, [70, 0, 100]),
    (131, 128, 128, [3, 60, 1, 0, 57]),
    (96, 128, 128, [0, 0, 0]),
    (200, 192, 192, [70, 0, 100]),
    (131, 64, 64, [3, 60, 1, 0, 57]),
]


# The ping-pong kernel (consumers on alternate tiles, one ring of stages shared in order),
# with 2 and 3 stages: a program's tiles even or odd in number, k one step or several.
PINGPONG = dataclasses.replace(SMALL_WS, pingpong=True)
_WS_GMM_KERNELS = {
    "whole": ("_gmm_kernel_warp_specialized", SMALL_WS),
    "strips": ("_gmm_kernel_warp_specialized", STRIPED_WS),
    "pingpong2": ("_gmm_kernel_pingpong", PINGPONG),
    "pingpong3": ("_gmm_kernel_pingpong", dataclasses.replace(PINGPONG, stages=3)),
    # 192-row tiles in strips, the H200 default's shape where groups are large
    "tall_strips": ("_gmm_kernel_warp_specialized", dataclasses.replace(STRIPED_WS, block_m=192)),
}


@pytest.mark.parametrize("variant", list(_WS_GMM_KERNELS))
@pytest.mark.parametrize("m,k,n,sizes", INTERPRET_WS_CASES)
def test_interpret_warp_specialized_gmm_and_dx(m, k, n, sizes, variant, monkeypatch):
    """The producer / two-consumer kernels (the epilogue whole or in strips, or ping-pong):
    same values, zero rows past the total."""
    kernel, blocks = _WS_GMM_KERNELS[variant]
    built = []
    real = getattr(mgpu, kernel)
    monkeypatch.setattr(mgpu, kernel, lambda *a: built.append(a) or real(*a))
    gs = jnp.array(sizes, jnp.int32)
    x, w, dy = _operands(jax.random.key(m + blocks.stages), m, k, n, len(sizes))
    out = mgpu.gmm(x, w, gs, out_dtype=jnp.float32, block_sizes=blocks, interpret=True)
    dx = mgpu.gmm(dy, w, gs, transpose_rhs=True, out_dtype=jnp.float32, block_sizes=blocks,
                  interpret=True)
    assert len(built) == 2  # forward and dx both took it
    assert_close(out, gmm_reference(*_f32(x, w), gs), dtype=jnp.float32, tol=EXACT_FP32,
                 what="gmm")
    assert_close(dx, gmm_reference(*_f32(dy, w), gs, transpose_rhs=True), dtype=jnp.float32,
                 tol=EXACT_FP32, what="dx")
    total = sum(sizes)
    assert (np.asarray(dx)[total:] == 0).all() and (np.asarray(out)[total:] == 0).all()


def test_pingpong_fit():
    """A ping-pong stage holds one 128-column rhs block: 5 stages of 32 KiB beside two
    whole bf16 output slots fit 227 KiB (3 with fp32 slots). The dkernel's 192 x 128
    tiles (lhs 64 x 192, rhs 64 x 128: 40 KiB a stage) fit 4 stages beside two 192 x 64
    bf16 strips."""
    pp = dataclasses.replace(_WS4, stages=6, pingpong=True)
    assert mgpu._fit_warp_specialized(pp, 1024, 2, 2).stages == 5
    assert mgpu._fit_warp_specialized(pp, 1024, 2, 4).stages == 3
    assert not mgpu._fit_warp_specialized(pp, 320, 2, 2).pingpong  # 320 is not whole blocks
    tall = dataclasses.replace(pp, block_m=192, epilogue_block_n=64)
    assert mgpu._fit_warp_specialized(tall, 5760, 2, 2).stages == 4


@pytest.mark.parametrize("n,in_bytes,out_bytes,ws,stages", [
    (1024, 2, 2, True, 3),   # 3 x 48 KiB operands + 64 KiB output slots fit 227 KiB
    (1024, 2, 4, True, 2),   # fp32 output slots leave room for 2 stages
    (1024, 4, 4, False, 4),  # not even 2 stages: the one-warpgroup kernel
    (384, 2, 2, True, 3),    # three 128-column halves: the last tile's second is past n
    (320, 2, 2, False, 4),   # 320 columns are not whole 128-column halves
])
def test_fit_warp_specialized(n, in_bytes, out_bytes, ws, stages):
    fitted = mgpu._fit_warp_specialized(_WS4, n, in_bytes, out_bytes)
    assert (fitted.warp_specialized, fitted.stages) == (ws, stages)


def test_large_tiles_fit_three_stages_beside_strips():
    """192x(2x128)x64 stages take 56 KiB: 3 fit beside two 192x64 bf16 strips (48 KiB),
    2 beside fp32 ones (96 KiB)."""
    assert mgpu._fit_warp_specialized(mgpu.GMM_LARGE_TILES, 14336, 2, 2).stages == 3
    assert mgpu._fit_warp_specialized(mgpu.GMM_LARGE_TILES, 14336, 2, 4).stages == 2


def test_epilogue_strips_make_room_for_a_fourth_stage():
    """4 x 48 KiB operand stages + two 128x64 bf16 slots (32 KiB) fit 227 KiB; with
    whole 128-column slots (64 KiB) only 3 stages do."""
    striped = dataclasses.replace(_WS4, epilogue_block_n=64)
    assert mgpu._fit_warp_specialized(striped, 1024, 2, 2).stages == 4
    # a strip that no longer divides the fitted block_n becomes the whole block_n
    assert mgpu._fit_block_n(dataclasses.replace(_WS4, block_n=192, epilogue_block_n=192),
                             1024).epilogue_block_n is None


_WS4 = mgpu.MosaicGpuBlockSizes(block_m=128, block_n=128, block_k=64, stages=4,
                                warp_specialized=True)


def test_warp_specialized_falls_back_when_n_does_not_split(monkeypatch):
    monkeypatch.setattr(mgpu, "_gmm_kernel_warp_specialized",
                        lambda *a: pytest.fail("n = 96 is not whole 64-column halves"))
    x, w, _ = _operands(jax.random.key(2), 64, 64, 96, 2)
    gs = jnp.array([30, 20], jnp.int32)
    out = mgpu.gmm(x, w, gs, out_dtype=jnp.float32, block_sizes=SMALL_WS, interpret=True)
    assert_close(out, gmm_reference(*_f32(x, w), gs), dtype=jnp.float32, tol=EXACT_FP32,
                 what="gmm")


@pytest.mark.parametrize("m,k,n,sizes", INTERPRET_CASES[:3] + INTERPRET_CASES[4:])
def test_interpret_tgmm(m, k, n, sizes):
    gs = jnp.array(sizes, jnp.int32)
    x, _, dy = _operands(jax.random.key(m + 1), m, k, n, len(sizes))
    total = sum(sizes)
    # NaN in the rows past the total: a 0*NaN from an unmasked row would show.
    x = x.at[total:].set(jnp.nan)
    dy = dy.at[total:].set(jnp.nan)
    dk = mgpu.tgmm(x, dy, gs, num_groups=len(sizes), out_dtype=jnp.float32, block_sizes=SMALL,
                   interpret=True)
    ref = tgmm_reference(*_f32(x[:total], dy[:total]), gs, len(sizes))
    assert_close(dk, ref, dtype=jnp.float32, tol=EXACT_FP32, what="tgmm")
    empty = [i for i, s in enumerate(sizes) if s == 0]
    assert (np.asarray(dk)[empty] == 0).all()


# The dkernel's producer / two-consumer kernels: cooperative (the epilogue whole, in
# strips, delayed releases) and ping-pong (2 and 3 stages, whole tiles and strips).
_WS_TGMM_KERNELS = {
    "whole": ("_tgmm_kernel_warp_specialized", SMALL_WS),
    "strips": ("_tgmm_kernel_warp_specialized", STRIPED_WS),
    "strips_delayed": ("_tgmm_kernel_warp_specialized", STRIPED_WS_DELAYED),
    "pingpong2": ("_tgmm_kernel_pingpong", PINGPONG),
    "pingpong3_strips": ("_tgmm_kernel_pingpong", dataclasses.replace(
        STRIPED_WS, pingpong=True, stages=3)),
    # 192-row tiles where k allows (TGMM_PINGPONG_TALL's shape)
    "pingpong_tall": ("_tgmm_kernel_pingpong", dataclasses.replace(PINGPONG, block_m=192)),
}


@pytest.mark.parametrize("variant", list(_WS_TGMM_KERNELS))
@pytest.mark.parametrize("m,k,n,sizes", INTERPRET_WS_CASES + [(200, 64, 128, [70, 0, 100])])
def test_interpret_warp_specialized_tgmm(m, k, n, sizes, variant, monkeypatch):
    """The producer / two-consumer dkernels: each group's rows only (NaN rows past the
    total and a neighbour's rows masked in both operands), empty groups zero."""
    kernel, blocks = _WS_TGMM_KERNELS[variant]
    built = []
    real = getattr(mgpu, kernel)
    monkeypatch.setattr(mgpu, kernel, lambda *a: built.append(a) or real(*a))
    gs = jnp.array(sizes, jnp.int32)
    x, _, dy = _operands(jax.random.key(m + 2), m, k, n, len(sizes))
    total = sum(sizes)
    x = x.at[total:].set(jnp.nan)
    dy = dy.at[total:].set(jnp.nan)
    dk = mgpu.tgmm(x, dy, gs, num_groups=len(sizes), out_dtype=jnp.float32,
                   block_sizes=blocks, interpret=True)
    assert len(built) == 1
    ref = tgmm_reference(*_f32(x[:total], dy[:total]), gs, len(sizes))
    assert_close(dk, ref, dtype=jnp.float32, tol=EXACT_FP32, what="tgmm")
    empty = [i for i, s in enumerate(sizes) if s == 0]
    assert (np.asarray(dk)[empty] == 0).all()


# The H200 dkernel's shape at interpreter size: 128x(2x128) tiles, 64-column strips, a
# delayed release; its boundary masks rewrite 16-row chunks (32 where a block is 64 wide).
H200_LIKE_TGMM = dataclasses.replace(STRIPED_WS_DELAYED, block_m=128)


@pytest.mark.parametrize("blocks", [SMALL, STRIPED_WS_DELAYED, H200_LIKE_TGMM, PINGPONG],
                         ids=["one_wg", "strips_delayed", "h200_like", "pingpong"])
@pytest.mark.parametrize("poisoned", [1, 3])
def test_interpret_tgmm_keeps_a_groups_non_finite_rows_to_itself(blocks, poisoned):
    """NaN in one group's rows of x and Inf in its rows of dy (group starts off the 8-row
    grid, so both boundary steps of each neighbour hold some of them): that group's
    dkernel is non-finite, every other group's matches the clean reference exactly."""
    sizes = [37, 50, 0, 77, 36]
    m, k, n = 200, 256, 256
    gs = jnp.array(sizes, jnp.int32)
    x, _, dy = _operands(jax.random.key(poisoned), m, k, n, len(sizes))
    start = sum(sizes[:poisoned])
    rows = slice(start, start + sizes[poisoned])
    bad_x = x.at[rows].set(jnp.nan)
    bad_dy = dy.at[rows].set(jnp.inf)
    dk = mgpu.tgmm(bad_x, bad_dy, gs, num_groups=len(sizes), out_dtype=jnp.float32,
                   block_sizes=blocks, interpret=True)
    ref = tgmm_reference(*_f32(x, dy), gs, len(sizes))
    others = [i for i in range(len(sizes)) if i != poisoned]
    assert_close(dk[np.array(others)], ref[np.array(others)], dtype=jnp.float32,
                 tol=EXACT_FP32, what="tgmm, clean groups")
    assert not np.isfinite(np.asarray(dk[poisoned])).any()


def test_interpret_bf16_output_rounds_once():
    gs = jnp.array([20, 44], jnp.int32)
    x, w, _ = _operands(jax.random.key(7), 64, 128, 64, 2)
    out = mgpu.gmm(x, w, gs, block_sizes=SMALL, interpret=True)
    assert out.dtype == BF16
    ref = gmm_reference(*_f32(x, w), gs).astype(BF16)
    # fp32 sums differ only in order; after one rounding most entries agree exactly.
    same = np.mean(np.asarray(out, np.float32) == np.asarray(ref, np.float32))
    assert same > 0.95, same


# ----------------------------------------------------------------------------- lowering


# The kernels' block sizes the lowering and GPU tests name: None is the shape's default
# (the warp-specialised kernels where the width splits into 256 columns).
_BLOCKS = {
    "default": None,
    "ws": mgpu.GMM_WARP_SPECIALIZED,
    "ws_delayed": dataclasses.replace(mgpu.GMM_WARP_SPECIALIZED, delay_release=1),
    "ws_strips": dataclasses.replace(mgpu.GMM_WARP_SPECIALIZED, stages=4, epilogue_block_n=64),
    "one_wg": mgpu.GMM_LARGE_GROUPS,
    "small": mgpu.MosaicGpuBlockSizes(block_m=64, block_n=64, stages=3, grid_block_n=4),
    # the ping-pong gmm, dx and dkernel at the config measured on the H200 for the gmm
    # (docs/performance.md, "ping-pong")
    "pingpong": dataclasses.replace(mgpu.GMM_WARP_SPECIALIZED, pingpong=True, stages=5),
    # the ping-pong dkernel with 192-row tiles in 64-column strips
    "pingpong_tall": dataclasses.replace(mgpu.GMM_WARP_SPECIALIZED, pingpong=True, stages=4,
                                         block_m=192, epilogue_block_n=64),
    # the forward and dx default where groups average 1024 rows or more
    "large_tiles": mgpu.GMM_LARGE_TILES,
}


@pytest.mark.parametrize("product,blocks", [
    ("forward", "default"), ("dx", "default"), ("dkernel", "default"),
    ("forward", "ws_delayed"), ("dx", "ws_delayed"), ("forward", "one_wg"), ("dx", "one_wg"),
    ("dkernel", "ws"), ("forward", "ws_strips"), ("dx", "ws_strips"), ("dkernel", "ws_strips"),
    ("forward", "pingpong"), ("dx", "pingpong"), ("dkernel", "pingpong"),
    ("dkernel", "pingpong_tall"), ("forward", "large_tiles"),
    ("dx", "large_tiles"),
])
def test_lowers_for_cuda_from_cpu(product, blocks, monkeypatch):
    """Layout inference and the wgmma/TMA lowering run for every product: the default
    (warp-specialised gmm at 3 stages of 128x256, which fits shared memory), its delayed
    release, and the one-warpgroup gmm."""
    _export_for_cuda(product, _BLOCKS[blocks], (4096, 512, 1024, 8), monkeypatch)


@pytest.mark.parametrize("product", ["forward", "dx", "dkernel"])
def test_odd_halves_lower_for_cuda_from_cpu(product, monkeypatch):
    """k = n = 1408, eleven 128-column halves: the forward and dx default to the
    ping-pong kernel (128-column tiles), the dkernel to the cooperative one with the last
    tile's second half past the edge."""
    bs = mgpu.default_block_sizes(product=product, m=4096, k=1408, n=1408, g=8)
    assert bs.warp_specialized and bs.pingpong == (product != "dkernel")
    _export_for_cuda(product, None, (4096, 1408, 1408, 8), monkeypatch)


@pytest.mark.parametrize("product,dims", [
    ("forward", (4096, 1152, 576, 8)), ("dx", (4096, 576, 1152, 8)),
    ("dkernel", (4096, 576, 1152, 8)),
])
def test_odd_64s_take_192_wide_pingpong_tiles(product, dims, monkeypatch):
    """An output width (the dkernel: k) of 576 = 9 x 64 = 3 x 192, as 2880: the ping-pong
    kernels with 192-wide tiles by default, which lower for an H200."""
    m, k, n, g = dims
    bs = mgpu.default_block_sizes(product=product, m=m, k=k, n=n, g=g)
    wide = bs.block_m if product == "dkernel" else bs.block_n
    assert bs.pingpong and wide == 192, bs
    assert mgpu.default_block_sizes(product=product, m=m, k=2 * k, n=2 * n, g=g) != bs
    _export_for_cuda(product, None, dims, monkeypatch)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_lowers_without_a_data_dependent_branch(transpose_rhs, monkeypatch):
    """Rows of no group (past the total, other experts' rows) are zeroed by the kernel's
    own tiles, not by a conditional after it: the host waited for the device on every
    call to read such a branch's predicate (docs/performance.md, "no host wait")."""
    m, k, n, g = 4096, 512, 1024, 8
    s = jax.ShapeDtypeStruct
    rhs = s((g, n, k) if transpose_rhs else (g, k, n), BF16)

    def f(x, w, sizes, offset):
        return mgpu.gmm(x, w, sizes, group_offset=offset, transpose_rhs=transpose_rhs)

    text = _cuda_module(f, (s((m, k), BF16), rhs, s((2 * g,), jnp.int32), s((), jnp.int32)),
                        monkeypatch)
    assert "stablehlo.if" not in text and "stablehlo.case" not in text


def _export_for_cuda(product, blocks, dims, monkeypatch):
    m, k, n, g = dims
    s = jax.ShapeDtypeStruct
    gs = s((g,), jnp.int32)
    if product == "forward":
        f = lambda a, b, c: mgpu.gmm(a, b, c, block_sizes=blocks)  # noqa: E731
        args = (s((m, k), BF16), s((g, k, n), BF16), gs)
    elif product == "dx":
        f = lambda a, b, c: mgpu.gmm(a, b, c, transpose_rhs=True, out_dtype=jnp.float32,  # noqa
                                     block_sizes=blocks)
        args = (s((m, n), BF16), s((g, k, n), BF16), gs)
    else:
        f = lambda a, b, c: mgpu.tgmm(a, b, c, num_groups=g, block_sizes=blocks)  # noqa: E731
        args = (s((m, k), BF16), s((m, n), BF16), gs)
    _cuda_module(f, args, monkeypatch)


def _cuda_module(f, args, monkeypatch):
    """f lowered for an H200 (132 SMs) from this CPU: its module text, which must hold a
    Mosaic GPU kernel."""
    monkeypatch.setattr(mgpu, "_num_programs", lambda interpret: 132)
    text = cuda_module(f, *args, allow_triton=False)
    assert "mosaic_gpu" in text
    return text


# ----------------------------------------------------------------------------- GPU


def _gpu_cases():
    key = jax.random.key(11)
    ks = jax.random.split(key, 4)
    return [
        ("dirichlet", 4096, 512, 768, 8, random_group_sizes(ks[0], 4096, 8)),
        ("many_small", 8192, 256, 512, 64, random_group_sizes(ks[1], 8192, 64)),
        ("skewed", 4096, 512, 512, 16, skewed_group_sizes(ks[2], 4096, 16)),
        ("total_lt_m", 4096, 256, 384, 8, random_group_sizes(ks[3], 4096, 8, total=3001,
                                                            empty=(2, 5))),
        ("one_group", 2048, 256, 256, 4, one_group_sizes(2048, 4, index=3)),
        ("all_empty", 1024, 128, 256, 4, jnp.zeros((4,), jnp.int32)),
        ("odd_m", 1000, 192, 320, 5, jnp.array([1, 300, 0, 7, 600], jnp.int32)),
    ]


# Which cases run with which named blocks besides the default (every case).
_GPU_BLOCK_CASES = {
    "small": ("many_small", "odd_m"),
    "ws_delayed": ("dirichlet", "total_lt_m", "all_empty"),
    "one_wg": ("dirichlet", "many_small", "total_lt_m"),
    "ws": ("many_small", "skewed", "one_group"),
    "pingpong": ("dirichlet", "many_small", "total_lt_m", "all_empty", "odd_m"),
    "pingpong_tall": ("dirichlet", "skewed", "total_lt_m", "one_group", "odd_m"),
    "large_tiles": ("dirichlet", "skewed", "total_lt_m", "one_group", "odd_m"),
}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case,blocks",
    [(c, "default") for c in _gpu_cases()]
    + [(c, name) for name, names in _GPU_BLOCK_CASES.items()
       for c in _gpu_cases() if c[0] in names],
    ids=lambda v: v[0] if isinstance(v, tuple) else v,
)
def test_gpu_parity(case, blocks):
    _, m, k, n, g, gs = case
    blocks = _BLOCKS[blocks]
    x, w, dy = _operands(jax.random.key(m + k), m, k, n, g)
    total = int(np.sum(np.asarray(gs)))
    out = jax.jit(lambda a, b, c: mgpu.gmm(a, b, c, block_sizes=blocks,
                                           out_dtype=jnp.float32))(x, w, gs)
    assert_close(out, gmm_reference(*_f32(x, w), gs), dtype=BF16, what="gmm")
    assert (np.asarray(out)[total:] == 0).all()
    dx = jax.jit(lambda a, b, c: mgpu.gmm(a, b, c, transpose_rhs=True, block_sizes=blocks))(
        dy, w, gs)
    assert dx.dtype == BF16
    assert_close(dx, gmm_reference(*_f32(dy, w), gs, transpose_rhs=True), dtype=BF16, what="dx")
    assert (np.asarray(dx, np.float32)[total:] == 0).all()
    dk = jax.jit(lambda a, b, c: mgpu.tgmm(a, b, c, num_groups=g, block_sizes=blocks,
                                           out_dtype=jnp.float32))(x, dy, gs)
    assert_close(dk, tgmm_reference(*_f32(x, dy), gs, g), dtype=BF16, what="tgmm")
    empty = np.flatnonzero(np.asarray(gs) == 0)
    assert (np.asarray(dk)[empty] == 0).all()


@pytest.mark.gpu
def test_gpu_gradients_through_public_api():
    from pallasite.kernels.grouped_matmul.api import grouped_projection
    from pallasite.reference.grouped_projection import grouped_projection as reference

    m, k, n, g = 2048, 256, 512, 8
    x, w, dy = _operands(jax.random.key(5), m, k, n, g)
    gs = random_group_sizes(jax.random.key(6), m, g, total=1900, empty=(3,))

    def loss(f):
        return lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * dy.astype(jnp.float32))

    ours = jax.jit(jax.value_and_grad(
        loss(lambda a, b: grouped_projection(a, b, gs, BF16, implementation="pallas_mosaic_gpu")),
        argnums=(0, 1)))(x, w)
    ref = jax.jit(jax.value_and_grad(
        loss(lambda a, b: reference(a.astype(jnp.float32), b.astype(jnp.float32), gs,
                                    jnp.float32, precision=jax.lax.Precision.HIGHEST)),
        argnums=(0, 1)))(x, w)
    assert_close(ours[1][0], ref[1][0], dtype=BF16, what="dx")
    assert_close(ours[1][1], ref[1][1], dtype=BF16, what="dkernel")
    assert (np.asarray(ours[1][1], np.float32)[3] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("m,picked", [(2048, "mosaic_gpu"), (1024, "__gpu$xla.gpu.triton")])
def test_gpu_default_order_by_rows_per_group(m, picked):
    """With no implementation= on Hopper: Mosaic GPU at >= 256 rows per group on average
    (mosaic_gpu_preferred), Triton below; either way the value matches the reference."""
    from pallasite.kernels.grouped_matmul.api import grouped_projection

    k, n, g = 256, 512, 8
    x, w, _ = _operands(jax.random.key(9), m, k, n, g)
    gs = random_group_sizes(jax.random.key(10), m, g)
    f = jax.jit(lambda a, b, c: grouped_projection(a, b, c, BF16))
    assert picked in f.lower(x, w, gs).as_text()
    assert_close(f(x, w, gs), gmm_reference(*_f32(x, w), gs), dtype=BF16, what="default")
