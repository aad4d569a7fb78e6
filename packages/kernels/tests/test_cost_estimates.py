"""Every pallas_call's cost estimate (32 call sites: the grouped gmm and tgmm of three
backends, the fp8 gmm and tgmm of two, grouped_mlp's paired fp8 gate-up on Mosaic GPU,
the three fp8 quantizers, five SSD Triton kernels,
the SSD Mosaic TPU forward and backward, the two decode steps, the chunked gated delta
rule's three forward and three backward Triton kernels and its Mosaic TPU forward and
backward, grouped_mlp's Mosaic GPU gate-up; its Triton gate-up and down kernels share the
Triton gmm's call site and are checked too) against a hand count.

The estimates come from pl.estimate_cost on each call's body-equivalent function and the
bytes of the call's operands and results (pallasite.kernels.cost). The hand counts below
are written from the kernels: 2*m*k*n per matmul, one flop per element of an elementwise
op, one transcendental per exp; selects, casts and reductions are not counted.
"""

from __future__ import annotations

import ast
import glob
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_testlib
from pallasite.kernels import cost
from pallasite.kernels.grouped_matmul import MosaicTpuBlockSizes, group_metadata
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu, pallas_mosaic_tpu, pallas_triton
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu_fp8, pallas_triton_fp8
from pallasite.kernels.grouped_matmul import token_blocks
from pallasite.kernels.quantization import pallas_triton as quantize_triton
from pallasite.kernels.gated_delta import pallas_triton as delta_triton
from pallasite.kernels.gated_delta import step_pallas_triton as delta_step_triton
from pallasite.kernels.ssd_decode import pallas_triton as decode_triton
from pallasite.kernels.ssd import costs as ssd_costs
from pallasite.kernels.ssd import pallas_mosaic_tpu as ssd_tpu
from pallasite.kernels.ssd import pallas_triton as ssd_triton

S = jax.ShapeDtypeStruct
F32, BF16, F8, I32 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.int32


def _calls(fn, *args):
    """{name: [CostEstimate, ...]} of every kernel call `fn` traces."""
    found = {}
    for eqn in jaxpr_testlib.traced_pallas_calls(fn, *args):
        found.setdefault(str(eqn.params["name"]), []).append(eqn.params["cost_estimate"])
    return found


def _bytes(*shapes_and_dtypes):
    return sum(math.prod(s) * np.dtype(d).itemsize for s, d in shapes_and_dtypes)


def _check(estimate, flops, transcendentals, bytes_accessed):
    assert (estimate.flops, estimate.transcendentals, estimate.bytes_accessed) == (
        flops, transcendentals, bytes_accessed)


def test_io_bytes_and_estimate():
    x = S((3, 5), BF16)
    est = cost.estimate(lambda a: jnp.exp(a) * a, x, inputs=(x, None), outputs=(S((2,), F32),))
    _check(est, 15, 15, 3 * 5 * 2 + 2 * 4)


# ------------------------------------------------------------------- grouped matmuls

M, K, N, G = 100, 48, 40, 3
SIZES = jnp.array([30, 0, 50], jnp.int32)
SMALL = pallas_triton.config.TritonBlockSizes(16, 16, 16, group_m=2)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_grouped_triton(transpose_rhs):
    lhs, dy = S((M, K), BF16), S((M, N), BF16)
    rhs = S((G, N, K) if transpose_rhs else (G, K, N), BF16)
    (gmm,), = _calls(lambda a, w: pallas_triton.gmm(
        a, w, SIZES, transpose_rhs=transpose_rhs, block_sizes=SMALL), lhs, rhs).values()
    visits = group_metadata.num_visits(M, G, SMALL.block_m)
    _check(gmm, 2 * M * K * N, 0, 3 * visits * 4 + _bytes(((M, K), BF16), ((G, K, N), BF16),
                                                           ((M, N), BF16)))
    (tgmm,), = _calls(lambda a, b: pallas_triton.tgmm(a, b, SIZES, block_sizes=SMALL),
                      lhs, dy).values()
    _check(tgmm, 2 * M * K * N, 0, (G + 1) * 4 + _bytes(((M, K), BF16), ((M, N), BF16),
                                                        ((G, K, N), BF16)))


def test_grouped_mosaic_tpu():
    """The padded problem (tiles of 128): m 100 -> 128, k 48 -> 128, n 40 -> 128."""
    bs = MosaicTpuBlockSizes(128, 128, 128)
    lhs, rhs, dy = S((M, K), BF16), S((G, K, N), BF16), S((M, N), BF16)
    mp = kp = np_ = 128
    visits = group_metadata.num_visits(mp, G, 128)
    (gmm,), = _calls(lambda a, w: pallas_mosaic_tpu.gmm(a, w, SIZES, block_sizes=bs),
                     lhs, rhs).values()
    _check(gmm, 2 * mp * kp * np_, 0, 4 * visits * 4 + _bytes(
        ((mp, kp), BF16), ((G, kp, np_), BF16), ((mp, np_), BF16)))
    (tgmm,), = _calls(lambda a, b: pallas_mosaic_tpu.tgmm(a, b, SIZES, block_sizes=bs),
                      lhs, dy).values()
    _check(tgmm, 2 * mp * kp * np_, 0, 4 * visits * 4 + _bytes(
        ((mp, kp), BF16), ((mp, np_), BF16), ((G, kp, np_), BF16)))


def test_grouped_mosaic_gpu():
    """The padded problem (64-blocks): m 100 -> 104 (8-aligned), k 48 -> 64, n 40 -> 64;
    the row-tile table [4, T] and its count ride along (gmm), the group bounds (tgmm)."""
    bs = pallas_mosaic_gpu.MosaicGpuBlockSizes(64, 64, 64, stages=2, grid_block_n=2)
    lhs, rhs, dy = S((M, K), BF16), S((G, K, N), BF16), S((M, N), BF16)
    mp, kp, np_ = 104, 64, 64
    (gmm,), = _calls(lambda a, w: pallas_mosaic_gpu.gmm(a, w, SIZES, block_sizes=bs),
                     lhs, rhs).values()
    table, count = jax.eval_shape(
        lambda s: pallas_mosaic_gpu._row_tile_table(s, mp, 64), SIZES)
    _check(gmm, 2 * mp * kp * np_, 0, _bytes(
        (table.shape, jnp.int32), (count.shape, jnp.int32), ((mp, kp), BF16),
        ((G, kp, np_), BF16), ((mp, np_), BF16)))
    (tgmm,), = _calls(lambda a, b: pallas_mosaic_gpu.tgmm(a, b, SIZES, block_sizes=bs),
                      lhs, dy).values()
    mr = 128  # rows padded to a 64-multiple
    _check(tgmm, 2 * mr * kp * np_, 0, 2 * G * 4 + _bytes(
        ((mr, kp), BF16), ((mr, np_), BF16), ((G, kp, np_), BF16)))


# ------------------------------------------------------------ grouped_mlp's fused kernels

# Per element of the epilogue's [m, f] (gate-up) result: swiglu's act(gate) * up is a
# negation, an exp, an add, a divide and a product (4 flops, 1 exp); geglu's is 8 flops
# and a tanh before the product (9, 1). The gradient's (act'(gate) up dh, act(gate) dh):
# swiglu 3 for the sigmoid, 1 for act, 4 for act', 3 for the products (11, 1); geglu 5
# for the tanh's argument, 4 for its derivative, 3 for act, 8 for act', 3 (23, 1).
_EPILOGUE = {("swiglu", False): 4, ("swiglu", True): 11, ("geglu", False): 9,
             ("geglu", True): 23}
F_MLP = 40


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_grouped_mlp_gate_up_mosaic_gpu(activation):
    """The padded problem: m 100 -> 104, k 48 -> 64, f 40 -> 64 (gate and up each)."""
    from pallasite.kernels.expert_mlp import pallas_mosaic_gpu as fused

    bs = pallas_mosaic_gpu.MosaicGpuBlockSizes(64, 64, 64, stages=2, grid_block_n=2,
                                               warp_specialized=True)
    lhs, rhs, dh = S((M, K), BF16), S((G, K, 2 * F_MLP), BF16), S((M, F_MLP), BF16)
    mp, kp, fp = 104, 64, 64
    table, count = jax.eval_shape(lambda s: pallas_mosaic_gpu._row_tile_table(s, mp, 64),
                                  SIZES)
    meta = _bytes((table.shape, I32), (count.shape, I32))
    operands = _bytes(((mp, kp), BF16), ((G, kp, 2 * fp), BF16))
    (fwd,), = _calls(lambda a, w: fused.gate_up(a, w, SIZES, activation=activation,
                                                block_sizes=bs), lhs, rhs).values()
    _check(fwd, 2 * mp * kp * 2 * fp + _EPILOGUE[activation, False] * mp * fp, mp * fp,
           meta + operands + _bytes(((mp, fp), BF16)))
    (grad,), = _calls(lambda a, w, d: fused.gate_up_grad(a, w, SIZES, d, activation=activation,
                                                         block_sizes=bs),
                      lhs, rhs, dh).values()
    _check(grad, 2 * mp * kp * 2 * fp + _EPILOGUE[activation, True] * mp * fp, mp * fp,
           meta + operands + _bytes(((mp, fp), BF16), ((mp, 2 * fp), BF16)))


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_grouped_mlp_triton(activation):
    """Unpadded (masked) problems: the gate-up and its gradient; the down product with
    the row weights (one product per output) and its gradient (dh and the row sums of
    h * t: two per [m, f] element, one partial per 16-column tile)."""
    from pallasite.kernels.expert_mlp import pallas_triton as fused

    lhs, rhs, dh = S((M, K), BF16), S((G, K, 2 * F_MLP), BF16), S((M, F_MLP), BF16)
    meta = 3 * group_metadata.num_visits(M, G, SMALL.block_m) * 4
    operands = _bytes(((M, K), BF16), ((G, K, 2 * F_MLP), BF16))
    (fwd,), = _calls(lambda a, w: fused.gate_up(a, w, SIZES, activation=activation,
                                                block_sizes=SMALL), lhs, rhs).values()
    _check(fwd, 2 * M * K * 2 * F_MLP + _EPILOGUE[activation, False] * M * F_MLP,
           M * F_MLP, meta + operands + _bytes(((M, F_MLP), BF16)))
    (grad,), = _calls(lambda a, w, d: fused.gate_up_grad(a, w, SIZES, d, activation=activation,
                                                         block_sizes=SMALL),
                      lhs, rhs, dh).values()
    _check(grad, 2 * M * K * 2 * F_MLP + _EPILOGUE[activation, True] * M * F_MLP,
           M * F_MLP, meta + operands + _bytes(((M, F_MLP), BF16), ((M, 2 * F_MLP), BF16)))
    h, down, rw, dy = S((M, F_MLP), BF16), S((G, F_MLP, N), BF16), S((M,), F32), S((M, N), BF16)
    (y,), = _calls(lambda a, w, r: fused.down_weighted(a, w, SIZES, r, block_sizes=SMALL),
                   h, down, rw).values()
    _check(y, 2 * M * F_MLP * N + M * N, 0, meta + _bytes(
        ((M, F_MLP), BF16), ((G, F_MLP, N), BF16), ((M,), F32), ((M, N), BF16)))
    (back,), = _calls(lambda d, w, r, a: fused.down_weighted_grad(d, w, SIZES, r, a,
                                                                  block_sizes=SMALL),
                      dy, down, rw, h).values()
    tiles = -(-F_MLP // SMALL.block_n)
    _check(back, 2 * M * N * F_MLP + 2 * M * F_MLP, 0, meta + _bytes(
        ((M, N), BF16), ((G, F_MLP, N), BF16), ((M,), F32), ((M, F_MLP), BF16),
        ((M, F_MLP), BF16), ((M, tiles), F32)))


# ------------------------------------------------------------------- fp8 products


QM, QK, QN = 300, 200, 328  # k and n not multiples of 128


def _fp8_operands(contraction, out):
    """lhs [QM, contraction] with its 1 x 128 scales (transposed), rhs [G, out,
    contraction] K-major with its 128 x 128 scales."""
    cb, ob = -(-contraction // 128), -(-out // 128)
    return (S((QM, contraction), F8), S((cb, QM), F32), S((G, out, contraction), F8),
            S((G, ob, cb), F32))


def _token_operands():
    """x and dy as the fp8 dkernel reads them: [columns, 128 * bound], scales [bound,
    columns], for the bound on the token blocks of G groups over QM rows."""
    t = token_blocks.bound(QM, G)
    return (S((QK, 128 * t), F8), S((t, QK), F32), S((QN, 128 * t), F8), S((t, QN), F32)), t


def test_fp8_triton():
    """One product per output tile row: 2*m*k*n over the unpadded dims; bytes of the
    group metadata, the fp8 operands, their scales and the output."""
    bs = pallas_triton.config.TritonBlockSizes(64, 128, 128)
    ops = _fp8_operands(QK, QN)
    (gmm,), = _calls(lambda *a: pallas_triton_fp8.gmm_quantized(*a, SIZES, block_sizes=bs),
                     *ops).values()
    visits = group_metadata.num_visits(QM, G, bs.block_m)
    _check(gmm, 2 * QM * QK * QN, 0, 3 * visits * 4 + _bytes(
        *[(o.shape, o.dtype) for o in ops], ((QM, QN), BF16)))
    tokens, t = _token_operands()
    groups = S((G,), I32)
    (tgmm,), = _calls(lambda *a: pallas_triton_fp8.tgmm_quantized(*a, block_sizes=bs),
                      *tokens, groups, groups).values()
    _check(tgmm, 2 * QK * 128 * t * QN, 0, 2 * G * 4 + _bytes(
        *[(o.shape, o.dtype) for o in tokens], ((G, QK, QN), F32)))


def test_fp8_mosaic_gpu():
    """The padded problem: m 300 -> 304 (8-aligned), k 200 -> 256, n 328 -> 384; the
    row-tile table rides along (gmm), the groups' first block and count (tgmm)."""
    ops = _fp8_operands(QK, QN)
    (gmm,), = _calls(lambda *a: pallas_mosaic_gpu_fp8.gmm_quantized(*a, SIZES), *ops).values()
    mp, kp, np_ = 304, 256, 384
    table, count = jax.eval_shape(lambda s: pallas_mosaic_gpu._row_tile_table(s, mp, 128), SIZES)
    _check(gmm, 2 * mp * kp * np_, 0, _bytes(
        (table.shape, I32), (count.shape, I32), ((mp, kp), F8), ((kp // 128, mp), F32),
        ((G, np_, kp), F8), ((G, np_ // 128, kp // 128), F32), ((mp, np_), BF16)))
    tokens, t = _token_operands()
    groups = S((G,), I32)
    (tgmm,), = _calls(lambda *a: pallas_mosaic_gpu_fp8.tgmm_quantized(*a),
                      *tokens, groups, groups).values()
    p = 128 * t
    _check(tgmm, 2 * kp * p * np_, 0, 2 * G * 4 + _bytes(
        ((kp, p), F8), ((t, kp), F32), ((np_, p), F8), ((t, np_), F32), ((G, kp, np_), F32)))


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_fp8_gate_up_mosaic_gpu(activation):
    """grouped_mlp's paired fp8 gate-up: m 300 -> 304, k 200 -> 256, f 128 (gate and up
    each); its 64-row tile table rides along, the forward writes h's e4m3 values and a
    slot of 64 row scales per (row tile, column tile), the gradient reads dh and writes
    d(pre) [m, 2f]."""
    from pallasite.kernels.expert_mlp import pallas_mosaic_gpu_fp8 as fused

    f, mp, kp = 128, 304, 256
    lhs, lhs_scales, rhs, rhs_scales = _fp8_operands(QK, 2 * f)
    table, count = jax.eval_shape(lambda s: pallas_mosaic_gpu._row_tile_table(s, mp, 64), SIZES)
    ins = _bytes((table.shape, I32), (count.shape, I32), ((mp, kp), F8), ((kp // 128, mp), F32),
                 ((G, 2 * f, kp), F8), ((G, 2 * f // 128, kp // 128), F32))
    (fwd,), = _calls(lambda *a: fused.paired_call(*a, SIZES, kind="quantized_h",
                                                  activation=activation),
                     lhs, lhs_scales, rhs, rhs_scales).values()
    _check(fwd, 2 * mp * kp * 2 * f + _EPILOGUE[activation, False] * mp * f, mp * f,
           ins + _bytes(((mp, f), F8), ((table.shape[1], f // 128, 64), F32)))
    (grad,), = _calls(lambda *a: fused.paired_call(*a[:4], SIZES, kind="d_pre", dh=a[4],
                                                   activation=activation, out_dtype=BF16),
                      lhs, lhs_scales, rhs, rhs_scales, S((QM, f), BF16)).values()
    _check(grad, 2 * mp * kp * 2 * f + _EPILOGUE[activation, True] * mp * f, mp * f,
           ins + _bytes(((mp, f), BF16), ((mp, 2 * f), BF16)))


def test_quantizers():
    """Per element the multiply by the inverse scale: 1 flop (pl.estimate_cost counts
    no abs, compares, selects or casts); bytes of the input, the fp8 values and the
    fp32 scales (token blocks: the table too)."""
    x = S((QM, QK), BF16)
    cb = -(-QK // 128)
    (rows,), = _calls(lambda a: quantize_triton.rows(a, F8), x).values()
    _check(rows, QM * QK, 0, _bytes(((QM, QK), BF16), ((QM, QK), F8), ((cb, QM), F32)))
    t = token_blocks.bound(QM, G)
    (blocks,), = _calls(lambda a, st, r: quantize_triton.token_blocks(a, st, r, F8),
                        x, S((t,), I32), S((t,), I32)).values()
    _check(blocks, QM * QK, 0, _bytes(((QM, QK), BF16), ((t,), I32), ((t,), I32),
                                          ((QK, 128 * t), F8), ((t, QK), F32)))
    w = S((G, QK, QN), BF16)
    nb = -(-QN // 128)
    for transpose in (False, True):
        (weights,), = _calls(lambda a: quantize_triton.weight_blocks(
            a, F8, transpose=transpose), w).values()
        _check(weights, G * QK * QN, 0, _bytes(((G, QK, QN), BF16), ((G, QK, QN), F8),
                                                    ((G, cb, nb), F32)))


# ---------------------------------------------------------------------------- SSD

B, NC, C, H, P, NS, GR = 1, 2, 64, 2, 16, 32, 1
BM = 32
Z = B * NC * H
T = ssd_costs.tiles(C, BM)


def _ssd_args(dtype=BF16):
    return (S((B, NC, C, H, P), dtype), S((B, NC, C, H), F32), S((B, NC, C, GR, NS), dtype),
            S((B, NC, C, GR, NS), dtype), S((B, H, P, NS), F32))


@pytest.mark.parametrize("heads", [1, 2])
def test_ssd_triton(heads):
    x, a, b, c, s0 = _ssd_args()
    blocks = ssd_triton.BlockSizes(block_m=BM, block_t=BM, heads=heads)
    states = S((B, NC, H, P, NS), BF16)  # the entry states leave in the operand dtype
    fwd = _calls(lambda *t: ssd_triton.forward(*t, block_sizes=blocks), x, a, b, c, s0)
    bwd = _calls(lambda *t: ssd_triton.backward(*t, block_sizes=blocks), x, a, b, c, states,
                 x, s0)
    xb, acs_b = _bytes(((B, NC, C, H, P), BF16)), _bytes(((B, NC, C, H), F32))
    bcb, stb = _bytes(((B, NC, C, GR, NS), BF16)), _bytes(((B, NC, H, P, NS), F32))
    sb, decb = _bytes(((B, H, P, NS), F32)), _bytes(((B, NC, H), F32))
    entry = _bytes(((B, NC, H, P, NS), BF16))  # entry states; stb: the fp32 dS per chunk
    # The state scan: per (batch, chunk, head) the chunk's x^T (B * w) and decay S + it;
    # forward (x, B) and backward (dy, C, with <G, S> and the per-column-block partials).
    (scan,) = fwd["ssd_state_scan"]
    _check(scan, Z * (2 * C * P * NS + C * NS + 2 * P * NS), 0,
           xb + bcb + acs_b + decb + sb + entry + sb)
    (rscan,) = bwd["ssd_state_scan_reverse"]
    _check(rscan, Z * (2 * C * P * NS + C * NS + 3 * P * NS), 0,
           xb + bcb + acs_b + decb + entry + sb + stb + decb + sb)
    # The cumulative sums enter as double-float (hi, lo) pairs (ssd.decay): two [b, nc, C, h]
    # operands, a segment sum (hi_i - hi_j) + (lo_i - lo_j) is 3 flops and exp(acs) is
    # exp(hi + lo), 1 flop.
    # Each C_i B_j^T block serves `heads` heads of its group (2n of the block's 2n + 2p + 4).
    (out,) = fwd["ssd_chunk_output"]
    _check(out, Z * T * BM * BM * (2 * NS // heads + 2 * P + 4) + Z * C * (2 * NS * P + P + 1),
           Z * T * BM * BM + Z * C, xb + 2 * bcb + 2 * acs_b + entry + xb)
    (rows_j,) = bwd["ssd_bwd_rows_j"]
    _check(rows_j, Z * T * BM * BM * (4 * NS + 4 * P + 6) + Z * C * (4 * NS * P + 2 * P + NS + 3),
           Z * T * BM * BM + Z * C, 2 * xb + 2 * bcb + 2 * acs_b + stb + xb + bcb + 2 * acs_b)
    (rows_i,) = bwd["ssd_bwd_rows_i"]
    _check(rows_i, Z * T * BM * BM * (4 * NS + 2 * P + 5) + Z * C * (4 * NS * P + NS + 2 * P + 1),
           Z * T * BM * BM + Z * C, 2 * xb + 2 * bcb + 2 * acs_b + entry + bcb + acs_b)


def test_ssd_mosaic_tpu():
    x, a, b, c, s0 = _ssd_args(F32)
    states = S((B, NC, H, P, NS), F32)
    (fwd,), = _calls(lambda *t: ssd_tpu.forward(*t), x, a, b, c, s0).values()
    (bwd,), = _calls(lambda *t: ssd_tpu.backward(*t), x, a, b, c, states, x, s0).values()
    progs = B * H * NC
    xb, bcb = _bytes(((B, NC, C, H, P), F32)), _bytes(((B, NC, C, GR, NS), F32))
    acs2 = 2 * _bytes(((B, H, NC, 2, C), F32))  # hi/lo as rows and as columns
    sb, stb = _bytes(((B, H, P, NS), F32)), _bytes(((B, NC, H, P, NS), F32))
    _check(fwd, progs * (C * C * (2 * NS + 2 * P + 4) + C * (4 * NS * P + 3 * P + 4)
                         + 2 * P * NS + 1),
           progs * (C * C + 2 * C + 1), xb + 2 * bcb + acs2 + sb + xb + sb + stb)
    per_head = _bytes(((B, H, NC, C, NS), F32))
    _check(bwd, progs * (C * C * (6 * NS + 4 * P + 22) + 10 * C * NS * P + 37 * C * P
                         + 4 * C * NS + 20 * C + 2 * P * NS + 1),
           progs * (C * C + 2 * C + 1),
           xb + 2 * bcb + acs2 + stb + xb + sb + xb + 2 * per_head
           + _bytes(((B, H, NC, 1, C), F32)) + sb)


_DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "benchmarks.md")


def _call_sites() -> list[str]:
    """"file:line" of every `pl.pallas_call(...)` and `pl.kernel(...)` in the kernels."""
    root = os.path.dirname(os.path.abspath(cost.__file__))
    sites = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(path) as f:
            tree = ast.parse(f.read())
        sites += [f"{os.path.relpath(path, root)}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("pallas_call", "kernel")
                  and isinstance(node.func.value, ast.Name) and node.func.value.id == "pl"]
    return sites


def test_the_docs_count_the_calls_in_the_code():
    """docs/benchmarks.md says how many calls this file checks: the count of call sites in
    the code, so a new kernel is seen to need its hand count."""
    with open(_DOC) as f:
        said = int(re.search(r"checks all (\d+) call sites", f.read()).group(1))
    sites = _call_sites()
    assert said == len(sites), sites


# ------------------------------------------------------------------------ decode step


def test_selective_state_update():
    """Per state element the decay's multiply, dt x B's multiply, the add and the product
    with C (4 flops; the sum over n is a reduction); per row and head exp(A dt) (a
    multiply and an exp) and dt x (p multiplies). Bytes: the operands, y, and the named
    rows' states once read and once written, not the whole cache."""
    slots, b, h, p, n, g = 9, 3, 4, 16, 32, 2
    args = (S((slots, h, p, n), F32), S((b, h, p), BF16), S((b, h), F32), S((h,), F32),
            S((b, g, n), BF16), S((b, g, n), BF16), S((h, p), F32), S((b, h, p), BF16),
            S((b,), I32))
    (est,), = _calls(lambda *a: decode_triton.update(*a), *args).values()
    rows = ((b, h, p, n), F32)
    _check(est, 4 * b * h * p * n + b * h * p + b * h, b * h, _bytes(
        ((b,), I32), ((b, h), F32), ((h,), F32), ((b, g, n), BF16), ((b, g, n), BF16),
        ((h, p), F32), ((b, h, p), BF16), ((b, h, p), BF16), rows, ((b, h, p), BF16), rows))


def test_gated_delta_rule_step():
    """Per state element the decay's multiply, the prediction's product with k, the
    update's outer product and its add, and the output's product with q (5 flops; the
    sums over K are reductions); per row and head exp(g) (one exp), beta k (K
    multiplies) and v - S^T k (V subtractions). Bytes: the operands, o, and the named
    rows' states once read and once written, not the whole cache."""
    slots, b, hk, hv, dk, dv = 9, 3, 2, 4, 16, 32
    args = (S((slots, hv, dk, dv), F32), S((b, hk, dk), BF16), S((b, hk, dk), BF16),
            S((b, hv, dv), BF16), S((b, hv), F32), S((b, hv), F32))
    (est,), = _calls(lambda *a: delta_step_triton.update(*a[:6], 0.5, a[6], True),
                     *args, S((b,), I32)).values()
    rows = ((b, hv, dk, dv), F32)
    _check(est, 5 * b * hv * dk * dv + b * hv * dk + b * hv * dv, b * hv, _bytes(
        ((b,), I32), ((b, hk, dk), BF16), ((b, hk, dk), BF16), ((b, hv, dv), BF16),
        ((b, hv), F32), ((b, hv), F32), rows, ((b, hv, dv), BF16), rows))


# ------------------------------------------------------------- chunked gated delta rule


def test_chunked_gated_delta_rule_triton(monkeypatch):
    """Per (row, chunk, value head), C = 64 in nb = 4 blocks of S = 16 rows, the prep as
    one kernel (PREP_IN_TWO_KERNELS off):
    prep: the P = 10 lower blocks of A (2 S^2 K per k k^T block; a 3-flop segment, an exp
    and two products per entry), the diagonal blocks' substitution (S - 1 rows, a product
    and a subtraction per entry), the merges (M1 = 10 products A_im T_mj and M2 = 6
    closing ones, 2 S^3 each; M1 - M2 block sums and M2 negations), beta V and
    beta exp(G) K (an exp, an add and two products per step, a product per element),
    and the P block products into U and W with their P - nb block sums;
    state pass: u = U - W S, the decays to the chunk's end (a 3-flop segment and an exp
    per step), their product with K, exp(G_last), the new state (decay, product, add);
    output: exp(G) Q (an add and an exp per step, a product per element), its product
    with S, per block of 32 value columns Q K^T with its decay (segment, exp, product),
    the product with u, the sum and the scale. Bytes: operands and results once (the
    final states, aliased to the initial ones, read and written)."""
    monkeypatch.setattr(delta_triton, "PREP_IN_TWO_KERNELS", False)
    monkeypatch.setattr(delta_triton, "FUSED_OUTPUT", False)
    b, nc, c, hk, hv, k, v, n = 1, 2, 64, 1, 2, 32, 64, 1
    z, s, nb = b * nc * hv, 16, 4
    p, m1, m2 = 10, 10, 6
    t = nc * c
    x, y, gate = S((b, t, hk, k), BF16), S((b, t, hv, v), BF16), S((b, t, hv), F32)
    calls = _calls(lambda *a: delta_triton._kernels(
        *a, None, scale=0.1, chunk_size=c, l2norm=False, interpret=False,
        block_sizes={"output_block_v": 32}), x, x, y, gate, gate, S((n, hv, k, v), F32))
    (prep,), (state,), (out,) = (calls["gated_delta_rule_" + name]
                                 for name in ("prep", "state_pass", "output"))
    keys, values = ((b, nc, c, hk, k), BF16), ((b, nc, c, hv, v), BF16)
    gates, w = ((b, nc, c, hv), F32), ((b, nc, c, hv, k), BF16)
    states, runs, init = ((b, nc, hv, k, v), BF16), ((b, 1), I32), ((n, hv, k, v), F32)
    _check(prep, z * (p * (2 * s * s * k + 5 * s * s) + nb * (s - 1) * 2 * s * s
                      + (m1 + m2) * 2 * s ** 3 + m1 * s * s + c * (v + k + 2)
                      + p * 2 * s * s * (v + k) + (p - nb) * s * (v + k)),
           z * (p * s * s + c), _bytes(keys, values, gates, gates, gates, w, values))
    _check(state, z * (4 * c * k * v + c * v + 3 * c + c * k + 1 + 2 * k * v), z * (c + 1),
           _bytes(w, values, keys, gates, gates, runs, runs, runs, init, states, values, init))
    column_blocks = v // 32
    _check(out, z * (c + c * k + 2 * c * k * v + column_blocks * (2 * c * c * k + 4 * c * c)
                     + 2 * c * c * v + 2 * c * v),
           z * (c + column_blocks * c * c),
           _bytes(keys, keys, gates, gates, states, values, values))
    # the output in the state pass's loop (FUSED_OUTPUT) at block_v 32: the two bodies'
    # flops; bytes without the states and u (no residuals), with q in and o out
    monkeypatch.setattr(delta_triton, "FUSED_OUTPUT", True)
    calls = _calls(lambda *a: delta_triton._kernels(
        *a, None, scale=0.1, chunk_size=c, l2norm=False, interpret=False,
        block_sizes={"block_v": 32}), x, x, y, gate, gate, S((n, hv, k, v), F32))
    assert "gated_delta_rule_output" not in calls and "gated_delta_rule_state_pass" not in calls
    (fused,) = calls["gated_delta_rule_state_output_pass"]
    _check(fused, state.flops + out.flops, state.transcendentals + out.transcendentals,
           _bytes(w, values, keys, gates, gates, runs, runs, runs, init, keys, values, init))


def test_chunked_gated_delta_rule_mosaic_gpu_state_pass(monkeypatch):
    """The forward's state pass on Mosaic GPU (MOSAIC_GPU_STATE_PASS): the Triton pass's
    flops per (row, chunk, value head) (test_chunked_gated_delta_rule_triton), and its own
    operands' bytes: W, k and U, the chunk decays [B, Hv, NC, 2, C] fp32, the initial
    states; the entry states, u and the final states (not aliased: read and written once
    each)."""
    monkeypatch.setattr(delta_triton, "MOSAIC_GPU_STATE_PASS", True)
    monkeypatch.setattr(delta_triton.platform, "mosaic_gpu_runs", lambda device=None: True)
    b, nc, c, hk, hv, k, v, n = 1, 2, 64, 1, 2, 64, 64, 1
    z, t = b * nc * hv, nc * c
    x, y, gate = S((b, t, hk, k), BF16), S((b, t, hv, v), BF16), S((b, t, hv), F32)
    calls = _calls(lambda *a: delta_triton._kernels(
        *a, None, scale=0.1, chunk_size=c, l2norm=False, interpret=False,
        block_sizes={"block_v": 32}), x, x, y, gate, gate, S((n, hv, k, v), F32))
    assert "gated_delta_rule_state_pass" not in calls
    (state,) = calls["gated_delta_rule_state_pass_mosaic_gpu"]
    keys, values = ((b, nc, c, hk, k), BF16), ((b, nc, c, hv, v), BF16)
    w, decays = ((b, nc, c, hv, k), BF16), ((b, hv, nc, 2, c), F32)
    states, init = ((b, nc, hv, k, v), BF16), ((n, hv, k, v), F32)
    _check(state, z * (4 * c * k * v + c * v + 3 * c + c * k + 1 + 2 * k * v), z * (c + 1),
           _bytes(w, keys, values, decays, init, states, values, init))


def test_chunked_gated_delta_rule_triton_prep_in_two_kernels(monkeypatch):
    """Per (row, chunk, value head), C = 64 in nb = 4 blocks of S = 16 rows, the prep as
    two kernels (PREP_IN_TWO_KERNELS). Solve: K K^T whole (2 C^2 K), per entry of C x C a
    3-flop segment, an exp and two products; the substitution and merges as the one-kernel
    prep's. Apply: beta V and beta exp(G) K (an exp, an add and two products per step, a
    product per element), then T times each (2 C^2 (V + K)). Bytes: operands and results
    once (T, fp32, out of the solve and into the apply)."""
    monkeypatch.setattr(delta_triton, "PREP_IN_TWO_KERNELS", True)
    monkeypatch.setattr(delta_triton, "APPLY_IN_SOLVE_KERNEL", False)
    b, nc, c, hk, hv, k, v, n = 1, 2, 64, 1, 2, 32, 64, 1
    z, s, nb = b * nc * hv, 16, 4
    m1, m2 = 10, 6
    t = nc * c
    x, y, gate = S((b, t, hk, k), BF16), S((b, t, hv, v), BF16), S((b, t, hv), F32)
    calls = _calls(lambda *a: delta_triton._kernels(
        *a, None, scale=0.1, chunk_size=c, l2norm=False, interpret=False,
        block_sizes=None), x, x, y, gate, gate, S((n, hv, k, v), F32))
    assert "gated_delta_rule_prep" not in calls
    (solve,), (apply,) = (calls["gated_delta_rule_" + name] for name in ("solve", "apply"))
    keys, values = ((b, nc, c, hk, k), BF16), ((b, nc, c, hv, v), BF16)
    gates, w, inv = ((b, nc, c, hv), F32), ((b, nc, c, hv, k), BF16), ((b, nc, hv, c, c), F32)
    _check(solve, z * (2 * c * c * k + 5 * c * c + nb * (s - 1) * 2 * s * s
                       + (m1 + m2) * 2 * s ** 3 + m1 * s * s),
           z * c * c, _bytes(keys, gates, gates, gates, inv))
    _check(apply, z * (c * (v + k + 2) + 2 * c * c * (v + k)), z * c,
           _bytes(keys, values, gates, gates, gates, inv, w, values))
    # the two bodies in one kernel (APPLY_IN_SOLVE_KERNEL): their flops, the operands and
    # results once (T is stored, not read back from HBM)
    monkeypatch.setattr(delta_triton, "APPLY_IN_SOLVE_KERNEL", True)
    calls = _calls(lambda *a: delta_triton._kernels(
        *a, None, scale=0.1, chunk_size=c, l2norm=False, interpret=False,
        block_sizes=None), x, x, y, gate, gate, S((n, hv, k, v), F32))
    assert "gated_delta_rule_solve" not in calls and "gated_delta_rule_apply" not in calls
    (fused,) = calls["gated_delta_rule_solve_apply"]
    _check(fused, solve.flops + apply.flops, solve.transcendentals + apply.transcendentals,
           _bytes(keys, values, gates, gates, gates, inv, w, values))


def test_chunked_gated_delta_rule_triton_backward():
    """Per (row, chunk, value head), C = 64, through jax.vjp of the kernels' forward:
    reverse state pass: per block of 32 value columns P (Q K^T; a 3-flop segment, an exp
    and a product per entry); du = scale P^T do + Kd dS' (the decays to the chunk's end:
    a 3-flop segment and an exp per step; their product with K dS' (per C x V); two
    dots, the scale and an add); exp(G) do (an add and an exp per step, a product per
    C x V element); dS = exp(G_last) dS' + scale Q^T (exp(G) do) - W^T du (an add and an
    exp; three dots; the decay's product, the scale, the subtraction and the add per
    element);
    chunk gradients, two kernels per block of 32 value columns. Through the output and
    the exit state: 3 dots over K of C x C (dP K, dP^T Q, Q K^T), one over V (do u^T), 2
    of C K V (do S^T, u dS'^T) and one of C x C x C (dg's spans: a triangle of ones
    times the pair terms); 6 elementwise ops per C x C entry (the segment 3, dP's scale
    and decay, through P), 6 per C x K, one per K x V (dS' o S), 8 per step and 2 per
    program (exp(G_last) dS' . S); exps: exp(G), exp(G_last - G), the C x C decays and
    exp(G_last). Through the solve (through the forward's u, GRADS_SOLVE_THROUGH_U): 3
    dots over K of C x C (K K^T, dA K, dA^T K), 2 over V (dRv = T^T du, dA = -dRv u^T),
    one of C K V (dRk = -dRv S^T) and the spans again; 8 per C x C entry (the segment
    3, dA's negation and decay, through A, beta twice), 8 per C x K, 2 per C x V and 8
    per step; exps: exp(G) and the decays.
    Bytes: operands and results once (the final states' cotangents, aliased to the
    initial states', read and written; dk's and dg's shares, aliased from the first
    chunk-gradient kernel to the second, likewise; dq, dk, dbeta and dg one share per
    value block)."""
    b, nc, c, hk, hv, k, v, n = 1, 2, 64, 1, 2, 32, 64, 1
    z, bv = b * nc * hv, 32
    t = nc * c
    x, y, gate = S((b, t, hk, k), BF16), S((b, t, hv, v), BF16), S((b, t, hv), F32)

    def grads(*a):
        out, pull = jax.vjp(lambda *p: delta_triton.forward(
            *p[:5], scale=0.1, initial_state=p[5], cu_seqlens=None, chunk_size=c,
            use_qk_l2norm_in_kernel=False,
            block_sizes={"block_v": bv, "grads_block_v": bv}), *a)
        return pull(out)

    calls = _calls(grads, x, x, y, gate, gate, S((n, hv, k, v), F32))
    (rev,), (state,), (solve,) = (calls["gated_delta_rule_" + name] for name in (
        "reverse_state_pass", "chunk_grads_state", "chunk_grads_solve"))
    keys, values = ((b, nc, c, hk, k), BF16), ((b, nc, c, hv, v), BF16)
    gates, w = ((b, nc, c, hv), F32), ((b, nc, c, hv, k), BF16)
    states, runs, init = ((b, nc, hv, k, v), BF16), ((b, 1), I32), ((n, hv, k, v), F32)
    d_exit, du = ((b, nc, hv, k, v), BF16), ((b, nc, c, hv, v), BF16)
    u = du  # the forward's u, which the solve's gradients read
    blocks = v // bv
    _check(rev, z * (blocks * (2 * c * c * k + 4 * c * c) + 4 * c + 2 * c * c * v + 2 * c * v
                     + 6 * c * k * v + 2 * c * v + 4 * k * v + 1),
           z * (blocks * c * c + 2 * c + 1),
           _bytes(keys, keys, w, gates, gates, values, runs, runs, runs, init, d_exit, du, init))
    zb = z * blocks
    key_shares, gate_shares = ((blocks, b, nc, c, hv, k), F32), ((blocks, b, nc, c, hv), F32)
    _check(state, zb * (6 * c * c * k + 2 * c * c * bv + 4 * c * k * bv + 2 * c ** 3
                        + 6 * c * c + 6 * c * k + k * bv + 8 * c + 2),
           zb * (c * c + 2 * c + 1),
           _bytes(keys, keys, gates, gates, states, values, values, d_exit,
                  key_shares, key_shares, gate_shares))
    _check(solve, zb * (6 * c * c * k + 4 * c * c * bv + 2 * c * k * bv + 2 * c ** 3
                        + 8 * c * c + 8 * c * k + 2 * c * bv + 8 * c),
           zb * (c * c + c),
           _bytes(keys, values, gates, gates, gates, ((b, nc, hv, c, c), F32), u, states, du,
                  key_shares, gate_shares, ((b, nc, c, hv, v), F32), gate_shares, key_shares,
                  gate_shares))


def test_chunked_gated_delta_rule_mosaic_tpu():
    """Per (row, chunk, value head), C = 64, the chunk terms formed in XLA:
    forward: u = U - W S (a dot and a subtraction), o = scale (exp(G) Q S + (D * Q K^T)
    u) (two dots, an add and the scale), S' = exp(G_last) S + (Kd)^T u (a dot, a product
    and an add); backward: u again, du = scale P^T do + Kd dS' (two dots, the scale and
    an add), dS = exp(G_last) dS' + scale (exp(G) Q)^T do - W^T du (two dots, a product,
    the scale, a subtraction and an add), dW = -du S^T, d(exp(G) Q) = scale do S^T,
    dP = scale do u^T, dKd = u dS'^T (four dots, a negation and two scales) and
    d exp(G_last) = <S, dS'> (a product per element; the sum is not counted). No exps.
    Bytes: operands and results once (the tables, the terms, the initial or final-state
    cotangents aliased to the outputs, read and written)."""
    from pallasite.kernels.gated_delta import pallas_mosaic_tpu as delta_tpu

    b, nc, c, hk, hv, k, v, n = 1, 2, 64, 1, 2, 32, 64, 1
    z, t = b * nc * hv, nc * c
    x, y, gate = S((b, t, hk, k), BF16), S((b, t, hv, v), BF16), S((b, t, hv), F32)

    def grads(*a):
        out, pull = jax.vjp(lambda *p: delta_tpu.forward(
            *p[:5], scale=0.1, initial_state=p[5], cu_seqlens=None, chunk_size=c,
            use_qk_l2norm_in_kernel=False), *a)
        return pull(out)

    calls = _calls(grads, x, x, y, gate, gate, S((n, hv, k, v), F32))
    (fwd,), (bwd,) = (calls[f"gated_delta_rule_{d}_mosaic_tpu"] for d in ("forward", "backward"))
    tables = ((b, nc), I32)
    terms = [((b, nc, hv, c, v), F32), ((b, nc, hv, c, k), F32), ((b, nc, hv, c, k), F32),
             ((b, nc, hv, c, c), F32), ((b, nc, hv, 1, 1), F32), ((b, nc, hv, c, k), F32)]
    state, states = ((n, hv, k, v), F32), ((b, nc, hv, k, v), F32)
    rows_v = ((b, nc, hv, c, v), BF16)
    _check(fwd, z * (6 * c * k * v + 2 * c * c * v + 3 * c * v + 2 * k * v), 0,
           _bytes(tables, tables, *terms, state, rows_v, states, state))
    _check(bwd, z * (14 * c * k * v + 4 * c * c * v + 3 * c * v + 5 * k * v + 2 * c * k + c * c),
           0, _bytes(tables, tables, tables, *terms, states, rows_v, state, *terms, state))
