"""fp8 grouped products through Pallas Triton (CUDA GPUs from sm89: Ada and Hopper): e4m3
tensor-core dots with DeepSeek-V3's block scales, each 128-deep step promoted to an fp32
accumulator.

Backend contract: the Mosaic GPU fp8 module's (pallas_mosaic_gpu_fp8.py). `gmm` and
`tgmm` take the arguments of every grouped backend (floating lhs/rhs, group_sizes,
group_offset, transpose_rhs, out_dtype, block_sizes, interpret), quantize their operands
with `quantization.quantizer(interpret)` and call `gmm_quantized` / `tgmm_quantized`,
which take operands already quantized, in the same layouts as the Mosaic module's:
  forward  A = Q(x) [m, k] (1 x 128 blocks, scales [k/128, m]), B = Q(kernel) [g, n, k]
           (128 x 128 blocks, scales [g, n/128, k/128], written transposed);
  dx       A = Q(dy) [m, n], B = Q(kernel) [g, k, n] (as stored);
  dkernel  A = Qt(x) [k, tokens], B = Qt(dy) [n, tokens] in token blocks of 128 rows that
           never straddle groups (token_blocks.py), scales [blocks, columns].

Every product is A[M, K] @ B[N, K]^T, contracted 128 deep per step: each step's dot
(fp32 from the tensor cores) is multiplied by (row scale x column scale) and added to an
fp32 accumulator. The tensor cores keep fewer bits than fp32 in their own fp8 sums
(Hopper's), so no partial sum runs past one scale step (DeepSeek's promotion); Triton
gives the dot a fresh accumulator each step and the kernel adds it.

Block sizes: config.TritonBlockSizes read in that A @ B^T form: block_m tiles A's rows
(gmm: tokens; tgmm: the kernel's k), block_n B's rows (the output's columns), block_k
the contraction, fixed at 128 (one scale step). gmm's block_n is 128 too, one weight
scale block, so the weight scale is one scalar per step per tile. Every product holds
`num_stages` A and B tiles of one byte per element in shared memory, gmm's footprint in
triton_fit (fit.triton_fp8_reason holds configs to it).

gmm: one program per (row tile, column tile); the row tiles are pallas_triton.gmm's
(group_metadata: a tile starts at its group's first row, never straddles two groups;
rows of no group are zero tiles with no matmul); grouped_mlp's fp8 gate-up
(expert_mlp.pallas_triton_fp8) runs the same kernel through gmm_call with its weight
tiles paired and its own epilogue. tgmm: one program per (group, k tile,
n tile) over the group's token blocks [first, first + count); an empty group loops zero
times and stores its zeros. Loads and stores are masked on every axis, so no dimension
needs padding. Masks are selects (masked loads, the zero tiles' own stores), never a
multiplication by zero: a row of no group stays exactly zero even where its scales are
NaN.

Speed (one H200, the defaults' comment below): about 330 TFLOP/s at mixtral's dims,
about half of pallas_triton's bf16 gmm there; on Hopper the fp8 products belong to the
Mosaic GPU kernel. Not measured on sm89.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int, Shaped

from pallasite.kernels import platform, sharding
from pallasite.kernels.grouped_matmul import config, costs, tuning_benchmarks
from pallasite.kernels.grouped_matmul.group_metadata import (
    cdiv,
    local_groups,
    make_group_metadata,
    num_visits,
)
from pallasite.kernels.grouped_matmul.pallas_triton import Tile, _and, _in_range, _load, _swizzle
from pallasite.kernels.grouped_matmul.token_blocks import group_table, token_blocks
from pallasite.kernels.quantization import api as quantization
from pallasite.reference.quantization import TOKEN_BLOCK

BLOCK = TOKEN_BLOCK  # the contraction per step (one scale step) and gmm's column tile
FP8 = jnp.float8_e4m3fn

# Defaults measured on one H200 (2026-12-02; gmm_quantized / tgmm_quantized on operands
# already quantized, equal groups, median of 10 runs; TFLOP/s at mixtral's dims m=32768,
# k=4096, n=14336, g=8, then at m=65536, k=2048, n=768, g=128):
#   gmm  64x128x128, 4 warps, 4 stages: 329, 200; 128x128x128 on 8 warps with 3, 4, 5
#        stages: 279, 280, 276 (and 208, 171 at the second shape); on 4 warps 224;
#        64x128x128 with 6 stages 242.
#   tgmm 64x128x128, 4 warps, 4 stages: 320, 182; 128x128x128 on 8 warps with 3, 4, 5
#        stages: 290, 292, 294 (161, 169); 64x256x128 on 8 warps 300; 128x256x128 198.
# The measured best is 96 KiB of shared memory (triton_fit, one byte per element), inside
# sm89's 99 KiB: one default for both generations; more stages or larger tiles on sm90's
# 227 KiB were no faster. Each thread holds 64 fp32 of the total and 64 of the step's
# fresh dot. pallas_triton's bf16 defaults run 614 and 528 TFLOP/s at mixtral's dims:
# this kernel is slower than bf16 on Hopper, where fp8 goes to the Mosaic GPU kernel.
# (Probably because each step waits for its dot before promoting it, so no tensor-core
# work stays in flight across steps; not established.)
GMM_FP8 = config.TritonBlockSizes(64, BLOCK, BLOCK, group_m=8, num_warps=4, num_stages=4)
TGMM_FP8 = config.TritonBlockSizes(64, 128, BLOCK, group_m=1, num_warps=4, num_stages=4)
DEFAULT = GMM_FP8


def refusal(compute, operands, *, target: str | None) -> str | None:
    """Why these kernels cannot run compiled for `target` (None: interpreted, which runs
    anywhere; see pallas_triton.refusal). None: they can. Triton casts to fp8 and runs
    fp8 dots from sm89. Operands of any floating dtype are quantized first."""
    del compute, operands
    if target is not None and not platform.fp8_runs():
        return (f"pallas_triton (fp8) needs a CUDA GPU from sm89; the device is "
                f"{platform.device_generation()}")
    return None


def default_block_sizes(*, product: str, m: int, k: int, n: int, g: int
                        ) -> config.TritonBlockSizes:
    """The measured default (above); it fits every fp8 GPU's shared memory."""
    del m, k, n, g
    return TGMM_FP8 if product == "dkernel" else GMM_FP8


def resolve_block_sizes(block_sizes: Any, *, product: str, m: int, k: int, n: int, g: int,
                        interpret: bool = True) -> config.TritonBlockSizes:
    """The caller's blocks (checked by fit.triton_fp8_reason), else the tuned
    table / autotune cache, else a bounded autotune (compiled on an fp8 GPU only;
    PALLASITE_AUTOTUNE=0 turns it off), else `default_block_sizes`. m, k, n are the
    grouped projection's (x [m, k], kernel [g, k, n]), as for the other backends."""
    return tuning_benchmarks.select_block_sizes(
        sys.modules[__name__], "pallas_triton_fp8", config.TritonBlockSizes, block_sizes,
        product=product, dims={"m": m, "k": k, "n": n, "g": g}, dtype=FP8,
        default=default_block_sizes(product=product, m=m, k=k, n=n, g=g),
        tune_here=not interpret and platform.fp8_runs(),
    )


def _params(bs: config.TritonBlockSizes):
    return plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)


def _step_dot(a, b):
    """a [rows, 128] . b [cols, 128]^T in fp32: one scale step's fresh partial sum."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


# --------------------------------------------------------------------------- gmm


def _gmm_kernel(group_ref, start_ref, end_ref, lhs_ref, lhs_scales_ref, rhs_ref,
                rhs_scales_ref, *refs, bs, k, n, num_groups, num_tiles, pair=False,
                epilogue=None, num_outputs=1):
    """One (row tile, 128-column tile) of A @ B^T. With `pair` (grouped_mlp's gate-up)
    B holds 2n rows, the gate's [0, n) and the up's [n, 2n) (n a multiple of 128, so each
    column tile's up rows are one weight-scale block): two accumulators. With `epilogue`
    (grouped_mlp's kernels), epilogue(sums, extra_refs, out_refs, tile) stores the tile
    to the last `num_outputs` refs, reading the extra operands before them (sums None:
    rows of no local group, whose outputs are zeros), as pallas_triton's gmm epilogues."""
    extra_refs, out_refs = refs[:-num_outputs], refs[-num_outputs:]
    bm = bs.block_m
    tile, col = _swizzle(pl.program_id(0), num_tiles, cdiv(n, BLOCK), bs.group_m)
    group, start, end = group_ref[tile], start_ref[tile], end_ref[tile]
    rows = pl.ds(start, bm)
    row_ok = (start + jnp.arange(bm, dtype=jnp.int32)) < end
    col_ok = _in_range(col * BLOCK, BLOCK, n)
    here = Tile(rows, pl.ds(col * BLOCK, BLOCK), col, row_ok, col_ok, _and(row_ok, col_ok))
    store = epilogue or _store_sums
    halves = (0, n // BLOCK) if pair else (0,)

    @pl.when((group < num_groups) & (end > start))
    def _compute():
        gi = jnp.minimum(group, num_groups - 1)

        def step(i, accs):
            ks = pl.ds(i * BLOCK, BLOCK)
            k_ok = _in_range(i * BLOCK, BLOCK, k)
            a = _load(lhs_ref.at[rows, ks], _and(row_ok, k_ok))
            row_scales = _load(lhs_scales_ref.at[i, rows], row_ok)[:, None]  # [bm, 1]
            out = []
            for acc, half in zip(accs, halves):
                cb = half + col  # the weight's 128-row block: [128 n, 128 k]
                b = _load(rhs_ref.at[gi, pl.ds(cb * BLOCK, BLOCK), ks], _and(col_ok, k_ok))
                weight_scale = rhs_scales_ref[gi, cb, i]  # one 128 x 128 block
                out.append(acc + _step_dot(a, b) * (row_scales * weight_scale))
            return tuple(out)

        zeros = tuple(jnp.zeros((bm, BLOCK), jnp.float32) for _ in halves)
        accs = jax.lax.fori_loop(0, cdiv(k, BLOCK), step, zeros)
        store(accs if pair else accs[0], extra_refs, out_refs, here)

    @pl.when(group == num_groups)  # rows of no local group: zeros, never a product
    def _zeros():
        store(None, extra_refs, out_refs, here)


def _store_sums(sums, extra, outs, tile: Tile):
    del extra
    (out_ref,) = outs
    sums = jnp.zeros(tile.shape, jnp.float32) if sums is None else sums
    plgpu.store(out_ref.at[tile.rows, tile.cols], sums.astype(out_ref.dtype),
                mask=tile.store_ok)


def gmm_quantized(
    lhs: Shaped[Array, "m k"], lhs_scales_t: Float[Array, "kb m"],
    rhs: Shaped[Array, "g n k"], rhs_scales: Float[Array, "g nb kb"],
    group_sizes: Int[Array, " G"], *, group_offset=None, out_dtype: Any = jnp.bfloat16,
    block_sizes: config.TritonBlockSizes | None = None, interpret: bool = False,
    product: str = "forward",
) -> Float[Array, "m n"]:
    """out[rows of group i] = dequant(lhs rows) @ dequant(rhs[i])^T, fp8 operands in the
    layouts of the module docstring: lhs [m, k] with scales [ceil(k/128), m], rhs
    [g, n, k] (K-major) with scales [g, ceil(n/128), ceil(k/128)]. rhs holds groups
    [group_offset, group_offset + g) of group_sizes (all when None); rows of other groups
    and past the total are zeros. product ('forward' or 'dx') is the tuning key, whose
    dims are the projection's: the dx contracts n = rhs.shape[2] into k = rhs.shape[1]."""
    _check_offsets(lhs=lhs, rhs=rhs)
    m, kc = lhs.shape
    g, nc = rhs.shape[0], rhs.shape[1]
    out_dtype = jnp.dtype(out_dtype)
    k, n = (nc, kc) if product == "dx" else (kc, nc)
    bs = resolve_block_sizes(block_sizes, product=product, m=m, k=k, n=n,
                             g=group_sizes.shape[0], interpret=interpret)
    if m == 0 or nc == 0 or g == 0 or kc == 0:  # kc == 0: every sum is empty
        return jnp.zeros((m, nc), out_dtype)
    return gmm_call(lhs, lhs_scales_t, rhs, rhs_scales, group_sizes, nc, bs,
                    group_offset=group_offset, interpret=interpret,
                    outputs=(((m, nc), out_dtype),),
                    name="grouped_projection_gmm_fp8_triton")[0]


def gmm_call(lhs, lhs_scales_t, rhs, rhs_scales, group_sizes, n: int,
             bs: config.TritonBlockSizes, *, group_offset, interpret: bool, outputs,
             name: str, pair: bool = False, epilogue=None, extra=(), cost_of=None):
    """The gmm kernel's call over n output columns with blocks `bs`: a tuple of the
    `outputs`, each (shape, dtype). For grouped_mlp's kernels: `pair` and `epilogue`
    (_gmm_kernel), the `extra` operands the epilogue reads, and `cost_of(inputs=...,
    outputs=...)`, their cost estimate (else the product's)."""
    m, kc = lhs.shape
    g = rhs.shape[0]
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    meta = make_group_metadata(sizes, m, bs.block_m, aligned=False, include_tail=True,
                               row_start=row_start)
    num_tiles = num_visits(m, g, bs.block_m)
    kernel = functools.partial(_gmm_kernel, bs=bs, k=kc, n=n, num_groups=g,
                               num_tiles=num_tiles, pair=pair, epilogue=epilogue,
                               num_outputs=len(outputs))
    out_shape = tuple(sharding.out_struct(shape, dtype, like=lhs) for shape, dtype in outputs)
    inputs = (meta.group, meta.start, meta.end, lhs, lhs_scales_t, rhs, rhs_scales, *extra)
    if cost_of is not None:
        cost = cost_of(inputs=inputs, outputs=out_shape)
    else:
        cost = costs.gmm(m, kc, n, lhs.dtype, transpose_rhs=True, inputs=inputs,
                         outputs=out_shape)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_tiles * cdiv(n, BLOCK),),
        compiler_params=_params(bs),
        interpret=interpret,
        cost_estimate=cost,
        name=name,
    )(*inputs)


# --------------------------------------------------------------------------- tgmm


def _tgmm_kernel(groups_ref, lhs_ref, lhs_scales_ref, rhs_ref, rhs_scales_ref, out_ref, *,
                 bs, k, n):
    bm, bn = bs.block_m, bs.block_n
    group, kt, nt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first, count = groups_ref[0, group], groups_ref[1, group]
    rows, cols = pl.ds(kt * bm, bm), pl.ds(nt * bn, bn)
    row_ok = _in_range(kt * bm, bm, k)
    col_ok = _in_range(nt * bn, bn, n)

    def step(i, acc):
        block = first + i
        tokens = pl.ds(block * BLOCK, BLOCK)  # whole blocks: zeros past a block's rows
        a = _load(lhs_ref.at[rows, tokens], _and(row_ok, None))
        b = _load(rhs_ref.at[cols, tokens], _and(col_ok, None))
        row_scales = _load(lhs_scales_ref.at[block, rows], row_ok)  # [bm]
        col_scales = _load(rhs_scales_ref.at[block, cols], col_ok)  # [bn]
        return acc + _step_dot(a, b) * (row_scales[:, None] * col_scales[None, :])

    acc = jax.lax.fori_loop(0, count, step, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(out_ref.at[group, rows, cols], acc.astype(out_ref.dtype),
                mask=_and(row_ok, col_ok))


def tgmm_quantized(
    lhs_t: Shaped[Array, "k p"], lhs_scales: Float[Array, "t k"],
    rhs_t: Shaped[Array, "n p"], rhs_scales: Float[Array, "t n"],
    first: Int[Array, " g"], count: Int[Array, " g"], *, out_dtype: Any = jnp.float32,
    block_sizes: config.TritonBlockSizes | None = None, interpret: bool = False,
    m: int | None = None,
) -> Float[Array, "g k n"]:
    """out[i] = sum over group i's token blocks [first[i], first[i] + count[i]) of
    dequant(lhs block) @ dequant(rhs block)^T: the token-block layouts of the module
    docstring (values [c, 128 t], scales [t, c]). m: the rows the blocks were cut from
    (the tuning key; the token axis when None)."""
    _check_offsets(lhs_t=lhs_t, rhs_t=rhs_t)
    k, p = lhs_t.shape
    n = rhs_t.shape[0]
    g = first.shape[0]
    out_dtype = jnp.dtype(out_dtype)
    bs = resolve_block_sizes(block_sizes, product="dkernel", m=p if m is None else m, k=k,
                             n=n, g=g, interpret=interpret)
    if g == 0 or k == 0 or n == 0:
        return jnp.zeros((g, k, n), out_dtype)
    kernel = functools.partial(_tgmm_kernel, bs=bs, k=k, n=n)
    out_shape = sharding.out_struct((g, k, n), out_dtype, like=lhs_t)
    inputs = (group_table(first, count), lhs_t, lhs_scales, rhs_t, rhs_scales)
    cost = costs.gmm(k, p, n, lhs_t.dtype, transpose_rhs=True, inputs=inputs,
                     outputs=(out_shape,))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(g, cdiv(k, bs.block_m), cdiv(n, bs.block_n)),
        compiler_params=_params(bs),
        interpret=interpret,
        cost_estimate=cost,
        name="grouped_projection_tgmm_fp8_triton",
    )(*inputs)


# ------------------------------------------------------------- the backend contract


def _check_offsets(**operands):
    """Refuse fp8 operands Pallas Triton would address past its 32-bit offsets (more
    than 2**31 one-byte elements in at most 4 GiB: quantization/pallas_triton.py); the
    ordered fallback then takes the next backend."""
    for name, a in operands.items():
        if not quantization.pallas_triton.offsets_fit(a.shape, a.dtype):
            raise ValueError(
                f"pallas_triton (fp8): {name} {a.shape} {jnp.dtype(a.dtype).name} has more "
                "than 2**31 elements in at most 2**32 bytes, past the 32-bit offsets Pallas "
                "Triton addresses it with")


def _check(lhs, rhs, group_sizes):
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(a.dtype, jnp.floating) or jnp.dtype(a.dtype).itemsize > 4:
            raise TypeError(f"fp8 grouped products quantize floating operands up to fp32; "
                            f"{name} is {jnp.dtype(a.dtype).name}")
    if group_sizes.dtype != jnp.int32:
        raise TypeError(f"group_sizes must be int32, got {group_sizes.dtype}")


def gmm(lhs: Float[Array, "m k"], rhs: Float[Array, "g kn nk"], group_sizes: Int[Array, " G"],
        *, group_offset=None, transpose_rhs: bool = False, out_dtype: Any = None,
        block_sizes: config.TritonBlockSizes | None = None, interpret: bool = False
        ) -> Float[Array, "m n"]:
    """The forward (rhs [g, k, n]) or dx (transpose_rhs: dy [m, n] against rhs [g, k, n]
    read as [g, n, k]^T) in fp8: lhs in 1 x 128 blocks, rhs in 128 x 128 blocks. The
    blocks are resolved (and the caller's checked) before the quantizers are built."""
    _check(lhs, rhs, group_sizes)
    m = lhs.shape[0]
    g, k, n = rhs.shape
    product = "dx" if transpose_rhs else "forward"
    bs = resolve_block_sizes(block_sizes, product=product, m=m, k=k, n=n,
                             g=group_sizes.shape[0], interpret=interpret)
    out_dtype = out_dtype or lhs.dtype
    if 0 in lhs.shape or 0 in rhs.shape:
        return jnp.zeros((m, k if transpose_rhs else n), out_dtype)
    q = quantization.quantizer(interpret)
    lhs_q, lhs_scales_t = q.rows(lhs, FP8, interpret=interpret)
    # forward: B = kernel^T, [g, n, k], written so by the quantizer; dx: B = kernel as is.
    rhs_q, rhs_scales = q.weight_blocks(rhs, FP8, transpose=not transpose_rhs,
                                        interpret=interpret)
    return gmm_quantized(lhs_q, lhs_scales_t, rhs_q, rhs_scales, group_sizes,
                         group_offset=group_offset, out_dtype=out_dtype, block_sizes=bs,
                         interpret=interpret, product=product)


def tgmm(lhs: Float[Array, "m k"], rhs: Float[Array, "m n"], group_sizes: Int[Array, " G"],
         *, num_groups: int | None = None, group_offset=None, out_dtype: Any = None,
         block_sizes: config.TritonBlockSizes | None = None, interpret: bool = False
         ) -> Float[Array, "g k n"]:
    """dkernel in fp8: per local group lhs_g^T rhs_g over token blocks aligned to groups."""
    _check(lhs, rhs, group_sizes)
    (m, k), n = lhs.shape, rhs.shape[1]
    g = group_sizes.shape[0] if num_groups is None else num_groups
    bs = resolve_block_sizes(block_sizes, product="dkernel", m=m, k=k, n=n, g=g,
                             interpret=interpret)
    out_dtype = out_dtype or lhs.dtype
    if 0 in (m, k, n, g):
        return jnp.zeros((g, k, n), out_dtype)
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    table = token_blocks(sizes, m, row_start=row_start)
    q = quantization.quantizer(interpret)
    lhs_t, lhs_scales = q.token_blocks(lhs, table.start, table.rows, FP8, interpret=interpret)
    rhs_t, rhs_scales = q.token_blocks(rhs, table.start, table.rows, FP8, interpret=interpret)
    return tgmm_quantized(lhs_t, lhs_scales, rhs_t, rhs_scales, table.first, table.count,
                          out_dtype=out_dtype, block_sizes=bs, interpret=interpret, m=m)
