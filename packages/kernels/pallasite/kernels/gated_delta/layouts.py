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
    allows it (not already inside a split): the sequence split over devices
    (context_parallel.py), each device running its part from the entering state the
    exchange gives it; packed sequences too, cu_seqlens replicated.
Everything else is resharded replicated. Under Auto axes and inside a shard_map XLA
partitions the plain-JAX form itself, and no planner runs.

The Pallas Triton kernels run each pass (the forward with its residuals, the backward)
through `sharding.run` with `pass_planners`: under Auto axes a custom_partitioning per
pass keeps the rows and heads the compiler gave the operands local (the same choice as
above), so the kernels are not handed whole arrays; under Explicit axes and in a
shard_map the planner above, or the caller, has made the operands local already. A
sequence the compiler laid out over Auto axes in parts of whole chunks (unpacked rows)
stays split there too: each pass runs on its part and exchanges state-sized arrays
itself, the backward by hand (context_parallel.py). The layout is known only when the
passes are partitioned, after JAX has differentiated the call, so the backward cannot
be JAX's there. Any other split of T is gathered, and the log says so (logger
"pallasite.gated_delta"). Named as `sequence_axes` under jit, Auto axes split the
sequence as a shard_map's do (api._over_auto_axes, packed rows and parts of any length
included), decided while tracing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from pallasite.kernels import sharding
from pallasite.kernels.sharding import Plan

_LOG = logging.getLogger("pallasite.gated_delta")


def _rows_and_heads(v_dims, axis_sizes, batch_size: int, key_heads: int, value_heads: int,
                    packed: bool):
    """(batch axes, head axes) kept local, from v's layout (module docstring)."""
    batch = () if packed else sharding.fits(v_dims[0], batch_size, axis_sizes)
    head = sharding.fits(tuple(a for a in v_dims[2] if a not in batch), value_heads,
                         axis_sizes)
    if head and key_heads % sharding.size(head, axis_sizes):
        head = ()
    return batch, head


def planner(forward_over: Callable, q_shape, v_shape, packed: bool, *,
            split_sequence: bool = True) -> sharding.Planner:
    """forward_over(time_axes) -> forward(q, k, v, g, beta, initial_state[, cu_seqlens])
    -> (o, final_state) on local arrays whose T is split over `time_axes` (or whole)."""
    batch_size, key_heads = q_shape[0], q_shape[2]
    length, value_heads = v_shape[1], v_shape[2]

    def plan(given, axis_sizes) -> Plan:
        v_dims = given[2]
        batch, head = _rows_and_heads(v_dims, axis_sizes, batch_size, key_heads,
                                      value_heads, packed)
        time = ()
        if split_sequence:
            time = sharding.fits(tuple(a for a in v_dims[1] if a not in batch + head),
                                 length, axis_sizes)
        x = (batch, time, head, ())
        gate = (batch, time, head)
        state = (batch, head, (), ())
        in_dims = (x, x, x, gate, gate, state) + (((),) if packed else ())
        return Plan(in_dims=in_dims, out_dims=(x, state), local=forward_over(time))

    return plan


# The residuals the Pallas Triton forward keeps for its backward (pallas_triton._kernels):
# each one's dimensions as Shardy factor names (b rows, c chunks, s and r steps in a
# chunk, h value heads, j key heads, d K, e V). "positions" (packed sequences only) is
# the steps' places in the layout, replicated.
RESIDUALS = {
    "q": "b c s j d", "k": "b c s j d", "v": "b c s h e", "hi": "b c s h", "lo": "b c s h",
    "beta": "b c s h", "inv": "b c h s r", "w": "b c s h d", "states": "b c h d e",
    "u": "b c s h e", "entering": "b c", "leaving": "b c", "positions": "t",
}


def residual_names(packed: bool) -> tuple[str, ...]:
    return tuple(n for n in RESIDUALS if packed or n != "positions")


def pass_rules(packed: bool, residuals: bool = True,
               chunks: tuple[int, int] | None = None) -> tuple[str, str, dict]:
    """The Shardy rules of the Pallas Triton forward (q, k, v, g, beta, initial_state[,
    cu_seqlens] -> o, finals[, residuals]) and backward (residuals, do, dfinal -> dq, dk,
    dv, dg, dbeta, d initial_state), and the factor sizes they need. Packed sequences'
    states count sequences (n), not rows, and cu_seqlens has its own factor (N). T is
    the steps: with `chunks` = (NC, C), unpacked rows of whole chunks, the compound (c
    s) of the residuals' chunk and step factors, so a T the compiler splits over whole
    chunks splits the residuals' chunks alike (the backward's operands); else a factor
    of its own."""
    state = "n h d e" if packed else "b h d e"
    steps = "T" if packed or chunks is None else "(c s)"
    saved = ", ".join(RESIDUALS[n] if n != "positions" else "T"
                      for n in residual_names(packed))
    inputs = (f"b {steps} j d, b {steps} j d, b {steps} h e, b {steps} h, b {steps} h, "
              f"{state}" + (", N" if packed else ""))
    grads = f"b {steps} j d, b {steps} j d, b {steps} h e, b {steps} h, b {steps} h, {state}"
    outputs = f"b {steps} h e, {state}" + (f", {saved}" if residuals else "")
    sizes = {} if residuals or steps == "T" else {"c": chunks[0], "s": chunks[1]}
    return f"{inputs} -> {outputs}", f"{saved}, b {steps} h e, {state} -> {grads}", sizes


def _whole_chunks(time, axis_sizes, length: int, chunk: int, packed: bool):
    """The axes of `time` the kernels' passes split T over: all of them where they cut T
    into parts of whole chunks, and the rows are not packed; else () (T gathered)."""
    if packed or not time:
        return ()
    parts = sharding.size(time, axis_sizes)
    return time if length % parts == 0 and (length // parts) % chunk == 0 else ()


def pass_planners(forward: Callable, backward: Callable, *, batch_size: int, key_heads: int,
                  value_heads: int, packed: bool, residuals: bool = True, length: int,
                  chunk: int) -> tuple[sharding.Planner, sharding.Planner]:
    """Planners for the kernels' two passes on local arrays: forward(q, k, v, g, beta,
    initial_state[, cu_seqlens], sequence_axes=) -> (o, finals[, *residuals in
    residual_names order]) and backward(*residuals, do, dfinal, sequence_axes=) -> (dq,
    dk, dv, dg, dbeta, d initial_state). Rows and heads stay split as `planner` keeps
    them. T laid out over other axes stays split where each part is whole chunks of
    unpacked rows: the passes run on the parts with sequence_axes naming those axes
    (each part from the entering state one exchange gives it, context_parallel.py), and
    the residuals' chunks are split alike; any other split of T is gathered (logged).
    Every residual is laid out by its rows, heads and chunks (RESIDUALS), so the
    backward finds them where the forward left them. The gradients need no sum: a
    shard's key heads are read by its own value heads only."""
    names = residual_names(packed)

    def local_axes(v_dims, axis_sizes):
        return _rows_and_heads(v_dims, axis_sizes, batch_size, key_heads, value_heads,
                               packed)

    def dims(batch, head, time=()):
        factor = {"b": batch, "h": head, "j": head, "c": time}
        x = (batch, time, head, ())
        gate = (batch, time, head)
        state = (batch, head, (), ())
        saved = tuple(tuple(factor.get(f, ()) for f in RESIDUALS[n].split()) for n in names)
        return x, gate, state, saved

    def over(fn, time):
        return functools.partial(fn, sequence_axes=time) if time else fn

    def forward_plan(given, axis_sizes) -> Plan:
        batch, head = local_axes(given[2], axis_sizes)
        laid_out = tuple(a for a in given[2][1] if a not in batch + head)
        time = _whole_chunks(laid_out, axis_sizes, length, chunk, packed)
        if laid_out and not time:
            _LOG.info("gated_delta_rule: the sequence laid out over Auto axes %s is gathered "
                      "for the Pallas Triton kernels (they keep it split in parts of whole "
                      "chunks of unpacked rows; to split it otherwise, name those axes as "
                      "sequence_axes, or lay it out over Explicit axes)", laid_out)
        x, gate, state, saved = dims(batch, head, time)
        in_dims = (x, x, x, gate, gate, state) + (((),) if packed else ())
        return Plan(in_dims=in_dims, out_dims=(x, state) + (saved if residuals else ()),
                    local=over(forward, time))

    def backward_plan(given, axis_sizes) -> Plan:
        batch, head = local_axes(given[len(names)], axis_sizes)
        # T split where both do and the residuals' chunks are split alike (the forward's)
        chunks = given[names.index("q")][1]
        laid_out = tuple(a for a in given[len(names)][1] if a not in batch + head)
        time = _whole_chunks(laid_out if laid_out == chunks else (), axis_sizes, length,
                             chunk, packed)
        x, gate, state, saved = dims(batch, head, time)
        return Plan(in_dims=saved + (x, state), out_dims=(x, x, x, gate, gate, state),
                    local=over(backward, time))

    return forward_plan, backward_plan
