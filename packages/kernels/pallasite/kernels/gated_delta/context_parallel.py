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
backend's backward), so it too moves only state-sized arrays.

The Pallas Triton kernels split a sequence the compiler laid out over Auto axes inside
their passes (pallas_triton.py, layouts.pass_planners), with M and F from the state
pass alone: the prep once, the state pass from zero (F) and with U = 0 from I over K
columns (M), `entering_states`, then the state pass from the entering state and the
output. Their backward mirrors it by hand: the reverse pass with no final-state
cotangent gives G, the cotangent the part's outputs give its entering state, one
exchange of (M, G) chains the parts backwards (`exiting_cotangents`), and the backward
runs from the part's own final-state cotangent. The cost is two forwards
(V and K columns) and their backwards, against one unsplit; the gain is that no device
holds the whole sequence. Padded steps (g = 0, beta = 0) map the state to itself, so a
part may have any length.

Packed sequences (cu_seqlens, one row) split the same way (`_packed_part`). A part sees
the sequences as its steps cut them (cu_seqlens shifted to its first step and clipped
to its length, so a sequence outside it is empty there). Only the sequence running
when the part begins may continue from the part before: it enters with zero in the
first forward and with I in the second, every other local sequence with its own
initial state in the first and zero in the second. What passes to the next part is the
state of the sequence running at the part's end: M S_in + F where that is the entering
sequence, else its state from its own start (M = 0). Each sequence's final state comes
from the part that holds its last step, summed over the parts (one part writes it, the
others zero), and an empty sequence's is its initial state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallasite.kernels import sharding
from pallasite.kernels.gated_delta import packing
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


def exiting_cotangents(transitions, from_outputs, dfinal, axes):
    """(this part's final-state cotangent, the initial state's cotangent), fp32, from
    every part's (M, G) in sequence order, G being the cotangent its own outputs give its
    entering state: the chain backwards, dS_in(i) = M_i^T dS_out(i) + G_i and dS_out(i -
    1) = dS_in(i), from dS_out(last) = dfinal (the backward of `entering_states`)."""
    every_m, every_g = parts_in_order(transitions, axes), parts_in_order(from_outputs, axes)
    cotangent = dfinal.astype(F32)
    exiting = [None] * every_m.shape[0]
    for i in reversed(range(every_m.shape[0])):
        exiting[i] = cotangent
        cotangent = jnp.einsum("bhjk,bhjv->bhkv", every_m[i], cotangent,
                               precision=_HIGHEST) + every_g[i]
    return jnp.stack(exiting)[jax.lax.axis_index(axes)], cotangent


def split(form, axes):
    """form(q, k, v, g, beta, *, scale, initial_state, cu_seqlens,
    use_qk_l2norm_in_kernel) -> (o, final) for one part of a sequence split over the
    manual axes `axes` (in order): the module docstring's steps, the same contract."""

    def run(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel):
        if cu_seqlens is not None:
            return _packed_part(form, axes, q, k, v, g, beta, scale, initial_state,
                                cu_seqlens, use_qk_l2norm_in_kernel)
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


def _packed_part(form, axes, q, k, v, g, beta, scale, initial_state, cu_seqlens, l2norm_qk):
    """(o, final states [N, ...]) for one part of a packed row split over `axes`: the
    module docstring's packed steps."""
    t, hv = v.shape[1], v.shape[2]
    dk = q.shape[3]
    n = initial_state.shape[0]
    ends = cu_seqlens.astype(jnp.int32)
    start = jax.lax.axis_index(axes) * t
    local_cu = jnp.clip(ends - start, 0, t)

    def sequence_at(step):  # the non-empty sequence that holds `step`
        return jnp.clip(packing.sorted_index(ends[1:], step, "right"), 0, n - 1)

    first, last = sequence_at(start), sequence_at(start + t - 1)
    continues = ends[first] < start  # the part's first sequence began in an earlier part
    entering_one = ((jnp.arange(n) == first) & continues)[:, None, None, None]
    init = initial_state.astype(F32)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=F32), (n, hv, dk, dk))
    from_own = jnp.where(entering_one, 0.0, init)
    from_eye = jnp.where(entering_one, eye, 0.0)
    no_v = jnp.zeros(v.shape[:3] + (dk,), v.dtype)
    q, k, v, g, beta, from_own, from_eye, no_v, local_cu = sharding.vary_together(
        (q, k, v, g, beta, from_own, from_eye, no_v, local_cu))
    common = dict(scale=scale, cu_seqlens=local_cu, use_qk_l2norm_in_kernel=l2norm_qk)
    o_own, finals_own = form(q, k, v, g, beta, initial_state=from_own, **common)
    through, transitions = form(q, k, no_v, g, beta, initial_state=from_eye, **common)
    finals_own, transitions = finals_own.astype(F32), transitions.astype(F32)
    # What the part passes on: the state of the sequence running at its end.
    carried = continues & (last == first)
    transition = jnp.where(carried, transitions[first], 0.0)[None]
    entering, _ = entering_states(transition, finals_own[last][None],
                                  jnp.zeros((1, hv, dk, v.shape[3]), F32), axes)
    o = o_own.astype(F32) + jnp.einsum("bthk,bhkv->bthv", through.astype(F32), entering,
                                       precision=_HIGHEST)
    # Each sequence's final state, from the part that holds its last step.
    mine = ((ends[1:] > ends[:-1]) & (ends[1:] > start) & (ends[1:] <= start + t))
    local = finals_own + jnp.where(entering_one, jnp.einsum(
        "shkj,hjv->shkv", transitions, entering[0], precision=_HIGHEST), 0.0)
    finals = jax.lax.psum(jnp.where(mine[:, None, None, None], local, 0.0), axes)
    empty = (ends[1:] == ends[:-1])[:, None, None, None]
    return o.astype(o_own.dtype), finals + jnp.where(empty, init, 0.0)
