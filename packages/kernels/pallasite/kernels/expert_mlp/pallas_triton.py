"""grouped_mlp's gate-up product with its activation in the epilogue, through Pallas
Triton (CUDA GPUs from sm80): h = act(x W_gate) * (x W_up), [m, f], one kernel.

It is grouped_matmul.pallas_triton's gmm (unaligned row tiles from the group metadata,
masked loads and stores, zero tiles for rows past the total) with a second weight block
per k step: a program's f-wide output columns [c, c + block_n) read the gate columns
[c, c + block_n) and the up columns [f + c, f + c + block_n) of the group's [k, 2f]
kernel into two fp32 accumulators, and stores act(gate) * up rounded once. A tile does
the tensor work of a block_m x 2 block_n pre-activation tile, so the gmm's 128 x 256
tile becomes 128 x 128 here.

gate_up_grad is the backward's half of it: the same two accumulators recomputed from
x, then d(pre) = [act'(gate) up dh, act(gate) dh] stored in the compute dtype, so the
pre-activation is never written in either pass.

Not yet measured on a GPU (lowered for an H200 and run by the interpreter on the CPU).
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Int, Shaped

from pallasite.kernels import sharding
from pallasite.kernels.expert_mlp import costs, epilogue
from pallasite.kernels.grouped_matmul import config
from pallasite.kernels.grouped_matmul import pallas_triton as base

# The gmm default's tensor work per program (128 x 256 of the pre-activation). Not tuned.
GATE_UP_DEFAULT = config.TritonBlockSizes(128, 128, 64, group_m=8, num_warps=8, num_stages=3)


@sharding.local_operands("grouped_mlp")
def gate_up(
    lhs: Shaped[Array, "m k"],
    rhs: Shaped[Array, "g k two_f"],
    group_sizes: Int[Array, " G"],
    *,
    activation: str = "swiglu",
    group_offset=None,
    out_dtype: Any = None,
    block_sizes: config.TritonBlockSizes | None = None,
    interpret: bool = False,
) -> Shaped[Array, "m f"]:
    """h[rows of group i] = act(lhs_i W_gate[i]) * (lhs_i W_up[i]), W_gate = rhs[..., :f],
    W_up = rhs[..., f:]; fp32 sums, rounded once to out_dtype (lhs's when None). rhs
    holds groups [group_offset, group_offset + g) of group_sizes (all when None); rows of
    no local group are zero. block_sizes: block_n is h's columns per program."""
    epilogue.check_gate_up(lhs, rhs, activation)
    f = rhs.shape[2] // 2
    if 0 in lhs.shape or f == 0 or rhs.shape[0] == 0:
        return jnp.zeros((lhs.shape[0], f), jnp.dtype(out_dtype or lhs.dtype))
    return base.gmm_call(lhs, rhs, group_sizes, f, block_sizes or GATE_UP_DEFAULT,
                         group_offset=group_offset, transpose_rhs=False,
                         out_dtype=out_dtype, interpret=interpret,
                         name="grouped_mlp_gate_up_triton", pair=True,
                         epilogue=functools.partial(_store_h, activation=activation),
                         cost_of=functools.partial(costs.gate_up, lhs.shape[0],
                                                   lhs.shape[1], f, lhs.dtype, activation,
                                                   grad=False))


def _store_h(sums, extra, outs, tile, *, activation):
    """h = act(gate) * up for a tile of a group's rows; zeros for rows of no group."""
    del extra
    (out_ref,) = outs
    h = jnp.zeros(tile.shape, jnp.float32) if sums is None else epilogue.gated(*sums, activation)
    plgpu.store(out_ref.at[tile.rows, tile.cols], h.astype(out_ref.dtype), mask=tile.store_ok)


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
    block_sizes: config.TritonBlockSizes | None = None,
    interpret: bool = False,
) -> Shaped[Array, "m two_f"]:
    """d(pre) [m, 2f] = [act'(gate) up dh, act(gate) dh] for h = act(gate) * up, the
    pre-activation (gate | up) = lhs_i rhs[i] recomputed in the kernel (fp32 sums, never
    stored), rounded once to out_dtype (lhs's when None); rows of no local group zero.
    The gate-up's backward feeds it to the grouped dx and dkernel."""
    epilogue.check_gate_up(lhs, rhs, activation, dh)
    f = rhs.shape[2] // 2
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if 0 in lhs.shape or f == 0 or rhs.shape[0] == 0:
        return jnp.zeros((lhs.shape[0], 2 * f), out_dtype)
    return base.gmm_call(lhs, rhs, group_sizes, f, block_sizes or GATE_UP_DEFAULT,
                         group_offset=group_offset, transpose_rhs=False,
                         out_dtype=out_dtype, interpret=interpret,
                         name="grouped_mlp_gate_up_grad_triton", pair=True, extra=(dh,),
                         outputs=((2 * f, out_dtype),),
                         epilogue=functools.partial(_store_d_pre, activation=activation,
                                                    f=f),
                         cost_of=functools.partial(costs.gate_up, lhs.shape[0],
                                                   lhs.shape[1], f, lhs.dtype, activation,
                                                   grad=True))[0]


def _store_d_pre(sums, extra, outs, tile, *, activation, f):
    """[act'(gate) up dh, act(gate) dh] into the tile's gate and up columns."""
    (dh_ref,) = extra
    (out_ref,) = outs
    up_cols = pl.ds(f + tile.cols.start, tile.cols.size)
    if sums is None:
        d_gate = d_up = jnp.zeros(tile.shape, jnp.float32)
    else:
        gate, up = sums
        d_gate, d_up = epilogue.d_pre(gate, up, tile.load(dh_ref).astype(jnp.float32),
                                      activation)
    plgpu.store(out_ref.at[tile.rows, tile.cols], d_gate.astype(out_ref.dtype),
                mask=tile.store_ok)
    plgpu.store(out_ref.at[tile.rows, up_cols], d_up.astype(out_ref.dtype), mask=tile.store_ok)


# ----------------------------------------------------------------- the down product


@sharding.local_operands("grouped_mlp")
def down_weighted(
    h: Shaped[Array, "m f"],
    rhs: Shaped[Array, "g f n"],
    group_sizes: Int[Array, " G"],
    row_weights: Shaped[Array, " m"],
    *,
    group_offset=None,
    out_dtype: Any = None,
    block_sizes: config.TritonBlockSizes | None = None,
    interpret: bool = False,
) -> Shaped[Array, "m n"]:
    """y[rows of group i] = (h_i rhs[i]) * row_weights: the fp32 sums scaled by each row's
    weight in the epilogue, then rounded once to out_dtype (h's when None); rows of no
    local group are zero. block_sizes: None takes the grouped gmm's (tuned) forward
    blocks."""
    epilogue.check_down(h, rhs, row_weights)
    m, f = h.shape
    n = rhs.shape[2]
    out_dtype = jnp.dtype(out_dtype or h.dtype)
    if 0 in (m, f, n) or rhs.shape[0] == 0:
        return jnp.zeros((m, n), out_dtype)
    bs = block_sizes or base.resolve_block_sizes(
        None, product="forward", m=m, k=f, n=n, g=group_sizes.shape[0], dtype=h.dtype,
        interpret=interpret)
    return base.gmm_call(h, rhs, group_sizes, n, bs, group_offset=group_offset,
                         transpose_rhs=False, out_dtype=out_dtype, interpret=interpret,
                         name="grouped_mlp_down_triton", extra=(row_weights,),
                         outputs=((n, out_dtype),), epilogue=_store_weighted,
                         cost_of=functools.partial(costs.down_weighted, m, f, n, h.dtype,
                                                   grad=False))[0]


def _store_weighted(sums, extra, outs, tile):
    (rw_ref,) = extra
    (out_ref,) = outs
    y = jnp.zeros(tile.shape, jnp.float32) if sums is None else sums * _row_weights(rw_ref, tile)
    plgpu.store(out_ref.at[tile.rows, tile.cols], y.astype(out_ref.dtype), mask=tile.store_ok)


def _row_weights(rw_ref, tile):
    """The tile's rows' weights as an fp32 column (0 past the group's rows)."""
    rw = plgpu.load(rw_ref.at[tile.rows], mask=tile.row_ok, other=0.0)
    return rw.astype(jnp.float32)[:, None]


@sharding.local_operands("grouped_mlp")
def down_weighted_grad(
    dy: Shaped[Array, "m n"],
    rhs: Shaped[Array, "g f n"],
    group_sizes: Int[Array, " G"],
    row_weights: Shaped[Array, " m"],
    h: Shaped[Array, "m f"],
    *,
    group_offset=None,
    block_sizes: config.TritonBlockSizes | None = None,
    interpret: bool = False,
    dh_dtype=None,
):
    """The down product's backward for h: t = dy_i rhs[i]^T (fp32 sums, the weights read
    in place, transposed), then in the epilogue dh = row_weights * t (in dh_dtype, h's
    when None: fp32 where partial sums over a split n are summed after) and each row's
    share of d row_weights, sum over the tile's columns of h * t. Returns (dh [m, f],
    d row_weights [m] fp32): the weights' gradient comes from the same tiles as dh, with
    no pass over y."""
    epilogue.check_down(h, rhs, row_weights, dy)
    m, f = h.shape
    n = rhs.shape[2]
    dh_dtype = jnp.dtype(dh_dtype or h.dtype)
    if 0 in (m, f, n) or rhs.shape[0] == 0:
        return jnp.zeros((m, f), dh_dtype), jnp.zeros((m,), jnp.float32)
    bs = block_sizes or base.resolve_block_sizes(
        None, product="dx", m=m, k=f, n=n, g=group_sizes.shape[0], dtype=h.dtype,
        interpret=interpret)
    # rhs [g, f, n] read as [g, n', k'] = [g, f, n] transposed: the output is f wide
    dh, parts = base.gmm_call(
        dy, rhs, group_sizes, f, bs, group_offset=group_offset, transpose_rhs=True,
        out_dtype=dh_dtype, interpret=interpret, name="grouped_mlp_down_grad_triton",
        extra=(row_weights, h), epilogue=_store_dh_and_weight_parts,
        outputs=((f, dh_dtype), (-(-f // bs.block_n), jnp.float32)),
        cost_of=functools.partial(costs.down_weighted, m, f, n, h.dtype, grad=True))
    return dh, jnp.sum(parts, axis=1)


def _store_dh_and_weight_parts(sums, extra, outs, tile):
    rw_ref, h_ref = extra
    dh_ref, parts_ref = outs
    if sums is None:
        dh, part = jnp.zeros(tile.shape, jnp.float32), jnp.zeros(tile.shape[:1], jnp.float32)
    else:
        dh = sums * _row_weights(rw_ref, tile)
        part = jnp.sum(tile.load(h_ref).astype(jnp.float32) * sums, axis=1)
    plgpu.store(dh_ref.at[tile.rows, tile.cols], dh.astype(dh_ref.dtype), mask=tile.store_ok)
    plgpu.store(parts_ref.at[tile.rows, pl.ds(tile.col, 1)], part[:, None],
                mask=tile.row_ok[:, None])
