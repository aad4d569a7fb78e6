"""The decode step through Pallas Triton (CUDA GPUs from sm80): one pass over the state.

One program per (batch row, head, block of `BLOCK_P` head_dim rows) loads its slot's
[BLOCK_P, n] state once, advances it, stores it back in place (the state operand is
aliased to the state result: with the cache donated, XLA writes no copy), and reduces the
new state against C for y. The step is memory-bound: each state byte is read once and
written once; x, z, B and C are a few bytes per state row. The arithmetic is the oracle's
(pallasite.reference.ssd_decode), in fp32.

A padding row (slot index outside [0, slots)) reads and writes nothing and gives y = 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallasite.kernels import cost, sharding

BLOCK_P = 16  # head_dim rows per program: 16 x n fp32 state (8 KiB at n = 128)
NUM_WARPS = 4


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _kernel(idx_ref, x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, z_ref, state_ref,
            y_ref, state_out_ref, *, slots, p, n, per_group, has_d, d_per_row, has_z):
    del state_out_ref  # the same buffer as state_ref (aliased)
    i, h, pb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = idx_ref[i]
    live = (slot >= 0) & (slot < slots)
    slot = jnp.where(live, slot, 0)
    rows = pl.ds(pb * BLOCK_P, BLOCK_P)
    row_ok = pb * BLOCK_P + jnp.arange(BLOCK_P, dtype=jnp.int32) < p
    np2 = _pow2(n)
    col_ok = jnp.arange(np2, dtype=jnp.int32) < n
    mask = row_ok[:, None] & col_ok[None, :]
    g = h // per_group

    x = plgpu.load(x_ref.at[i, h, rows], mask=row_ok, other=0.0).astype(jnp.float32)
    dt = dt_ref[i, h].astype(jnp.float32)  # processed (bias, softplus) by the caller
    a = a_ref[h].astype(jnp.float32)
    bvec = plgpu.load(b_ref.at[i, g, pl.ds(0, np2)], mask=col_ok, other=0.0).astype(jnp.float32)
    cvec = plgpu.load(c_ref.at[i, g, pl.ds(0, np2)], mask=col_ok, other=0.0).astype(jnp.float32)
    state = plgpu.load(state_ref.at[slot, h, rows, pl.ds(0, np2)], mask=mask & live,
                       other=0.0).astype(jnp.float32)

    new = state * jnp.exp(a * dt) + (dt * x)[:, None] * bvec[None, :]
    y = jnp.sum(new * cvec[None, :], axis=1)
    if has_d:
        d = (plgpu.load(d_ref.at[h, rows], mask=row_ok, other=0.0) if d_per_row
             else d_ref[h]).astype(jnp.float32)
        y = y + d * x
    if has_z:
        z = plgpu.load(z_ref.at[i, h, rows], mask=row_ok, other=0.0).astype(jnp.float32)
        y = y * (z * jax.nn.sigmoid(z))
    y = jnp.where(live, y, 0.0)
    plgpu.store(state_ref.at[slot, h, rows, pl.ds(0, np2)], new.astype(state_ref.dtype),
                mask=mask & live)
    plgpu.store(y_ref.at[i, h, rows], y.astype(y_ref.dtype), mask=row_ok)


def _body(state, x, dt, a, bvec, cvec):
    """The step's arithmetic over the rows' states (heads' B and C already picked), for
    pl.estimate_cost: y without D and z (a few flops per state row, left out)."""
    decay = jnp.exp(a[None, :] * dt)
    new = (state * decay[:, :, None, None]
           + (dt[:, :, None] * x)[..., None] * bvec[:, :, None, :])
    return jnp.sum(new * cvec[:, :, None, :], axis=-1)


def _cost(state, x, others, y):
    """flops and exps of `_body`; bytes of every operand and y once, and of the state
    rows the batch names (read and written once), not the whole cache."""
    b, h, p = x.shape
    n = state.shape[3]
    f32 = jnp.float32
    rows = cost.struct((b, h, p, n), state.dtype)
    return cost.estimate(_body, cost.struct((b, h, p, n), f32), cost.struct((b, h, p), f32),
                         cost.struct((b, h), f32), cost.struct((h,), f32),
                         cost.struct((b, h, n), f32), cost.struct((b, h, n), f32),
                         inputs=others + (x, rows), outputs=(y, rows))


@sharding.local_operands("pallasite.kernels.selective_state_update")
def update(state, x, dt, A, B, C, D, z, slots_of_rows, *, interpret: bool = False):
    """(y [b, h, p] in x's dtype, state advanced in place): dt already processed (fp32),
    slots_of_rows [b] int32 (padding rows outside [0, slots))."""
    slots, h, p, n = state.shape
    b = x.shape[0]
    per_group = h // B.shape[1]
    has_d, has_z = D is not None, z is not None
    d = D if has_d else jnp.zeros((1,), jnp.float32)
    zz = z if has_z else jnp.zeros((1,), x.dtype)
    inputs = (slots_of_rows, x, dt, A, B, C, d, zz, state)
    outputs = (sharding.out_struct((b, h, p), x.dtype, like=x),
               sharding.out_struct(state.shape, state.dtype, like=state))
    kernel = functools.partial(_kernel, slots=slots, p=p, n=n, per_group=per_group,
                               has_d=has_d, d_per_row=has_d and D.ndim == 2, has_z=has_z)
    return pl.pallas_call(
        kernel,
        out_shape=outputs,
        grid=(b, h, -(-p // BLOCK_P)),
        input_output_aliases={len(inputs) - 1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        cost_estimate=_cost(state, x, inputs[:1] + inputs[2:-1], outputs[0]),
        name="selective_state_update",
    )(*inputs)
