"""dew's `delta_prep`: the chunked gated delta rule's in-chunk correction, in dew's layout.

Per chunk of C steps (keys k [C, Dk], values v [C, Dv], write strengths beta [C], and the
log decay cumulated within the chunk as a compensated pair hi + lo [C]):

    A   = strictly lower (beta_t (k_t . k_j) exp(G_t - G_j))      G = hi + lo
    w   = (I + A)^-1 (beta k exp(hi))        [C, Dk]
    u   = (I + A)^-1 (beta v)                [C, Dv]

so the chunk's corrected values are u - w S for the state S it enters with (delta_chunks).
As dew's, w's decay is exp(hi) alone. This is the WY form pallasite's own chunked rule
builds inside its kernels (gated_delta/xla.py, gated_delta/pallas_triton.py), written
here as one unit-triangular solve per chunk in plain JAX, differentiable by JAX in every
array argument: pallasite's kernels fuse the correction with the state pass and the
output behind one hand-written backward, so they have no standalone correction to offer.
For speed, call `pallasite.kernels.chunk_gated_delta_rule`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallasite.kernels.dew._layouts import HIGHEST, check_chunked, chunk_decay, f32, unpaired


def refusal(key, value) -> str | None:
    """Why `chunk_prep` does not take these [B, H, NC, C, Dk] keys and [B, H, NC, C, Dv]
    values, or None where it does. dew's kernel has width bounds (chunks to 64, keys to
    128, values to 256); the form here has none, so only operands that do not pair up
    are refused."""
    return unpaired(key, value)


def chunk_prep(k, v, beta, hi, lo, interpret: bool = False):
    """(w [B, H, NC, C, Dk], u [B, H, NC, C, Dv]) in fp32 from k [B, H, NC, C, Dk],
    v [B, H, NC, C, Dv], beta, hi, lo [B, H, NC, C] (module docstring). `interpret` is
    dew's kernel flag, accepted and ignored: this form is plain JAX on every device."""
    del interpret
    check_chunked("v", v, k.shape[:4], 5)
    for name, a in (("beta", beta), ("hi", hi), ("lo", lo)):
        check_chunked(name, a, k.shape[:4], 4)
    k, v, beta, hi, lo = f32(k, v, beta, hi, lo)
    einsum = functools.partial(jnp.einsum, precision=HIGHEST)
    paired = einsum("...tk,...jk->...tj", beta[..., None] * k, k)
    system = paired * chunk_decay(hi, lo, strict=True) + jnp.eye(k.shape[-2], dtype=k.dtype)
    solve = functools.partial(jax.scipy.linalg.solve_triangular, lower=True,
                              unit_diagonal=True)
    w = solve(system, (beta * jnp.exp(hi))[..., None] * k)
    u = solve(system, beta[..., None] * v)
    return w, u
