"""The gated delta rule's decode step through Pallas Triton (CUDA GPUs from sm80).

One program per (batch row, value head, block of `BLOCK_V` value columns). The columns
of the state are independent in the update (the prediction S^T k reduces over K, within
a column), so each program loads its slot's [K, BLOCK_V] state once, decays it, writes
the delta rule's update, reduces it against q for the output, and stores it back in
place (the state operand is aliased to the state result: with the cache donated, XLA
writes no copy). Memory-bound: each state byte is read once and written once; q, k, v,
g and beta are a few bytes per state column. The arithmetic is the oracle's
(pallasite.reference.gated_delta_rule.one_step), in fp32; q and k are L2-normalised in
the program when asked.

A padding row (slot index outside [0, slots)) reads and writes nothing and gives o = 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallasite.kernels import cost, sharding
from pallasite.reference.gated_delta_rule import L2NORM_EPS

# Value columns per program (a K x 64 fp32 state: 32 KiB at K = 128) and its warps: the
# best of an H200 sweep over 32 / 64 / 128 columns on 1 / 2 / 4 / 8 warps
# (tools/sweeps/decode_steps.py --delta-configs, 2026-12-03): 0.82 of copy bandwidth at
# 256 rows, against 0.75 at 32 columns on four warps.
BLOCK_V = 64
NUM_WARPS = 2


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _kernel(idx_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, o_ref, state_out_ref,
            *, slots, dk, dv, per_key_head, scale, l2norm_qk):
    del state_out_ref  # the same buffer as state_ref (aliased)
    i, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = idx_ref[i]
    live = (slot >= 0) & (slot < slots)
    slot = jnp.where(live, slot, 0)
    kp2 = _pow2(dk)
    k_ok = jnp.arange(kp2, dtype=jnp.int32) < dk
    cols = pl.ds(vb * BLOCK_V, BLOCK_V)
    v_ok = vb * BLOCK_V + jnp.arange(BLOCK_V, dtype=jnp.int32) < dv
    mask = k_ok[:, None] & v_ok[None, :]
    hk = h // per_key_head

    q = plgpu.load(q_ref.at[i, hk, pl.ds(0, kp2)], mask=k_ok, other=0.0).astype(jnp.float32)
    k = plgpu.load(k_ref.at[i, hk, pl.ds(0, kp2)], mask=k_ok, other=0.0).astype(jnp.float32)
    if l2norm_qk:
        q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS)
        k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)
    v = plgpu.load(v_ref.at[i, h, cols], mask=v_ok, other=0.0).astype(jnp.float32)
    g = g_ref[i, h].astype(jnp.float32)
    beta = beta_ref[i, h].astype(jnp.float32)
    state = plgpu.load(state_ref.at[slot, h, pl.ds(0, kp2), cols], mask=mask & live,
                       other=0.0).astype(jnp.float32)

    state = state * jnp.exp(g)
    pred = jnp.sum(state * k[:, None], axis=0)  # S^T k, this block's columns
    state = state + (beta * k)[:, None] * (v - pred)[None, :]
    o = jnp.sum(state * (scale * q)[:, None], axis=0)
    o = jnp.where(live, o, 0.0)
    plgpu.store(state_ref.at[slot, h, pl.ds(0, kp2), cols], state.astype(state_ref.dtype),
                mask=mask & live)
    plgpu.store(o_ref.at[i, h, cols], o.astype(o_ref.dtype), mask=v_ok)


def _body(state, q, k, v, g, beta):
    """The step's arithmetic over the rows' states (heads expanded), for
    pl.estimate_cost: the decay, the prediction, the update and the output."""
    state = state * jnp.exp(g)[..., None, None]
    pred = jnp.sum(state * k[..., None], axis=-2)
    state = state + (beta[..., None] * k)[..., None] * (v - pred)[..., None, :]
    return jnp.sum(state * q[..., None], axis=-2)


def _cost(state, q, v, others, o):
    """flops and exps of `_body`; bytes of every operand and o once, and of the state
    rows the batch names (read and written once), not the whole cache."""
    b, hv, dv = v.shape
    dk = q.shape[2]
    f32 = jnp.float32
    rows = cost.struct((b, hv, dk, dv), state.dtype)
    return cost.estimate(_body, cost.struct((b, hv, dk, dv), f32), cost.struct((b, hv, dk), f32),
                         cost.struct((b, hv, dk), f32), cost.struct((b, hv, dv), f32),
                         cost.struct((b, hv), f32), cost.struct((b, hv), f32),
                         inputs=others + (rows,), outputs=(o, rows))


@sharding.local_operands("pallasite.kernels.gated_delta_rule_step")
def update(state, q, k, v, g, beta, scale: float, slots_of_rows, l2norm_qk: bool, *,
           interpret: bool = False):
    """(o [b, Hv, V] in v's dtype, the state advanced in place): slots_of_rows [b] int32
    (padding rows outside [0, slots))."""
    slots, hv, dk, dv = state.shape
    b, hk = q.shape[:2]
    inputs = (slots_of_rows, q, k, v, g, beta, state)
    outputs = (sharding.out_struct((b, hv, dv), v.dtype, like=v),
               sharding.out_struct(state.shape, state.dtype, like=state))
    kernel = functools.partial(_kernel, slots=slots, dk=dk, dv=dv, per_key_head=hv // hk,
                               scale=float(scale), l2norm_qk=l2norm_qk)
    return pl.pallas_call(
        kernel,
        out_shape=outputs,
        grid=(b, hv, -(-dv // BLOCK_V)),
        input_output_aliases={len(inputs) - 1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        cost_estimate=_cost(state, q, v, inputs[:-1], outputs[0]),
        name="gated_delta_rule_step",
    )(*inputs)
