"""Each packed sequence's final state (mamba_ssm's `varlen_states`), in plain JAX.

The sequences of one row are separated by resets, so the state after a sequence's last
step e is the state the scan holds there: exp(sum of a over its chunk up to e) times the
state its chunk entered with, plus the chunk's own steps up to e. The chunks' entering
states come from one state-sized contraction per chunk and a scan over chunks (what the
kernels' forward computes and keeps to itself), the partial chunks from the same
contraction with the steps after e masked out. The cost is one pass over x and B and a
scan over [h, p, n] states: a fraction of the scan's, paid only when the states are
asked for. It is plain JAX, so JAX differentiates it (mamba_ssm's does not).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallasite.kernels.ssd import context_parallel


def _chunks(t, chunk_size: int):
    """[1, l, ...] -> [nc, 1, C, ...] (zero padded): each chunk as its own batch row."""
    length = t.shape[1]
    nc = -(-length // chunk_size)
    widths = [(0, 0)] * t.ndim
    widths[1] = (0, nc * chunk_size - length)
    t = jnp.pad(t, widths)
    return t.reshape(nc, 1, chunk_size, *t.shape[2:])


def varlen_states(x, a, b, initial_state, cu_seqlens, chunk_size: int):
    """[num_sequences, h, p, n] fp32. x [1, l, h, p] already scaled by dt, a [1, l, h]
    with resets at the sequences' first steps, b [1, l, g, n], initial_state [1, h, p,
    n] fp32, cu_seqlens [num_sequences + 1]. An empty sequence's state is zero."""
    length = x.shape[1]
    xs, as_, bs = (_chunks(t, chunk_size) for t in (x, a, b))
    own, total = context_parallel.zero_state_final(xs, as_, bs)  # [nc, h, p, n], [nc, h]

    def step(state, inputs):
        own_c, total_c = inputs
        return jnp.exp(total_c)[:, None, None] * state + own_c, state

    _, entering = jax.lax.scan(step, initial_state[0].astype(jnp.float32), (own, total))
    ends = cu_seqlens.astype(jnp.int32)
    last = jnp.clip(ends[1:] - 1, 0, length - 1)
    chunk, offset = last // chunk_size, last % chunk_size
    upto = jnp.arange(chunk_size)[None, :] <= offset[:, None]  # [s, C]

    def part(t):  # the end chunk's steps up to the end, later steps zero
        rows = t[chunk, 0]  # [s, C, ...]
        mask = upto.reshape(upto.shape + (1,) * (rows.ndim - 2))
        return jnp.where(mask, rows, 0)[:, None]

    own_s, total_s = context_parallel.zero_state_final(part(xs), part(as_), part(bs))
    states = jnp.exp(total_s)[:, :, None, None] * entering[chunk] + own_s
    return jnp.where((ends[1:] > ends[:-1])[:, None, None, None], states, 0.0)
