"""Grouped projection on Hopper (sm90) through Pallas Mosaic GPU: wgmma fed by TMA.

Backend contract (megablox style, shared by every grouped-projection backend):
  gmm(lhs[m,k], rhs[g,k,n] or [g,n,k] with transpose_rhs, group_sizes[g]) -> [m,n]
  tgmm(lhs[m,k], rhs[m,n], group_sizes[g], num_groups=g) -> [g,k,n], out_g = lhs_g^T rhs_g
Rows of lhs are sorted by group; rows past sum(group_sizes) give zeros; empty groups give
zero tgmm blocks; products accumulate in fp32 (wgmma accumulators) and round once.

gmm (forward, and dx = gmm(dy, kernel, transpose_rhs=True): the transposed weight tile is
  read through a transposed shared-memory view, never copied in HBM).
  Row tiles are laid out per group, starting at the group's first row, so no tile straddles
  two groups: a tile holds up to block_m rows of one group. The tile table (group, first
  row, valid rows) is built on the device by a few tiny XLA ops before the kernel; the
  kernel reads three scalars per tile instead of unrolling a search over all groups (JAX's
  example kernel does the latter, which costs it most of the gap on g=128/256 shapes, see
  docs/performance.md). Rows of no group (past the total, or of other experts with
  group_offset) have tiles too, which skip the matmul and store zeros: the forward has no
  data-dependent branch after the kernel, whose predicate would make the host wait for
  the device on every call. Every tile runs a pipeline, a zero tile the shortest (a tile
  that skipped it stalled the GPU, docs/performance.md).
  A persistent grid (one program per SM) walks (row tile, column tile) pairs in a planar
  snake of width grid_block_n column tiles, so concurrently running programs share weight
  and activation tiles in L2. Each tile runs a `stages`-deep TMA -> swizzled SMEM -> wgmma
  pipeline over k. The output tile goes registers -> SMEM -> TMA store, with the ragged row
  count stored as a ladder of power-of-two row boxes (TMA boxes are static).
  The TMA load window is clamped into [0, m) (a short last tile of the last group reads a
  few rows before its first row rather than past the array end) so no load is out of
  bounds; the store uses only the group's own rows.
  With local experts (group_offset: rhs holds groups [offset, offset + g) of the global
  group_sizes) the table holds the local groups' tiles from their first row on; the other
  rows, most of them under expert parallelism, cost a zero store and no matmul.

tgmm (dkernel): one output tile (block_m x block_n of [k, n]) per (group, tile) pair; the
  contraction runs over the group's rows in steps of block_k starting at the group's first
  row rounded down to 8; the first and last steps mask the rows not the group's in both
  operands (a select, so a NaN in a neighbour's rows cannot leak in as 0*NaN), rewriting
  only the 16-row chunks that hold such rows. An empty group runs one fully masked step
  and stores zeros. On every TARGETS shape there are >= 28k output tiles for 132 SMs, so uneven
  groups average out across programs without split-k (see docs/performance.md).

Warp-specialised variants (MosaicGpuBlockSizes.warp_specialized, the H200 default for gmm,
dx and tgmm wherever the output width is whole block_n columns): a producer
warpgroup issues the TMA loads and runs ahead into the next tile while two consumer
warpgroups each own half of a block_m x 2*block_n tile; a consumer waits for its previous
tile's stores to leave SMEM only when it next needs its slot, so epilogue and refill overlap
the tensor-core work instead of following it. That fixed per-tile cost is what limited the
one-warpgroup kernels on short k loops (dsv3's dkernel: about 4 row steps per tile). The
dkernel default stores each consumer's tile in two 64-column strips through one 32 KiB
slot, which leaves room for a 4th pipeline stage, and releases each stage a step late
(epilogue_block_n, delay_release); that made it 7-11% faster on every measured shape.
Where groups average 1024 rows or more the forward and dx take 192x(2x128) tiles in
64-column strips (GMM_LARGE_TILES). A ping-pong gmm and dx (MosaicGpuBlockSizes.pingpong,
the default where the output width is an odd count of 128-column halves): the consumers
take alternate tiles fed through one ring that is never drained, so one's epilogue
overlaps the other's wgmma; on the H200 4-7% faster than the cooperative kernel on those
widths, 12-25% slower on even counts (docs/performance.md "ping-pong", "boundary masks
by chunk"). A ping-pong tgmm (_tgmm_kernel_pingpong) likewise; with 192-wide tiles it is
the default for gmm, dx and tgmm where the width is an odd multiple of 64 that 192
divides (2880: dx 1.64x, dkernel 1.44x the previous defaults, GMM_PINGPONG_WIDE).

Measured on one H200 (2026-11-30, docs/performance.md issue 7), bench harness (rotated
inputs, every peer in one process), TFLOP/s forward with the default: mixtral 643, dsv3
497, qwen3 472, olmoe 474 (torch._grouped_mm 644 / 457 / 486 / 486, Triton 585 / 477 / 368
/ 429); fwd+bwd with every product warp-specialised: dsv3 391, qwen3 440, olmoe 440
(torch 427 / 457 / 466, tokamax 186 / 215 / 224). Sampled parity against fp32 dots: rel_l2
1.7e-3 on every product and config; the whole GPU grid passes there, for the default, the
one-warpgroup and the delayed-release kernels. A first version let tiles skip their
pipeline (rows past the total, empty groups): on the GPU (only) the total < m case then
stalled, so every tile runs its pipeline. api.CUDA_ORDER puts this backend first where
groups average >= 256 rows (predicates.mosaic_gpu_preferred), Triton otherwise.
SASS of the one-warpgroup kernels: HGMMA.64x128x16.F32.BF16, no spills, no local memory.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Int, Shaped

from pallasite.kernels import platform
from pallasite.kernels import sharding
from pallasite.kernels.grouped_matmul import costs, tuning_benchmarks
from pallasite.kernels.grouped_matmul.group_metadata import (
    group_offsets,
    local_groups,
    segment_of,
)
from pallasite.reference.grouped_projection import Dtype

# H200 SXM has 132 SMs; used when the default device does not report its core count.
_DEFAULT_NUM_SMS = 132
# Programs in interpret mode (CPU tests): few, so the interpreter's threads stay cheap.
_INTERPRET_NUM_SMS = 3
_MAX_ACC_ELEMS = 192 * 128  # one warpgroup: 192 fp32 accumulator registers per thread


@dataclasses.dataclass(frozen=True)
class MosaicGpuBlockSizes:
    """Tiles for one Mosaic GPU product.

    block_m x block_n is the output tile held in one warpgroup's registers; block_k the
    contraction step per pipeline stage. For gmm: block_m rows of lhs, block_n columns of
    the output, block_k of the k contraction. For tgmm: block_m over k (lhs columns),
    block_n over n, block_k rows of the ragged contraction. stages is the number of TMA
    buffers in flight; grid_block_n the width (in column tiles) of the planar snake.

    warp_specialized: a producer warpgroup issues the TMA loads while two consumer
    warpgroups each own a block_m x block_n half of a block_m x 2*block_n tile, so one
    tile's epilogue overlaps the next tile's loads. Needs n to be a multiple of block_n
    (else the one-warpgroup kernel runs; an odd count leaves the last tile's second half
    idle); stages are cut to what fits shared memory.
    delay_release (warp-specialised kernels only, 0 or 1): wgmma groups a consumer leaves
    in flight when it hands a stage back to the producer (1: the buffer is released a step
    later; gmm keeps 0 for pipelines of a single k step, tgmm runs at least two steps).
    epilogue_block_n (warp-specialised kernels only; None: block_n): columns per store
    strip of a consumer's epilogue. A strip narrower than block_n shrinks each consumer's
    output slot (the strips go out one after another through it), and the shared memory
    freed holds one more pipeline stage: 4 stages of 128x(2x128)x64 fit beside 64-column
    strips, 3 beside whole 128-column tiles.
    pingpong (implies warp_specialized): the two consumer warpgroups take alternate
    block_m x block_n tiles instead of halves of one, fed in order by the producer
    through one ring of `stages` buffers that is never drained between tiles, so one
    consumer's epilogue overlaps the other's wgmma (_gmm_kernel_pingpong,
    _tgmm_kernel_pingpong). The gmm and dx default where the output width is an odd
    count of block_n columns (GMM_PINGPONG), and with 192-wide tiles for every product
    where it is an odd multiple of 64 that 192 divides (GMM_PINGPONG_WIDE,
    TGMM_PINGPONG_TALL).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    grid_block_n: int = 8
    warp_specialized: bool = False
    delay_release: int = 0
    epilogue_block_n: int | None = None
    pingpong: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "stages", "grid_block_n"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MosaicGpuBlockSizes.{name} must be a positive int, got {value!r}")
        for name in ("warp_specialized", "pingpong"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"MosaicGpuBlockSizes.{name} must be a bool, "
                                 f"got {getattr(self, name)!r}")
        if self.pingpong and not self.warp_specialized:
            raise ValueError("MosaicGpuBlockSizes.pingpong needs warp_specialized=True (a "
                             "producer and two consumer warpgroups)")
        if self.delay_release not in (0, 1) or isinstance(self.delay_release, bool):
            raise ValueError(f"MosaicGpuBlockSizes.delay_release must be 0 or 1, "
                             f"got {self.delay_release!r}")
        for name in ("block_m", "block_n", "block_k"):
            if getattr(self, name) % 64:
                raise ValueError(
                    f"MosaicGpuBlockSizes.{name} must be a multiple of 64 (wgmma warpgroup "
                    f"rows, 128-byte swizzle of bf16), got {getattr(self, name)}"
                )
        strip = self.epilogue_block_n
        if strip is not None and (not isinstance(strip, (int, np.integer)) or isinstance(strip, bool)
                                  or strip < 64 or strip % 64 or self.block_n % strip):
            raise ValueError(f"MosaicGpuBlockSizes.epilogue_block_n must be None or a multiple "
                             f"of 64 dividing block_n={self.block_n}, got {strip!r}")
        if self.block_m * self.block_n > _MAX_ACC_ELEMS:
            raise ValueError(
                f"MosaicGpuBlockSizes block_m*block_n={self.block_m * self.block_n} exceeds "
                f"{_MAX_ACC_ELEMS}: the fp32 accumulator would not fit one warpgroup's registers"
            )


# Defaults measured on one H200 (docs/performance.md, issue 7). Forward and dx where the
# output width is whole 128-column halves (an odd count since 2026-12-01, _live_half;
# measured then on 256-column multiples): the warp-specialised kernel, 128x(2x128)
# tiles, 3 stages, width 8; 2026-11-30 18:2x UTC, TFLOP/s against the one-warpgroup
# default in the same process: forward mixtral 666/632, dsv3 509/480, qwen3 486/454,
# olmoe 479/446; dx 655/644, 490/428, 464/379, 449/393. Otherwise, the one-warpgroup
# kernel: on mixtral (8 groups of ~4096 rows) 128x128 tiles, 4 stages, snake width 8 gave
# forward 644 TFLOP/s against 631 for 192x128 and 606 for 5 stages / width 4; on dsv3 (256
# groups of ~256 rows) 5 stages / width 4 gave 480 against 450 for both 4-stage configs.
GMM_WARP_SPECIALIZED = MosaicGpuBlockSizes(block_m=128, block_n=128, block_k=64, stages=3,
                                           grid_block_n=8, warp_specialized=True)
# Forward and dx where the output width is an odd number of 128-column halves (1408 = 11,
# 5504 = 43; the cooperative kernel's last 256-column tile leaves a half idle): the
# ping-pong kernel, 128x128 tiles, 5 stages, snake width 8. 2026-12-02 00:4x UTC, ms
# against the cooperative default in one process (docs/performance.md "ping-pong"):
# forward w1408_up 0.393 / 0.417, w5504_up 1.210 / 1.259; dx (output width 1408, 5504)
# w1408_down 0.395 / 0.425, w5504_down 1.205 / 1.275; the forward again at 04:2x UTC:
# 0.405 / 0.431 and 1.238 / 1.288. (That run's dx pair timed the cooperative kernel
# twice, a sweep bug fixed since: docs/performance.md, "one-pass tile table".)
GMM_PINGPONG = MosaicGpuBlockSizes(block_m=128, block_n=128, block_k=64, stages=5,
                                   grid_block_n=8, warp_specialized=True, pingpong=True)
# Forward and dx with an even count of halves where groups average 1024 rows or more:
# 192x(2x128) tiles (a third fewer operand loads per flop), 3 stages beside 64-column
# epilogue strips (_fit_warp_specialized). 2026-12-02 04:2x-04:3x UTC, ms against the
# 128-row default in one process, two runs: mixtral forward 5.860 / 5.964 and 5.796 /
# 5.894, dx 5.716 / 5.807; w5504_down forward 1.152 / 1.217. (w5504_up's dx, which takes
# these tiles too, was only timed end to end: fwd+bwd 645 against torch's 640 TFLOP/s.)
# Where groups average 512 rows (olmoe, qwen3, the 1408 widths) it tied or lost (olmoe
# forward 0.314 / 0.296): a 192-row tile wastes more of each group's last tile.
GMM_LARGE_TILES = MosaicGpuBlockSizes(block_m=192, block_n=128, block_k=64, stages=3,
                                      grid_block_n=8, warp_specialized=True,
                                      epilogue_block_n=64)
GMM_LARGE_GROUPS = MosaicGpuBlockSizes(block_m=128, block_n=128, block_k=64, stages=4, grid_block_n=8)
GMM_SMALL_GROUPS = MosaicGpuBlockSizes(block_m=128, block_n=128, block_k=64, stages=5, grid_block_n=4)
# dkernel where n is whole 128-column halves (odd counts too): the warp-specialised kernel,
# width 4; 2026-11-30 18:2x UTC at 3 stages, ms against the one-warpgroup kernel (the
# table's dsv3 entry, 5 stages / width 4, elsewhere TGMM_DEFAULT) in the same process: dsv3
# 5.93 / 6.96, qwen3 0.490 / 0.543, olmoe 0.316 / 0.360, mixtral 6.06 / 6.19 (at width 8
# the warp-specialised kernel lost on mixtral, 6.46). Since 2026-12-01 4 stages beside
# 64-column epilogue strips, with a delayed release; ms against the 3-stage kernel in one
# process (docs/performance.md "dkernel: a fourth stage"): dsv3 5.24 / 5.92, mixtral 5.83 /
# 6.41, qwen3 0.473 / 0.511, olmoe 0.307 / 0.339, w1408_up 0.437 / 0.482, w5504_up 1.225 /
# 1.350. Otherwise, one warpgroup: 64-row steps,
# 4 stages, width 8 beat 128-row steps (mixtral 625 vs 578, dsv3 269 vs 218 TFLOP/s) and
# 6 stages / width 16 (557, 264).
TGMM_WARP_SPECIALIZED = MosaicGpuBlockSizes(block_m=128, block_n=128, block_k=64, stages=4,
                                            grid_block_n=4, warp_specialized=True,
                                            delay_release=1, epilogue_block_n=64)
TGMM_DEFAULT = MosaicGpuBlockSizes(block_m=128, block_n=128, block_k=64, stages=4, grid_block_n=8)
# Widths that are an odd multiple of 64 but whole 192-column blocks (2880 = 45 x 64 = 15 x
# 192; gpt-oss's hidden size): 128-column tiles leave the last one half empty and, the
# width not splitting into 128-column halves, run the one-warpgroup kernel. 192-wide tiles
# on the ping-pong kernels instead, 4 stages beside 64-column strips. 2026-12-03 21:0x UTC
# on the H200 at m 65536, k 2880, n 5760, g 128 (autotune, median of interleaved calls):
# dx 3.78 ms against 6.19 for the 128-column default and 4.16 for 192-column one-warpgroup
# tiles; dkernel (192 rows of k a tile) 4.10 ms against 5.91 for the cooperative default and
# 5.04-5.31 for 192-row one-warpgroup tiles. The ping-pong dkernel at 128-row tiles lost to
# the cooperative one on every other measured shape (dsv3 5.17 / 4.97 ms, qwen3 0.468 /
# 0.455, olmoe 0.308 / 0.295, mixtral 6.31 / 5.81), so it is the default only here.
GMM_PINGPONG_WIDE = MosaicGpuBlockSizes(block_m=128, block_n=192, block_k=64, stages=4,
                                        grid_block_n=8, warp_specialized=True,
                                        epilogue_block_n=64, pingpong=True)
TGMM_PINGPONG_TALL = MosaicGpuBlockSizes(block_m=192, block_n=128, block_k=64, stages=4,
                                         grid_block_n=4, warp_specialized=True,
                                         epilogue_block_n=64, pingpong=True)


def refusal(compute: Dtype, operands: Sequence[jax.Array], *, target: str | None
            ) -> str | None:
    """Why these kernels cannot run `compute` over `operands` compiled for `target` (a
    platform; None: interpreted, which takes every dtype ragged_dot_runs admits). None:
    they can. api.py asks after its generic checks; wgmma needs the Hopper GPU this
    process holds and takes 16-bit operands here."""
    del operands  # cast to `compute` before the kernel
    if target is None:
        return None
    if not platform.mosaic_gpu_runs():
        return (f"pallas_mosaic_gpu needs a Hopper GPU (sm90); the device is "
                f"{platform.device_generation()}")
    if np.dtype(compute).itemsize != 2:
        return (f"pallas_mosaic_gpu takes 16-bit compute (bf16, fp16); "
                f"compute={np.dtype(compute).name}")
    return None


def resolve_block_sizes(
    block_sizes: Any, *, product: str, m: int, k: int, n: int, g: int, dtype: Any = jnp.bfloat16,
    interpret: bool = True,
) -> MosaicGpuBlockSizes:
    """The one place this backend picks its blocks: the caller's, else pallasite.tuning's
    tuned table / autotune cache entry for this device and shape bucket, else a bounded
    autotune of this shape (only when the kernel will run compiled, not `interpret`, on a
    Hopper GPU; PALLASITE_AUTOTUNE=0 turns it off), else the shape's default (exactly
    `default_block_sizes`). `interpret` defaults to True, "do not tune", for callers that
    only ask which blocks apply; gmm and tgmm pass theirs.

    block_sizes: None, a MosaicGpuBlockSizes (every product), or a
    config.GroupedProjectionBlockSizes naming one per product ('forward', 'dx', 'dkernel').
    """
    return tuning_benchmarks.select_block_sizes(
        sys.modules[__name__], "pallas_mosaic_gpu", MosaicGpuBlockSizes, block_sizes,
        product=product, dims={"m": m, "k": k, "n": n, "g": g}, dtype=dtype,
        default=default_block_sizes(product=product, m=m, k=k, n=n, g=g),
        tune_here=not interpret and platform.mosaic_gpu_runs(),
    )


def default_block_sizes(*, product: str, m: int, k: int, n: int, g: int) -> MosaicGpuBlockSizes:
    """The H200-measured default for the product, its output width and the group sizes
    (above). m, k, n are the projection's ([m, k] x [k, n]); dx writes k columns."""
    if product == "dx":
        n = k
    if product == "dkernel":
        splits = n % TGMM_WARP_SPECIALIZED.block_n == 0
        if splits and _odd_64s_whole_192s(k):
            return TGMM_PINGPONG_TALL
        return TGMM_WARP_SPECIALIZED if splits else TGMM_DEFAULT
    if _odd_64s_whole_192s(n):
        return GMM_PINGPONG_WIDE
    large_groups = m >= 1024 * max(g, 1)
    halves, rest = divmod(n, GMM_WARP_SPECIALIZED.block_n)  # n: the output width
    if rest == 0 and halves % 2:
        return GMM_PINGPONG
    if rest == 0:
        return GMM_LARGE_TILES if large_groups else GMM_WARP_SPECIALIZED
    return GMM_LARGE_GROUPS if large_groups else GMM_SMALL_GROUPS


def _odd_64s_whole_192s(width: int) -> bool:
    """A width that 128-column tiles cover with a half-empty last one and 192-column tiles
    exactly (GMM_PINGPONG_WIDE, TGMM_PINGPONG_TALL)."""
    return width % 128 == 64 and width % 192 == 0


# --------------------------------------------------------------------------- helpers


def _num_programs(interpret: bool) -> int:
    if interpret:
        return _INTERPRET_NUM_SMS
    return int(getattr(jax.devices()[0], "core_count", 0) or _DEFAULT_NUM_SMS)


def _mesh(bs: MosaicGpuBlockSizes, interpret: bool):
    """One program per SM; warp-specialised kernels run three warpgroups per program (two
    consumers, then the producer, named "wg")."""
    if bs.warp_specialized:
        return plgpu.Mesh(grid=(_num_programs(interpret),), grid_names=("sm",),
                          num_threads=3, thread_name="wg")
    return plgpu.Mesh(grid=(_num_programs(interpret),), grid_names=("sm",))


def _interpret_params(interpret: bool):
    # TMA zero-fills reads past the array end (the last group's last tgmm step); the
    # interpreter fills them with NaN instead, which the row masks must then remove.
    return plgpu.InterpretGPUParams(out_of_bounds_reads="uninitialized_value") if interpret else False


def _compiler_params():
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _swizzle_transforms(dtype, rows: int = 8) -> tuple:
    """128-byte swizzle with (rows, 128 bytes) tiles.

    rows=1 for the ragged output tile: its row boxes start at any row, which (8, .) tiles
    cannot address.
    """
    swizzle = 128
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((rows, elems)), plgpu.SwizzleTransform(swizzle))


def _pad_axis(x: jax.Array, axis: int, multiple: int, minimum: int = 0) -> jax.Array:
    size = x.shape[axis]
    target = max(-(-size // multiple) * multiple, minimum)
    if target == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, target - size)
    return jnp.pad(x, pad)


def _fit_block(dim: int, block: int) -> int:
    """Largest multiple of 64 <= block that divides dim (avoids padding the weights)."""
    for b in range(block, 63, -64):
        if dim % b == 0:
            return b
    return block


def _fit_block_n(bs: MosaicGpuBlockSizes, n: int) -> MosaicGpuBlockSizes:
    """bs with block_n fitted to n (_fit_block); an epilogue strip that no longer divides
    it becomes the whole block_n."""
    block_n = _fit_block(n, bs.block_n)
    strip = bs.epilogue_block_n
    return dataclasses.replace(bs, block_n=block_n,
                               epilogue_block_n=None if strip is None or block_n % strip else strip)


def _epilogue_strip(bs: MosaicGpuBlockSizes) -> int:
    """Columns per epilogue store strip (MosaicGpuBlockSizes.epilogue_block_n)."""
    return bs.epilogue_block_n or bs.block_n


def _group_bounds(group_sizes: jax.Array, m: int, row_start=None) -> tuple[jax.Array, jax.Array]:
    """Start and clamped size of each group, the first from row_start (0 when None);
    totals past m are cut at m."""
    offsets = jnp.minimum(group_offsets(group_sizes, row_start), m)
    return offsets[:-1], offsets[1:] - offsets[:-1]


def _row_tile_table(group_sizes: jax.Array, m: int, block_m: int, row_start=None
                    ) -> tuple[jax.Array, jax.Array]:
    """Per row tile (segment, load row, first row, valid rows) as int32 [4, T]; count [1].

    The segments cover every row of [0, m) in order: the rows before the first group
    (row_start, 0 when None), the g groups, then the rows past the last group. A group's
    tiles carry its index; the two segments of no group carry g, and their tiles store
    zeros (the contract) without a matmul. Covering those rows in the kernel keeps the
    forward free of a data-dependent branch after it: a lax.cond on the rows' presence
    made the host wait for the device on every call (docs/performance.md, "no host
    wait"). A segment's tiles start at its first row rounded down to 8 (TMA loads and the
    swizzled SMEM tiles need 8-row alignment; m is padded to a multiple of 8), so a tile
    holds at most block_m rows of one segment and wastes at most 7 leading rows. The load
    row is clamped to m - block_m so no load leaves the array.
    T = (m + (g+3)(block_m+7)) // block_m + 1 bounds sum_s ceil((size_s + 7) / block_m)
    over the g + 2 segments.
    """
    if m % 8 or m < block_m:
        raise ValueError(f"_row_tile_table needs m % 8 == 0 and m >= block_m; got {m=}, {block_m=}")
    g = group_sizes.shape[0]
    starts, sizes = _group_bounds(group_sizes, m, row_start)
    first_row = starts[:1]
    last_row = starts[-1:] + sizes[-1:]
    seg_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), starts, last_row])
    seg_end = jnp.concatenate([first_row, starts + sizes, jnp.full((1,), m, jnp.int32)])
    seg_id = jnp.concatenate([jnp.full((1,), g, jnp.int32), jnp.arange(g, dtype=jnp.int32),
                              jnp.full((1,), g, jnp.int32)])
    seg_base = seg_start // 8 * 8
    seg_tiles = jnp.where(seg_end > seg_start, (seg_end - seg_base + block_m - 1) // block_m, 0)
    tile_end = jnp.cumsum(seg_tiles)
    tile_begin = tile_end - seg_tiles
    bound = (m + (g + 3) * (block_m + 7)) // block_m + 1
    t = jnp.arange(bound, dtype=jnp.int32)
    s = jnp.minimum(segment_of(tile_end, t), g + 1)
    window = seg_base[s] + (t - tile_begin[s]) * block_m
    first = jnp.maximum(window, seg_start[s])
    last = jnp.minimum(window + block_m, seg_end[s])
    load = jnp.minimum(window, m - block_m)
    table = jnp.stack([seg_id[s], load, first, jnp.maximum(last - first, 0)]).astype(jnp.int32)
    return table, tile_end[-1:].astype(jnp.int32)


def _row_tile(table_gmem, index, num_tiles, grid_n: int, bs: MosaicGpuBlockSizes, g: int):
    """Snake step `index`'s row tile mi and column tile ni, with the tile's table row
    (_row_tile_table): segment, load row (8-aligned), first row, valid rows, and whether
    the segment is a group's (else rows of no group: no matmul, zeros stored)."""
    mi, ni = plgpu.planar_snake(index, (num_tiles, grid_n), 1, bs.grid_block_n)
    seg = table_gmem[0, mi]
    return (mi, ni, seg, pl.multiple_of(table_gmem[1, mi], 8), table_gmem[2, mi],
            table_gmem[3, mi], seg < g)


def _k_steps(live, k_steps: int, delay: int):
    """Pipeline steps of a row tile: all k_steps for a group's rows; for rows of no group
    (zeros, no matmul) the fewest a pipeline with `delay` releases in flight takes."""
    return jnp.where(live, k_steps, min(k_steps, 1 + delay))


# --------------------------------------------------------------------------- gmm


def _store_rows(acc, out_gmem, row0, rows, smem_off, col0, block_m: int, block_n: int):
    """Store `rows` (dynamic, <= block_m) rows of the tile from SMEM row smem_off on.

    TMA boxes are static, so the count is written as a sum of power-of-two row boxes.
    """

    o_type = plgpu.SMEM(
        (block_m, block_n), out_gmem.dtype, transforms=_swizzle_transforms(out_gmem.dtype, rows=1)
    )

    @functools.partial(pl.run_scoped, o_smem=o_type)
    def _(o_smem):
        _store_rows_from(acc, o_smem, out_gmem, row0, rows, smem_off, col0, block_m)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _store_rows_from(acc, o_smem, out_gmem, row0, rows, smem_off, col0, block_m: int):
    """Write acc to the SMEM slot o_smem, then issue (not wait for) the TMA row boxes.

    A slot narrower than acc (a sub-tiled epilogue) takes acc strip by strip (_fill_slot)."""
    acc = acc.astype(o_smem.dtype)
    strip = o_smem.shape[-1]
    for j in range(acc.shape[-1] // strip):
        _fill_slot(acc, o_smem, j)
        store_row_boxes(o_smem, out_gmem, row0, rows, smem_off, col0 + j * strip, block_m)


def store_row_boxes(o_smem, out_gmem, row0, rows, smem_off, col0, block_m: int):
    """Issue (not wait for) TMA boxes storing `rows` (dynamic, <= block_m) rows of the
    SMEM slot o_smem, from its row smem_off on, to out_gmem rows [row0, row0 + rows) and
    columns [col0, col0 + the slot's width). TMA boxes are static, so the count is
    written as a sum of power-of-two row boxes."""
    strip = o_smem.shape[-1]
    done = jnp.int32(0)
    box = 1 << (block_m.bit_length() - 1)
    while box:

        @pl.when(rows & box != 0)
        def _(box=box, done=done):
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(smem_off + done, box)],
                out_gmem.at[pl.ds(row0 + done, box), pl.ds(col0, strip)],
            )

        done = done + (rows & box)
        box //= 2


def _fill_slot(acc, o_smem, j: int):
    """Write column strip j (o_smem's width) of acc to the SMEM slot o_smem. The caller
    frees the slot for strip 0; a later strip first waits until the stores issued from the
    slot have read it."""
    strip = o_smem.shape[-1]
    if j:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    o_smem[...] = acc[:, j * strip:(j + 1) * strip]
    plgpu.commit_smem()


def _gmm_kernel(m, k, n, g, bs: MosaicGpuBlockSizes, transpose_rhs: bool):
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    grid_n = n // bn
    delay = 1 if bs.stages > 1 else 0

    def body(table_gmem, count_gmem, lhs_gmem, rhs_gmem, out_gmem):
        num_tiles = count_gmem[0]

        @plgpu.nd_loop((num_tiles * grid_n,), collective_axes="sm")
        def _(info):
            mi, ni, seg, load0, row0, rows, live = _row_tile(table_gmem, info.index[0],
                                                             num_tiles, grid_n, bs, g)

            def acc_scope(acc_ref):
                def mma(_, a_smem, b_smem):
                    @pl.when(live)
                    def _():
                        plgpu.wgmma(acc_ref, a_smem,
                                    b_smem.transpose((1, 0)) if transpose_rhs else b_smem)
                        if not delay:
                            plgpu.wgmma_wait(0)

                # Every listed tile runs a pipeline (a zero tile the shortest one): a tile
                # that skipped it was the cause of a GPU-only stall (docs/performance.md).
                rhs_spec = (
                    plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk), delay_release=delay)
                    if transpose_rhs
                    else plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=delay)
                )
                plgpu.emit_pipeline(
                    mma,
                    grid=(_k_steps(live, k // bk, delay),),
                    in_specs=[
                        plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), delay_release=delay),
                        rhs_spec,
                    ],
                    max_concurrent_steps=bs.stages,
                )(lhs_gmem.at[pl.ds(load0, bm)], rhs_gmem.at[jnp.minimum(seg, g - 1)])
                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))
            _store_rows(acc, out_gmem, row0, rows, row0 - load0, ni * bn, bm, bn)

    return body


# sm90's shared memory per block (227 KiB), less room for the pipeline's barriers.
_SMEM_BYTES = platform.SHARED_MEMORY_KIB["sm90"] * 1024 - 2048


def _fit_warp_specialized(bs: MosaicGpuBlockSizes, n: int, in_bytes: int, out_bytes: int,
                          extra_bytes: int = 0) -> MosaicGpuBlockSizes:
    """bs with as many stages as fit shared memory (at least 2), or the one-warpgroup
    kernel when n does not split into block_n columns or even 2 stages do not fit.
    Shared memory: stages x (lhs block_m x block_k + rhs block_k x 2 block_n) operand
    buffers plus one block_m x epilogue strip output slot per consumer. Where n is an odd
    number of block_n columns the last tile's second half lies past n (see _live_half).
    A ping-pong kernel's stage holds one block_k x block_n rhs block (its tiles are
    block_n wide). extra_bytes: scratch an epilogue adds (the down product's row weights
    and h tiles)."""
    if n % bs.block_n:
        return dataclasses.replace(bs, warp_specialized=False, pingpong=False)
    cta_n = bs.block_n if bs.pingpong else 2 * bs.block_n
    per_stage = (bs.block_m * bs.block_k + bs.block_k * cta_n) * in_bytes
    out_slots = 2 * bs.block_m * _epilogue_strip(bs) * out_bytes
    stages = min(bs.stages, (_SMEM_BYTES - out_slots - extra_bytes) // per_stage)
    if stages < 2:
        return dataclasses.replace(bs, warp_specialized=False, pingpong=False)
    return dataclasses.replace(bs, stages=int(stages))


def _live_half(ni, wg, bs: MosaicGpuBlockSizes, n: int):
    """Whether consumer `wg`'s half of column tile `ni` (block_n columns from
    (2 ni + wg) block_n) holds any of the n output columns.

    Where n is an odd number of block_n columns (1408 = 11 x 128, 5504 = 43 x 128) the
    last block_m x 2 block_n tile reaches block_n columns past n: TMA fills those operand
    columns with zeros (and the interpreter with NaN), that half's products are never
    stored, and the rest of the tile runs as usual. This costs one half tile of tensor
    work per row tile (1408 columns run as 1536), where the one-warpgroup kernel that ran
    those widths before cost its whole epilogue on every tile. Measured on the H200
    (2026-12-01, docs/performance.md "odd counts of 128-column halves"), TFLOP/s against
    the one-warpgroup default in one process: w5504_up forward 542 / 492, fwd+bwd 576 /
    559; w5504_down fwd+bwd 594 / 553; w1408_up forward 0.421 / 0.446 ms."""
    return (2 * ni + wg) * bs.block_n < n


# The operands each epilogue of _gmm_kernel_warp_specialized adds: the row weights, and
# for the backward h.
EPILOGUE_OPERANDS = {None: 0, "scaled": 1, "scaled_grad": 2}


def epilogue_scratch_bytes(bs: MosaicGpuBlockSizes, epilogue: str | None, h_bytes: int = 2
                           ) -> int:
    """Shared memory _gmm_kernel_warp_specialized's epilogue adds: per consumer a block_m
    fp32 weights slot ("scaled"), and an h tile and a block_m fp32 share slot
    ("scaled_grad")."""
    if not epilogue:
        return 0
    grad = epilogue == "scaled_grad"
    return 2 * bs.block_m * 4 + (2 * bs.block_m * (bs.block_n * h_bytes + 4) if grad else 0)


def _gmm_kernel_warp_specialized(m, k, n, g, bs: MosaicGpuBlockSizes, transpose_rhs: bool,
                                 epilogue: str | None = None):
    """gmm with a TMA producer warpgroup and two wgmma consumer warpgroups per program.

    The same row-tile table and snake as _gmm_kernel; a program's tile is block_m x
    2*block_n, consumer w owning columns [w*block_n, (w+1)*block_n). Each consumer keeps its
    accumulator in registers, writes it to its own SMEM slot and issues its own ragged TMA
    row stores; it waits for its previous stores to leave SMEM only when it next needs the
    slot, so the stores overlap the next tile's main loop while the producer is already
    loading that tile's operands.

    epilogue (grouped_mlp's down product, expert_mlp.pallas_mosaic_gpu):
      "scaled": one more operand, fp32 weights [m] (the row weights), by which each row's
        fp32 sums are multiplied before the one rounding. Each consumer brings its tile's
        block_m weights into SMEM by TMA while its k loop runs.
      "scaled_grad": the down product's backward for h (t = dy W^T, this kernel with
        transpose_rhs): operands weights [m] and h [m, n]; the scaled sums are dh, and a
        second output [tiles, 2 * grid_n, block_m] fp32 takes each consumer's per-row
        sum over its columns of h * t (its share of d row_weights), a whole block_m slot
        per (row tile, column half), which _row_parts sums over the tiles' valid rows.
        The h tile comes in by TMA beside the weights.
    """
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    cta_n = 2 * bn
    grid_n = pl.cdiv(n, cta_n)
    rhs_block = (cta_n, bk) if transpose_rhs else (bk, cta_n)
    rhs_index = (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0))
    # A one-step pipeline with a delayed release breaks the stage barriers' phases (seen
    # in the interpreter), so a single k step always waits.
    delay = bs.delay_release if k // bk > 1 else 0

    def pipeline(mma, compute_context, steps=k // bk):
        return plgpu.emit_pipeline_warp_specialized(
            mma,
            grid=(steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), memory_space=plgpu.SMEM,
                                delay_release=delay),
                plgpu.BlockSpec(rhs_block, rhs_index, memory_space=plgpu.SMEM,
                                delay_release=delay),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=bs.stages,
            compute_context=compute_context,
        )

    grad = epilogue == "scaled_grad"
    operands = EPILOGUE_OPERANDS[epilogue]

    def body(table_gmem, count_gmem, lhs_gmem, rhs_gmem, *refs):
        extra_gmem, (out_gmem, *parts_gmem) = refs[:operands], refs[operands:]
        num_tiles = count_gmem[0]
        wg = lax.axis_index("wg")
        ignore = lambda *_, **__: None  # noqa: E731 - allocations do not depend on the body
        allocs = pipeline(ignore, ignore).get_allocations(
            lhs_gmem.at[pl.ds(0, bm)],
            rhs_gmem.at[0, pl.ds(0, cta_n)] if transpose_rhs else rhs_gmem.at[0, :, pl.ds(0, cta_n)],
        )
        scratch = dict(o_smem=plgpu.SMEM((2, bm, _epilogue_strip(bs)), out_gmem.dtype,
                                         transforms=_swizzle_transforms(out_gmem.dtype, rows=1)))
        if epilogue:
            scratch.update(w_smem=plgpu.SMEM((2, bm), jnp.float32),
                           w_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2))
        if grad:
            h_dtype = extra_gmem[1].dtype
            scratch.update(h_smem=plgpu.SMEM((2, bm, bn), h_dtype,
                                             transforms=_swizzle_transforms(h_dtype)),
                           h_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2),
                           p_smem=plgpu.SMEM((2, bm), jnp.float32))

        @functools.partial(pl.run_scoped, allocations=allocs, collective_axes="wg", **scratch)
        def _(allocations, o_smem, w_smem=None, w_ready=None, h_smem=None, h_ready=None,
              p_smem=None):
            @plgpu.nd_loop((num_tiles * grid_n,), collective_axes="sm")
            def _(info):
                mi, ni, seg, load0, row0, rows, live = _row_tile(table_gmem, info.index[0],
                                                                 num_tiles, grid_n, bs, g)
                cols = pl.ds(wg * bn, bn)

                def mma(_, a_smem, b_smem, acc_ref):
                    b = b_smem.at[cols].transpose((1, 0)) if transpose_rhs else b_smem.at[:, cols]

                    @pl.when(live)
                    def _():
                        plgpu.wgmma(acc_ref, a_smem, b)
                        plgpu.wgmma_wait(delay)

                    return acc_ref

                def compute_context(run_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
                    def _(acc_ref):
                        col0 = ni * cta_n + wg * bn
                        if epilogue:  # the tile's row weights (and h) arrive during the k loop
                            plgpu.copy_gmem_to_smem(extra_gmem[0].at[pl.ds(load0, bm)],
                                                    w_smem.at[wg], w_ready.at[wg])
                        if grad:
                            plgpu.copy_gmem_to_smem(
                                extra_gmem[1].at[pl.ds(load0, bm), pl.ds(col0, bn)],
                                h_smem.at[wg], h_ready.at[wg])
                        run_pipeline(acc_ref)
                        acc = acc_ref[...]
                        if grad:  # this consumer's share of d row_weights: sum of h * t
                            plgpu.barrier_wait(h_ready.at[wg])
                            part = jnp.sum(h_smem.at[wg][...].astype(jnp.float32) * acc, axis=1)
                        if epilogue:
                            plgpu.barrier_wait(w_ready.at[wg])
                            weights = plgpu.load(w_smem.at[wg],
                                                 layout=plgpu.Layout.WGMMA.reduce(1))
                            acc = acc * lax.broadcast_in_dim(weights, acc.shape, [0])
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # slots free again

                        @pl.when(_live_half(ni, wg, bs, n))
                        def _():
                            _store_rows_from(acc, o_smem.at[wg], out_gmem, row0, rows,
                                             row0 - load0, col0, bm)
                            if grad:
                                p_smem.at[wg][...] = part
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(p_smem.at[wg],
                                                        parts_gmem[0].at[mi, ni * 2 + wg])

                weights = rhs_gmem.at[jnp.minimum(seg, g - 1)]
                weights = (weights.at[pl.ds(ni * cta_n, cta_n)] if transpose_rhs
                           else weights.at[:, pl.ds(ni * cta_n, cta_n)])
                pipeline(mma, compute_context, _k_steps(live, k // bk, delay))(
                    lhs_gmem.at[pl.ds(load0, bm)], weights, allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def _ring_barriers(stages: int) -> dict:
    """The ping-pong kernels' ring barriers: full[c * stages + s] (the two TMA copies of a
    step in slot s for consumer c) and empty[s] (its consumer has read slot s)."""
    return dict(full=plgpu.Barrier(num_arrivals=2, num_barriers=2 * stages),
                empty=plgpu.Barrier(num_arrivals=1, num_barriers=stages))


def _ring_produce(q, steps, j, stages: int, full, empty, load_step):
    """Producer side of the ping-pong ring: a tile's `steps` steps into the slots from
    the program's step q on, each once its slot's previous reader released it;
    load_step(kk, slot, barrier) issues step kk's two copies. Returns the next q."""
    first = lax.rem(j, 2) * stages  # consumer j % 2's full barriers

    @pl.loop(0, steps)
    def _(kk):
        slot = lax.rem(q + kk, stages)

        @pl.when(q + kk >= stages)
        def _():
            plgpu.barrier_wait(empty.at[slot])

        load_step(kk, slot, full.at[first + slot])

    return q + steps


def _ring_drain(issued, stages: int, empty):
    """The producer observes the last releases, so no barrier is left mid-phase."""

    @pl.loop(jnp.maximum(issued - stages, 0), issued)
    def _(q):
        plgpu.barrier_wait(empty.at[lax.rem(q, stages)])


def _ring_consume(q, steps, wg, stages: int, full, empty, mma_step):
    """Consumer side: for each of a tile's steps, wait for its copies, mma_step(kk, slot)
    (issues its wgmma), keep one wgmma group in flight and release the previous step's
    slot (one step late); then retire the last group and release its slot."""

    @pl.loop(0, steps)
    def _(kk):
        slot = lax.rem(q + kk, stages)
        plgpu.barrier_wait(full.at[wg * stages + slot])
        mma_step(kk, slot)
        plgpu.wgmma_wait(1)

        @pl.when(kk > 0)
        def _():
            plgpu.barrier_arrive(empty.at[lax.rem(q + kk - 1, stages)])

    plgpu.wgmma_wait(0)

    @pl.when(steps > 0)
    def _():
        plgpu.barrier_arrive(empty.at[lax.rem(q + steps - 1, stages)])


def _gmm_kernel_pingpong(m, k, n, g, bs: MosaicGpuBlockSizes, transpose_rhs: bool,
                         num_programs: int):
    """gmm with a TMA producer warpgroup and two consumer warpgroups on alternate tiles.

    The row-tile table and snake are _gmm_kernel's (tiles block_m x block_n). Program p
    takes the linear tiles p, p + P, p + 2P, ...; its j-th tile belongs to consumer j % 2.
    The producer walks those tiles in order and streams each tile's k steps through one
    ring of `stages` (lhs, rhs) buffers, slot q % stages for the program's q-th step, never
    waiting for a tile to drain: it waits only for the consumer of step q - stages to
    release that slot. So consumer 1's first steps arrive while consumer 0 finishes its
    last ones, and each consumer's epilogue (registers -> SMEM -> TMA row stores) runs
    while the other's wgmmas keep the tensor cores busy.

    Barriers: full[c * stages + s] (the two TMA copies of a step in slot s for consumer c)
    and empty[s] (its consumer has read slot s). Each consumer waits only on its own full
    barriers and in order, and the producer waits on every phase of every empty barrier,
    so the per-thread phase bits stay in step. A consumer releases a slot one step late
    (after the next wgmma is issued and the previous one retired). Rows of no group are
    zero tiles with no loads and no matmul: their consumer stores its zero accumulator.
    """
    bm, bn, bk, stages = bs.block_m, bs.block_n, bs.block_k, bs.stages
    grid_n = n // bn
    k_steps = k // bk

    def body(table_gmem, count_gmem, lhs_gmem, rhs_gmem, out_gmem):
        transforms = _swizzle_transforms(lhs_gmem.dtype)
        num_tiles = count_gmem[0]
        program = lax.axis_index("sm")
        mine = jnp.maximum(num_tiles * grid_n - program + num_programs - 1, 0) // num_programs
        wg = lax.axis_index("wg")

        def tile(j):
            mi, ni = plgpu.planar_snake(program + j * num_programs, (num_tiles, grid_n), 1,
                                        bs.grid_block_n)
            seg = table_gmem[0, mi]
            live = seg < g  # else rows of no group: no steps, the accumulator stays zero
            return mi, ni, seg, jnp.where(live, k_steps, 0)

        rhs_block = (bn, bk) if transpose_rhs else (bk, bn)

        @functools.partial(
            pl.run_scoped,
            lhs_smem=plgpu.SMEM((stages, bm, bk), lhs_gmem.dtype, transforms=transforms),
            rhs_smem=plgpu.SMEM((stages, *rhs_block), rhs_gmem.dtype, transforms=transforms),
            o_smem=plgpu.SMEM((2, bm, _epilogue_strip(bs)), out_gmem.dtype,
                              transforms=_swizzle_transforms(out_gmem.dtype, rows=1)),
            **_ring_barriers(stages),
            collective_axes="wg",
        )
        def _(lhs_smem, rhs_smem, o_smem, full, empty):
            @pl.when(wg == 2)
            def _producer():
                plgpu.set_max_registers(40, action="decrease")

                def load_tile(j, q):
                    mi, ni, seg, steps = tile(j)
                    load0 = pl.multiple_of(table_gmem[1, mi], 8)
                    weights = rhs_gmem.at[jnp.minimum(seg, g - 1)]

                    def load_step(kk, slot, barrier):
                        cols = pl.ds(pl.multiple_of(kk * bk, bk), bk)
                        plgpu.copy_gmem_to_smem(lhs_gmem.at[pl.ds(load0, bm), cols],
                                                lhs_smem.at[slot], barrier)
                        block = (weights.at[pl.ds(ni * bn, bn), cols] if transpose_rhs
                                 else weights.at[cols, pl.ds(ni * bn, bn)])
                        plgpu.copy_gmem_to_smem(block, rhs_smem.at[slot], barrier)

                    return _ring_produce(q, steps, j, stages, full, empty, load_step)

                _ring_drain(lax.fori_loop(0, mine, load_tile, jnp.int32(0)), stages, empty)

            @pl.when(wg < 2)
            def _consumer():
                plgpu.set_max_registers(232, action="increase")

                def run_tile(j, q):
                    mi, ni, seg, steps = tile(j)

                    @pl.when(lax.rem(j, 2) == wg)
                    def _():
                        def acc_scope(acc_ref):
                            def mma_step(kk, slot):
                                b = rhs_smem.at[slot]
                                plgpu.wgmma(acc_ref, lhs_smem.at[slot],
                                            b.transpose((1, 0)) if transpose_rhs else b)

                            _ring_consume(q, steps, wg, stages, full, empty, mma_step)
                            return acc_ref[...]

                        acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32))
                        load0 = table_gmem[1, mi]
                        row0 = table_gmem[2, mi]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # slot free again
                        _store_rows_from(acc, o_smem.at[wg], out_gmem, row0, table_gmem[3, mi],
                                         row0 - load0, ni * bn, bm)

                    return q + steps

                lax.fori_loop(0, mine, run_tile, jnp.int32(0))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def _gmm_local(lhs, rhs, group_sizes, row_start, *, transpose_rhs, out_dtype, bs, interpret,
               row_weights=None, grad_of=None):
    """gmm on one device's operands (already padded to the block multiples). With
    row_weights (fp32 [m]; the cooperative warp-specialised kernel only) each row's sums
    are scaled by its weight before the rounding; with grad_of (h [m, n] as well) it is
    the down product's backward for h, returning (dh, d row_weights [m] fp32)
    (_gmm_kernel_warp_specialized's epilogues)."""
    m, k = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    table, count = _row_tile_table(group_sizes, m, bs.block_m, row_start)
    out_type = sharding.out_struct((m, n), out_dtype, like=lhs)
    epilogue = (None if row_weights is None
                else "scaled" if grad_of is None else "scaled_grad")
    extra = tuple(a for a in (row_weights, grad_of) if a is not None)
    out_types = (out_type,)
    if grad_of is not None:  # each (row tile, column half)'s share of d row_weights
        out_types += (sharding.out_struct((table.shape[1], 2 * pl.cdiv(n, 2 * bs.block_n),
                                           bs.block_m), jnp.float32, like=lhs),)
    cost = costs.gmm(m, k, n, lhs.dtype, transpose_rhs=transpose_rhs,
                     inputs=(table, count, lhs, rhs, *extra), outputs=out_types)
    if epilogue:
        if bs.pingpong or not bs.warp_specialized:
            raise ValueError(f"row weights run on the cooperative warp-specialised kernel; "
                             f"got {bs}")
        body = _gmm_kernel_warp_specialized(m, k, n, g, bs, transpose_rhs, epilogue)
    elif bs.pingpong:
        body = _gmm_kernel_pingpong(m, k, n, g, bs, transpose_rhs, _num_programs(interpret))
    elif bs.warp_specialized:
        body = _gmm_kernel_warp_specialized(m, k, n, g, bs, transpose_rhs)
    else:
        body = _gmm_kernel(m, k, n, g, bs, transpose_rhs)
    name = {None: "grouped_projection_gmm_mosaic_gpu", "scaled": "grouped_mlp_down_mosaic_gpu",
            "scaled_grad": "grouped_mlp_down_grad_mosaic_gpu"}[epilogue]
    call = pl.kernel(
        body,
        out_type=out_types if grad_of is not None else out_type,
        mesh=_mesh(bs, interpret),
        compiler_params=_compiler_params(),
        interpret=_interpret_params(interpret),
        cost_estimate=cost,
        name=name,
    )
    out = call(table, count, lhs, rhs, *extra)
    if grad_of is None:
        return out
    dh, parts = out
    return dh, _row_parts(parts, table, count, pl.cdiv(n, bs.block_n), m)


def tile_rows(table, count, block_m: int) -> tuple[jax.Array, jax.Array]:
    """(row [T, block_m], valid [T, block_m]): the row each slot of a row tile's
    block_m-row window stands for (the table's load row on), and whether the tile holds
    it as one of its valid rows (the table's first row and row count; tiles past `count`
    hold none). Each row of [0, m) is valid in exactly one tile (_row_tile_table)."""
    load, first, rows = table[1], table[2], table[3]
    row = load[:, None] + jnp.arange(block_m, dtype=jnp.int32)[None, :]
    valid = ((row >= first[:, None]) & (row < (first + rows)[:, None])
             & (jnp.arange(table.shape[1])[:, None] < count[0]))
    return row, valid


def _row_parts(parts, table, count, halves: int, m: int):
    """[m] fp32: each row's sum of the "scaled_grad" epilogue's per-(tile, column half)
    slots, over the tiles that hold it as a valid row (tile_rows) and the column halves
    that lie inside n. Slots of tiles past `count`, of rows outside a tile's valid rows
    and of halves past n were never written, and are selected away, not multiplied."""
    row, valid = tile_rows(table, count, parts.shape[2])
    per_row = jnp.sum(parts[:, :halves], axis=1)
    per_row = jnp.where(valid, per_row, 0.0)
    return jnp.zeros((m,), jnp.float32).at[jnp.where(valid, row, m)].add(per_row, mode="drop")


def _check_gmm(lhs, rhs, group_sizes, transpose_rhs, group_offset):
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [m, k], got shape {lhs.shape}")
    if rhs.ndim != 3:
        raise ValueError(f"rhs must be [g, k, n] (or [g, n, k] transposed), got shape {rhs.shape}")
    rk = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if rk != lhs.shape[1]:
        raise ValueError(
            f"k mismatch: lhs {lhs.shape} vs rhs {rhs.shape} (transpose_rhs={transpose_rhs})"
        )
    _check_group_sizes(group_sizes, rhs.shape[0], group_offset)
    _check_operand_dtypes(lhs, rhs)


def _check_operand_dtypes(lhs, rhs):
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"lhs and rhs must share the compute dtype, got {lhs.dtype} and {rhs.dtype}")
    if jnp.dtype(lhs.dtype).itemsize != 2:
        raise TypeError(f"Mosaic GPU kernels take 16-bit operands (bf16/fp16), got {lhs.dtype}")


def _check_group_sizes(group_sizes, g, group_offset=None):
    """[g] int32, or [G >= g] with a group_offset (local experts)."""
    local = group_offset is not None
    count = group_sizes.shape[0] if group_sizes.ndim == 1 else -1
    if count < g or (count != g and not local):
        want = f"G >= {g}" if local else str(g)
        raise ValueError(f"group_sizes must be [{want}], got shape {group_sizes.shape}")
    if group_sizes.dtype != jnp.int32:
        raise TypeError(f"group_sizes must be int32, got {group_sizes.dtype}")


@sharding.local_operands("grouped_projection")
def gmm(
    lhs: Shaped[Array, "m k"],
    rhs: Shaped[Array, "g kn nk"],
    group_sizes: Int[Array, " G"],
    *,
    group_offset=None,
    transpose_rhs: bool = False,
    out_dtype: Any = None,
    block_sizes: MosaicGpuBlockSizes | None = None,
    interpret: bool = False,
) -> Shaped[Array, "m n"]:
    """Grouped matmul: out[rows of group i] = lhs[rows of group i] @ rhs[i] (or rhs[i]^T).
    rhs holds groups [group_offset, group_offset + g) of group_sizes (all when None)."""
    _check_gmm(lhs, rhs, group_sizes, transpose_rhs, group_offset)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    m, k = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    product = "dx" if transpose_rhs else "forward"
    # Tuning keys, fit rules and defaults take the projection's dims: dx contracts its n
    # (here k) and writes its k (here n).
    k_proj, n_proj = (n, k) if transpose_rhs else (k, n)
    bs = resolve_block_sizes(block_sizes, product=product, m=m, k=k_proj, n=n_proj,
                             g=group_sizes.shape[0], dtype=lhs.dtype, interpret=interpret)
    bs = _fit_block_n(bs, n)
    if bs.warp_specialized:
        bs = _fit_warp_specialized(bs, n, jnp.dtype(lhs.dtype).itemsize, out_dtype.itemsize)
    if m == 0 or n == 0 or g == 0:
        return jnp.zeros((m, n), out_dtype)
    # Pad only where a dimension is not a block multiple (none of the TARGETS shapes).
    lhs_p = _pad_axis(_pad_axis(lhs, 1, bs.block_k), 0, 8, bs.block_m)
    rhs_p = _pad_axis(rhs, 2 if transpose_rhs else 1, bs.block_k)
    rhs_p = _pad_axis(rhs_p, 1 if transpose_rhs else 2, bs.block_n)

    sizes, row_start = local_groups(group_sizes, group_offset, g)
    return _gmm_local(lhs_p, rhs_p, sizes, row_start, transpose_rhs=transpose_rhs,
                      out_dtype=out_dtype, bs=bs, interpret=interpret)[:m, :n]


# --------------------------------------------------------------------------- tgmm


# Rows per boundary-mask chunk (_mask_outside_group): 16 rows of a 128-column operand
# block are one (16, 128) piece the copy layout moves in 16-byte vectors; 64-column blocks
# need 32-row pieces (the layout spreads 4 tiles of (8, 64) over a warpgroup's warps).
_MASK_CHUNK_ROWS = 16


def _mask_rows(ref, lo, hi):
    """Zero the rows outside [lo, hi) of an SMEM tile in place (a select: NaN-safe).

    The rows move through registers in the shared-memory copy layout (16-byte vectors,
    conflict-free over the 128-byte swizzle), not the wgmma accumulator layout."""
    layout = plgpu.Layout.SMEM_GMEM_COPY(ref.shape, ref.dtype, 128)
    rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, ref.shape, 0), layout)
    x = ref[...]
    ref[...] = jnp.where((rows >= lo) & (rows < hi), x, jnp.zeros_like(x))


def _mask_chunk_rows(cols: int) -> int:
    """Rows per masked piece of a block `cols` wide (_MASK_CHUNK_ROWS above)."""
    return _MASK_CHUNK_ROWS if cols % 128 == 0 else max(_MASK_CHUNK_ROWS, 32)


def _tgmm_tile(info, starts_gmem, sizes_gmem, grid_m, grid_n, bs: MosaicGpuBlockSizes):
    """An nd_loop step's (group, k tile, n tile) and its group's row window: first row,
    size, base (the first row rounded down to 8: TMA row boxes start on 8-row boundaries)
    and the number of block_k row steps from base."""
    gi = info.index[0]
    mi, ni = plgpu.planar_snake(info.index[1], (grid_m, grid_n), 1, bs.grid_block_n)
    start = starts_gmem[gi]
    size = sizes_gmem[gi]
    base = start // 8 * 8
    steps = (start + size - base + bs.block_k - 1) // bs.block_k
    return gi, mi, ni, start, size, base, steps


def _mask_outside_group(step, start, size, base, bk, lhs_smem, rhs_smem):
    """Zero the rows of this contraction step that are not the group's, in both operand
    blocks. Rows [lo, hi) of the step belong to the group; only the first step (fewer
    than 8 leading rows: the window starts at the group's first row rounded down to 8)
    and the last (rows past the group's end, or TMA's zero fill) can hold others. Only
    the row chunks that hold such rows are rewritten: masking whole 64-row blocks in the
    accumulator layout cost 12% of dsv3's dkernel (docs/performance.md, "dkernel: a
    fourth stage"); see "boundary masks by chunk" there for this form's figures."""
    lo = start - base - step * bk
    hi = start + size - base - step * bk
    refs = (lhs_smem, rhs_smem)
    chunk = min(bk, max(_mask_chunk_rows(ref.shape[1]) for ref in refs))
    for c0 in range(0, bk, chunk):

        @pl.when((lo > c0) | (hi < c0 + chunk))
        def _(c0=c0):
            for ref in refs:
                _mask_rows(ref.at[pl.ds(c0, chunk)], lo - c0, hi - c0)
            plgpu.commit_smem()


def _tgmm_kernel(m, k, n, g, bs: MosaicGpuBlockSizes, dtype):
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    grid_m, grid_n = k // bm, n // bn
    delay = 1 if bs.stages > 1 else 0
    transforms = _swizzle_transforms(dtype)

    def body(starts_gmem, sizes_gmem, lhs_gmem, rhs_gmem, out_gmem):
        @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
        def _(info):
            gi, mi, ni, start, size, base, steps = _tgmm_tile(
                info, starts_gmem, sizes_gmem, grid_m, grid_n, bs)

            def acc_scope(acc_ref):
                def step(idx, lhs_smem, rhs_smem):
                    _mask_outside_group(idx[0], start, size, base, bk, lhs_smem, rhs_smem)
                    plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), rhs_smem)
                    if not delay:
                        plgpu.wgmma_wait(0)

                def row_block(r):
                    return pl.multiple_of(base + r * bk, 8)

                # An empty group runs one fully masked step (zeros) rather than skipping
                # its pipeline: every tile takes the same path (see the gmm note).
                plgpu.emit_pipeline(
                    step,
                    grid=(jnp.maximum(steps, 1),),
                    in_specs=[
                        plgpu.BlockSpec(
                            (pl.Element(bk), bm),
                            lambda r: (row_block(r), mi),
                            delay_release=delay,
                            transforms=transforms,
                        ),
                        plgpu.BlockSpec(
                            (pl.Element(bk), bn),
                            lambda r: (row_block(r), ni),
                            delay_release=delay,
                            transforms=transforms,
                        ),
                    ],
                    max_concurrent_steps=bs.stages,
                )(lhs_gmem, rhs_gmem)

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

            @functools.partial(
                pl.run_scoped,
                o_smem=plgpu.SMEM(
                    (bm, bn), dtype=out_gmem.dtype, transforms=_swizzle_transforms(out_gmem.dtype)
                ),
            )
            def _(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem, out_gmem.at[gi, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)]
                )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def _tgmm_kernel_warp_specialized(m, k, n, g, bs: MosaicGpuBlockSizes, dtype):
    """tgmm with a TMA producer warpgroup and two wgmma consumer warpgroups per program.

    The same (group, k tile, n tile) loop as _tgmm_kernel, each program owning a block_m x
    2*block_n output tile, consumer w the columns [w*block_n, (w+1)*block_n). The producer
    runs ahead into the next tile's rows while the consumers finish and store this one,
    which matters where groups are short (dsv3: ~256 rows, 4 steps per tile). Boundary
    steps are masked in SMEM: each consumer zeroes the out-of-group rows of the shared lhs
    block (both write the same values) and of its own rhs columns.
    """
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    cta_n = 2 * bn
    grid_m, grid_n = k // bm, pl.cdiv(n, cta_n)
    transforms = _swizzle_transforms(dtype)
    delay = bs.delay_release

    def pipeline(step, compute_context, base, steps):
        def row_block(r):
            return pl.multiple_of(base + r * bk, 8)

        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((pl.Element(bk), bm), lambda r: (row_block(r), 0),
                                transforms=transforms, memory_space=plgpu.SMEM,
                                delay_release=delay),
                plgpu.BlockSpec((pl.Element(bk), cta_n), lambda r: (row_block(r), 0),
                                transforms=transforms, memory_space=plgpu.SMEM,
                                delay_release=delay),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=bs.stages,
            compute_context=compute_context,
        )

    def body(starts_gmem, sizes_gmem, lhs_gmem, rhs_gmem, out_gmem):
        wg = lax.axis_index("wg")
        ignore = lambda *_, **__: None  # noqa: E731 - allocations do not depend on the body
        allocs = pipeline(ignore, ignore, 0, bs.stages).get_allocations(
            lhs_gmem.at[:, pl.ds(0, bm)], rhs_gmem.at[:, pl.ds(0, cta_n)])
        strip = _epilogue_strip(bs)
        o_type = plgpu.SMEM((2, bm, strip), out_gmem.dtype,
                            transforms=_swizzle_transforms(out_gmem.dtype))

        @functools.partial(pl.run_scoped, allocations=allocs, o_smem=o_type,
                           collective_axes="wg")
        def _(allocations, o_smem):
            @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
            def _(info):
                gi, mi, ni, start, size, base, steps = _tgmm_tile(
                    info, starts_gmem, sizes_gmem, grid_m, grid_n, bs)
                cols = pl.ds(wg * bn, bn)

                def step(idx, lhs_smem, rhs_smem, acc_ref):
                    rhs_cols = rhs_smem.at[:, cols]
                    _mask_outside_group(idx[0], start, size, base, bk, lhs_smem, rhs_cols)
                    plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), rhs_cols)
                    plgpu.wgmma_wait(delay)
                    return acc_ref

                def compute_context(run_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
                    def _(acc_ref):
                        run_pipeline(acc_ref)
                        acc = acc_ref[...]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # slot free again

                        @pl.when(_live_half(ni, wg, bs, n))
                        def _():
                            out = acc.astype(o_smem.dtype)
                            for j in range(bn // strip):
                                _fill_slot(out, o_smem.at[wg], j)
                                plgpu.copy_smem_to_gmem(
                                    o_smem.at[wg],
                                    out_gmem.at[gi, pl.ds(mi * bm, bm),
                                                pl.ds(ni * cta_n + wg * bn + j * strip, strip)])

                # An empty group runs one fully masked step (zeros), as in _tgmm_kernel;
                # with a delayed release every tile runs at least two (a one-step pipeline
                # with a release in flight breaks the stage barriers' phases), the second
                # of a one-step group fully masked.
                pipeline(step, compute_context, base, jnp.maximum(steps, 1 + delay))(
                    lhs_gmem.at[:, pl.ds(mi * bm, bm)], rhs_gmem.at[:, pl.ds(ni * cta_n, cta_n)],
                    allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def _tgmm_kernel_pingpong(m, k, n, g, bs: MosaicGpuBlockSizes, num_programs: int):
    """tgmm with a TMA producer warpgroup and two consumer warpgroups on alternate tiles.

    The (group, k tile, n tile) walk of _tgmm_kernel, tiles block_m x block_n. Program p
    takes the linear tiles p, p + P, p + 2P, ...; its j-th tile belongs to consumer j % 2.
    As in _gmm_kernel_pingpong, the producer streams each tile's row steps through one ring
    of `stages` (lhs, rhs) buffers without draining it between tiles, so one consumer's
    epilogue (a block_m x block_n store) runs while the other's wgmmas keep the tensor
    cores busy. Where groups are short (512 rows: 8 steps a tile) that epilogue is a large
    share of a tile, and the cooperative kernel, whose consumers store together, leaves
    the tensor cores idle for it. A consumer masks its own steps' boundary rows in SMEM
    (_mask_outside_group); an empty group's tile has no steps and stores zeros.
    The ring's barriers and protocol are _gmm_kernel_pingpong's (_ring_produce,
    _ring_consume).
    """
    bm, bn, bk, stages = bs.block_m, bs.block_n, bs.block_k, bs.stages
    grid_m, grid_n = k // bm, n // bn
    per_group = grid_m * grid_n
    strip = _epilogue_strip(bs)

    def body(starts_gmem, sizes_gmem, lhs_gmem, rhs_gmem, out_gmem):
        transforms = _swizzle_transforms(lhs_gmem.dtype)
        program = lax.axis_index("sm")
        mine = jnp.maximum(g * per_group - program + num_programs - 1, 0) // num_programs
        wg = lax.axis_index("wg")

        def tile(j):
            t = program + j * num_programs
            gi = t // per_group
            mi, ni = plgpu.planar_snake(lax.rem(t, per_group), (grid_m, grid_n), 1,
                                        bs.grid_block_n)
            start = starts_gmem[gi]
            size = sizes_gmem[gi]
            base = start // 8 * 8
            steps = jnp.where(size > 0, (start + size - base + bk - 1) // bk, 0)
            return gi, mi, ni, start, size, base, steps

        @functools.partial(
            pl.run_scoped,
            lhs_smem=plgpu.SMEM((stages, bk, bm), lhs_gmem.dtype, transforms=transforms),
            rhs_smem=plgpu.SMEM((stages, bk, bn), rhs_gmem.dtype, transforms=transforms),
            o_smem=plgpu.SMEM((2, bm, strip), out_gmem.dtype,
                              transforms=_swizzle_transforms(out_gmem.dtype)),
            **_ring_barriers(stages),
            collective_axes="wg",
        )
        def _(lhs_smem, rhs_smem, o_smem, full, empty):
            @pl.when(wg == 2)
            def _producer():
                plgpu.set_max_registers(40, action="decrease")

                def load_tile(j, q):
                    _, mi, ni, _, _, base, steps = tile(j)

                    def load_step(kk, slot, barrier):
                        rows = pl.ds(pl.multiple_of(base + kk * bk, 8), bk)
                        plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, pl.ds(mi * bm, bm)],
                                                lhs_smem.at[slot], barrier)
                        plgpu.copy_gmem_to_smem(rhs_gmem.at[rows, pl.ds(ni * bn, bn)],
                                                rhs_smem.at[slot], barrier)

                    return _ring_produce(q, steps, j, stages, full, empty, load_step)

                _ring_drain(lax.fori_loop(0, mine, load_tile, jnp.int32(0)), stages, empty)

            @pl.when(wg < 2)
            def _consumer():
                plgpu.set_max_registers(232, action="increase")

                def run_tile(j, q):
                    gi, mi, ni, start, size, base, steps = tile(j)

                    @pl.when(lax.rem(j, 2) == wg)
                    def _():
                        def acc_scope(acc_ref):
                            def mma_step(kk, slot):
                                a, b = lhs_smem.at[slot], rhs_smem.at[slot]
                                _mask_outside_group(kk, start, size, base, bk, a, b)
                                plgpu.wgmma(acc_ref, a.transpose((1, 0)), b)

                            _ring_consume(q, steps, wg, stages, full, empty, mma_step)
                            return acc_ref[...]

                        acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32))
                        out = acc.astype(o_smem.dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # slot free again
                        for s in range(bn // strip):
                            _fill_slot(out, o_smem.at[wg], s)
                            plgpu.copy_smem_to_gmem(
                                o_smem.at[wg],
                                out_gmem.at[gi, pl.ds(mi * bm, bm),
                                            pl.ds(ni * bn + s * strip, strip)])

                    return q + steps

                lax.fori_loop(0, mine, run_tile, jnp.int32(0))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def _tgmm_local(lhs, rhs, group_sizes, row_start, *, out_dtype, bs, interpret):
    m, k = lhs.shape
    n = rhs.shape[1]
    g = group_sizes.shape[0]
    starts, sizes = _group_bounds(group_sizes, m, row_start)
    out_type = sharding.out_struct((g, k, n), out_dtype, like=lhs)
    cost = costs.tgmm(m, k, n, lhs.dtype, inputs=(starts, sizes, lhs, rhs),
                      outputs=(out_type,))
    if bs.pingpong:
        body = _tgmm_kernel_pingpong(m, k, n, g, bs, _num_programs(interpret))
    elif bs.warp_specialized:
        body = _tgmm_kernel_warp_specialized(m, k, n, g, bs, lhs.dtype)
    else:
        body = _tgmm_kernel(m, k, n, g, bs, lhs.dtype)
    call = pl.kernel(
        body,
        out_type=out_type,
        mesh=_mesh(bs, interpret),
        compiler_params=_compiler_params(),
        interpret=_interpret_params(interpret),
        cost_estimate=cost,
        name="grouped_projection_tgmm_mosaic_gpu",
    )
    return call(starts, sizes, lhs, rhs)


@sharding.local_operands("grouped_projection")
def tgmm(
    lhs: Shaped[Array, "m k"],
    rhs: Shaped[Array, "m n"],
    group_sizes: Int[Array, " G"],
    *,
    num_groups: int | None = None,
    group_offset=None,
    out_dtype: Any = None,
    block_sizes: MosaicGpuBlockSizes | None = None,
    interpret: bool = False,
) -> Shaped[Array, "g k n"]:
    """Ragged contraction: out[i] = lhs[rows of group i]^T @ rhs[rows of group i], for the
    num_groups groups [group_offset, group_offset + num_groups) (all when None)."""
    if lhs.ndim != 2 or rhs.ndim != 2 or lhs.shape[0] != rhs.shape[0]:
        raise ValueError(f"lhs [m, k] and rhs [m, n] must share m, got {lhs.shape} and {rhs.shape}")
    g = group_sizes.shape[0] if num_groups is None else num_groups
    _check_group_sizes(group_sizes, g, group_offset)
    _check_operand_dtypes(lhs, rhs)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    m, k = lhs.shape
    n = rhs.shape[1]
    bs = resolve_block_sizes(block_sizes, product="dkernel", m=m, k=k, n=n,
                             g=group_sizes.shape[0], dtype=lhs.dtype, interpret=interpret)
    bs = dataclasses.replace(bs, block_m=_fit_block(k, bs.block_m))
    bs = _fit_block_n(bs, n)
    if bs.warp_specialized:
        bs = _fit_warp_specialized(bs, n, jnp.dtype(lhs.dtype).itemsize, out_dtype.itemsize)
    if g == 0 or k == 0 or n == 0:
        return jnp.zeros((g, k, n), out_dtype)
    # Rows are padded to a block_k multiple (and at least one block) so every contraction
    # window lies in a block-aligned array; the pad rows belong to no group.
    lhs_p = _pad_axis(_pad_axis(lhs, 0, bs.block_k, bs.block_k), 1, bs.block_m)
    rhs_p = _pad_axis(_pad_axis(rhs, 0, bs.block_k, bs.block_k), 1, bs.block_n)

    sizes, row_start = local_groups(group_sizes, group_offset, g)
    return _tgmm_local(lhs_p, rhs_p, sizes, row_start, out_dtype=out_dtype, bs=bs,
                       interpret=interpret)[:, :k, :n]
