"""Which shardings the gated delta rule runs on locally (the planner for
`pallasite.kernels.sharding.run_explicit`, Explicit axes).

The recurrence carries its state along time, so time and the head dims stay local; rows
and value heads are independent and keep the mesh axes that shard them, taken from v:
  - batch: v's batch axes, where they divide the batch (with cu_seqlens the one row
    holds every sequence: none);
  - heads: v's head axes (not on the batch) where they divide both the value heads and
    the query/key heads, so each shard's value heads read only its own key heads (head
    h reads key head h // (Hv / Hk)). Otherwise heads are taken whole.
  - time: v's time axes (not on the batch or heads) where they divide T and the caller
    allows it (no packed sequences, not already inside a split): the sequence split over
    devices (context_parallel.py), each device running its part from the entering state
    the exchange gives it.
Everything else is resharded replicated. Under Auto axes and inside a shard_map XLA
partitions the plain-JAX form itself, and no planner runs.
"""

from __future__ import annotations

from collections.abc import Callable

from pallasite.kernels import sharding
from pallasite.kernels.sharding import Plan


def planner(forward_over: Callable, q_shape, v_shape, packed: bool, *,
            split_sequence: bool = True) -> sharding.Planner:
    """forward_over(time_axes) -> forward(q, k, v, g, beta, initial_state[, cu_seqlens])
    -> (o, final_state) on local arrays whose T is split over `time_axes` (or whole)."""
    batch_size, key_heads = q_shape[0], q_shape[2]
    length, value_heads = v_shape[1], v_shape[2]

    def plan(given, axis_sizes) -> Plan:
        v_dims = given[2]
        batch = () if packed else sharding.fits(v_dims[0], batch_size, axis_sizes)
        head = sharding.fits(tuple(a for a in v_dims[2] if a not in batch), value_heads,
                             axis_sizes)
        if head and key_heads % sharding.size(head, axis_sizes):
            head = ()
        time = ()
        if split_sequence and not packed:
            time = sharding.fits(tuple(a for a in v_dims[1] if a not in batch + head),
                                 length, axis_sizes)
        x = (batch, time, head, ())
        gate = (batch, time, head)
        state = (batch, head, (), ())
        in_dims = (x, x, x, gate, gate, state) + (((),) if packed else ())
        return Plan(in_dims=in_dims, out_dims=(x, state), local=forward_over(time))

    return plan
