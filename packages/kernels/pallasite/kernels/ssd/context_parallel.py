"""The SSD scan with its sequence split over devices (context parallelism).

Each device holds a contiguous run of chunks. The scan is linear in its entering state,
so a device's part is its scan from a zero state plus the entering state's contribution.
The devices exchange only state-sized arrays:

forward, on device j (chunks in order along the mesh axes `axes`):
  1. F_j = the final state of its part from a zero state, and T_j = the sum of its a
     (its total log decay): one pass over x and B, an einsum in XLA;
  2. one all_gather of (F, T) over `axes`, then, in order,
     S_in(0) = S0 and S_in(i+1) = exp(T_i) S_in(i) + F_i; S_in(shards) is the final state;
  3. the backend's forward of its part from S_in(j). Its outputs and entry states are
     the unsplit scan's, computed by the same kernel.

backward, mirrored:
  1. G_j = the cotangent its part's outputs give its entering state with no cotangent on
     its final state, sum_t exp(acs_t) dy_t C_t^T, and T_j as above;
  2. one all_gather of (G, T), then, in reverse order, dS_out(last) = dfinal and
     dS_out(i-1) = exp(T_i) dS_out(i) + G_i; the last value is S0's cotangent;
  3. the backend's backward of its part with dS_out(j) as its final state's cotangent.

The extra work is one state-sized contraction per pass (about what one chunk's state
update costs per chunk) and the exchange of shards x [b, h, p, n] fp32. Resets (a <=
decay.RESET) are clamped as every backend clamps them, so exp(T) is 0 across one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallasite.kernels.ssd import decay

_HIGHEST = jax.lax.Precision.HIGHEST


def _flat(t):
    """[b, nc, C, ...] -> [b, nc * C, ...]: the part's steps in order."""
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:])


def _heads(t, heads: int):
    """B or C [b, l, g, n] -> [b, l, h, n], each group serving heads // g heads."""
    return jnp.repeat(t, heads // t.shape[2], axis=2)


def _log_decays(a):
    """(inclusive cumulative sums [b, l, h], the sums after each step [b, l, h], the total
    [b, h]) of the clamped a, in fp32. The sums after each step are a reversed
    cumulative sum of the steps shifted by one (not total - prefix, nor an inclusive sum
    less the step): no cancellation, even beside a reset's -1e4."""
    a = _flat(decay.clamp_resets(a).astype(jnp.float32))
    prefix = jnp.cumsum(a, axis=1)
    later = jnp.concatenate([a[:, 1:], jnp.zeros_like(a[:, :1])], axis=1)
    after = jnp.flip(jnp.cumsum(jnp.flip(later, 1), axis=1), 1)
    return prefix, after, jnp.sum(a, axis=1)


def zero_state_final(x, a, b, dt=None):
    """(F [b, h, p, n]: the part's final state from a zero state, T [b, h]) in fp32; the
    scan's input is x dt where dt [b, nc, C, h] is given (mamba_scan.fused)."""
    _, after, total = _log_decays(a)
    weight = jnp.exp(after) if dt is None else jnp.exp(after) * _flat(dt).astype(jnp.float32)
    xs = _flat(x).astype(jnp.float32) * weight[..., None]
    bh = _heads(_flat(b).astype(jnp.float32), x.shape[3])
    return jnp.einsum("blhp,blhn->bhpn", xs, bh, precision=_HIGHEST), total


def entering_cotangent(dy, a, c):
    """(G [b, h, p, n]: the part's outputs' cotangent on its entering state, T [b, h])."""
    prefix, _, total = _log_decays(a)
    dys = _flat(dy).astype(jnp.float32) * jnp.exp(prefix)[..., None]
    ch = _heads(_flat(c).astype(jnp.float32), dy.shape[3])
    return jnp.einsum("blhp,blhn->bhpn", dys, ch, precision=_HIGHEST), total


def _gathered(state, total, axes):
    """Every part's (state, total), [shards, ...], in sequence order, and this part's
    index. Each part's values placed in its own row and summed over `axes`: the result
    is the same on every part (invariant over `axes` under check_vma, which an
    all_gather's is not on JAX 0.11.2), so the whole sequence's final state and the
    initial state's cotangent are too."""
    me = jax.lax.axis_index(axes)
    return parts_in_order(state, axes), parts_in_order(total, axes), me


def parts_in_order(t, axes):
    """[shards, *t.shape]: every part's t in sequence order, the same on every part."""
    me = jax.lax.axis_index(axes)
    shards = jax.lax.psum(1, axes)
    return jax.lax.psum(jnp.zeros((shards,) + t.shape, t.dtype).at[me].set(t), axes)


def previous_part(t, first, axes):
    """The previous part's t (for the sequence's first part: `first`), e.g. the last
    step's value of an array split along the sequence."""
    rows = parts_in_order(t, axes)
    me = jax.lax.axis_index(axes)
    return jnp.where(me == 0, first, rows[jnp.maximum(me - 1, 0)])


def entering_state(final_from_zero, total, initial_state, axes):
    """(this part's entering state, the whole sequence's final state), both fp32."""
    finals, totals, me = _gathered(final_from_zero, total, axes)
    state = initial_state.astype(jnp.float32)
    entering = []
    for i in range(finals.shape[0]):
        entering.append(state)
        state = jnp.exp(totals[i])[..., None, None] * state + finals[i]
    return jnp.stack(entering)[me], state


def exiting_cotangent(cotangent_from_outputs, total, dfinal, axes):
    """(this part's final-state cotangent, the initial state's cotangent), fp32."""
    cots, totals, me = _gathered(cotangent_from_outputs, total, axes)
    dstate = dfinal.astype(jnp.float32)
    exiting = [None] * cots.shape[0]
    for i in reversed(range(cots.shape[0])):
        exiting[i] = dstate
        dstate = jnp.exp(totals[i])[..., None, None] * dstate + cots[i]
    return jnp.stack(exiting)[me], dstate


def split_forward(forward, axes, *, weighted=False):
    """forward(x, a, b, c, initial) -> (y, final, chunk_states) on one part of a sequence
    split over `axes`: steps 1-3 of the module docstring. weighted: forward(x, dt, a, b,
    c, initial, *options) -> (*outputs, final, chunk_states), the scan of x dt
    (mamba_scan.fused, whose options are D and z)."""

    def run(x, *rest):
        dt, (a, b, c, initial, *options) = (rest[0], rest[1:]) if weighted else (None, rest)
        final_from_zero, total = zero_state_final(x, a, b, dt)
        entering, final = entering_state(final_from_zero, total, initial, axes)
        lead = (x, dt, a, b, c) if weighted else (x, a, b, c)
        *outputs, _, chunk_states = forward(*lead, entering, *options)
        return (*outputs, final, chunk_states)

    return run


def split_backward(backward, axes):
    """backward(x, a, b, c, chunk_states, dy, dfinal) -> (dx, da, db, dc, dinitial) on
    one part of a sequence split over `axes` (chunk_states: the part's own, entering
    state included): the mirrored steps."""

    def run(x, a, b, c, chunk_states, dy, dfinal):
        from_outputs, total = entering_cotangent(dy, a, c)
        exiting, dinitial = exiting_cotangent(from_outputs, total, dfinal, axes)
        dx, da, db, dc, _ = backward(x, a, b, c, chunk_states, dy, exiting)
        return dx, da, db, dc, dinitial

    return run
