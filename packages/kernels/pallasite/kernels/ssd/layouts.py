"""Which shardings the SSD scan runs on locally: the planners for
`pallasite.kernels.sharding.run`, forward and backward.

The scan carries its state along the sequence, so chunks and steps stay local; batch and
heads are independent and keep whatever mesh axes shard them (any names), taken from x:
  - batch: x's batch axes, where they divide the batch;
  - heads: x's head axes (not already on the batch), where they divide the heads, and
    either split B and C's groups with them (groups a multiple of the head shards: each
    shard's heads read only its own groups) or meet a single replicated group, whose dB
    and dC are then summed over the head axes (fp32, rounded once). Other group counts
    take the heads replicated.
  - chunks: x's chunk axes (not on batch or heads), where they divide the chunk count:
    the sequence split over devices (context parallelism, context_parallel.py), each
    device scanning its run of chunks from the entering state the exchange gives it.
    (Inside a caller's shard_map the arrays are local and carry no layout: there the
    caller names the axes its sequence is split over, and api.py runs the exchange.)
Everything else (the step axis, head_dim, state) is resharded replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from pallasite.kernels import sharding
from pallasite.kernels.sharding import Plan
from pallasite.kernels.ssd import context_parallel

# Shardy rules for the Auto-axes path: z batch, c chunks, t steps, h heads, p head_dim,
# g groups, n state (factor names, not axes).
FORWARD_RULE = ("z c t h p, z c t h, z c t g n, z c t g n, z h p n "
                "-> z c t h p, z h p n, z c h p n")
BACKWARD_RULE = ("z c t h p, z c t h, z c t g n, z c t g n, z c h p n, z c t h p, z h p n "
                 "-> z c t h p, z c t h, z c t g n, z c t g n, z h p n")


def _given(given, axis_sizes, x_shape):
    """(batch axes, head axes) of x's layout, where they divide the dimension."""
    bsz, heads = x_shape[0], x_shape[3]
    x_dims = given[0]
    batch = sharding.fits(x_dims[0], bsz, axis_sizes)
    head = sharding.fits(tuple(a for a in x_dims[3] if a not in batch), heads, axis_sizes)
    return batch, head


def _sequence(given, axis_sizes, x_shape, taken) -> tuple:
    """The axes the chunks are split over: x's chunk axes not taken by batch or heads,
    where they divide the chunk count."""
    axes = tuple(a for a in given[0][1] if a not in taken)
    return sharding.fits(axes, x_shape[1], axis_sizes)


def _layout(given, axis_sizes, x_shape, groups):
    """(batch axes, head axes, group axes, chunk axes) this scan runs on, from x's layout."""
    batch, head = _given(given, axis_sizes, x_shape)
    seq = _sequence(given, axis_sizes, x_shape, batch + head)
    shards = sharding.size(head, axis_sizes)
    if not head:
        return batch, (), (), seq
    if groups % shards == 0:
        return batch, head, head, seq
    if groups == 1:
        return batch, head, (), seq
    return batch, (), (), seq


def _dims(batch, head, group, seq=()):
    x = (batch, seq, (), head, ())
    a = (batch, seq, (), head)
    bc = (batch, seq, (), group, ())
    state = (batch, head, (), ())
    chunk_states = (batch, seq, head, (), ())
    return x, a, bc, state, chunk_states


def forward_planner(forward: Callable, x_shape, groups: int) -> sharding.Planner:
    """forward(x, a, b, c, initial_state) -> (y, final_state, chunk_states) on local arrays.
    With the chunks split, each part runs from its entering state (context_parallel)."""

    def plan(given, axis_sizes) -> Plan:
        batch, head, group, seq = _layout(given, axis_sizes, x_shape, groups)
        x, a, bc, state, chunk_states = _dims(batch, head, group, seq)
        x_like, _, _, state_like, _ = _dims(*_given(given, axis_sizes, x_shape), (), seq)

        local = context_parallel.split_forward(forward, seq) if seq else forward
        return Plan(in_dims=(x, a, bc, bc, state), out_dims=(x, state, chunk_states),
                    local=local, out_like=(x_like, state_like, chunk_states))

    return plan


def backward_planner(backward: Callable, x_shape, groups: int) -> sharding.Planner:
    """backward(x, a, b, c, chunk_states, dy, dfinal) -> (dx, da, db, dc, dinitial) on
    local arrays; dB and dC of a single group replicated over head shards are summed.
    With the chunks split, each part's final state takes the cotangent the later parts
    give it (context_parallel)."""

    def plan(given, axis_sizes) -> Plan:
        batch, head, group, seq = _layout(given, axis_sizes, x_shape, groups)
        x, a, bc, state, chunk_states = _dims(batch, head, group, seq)
        summed = head if head and not group else ()

        part = context_parallel.split_backward(backward, seq) if seq else backward

        def local(x_, a_, b_, c_, states, dy, dfinal):
            if not summed:
                return part(x_, a_, b_, c_, states, dy, dfinal)
            # fp32 B and C give fp32 dB and dC (every backend computes in fp32 from its
            # matmul dtype either way), so the sum over head shards rounds once.
            dx, da, db, dc, dinit = part(x_, a_, b_.astype(jnp.float32),
                                         c_.astype(jnp.float32), states, dy, dfinal)
            return (dx, da, sharding.psum_f32(db, summed, b_.dtype),
                    sharding.psum_f32(dc, summed, c_.dtype), dinit)

        return Plan(in_dims=(x, a, bc, bc, chunk_states, x, state),
                    out_dims=(x, a, bc, bc, state), local=local)

    return plan


def fused_forward_planner(forward_fused: Callable, x_shape, groups: int, *, skip: bool,
                          gated: bool) -> sharding.Planner:
    """forward_fused(x, dt, a, b, c, initial_state[, D][, z]) -> (y, final_state,
    chunk_states) on local arrays (mamba_scan.fused: D and z present where `skip`,
    `gated`). Batch, heads and chunks split as the scan's (D [h, p]
    with the heads, dt and z as a and x); with the chunks split, each part runs from its
    entering state (context_parallel, the scan of x dt)."""

    def plan(given, axis_sizes) -> Plan:
        batch, head, group, seq = _layout(given, axis_sizes, x_shape, groups)
        x, a, bc, state, chunk_states = _dims(batch, head, group, seq)
        x_like, _, _, state_like, _ = _dims(*_given(given, axis_sizes, x_shape), (), seq)
        ins = (x, a, a, bc, bc, state) + (((head, ()),) if skip else ()) + \
            ((x,) if gated else ())
        outs = (x, state, chunk_states)
        likes = (x_like, state_like, chunk_states)
        local = (context_parallel.split_forward(forward_fused, seq, weighted=True) if seq
                 else forward_fused)
        return Plan(in_dims=ins, out_dims=outs, local=local, out_like=likes)

    return plan


def fused_forward_rule(skip: bool, gated: bool) -> str:
    """The fused forward's Shardy rule (FORWARD_RULE's factors; D is h p)."""
    ins = "z c t h p, z c t h, z c t h, z c t g n, z c t g n, z h p n"
    ins += ", h p" if skip else ""
    ins += ", z c t h p" if gated else ""
    return f"{ins} -> z c t h p, z h p n, z c h p n"
