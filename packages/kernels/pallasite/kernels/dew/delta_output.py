"""dew's `delta_output`: the chunked gated delta rule's output, in dew's layout.

Per chunk, with the state h it entered and its corrected values v (delta_chunks):

    out = (q exp(hi)) h + ((q k^T) D) v,     D_tj = exp(G_t - G_j) for j <= t, G = hi + lo

with q already scaled. Plain JAX, differentiable by JAX in every array argument; the
kernel form of this output is part of `pallasite.kernels.chunk_gated_delta_rule`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallasite.kernels.dew._layouts import HIGHEST, check_chunked, chunk_decay, f32, unpaired


def refusal(key, value) -> str | None:
    """Why `chunk_output` does not take these [B, H, NC, C, Dk] keys and [B, H, NC, C, Dv]
    values, or None where it does. dew's kernel bounds the widths (chunks to 64, keys to
    128, values a power of two to 256); the form here does not."""
    return unpaired(key, value)


def chunk_output(q, k, hi, lo, h, v, interpret: bool = False):
    """out [B, H, NC, C, Dv] fp32 from q and k [B, H, NC, C, Dk], hi and lo [B, H, NC, C],
    the entered states h [B, H, NC, Dk, Dv] and the corrected values v [B, H, NC, C, Dv]
    (module docstring). `interpret` is dew's kernel flag, accepted and ignored."""
    del interpret
    lead = q.shape[:4]
    check_chunked("k", k, lead, 5)
    check_chunked("hi", hi, lead, 4)
    check_chunked("lo", lo, lead, 4)
    check_chunked("h", h, lead[:3], 5)
    check_chunked("v", v, lead, 5)
    q, k, hi, lo, h, v = f32(q, k, hi, lo, h, v)
    einsum = functools.partial(jnp.einsum, precision=HIGHEST)
    paired = einsum("...tk,...jk->...tj", q, k) * chunk_decay(hi, lo)
    return (einsum("...tk,...kv->...tv", q * jnp.exp(hi)[..., None], h)
            + einsum("...tj,...jv->...tv", paired, v))
