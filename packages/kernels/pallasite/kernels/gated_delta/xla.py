"""The chunked gated delta rule in plain JAX (the WY form), differentiated by JAX.

Within a chunk of C steps entered with state S [K, V], with the in-chunk cumulative log
decay G_t = g_0 + ... + g_t, D_tj = exp(G_t - G_j) for j <= t (a masked cumulative sum,
as the SSD's segment sums: no cancellation under strong decay), and u_t the update the
delta rule writes at step t (S_t = exp(g_t) S_{t-1} + k_t u_t^T):

    u_t = beta_t (v_t - exp(G_t) S^T k_t - sum_{j<t} D_tj (k_t . k_j) u_j)

so (I + A) u = beta (V - exp(G) K S) with A_tj = beta_t D_tj (k_t . k_j) strictly below
the diagonal. One unit lower-triangular solve per chunk gives U = (I + A)^-1 (beta V) and
W = (I + A)^-1 (beta exp(G) K), both independent of S; then, in a scan over chunks,

    u  = U - W S
    o  = scale (exp(G) Q S + (D * Q K^T) u)            (D with its diagonal)
    S' = exp(G_last) S + (exp(G_last - G) K)^T u

Packed sequences (cu_seqlens) are laid out so that each starts on a chunk of its own
(packing.py: a static bound on the padded length, positions from cu_seqlens, so traced
cu_seqlens work): a sequence's first chunk enters with its own initial state, its last chunk's exit
is its final state. Padding steps have k = v = q = 0, g = 0, beta = 0: they keep the
state and write nothing.

This is the fallback every device runs and the baseline the kernels are held to. Its
backward is JAX's reverse of the scan (the chunk states saved per chunk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallasite.kernels.gated_delta import packing
from pallasite.kernels.ssd.xla import segsum
from pallasite.reference.gated_delta_rule import expand_heads, l2norm

_HI = jax.lax.Precision.HIGHEST
_einsum = functools.partial(jnp.einsum, precision=_HI)


def chunk_terms(q, k, v, g, beta, chunk: int):
    """Per chunk (all at once): U, W, exp(G) Q, the masked D * Q K^T, exp(G_last) and
    exp(G_last - G) K, from [B, L, H, ...] inputs (L a multiple of the chunk)."""
    b, length, h, dk = k.shape
    nc = length // chunk
    split = lambda t: t.reshape(b, nc, chunk, *t.shape[2:])  # noqa: E731
    q, k, v, g, beta = (split(t) for t in (q, k, v, g, beta))
    g_h = jnp.moveaxis(g, 2, -1)  # [b, nc, h, C]
    cum = jnp.cumsum(g_h, axis=-1)
    seg = segsum(g_h)  # [b, nc, h, C, C]: sum_{j<l<=t} g_l below, -inf above
    decay = jnp.exp(seg)  # D_tj (0 above the diagonal)
    to_end = decay[..., -1, :]  # exp(G_last - G_j)  [b, nc, h, C]
    kk = _einsum("bnthk,bnjhk->bnhtj", k, k)
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    beta_h = jnp.moveaxis(beta, 2, -1)  # [b, nc, h, C]
    a = jnp.where(strict, beta_h[..., :, None] * decay * kk, 0.0)
    system = a + jnp.eye(chunk, dtype=a.dtype)
    rhs_v = beta_h[..., None] * jnp.moveaxis(v, 2, 3)  # [b, nc, h, C, V]
    rhs_k = (beta_h * jnp.exp(cum))[..., None] * jnp.moveaxis(k, 2, 3)  # [b, nc, h, C, K]
    solve = functools.partial(jax.scipy.linalg.solve_triangular, lower=True,
                              unit_diagonal=True)
    u_part, w = solve(system, rhs_v), solve(system, rhs_k)
    q_h = jnp.moveaxis(q, 2, 3)  # [b, nc, h, C, K]
    qk = jnp.where(jnp.tril(jnp.ones((chunk, chunk), bool)), decay, 0.0) * _einsum(
        "bnhtk,bnhjk->bnhtj", q_h, jnp.moveaxis(k, 2, 3))
    eq = jnp.exp(cum)[..., None] * q_h
    kd = to_end[..., None] * jnp.moveaxis(k, 2, 3)
    return u_part, w, eq, qk, jnp.exp(cum[..., -1]), kd


def forward(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, chunk_size: int,
            use_qk_l2norm_in_kernel: bool):
    """(o [B, T, Hv, V] in v's dtype, final states [N, Hv, K, V] fp32). Inputs as the
    public function's, validated; initial_state [N, Hv, K, V] (zeros when none)."""
    b, length, hv, dv = v.shape
    f = jnp.result_type(jnp.float32, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
    qf, kf = (expand_heads(t.astype(f), hv) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    vf, gf, bf = v.astype(f), g.astype(f), beta.astype(f)
    init = initial_state.astype(f)
    (qf, kf, vf, gf, bf), padded, positions, first, counts = packing.lay_out(
        (qf, kf, vf, gf, bf), cu_seqlens, length, chunk_size)
    nc = padded // chunk_size
    u_part, w, eq, qk, end_decay, kd = chunk_terms(qf, kf, vf, gf, bf, chunk_size)
    if cu_seqlens is None:
        entering = leaving = jnp.full((nc,), -1, jnp.int32)
        state0 = init
    else:  # chunk c is sequence s's first (it enters with s's initial state) or last
        entering, leaving = packing.chunk_owners(first, counts, nc)
        state0 = jnp.zeros_like(init[:1])  # (varying as init does, inside a shard_map)

    def step(carry, inputs):
        state, finals = carry
        u_c, w_c, eq_c, qk_c, ed_c, kd_c, enter, leave = inputs
        state = jnp.where(enter >= 0, init[jnp.maximum(enter, 0)][None], state)
        u = u_c - _einsum("bhtk,bhkv->bhtv", w_c, state)
        o = scale * (_einsum("bhtk,bhkv->bhtv", eq_c, state)
                     + _einsum("bhtj,bhjv->bhtv", qk_c, u))
        new = ed_c[..., None, None] * state + _einsum("bhtk,bhtv->bhkv", kd_c, u)
        slot = jnp.maximum(leave, 0)  # a sequence's last chunk: its final state
        finals = finals.at[slot].set(jnp.where(leave >= 0, new[0], finals[slot]))
        return (new, finals), o

    xs = tuple(jnp.moveaxis(t, 1, 0) for t in (u_part, w, eq, qk, end_decay, kd))
    (last, finals), o = jax.lax.scan(jax.checkpoint(step), (state0, init),
                                     xs + (entering, leaving))
    o = jnp.moveaxis(o, 0, 1)  # [b, nc, h, C, V]
    o = jnp.moveaxis(o, 2, 3).reshape(b, padded, hv, dv)
    o = packing.steps_of(o, length, positions).astype(v.dtype)
    return o, (last if cu_seqlens is None else finals)  # an empty sequence's: its initial
