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
from pallasite.kernels.expert_mlp import epilogue
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
                         name="grouped_mlp_gate_up_triton",
                         epilogue=functools.partial(_store_h, activation=activation))


def _store_h(sums, extra, out_ref, tile, *, activation):
    """h = act(gate) * up for a tile of a group's rows; zeros for rows of no group."""
    del extra
    h = (jnp.zeros((tile.row_ok.shape[0], tile.cols.size), jnp.float32) if sums is None
         else epilogue.gated(*sums, activation))
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
                         name="grouped_mlp_gate_up_grad_triton", extra=(dh,), out_cols=2 * f,
                         epilogue=functools.partial(_store_d_pre, activation=activation, f=f))


def _store_d_pre(sums, extra, out_ref, tile, *, activation, f):
    """[act'(gate) up dh, act(gate) dh] into the tile's gate and up columns."""
    (dh_ref,) = extra
    up_cols = pl.ds(f + tile.cols.start, tile.cols.size)
    shape = (tile.row_ok.shape[0], tile.cols.size)
    if sums is None:
        d_gate = d_up = jnp.zeros(shape, jnp.float32)
    else:
        gate, up = sums
        mask = tile.store_ok
        dh = (plgpu.load(dh_ref.at[tile.rows, tile.cols]) if mask is None else
              plgpu.load(dh_ref.at[tile.rows, tile.cols], mask=mask, other=0.0))
        d_gate, d_up = epilogue.d_pre(gate, up, dh.astype(jnp.float32), activation)
    plgpu.store(out_ref.at[tile.rows, tile.cols], d_gate.astype(out_ref.dtype),
                mask=tile.store_ok)
    plgpu.store(out_ref.at[tile.rows, up_cols], d_up.astype(out_ref.dtype), mask=tile.store_ok)
