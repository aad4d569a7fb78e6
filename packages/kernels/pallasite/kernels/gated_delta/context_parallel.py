"""The gated delta rule with its sequence split over devices (context parallelism).

Each device holds a contiguous run of steps. Per (row, value head) a step maps the state
affinely, S <- exp(g) (I - beta k k^T) S + beta k v^T, so a part maps its entering state
S_in to S_out = M S_in + F, with M [K, K] the product of its steps' linear parts and F
its final state from a zero state. Its outputs are likewise o = o_zero + P S_in, where
o_zero are its outputs from a zero state and row t of P [T, K] is (scale q_t)^T times
the product of the steps up to t. Both halves come from the forward itself, each value
column being independent:

  1. (o_zero, F) = the forward of the part from a zero state;
     (P, M) = the forward of the part with v = 0 (K columns) from S = I;
  2. one exchange of (M, F) over the axes (state-sized, [shards, b, Hv, K, K + V]),
     then, in order, S_in(0) = S0 and S_in(i+1) = M_i S_in(i) + F_i; S_in(shards) is
     the whole sequence's final state, the same on every device;
  3. o = o_zero + P S_in(this part), an fp32 product per step.

The backward is JAX's, through these steps (each forward differentiates by its own
backend's backward), so it too moves only state-sized arrays. The cost is two forwards
(V and K columns) and their backwards, against one unsplit; the gain is that no device
holds the whole sequence. Padded steps (g = 0, beta = 0) map the state to itself, so a
part may have any length. Packed sequences (cu_seqlens) are not split: a sequence that
starts inside a part would take no entering state, and the tables for that are not
written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallasite.kernels import sharding
from pallasite.kernels.ssd.context_parallel import parts_in_order

F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


def entering_states(transitions, finals, initial_state, axes):
    """(this part's entering state, the whole sequence's final state), fp32, from every
    part's (M, F) in sequence order."""
    every_m, every_f = parts_in_order(transitions, axes), parts_in_order(finals, axes)
    state = initial_state.astype(F32)
    entering = []
    for i in range(every_m.shape[0]):
        entering.append(state)
        state = jnp.einsum("bhkj,bhjv->bhkv", every_m[i], state, precision=_HIGHEST) + every_f[i]
    return jnp.stack(entering)[jax.lax.axis_index(axes)], state


def split(form, axes):
    """form(q, k, v, g, beta, *, scale, initial_state, cu_seqlens,
    use_qk_l2norm_in_kernel) -> (o, final) for one part of a sequence split over the
    manual axes `axes` (in order): the module docstring's steps, the same contract."""

    def run(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel):
        if cu_seqlens is not None:
            raise NotImplementedError("the gated delta rule does not split packed "
                                      "sequences (cu_seqlens) over devices")
        b, t, hv, dv = v.shape
        dk = q.shape[3]
        common = dict(scale=scale, cu_seqlens=None,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        zero = jnp.zeros(initial_state.shape, F32)
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=F32), (b, hv, dk, dk))
        no_v = jnp.zeros((b, t, hv, dk), v.dtype)
        # One varying type for the parts' inputs and the constants made here (check_vma).
        q, k, v, g, beta, zero, eye, no_v = sharding.vary_together(
            (q, k, v, g, beta, zero, eye, no_v))
        o_zero, from_zero = form(q, k, v, g, beta, initial_state=zero, **common)
        through, transition = form(q, k, no_v, g, beta, initial_state=eye, **common)
        entering, final = entering_states(transition.astype(F32), from_zero.astype(F32),
                                          initial_state, axes)
        o = o_zero.astype(F32) + jnp.einsum("bthk,bhkv->bthv", through.astype(F32), entering,
                                            precision=_HIGHEST)
        return o.astype(o_zero.dtype), final

    return run
