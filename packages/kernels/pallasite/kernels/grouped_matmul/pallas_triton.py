"""Pallas Triton grouped matmuls (gmm, tgmm) for CUDA GPUs from sm80.

gmm: out[rows of group i] = lhs[rows of group i] @ rhs[i]. One program per (row tile,
column tile); row tiles come from `group_metadata` (unaligned: a tile starts at its
group's first row, so no tile straddles two groups and no row is computed twice). The
grid is static, `cdiv(m, block_m) + g + 1` row tiles; the extra ones have empty row
ranges and exit. Rows past the total are a pseudo-group whose tiles store zeros. Every
load and store is masked on rows, the contraction and columns, so no dimension needs
padding. With transpose_rhs the weight block is read as [block_n, block_k] from
rhs[g, n, k] and contracted on its second axis: dx reads the forward kernel in place,
no transposed copy in HBM.

tgmm: out[i] = lhs[rows of i]^T @ rhs[rows of i]. One program per (group, k tile, n tile)
loops over the group's rows in steps of block_m; an empty group loops zero times and
stores its zeros.

Accumulation is fp32 in registers; one rounding to out_dtype at the store.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallasite.kernels import platform
from pallasite.kernels import sharding
from pallasite.kernels.grouped_matmul import config, costs, fit, triton_fit, tuning_benchmarks
from pallasite.kernels.grouped_matmul.group_metadata import (
    cdiv,
    group_offsets,
    local_groups,
    make_group_metadata,
    num_visits,
)
from pallasite.reference.grouped_projection import Dtype

# Defaults measured on the H200 (tools/sweeps/bench_grouped_projection.py, 2026-11-30,
# bf16, TARGETS shapes; docs/performance.md has every config tried):
# gmm (forward and dx): 128x256x64, 8 warps, 3 stages: 611/448/229/197 TFLOP/s forward on
#   mixtral/dsv3/qwen3/olmoe; 128x128x64 gave 467/360/219/180, 64x256x64 462/403/198/223.
# tgmm: 64 rows x 128 x 128, 4 warps: 424/237/206/260; 64x256x128 (8 warps) reaches 537 on
#   mixtral, whose groups hold ~4096 rows, but loses on qwen3/olmoe (148/236, ~512 rows).
GMM_16BIT = config.TritonBlockSizes(128, 256, 64, group_m=8, num_warps=8, num_stages=3)
TGMM_16BIT = config.TritonBlockSizes(64, 128, 128, group_m=1, num_warps=4, num_stages=3)
TGMM_16BIT_LONG_GROUPS = config.TritonBlockSizes(64, 256, 128, group_m=1, num_warps=8,
                                                 num_stages=3)
# GPUs with 99 KiB of shared memory per block (sm86, sm89; triton_fit): the gmm tile above
# needs 144 KiB there. 128x128x32 with 4 stages (64 KiB) is the 128x128 tile the sweep
# measured at 467 TFLOP/s on mixtral (H200), with a shorter k step; not measured on sm86/89.
GMM_16BIT_99K = config.TritonBlockSizes(128, 128, 32, group_m=8, num_warps=4, num_stages=4)
TGMM_16BIT_99K = config.TritonBlockSizes(64, 128, 64, group_m=1, num_warps=4, num_stages=3)
# fp32 operands take twice the shared memory per stage: the 16-bit tiles ask 256 KiB where
# sm90 has 227 KiB (seen failing on the H200). Smaller tiles, not yet tuned.
GMM_32BIT = config.TritonBlockSizes(64, 128, 32, group_m=8, num_warps=4, num_stages=3)
TGMM_32BIT = config.TritonBlockSizes(32, 128, 64, group_m=1, num_warps=4, num_stages=3)
DEFAULT = GMM_16BIT


def refusal(compute: Dtype, operands: Sequence[jax.Array], *, target: str | None
            ) -> str | None:
    """Why these kernels cannot run `compute` over `operands` compiled for `target` (a
    platform, platform.compile_target's names; None: interpreted, which runs anywhere).
    None: they can. api.py asks after its generic checks (the module imports,
    ragged_dot_runs). CUDA code is compiled for the device this process holds."""
    del compute, operands  # every dtype ragged_dot_runs admits
    if target is not None and not platform.triton_runs():
        return (f"pallas_triton needs a CUDA GPU from sm80; the device is "
                f"{platform.device_generation()}")
    return None


def default_block_sizes(*, product: str, m: int, k: int, n: int, g: int,
                        dtype, device=None) -> config.TritonBlockSizes:
    """The measured default for one product and operand width (see above), the first that
    fits the shared memory of `device` (default: JAX's first; off CUDA, every GPU from
    sm80: fit.triton_budget, the budget of every choice pallasite makes); what a tuned
    table entry must beat."""
    del k, n
    itemsize = jnp.dtype(dtype).itemsize
    wide = itemsize > 2
    if product != "dkernel":
        order = [GMM_32BIT] if wide else [GMM_16BIT, GMM_16BIT_99K]
    elif wide:
        order = [TGMM_32BIT]
    else:
        order = ([TGMM_16BIT_LONG_GROUPS] if m >= 2048 * g else []) + [TGMM_16BIT,
                                                                       TGMM_16BIT_99K]
    return triton_fit.first_fitting(order, itemsize, product, fit.triton_budget(device=device))


def resolve_block_sizes(block_sizes, *, product: str, m: int, k: int, n: int, g: int,
                        dtype, interpret: bool = True) -> config.TritonBlockSizes:
    """The one place this backend picks its blocks: the caller's, else pallasite.tuning's
    tuned table / autotune cache entry for this device and shape bucket, else a bounded
    autotune of this shape (only when the kernel will run compiled, not `interpret`, on a
    GPU Triton runs on; PALLASITE_AUTOTUNE=0 turns it off), else the default (exactly
    `default_block_sizes`). `interpret` defaults to True, "do not tune", for callers that
    only ask which blocks apply; gmm and tgmm pass theirs."""
    return tuning_benchmarks.select_block_sizes(
        sys.modules[__name__], "pallas_triton", config.TritonBlockSizes, block_sizes,
        product=product, dims={"m": m, "k": k, "n": n, "g": g}, dtype=dtype,
        default=default_block_sizes(product=product, m=m, k=k, n=n, g=g, dtype=dtype),
        tune_here=not interpret and platform.triton_runs(),
    )


def _in_range(offset, size: int, limit: int):
    """Mask of `offset + arange(size) < limit`, or None when the tiling divides `limit`
    statically (every block is full): a mask Triton cannot prove true costs
    vectorisation along that axis."""
    if limit % size == 0:
        return None
    return (offset + jnp.arange(size, dtype=jnp.int32)) < limit


def _and(*masks):
    """The 2-D conjunction of per-axis masks ([rows] or None, [cols] or None)."""
    rows, cols = masks
    if rows is None and cols is None:
        return None
    if rows is None:
        return cols[None, :]
    if cols is None:
        return rows[:, None]
    return rows[:, None] & cols[None, :]


def _swizzle(pid, num_tiles: int, num_col_tiles: int, group_m: int):
    """Program id -> (row tile, column tile), group_m row tiles per sweep of columns so
    the weight tiles a sweep reads stay in L2 (rows of one group are adjacent tiles)."""
    width = group_m * num_col_tiles
    first = (pid // width) * group_m
    size = jnp.minimum(num_tiles - first, group_m)
    local = pid % width
    return first + local % size, local // size


class Tile(NamedTuple):
    """One gmm program's output tile: its row and column slices, column tile index, and
    the masks of its valid rows, columns and both (None where the tiling divides)."""
    rows: Any
    cols: Any
    col: Any
    row_ok: Any
    col_ok: Any
    store_ok: Any

    @property
    def shape(self) -> tuple[int, int]:
        """(block_m, block_n): the tile's values' shape."""
        return (self.row_ok.shape[0], self.cols.size)

    def load(self, ref):
        """ref's [rows, cols] block, 0 outside the valid rows and columns."""
        return _load(ref.at[self.rows, self.cols], self.store_ok)


def _gmm_kernel(group_ref, start_ref, end_ref, lhs_ref, rhs_ref, *refs, bs, m, k, n,
                num_groups, num_tiles, transpose_rhs, epilogue=None, pair=False,
                num_outputs=1):
    """One (row tile, column tile) of gmm. With `pair` (grouped_mlp's gate-up, not
    transposed) rhs is [g, k, 2n] (gate columns, then up) and the tile keeps a gate and an
    up accumulator for its n columns. With `epilogue` (grouped_mlp's kernels),
    epilogue(sums, extra_refs, out_refs, tile) stores the tile to the last `num_outputs`
    refs (sums None: rows of no group, whose outputs are zeros)."""
    extra_refs, out_refs = refs[:-num_outputs], refs[-num_outputs:]
    out_ref = out_refs[0]
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    tile, col = _swizzle(pl.program_id(0), num_tiles, cdiv(n, bn), bs.group_m)
    group, start, end = group_ref[tile], start_ref[tile], end_ref[tile]
    rows = pl.ds(start, bm)
    row_ok = (start + jnp.arange(bm, dtype=jnp.int32)) < end
    cols = pl.ds(col * bn, bn)
    col_ok = _in_range(col * bn, bn, n)
    store_ok = _and(row_ok, col_ok)
    out_tile = Tile(rows, cols, col, row_ok, col_ok, store_ok)

    @pl.when((group < num_groups) & (end > start))
    def _compute():
        gi = jnp.minimum(group, num_groups - 1)

        def step(i, acc):
            ks = pl.ds(i * bk, bk)
            k_ok = _in_range(i * bk, bk, k)
            a = plgpu.load(lhs_ref.at[rows, ks], mask=_and(row_ok, k_ok), other=0.0)
            if transpose_rhs:  # rhs[g] is [n, k]: a [bn, bk] block, contracted on axis 1
                b = _load(rhs_ref.at[gi, cols, ks], _and(col_ok, k_ok))
                dims = (((1,), (1,)), ((), ()))
            else:
                b = _load(rhs_ref.at[gi, ks, cols], _and(k_ok, col_ok))
                dims = (((1,), (0,)), ((), ()))
            if not pair:
                return acc + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
            up = _load(rhs_ref.at[gi, ks, pl.ds(n + col * bn, bn)], _and(k_ok, col_ok))
            return (acc[0] + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32),
                    acc[1] + jax.lax.dot_general(a, up, dims, preferred_element_type=jnp.float32))

        zeros = jnp.zeros((bm, bn), jnp.float32)
        acc = jax.lax.fori_loop(0, cdiv(k, bk), step,
                                (zeros, zeros) if pair else zeros)
        if epilogue is None:
            plgpu.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=store_ok)
        else:
            epilogue(acc, extra_refs, out_refs, out_tile)

    @pl.when(group == num_groups)  # rows past the total: zeros, per the contract
    def _zeros():
        if epilogue is None:
            plgpu.store(out_ref.at[rows, cols], jnp.zeros((bm, bn), out_ref.dtype),
                        mask=store_ok)
        else:
            epilogue(None, extra_refs, out_refs, out_tile)


def _load(ref, mask):
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0.0)


def _params(bs: config.TritonBlockSizes):
    return plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)


@sharding.local_operands("grouped_projection")
def gmm(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "g k n"] | Float[Array, "g n k"],
    group_sizes: Int[Array, "G"],
    *,
    group_offset=None,
    transpose_rhs: bool = False,
    out_dtype=None,
    block_sizes=None,
    interpret: bool = False,
) -> Float[Array, "m n"]:
    """[m, k] x [g, k, n] (or [g, n, k] with transpose_rhs) -> [m, n] out_dtype. rhs holds
    groups [group_offset, group_offset + g) of group_sizes (all of them when None); rows
    of other groups are zero tiles (no matmul)."""
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    # Tuning keys and fit rules take the projection's dims: dx contracts its n (here k)
    # and writes its k (here n).
    k_proj, n_proj = (n, k) if transpose_rhs else (k, n)
    bs = resolve_block_sizes(block_sizes, product="dx" if transpose_rhs else "forward",
                             m=m, k=k_proj, n=n_proj, g=group_sizes.shape[0], dtype=lhs.dtype,
                             interpret=interpret)
    name = "grouped_projection_gmm_dx" if transpose_rhs else "grouped_projection_gmm"
    return gmm_call(lhs, rhs, group_sizes, n, bs, group_offset=group_offset,
                    transpose_rhs=transpose_rhs, out_dtype=out_dtype, interpret=interpret,
                    name=name)


def gmm_call(lhs, rhs, group_sizes, n: int, bs: config.TritonBlockSizes, *, group_offset,
             transpose_rhs: bool, out_dtype, interpret: bool, name: str, epilogue=None,
             pair: bool = False, extra=(), outputs=None, cost_of=None):
    """The gmm kernel's call with blocks `bs` over n output columns: gmm's [m, n]. For
    grouped_mlp's kernels (_gmm_kernel): `pair` (rhs [g, k, 2n], gate and up sums), an
    `epilogue` storing the tiles, `extra` operands it reads (after rhs), and `outputs`,
    a tuple of (columns, dtype) of its [m, columns] outputs (returned as a tuple), and
    `cost_of(inputs=..., outputs=...)`, their cost estimate (else the product's)."""
    m, k = lhs.shape
    g = rhs.shape[0]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    meta = make_group_metadata(sizes, m, bs.block_m, aligned=False, include_tail=True,
                               row_start=row_start)
    num_tiles = num_visits(m, g, bs.block_m)
    kernel = functools.partial(
        _gmm_kernel, bs=bs, m=m, k=k, n=n, num_groups=g, num_tiles=num_tiles,
        transpose_rhs=transpose_rhs, epilogue=epilogue, pair=pair,
        num_outputs=1 if outputs is None else len(outputs),
    )
    out_shape = (sharding.out_struct((m, n), out_dtype, like=lhs) if outputs is None else
                 tuple(sharding.out_struct((m, cols), dtype, like=lhs)
                       for cols, dtype in outputs))
    operands = (meta.group, meta.start, meta.end, lhs, rhs, *extra)
    if cost_of is not None:
        cost = cost_of(inputs=operands, outputs=jax.tree.leaves(out_shape))
    else:
        cost = costs.gmm(m, k, n, lhs.dtype, transpose_rhs=transpose_rhs, inputs=operands,
                         outputs=(out_shape,))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_tiles * cdiv(n, bs.block_n),),
        compiler_params=_params(bs),
        interpret=interpret,
        cost_estimate=cost,
        name=name,
    )(*operands)


def _tgmm_kernel(offsets_ref, lhs_ref, rhs_ref, out_ref, *, bs, k, n):
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    group, kt, nt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = offsets_ref[group], offsets_ref[group + 1]
    ks, cols = pl.ds(kt * bk, bk), pl.ds(nt * bn, bn)
    k_ok = _in_range(kt * bk, bk, k)
    col_ok = _in_range(nt * bn, bn, n)

    def step(i, acc):
        row0 = start + i * bm
        row_ok = (row0 + jnp.arange(bm, dtype=jnp.int32)) < end
        a = plgpu.load(lhs_ref.at[pl.ds(row0, bm), ks], mask=_and(row_ok, k_ok), other=0.0)
        b = plgpu.load(rhs_ref.at[pl.ds(row0, bm), cols], mask=_and(row_ok, col_ok), other=0.0)
        dims = (((0,), (0,)), ((), ()))  # a^T b: contract the rows
        return acc + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    trips = (end - start + bm - 1) // bm
    acc = jax.lax.fori_loop(0, trips, step, jnp.zeros((bk, bn), jnp.float32))
    plgpu.store(out_ref.at[group, ks, cols], acc.astype(out_ref.dtype), mask=_and(k_ok, col_ok))


@sharding.local_operands("grouped_projection")
def tgmm(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "m n"],
    group_sizes: Int[Array, "G"],
    *,
    num_groups: int | None = None,
    group_offset=None,
    out_dtype=None,
    block_sizes=None,
    interpret: bool = False,
) -> Float[Array, "g k n"]:
    """[m, k], [m, n] -> [g, k, n]: per group lhs_g^T @ rhs_g; empty groups zeros.
    The g = num_groups groups are [group_offset, group_offset + g) of group_sizes (all of
    them when None). Rows of no such group are never read."""
    m, k = lhs.shape
    n = rhs.shape[1]
    g = num_groups or group_sizes.shape[0]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    bs = resolve_block_sizes(block_sizes, product="dkernel", m=m, k=k, n=n,
                             g=group_sizes.shape[0], dtype=lhs.dtype, interpret=interpret)
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    offsets = group_offsets(sizes, row_start)
    offsets = jnp.minimum(offsets, m)  # a total past m (caller error) never reads past m
    kernel = functools.partial(_tgmm_kernel, bs=bs, k=k, n=n)
    tiles_k, tiles_n = cdiv(k, bs.block_k), cdiv(n, bs.block_n)
    out_shape = sharding.out_struct((g, k, n), out_dtype, like=lhs)
    cost = costs.tgmm(m, k, n, lhs.dtype, inputs=(offsets, lhs, rhs), outputs=(out_shape,))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(g, tiles_k, tiles_n),
        compiler_params=_params(bs),
        interpret=interpret,
        cost_estimate=cost,
        name="grouped_projection_tgmm",
    )(offsets, lhs, rhs)
