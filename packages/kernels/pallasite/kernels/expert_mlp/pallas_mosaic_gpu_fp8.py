"""grouped_mlp's fp8 products on Hopper (sm90) through Pallas Mosaic GPU: the gate-up
with the activation and h's quantization in its epilogue, its backward half, and the
down product with the row weights in its epilogue. The same functions as
pallas_triton_fp8.py, so that ops.mlp_fp8 runs either backend.

gate_up_quantized is the paired gate-up kernel below (paired_call, kind "quantized_h"):
e4m3 wgmma with each 128-deep step promoted to fp32 with its block scales, as
grouped_matmul.pallas_mosaic_gpu_fp8's gmm does, on a persistent grid of 64-row tiles.
A stage holds the 64 x 128 x tile and the 128 x 128 gate and up weight tiles of one
128-column tile of h; consumer c of the two takes h's columns [64 c, 64 c + 64), so it
keeps a gate and an up total of 64 x 64 fp32 each and two fresh accumulators as large:
the plain gmm's 64 x 128 in registers. (Consumers of 64 rows x 128 columns of h held
64 x 128 gate and up totals beside a fresh accumulator and spilled 336-360 bytes a
thread: about 2.5x slower than the plain gmm, docs/grouped_mlp.md.) A tile's 128
columns of h are one 1 x 128 block of each row, so each consumer forms h = act(gate) *
up in fp32 and its rows' amax over its 64 columns, the two exchange their amax through
shared memory, and each stores its e4m3 values [m, f] by TMA; the row scales go into a
per-tile slot, assembled into [f / 128, m] after (h_scales): the layout the fp8 down
product reads its lhs in. h is never written in 16 bits. Rows of no local group come out
as the quantizer makes zeros: values 0, scale 1.

gate_up_grad_quantized is the same paired kernel, kind "d_pre": each consumer's 64 x 64
dh tile comes in by TMA while its k loop runs, and d(pre) = [act'(gate) up dh,
act(gate) dh] is stored into the gate and up columns of an [m, 2f] output, so the
pre-activation is written in neither pass.

down_weighted_quantized is the fp8 gmm with epilogue "weighted": each consumer brings
its 64 row weights into shared memory by TMA while its k loop runs and scales its fp32
sums before y's one rounding. down_weighted_grad_quantized is its backward for h, the
fp8 gmm as dx (t = dy W_down^T) with epilogue "weighted_grad": each consumer's weights
and h tile come in by TMA while its k loop runs, and it stores dh = weights * t and its
rows' share of d row_weights (the sum of h * t over its 128 columns) into a per-tile
slot, summed after: t never reaches memory and y is not kept.

f must be a multiple of 128 (mixtral 14336, qwen3 768 and dsv3 2048 are), so that a
column tile's up columns are one weight-scale block row. Lowered for an H200 and run by
the Mosaic GPU interpreter on a CPU (docs/grouped_mlp.md, "The fp8 fused route on Mosaic
GPU", has the measurements).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int, Shaped

from pallasite.kernels import sharding
from pallasite.kernels.expert_mlp import costs, epilogue
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu as bf16
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu_fp8 as base
from pallasite.kernels.grouped_matmul.group_metadata import local_groups
from pallasite.reference import quantization as ref

FP8 = base.FP8
BLOCK = base.BLOCK


@sharding.local_operands("grouped_mlp")
def gate_up_quantized(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "g k two_f"],
    group_sizes: Int[Array, " G"],
    *,
    activation: str = "swiglu",
    group_offset=None,
    block_sizes: base.MosaicGpuFp8BlockSizes | None = None,
    interpret: bool = False,
) -> tuple[Shaped[Array, "m f"], Float[Array, "fb m"]]:
    """(h's e4m3 values [m, f], their fp32 scales [f / 128, m]) for h[rows of group i] =
    act(Q(lhs_i) Q(W_gate[i])) * (Q(lhs_i) Q(W_up[i])), W_gate = rhs[..., :f], W_up =
    rhs[..., f:], quantized in 1 x 128 blocks of h's rows: pallas_triton_fp8's function
    on Hopper's kernel (module docstring). lhs and rhs are floating (up to fp32) and
    quantized here; rows of no local group are zero (scale 1); f a multiple of 128.
    block_sizes: the fp8 gmm's (stages and the snake's width; its DEFAULT when None)."""
    epilogue.check_gate_up(lhs, rhs, activation)
    m, f = lhs.shape[0], rhs.shape[2] // 2
    if 0 in lhs.shape or f == 0 or rhs.shape[0] == 0:
        return jnp.zeros((m, f), FP8), jnp.ones((f // BLOCK, m), jnp.float32)
    return paired_call(*_quantized_operands(lhs, rhs, group_sizes, interpret), group_sizes,
                       kind="quantized_h", activation=activation, group_offset=group_offset,
                       block_sizes=block_sizes, interpret=interpret)


def _quantized_operands(lhs, rhs, group_sizes, interpret):
    """lhs in 1 x 128 blocks and rhs in 128 x 128 (written K-major, [g, 2f, k])."""
    base._check(lhs, rhs, group_sizes)
    epilogue.check_fp8_f(rhs.shape[2] // 2, BLOCK)
    q = base._quantizer(interpret)
    return (*q.rows(lhs, FP8), *q.weight_blocks(rhs, FP8, transpose=True))


@sharding.local_operands("grouped_mlp")
def down_weighted_quantized(
    h: Shaped[Array, "m f"],
    h_scales_t: Float[Array, "fb m"],
    rhs: Float[Array, "g f n"],
    group_sizes: Int[Array, " G"],
    row_weights: Float[Array, " m"],
    *,
    group_offset=None,
    out_dtype=jnp.bfloat16,
    block_sizes: base.MosaicGpuFp8BlockSizes | None = None,
    interpret: bool = False,
) -> Shaped[Array, "m n"]:
    """y[rows of group i] = (dequant(h) Q(rhs[i])) * row_weights in out_dtype, h as
    gate_up_quantized stores it, rhs quantized here: pallas_triton_fp8's function on
    Hopper's kernel (module docstring)."""
    m, f = h.shape
    n = rhs.shape[2]
    if 0 in (m, f, n) or rhs.shape[0] == 0:
        return jnp.zeros((m, n), out_dtype)
    if row_weights.shape != (m,):
        raise ValueError(f"row_weights must be [m] = [{m}], got {row_weights.shape}")
    q = base._quantizer(interpret)
    rhs_q, rhs_scales = q.weight_blocks(rhs, FP8, transpose=True)  # [g, n, f], K-major
    bs = base.resolve_block_sizes(block_sizes, product="forward", m=m, k=f, n=n,
                                  g=group_sizes.shape[0], interpret=interpret)
    return base.gmm_call(
        h, h_scales_t, rhs_q, rhs_scales, group_sizes, n, group_offset=group_offset,
        out_dtype=jnp.dtype(out_dtype), bs=bs, interpret=interpret, epilogue="weighted",
        extra=(row_weights.astype(jnp.float32),),
        cost_of=lambda **io: costs.down_weighted(m, f, n, FP8, grad=False, **io),
        name="grouped_mlp_down_fp8_mosaic_gpu")


@sharding.local_operands("grouped_mlp")
def gate_up_grad_quantized(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "g k two_f"],
    group_sizes: Int[Array, " G"],
    dh: Float[Array, "m f"],
    *,
    activation: str = "swiglu",
    group_offset=None,
    out_dtype=jnp.bfloat16,
    block_sizes: base.MosaicGpuFp8BlockSizes | None = None,
    interpret: bool = False,
) -> Shaped[Array, "m two_f"]:
    """d(pre) [m, 2f] = [act'(gate) up dh, act(gate) dh] in out_dtype, the gate and up
    sums recomputed in the kernel from Q(lhs) and Q(rhs) as gate_up_quantized forms them
    (never stored). dh [m, f] is read in out_dtype (its tile in by TMA while the k loop
    runs); rows of no local group are zero."""
    epilogue.check_gate_up(lhs, rhs, activation, dh)
    m, f = lhs.shape[0], rhs.shape[2] // 2
    out_dtype = jnp.dtype(out_dtype)
    if 0 in lhs.shape or f == 0 or rhs.shape[0] == 0:
        return jnp.zeros((m, 2 * f), out_dtype)
    return paired_call(*_quantized_operands(lhs, rhs, group_sizes, interpret), group_sizes,
                       kind="d_pre", activation=activation, group_offset=group_offset, dh=dh,
                       out_dtype=out_dtype, block_sizes=block_sizes, interpret=interpret)


@sharding.local_operands("grouped_mlp")
def down_weighted_grad_quantized(
    dy: Float[Array, "m n"],
    rhs: Float[Array, "g f n"],
    group_sizes: Int[Array, " G"],
    row_weights: Float[Array, " m"],
    h: Float[Array, "m f"],
    *,
    group_offset=None,
    dh_dtype=jnp.float32,
    block_sizes: base.MosaicGpuFp8BlockSizes | None = None,
    interpret: bool = False,
):
    """(dh = row_weights * t in dh_dtype [m, f], d row_weights = sum_f h * t [m] fp32)
    for t = Q(dy_i) Q(rhs[i])^T, t never in memory: pallas_triton_fp8's function on
    Hopper's kernel (module docstring). h is read in fp32 (the forward's, dequantized)."""
    m, n = dy.shape
    f = rhs.shape[1]
    if 0 in (m, f, n) or rhs.shape[0] == 0:
        return jnp.zeros((m, f), dh_dtype), jnp.zeros((m,), jnp.float32)
    base._check(dy, rhs, group_sizes)
    if h.shape != (m, f) or row_weights.shape != (m,):
        raise ValueError(f"h must be [m, f] = {(m, f)} and row_weights [m]; got {h.shape} "
                         f"and {row_weights.shape}")
    q = base._quantizer(interpret)
    dy_q, dy_scales_t = q.rows(dy, FP8)
    rhs_q, rhs_scales = q.weight_blocks(rhs, FP8, transpose=False)  # [g, f, n], as stored
    bs = base.resolve_block_sizes(block_sizes, product="dx", m=m, k=f, n=n,
                                  g=group_sizes.shape[0], interpret=interpret)
    return base.gmm_call(
        dy_q, dy_scales_t, rhs_q, rhs_scales, group_sizes, f, group_offset=group_offset,
        out_dtype=jnp.dtype(dh_dtype), bs=bs, interpret=interpret, epilogue="weighted_grad",
        extra=(row_weights.astype(jnp.float32),
               base._pad_to(h.astype(jnp.float32), 1, BLOCK)),  # whole TMA boxes
        cost_of=lambda **io: costs.down_weighted(m, f, n, FP8, grad=True, **io),
        name="grouped_mlp_down_grad_fp8_mosaic_gpu")


# ------------------------------------------------------------- the paired gate-up

_PART = base._CONSUMER_ROWS  # a consumer's rows and columns of h: 64 x 64
PAIRED_KINDS = ("quantized_h", "d_pre")
# d(pre)'s row tile: 64 rows x 128 columns of h, as "quantized_h" (which needs a row's
# whole 1 x 128 block in one tile), or 128 rows x 64 columns (a consumer's 64 rows
# each): a 32 KB step like the plain gmm's, against 40 KB. 64 is what the GPU tests and
# the timings of 2026-12-05 ran; 128 is interpreter-checked and lowered, not yet timed
# (tools/sweeps/fp8_quantizers.py --paired-gate-up times both).
D_PRE_TILE_ROWS = 64


def _promote_pair(totals, a, b_tiles, scales, live):
    """base._promote of the gate and the up product at once: both issued into fresh
    accumulators, then waited for and promoted, each with its scale() ([64, 64], zero
    where not `live`)."""
    shape = (_PART, _PART)

    def gate_scope(gate_acc):
        def up_scope(up_acc):
            @pl.when(live)
            def _():
                plgpu.wgmma(gate_acc, a, b_tiles[0].transpose((1, 0)))
                plgpu.wgmma(up_acc, a, b_tiles[1].transpose((1, 0)))

            gate_factor, up_factor = scales[0](), scales[1]()
            return (totals[0] + gate_acc[...] * gate_factor,
                    totals[1] + up_acc[...] * up_factor)

        return pl.run_scoped(up_scope, plgpu.ACC(shape, jnp.float32))

    return pl.run_scoped(gate_scope, plgpu.ACC(shape, jnp.float32))


def _meet(barrier):
    """Both consumers arrive, then wait: what each wrote to shared memory before is seen
    by the other after."""
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


def _paired_stages(bs, out_dtype, kind: str, tile_m: int) -> int:
    """bs.stages cut to what shared memory holds: a stage is the tile_m x 128 A tile,
    its row scales and the gate and up B tiles (tile_n x 128 each, tile_n = 8192 /
    tile_m); "quantized_h" adds the shared 64 x 128 e4m3 slot of h, the two consumers'
    amax rows and the scale row, "d_pre" each consumer's 64 x 64 output slot and dh tile
    (both in out_dtype)."""
    tile_n = _PART * _PART * 2 // tile_m
    per_stage = tile_m * BLOCK + 2 * tile_n * BLOCK + tile_m * 4
    if kind == "quantized_h":
        scratch = _PART * BLOCK + 3 * _PART * 4
    else:
        scratch = 2 * 2 * _PART * _PART * jnp.dtype(out_dtype).itemsize
    return int(min(bs.stages, (bf16._SMEM_BYTES - scratch) // per_stage))


def _paired_kernel(k: int, f: int, g: int, bs, stages: int, kind: str, activation: str,
                   tile_m: int = _PART):
    """The paired gate-up on a persistent grid of tiles of h, each 64 x 64 a consumer:
    tile_m 64, a tile is 64 rows of x and 128 columns of h, and consumer c computes the
    columns [64 c, 64 c + 64) from the rows [64 c, 64 c + 64) of the gate's and the up's
    128 x 128 B tiles; tile_m 128 (d_pre only), a tile is 128 rows and 64 columns
    (B tiles 64 x 128), and consumer c computes the rows [64 c, 64 c + 64). The
    producer streams the A tile and both B tiles. A consumer's totals, gate and up, hold
    64 x 64 fp32 each, and its two fresh accumulators as many: the 64 x 128 tile of the
    plain gmm in registers.

    "quantized_h": each row's scale covers its whole 1 x 128 block of h, and a TMA box
    must start on 128 bytes in shared memory (a box from a row of 64 e4m3 values, 64
    bytes, misaligned every second row on an H100: CUDA_ERROR_MISALIGNED_ADDRESS). So
    the two consumers share one 64 x 128 e4m3 slot, 128 bytes a row: each writes its
    rows' amax, meets the other at a barrier, forms the scale from both, writes its 64
    columns of values into the slot and meets the other again; then consumer 0 stores
    the slot's valid rows and the scales. Consumer 0 waits for its previous stores to
    read the slot before it meets the other at the first barrier of the next tile, so
    neither writes the slot while a store still reads it."""
    assert tile_m in (_PART, 2 * _PART) and (kind == "d_pre" or tile_m == _PART)
    tile_n = _PART * _PART * 2 // tile_m  # columns of h a tile
    grid_n = f // tile_n
    k_steps = k // BLOCK
    index = lambda kk: (0, kk)  # noqa: E731 - A and B blocks of pipeline step kk
    spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM)
    specs = [spec((tile_m, BLOCK), index, transforms=base._transforms(FP8)),
             spec((1, tile_m), lambda kk: (kk, 0)),
             spec((tile_n, BLOCK), index, transforms=base._transforms(FP8)),
             spec((tile_n, BLOCK), index, transforms=base._transforms(FP8))]
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def body(table_gmem, count_gmem, lhs_gmem, lhs_scales_gmem, rhs_gmem, rhs_scales_gmem,
             *refs):
        if kind == "d_pre":
            dh_gmem, out_gmem = refs
        else:
            out_gmem, scales_gmem = refs
        num_tiles = count_gmem[0]
        wg = lax.axis_index("wg")
        # This consumer's rows of the A tile and of each B tile (h's columns).
        row_off = wg * _PART if tile_m > _PART else 0
        col_off = wg * _PART if tile_m == _PART else 0
        my_rows, my_cols = pl.ds(row_off, _PART), pl.ds(col_off, _PART)
        ignore = lambda *_, **__: None  # noqa: E731 - allocations do not depend on the body
        b_block = rhs_gmem.at[0, pl.ds(0, tile_n)]
        allocs = base._pipeline(ignore, ignore, specs, stages, stages).get_allocations(
            lhs_gmem.at[pl.ds(0, tile_m)], lhs_scales_gmem.at[:, pl.ds(0, tile_m)],
            b_block, b_block)
        if kind == "quantized_h":
            scratch = dict(h_smem=plgpu.SMEM((_PART, BLOCK), FP8),
                           amax_smem=plgpu.SMEM((2, _PART), jnp.float32),
                           s_smem=plgpu.SMEM((_PART,), jnp.float32),
                           met=plgpu.Barrier(num_arrivals=2, num_barriers=2))
        else:
            scratch = dict(o_smem=plgpu.SMEM((2, _PART, _PART), out_gmem.dtype,
                                             transforms=bf16._swizzle_transforms(out_gmem.dtype,
                                                                                 rows=1)),
                           dh_smem=plgpu.SMEM((2, _PART, _PART), dh_gmem.dtype,
                                              transforms=bf16._swizzle_transforms(dh_gmem.dtype)),
                           dh_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2))

        @functools.partial(pl.run_scoped, allocations=allocs, collective_axes="wg", **scratch)
        def _(allocations, h_smem=None, amax_smem=None, s_smem=None, met=None, o_smem=None,
              dh_smem=None, dh_ready=None):
            @plgpu.nd_loop((num_tiles * grid_n,), collective_axes="sm")
            def _(info):
                mi, ni, seg, load0, row0, rows, live = bf16._row_tile(
                    table_gmem, info.index[0], num_tiles, grid_n, bs, g)
                gi = jnp.minimum(seg, g - 1)
                col = ni * tile_n + col_off  # this consumer's first column of h
                block = ni * tile_n // BLOCK  # the weight-scale block column of the gate's

                def mma(idx, a_smem, a_scales_smem, gate_smem, up_smem, totals):
                    def scale_of(col_block):
                        def scale():
                            row_scales = (plgpu.load(a_scales_smem.at[0, my_rows],
                                                     layout=row_layout)
                                          * rhs_scales_gmem[gi, col_block, idx[0]])
                            return lax.broadcast_in_dim(base._where(live, row_scales),
                                                        (_PART, _PART), [0])
                        return scale

                    return _promote_pair(
                        totals, a_smem.at[my_rows], (gate_smem.at[my_cols], up_smem.at[my_cols]),
                        (scale_of(block), scale_of(f // BLOCK + block)), live)

                def compute_context(run_pipeline):
                    if kind == "d_pre":  # the dh tile arrives during the k loop
                        plgpu.copy_gmem_to_smem(
                            dh_gmem.at[pl.ds(load0 + row_off, _PART), pl.ds(col, _PART)],
                            dh_smem.at[wg], dh_ready.at[wg])
                    gate, up = run_pipeline((_zeros(), _zeros()))
                    # This consumer's rows of the tile that are the group's.
                    lo = jnp.maximum(row0 - load0, row_off)
                    hi = jnp.minimum(row0 - load0 + rows, row_off + _PART)
                    if kind == "quantized_h":
                        h = epilogue.gated(gate, up, activation)

                        @pl.when(wg == 0)
                        def _():
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # slot free

                        amax_smem.at[wg][...] = ref.amax(h, axis=1)
                        _meet(met.at[0])
                        amax = jnp.maximum(plgpu.load(amax_smem.at[0], layout=row_layout),
                                           plgpu.load(amax_smem.at[1], layout=row_layout))
                        scale, inverse = ref.scale_and_inverse(amax, FP8)
                        h_smem.at[:, my_cols][...] = ref.to_fp8(
                            h, lax.broadcast_in_dim(inverse, h.shape, [0]), FP8)
                        plgpu.commit_smem()
                        _meet(met.at[1])

                        @pl.when(wg == 0)
                        def _():
                            bf16.store_row_boxes(h_smem, out_gmem, load0 + lo,
                                                 jnp.maximum(hi - lo, 0), lo, ni * BLOCK, _PART)
                            s_smem[...] = scale
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(s_smem, scales_gmem.at[mi, ni])
                        return
                    plgpu.barrier_wait(dh_ready.at[wg])
                    d_gate, d_up = epilogue.d_pre(
                        gate, up, dh_smem.at[wg][...].astype(jnp.float32), activation)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # slot free again
                    for i, (out, at) in enumerate([(d_gate, col), (d_up, f + col)]):
                        if i:
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        bf16._store_rows_from(out, o_smem.at[wg], out_gmem, load0 + lo,
                                              jnp.maximum(hi - lo, 0), lo - row_off, at, _PART)

                weights = rhs_gmem.at[gi]
                base._pipeline(mma, compute_context, specs, stages,
                               bf16._k_steps(live, k_steps, 0))(
                    lhs_gmem.at[pl.ds(load0, tile_m)],
                    lhs_scales_gmem.at[:, pl.ds(load0, tile_m)],
                    weights.at[pl.ds(ni * tile_n, tile_n)],
                    weights.at[pl.ds(f + ni * tile_n, tile_n)], allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def _zeros():
    return plgpu.layout_cast(jnp.zeros((_PART, _PART), jnp.float32), plgpu.Layout.WGMMA)


def paired_call(lhs, lhs_scales_t, rhs, rhs_scales, group_sizes, *, kind: str,
                activation: str, group_offset=None, dh=None, out_dtype=FP8,
                block_sizes: base.MosaicGpuFp8BlockSizes | None = None,
                interpret: bool = False, name: str | None = None):
    """The paired gate-up on operands already quantized: lhs [m, k] e4m3 with scales
    [ceil(k / 128), m], rhs [g, 2f, k] (K-major, the gate's f rows, then the up's) with
    scales [g, 2f / 128, ceil(k / 128)]. kind "quantized_h": (h's e4m3 values [m, f], their
    scales [f / 128, m]); "d_pre": d(pre) [m, 2f] in out_dtype from dh [m, f]."""
    if kind not in PAIRED_KINDS:
        raise ValueError(f"kind={kind!r}: one of {PAIRED_KINDS}")
    m, k = lhs.shape
    g, f = rhs.shape[0], rhs.shape[1] // 2
    epilogue.check_fp8_f(f, BLOCK)
    bs = block_sizes or base.DEFAULT
    kp = -(-k // BLOCK) * BLOCK
    lhs_p = base._pad_to(base._pad_to(lhs, 1, BLOCK), 0, 8, BLOCK)
    scales_p = base._pad_to(lhs_scales_t, 1, 8, BLOCK, value=1.0)
    rhs_p = base._pad_to(rhs, 2, BLOCK)
    mp = lhs_p.shape[0]
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    tile_m = D_PRE_TILE_ROWS if kind == "d_pre" else _PART
    table, count = bf16._row_tile_table(sizes, mp, tile_m, row_start)
    if kind == "d_pre":
        dh = base._pad_to(dh.astype(out_dtype), 0, 8, BLOCK)
        out_types = (sharding.out_struct((mp, 2 * f), out_dtype, like=lhs),)
        inputs = (table, count, lhs_p, scales_p, rhs_p, rhs_scales, dh)
    else:
        out_types = (sharding.out_struct((mp, f), FP8, like=lhs),
                     sharding.out_struct((table.shape[1], f // BLOCK, _PART), jnp.float32,
                                         like=lhs))
        inputs = (table, count, lhs_p, scales_p, rhs_p, rhs_scales)
    stages = _paired_stages(bs, out_dtype, kind, tile_m)
    if stages < 2:
        raise ValueError(f"{name}: {bs} leaves fewer than two stages in shared memory")
    call = pl.kernel(
        _paired_kernel(kp, f, g, bs, min(stages, kp // BLOCK), kind, activation, tile_m),
        out_type=out_types if len(out_types) > 1 else out_types[0],
        mesh=base._mesh(interpret),
        compiler_params=bf16._compiler_params(),
        interpret=bf16._interpret_params(interpret),
        cost_estimate=costs.gate_up(mp, kp, f, FP8, activation, grad=kind == "d_pre",
                                    inputs=inputs, outputs=out_types),
        name=name or f"grouped_mlp_gate_up{'_grad' if kind == 'd_pre' else ''}_fp8_mosaic_gpu",
    )
    out = call(*inputs)
    if kind == "d_pre":
        return out[:m]
    values, parts = out
    return values[:m], h_scales(parts, table, count, m)


def h_scales(parts, table, count, m: int):
    """[f / 128, m] fp32 from the "quantized_h" kernel's per-(row tile, column tile)
    slots of 64 row scales: each row's from the one tile that holds it as a valid row
    (bf16.tile_rows; rows of no group included: their tiles store zeros with scale 1)."""
    row, valid = bf16.tile_rows(table, count, parts.shape[-1])
    at = jnp.where(valid, row, m).reshape(-1)  # m: dropped
    per_tile = jnp.moveaxis(parts, 1, 0).reshape(parts.shape[1], -1)
    return jnp.ones((parts.shape[1], m), jnp.float32).at[:, at].set(per_tile, mode="drop")
