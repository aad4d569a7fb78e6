"""The gated delta rule (Gated DeltaNet), one step at a time: the definition.

Per batch row (or packed sequence), value head h (reading query/key head h // (Hv // Hk)),
step t, with the state S [K, V]:

    S   <- exp(g_t) S                                   (g_t <= 0: a log decay)
    S   <- S + beta_t k_t (v_t - S^T k_t)^T             (the delta rule's update)
    o_t  = S^T (scale q_t)                              (scale defaults to K^-1/2)

q and k are L2-normalised first (x / sqrt(sum x^2 + 1e-6)) when
`use_qk_l2norm_in_kernel`. Layouts are flash-linear-attention's: q, k [B, T, Hk, K], v
[B, T, Hv, V] (Hv a multiple of Hk), g and beta [B, T, Hv], states [N, Hv, K, V] in
fp32, N = B, or with cu_seqlens (B = 1, cu_seqlens [N + 1]) the number of packed
sequences, each starting from its own initial state (zero when none is given) and
giving its own final state (an empty sequence's is its initial state).

A lax.scan over steps in fp32, or float64 where x64 is on and an input is float64; the
outputs in v's dtype. Every contraction runs at HIGHEST precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer

from pallasite.reference import slots as slots_
from pallasite.reference.checks import (check_cu_seqlens, check_floating_arrays, need_shape,
                                        shape_of)

__all__ = ["gated_delta_rule_sequential", "gated_delta_rule_step_reference",
           "validate_gated_delta_rule", "validate_gated_delta_rule_step", "l2norm",
           "expand_heads", "one_step", "on_slots", "L2NORM_EPS"]

_HI = jax.lax.Precision.HIGHEST
L2NORM_EPS = 1e-6


_shape = shape_of


def validate_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                              cu_seqlens=None, chunk_size=None, packed_length=None) -> int:
    """ValueError/TypeError naming the argument; returns N, the number of states.
    packed_length: the whole packed row's length cu_seqlens must end at, where the arrays
    hold one part of it (a sequence split over devices); None: their own T."""
    check_floating_arrays(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, time, key_heads, key_dim]; got shape "
                         f"{_shape(q)}")
    b, t, hk, dk = _shape(q)
    need_shape("k", k, (b, t, hk, dk), "[batch, time, key_heads, key_dim]")
    if v.ndim != 4 or _shape(v)[:2] != (b, t):
        raise ValueError(f"v must be [batch, time, value_heads, value_dim] with q's batch "
                         f"and time {(b, t)}; got shape {_shape(v)}")
    hv, dv = _shape(v)[2:]
    if hk == 0 or hv % hk:
        raise ValueError(f"v's heads ({hv}) must be a multiple of q's and k's ({hk})")
    need_shape("g", g, (b, t, hv), "[batch, time, value_heads]")
    need_shape("beta", beta, (b, t, hv), "[batch, time, value_heads]")
    if scale is not None and not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a number or None; got {type(scale).__name__}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
            raise TypeError(f"chunk_size must be an int; got {type(chunk_size).__name__}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    n = b
    if cu_seqlens is not None:
        n = check_cu_seqlens(cu_seqlens, b, t if packed_length is None else packed_length,
                             f"q of shape {_shape(q)}")
    if initial_state is not None:
        need_shape("initial_state", initial_state, (n, hv, dk, dv),
                   "[num_states, value_heads, key_dim, value_dim]")
    return n


def l2norm(x):
    """x / sqrt(sum(x^2) + 1e-6) over the last axis, in x's dtype's wide form."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def expand_heads(t, value_heads: int):
    """q or k [B, T, Hk, K] -> [B, T, Hv, K]: value head h reads key head h // (Hv/Hk)."""
    return jnp.repeat(t, value_heads // t.shape[2], axis=2)


def one_step(state, q, k, v, g, beta, scale):
    """One step of every row and head, all in one wide dtype: (o [b, H, V], the new
    state [b, H, K, V]) from the state [b, H, K, V], q and k [b, H, K] (heads expanded,
    normalised if asked), v [b, H, V], g and beta [b, H]."""
    state = jnp.exp(g)[..., None, None] * state
    pred = jnp.einsum("bhkv,bhk->bhv", state, k, precision=_HI)
    state = state + (beta[..., None] * k)[..., None] * (v - pred)[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", state, scale * q, precision=_HI), state


def gated_delta_rule_sequential(
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
):
    """(o [B, T, Hv, V] in v's dtype, final states [N, Hv, K, V] or None)."""
    n = validate_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  cu_seqlens=cu_seqlens)
    wide = jnp.result_type(jnp.float32, *(x.dtype for x in (q, k, v, g, beta, initial_state)
                                          if x is not None))
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    scale = dk ** -0.5 if scale is None else scale
    qf, kf = (expand_heads(x.astype(wide), hv) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    init = (jnp.zeros((n, hv, dk, dv), wide) if initial_state is None
            else initial_state.astype(wide))
    if cu_seqlens is None:
        starts = jnp.full((t,), -1, jnp.int32)
        s0 = init
    else:  # one row: the state is reset to a sequence's own at its first step
        ends = cu_seqlens.astype(jnp.int32)
        steps = jnp.arange(t, dtype=jnp.int32)
        seq = jnp.searchsorted(ends[1:], steps, side="right").astype(jnp.int32)
        starts = jnp.where(steps == ends[jnp.clip(seq, 0, n - 1)], seq, -1)
        s0 = jnp.zeros_like(init[:1])

    def step(state, inputs):
        q_t, k_t, v_t, g_t, b_t, start = inputs  # [B,H,K] x2, [B,H,V], [B,H] x2, []
        state = jnp.where(start >= 0, init[jnp.maximum(start, 0)][None], state)
        o_t, state = one_step(state, q_t, k_t, v_t, g_t, b_t, scale)
        return state, (o_t, state)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (qf, kf, v.astype(wide), g.astype(wide),
                                                beta.astype(wide))) + (starts,)
    last, (o, states) = jax.lax.scan(step, s0, xs)
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    if not output_final_state:
        return o, None
    if cu_seqlens is None:
        return o, last
    ends = cu_seqlens.astype(jnp.int32)
    final = states[jnp.clip(ends[1:] - 1, 0, t - 1), 0]
    return o, jnp.where((ends[1:] > ends[:-1])[:, None, None, None], final, init)


# ------------------------------------------------------------------------ the decode step


def validate_gated_delta_rule_step(state, q, k, v, g, beta, *, scale=None,
                                   state_batch_indices=None) -> None:
    """ValueError/TypeError naming the argument, for one token per batch row: state
    [slots, Hv, K, V] (fp32 or bf16), q and k [b, Hk, K], v [b, Hv, V], g and beta
    [b, Hv], state_batch_indices [b] int (concrete ones checked for repeats)."""
    check_floating_arrays(state=state, q=q, k=k, v=v, g=g, beta=beta)
    if state.ndim != 4:
        raise ValueError(f"state must be [slots, value_heads, key_dim, value_dim]; got "
                         f"shape {_shape(state)}")
    if np.dtype(state.dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise TypeError(f"state must be float32 or bfloat16; got {state.dtype}")
    slots, hv, dk, dv = _shape(state)
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, key_heads, key_dim]; got shape {_shape(q)}")
    b, hk = _shape(q)[:2]
    need_shape("q", q, (b, hk, dk), "[batch, key_heads, key_dim]")
    need_shape("k", k, (b, hk, dk), "[batch, key_heads, key_dim]")
    need_shape("v", v, (b, hv, dv), "[batch, value_heads, value_dim]")
    need_shape("g", g, (b, hv), "[batch, value_heads]")
    need_shape("beta", beta, (b, hv), "[batch, value_heads]")
    if hk == 0 or hv % hk:
        raise ValueError(f"the state's value heads ({hv}) must be a multiple of q's and "
                         f"k's ({hk})")
    if scale is not None and not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a number or None; got {type(scale).__name__}")
    slots_.check_slot_indices(state_batch_indices, slots, b)


def on_slots(state, q, k, v, g, beta, scale, slots_of_rows, l2norm_qk: bool):
    """The step on a cache: the rows' slots gathered, stepped in fp32 and scattered
    back; rows outside [0, slots) read and write nothing and give o = 0."""
    hv = state.shape[1]
    f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
    qf, kf = (jnp.repeat(f32(t), hv // t.shape[1], axis=1) for t in (q, k))
    if l2norm_qk:
        qf, kf = l2norm(qf), l2norm(kf)
    rows, live = slots_.gather(state, slots_of_rows)
    o, new = one_step(rows, qf, kf, f32(v), f32(g), f32(beta), scale)
    o = jnp.where(live[:, None, None], o, 0.0)
    return o.astype(v.dtype), slots_.scatter(state, new, slots_of_rows, live)


def gated_delta_rule_step_reference(state, q, k, v, g, beta, *, scale=None,
                                    state_batch_indices=None,
                                    use_qk_l2norm_in_kernel: bool = False):
    """(o [b, Hv, V] in v's dtype, the whole cache with the named slots advanced one
    step, in the state's dtype). Row i uses slot state_batch_indices[i] (i when None); a
    row whose index is outside [0, slots) is padding: o = 0, no slot touched."""
    validate_gated_delta_rule_step(state, q, k, v, g, beta, scale=scale,
                                   state_batch_indices=state_batch_indices)
    idx = slots_.slots_of_rows(state_batch_indices, q.shape[0])
    dk = q.shape[2]
    return on_slots(state, q, k, v, g, beta, dk ** -0.5 if scale is None else float(scale),
                    idx, use_qk_l2norm_in_kernel)
