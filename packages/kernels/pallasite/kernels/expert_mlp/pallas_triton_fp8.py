"""grouped_mlp's gate-up product in fp8, with the activation and h's quantization in the
epilogue, through Pallas Triton (CUDA GPUs from sm89): h leaves the kernel in e4m3.

It is grouped_matmul.pallas_triton_fp8's gmm with the gate and up blocks paired, as
expert_mlp.pallas_triton pairs them in 16 bits: x in 1 x 128 blocks, the [g, k, 2f]
kernel in 128 x 128 blocks (K-major, [g, 2f, k]), two fp32 accumulators, each 128-deep
step's dot promoted with its scales. A program's 128 columns of h are one 1 x 128 block
per row, so the epilogue quantizes them where they are: h = act(gate) * up in fp32, each
row's amax over the tile's columns gives its scale (the oracle's scale and rounding,
pallasite.reference.quantization), and the tile stores h's e4m3 values [m, f] and the
scales transposed [f / 128, m]: the layout in which the fp8 down product
(grouped_matmul.pallas_triton_fp8.gmm_quantized) reads its lhs. So h is never written
in 16 bits and never quantized by a separate pass. Rows of no local group come out as
the quantizer makes zeros: values 0, scale 1.

gate_up_grad_quantized is the backward's half: the same paired product recomputed, then
d(pre) = [act'(gate) up dh, act(gate) dh] stored in the compute dtype (pallas_triton's
epilogue), so the pre-activation is never written. down_weighted_quantized is the down
product on h as stored, the row weights applied to its fp32 sums in the epilogue
(pallas_triton's), y rounded once; down_weighted_grad_quantized its backward for h (dh
and d row_weights from the tiles of t = dy W_down^T in the epilogue, t never stored).

f must be a multiple of 128, so that each column tile's up columns are one weight-scale
block. Each of num_stages holds an x tile and the two weight tiles (one byte per
element). Lowered for an H200 and run by the interpreter on a CPU; its GPU tests pass
on an H100 (2026-12-05), where on Hopper the Mosaic GPU kernels
(pallas_mosaic_gpu_fp8.py) run the route faster (docs/grouped_mlp.md, "fp8").
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int, Shaped

from pallasite.kernels import sharding
from pallasite.kernels.expert_mlp import costs, epilogue
from pallasite.kernels.expert_mlp import pallas_triton as triton16
from pallasite.kernels.grouped_matmul import config, fit, triton_fit
from pallasite.kernels.grouped_matmul import pallas_triton_fp8 as base
from pallasite.kernels.quantization import api as quantization
from pallasite.reference import quantization as ref

FP8 = base.FP8
BLOCK = base.BLOCK
# The fp8 gmm's measured tile (64 rows, one 128 x 128 weight block per step) with two
# weight tiles per stage; stages: the most of 4, 3, 2 that fit (_default). Not tuned.
GATE_UP_FP8 = dataclasses.replace(base.GMM_FP8, num_stages=4)


def pair_shared_memory_bytes(bs: config.TritonBlockSizes) -> int:
    """Shared memory of `bs` on the paired product: an x tile and two weight tiles a stage."""
    return triton_fit.shared_memory_bytes(dataclasses.replace(bs, block_n=2 * bs.block_n), 1,
                                          "forward")


def block_sizes_reason(bs: config.TritonBlockSizes, *, caller: bool) -> str | None:
    """Why `bs` cannot tile the paired fp8 gate-up (None: it can)."""
    if (bs.block_k, bs.block_n) != (BLOCK, BLOCK):
        return (f"block_k={bs.block_k}, block_n={bs.block_n}: the fp8 gate-up steps one "
                f"128-deep scale step over 128 columns of h (one 1 x 128 block of it)")
    if bs.block_m not in (64, 128):
        return f"block_m={bs.block_m}: the fp8 gate-up tiles 64 or 128 rows"
    budget = fit.triton_budget(caller)
    need = pair_shared_memory_bytes(bs)
    if budget is not None and need > budget:
        return f"{bs.num_stages} stages need {need} bytes of shared memory > {budget}"
    return None


def _default() -> config.TritonBlockSizes:
    for stages in (4, 3, 2):
        bs = dataclasses.replace(GATE_UP_FP8, num_stages=stages)
        if block_sizes_reason(bs, caller=False) is None:
            return bs
    return bs


@sharding.local_operands("grouped_mlp")
def gate_up_quantized(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "g k two_f"],
    group_sizes: Int[Array, " G"],
    *,
    activation: str = "swiglu",
    group_offset=None,
    block_sizes: config.TritonBlockSizes | None = None,
    interpret: bool = False,
) -> tuple[Shaped[Array, "m f"], Float[Array, "fb m"]]:
    """(h's e4m3 values [m, f], their fp32 scales [f / 128, m]) for h[rows of group i] =
    act(Q(lhs_i) Q(W_gate[i])) * (Q(lhs_i) Q(W_up[i])), W_gate = rhs[..., :f], W_up =
    rhs[..., f:], quantized in 1 x 128 blocks of h's rows. lhs and rhs are floating (up to
    fp32) and quantized here: lhs in 1 x 128 blocks, rhs in 128 x 128. rhs holds groups
    [group_offset, group_offset + g) of group_sizes (all when None); rows of no local
    group are zero (scale 1). f must be a multiple of 128."""
    epilogue.check_gate_up(lhs, rhs, activation)
    m, f = lhs.shape[0], rhs.shape[2] // 2
    if 0 in lhs.shape or f == 0 or rhs.shape[0] == 0:
        return jnp.zeros((m, f), FP8), jnp.ones((f // BLOCK, m), jnp.float32)
    outputs = (((m, f), FP8), ((f // BLOCK, m), jnp.float32))
    return _paired_call(lhs, rhs, group_sizes, outputs, (), "grouped_mlp_gate_up_fp8_triton",
                        functools.partial(_store_quantized_h, activation=activation),
                        activation, False, group_offset, block_sizes, interpret)


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
    block_sizes: config.TritonBlockSizes | None = None,
    interpret: bool = False,
) -> Shaped[Array, "m two_f"]:
    """d(pre) [m, 2f] = [act'(gate) up dh, act(gate) dh] in out_dtype, the gate and up
    sums recomputed in the kernel from Q(lhs) and Q(rhs) as gate_up_quantized forms them
    (never stored): the fp8 route's backward feeds it to the dx and dkernel products.
    dh [m, f] is read in its own dtype; rows of no local group are zero."""
    epilogue.check_gate_up(lhs, rhs, activation, dh)
    m, f = lhs.shape[0], rhs.shape[2] // 2
    if 0 in lhs.shape or f == 0 or rhs.shape[0] == 0:
        return jnp.zeros((m, 2 * f), out_dtype)
    return _paired_call(lhs, rhs, group_sizes, (((m, 2 * f), jnp.dtype(out_dtype)),), (dh,),
                        "grouped_mlp_gate_up_grad_fp8_triton",
                        functools.partial(triton16._store_d_pre, activation=activation, f=f),
                        activation, True, group_offset, block_sizes, interpret)[0]


def _paired_call(lhs, rhs, group_sizes, outputs, extra, name, store, activation, grad,
                 group_offset, block_sizes, interpret):
    """lhs and rhs quantized (1 x 128 rows; 128 x 128 blocks, written K-major [g, 2f, k]),
    then the fp8 gmm with the gate and up tiles paired and `store` as its epilogue."""
    base._check(lhs, rhs, group_sizes)
    m, k = lhs.shape
    f = rhs.shape[2] // 2
    epilogue.check_fp8_f(f, BLOCK)
    if block_sizes is not None and (why := block_sizes_reason(block_sizes, caller=True)):
        raise ValueError(f"block_sizes: {why}")
    q = quantization.quantizer(interpret)
    lhs_q, lhs_scales_t = q.rows(lhs, FP8, interpret=interpret)
    # [g, 2f, k], K-major
    rhs_q, rhs_scales = q.weight_blocks(rhs, FP8, transpose=True, interpret=interpret)
    base._check_offsets(lhs=lhs_q, rhs=rhs_q)
    return base.gmm_call(
        lhs_q, lhs_scales_t, rhs_q, rhs_scales, group_sizes, f, block_sizes or _default(),
        group_offset=group_offset, interpret=interpret, outputs=outputs, name=name,
        pair=True, epilogue=store, extra=extra,
        cost_of=functools.partial(costs.gate_up, m, k, f, FP8, activation, grad=grad))


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
    block_sizes: config.TritonBlockSizes | None = None,
    interpret: bool = False,
) -> Shaped[Array, "m n"]:
    """y[rows of group i] = (dequant(h) Q(rhs[i])) * row_weights in out_dtype: h as
    gate_up_quantized stores it (e4m3 values, scales [f / 128, m]), rhs floating and
    quantized here in 128 x 128 blocks; the fp32 sums scaled by each row's weight in the
    epilogue (pallas_triton's down epilogue), y rounded once. Rows of no local group are
    zero."""
    m, f = h.shape
    n = rhs.shape[2]
    if 0 in (m, f, n) or rhs.shape[0] == 0:
        return jnp.zeros((m, n), out_dtype)
    q = quantization.quantizer(interpret)
    # [g, n, f], K-major
    rhs_q, rhs_scales = q.weight_blocks(rhs, FP8, transpose=True, interpret=interpret)
    base._check_offsets(lhs=h, rhs=rhs_q)
    bs = base.resolve_block_sizes(block_sizes, product="forward", m=m, k=f, n=n,
                                  g=group_sizes.shape[0], interpret=interpret)
    return base.gmm_call(
        h, h_scales_t, rhs_q, rhs_scales, group_sizes, n, bs, group_offset=group_offset,
        interpret=interpret, outputs=(((m, n), jnp.dtype(out_dtype)),),
        name="grouped_mlp_down_fp8_triton", epilogue=triton16._store_weighted,
        extra=(row_weights,),
        cost_of=functools.partial(costs.down_weighted, m, f, n, FP8, grad=False))[0]


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
    block_sizes: config.TritonBlockSizes | None = None,
    interpret: bool = False,
):
    """The fp8 down product's backward for h: t = Q(dy_i) Q(rhs[i])^T (fp32 sums; dy in
    1 x 128 blocks, rhs in 128 x 128, read as stored), then in the epilogue (the 16-bit
    down kernel's) dh = row_weights * t in dh_dtype and each row's share of d row_weights,
    the sum over the tile's columns of h * t. Returns (dh [m, f], d row_weights [m] fp32):
    t never reaches memory. h is read in its own dtype (the forward's h, dequantized)."""
    m, n = dy.shape
    f = rhs.shape[1]
    if 0 in (m, f, n) or rhs.shape[0] == 0:
        return jnp.zeros((m, f), dh_dtype), jnp.zeros((m,), jnp.float32)
    base._check(dy, rhs, group_sizes)
    q = quantization.quantizer(interpret)
    dy_q, dy_scales_t = q.rows(dy, FP8, interpret=interpret)
    # [g, f, n], as stored
    rhs_q, rhs_scales = q.weight_blocks(rhs, FP8, transpose=False, interpret=interpret)
    base._check_offsets(lhs=dy_q, rhs=rhs_q)
    bs = base.resolve_block_sizes(block_sizes, product="dx", m=m, k=f, n=n,
                                  g=group_sizes.shape[0], interpret=interpret)
    dh, parts = base.gmm_call(
        dy_q, dy_scales_t, rhs_q, rhs_scales, group_sizes, f, bs, group_offset=group_offset,
        interpret=interpret, name="grouped_mlp_down_grad_fp8_triton",
        outputs=(((m, f), jnp.dtype(dh_dtype)), ((m, -(-f // BLOCK)), jnp.float32)),
        epilogue=triton16._store_dh_and_weight_parts, extra=(row_weights, h),
        cost_of=functools.partial(costs.down_weighted, m, f, n, FP8, grad=True))
    return dh, jnp.sum(parts, axis=1)


def _store_quantized_h(sums, extra, outs, tile, *, activation):
    """h = act(gate) * up for the tile's rows, quantized per row over its 128 columns."""
    del extra
    values_ref, scales_ref = outs
    if sums is None:
        h = jnp.zeros(tile.shape, jnp.float32)
    else:
        h = epilogue.gated(*sums, activation)
    scale, inverse = ref.scale_and_inverse(ref.amax(h, axis=1), FP8)
    plgpu.store(values_ref.at[tile.rows, tile.cols], ref.to_fp8(h, inverse[:, None], FP8),
                mask=tile.store_ok)
    plgpu.store(scales_ref.at[tile.col, tile.rows], scale, mask=tile.row_ok)
