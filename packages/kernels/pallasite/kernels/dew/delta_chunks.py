"""dew's `delta_chunks`: the chunked gated delta rule's state across chunks, in dew's layout.

With w and u from delta_prep and gc the log decay cumulated within each chunk, chunk i
entered with state S_i [Dk, Dv] gives

    v_i     = u_i - w_i S_i                                   (corrected values)
    S_i+1   = exp(gc_i,last) S_i + (k_i exp(gc_i,last - gc_i))^T v_i

in order over the chunks. `chunk_states` returns every entered state, the corrected
values and the state leaving the last chunk, as dew's does. It is a `lax.scan` in plain
JAX, differentiable by JAX in every array argument; pallasite's own state pass is a
kernel inside `chunk_gated_delta_rule` (gated_delta/pallas_triton.py), with its backward
written for the whole rule, so it is not offered piecewise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallasite.kernels.dew._layouts import HIGHEST, check_chunked, f32, unpaired


def refusal(key, out_vals) -> str | None:
    """Why `chunk_states` does not take these [B, H, NC, C, Dk] keys and [B, H, NC, C, Dv]
    corrected-value operands, or None where it does. dew's kernels also ask for fp32,
    power-of-two widths and operands no mesh axis splits; the form here takes any of
    those, so only operands that do not pair up are refused."""
    return unpaired(key, out_vals)


def chunk_states(key, w, u, gc, state, interpret: bool = False):
    """(entered [B, H, NC, Dk, Dv], corrected [B, H, NC, C, Dv], final [B, H, Dk, Dv]),
    fp32, from key and w [B, H, NC, C, Dk], u [B, H, NC, C, Dv], gc [B, H, NC, C] and the
    state entering the first chunk [B, H, Dk, Dv] (module docstring). `interpret` is
    dew's kernel flag, accepted and ignored."""
    del interpret
    lead = key.shape[:4]
    check_chunked("w", w, lead, 5)
    check_chunked("u", u, lead, 5)
    check_chunked("gc", gc, lead, 4)
    check_chunked("state", state, lead[:2], 4)
    key, w, u, gc, state = f32(key, w, u, gc, state)
    einsum = functools.partial(jnp.einsum, precision=HIGHEST)
    leave = jnp.exp(gc[..., -1:] - gc)  # [B, H, NC, C]: each step's decay to the chunk's end
    forget = jnp.exp(gc[..., -1])  # [B, H, NC]

    def chunk(s, operands):
        k_c, w_c, u_c, leave_c, forget_c = operands
        corrected = u_c - einsum("bhck,bhkv->bhcv", w_c, s)
        new = forget_c[..., None, None] * s + einsum("bhck,bhcv->bhkv",
                                                     k_c * leave_c[..., None], corrected)
        return new, (s, corrected)

    chunks = tuple(jnp.moveaxis(t, 2, 0) for t in (key, w, u, leave, forget))
    final, (entered, corrected) = jax.lax.scan(chunk, state, chunks)
    return jnp.moveaxis(entered, 0, 2), jnp.moveaxis(corrected, 0, 2), final
