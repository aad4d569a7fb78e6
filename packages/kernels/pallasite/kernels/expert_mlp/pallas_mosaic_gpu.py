"""grouped_mlp's gate-up product with its activation in the epilogue, on Hopper (sm90)
through Pallas Mosaic GPU: h = act(x W_gate) * (x W_up), [m, f], one kernel.

The composition path writes the [m, 2f] pre-activation in compute and reads it back for
the activation. Here each tile's gate and up sums stay in fp32 registers and only h is
stored, rounded once (the definition's rounding, pallasite.reference.grouped_mlp).

The kernel is grouped_matmul.pallas_mosaic_gpu's warp-specialised gmm (its row-tile
table, planar snake, ragged TMA row stores and zero tiles for rows of no group) with a
second rhs operand: a tile is block_m rows x 2*block_n columns of h, for which the
producer loads the matching gate columns [c, c + 2*block_n) and up columns [f + c, f + c
+ 2*block_n) of the group's [k, 2f] kernel into each stage. Consumer w owns h's columns
[w*block_n, (w+1)*block_n) of the tile: two wgmma accumulators (gate, up), block_m x
block_n each, and the epilogue act(gate) * up. A tile does the tensor work of a
block_m x 4*block_n pre-activation tile, so block_n = 64 keeps the cooperative gmm's
128 x 256 per program. Each step's two wgmmas retire before its stage is released
(no delayed release: two commit groups per step).

gate_up_grad is its backward half: the same sums recomputed, each consumer's dh tile
brought in by TMA while its k loop runs, and d(pre) = [act'(gate) up dh, act(gate) dh]
stored into the gate and up columns of an [m, 2f] output, so neither pass writes the
pre-activation. expert_mlp.ops.gate_up_activation is the differentiable form over these
kernels and pallas_triton.py's; grouped_mlp takes it where pallas_mosaic_gpu is named.

down_weighted is the down product with grouped_mlp's row weights in the epilogue: the
grouped gmm's cooperative kernel with one more operand (grouped_matmul.pallas_mosaic_gpu,
epilogue "scaled"), so y is rounded once from the scaled fp32 sums. down_weighted_grad
is its backward for h on the gmm's dx (epilogue "scaled_grad"): dh and each row's share
of d row_weights from the tiles of t = dy W_down^T and of h, so t never reaches memory.

Lowered for an H200 and run by the interpreter on the CPU; measured on an H200 since
2026-12-04 (docs/grouped_mlp.md has the figures and what is left).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Int, Shaped

from pallasite.kernels import sharding
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu as base
from pallasite.kernels.expert_mlp import costs, epilogue
from pallasite.kernels.grouped_matmul.group_metadata import local_groups

_F32 = jnp.float32

# 128 rows x (2 x 64) columns of h a tile: the gate and up stages (16 KiB each) beside
# the lhs block (16 KiB) give 48 KiB a stage; 4 stages fit beside two 128 x 64 bf16
# output slots. Not tuned on a GPU yet.
GATE_UP_DEFAULT = base.MosaicGpuBlockSizes(block_m=128, block_n=64, block_k=64, stages=4,
                                           grid_block_n=8, warp_specialized=True)


def _stages_that_fit(bs: base.MosaicGpuBlockSizes, in_bytes: int, out_bytes: int,
                     grad: bool = False) -> int:
    """Stages of (lhs block_m x block_k, gate and up block_k x 2 block_n) beside two
    block_m x block_n output slots in shared memory (and, for the gradient, two dh
    slots of the operand dtype)."""
    per_stage = (bs.block_m * bs.block_k + 2 * bs.block_k * 2 * bs.block_n) * in_bytes
    slots = 2 * bs.block_m * bs.block_n * (out_bytes + (in_bytes if grad else 0))
    return int(min(bs.stages, (base._SMEM_BYTES - slots) // per_stage))


def _gate_up_kernel(k, f, g, bs: base.MosaicGpuBlockSizes, activation: str,
                    grad: bool = False):
    """The gate-up kernel; with `grad` its backward half: each consumer also loads its
    block_m x block_n tile of dh (TMA, issued before the k loop) and stores d(pre) =
    [act'(gate) up dh, act(gate) dh] into the gate and up columns of a [m, 2f] output."""
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    cta_n = 2 * bn
    grid_n = pl.cdiv(f, cta_n)

    def pipeline(mma, compute_context, steps=k // bk):
        return plgpu.emit_pipeline_warp_specialized(
            mma,
            grid=(steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), memory_space=plgpu.SMEM),
                plgpu.BlockSpec((bk, cta_n), lambda kk: (kk, 0), memory_space=plgpu.SMEM),
                plgpu.BlockSpec((bk, cta_n), lambda kk: (kk, 0), memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=bs.stages,
            compute_context=compute_context,
        )

    def body(table_gmem, count_gmem, lhs_gmem, rhs_gmem, *refs):
        *dh_gmem, out_gmem = refs
        num_tiles = count_gmem[0]
        wg = lax.axis_index("wg")
        ignore = lambda *_, **__: None  # noqa: E731 - allocations do not depend on the body
        block = rhs_gmem.at[0, :, pl.ds(0, cta_n)]
        allocs = pipeline(ignore, ignore).get_allocations(lhs_gmem.at[pl.ds(0, bm)], block,
                                                          block)
        scratch = dict(o_smem=plgpu.SMEM((2, bm, bn), out_gmem.dtype,
                                         transforms=base._swizzle_transforms(out_gmem.dtype,
                                                                             rows=1)))
        if grad:
            scratch.update(
                dh_smem=plgpu.SMEM((2, bm, bn), dh_gmem[0].dtype,
                                   transforms=base._swizzle_transforms(dh_gmem[0].dtype)),
                dh_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2))

        @functools.partial(pl.run_scoped, allocations=allocs, collective_axes="wg", **scratch)
        def _(allocations, o_smem, dh_smem=None, dh_ready=None):
            @plgpu.nd_loop((num_tiles * grid_n,), collective_axes="sm")
            def _(info):
                # rows of no group (not live): act(0) * 0 = 0 is stored
                mi, ni, seg, load0, row0, rows, live = base._row_tile(
                    table_gmem, info.index[0], num_tiles, grid_n, bs, g)
                cols = pl.ds(wg * bn, bn)

                def mma(_, a_smem, gate_smem, up_smem, accs):
                    acc_gate, acc_up = accs

                    @pl.when(live)
                    def _():
                        plgpu.wgmma(acc_gate, a_smem, gate_smem.at[:, cols])
                        plgpu.wgmma(acc_up, a_smem, up_smem.at[:, cols])
                        plgpu.wgmma_wait(0)

                    return accs

                col0 = ni * cta_n + wg * bn

                def compute_context(run_pipeline):
                    @functools.partial(pl.run_scoped,
                                       acc_gate=plgpu.ACC((bm, bn), _F32),
                                       acc_up=plgpu.ACC((bm, bn), _F32))
                    def _(acc_gate, acc_up):
                        if grad:  # this tile's dh arrives while the k loop runs
                            plgpu.copy_gmem_to_smem(
                                dh_gmem[0].at[pl.ds(load0, bm), pl.ds(col0, bn)],
                                dh_smem.at[wg], dh_ready.at[wg])
                        run_pipeline((acc_gate, acc_up))
                        gate, up = acc_gate[...], acc_up[...]
                        if grad:
                            plgpu.barrier_wait(dh_ready.at[wg])
                            d_gate, d_up = epilogue.d_pre(
                                gate, up, dh_smem.at[wg][...].astype(_F32), activation)
                            outs = ((d_gate, col0), (d_up, f + col0))
                        else:
                            outs = ((epilogue.gated(gate, up, activation), col0),)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # slot free again

                        @pl.when(base._live_half(ni, wg, bs, f))
                        def _():
                            for i, (out, at) in enumerate(outs):
                                if i:
                                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                                base._store_rows_from(out, o_smem.at[wg], out_gmem, row0,
                                                      rows, row0 - load0, at, bm)

                weights = rhs_gmem.at[jnp.minimum(seg, g - 1)]
                pipeline(mma, compute_context, base._k_steps(live, k // bk, 0))(
                    lhs_gmem.at[pl.ds(load0, bm)],
                    weights.at[:, pl.ds(ni * cta_n, cta_n)],
                    weights.at[:, pl.ds(f + ni * cta_n, cta_n)],
                    allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def _split_padded(rhs: jax.Array, f: int, f_p: int) -> jax.Array:
    """[g, k, 2f] -> [g, k, 2 f_p]: the gate and up halves each padded to f_p columns."""
    if f_p == f:
        return rhs
    pad = ((0, 0), (0, 0), (0, f_p - f))
    return jnp.concatenate([jnp.pad(rhs[..., :f], pad), jnp.pad(rhs[..., f:], pad)], -1)


@sharding.local_operands("grouped_mlp")
def gate_up(
    lhs: Shaped[Array, "m k"],
    rhs: Shaped[Array, "g k two_f"],
    group_sizes: Int[Array, " G"],
    *,
    activation: str = "swiglu",
    group_offset=None,
    out_dtype: Any = None,
    block_sizes: base.MosaicGpuBlockSizes | None = None,
    interpret: bool = False,
) -> Shaped[Array, "m f"]:
    """h[rows of group i] = act(lhs_i W_gate[i]) * (lhs_i W_up[i]), W_gate = rhs[..., :f],
    W_up = rhs[..., f:]; fp32 sums, rounded once to out_dtype (lhs's when None). rhs
    holds groups [group_offset, group_offset + g) of group_sizes (all when None); rows of
    no local group are zero. block_sizes: block_n is h's columns per consumer (a tile is
    2 * block_n wide); warp_specialized must be True."""
    epilogue.check_gate_up(lhs, rhs, activation)
    base._check_gmm(lhs, rhs, group_sizes, False, group_offset)
    bs = _checked_blocks(block_sizes)
    return _call(lhs, rhs, group_sizes, None, activation=activation,
                 group_offset=group_offset, out_dtype=out_dtype, bs=bs, interpret=interpret)


@sharding.local_operands("grouped_mlp")
def gate_up_grad(
    lhs: Shaped[Array, "m k"],
    rhs: Shaped[Array, "g k two_f"],
    group_sizes: Int[Array, " G"],
    dh: Shaped[Array, "m f"],
    *,
    activation: str = "swiglu",
    group_offset=None,
    out_dtype: Any = None,
    block_sizes: base.MosaicGpuBlockSizes | None = None,
    interpret: bool = False,
) -> Shaped[Array, "m two_f"]:
    """d(pre) [m, 2f] = [act'(gate) up dh, act(gate) dh] for h = act(gate) * up, the
    pre-activation (gate | up) = lhs_i rhs[i] recomputed in the kernel (fp32 sums, never
    stored), rounded once to out_dtype (lhs's when None); rows of no local group zero.
    dh is read in lhs's dtype. The gate-up's backward feeds it to the grouped dx and
    dkernel."""
    epilogue.check_gate_up(lhs, rhs, activation, dh)
    base._check_gmm(lhs, rhs, group_sizes, False, group_offset)
    return _call(lhs, rhs, group_sizes, dh.astype(lhs.dtype), activation=activation,
                 group_offset=group_offset, out_dtype=out_dtype,
                 bs=_checked_blocks(block_sizes), interpret=interpret)


def _cooperative(bs: base.MosaicGpuBlockSizes, width: int, in_dtype, out_dtype,
                 epilogue_kind: str) -> tuple[base.MosaicGpuBlockSizes, int]:
    """(blocks, padded width) for the down product's epilogues on the gmm's cooperative
    warp-specialised kernel: the given (tuned) tiles run as the cooperative kernel; where
    those and the epilogue's scratch leave no two stages in shared memory, the gmm's
    128 x (2 x 128) default, then 128 x (2 x 64). The backward's epilogue stores in
    64-column strips, so that the consumers' h tiles fit beside two stages of
    128 x (2 x 128) tiles (two 48 KiB stages, 32 KiB of strips, 66 KiB of h and
    weights; mixtral's tuned 192-row dx tiles leave room for one). The width is padded
    to whole tiles, so h's last TMA box stays inside it."""
    in_bytes, out_bytes = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    grad = epilogue_kind == "scaled_grad"
    narrow = dataclasses.replace(base.GMM_WARP_SPECIALIZED, block_n=64, epilogue_block_n=None)
    for blocks in (bs, base.GMM_WARP_SPECIALIZED, narrow):
        blocks = base._fit_block_n(
            dataclasses.replace(blocks, warp_specialized=True, pingpong=False), width)
        if grad and blocks.block_n > 64 and blocks.block_n % 64 == 0:
            blocks = dataclasses.replace(blocks, epilogue_block_n=64)
        padded = -(-width // (2 * blocks.block_n)) * 2 * blocks.block_n
        blocks = base._fit_warp_specialized(
            blocks, padded, in_bytes, out_bytes,
            base.epilogue_scratch_bytes(blocks, epilogue_kind, in_bytes))
        if blocks.warp_specialized:
            return blocks, padded
    raise ValueError(f"the down product's {epilogue_kind} epilogue: no tiles leave two "
                     f"stages in shared memory for width {width}")


@sharding.local_operands("grouped_mlp")
def down_weighted(
    h: Shaped[Array, "m f"],
    rhs: Shaped[Array, "g f n"],
    group_sizes: Int[Array, " G"],
    row_weights: Shaped[Array, " m"],
    *,
    group_offset=None,
    out_dtype: Any = None,
    block_sizes: base.MosaicGpuBlockSizes | None = None,
    interpret: bool = False,
) -> Shaped[Array, "m n"]:
    """y[rows of group i] = (h_i rhs[i]) * row_weights: the grouped gmm's cooperative
    warp-specialised kernel, whose consumers bring their tile's weights in by TMA while the
    k loop runs and scale the fp32 sums before the one rounding to out_dtype (h's when
    None); rows of no local group are zero. block_sizes: None takes the gmm's (tuned)
    forward blocks; a ping-pong or one-warpgroup choice runs as the cooperative kernel
    with the same tiles (the ping-pong kernel has no such epilogue)."""
    epilogue.check_down(h, rhs, row_weights)
    base._check_gmm(h, rhs, group_sizes, False, group_offset)
    out_dtype = jnp.dtype(out_dtype or h.dtype)
    m, f = h.shape
    g, n = rhs.shape[0], rhs.shape[2]
    if 0 in (m, f, n) or g == 0:
        return jnp.zeros((m, n), out_dtype)
    bs = base.resolve_block_sizes(block_sizes, product="forward", m=m, k=f, n=n,
                                  g=group_sizes.shape[0], dtype=h.dtype, interpret=interpret)
    bs, _ = _cooperative(bs, n, h.dtype, out_dtype, "scaled")
    h_p = base._pad_axis(base._pad_axis(h, 1, bs.block_k), 0, 8, bs.block_m)
    rhs_p = base._pad_axis(base._pad_axis(rhs, 1, bs.block_k), 2, bs.block_n)
    weights = base._pad_axis(row_weights.astype(_F32), 0, 8, bs.block_m)
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    return base._gmm_local(h_p, rhs_p, sizes, row_start, transpose_rhs=False,
                           out_dtype=out_dtype, bs=bs, interpret=interpret,
                           row_weights=weights)[:m, :n]


@sharding.local_operands("grouped_mlp")
def down_weighted_grad(
    dy: Shaped[Array, "m n"],
    rhs: Shaped[Array, "g f n"],
    group_sizes: Int[Array, " G"],
    row_weights: Shaped[Array, " m"],
    h: Shaped[Array, "m f"],
    *,
    group_offset=None,
    block_sizes: base.MosaicGpuBlockSizes | None = None,
    interpret: bool = False,
    dh_dtype=None,
):
    """The down product's backward for h: t = dy_i rhs[i]^T (the gmm's dx, fp32 sums),
    then in the epilogue dh = row_weights * t (in dh_dtype, h's when None) and each row's
    share of d row_weights, the sum of h * t over the consumer's columns (h's tile in by
    TMA during the k loop), summed over the shares after. Returns (dh [m, f],
    d row_weights [m] fp32), with no pass over y and t never in memory. block_sizes:
    None takes the gmm's (tuned) dx blocks, run as the cooperative kernel."""
    epilogue.check_down(h, rhs, row_weights, dy)
    base._check_gmm(dy, rhs, group_sizes, True, group_offset)
    dh_dtype = jnp.dtype(dh_dtype or h.dtype)
    m, f = h.shape
    g, n = rhs.shape[0], rhs.shape[2]
    if 0 in (m, f, n) or g == 0:
        return jnp.zeros((m, f), dh_dtype), jnp.zeros((m,), _F32)
    # The gmm's dx: contraction n, output f (tuning keys take the projection's dims).
    bs = base.resolve_block_sizes(block_sizes, product="dx", m=m, k=f, n=n,
                                  g=group_sizes.shape[0], dtype=h.dtype, interpret=interpret)
    bs, f_p = _cooperative(bs, f, h.dtype, dh_dtype, "scaled_grad")
    dy_p = base._pad_axis(base._pad_axis(dy, 1, bs.block_k), 0, 8, bs.block_m)
    rhs_p = base._pad_axis(base._pad_axis(rhs, 2, bs.block_k), 1, f_p)
    h_p = base._pad_axis(base._pad_axis(h, 1, f_p), 0, 8, bs.block_m)
    weights = base._pad_axis(row_weights.astype(_F32), 0, 8, bs.block_m)
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    dh, d_rw = base._gmm_local(dy_p, rhs_p, sizes, row_start, transpose_rhs=True,
                               out_dtype=dh_dtype, bs=bs, interpret=interpret,
                               row_weights=weights, grad_of=h_p)
    return dh[:m, :f], d_rw[:m]


def _checked_blocks(block_sizes):
    bs = block_sizes or GATE_UP_DEFAULT
    if not bs.warp_specialized or bs.pingpong:
        raise ValueError(f"gate_up runs the cooperative warp-specialised kernel only; got "
                         f"{bs}")
    return bs


def _call(lhs, rhs, group_sizes, dh, *, activation, group_offset, out_dtype, bs, interpret):
    """The forward (dh None: h [m, f]) or gradient (d(pre) [m, 2f]) kernel's call."""
    grad = dh is not None
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    m, k = lhs.shape
    g, f = rhs.shape[0], rhs.shape[2] // 2
    if m == 0 or f == 0 or g == 0:
        return jnp.zeros((m, 2 * f if grad else f), out_dtype)
    bs = base._fit_block_n(bs, f)
    stages = _stages_that_fit(bs, jnp.dtype(lhs.dtype).itemsize, out_dtype.itemsize, grad)
    if stages < 2:
        raise ValueError(f"gate_up: {bs} does not fit two stages in shared memory")
    bs = dataclasses.replace(bs, stages=stages, epilogue_block_n=None)
    f_p = -(-f // bs.block_n) * bs.block_n
    lhs_p = base._pad_axis(base._pad_axis(lhs, 1, bs.block_k), 0, 8, bs.block_m)
    rhs_p = base._pad_axis(_split_padded(rhs, f, f_p), 1, bs.block_k)
    extra = () if not grad else (base._pad_axis(base._pad_axis(dh, 1, bs.block_n), 0, 8,
                                                bs.block_m),)
    k_p, m_p = lhs_p.shape[1], lhs_p.shape[0]
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    table, count = base._row_tile_table(sizes, m_p, bs.block_m, row_start)
    out_type = sharding.out_struct((m_p, 2 * f_p if grad else f_p), out_dtype, like=lhs)
    cost = costs.gate_up(m_p, k_p, f_p, lhs.dtype, activation, grad=grad,
                         inputs=(table, count, lhs_p, rhs_p, *extra), outputs=(out_type,))
    call = pl.kernel(
        _gate_up_kernel(k_p, f_p, g, bs, activation, grad),
        out_type=out_type,
        mesh=base._mesh(bs, interpret),
        compiler_params=base._compiler_params(),
        interpret=base._interpret_params(interpret),
        cost_estimate=cost,
        name="grouped_mlp_gate_up_grad_mosaic_gpu" if grad else "grouped_mlp_gate_up_mosaic_gpu",
    )
    out = call(table, count, lhs_p, rhs_p, *extra)
    if not grad:
        return out[:m, :f]
    return jnp.concatenate([out[:m, :f], out[:m, f_p:f_p + f]], axis=1)
