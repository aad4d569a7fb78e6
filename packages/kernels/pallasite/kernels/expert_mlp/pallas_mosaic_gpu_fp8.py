"""grouped_mlp's fp8 products on Hopper (sm90) through Pallas Mosaic GPU: the gate-up
with the activation and h's quantization in its epilogue, its backward half, and the
down product with the row weights in its epilogue. The same functions as
pallas_triton_fp8.py, so that ops.mlp_fp8 runs either backend.

gate_up_quantized is grouped_matmul.pallas_mosaic_gpu_fp8's gmm (e4m3 wgmma, each
128-deep step promoted to fp32 with its block scales; a producer warpgroup and two
consumers of 64 rows) with its B tiles paired, epilogue "quantized_h": a stage holds the
x tile and the 128 x 128 gate and up weight tiles of one column tile of h, and a
consumer keeps a gate and an up total, 64 x 128 fp32 each, promoting one fresh
accumulator at a time (gate, then up). A tile's 128 columns of h are one 1 x 128 block of
each row, so the epilogue forms h = act(gate) * up in fp32, takes each row's amax over
them, and stores h's e4m3 values [m, f] by TMA and the row scales into a per-tile slot,
assembled into [f / 128, m] after (grouped_matmul.pallas_mosaic_gpu_fp8.h_scales): the
layout the fp8 down product reads its lhs in. h is never written in 16 bits. Rows of no
local group come out as the quantizer makes zeros: values 0, scale 1.

gate_up_grad_quantized is the same paired product with epilogue "d_pre": each
consumer's dh tile comes in by TMA while its k loop runs, and d(pre) = [act'(gate) up dh,
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
the Mosaic GPU interpreter on a CPU; its GPU tests pass on an H100 (2026-12-05), where
the paired gate-up ran at about half the fp8 gmm's rate at mixtral's dims
(docs/grouped_mlp.md, "The fp8 fused route on Mosaic GPU").
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int, Shaped

from pallasite.kernels import sharding
from pallasite.kernels.expert_mlp import costs, epilogue
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu_fp8 as base
from pallasite.reference import quantization as ref

FP8 = base.FP8
BLOCK = base.BLOCK


def _quantized_h(gate, up, activation: str):
    """(h's e4m3 values, one scale per row) for h = act(gate) * up over a consumer's
    64 x 128 tile, whose rows' 128 columns are one 1 x 128 block each: the oracle's amax,
    scale and rounding (pallasite.reference.quantization), the broadcast written out."""
    h = epilogue.gated(gate, up, activation)
    scale, inverse = ref.scale_and_inverse(ref.amax(h, axis=1), FP8)
    return ref.to_fp8(h, lax.broadcast_in_dim(inverse, h.shape, [0]), FP8), scale


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
    return _paired(lhs, rhs, group_sizes, "quantized_h", (), FP8,
                   lambda gate, up: _quantized_h(gate, up, activation), activation,
                   group_offset, block_sizes, interpret, "grouped_mlp_gate_up_fp8_mosaic_gpu")


def _paired(lhs, rhs, group_sizes, kind, extra, out_dtype, finish, activation, group_offset,
            block_sizes, interpret, name):
    """lhs quantized in 1 x 128 blocks and rhs in 128 x 128 (written K-major, [g, 2f, k]),
    then the fp8 gmm with the gate and up tiles paired and epilogue `kind`."""
    base._check(lhs, rhs, group_sizes)
    (m, k), f = lhs.shape, rhs.shape[2] // 2
    epilogue.check_fp8_f(f, BLOCK)
    q = base._quantizer(interpret)
    lhs_q, lhs_scales_t = q.rows(lhs, FP8)
    rhs_q, rhs_scales = q.weight_blocks(rhs, FP8, transpose=True)
    return base.gmm_call(
        lhs_q, lhs_scales_t, rhs_q, rhs_scales, group_sizes, f, group_offset=group_offset,
        out_dtype=out_dtype, bs=block_sizes or base.DEFAULT, interpret=interpret,
        epilogue=kind, extra=extra, finish=finish,
        cost_of=lambda **io: costs.gate_up(m, k, f, FP8, activation, grad=bool(extra), **io),
        name=name)


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
    return _paired(lhs, rhs, group_sizes, "d_pre", (dh.astype(out_dtype),), out_dtype,
                   lambda gate, up, dh: epilogue.d_pre(gate, up, dh, activation), activation,
                   group_offset, block_sizes, interpret,
                   "grouped_mlp_gate_up_grad_fp8_mosaic_gpu")


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
