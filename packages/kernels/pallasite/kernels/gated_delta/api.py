"""The gated delta rule's public functions, with flash-linear-attention's arguments.

`chunk_gated_delta_rule` (training and prefill: the chunked WY form) and
`fused_recurrent_gated_delta_rule` (short sequences and decode: the step-by-step
recurrence) compute the definition of pallasite.reference.gated_delta_rule and return
(o, final_state or None). Implementations, in order: "xla" (xla.py, every device) is the
only one today; naming another is an error that lists the known names. The Pallas
kernels are not written yet (docs/gated_delta_rule.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from pallasite.kernels import platform
from pallasite.kernels.gated_delta import xla
from pallasite.reference import gated_delta_rule as ref

IMPLEMENTATIONS = ("xla",)


def _names(implementation) -> list[str]:
    return platform.named_implementations(
        implementation, IMPLEMENTATIONS, " (no Pallas kernel of the gated delta rule exists yet)")


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, block_sizes):
    """Checks (ValueError/TypeError naming the argument); the scale and initial states."""
    if block_sizes is not None:
        raise TypeError("block_sizes: the gated delta rule's only implementation (xla) "
                        f"takes none; got {block_sizes!r}")
    n = ref.validate_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                      initial_state=initial_state, cu_seqlens=cu_seqlens,
                                      chunk_size=chunk_size)
    hv, dv = v.shape[2:]
    dk = q.shape[3]
    if initial_state is None:
        initial_state = jnp.zeros((n, hv, dk, dv), jnp.float32)
    return (dk ** -0.5 if scale is None else float(scale)), initial_state


def chunk_gated_delta_rule(
    q: Float[Array, "B T Hk K"],
    k: Float[Array, "B T Hk K"],
    v: Float[Array, "B T Hv V"],
    g: Float[Array, "B T Hv"],
    beta: Float[Array, "B T Hv"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "N Hv K V"] | None = None,
    output_final_state: bool = False,
    cu_seqlens: Integer[Array, " N1"] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
    implementation: str | Sequence[str] | None = None,
    block_sizes=None,
):
    """(o [B, T, Hv, V] in v's dtype, final_state [N, Hv, K, V] fp32 or None).

    q, k [B, T, Hk, K]; v [B, T, Hv, V] with Hv a multiple of Hk (value head h reads
    key head h // (Hv // Hk)); g [B, T, Hv] the log decay (<= 0); beta [B, T, Hv];
    initial_state [N, Hv, K, V] with N = B, or the number of sequences when cu_seqlens
    [N + 1] packs them into one row (B = 1). scale defaults to K^-1/2. Differentiable in
    q, k, v, g, beta and initial_state.
    """
    names = _names(implementation)
    scale, init = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size,
                           block_sizes)
    del names  # one implementation: xla
    o, final = xla.forward(q, k, v, g, beta, scale=scale, initial_state=init,
                           cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o, (final.astype(jnp.float32) if output_final_state else None)


def fused_recurrent_gated_delta_rule(
    q: Float[Array, "B T Hk K"],
    k: Float[Array, "B T Hk K"],
    v: Float[Array, "B T Hv V"],
    g: Float[Array, "B T Hv"],
    beta: Float[Array, "B T Hv"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "N Hv K V"] | None = None,
    output_final_state: bool = False,
    cu_seqlens: Integer[Array, " N1"] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    implementation: str | Sequence[str] | None = None,
    block_sizes=None,
):
    """chunk_gated_delta_rule's arguments and results (no chunk_size), computed one step
    at a time: cheaper than the chunked form where T is a few steps (decode)."""
    _names(implementation)
    scale, init = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, None,
                           block_sizes)
    o, final = ref.gated_delta_rule_sequential(
        q, k, v, g, beta, scale=scale, initial_state=init, output_final_state=True,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o, (final.astype(jnp.float32) if output_final_state else None)
