"""fp8 grouped products on Hopper (sm90) through Pallas Mosaic GPU: e4m3 wgmma with
DeepSeek-V3's block scales, each 128-deep step promoted to an fp32 accumulator.

Backend contract. `gmm` and `tgmm` take the same arguments as every grouped backend's
(pallas_mosaic_gpu.py: floating lhs/rhs, group_sizes, group_offset, transpose_rhs,
out_dtype, block_sizes, interpret) and quantize their operands first, in the layouts the
tensor cores read (pallasite.kernels.quantization): the sharding planners and the
custom_vjp of ops.py use them unchanged (recipe="fp8"). `gmm_quantized` and
`tgmm_quantized` take operands already quantized.

Layouts. fp8 wgmma reads both operands K-major (the contraction contiguous), so every
product here is `A [M, K] @ B[N, K]^T`, 128 deep per step:
  forward  A = Q(x) [m, k] (1 x 128 blocks), B = Q(kernel) [g, n, k] (128 x 128 blocks,
           written transposed by the quantizer);
  dx       A = Q(dy) [m, n], B = Q(kernel) [g, k, n] (as stored);
  dkernel  A = Qt(x) [k, tokens], B = Qt(dy) [n, tokens]: token blocks of 128 rows that
           never straddle groups (grouped_matmul/token_blocks.py), stored transposed, so
           each group's rows are whole 128-token steps.
Scales: A's are one per row per step (read as a [128] vector per step from a transposed
[K/128, M] array); B's one per step for the whole 128-column tile (gmm: the 128 x 128
weight block) or one per column (tgmm: the token blocks).

Kernel. A persistent grid (one program per SM) walks (row tile, column tile) pairs in a
planar snake; a producer warpgroup streams A, A's scales and B through `stages` TMA
buffers; two consumer warpgroups each own 64 rows of the 128 x 128 tile. Per step a
consumer runs its wgmmas into a fresh accumulator, waits for them, and adds them, times
(row scale x column scale), into its fp32 total: Hopper's fp8 wgmma keeps fewer bits in
its own sums than fp32, so partial sums never run past one 128-deep step (DeepSeek's
promotion). The other consumer's wgmmas keep the tensor cores busy meanwhile. A 64 x 128
consumer tile holds 64 + 64 accumulator registers per thread; a 128 x 128 tile (or 64 x
256) would hold 256 with the fresh accumulator, more than a thread has. gmm's row tiles
come from the bf16 kernel's table (no tile straddles two groups; rows of no group are
zero tiles with no matmul) and its ragged row stores; tgmm's tiles are (group, k tile,
n tile), each over its group's token blocks.

Measured on one H200 (2026-12-02, a dense probe of this kernel form, queued timing):
8192^3 with 128 x 128 tiles and 4 stages 1170 TFLOP/s, 128 x 256 tiles (two promotion
chunks) 1000-1020; at mixtral's dims (32768 x 14336 x 4096) 1101 against 929-957.
On 2026-12-04 this kernel at mixtral's dims as one group ran 880-909 against 863-894 with
mixtral's 8 experts; two steps per stage lost 7-11% and clusters of two were level
(docs/performance.md, "fp8 forward: two steps per stage..."), so both are off by default.
docs/fp8.md has the grouped figures.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int, Shaped

from pallasite.kernels import platform, sharding
from pallasite.kernels.grouped_matmul import costs, pallas_mosaic_gpu as bf16
from pallasite.kernels.grouped_matmul import tuning_benchmarks
from pallasite.kernels.grouped_matmul.group_metadata import local_groups
from pallasite.kernels.grouped_matmul.token_blocks import group_table, token_blocks
from pallasite.kernels.quantization import api as quantization
from pallasite.reference.quantization import TOKEN_BLOCK

FP8 = jnp.float8_e4m3fn
BLOCK = TOKEN_BLOCK  # rows per tile (two consumers x 64), columns per tile, k per step
_CONSUMER_ROWS = BLOCK // 2


@dataclasses.dataclass(frozen=True)
class MosaicGpuFp8BlockSizes:
    """The fp8 kernels' tuning knobs. Tiles are fixed at 128 x 128 x 128: 128 deep is one
    scale step, 128 columns one weight scale block, and two consumers of 64 rows is what
    the promotion's second accumulator leaves registers for (module docstring).
    stages: TMA buffers in flight (cut to what shared memory holds); grid_block_n: the
    planar snake's width in column tiles; steps_per_stage: 128-deep scale steps per
    buffer in gmm (1 or 2). With 2, a consumer issues the second step's wgmmas before it
    promotes the first, so that promotion runs while the tensor cores work; a k of an odd
    number of steps runs with 1. tgmm's steps are token blocks, one per buffer.
    cluster: gmm's CTAs per cluster (1 or 2). With 2, the two CTAs of a cluster take
    adjacent column tiles of one row tile and receive each A block (and its scales) from
    one TMA multicast: a third less L2-to-SM traffic per flop. An odd count of column
    tiles runs with 1."""

    stages: int = 4
    grid_block_n: int = 8
    steps_per_stage: int = 1
    cluster: int = 1

    def __post_init__(self):
        for name in ("stages", "grid_block_n", "steps_per_stage", "cluster"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MosaicGpuFp8BlockSizes.{name} must be a positive int, "
                                 f"got {value!r}")
        if self.stages < 2:
            raise ValueError(f"MosaicGpuFp8BlockSizes.stages must be at least 2, got {self.stages}")
        if self.cluster > 2:
            raise ValueError(f"MosaicGpuFp8BlockSizes.cluster must be 1 or 2, got {self.cluster}")
        if self.steps_per_stage > 2:
            raise ValueError(f"MosaicGpuFp8BlockSizes.steps_per_stage must be 1 or 2, got "
                             f"{self.steps_per_stage}")


# Defaults from the dense probe above (H200, 2026-12-02): 4 stages, snake width 8; one
# step per stage and no clusters (measured against both on 2026-12-04, module docstring).
DEFAULT = MosaicGpuFp8BlockSizes(stages=4, grid_block_n=8, steps_per_stage=1, cluster=1)


def default_block_sizes(*, product: str, m: int, k: int, n: int, g: int) -> MosaicGpuFp8BlockSizes:
    del product, m, k, n, g
    return DEFAULT


def resolve_block_sizes(block_sizes: Any, *, product: str, m: int, k: int, n: int, g: int,
                        interpret: bool = True) -> MosaicGpuFp8BlockSizes:
    """The caller's blocks, else the tuned table / autotune cache, else a bounded autotune
    (compiled on a Hopper GPU only; PALLASITE_AUTOTUNE=0 turns it off), else DEFAULT."""
    return tuning_benchmarks.select_block_sizes(
        sys.modules[__name__], "pallas_mosaic_gpu_fp8", MosaicGpuFp8BlockSizes, block_sizes,
        # The key's dtype is the operands' before quantization (bf16 in the tuning
        # benchmarks); the implementation name says the products are fp8.
        product=product, dims={"m": m, "k": k, "n": n, "g": g}, dtype=jnp.bfloat16,
        default=default_block_sizes(product=product, m=m, k=k, n=n, g=g),
        tune_here=not interpret and platform.mosaic_gpu_runs(),
    )


def refusal(compute, operands, *, target: str | None) -> str | None:
    """Why these kernels cannot run compiled for `target` (None: interpreted, which runs
    anywhere). None: they can. fp8 wgmma needs the Hopper GPU this process holds.
    Operands of any floating dtype are quantized first."""
    del compute, operands
    if target is not None and not platform.mosaic_gpu_runs():
        return (f"pallas_mosaic_gpu (fp8) needs a Hopper GPU (sm90); the device is "
                f"{platform.device_generation()}")
    return None


def _stages(bs: MosaicGpuFp8BlockSizes, out_bytes: int, depth: int = 1, strips: bool = True,
            extra_bytes: int = 0) -> tuple[int, int]:
    """(stages, epilogue strip): bs.stages cut to what shared memory holds. A stage holds
    `depth` steps of A and B (fp8, 128 x 128 each) and two [128] fp32 scale vectors;
    each consumer has one 64 x strip output slot, and an epilogue `extra_bytes` more.
    The strip is 128 columns, or 64 (the tile stored in two strips, gmm's ragged stores
    only: `strips`) where that lets one more stage fit."""
    per_stage = depth * (2 * BLOCK * BLOCK + 2 * BLOCK * 4)

    def fit(strip):
        free = bf16._SMEM_BYTES - 2 * _CONSUMER_ROWS * strip * out_bytes - extra_bytes
        return int(min(bs.stages, free // per_stage))

    narrow = strips and fit(BLOCK // 2) > fit(BLOCK)
    return (fit(BLOCK // 2), BLOCK // 2) if narrow else (fit(BLOCK), BLOCK)


def _transforms(dtype):
    return bf16._swizzle_transforms(dtype)


def _row_scales(scales_smem, wg, step: int = 0):
    """This consumer's 64 rows of row `step` of a [steps, 128] scale block, one per
    accumulator row."""
    return plgpu.load(scales_smem.at[step, pl.ds(wg * _CONSUMER_ROWS, _CONSUMER_ROWS)],
                      layout=plgpu.Layout.WGMMA.reduce(1))


def _promote(total, a, b_t, scale, live):
    """total + (a @ b_t^T) * scale(), the product summed by the tensor cores in one fresh
    accumulator (waited for) and promoted at once. scale: a function giving a [64, 128]
    broadcast, zero where not `live` (no wgmma runs then, and the fresh accumulator stays
    zero). It is called after the wgmmas are issued, so that its loads (a scale from
    global memory, a vector from shared memory) wait under the tensor cores' work."""
    def product(acc_ref):
        @pl.when(live)
        def _():
            plgpu.wgmma(acc_ref, a, b_t.transpose((1, 0)))

        factor = scale()
        return acc_ref[...] * factor

    return total + pl.run_scoped(product, plgpu.ACC((_CONSUMER_ROWS, BLOCK), jnp.float32))


def _promote_two(total, a, b_t, scales, live):
    """_promote of two steps: the second step's wgmmas are issued before the first one's
    product is promoted (waited for with one group still in flight), so that promotion
    runs under the second step's tensor-core work. a, b_t, scales: a pair each."""
    def first(acc0):
        @pl.when(live)
        def _():
            plgpu.wgmma(acc0, a[0], b_t[0].transpose((1, 0)))

        def second(acc1):
            @pl.when(live)
            def _():
                plgpu.wgmma(acc1, a[1], b_t[1].transpose((1, 0)))

            factors = scales[0](), scales[1]()
            partial = total + plgpu.wgmma_accumulator_load(acc0, wait_n=1) * factors[0]
            return partial + acc1[...] * factors[1]

        return pl.run_scoped(second, plgpu.ACC((_CONSUMER_ROWS, BLOCK), jnp.float32))

    return pl.run_scoped(first, plgpu.ACC((_CONSUMER_ROWS, BLOCK), jnp.float32))


def _mesh(interpret: bool, cluster: int = 1):
    """One program per SM, of two consumer warpgroups and a producer ("wg"); with
    cluster 2, programs in pairs ("cluster") and the grid ("sm") counts the pairs."""
    clustered = cluster > 1
    return plgpu.Mesh(grid=(max(bf16._num_programs(interpret) // cluster, 1),),
                      grid_names=("sm",), cluster=(cluster,) if clustered else (),
                      cluster_names=("cluster",) if clustered else (),
                      num_threads=3, thread_name="wg")


def _where(live, value):
    """value where `live` (a scalar), else zeros: a select, so a NaN scale of rows that are
    not computed cannot reach the total as 0 * NaN. The predicate is broadcast by hand
    (warpgroup lowering has no implicit broadcast in a select)."""
    mask = lax.broadcast_in_dim(live, value.shape, ())
    return jnp.where(mask, value, jnp.zeros_like(value))


def _zeros():
    return plgpu.layout_cast(jnp.zeros((_CONSUMER_ROWS, BLOCK), jnp.float32), plgpu.Layout.WGMMA)


def _pipeline(mma, compute_context, in_specs, stages, steps):
    return plgpu.emit_pipeline_warp_specialized(
        mma, grid=(steps,), memory_registers=40, in_specs=in_specs, wg_axis="wg",
        num_compute_wgs=2, max_concurrent_steps=stages, compute_context=compute_context)


def _specs(index_a, index_b, b_scales_block, depth: int = 1, cluster: int = 1):
    """In specs: A [128, 128 depth], A's scales [depth, 128], B [128, 128 depth], and B's
    scales. cluster 2: A and its scales multicast to the cluster's two programs."""
    spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM)
    shared = functools.partial(spec, collective_axes=("cluster",) if cluster > 1 else None)
    specs = [shared((BLOCK, depth * BLOCK), index_a, transforms=_transforms(FP8)),
             shared((depth, BLOCK), lambda kk: (index_a(kk)[1], 0))]
    specs.append(spec((BLOCK, depth * BLOCK), index_b, transforms=_transforms(FP8)))
    if b_scales_block is not None:
        specs.append(spec(b_scales_block, lambda kk: (index_b(kk)[1], 0)))
    return specs


# --------------------------------------------------------------------------- gmm

# gmm's epilogues: what a tile's fp32 totals become, and the operands and outputs each
# adds (gmm_call). None: the sums rounded to the output dtype. "weighted": one more
# operand, fp32 row weights [m], which scale each row's sums before the rounding (the
# grouped_mlp down product). "weighted_grad": the down product's backward for h (this
# product as dx, t = dy W^T): operands the row weights [m] and h [m, n] fp32 (tiles in
# by TMA during the k loop); the output is dh = weights * t, and a second output
# [tiles, n / 128, 2, 64] fp32 takes each consumer's per-row sum of h * t over its
# columns (its share of d row_weights; pallas_mosaic_gpu._row_parts sums them).
# grouped_mlp's paired gate-up is its own kernel (expert_mlp.pallas_mosaic_gpu_fp8).
EPILOGUES = (None, "weighted", "weighted_grad")
_EPILOGUE_OPERANDS = {None: 0, "weighted": 1, "weighted_grad": 2}


def _epilogue_scratch_bytes(epilogue: str | None) -> int:
    """Shared memory `epilogue`'s scratch takes for both consumers (_gmm_kernel's): a
    64-row fp32 slot for the row weights, and for "weighted_grad" one for its row sums
    and a 64 x 128 fp32 h tile."""
    grad = epilogue == "weighted_grad"
    slots = (epilogue is not None) + grad
    tile = BLOCK * 4 if grad else 0
    return 2 * _CONSUMER_ROWS * (4 * slots + tile)


def _gmm_kernel(m, k, n, g, bs: MosaicGpuFp8BlockSizes, stages: int, strip: int, depth: int,
                cluster: int, epilogue: str | None = None):
    """depth: 128-deep steps per pipeline step (steps_per_stage); strip: the epilogue's
    slot width (_stages); cluster: programs per cluster, on adjacent column tiles;
    epilogue: one of EPILOGUES."""
    grid_n = n // BLOCK
    # The snake walks (row tile, column tiles of a cluster); its width in those units.
    snake = dataclasses.replace(bs, grid_block_n=max(bs.grid_block_n // cluster, 1))
    k_steps = k // (depth * BLOCK)
    index = lambda kk: (0, kk)  # noqa: E731 - A and B blocks of pipeline step kk
    operands = _EPILOGUE_OPERANDS[epilogue]

    def body(table_gmem, count_gmem, lhs_gmem, lhs_scales_gmem, rhs_gmem, rhs_scales_gmem,
             *refs):
        extra_gmem, (out_gmem, *parts_gmem) = refs[:operands], refs[operands:]
        num_tiles = count_gmem[0]
        wg = lax.axis_index("wg")
        specs = _specs(index, index, None, depth, cluster)
        ignore = lambda *_, **__: None  # noqa: E731 - allocations do not depend on the body
        b_block = rhs_gmem.at[0, pl.ds(0, BLOCK)]
        allocs = _pipeline(ignore, ignore, specs, stages, stages).get_allocations(
            lhs_gmem.at[pl.ds(0, BLOCK)], lhs_scales_gmem.at[:, pl.ds(0, BLOCK)], b_block)
        scratch = dict(o_smem=plgpu.SMEM((2, _CONSUMER_ROWS, strip), out_gmem.dtype,
                                         transforms=bf16._swizzle_transforms(out_gmem.dtype,
                                                                             rows=1)))
        weighted = epilogue is not None  # both epilogues read the row weights
        if weighted:
            scratch.update(w_smem=plgpu.SMEM((2, _CONSUMER_ROWS), jnp.float32),
                           w_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2))
        if epilogue == "weighted_grad":
            scratch.update(s_smem=plgpu.SMEM((2, _CONSUMER_ROWS), jnp.float32),
                           h_smem=plgpu.SMEM((2, _CONSUMER_ROWS, BLOCK), jnp.float32,
                                             transforms=bf16._swizzle_transforms(jnp.float32)),
                           h_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2))

        @functools.partial(pl.run_scoped, allocations=allocs, collective_axes="wg", **scratch)
        def _(allocations, o_smem, w_smem=None, w_ready=None, s_smem=None, h_smem=None,
              h_ready=None):
            @plgpu.nd_loop((num_tiles * (grid_n // cluster),), collective_axes="sm")
            def _(info):
                mi, nc, seg, load0, row0, rows, live = bf16._row_tile(
                    table_gmem, info.index[0], num_tiles, grid_n // cluster, snake, g)
                ni = nc * cluster + (lax.axis_index("cluster") if cluster > 1 else 0)
                gi = jnp.minimum(seg, g - 1)
                mine = wg * _CONSUMER_ROWS

                def scale_of(idx, a_scales_smem, j: int, col_block):
                    def scale():
                        weight_scale = rhs_scales_gmem[gi, col_block, idx[0] * depth + j]
                        row_scales = _row_scales(a_scales_smem, wg, j) * weight_scale
                        return lax.broadcast_in_dim(_where(live, row_scales),
                                                    (_CONSUMER_ROWS, BLOCK), [0])
                    return scale

                def mma(idx, a_smem, a_scales_smem, b_smem, total):
                    rows = pl.ds(mine, _CONSUMER_ROWS)
                    a, b, scales = [], [], []
                    for j in range(depth):
                        scales.append(scale_of(idx, a_scales_smem, j, ni))
                        a.append(a_smem.at[rows, pl.ds(j * BLOCK, BLOCK)])
                        b.append(b_smem.at[:, pl.ds(j * BLOCK, BLOCK)])
                    if depth == 1:
                        return _promote(total, a[0], b[0], scales[0], live)
                    return _promote_two(total, a, b, scales, live)

                def compute_context(run_pipeline):
                    # The epilogue's operand tiles arrive during the k loop.
                    if weighted:
                        plgpu.copy_gmem_to_smem(
                            extra_gmem[0].at[pl.ds(load0 + mine, _CONSUMER_ROWS)],
                            w_smem.at[wg], w_ready.at[wg])
                    if epilogue == "weighted_grad":
                        plgpu.copy_gmem_to_smem(
                            extra_gmem[1].at[pl.ds(load0 + mine, _CONSUMER_ROWS),
                                             pl.ds(ni * BLOCK, BLOCK)],
                            h_smem.at[wg], h_ready.at[wg])
                    total = run_pipeline(_zeros())
                    outs = [(total, ni * BLOCK)]
                    if epilogue == "weighted_grad":  # this consumer's share: sum of h * t
                        plgpu.barrier_wait(h_ready.at[wg])
                        row_sums = jnp.sum(h_smem.at[wg][...] * total, axis=1)
                    if weighted:
                        plgpu.barrier_wait(w_ready.at[wg])
                        weights = plgpu.load(w_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
                        outs = [(total * lax.broadcast_in_dim(weights, total.shape, [0]),
                                 ni * BLOCK)]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # slots free again
                    # This consumer's rows of the tile that are the group's.
                    lo = jnp.maximum(row0 - load0, mine)
                    hi = jnp.minimum(row0 - load0 + rows, mine + _CONSUMER_ROWS)
                    for i, (out, col) in enumerate(outs):
                        if i:
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        bf16._store_rows_from(out, o_smem.at[wg], out_gmem, load0 + lo,
                                              jnp.maximum(hi - lo, 0), lo - mine, col,
                                              _CONSUMER_ROWS)
                    if epilogue == "weighted_grad":  # the row sums, into the tile's slot
                        s_smem.at[wg][...] = row_sums
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(s_smem.at[wg], parts_gmem[0].at[mi, ni, wg])

                _pipeline(mma, compute_context, specs, stages, bf16._k_steps(live, k_steps, 0))(
                    lhs_gmem.at[pl.ds(load0, BLOCK)], lhs_scales_gmem.at[:, pl.ds(load0, BLOCK)],
                    rhs_gmem.at[gi, pl.ds(ni * BLOCK, BLOCK)], allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def _pad_to(x, axis: int, multiple: int, minimum: int = 0, value=0):
    size = x.shape[axis]
    target = max(-(-size // multiple) * multiple, minimum)
    if target == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, target - size)
    return jnp.pad(x, pad, constant_values=value)


def gmm_call(lhs, lhs_scales_t, rhs, rhs_scales, group_sizes, n: int, *, group_offset,
             out_dtype, bs: MosaicGpuFp8BlockSizes, interpret: bool, epilogue=None,
             extra=(), cost_of=None, name="grouped_projection_gmm_fp8_mosaic_gpu"):
    """The fp8 gmm's call on quantized operands in the kernel's layouts (gmm_quantized's
    docstring), n output columns, with an `epilogue` of EPILOGUES and its `extra`
    operands ([m] or [m, n] arrays, padded here along m); cost_of(inputs=, outputs=) the
    epilogue's cost estimate (the plain product's when None). rhs: [g, n, k]. Returns
    the [m, n] output; for "weighted_grad" (dh [m, n], the row sums [m] fp32)."""
    m, k = lhs.shape
    g = rhs.shape[0]
    kp = -(-k // BLOCK) * BLOCK
    lhs_p = _pad_to(_pad_to(lhs, 1, BLOCK), 0, 8, BLOCK)
    scales_p = _pad_to(lhs_scales_t, 1, 8, BLOCK, value=1.0)
    mp = lhs_p.shape[0]
    rhs_p = _pad_to(_pad_to(rhs, 2, BLOCK), 1, BLOCK)
    np_ = rhs_p.shape[1]
    extra = tuple(_pad_to(a, 0, 8, BLOCK) for a in extra)
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    table, count = bf16._row_tile_table(sizes, mp, BLOCK, row_start)
    out_type = sharding.out_struct((mp, np_), out_dtype, like=lhs)
    out_types = (out_type,)
    if epilogue == "weighted_grad":
        out_types += (sharding.out_struct((table.shape[1], np_ // BLOCK, 2, _CONSUMER_ROWS),
                                          jnp.float32, like=lhs),)
    inputs = (table, count, lhs_p, scales_p, rhs_p, rhs_scales, *extra)
    cost = (costs.gmm(mp, kp, rhs_p.shape[1], lhs.dtype, transpose_rhs=True, inputs=inputs,
                      outputs=out_types) if cost_of is None
            else cost_of(inputs=inputs, outputs=out_types))
    # Two steps per stage where k has an even number of them (steps_per_stage); clusters
    # of two where the column tiles pair up (cluster). The interpreter runs without
    # clusters (its multicast copies hang on jax 0.11.2).
    depth = bs.steps_per_stage if (kp // BLOCK) % bs.steps_per_stage == 0 else 1
    cluster = bs.cluster if (np_ // BLOCK) % bs.cluster == 0 and not interpret else 1
    stages, strip = _stages(bs, jnp.dtype(out_dtype).itemsize, depth,
                            extra_bytes=_epilogue_scratch_bytes(epilogue))
    if stages < 2:
        raise ValueError(f"{name}: {bs} leaves fewer than two stages in shared memory")
    call = pl.kernel(
        _gmm_kernel(mp, kp, np_, g, bs, min(stages, kp // (depth * BLOCK)), strip, depth,
                    cluster, epilogue),
        out_type=out_types if len(out_types) > 1 else out_type,
        mesh=_mesh(interpret, cluster),
        compiler_params=bf16._compiler_params(),
        interpret=bf16._interpret_params(interpret),
        cost_estimate=cost,
        name=name,
    )
    out = call(*inputs)
    if epilogue == "weighted_grad":
        dh, parts = out
        parts = parts.reshape(parts.shape[0], parts.shape[1], BLOCK)
        return dh[:m, :n], bf16._row_parts(parts, table, count, parts.shape[1], mp)[:m]
    return out[:m, :n]


def gmm_quantized(
    lhs: Shaped[Array, "m k"], lhs_scales_t: Float[Array, "kb m"],
    rhs: Shaped[Array, "g n k"], rhs_scales: Float[Array, "g nb kb"],
    group_sizes: Int[Array, " G"], *, group_offset=None, out_dtype: Any = jnp.bfloat16,
    block_sizes: MosaicGpuFp8BlockSizes | None = None, interpret: bool = False,
    product: str = "forward",
) -> Float[Array, "m n"]:
    """out[rows of group i] = dequant(lhs rows) @ dequant(rhs[i])^T, fp8 operands in the
    layouts of the module docstring: lhs [m, k] with scales [ceil(k/128), m], rhs
    [g, n, k] (K-major) with scales [g, ceil(n/128), ceil(k/128)]. rhs holds groups
    [group_offset, group_offset + g) of group_sizes (all when None)."""
    m, k = lhs.shape
    g, n = rhs.shape[0], rhs.shape[1]
    out_dtype = jnp.dtype(out_dtype)
    # Tuning keys and fit rules take the projection's dims: dx contracts its n, writes its k.
    k_proj, n_proj = (n, k) if product == "dx" else (k, n)
    bs = resolve_block_sizes(block_sizes, product=product, m=m, k=k_proj, n=n_proj,
                             g=group_sizes.shape[0], interpret=interpret)
    if m == 0 or n == 0 or g == 0:
        return jnp.zeros((m, n), out_dtype)
    return gmm_call(lhs, lhs_scales_t, rhs, rhs_scales, group_sizes, n,
                    group_offset=group_offset, out_dtype=out_dtype, bs=bs,
                    interpret=interpret)


# --------------------------------------------------------------------------- tgmm


def _tgmm_kernel(k, n, g, num_blocks, bs: MosaicGpuFp8BlockSizes, stages: int):
    grid_m, grid_n = k // BLOCK, n // BLOCK

    def body(groups_gmem, lhs_gmem, lhs_scales_gmem, rhs_gmem, rhs_scales_gmem, out_gmem):
        wg = lax.axis_index("wg")
        zero = lambda kk: (0, kk)  # noqa: E731
        specs = _specs(zero, zero, (1, BLOCK))
        ignore = lambda *_, **__: None  # noqa: E731
        # A static grid of `stages` steps: a shorter one would shrink the buffers below
        # the `stages` the (dynamic) pipelines below use.
        allocs = _pipeline(ignore, ignore, specs, stages, stages).get_allocations(
            lhs_gmem.at[pl.ds(0, BLOCK)], lhs_scales_gmem.at[:, pl.ds(0, BLOCK)],
            rhs_gmem.at[pl.ds(0, BLOCK)], rhs_scales_gmem.at[:, pl.ds(0, BLOCK)])
        o_type = plgpu.SMEM((2, _CONSUMER_ROWS, BLOCK), out_gmem.dtype,
                            transforms=bf16._swizzle_transforms(out_gmem.dtype))

        @functools.partial(pl.run_scoped, allocations=allocs, o_smem=o_type,
                           collective_axes="wg")
        def _(allocations, o_smem):
            @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
            def _(info):
                gi = info.index[0]
                mi, ni = plgpu.planar_snake(info.index[1], (grid_m, grid_n), 1, bs.grid_block_n)
                count = groups_gmem[1, gi]
                live = count > 0  # an empty group runs one step and stores zeros
                steps = jnp.maximum(count, 1)
                first = jnp.minimum(groups_gmem[0, gi], num_blocks - steps)
                index = lambda kk: (0, first + kk)  # noqa: E731

                def mma(idx, a_smem, a_scales_smem, b_smem, b_scales_smem, total):
                    def scale():
                        rows = _row_scales(a_scales_smem, wg)
                        cols = plgpu.load(b_scales_smem.at[0],
                                          layout=plgpu.Layout.WGMMA.reduce(0))
                        shape = (_CONSUMER_ROWS, BLOCK)
                        # A select, not a product: an unused block's scales may be anything.
                        return _where(live, lax.broadcast_in_dim(rows, shape, [0])
                                      * lax.broadcast_in_dim(cols, shape, [1]))

                    a = a_smem.at[pl.ds(wg * _CONSUMER_ROWS, _CONSUMER_ROWS)]
                    return _promote(total, a, b_smem, scale, live)

                def compute_context(run_pipeline):
                    total = run_pipeline(_zeros())
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # slot free again
                    o_smem[wg] = total.astype(o_smem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        o_smem.at[wg],
                        out_gmem.at[gi, pl.ds(mi * BLOCK + wg * _CONSUMER_ROWS, _CONSUMER_ROWS),
                                    pl.ds(ni * BLOCK, BLOCK)])

                in_specs = _specs(index, index, (1, BLOCK))
                _pipeline(mma, compute_context, in_specs, stages, steps)(
                    lhs_gmem.at[pl.ds(mi * BLOCK, BLOCK)],
                    lhs_scales_gmem.at[:, pl.ds(mi * BLOCK, BLOCK)],
                    rhs_gmem.at[pl.ds(ni * BLOCK, BLOCK)],
                    rhs_scales_gmem.at[:, pl.ds(ni * BLOCK, BLOCK)], allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def tgmm_quantized(
    lhs_t: Shaped[Array, "k p"], lhs_scales: Float[Array, "t k"],
    rhs_t: Shaped[Array, "n p"], rhs_scales: Float[Array, "t n"],
    first: Int[Array, " g"], count: Int[Array, " g"], *, out_dtype: Any = jnp.float32,
    block_sizes: MosaicGpuFp8BlockSizes | None = None, interpret: bool = False,
    m: int | None = None,
) -> Float[Array, "g k n"]:
    """out[i] = sum over group i's token blocks [first[i], first[i] + count[i]) of
    dequant(lhs block)^T-contracted with dequant(rhs block): the token-block layouts of
    the module docstring (values [c, 128 t], scales [t, c]). m: the rows the blocks were
    cut from (the tuning key; the token axis when None)."""
    k, p = lhs_t.shape
    n = rhs_t.shape[0]
    g = first.shape[0]
    num_blocks = lhs_scales.shape[0]
    out_dtype = jnp.dtype(out_dtype)
    bs = resolve_block_sizes(block_sizes, product="dkernel", m=p if m is None else m, k=k,
                             n=n, g=g, interpret=interpret)
    if g == 0 or k == 0 or n == 0:
        return jnp.zeros((g, k, n), out_dtype)
    lhs_p = _pad_to(lhs_t, 0, BLOCK)
    rhs_p = _pad_to(rhs_t, 0, BLOCK)
    lhs_scales_p = _pad_to(lhs_scales, 1, BLOCK, value=1.0)
    rhs_scales_p = _pad_to(rhs_scales, 1, BLOCK, value=1.0)
    kp, np_ = lhs_p.shape[0], rhs_p.shape[0]
    out_type = sharding.out_struct((g, kp, np_), out_dtype, like=lhs_t)
    inputs = (group_table(first, count), lhs_p, lhs_scales_p, rhs_p, rhs_scales_p)
    cost = costs.gmm(kp, p, np_, lhs_t.dtype, transpose_rhs=True, inputs=inputs,
                     outputs=(out_type,))
    call = pl.kernel(
        _tgmm_kernel(kp, np_, g, num_blocks, bs, _stages(bs, out_dtype.itemsize, strips=False)[0]),
        out_type=out_type,
        mesh=_mesh(interpret),
        compiler_params=bf16._compiler_params(),
        interpret=bf16._interpret_params(interpret),
        cost_estimate=cost,
        name="grouped_projection_tgmm_fp8_mosaic_gpu",
    )
    return call(*inputs)[:, :k, :n]


# ------------------------------------------------------------- the backend contract


def _quantizer(interpret: bool):
    """The quantizers of the operands: the Pallas ones compiled on the GPU; the XLA forms
    under the interpreter, where a Triton-interpreted quantizer and the Mosaic GPU
    interpreter in one jitted program hang on a 2-core host (seen on jax 0.11.2: the
    interpreter's blocking host callbacks wait on each other for the few XLA:CPU
    threads). Both write the same layouts and values (tests/test_quantize.py)."""
    return quantization.xla if interpret else quantization.quantizer(False)


def _check(lhs, rhs, group_sizes):
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(a.dtype, jnp.floating) or jnp.dtype(a.dtype).itemsize > 4:
            raise TypeError(f"fp8 grouped products quantize floating operands up to fp32; "
                            f"{name} is {jnp.dtype(a.dtype).name}")
    if group_sizes.dtype != jnp.int32:
        raise TypeError(f"group_sizes must be int32, got {group_sizes.dtype}")


def gmm(lhs: Float[Array, "m k"], rhs: Float[Array, "g kn nk"], group_sizes: Int[Array, " G"],
        *, group_offset=None, transpose_rhs: bool = False, out_dtype: Any = None,
        block_sizes: MosaicGpuFp8BlockSizes | None = None, interpret: bool = False
        ) -> Float[Array, "m n"]:
    """The forward (rhs [g, k, n]) or dx (transpose_rhs: dy [m, n] against rhs [g, k, n]
    read as [g, n, k]^T) in fp8: lhs in 1 x 128 blocks, rhs in 128 x 128 blocks."""
    _check(lhs, rhs, group_sizes)
    q = _quantizer(interpret)
    lhs_q, lhs_scales_t = q.rows(lhs, FP8)
    # forward: B = kernel^T, [g, n, k], written so by the quantizer; dx: B = kernel as is.
    rhs_q, rhs_scales = q.weight_blocks(rhs, FP8, transpose=not transpose_rhs)
    return gmm_quantized(lhs_q, lhs_scales_t, rhs_q, rhs_scales, group_sizes,
                         group_offset=group_offset, out_dtype=out_dtype or lhs.dtype,
                         block_sizes=block_sizes, interpret=interpret,
                         product="dx" if transpose_rhs else "forward")


def tgmm(lhs: Float[Array, "m k"], rhs: Float[Array, "m n"], group_sizes: Int[Array, " G"],
         *, num_groups: int | None = None, group_offset=None, out_dtype: Any = None,
         block_sizes: MosaicGpuFp8BlockSizes | None = None, interpret: bool = False
         ) -> Float[Array, "g k n"]:
    """dkernel in fp8: per local group lhs_g^T rhs_g over token blocks aligned to groups."""
    _check(lhs, rhs, group_sizes)
    m = lhs.shape[0]
    g = group_sizes.shape[0] if num_groups is None else num_groups
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    table = token_blocks(sizes, m, row_start=row_start)
    q = _quantizer(interpret)
    lhs_t, lhs_scales = q.token_blocks(lhs, table.start, table.rows, FP8)
    rhs_t, rhs_scales = q.token_blocks(rhs, table.start, table.rows, FP8)
    return tgmm_quantized(lhs_t, lhs_scales, rhs_t, rhs_scales, table.first, table.count,
                          out_dtype=out_dtype or lhs.dtype, block_sizes=block_sizes,
                          interpret=interpret, m=m)
