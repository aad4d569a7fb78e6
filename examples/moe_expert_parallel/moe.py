"""An expert-parallel mixture-of-experts feed-forward block on pallasite's grouped_mlp.

Each device of the `expert` mesh axis holds its own tokens and E / D of the E experts
(D devices). Per device, inside one shard_map:

  1. route: top-k experts per token (softmax over the k chosen logits);
  2. local sort: the T*k (token, expert) assignments sorted by expert, rows gathered;
  3. dispatch: each expert shard's rows sent to it, either
       - `ragged`: `jax.lax.ragged_all_to_all` into a receive buffer of `capacity` rows
         (the GPU path; XLA:CPU does not implement it), or
       - `padded`: `jax.lax.all_to_all` of a [D, capacity, d] buffer, `capacity` rows per
         (sender, receiver) pair (what CI runs on host devices);
     rows past a capacity are dropped (their output is zero), as in capacity-factor MoE;
  4. the received rows sorted by local expert;
  5. the experts: one grouped_mlp over the local experts (the gate-up product, the
     SwiGLU, the down product); `experts=` swaps in another form with its signature,
     such as `unfused_experts(project)`: three separate products on pallasite's
     grouped_projection or on jax.lax.ragged_dot (the peer);
  6. the return trip (the same collective, reversed), the inverse sorts, and the combine
     weighted by the router's probabilities.

Every step is differentiable (the collectives' transposes are collectives), so
`jax.grad` of a loss over the block's output trains it. `reference` is the same block as
dense einsums over every expert on one device, the oracle of the tests.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallasite.kernels import grouped_mlp, grouped_projection

DISPATCHES = ("ragged", "padded")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    compute: str = "bfloat16"


def init_params(key, config: MoeConfig, dtype=jnp.float32) -> dict:
    """Router [d, E]; gate_up [E, d, 2f] (the gate's f columns, then the up's); down
    [E, f, d] (scaled for unit outputs)."""
    kr, kg, kd = jax.random.split(key, 3)
    d, f, e = config.d_model, config.d_ff, config.num_experts
    return {
        "router": jax.random.normal(kr, (d, e), dtype) / np.sqrt(d),
        "gate_up": jax.random.normal(kg, (e, d, 2 * f), dtype) / np.sqrt(d),
        "down": jax.random.normal(kd, (e, f, d), dtype) / np.sqrt(f),
    }


def route(x, router, top_k: int):
    """(experts [T, k] int32, probabilities [T, k] fp32): each token's top-k experts by
    router logit (fp32), weighted by a softmax over those k logits."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    top, experts = jax.lax.top_k(logits, top_k)
    return experts.astype(jnp.int32), jax.nn.softmax(top, axis=-1)


def pallasite_experts(compute) -> Callable:
    """grouped_mlp in `compute`: the whole expert MLP, h and y each rounded once."""
    return lambda rows, sizes, gate_up, down: grouped_mlp(rows, gate_up, down, sizes, compute)


def pallasite_fused_experts(compute, implementation=None) -> Callable:
    """grouped_mlp with fuse_activation=True (16-bit compute): the activation in the
    gate-up kernel's epilogue and no [rows, 2 d_ff] pre-activation kept for the backward
    (docs/grouped_mlp.md); on a CPU the kernels run interpreted. implementation: the
    fused backend (None: the first that runs here)."""
    return lambda rows, sizes, gate_up, down: grouped_mlp(
        rows, gate_up, down, sizes, compute, interpret_on_cpu=True,
        implementation=implementation, fuse_activation=True)


def pallasite_fp8_experts(compute, fuse_activation=False) -> Callable:
    """grouped_mlp's fp8 training recipe: both products in e4m3 (1 x 128 activation
    blocks, 128 x 128 weight blocks, the weight gradients' operands in 128-token
    blocks), fp32 sums, outputs in `compute`, gradients straight through to the
    bf16/fp32 arrays (docs/fp8.md). fuse_activation: the fused fp8 route (h quantized
    in the gate-up kernel's epilogue and kept in e4m3; docs/grouped_mlp.md)."""
    return lambda rows, sizes, gate_up, down: grouped_mlp(
        rows, gate_up, down, sizes, compute, recipe="fp8", interpret_on_cpu=fuse_activation,
        fuse_activation=fuse_activation)


def pallasite_project(compute) -> Callable:
    """grouped_projection in `compute`: one expert matmul (for unfused_experts)."""
    return lambda x, w, sizes: grouped_projection(x, w, sizes, compute)


def ragged_dot_project(compute) -> Callable:
    """The same product through jax.lax.ragged_dot (fp32 sums, one rounding): the peer."""
    def project(x, w, sizes):
        out = jax.lax.ragged_dot(x.astype(compute), w.astype(compute), sizes,
                                 preferred_element_type=jnp.float32)
        rows = jnp.arange(x.shape[0])[:, None] < jnp.sum(sizes)
        return jnp.where(rows, out, 0).astype(compute)
    return project


def unfused_experts(project) -> Callable:
    """The expert MLP as three `project` calls (gate, up, down) with the SwiGLU between,
    each product rounded to its output dtype: what a block without grouped_mlp runs."""
    def experts(rows, group_sizes, gate_up, down):
        f = gate_up.shape[2] // 2
        hidden = jax.nn.silu(project(rows, gate_up[..., :f], group_sizes).astype(jnp.float32))
        hidden = hidden * project(rows, gate_up[..., f:], group_sizes).astype(jnp.float32)
        return project(hidden.astype(rows.dtype), down, group_sizes)
    return experts


# ------------------------------------------------------------------ dispatch maths


def _kept_per_expert(counts, kept):
    """Rows of each expert that fit when a chunk sorted by expert keeps its first `kept`
    rows: counts [..., El], kept [...] -> [..., El]."""
    before = jnp.cumsum(counts, axis=-1) - counts
    return jnp.clip(kept[..., None] - before, 0, counts)


def _local_expert_of_rows(rows: int, chunk_start, chunk_counts, local_experts: int):
    """Per row of a receive buffer: the local expert it belongs to, `local_experts` for a
    row of no chunk. Chunk s starts at chunk_start[s] and holds chunk_counts[s, e] rows of
    expert e, in expert order."""
    r = jnp.arange(rows, dtype=jnp.int32)
    expert = jnp.full((rows,), local_experts, jnp.int32)
    for s in range(chunk_counts.shape[0]):
        ends = jnp.cumsum(chunk_counts[s])
        pos = r - chunk_start[s]
        inside = (pos >= 0) & (pos < ends[-1])
        e = jnp.searchsorted(ends, pos, side="right").astype(jnp.int32)
        expert = jnp.where(inside, e, expert)
    return expert


def _grouped_by_expert(buffer, expert, local_experts: int):
    """(rows sorted by local expert, the sort order, group sizes [El])."""
    order = jnp.argsort(expert, stable=True)
    sizes = jnp.sum(expert[None, :] == jnp.arange(local_experts)[:, None], axis=1,
                    dtype=jnp.int32)
    return buffer[order], order, sizes


def _unsorted(rows, order):
    """The inverse of rows = original[order]."""
    return jnp.zeros_like(rows).at[order].set(rows)


# ------------------------------------------------------------------ the block


def _block_local(params, x, *, top_k, axis, devices, dispatch, capacity, expert_mlp):
    """The block on one device's tokens and experts (inside the shard_map over `axis`)."""
    num_experts_local = params["gate_up"].shape[0]
    num_experts = num_experts_local * devices
    tokens, d = x.shape
    experts, probs = route(x, params["router"], top_k)

    # 2. local sort of the assignments by expert.
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // top_k]
    counts = jnp.sum(flat[None, :] == jnp.arange(num_experts)[:, None], axis=1,
                     dtype=jnp.int32).reshape(devices, num_experts_local)  # [dst, El]
    sends = jnp.sum(counts, axis=1)  # rows for each destination
    send_start = jnp.cumsum(sends) - sends
    # What every source sends this device, per local expert: [src, El].
    recv_counts = jax.lax.all_to_all(counts, axis, 0, 0, tiled=True)

    # 3. dispatch; 4. sort by local expert.
    if dispatch == "ragged":
        me = jax.lax.axis_index(axis)
        all_sends = jax.lax.all_gather(sends, axis)  # [src, dst]
        before = jnp.cumsum(all_sends, axis=0) - all_sends  # rows landing before src's
        kept_all = jnp.clip(capacity - before, 0, all_sends)  # [src, dst] that fit
        kept_send, out_start = kept_all[me], jnp.minimum(before[me], capacity)
        kept_recv, recv_start = kept_all[:, me], jnp.minimum(before[:, me], capacity)
        buffer = jax.lax.ragged_all_to_all(
            rows, jnp.zeros((capacity, d), rows.dtype), send_start.astype(jnp.int32),
            kept_send.astype(jnp.int32), out_start.astype(jnp.int32),
            kept_recv.astype(jnp.int32), axis_name=axis)
    else:
        kept_send = jnp.minimum(sends, capacity)
        kept_recv = jnp.minimum(jnp.sum(recv_counts, axis=1), capacity)
        recv_start = jnp.arange(devices, dtype=jnp.int32) * capacity
        slot = jnp.arange(capacity, dtype=jnp.int32)
        src_rows = send_start[:, None] + slot[None, :]  # [dst, capacity]
        valid = slot[None, :] < kept_send[:, None]
        chunks = jnp.where(valid[..., None], rows[jnp.clip(src_rows, 0, rows.shape[0] - 1)], 0)
        buffer = jax.lax.all_to_all(chunks, axis, 0, 0, tiled=True).reshape(-1, d)
    chunk_counts = _kept_per_expert(recv_counts, kept_recv)
    expert = _local_expert_of_rows(buffer.shape[0], recv_start, chunk_counts, num_experts_local)
    grouped, order_local, sizes = _grouped_by_expert(buffer, expert, num_experts_local)

    # 5. the experts.
    out = expert_mlp(grouped, sizes, params["gate_up"], params["down"])
    out = _unsorted(out, order_local)

    # 6. the return trip, the inverse sort, the weighted combine.
    if dispatch == "ragged":
        source_start = (jnp.cumsum(all_sends, axis=1) - all_sends)[:, me]  # [src]
        back = jax.lax.ragged_all_to_all(
            out, jnp.zeros((rows.shape[0], d), out.dtype), recv_start.astype(jnp.int32),
            kept_recv.astype(jnp.int32), source_start.astype(jnp.int32),
            kept_send.astype(jnp.int32), axis_name=axis)
    else:
        back = jax.lax.all_to_all(out.reshape(devices, capacity, d), axis, 0, 0, tiled=True)
        a = jnp.arange(rows.shape[0], dtype=jnp.int32)
        dst = jnp.searchsorted(jnp.cumsum(sends), a, side="right").clip(0, devices - 1)
        slot_of = a - send_start[dst]
        back = jnp.where((slot_of < kept_send[dst])[:, None],
                         back[dst, jnp.clip(slot_of, 0, capacity - 1)], 0)
    per_assignment = _unsorted(back, order).reshape(tokens, top_k, d)
    return jnp.einsum("tkd,tk->td", per_assignment.astype(jnp.float32), probs).astype(x.dtype)


def moe_block(params, x, config: MoeConfig, mesh, *, axis: str = "expert",
              dispatch: str = "ragged", capacity_factor: float = 2.0,
              experts: Callable | None = None):
    """The expert-parallel block over `mesh`'s `axis`: x [T, d] sharded over it (each
    device routes its own tokens), the expert weights sharded over their expert axis,
    the router replicated. Returns [T, d] laid out like x.

    capacity_factor: receive rows per device (ragged) or per device pair (padded) as a
    multiple of the average, T*k/D and T*k/D^2 per device; rows past it are dropped.
    A finite number > 0 (else ValueError). `capacity_factor=None` sizes the buffers for
    the worst case (nothing is dropped).
    experts: the expert MLP, (rows, group_sizes, gate_up, down) -> rows
    (pallasite_experts by default; unfused_experts(ragged_dot_project(...)) is the
    peer)."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch={dispatch!r}: one of {DISPATCHES}")
    devices = mesh.shape[axis]
    if config.num_experts % devices:
        raise ValueError(f"num_experts={config.num_experts} must split over the {devices} "
                         f"devices of axis {axis!r}")
    if x.shape[0] % devices:
        raise ValueError(f"x has {x.shape[0]} tokens; they must split over {devices} devices")
    _check_capacity_factor(capacity_factor)
    assignments = x.shape[0] // devices * config.top_k  # per device
    if capacity_factor is None:  # the worst case: every row to one device
        capacity = assignments * devices if dispatch == "ragged" else assignments
    else:
        average = assignments if dispatch == "ragged" else assignments / devices
        capacity = int(np.ceil(average * capacity_factor))
    experts = experts or pallasite_experts(jnp.dtype(config.compute))
    body = functools.partial(_block_local, top_k=config.top_k, axis=axis, devices=devices,
                             dispatch=dispatch, capacity=capacity, expert_mlp=experts)
    specs = {"router": P(), "gate_up": P(axis), "down": P(axis)}
    if axis in mesh.explicit_axes:  # Explicit axes: the operands must already be laid out
        place = lambda a, spec: jax.sharding.reshard(a, NamedSharding(mesh, spec))  # noqa: E731
        params = {name: place(params[name], spec) for name, spec in specs.items()}
        x = place(x, P(axis))
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axis)), out_specs=P(axis),
                         check_vma=False)(params, x)


def _check_capacity_factor(capacity_factor) -> None:
    """None, or a finite number > 0: zero or less would size the receive buffers at no rows
    (an indexing error deep inside XLA), and inf or NaN at no integer number of rows."""
    if capacity_factor is None:
        return
    if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real)
            or not 0 < capacity_factor < float("inf")):
        raise ValueError(f"capacity_factor={capacity_factor!r}: need a finite number > 0, "
                         "or None for buffers that drop nothing")


def reference(params, x, config: MoeConfig):
    """The block on one device as dense fp32 einsums over every expert (no dispatch, no
    drops): out[t] = sum_k p[t, k] * down_e(silu(gate_e x) * up_e x), e = experts[t, k]."""
    experts, probs = route(x, params["router"], config.top_k)
    hi = jax.lax.Precision.HIGHEST
    xf = x.astype(jnp.float32)
    f = params["down"].shape[1]
    gate_up = params["gate_up"].astype(jnp.float32)
    gate = jnp.einsum("td,edf->etf", xf, gate_up[..., :f], precision=hi)
    up = jnp.einsum("td,edf->etf", xf, gate_up[..., f:], precision=hi)
    every = jnp.einsum("etf,efd->etd", jax.nn.silu(gate) * up,
                       params["down"].astype(jnp.float32), precision=hi)
    weight = jnp.sum(jax.nn.one_hot(experts, config.num_experts) * probs[..., None], axis=1)
    return jnp.einsum("etd,te->td", every, weight, precision=hi).astype(x.dtype)
