"""Mosaic TPU grouped matmuls (gmm, tgmm) in the megablox style.

TPU blocks must be aligned, so a visit (see group_metadata, `aligned=True`) is the
intersection of one group with one [tm]-row block: a block shared by two groups is
visited once per group, consecutively, each visit storing only its own rows (the output
block stays resident in VMEM between visits). The visit arrays ride in scalar prefetch
(SMEM) and steer the BlockSpec index maps. The contraction is the innermost,
"arbitrary" axis, accumulated in an fp32 VMEM scratch and rounded once at the store.

gmm grid: (n tiles, visits, k tiles). Rows past the total are one more pseudo-group whose
visits store zeros; padded visits (the static bound exceeds the real count) repeat the
last visit with no rows. With transpose_rhs, rhs is [g, n, k] and its [tn, tk] block is
contracted on its last axis: dx reads the forward kernel in place.
tgmm grid: (n tiles, k tiles, visits); every empty group gets one empty visit, so its
zero accumulator is stored.

Unaligned m, k, n are padded with zeros to the tile (a copy only when unaligned).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallasite.kernels import platform, sharding
from pallasite.kernels.grouped_matmul import config, costs
from pallasite.kernels.grouped_matmul.group_metadata import (
    cdiv,
    local_groups,
    make_group_metadata,
    num_visits,
)
from pallasite.reference.grouped_projection import Dtype

DEFAULT = config.MosaicTpuBlockSizes(tm=256, tk=1024, tn=1024)  # see default_block_sizes
_block_spec = platform.mosaic_tpu_block_spec  # int32 block indices under x64 too


def refusal(compute: Dtype, operands: Sequence[jax.Array], *, target: str | None
            ) -> str | None:
    """Why these kernels cannot run `compute` over `operands` compiled for `target` (a
    platform; None: interpreted, which takes every dtype ragged_dot_runs admits). None:
    they can. api.py asks after its generic checks. Every TPU runs them, so a lowering
    for a TPU from another host (a TPU export) passes; the TPU compiler's dtype limits
    hold there too, since a compile error would not reach a fallback."""
    del operands  # cast to `compute` before the kernels
    if target is None:
        return None
    if target != "tpu":
        return f"pallas_mosaic_tpu needs a TPU; the target is {target}"
    return platform.mosaic_tpu_dtype_reason("pallas_mosaic_tpu", {"compute": compute})


def _column_tile(dim: int, cap: int) -> int:
    """The narrowest multiple of 128 that covers `dim` in as few tiles as `cap`-wide ones
    would: the fewest grid steps, and the least padding among them (k = 1536 at cap 1024
    takes two 768-wide tiles, no padding copy)."""
    lanes = cdiv(dim, 128)
    tiles = cdiv(lanes * 128, cap)
    return cdiv(lanes, tiles) * 128


def default_block_sizes(*, product: str, m: int, k: int, n: int, g: int,
                        dtype) -> config.MosaicTpuBlockSizes:
    """DEFAULT (256 rows x 1024 deep x 1024 columns) cut to the product's dimensions.

    Each grid step costs about 0.4 us beside its matmul on a v5e, so 128^3 tiles
    (megablox's default) left the kernels at 361 ms for mixtral's forward; 256 x 1024 x
    1024 ran it in 29.6 ms and its forward+backward in 81.8 ms, against 29.0 and 146 ms
    for jax.lax.ragged_dot (docs/performance.md, 2026-12-07). The tiles fit the 16 MiB
    of scoped VMEM for 16-bit operands; 4-byte operands take 512-wide k and n tiles.
    The contraction and column tiles are balanced over their dimension (_column_tile),
    so aligned weights are seldom padded."""
    del g
    rows, contraction, columns = (m, n, k) if product == "dx" else (m, k, n)
    shrink = 1 if jnp.dtype(dtype).itemsize <= 2 else 2
    return config.MosaicTpuBlockSizes(tm=min(DEFAULT.tm, cdiv(rows, 16) * 16),
                                      tk=_column_tile(contraction, DEFAULT.tk // shrink),
                                      tn=_column_tile(columns, DEFAULT.tn // shrink))


def resolve_block_sizes(block_sizes, *, product: str, m: int, k: int, n: int, g: int,
                        dtype) -> config.MosaicTpuBlockSizes:
    """The one place this backend picks its tiles: the caller's, else the default."""
    chosen = config.for_product(block_sizes, product)
    if chosen is not None:
        if not isinstance(chosen, config.MosaicTpuBlockSizes):
            raise TypeError(f"block_sizes for pallas_mosaic_tpu must be MosaicTpuBlockSizes, got {chosen!r}")
        return chosen
    return default_block_sizes(product=product, m=m, k=k, n=n, g=g, dtype=dtype)


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _row_mask(tile, start, end, tm: int, width: int):
    rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, width), 0)
    return (rows >= start) & (rows < end)


def _load_f32(ref):
    return ref[...].astype(jnp.float32)


def _interpret(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


def _gmm_kernel(group_ref, start_ref, end_ref, tile_ref, lhs_ref, rhs_ref, out_ref, acc_ref,
                *, num_groups, tiles_k, tm, tn, transpose_rhs):
    v, ki = pl.program_id(1), pl.program_id(2)
    group, start, end = group_ref[v], start_ref[v], end_ref[v]

    @pl.when(ki == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when((group < num_groups) & (end > start))
    def _accumulate():
        dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
        acc_ref[...] += jax.lax.dot_general(
            lhs_ref[...], rhs_ref[...], dims, preferred_element_type=jnp.float32
        )

    @pl.when(ki == tiles_k - 1)
    def _store():
        mask = _row_mask(tile_ref[v], start, end, tm, tn)
        old = out_ref[...].astype(jnp.float32)
        out_ref[...] = jnp.where(mask, acc_ref[...], old).astype(out_ref.dtype)


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
    of other groups are zero visits (no matmul)."""
    m, k = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    # Tuning keys and fit rules take the projection's dims: dx contracts its n (here k)
    # and writes its k (here n).
    k_proj, n_proj = (n, k) if transpose_rhs else (k, n)
    bs = resolve_block_sizes(block_sizes, product="dx" if transpose_rhs else "forward",
                             m=m, k=k_proj, n=n_proj, g=g, dtype=lhs.dtype)
    tm, tk, tn = bs.tm, bs.tk, bs.tn
    lhs = _pad_to(_pad_to(lhs, 0, tm), 1, tk)
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    rhs = _pad_to(_pad_to(rhs, k_axis, tk), n_axis, tn)
    mp, kp = lhs.shape
    np_ = rhs.shape[n_axis]
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    meta = make_group_metadata(sizes, mp, tm, aligned=True, include_tail=True,
                               row_start=row_start)
    visits, tiles_k = num_visits(mp, g, tm), kp // tk

    def rhs_map(ni, v, ki, group, start, end, tile):
        gi = jnp.minimum(group[v], g - 1)
        return (gi, ni, ki) if transpose_rhs else (gi, ki, ni)

    rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
    kernel = functools.partial(_gmm_kernel, num_groups=g, tiles_k=tiles_k, tm=tm, tn=tn,
                               transpose_rhs=transpose_rhs)
    scalars = (meta.group, meta.start, meta.end, meta.tile)
    out = pl.pallas_call(
        kernel,
        out_shape=sharding.out_struct((mp, np_), out_dtype, like=lhs),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(np_ // tn, visits, tiles_k),
            in_specs=[
                _block_spec((tm, tk), lambda ni, v, ki, gr, st, en, tl: (tl[v], ki)),
                _block_spec(rhs_block, rhs_map),
            ],
            out_specs=_block_spec((tm, tn), lambda ni, v, ki, gr, st, en, tl: (tl[v], ni)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=_interpret(interpret),
        cost_estimate=costs.gmm(mp, kp, np_, lhs.dtype, transpose_rhs=transpose_rhs,
                                inputs=(*scalars, lhs, rhs),
                                outputs=(jax.ShapeDtypeStruct((mp, np_), out_dtype),)),
        name="grouped_projection_gmm_dx" if transpose_rhs else "grouped_projection_gmm",
    )(*scalars, lhs, rhs)
    return out[:m, :n]


def _tgmm_kernel(group_ref, start_ref, end_ref, tile_ref, lhs_ref, rhs_ref, out_ref, acc_ref,
                 *, tm, tk, tn):
    v, last = pl.program_id(2), pl.num_programs(2) - 1
    group, start, end, tile = group_ref[v], start_ref[v], end_ref[v], tile_ref[v]

    @pl.when((v == 0) | (group != group_ref[jnp.maximum(v - 1, 0)]))
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(end > start)
    def _accumulate():
        dtype = lhs_ref.dtype
        zero = jnp.float32(0)  # typed: a literal 0 is int64 under jax_enable_x64
        a = jnp.where(_row_mask(tile, start, end, tm, tk), _load_f32(lhs_ref), zero)
        b = jnp.where(_row_mask(tile, start, end, tm, tn), _load_f32(rhs_ref), zero)
        acc_ref[...] += jax.lax.dot_general(
            a.astype(dtype).T, b.astype(dtype), (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )

    @pl.when((v == last) | (group != group_ref[jnp.minimum(v + 1, last)]))
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


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
    """[m, k], [m, n] -> [g, k, n]: per group lhs_g^T @ rhs_g; empty groups zeros. The
    g = num_groups groups are [group_offset, group_offset + g) of group_sizes (all of
    them when None)."""
    m, k = lhs.shape
    n = rhs.shape[1]
    g = num_groups or group_sizes.shape[0]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    bs = resolve_block_sizes(block_sizes, product="dkernel", m=m, k=k, n=n, g=g, dtype=lhs.dtype)
    tm, tk, tn = bs.tm, bs.tk, bs.tn
    lhs = _pad_to(_pad_to(lhs, 0, tm), 1, tk)
    rhs = _pad_to(_pad_to(rhs, 0, tm), 1, tn)
    mp, kp = lhs.shape
    np_ = rhs.shape[1]
    sizes, row_start = local_groups(group_sizes, group_offset, g)
    meta = make_group_metadata(sizes, mp, tm, aligned=True, include_tail=False,
                               visit_empty=True, row_start=row_start)
    scalars = (meta.group, meta.start, meta.end, meta.tile)
    kernel = functools.partial(_tgmm_kernel, tm=tm, tk=tk, tn=tn)
    out = pl.pallas_call(
        kernel,
        out_shape=sharding.out_struct((g, kp, np_), out_dtype, like=lhs),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(np_ // tn, kp // tk, num_visits(mp, g, tm)),
            in_specs=[
                _block_spec((tm, tk), lambda ni, ki, v, gr, st, en, tl: (tl[v], ki)),
                _block_spec((tm, tn), lambda ni, ki, v, gr, st, en, tl: (tl[v], ni)),
            ],
            out_specs=_block_spec((None, tk, tn),
                                  lambda ni, ki, v, gr, st, en, tl: (gr[v], ki, ni)),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=_interpret(interpret),
        cost_estimate=costs.tgmm(mp, kp, np_, lhs.dtype, inputs=(*scalars, lhs, rhs),
                                 outputs=(jax.ShapeDtypeStruct((g, kp, np_), out_dtype),)),
        name="grouped_projection_tgmm",
    )(*scalars, lhs, rhs)
    return out[:, :k, :n]
