"""dew's `delta_rule`: one decode token of the delta rule with a decay per key dimension.

For a state S [Dk, Dv], the token's update and output are

    delta = beta (v - (k decay)^T S)
    S'    = diag(decay) S + k delta^T
    out   = q^T S' = (q decay)^T S + (q . k) delta

with decay = exp(g) given per key dimension (a vector gate; pallasite's own
`gated_delta_rule_step` takes one log decay per head) and q already scaled. Both readouts
use the old state, so one pass reads it and writes S'. A bf16 state is rounded
stochastically (`round_to_bf16`), as dew rounds it, so a decay smaller than half a bf16
step still moves the state on average. Written in plain JAX (XLA fuses the readouts and
the write into one pass over the state), so it runs on every device; donate the state
to update it in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.kernels.dew._layouts import F32

# The salts and the integer finalizer of the rounding noise (a golden-ratio and a
# murmur3 multiplier; the lowbias32 mix), fixed so the rounding is reproducible.
_KEY_SALT, _VALUE_SALT = 0x9E3779B1, 0x85EBCA77
_MIX = (0x7FEB352D, 0x846CA68B)


def fits(state) -> bool:
    """Whether `step` takes this state: [rows, heads, Dk, Dv] held in fp32 or bf16. (dew's
    CUDA kernel also asks for power-of-two widths; the form here takes any.)"""
    return (getattr(state, "ndim", 0) == 4
            and np.dtype(state.dtype) in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)))


def round_to_bf16(state, key, value):
    """`state` [..., Dk, Dv] fp32 rounded to bf16 stochastically: away from zero with the
    probability the dropped low 16 bits give, else toward it. The noise hashes the
    value's bits with the token's key [..., Dk] and value [..., Dv], so it is
    deterministic and changes from token to token."""
    u32 = jnp.uint32
    bits = jax.lax.bitcast_convert_type(jnp.asarray(state, F32), u32)
    salt = (jax.lax.bitcast_convert_type(jnp.asarray(key, F32), u32)[..., :, None] * u32(_KEY_SALT)
            + jax.lax.bitcast_convert_type(jnp.asarray(value, F32), u32)[..., None, :]
            * u32(_VALUE_SALT))
    noise = bits ^ salt
    noise = (noise ^ (noise >> 16)) * u32(_MIX[0])
    noise = (noise ^ (noise >> 15)) * u32(_MIX[1])
    noise = noise ^ (noise >> 16)
    kept = (bits + (noise & u32(0xFFFF))) & u32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(kept, F32).astype(jnp.bfloat16)


def step(state, query, key, value, decay, beta, active=None):
    """(state', out) for one token: state [rows, heads, Dk, Dv] in fp32 or bf16 (written
    back in its dtype, a bf16 one through `round_to_bf16`); query (already scaled), key
    and decay [rows, heads, Dk]; value [rows, heads, Dv]; beta [rows, heads]; the rule
    runs in fp32. out [rows, heads, Dv] in query's dtype. active [rows] (bool): a row
    marked False keeps its state bit for bit and gets zeros."""
    if not fits(state):
        raise ValueError(f"state must be [rows, heads, Dk, Dv] in float32 or bfloat16; got "
                         f"{getattr(state, 'shape', None)} {getattr(state, 'dtype', None)}")
    rows, heads, dk, dv = state.shape
    for name, a, want in (("query", query, (rows, heads, dk)), ("key", key, (rows, heads, dk)),
                          ("decay", decay, (rows, heads, dk)), ("value", value, (rows, heads, dv)),
                          ("beta", beta, (rows, heads))):
        if tuple(a.shape) != want:
            raise ValueError(f"{name} must be {want} for a state of shape {tuple(state.shape)}; "
                             f"got {tuple(a.shape)}")
    if active is not None and tuple(active.shape) != (rows,):
        raise ValueError(f"active must be [rows] = ({rows},); got {tuple(active.shape)}")
    s = state.astype(F32)
    q, k, v, d, b = (jnp.asarray(a, F32) for a in (query, key, value, decay, beta))
    read_key = jnp.einsum("rhk,rhkv->rhv", k * d, s, precision=jax.lax.Precision.HIGHEST)
    read_query = jnp.einsum("rhk,rhkv->rhv", q * d, s, precision=jax.lax.Precision.HIGHEST)
    delta = (v - read_key) * b[..., None]
    out = read_query + jnp.sum(q * k, axis=-1, keepdims=True) * delta
    updated = s * d[..., None] + k[..., None] * delta[..., None, :]
    new = (round_to_bf16(updated, k, v) if state.dtype == jnp.bfloat16
           else updated.astype(state.dtype))
    if active is not None:
        live = jnp.asarray(active, bool)
        new = jnp.where(live[:, None, None, None], new, state)
        out = jnp.where(live[:, None, None], out, 0.0)
    return new, out.astype(query.dtype)
