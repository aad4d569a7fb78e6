"""The gated delta rule's public functions, with flash-linear-attention's arguments.

`chunk_gated_delta_rule` (training and prefill: the chunked WY form) and
`fused_recurrent_gated_delta_rule` (short sequences: the step-by-step recurrence)
compute the definition of pallasite.reference.gated_delta_rule and return (o,
final_state or None). The chunked form's implementations: "pallas_triton"
(pallas_triton.py: a CUDA GPU from sm80, where predicates.py admits the problem; named
on a CPU it runs interpreted), "pallas_mosaic_tpu" (pallas_mosaic_tpu.py: the state pass
as Mosaic TPU kernels, on a TPU or interpreted on a CPU, only where named) and "xla"
(xla.py, every device). A call that names none
runs DEFAULT_ORDER: the Pallas kernels where they serve, else XLA (on an H200 the
kernels' forward takes 4.0 ms where the XLA form takes 25.9 at Qwen3-Next's shape:
docs/gated_delta_rule.md). The step-by-step form has one, "xla".

`gated_delta_rule_step` is the decode step: one token per batch row into a
slot-indexed state cache, in place where the cache is donated, on Pallas Triton
(step_pallas_triton.py, one pass over the named slots' state) or XLA (the oracle's step).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from pallasite.kernels import decoding, platform, sharding
from pallasite.kernels.gated_delta import context_parallel, layouts, predicates, xla
from pallasite.reference import gated_delta_rule as ref
from pallasite.reference import slots

IMPLEMENTATIONS = ("pallas_triton", "pallas_mosaic_tpu", "xla")
# What a call naming no implementation runs: each name where it serves, in order.
DEFAULT_ORDER = ("pallas_triton", "xla")
RECURRENT_IMPLEMENTATIONS = ("xla",)


def _chunked_backend(implementation, q, k, v, g, beta, chunk_size, block_sizes):
    """(name, interpret) of the chunked form's implementation: the first of the names
    (DEFAULT_ORDER when None) that serves. pallas_triton serves where
    predicates.pallas_triton_reason admits the problem on this device; where it was named
    alone and does not, a ValueError says why (naming the argument)."""
    names = (list(DEFAULT_ORDER) if implementation is None
             else platform.named_implementations(implementation, IMPLEMENTATIONS))
    reasons = []
    for name in names:
        if name == "xla":
            return name, False
        named = implementation is not None
        if name == "pallas_triton":
            why = predicates.pallas_triton_reason(q, k, v, g, beta, chunk_size, block_sizes,
                                                  named=named)
        else:
            why = predicates.pallas_mosaic_tpu_reason(q, k, v, g, beta, chunk_size,
                                                      named=named)
        if why is None:
            return name, jax.default_backend() == "cpu"
        reasons.append(f"{name}: {why}")
    raise ValueError(f"implementation={implementation!r} cannot serve this call: "
                     + "; ".join(reasons))


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, block_sizes,
             sequence_axes):
    """Checks (ValueError/TypeError naming the argument); the scale and initial states.
    With sequence_axes, cu_seqlens spans the whole row: T times the parts."""
    predicates.check_block_sizes(block_sizes)
    parts = sharding.size(sequence_axes, dict(jax.sharding.get_abstract_mesh().shape))
    n = ref.validate_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                      initial_state=initial_state, cu_seqlens=cu_seqlens,
                                      chunk_size=chunk_size, packed_length=q.shape[1] * parts)
    hv, dv = v.shape[2:]
    dk = q.shape[3]
    if initial_state is None:
        initial_state = jnp.zeros((n, hv, dk, dv), jnp.float32)
    return (dk ** -0.5 if scale is None else float(scale)), initial_state


def chunk_gated_delta_rule(
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
    chunk_size: int = 64,
    implementation: str | Sequence[str] | None = None,
    block_sizes=None,
    sequence_axes: str | Sequence[str] | None = None,
):
    """(o [B, T, Hv, V] in v's dtype, final_state [N, Hv, K, V] fp32 or None).

    q, k [B, T, Hk, K]; v [B, T, Hv, V] with Hv a multiple of Hk (value head h reads
    key head h // (Hv // Hk)); g [B, T, Hv] the log decay (<= 0); beta [B, T, Hv];
    initial_state [N, Hv, K, V] with N = B, or the number of sequences when cu_seqlens
    [N + 1] packs them into one row (B = 1). scale defaults to K^-1/2. Differentiable in
    q, k, v, g, beta and initial_state.

    implementation: "pallas_triton", "pallas_mosaic_tpu", "xla", a sequence of them
    (each tried where it serves: pallas_triton where predicates.py admits it, a CUDA GPU
    from sm80, K and V powers of two in [16, 256], chunk_size 16, 32 or 64,
    bf16/fp16/fp32 inputs; pallas_mosaic_tpu on a TPU, or a CPU interpreted, a chunk
    that is a multiple of 8, only when named), or None
    (DEFAULT_ORDER: pallas_triton where it serves, else xla). block_sizes: None or a dict for pallas_triton
    ({"block_v": ..., "output_block_v": ..., "grads_block_v": ...}: value columns per
    program of the state passes, the output and the chunk gradients); xla ignores it.

    The sequence split over devices (context parallelism, context_parallel.py): under
    jit with Explicit axes, T laid out over mesh axes (not the batch's or heads') that
    divide it stays split, the devices passing only state-sized arrays; inside a
    shard_map, name the manual axes the local arrays' T is split over, in order, as
    `sequence_axes` (each part may have any length; the final state and the initial
    state's gradient are the whole sequence's on every device). Under jit with Auto
    axes, where the layout is the compiler's, `sequence_axes` may name Auto axes of the
    mesh in context (jax.set_mesh) that divide T: the call then splits T over them
    itself (`_over_auto_axes`), and rows and heads are left to the compiler. Not named,
    a T the compiler splits over Auto axes in parts of whole chunks of unpacked rows
    stays split through the pallas_triton kernels' passes (layouts.pass_planners); any
    other split is gathered.
    Packed sequences (cu_seqlens) split the same way: a sequence that crosses a part's
    edge carries its state across it, and each final state comes from the part that
    holds the sequence's last step.
    """
    if auto := sharding.auto_sequence_axes(sequence_axes):
        return _over_auto_axes(
            chunk_gated_delta_rule, auto, q, k, v, g, beta, initial_state, cu_seqlens,
            output_final_state, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            chunk_size=chunk_size, implementation=implementation, block_sizes=block_sizes)
    sequence_axes = sharding.sequence_axes_in_context(sequence_axes, auto_too=True)
    scale, init = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size,
                           block_sizes, sequence_axes)
    name, interpret = _chunked_backend(implementation, q, k, v, g, beta, chunk_size,
                                       block_sizes)
    if name == "xla":
        form = functools.partial(xla.forward, chunk_size=chunk_size)
    elif name == "pallas_mosaic_tpu":
        from pallasite.kernels.gated_delta import pallas_mosaic_tpu

        form = functools.partial(pallas_mosaic_tpu.forward, chunk_size=chunk_size,
                                 interpret=interpret)
    else:
        from pallasite.kernels.gated_delta import pallas_triton

        form = functools.partial(pallas_triton.forward, chunk_size=chunk_size,
                                 interpret=interpret, block_sizes=block_sizes)
    return _run(form, q, k, v, g, beta, scale, init, cu_seqlens, use_qk_l2norm_in_kernel,
                output_final_state, sequence_axes=sequence_axes,
                split_sequence=not sequence_axes)


def _run(form, q, k, v, g, beta, scale, init, cu_seqlens, l2norm_qk, output_final_state,
         sequence_axes=(), split_sequence=False):
    """form(q, k, v, g, beta, scale=, initial_state=, cu_seqlens=,
    use_qk_l2norm_in_kernel=) -> (o, final) on the local rows and heads (layouts.py:
    a shard_map under Explicit axes; XLA's partitioner elsewhere). The public result.
    sequence_axes: a caller's shard_map splits T over these (context_parallel.split);
    split_sequence: the form may run on a part of T under Explicit axes, where T's
    layout allows."""

    def forward_over(axes):
        axes = axes or sequence_axes
        part = context_parallel.split(form, axes) if axes else form

        def forward(q, k, v, g, beta, init, *cu):
            if not axes:
                # Inside a shard_map with check_vma, an initial state replicated beside
                # split rows takes their varying type (the scans' carries need one). A
                # split sequence keeps it as given: its final state is then the same
                # on every part.
                q, k, v, g, beta, init = sharding.vary_together((q, k, v, g, beta, init))
            return part(q, k, v, g, beta, scale=scale, initial_state=init,
                        cu_seqlens=cu[0] if cu else None, use_qk_l2norm_in_kernel=l2norm_qk)

        return forward

    args = (q, k, v, g, beta, init) + (() if cu_seqlens is None else (cu_seqlens,))
    plan = layouts.planner(forward_over, q.shape, v.shape, cu_seqlens is not None,
                           split_sequence=split_sequence)
    o, final = sharding.run_explicit(plan, args)
    return o, (final.astype(jnp.float32) if output_final_state else None)


def _over_auto_axes(public, axes, q, k, v, g, beta, initial_state, cu_seqlens,
                    output_final_state, **options):
    """public(...) with T split over the Auto mesh axes `axes` (sequence_axes under jit):
    a shard_map manual over those axes alone, T laid out over them (the compiler moves
    it there if it lies elsewhere), each device running its part with sequence_axes as
    inside a caller's shard_map; the other axes stay Auto, so the compiler partitions
    rows and heads within. The initial state and cu_seqlens (the whole row's) go to
    every part whole; the final state comes back the same on every device."""
    mesh = jax.sharding.get_abstract_mesh()
    parts = sharding.size(axes, dict(mesh.shape))
    if q.shape[1] % parts:
        raise ValueError(f"sequence_axes={axes!r}: T={q.shape[1]} must divide by their "
                         f"{parts} devices (the sequence is split in equal parts)")
    P = jax.sharding.PartitionSpec
    along_t = P(None, axes)
    whole = tuple(a for a in (initial_state, cu_seqlens) if a is not None)

    def part(q, k, v, g, beta, *rest):
        rest = iter(rest)
        init = next(rest) if initial_state is not None else None
        cu = next(rest) if cu_seqlens is not None else None
        return public(q, k, v, g, beta, initial_state=init, cu_seqlens=cu,
                      output_final_state=True, sequence_axes=axes, **options)

    # check_vma off, as the Explicit route's shard_map (sharding.run_explicit): the
    # Pallas interpreters cannot run under it.
    o, final = jax.shard_map(part, mesh=mesh, in_specs=(along_t,) * 5 + (P(),) * len(whole),
                             out_specs=(along_t, P()), axis_names=frozenset(axes),
                             check_vma=False)(q, k, v, g, beta, *whole)
    return o, (final if output_final_state else None)


def fused_recurrent_gated_delta_rule(
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
    implementation: str | Sequence[str] | None = None,
    block_sizes=None,
    sequence_axes: str | Sequence[str] | None = None,
):
    """chunk_gated_delta_rule's arguments and results (no chunk_size), computed one step
    at a time: cheaper than the chunked form where T is a few steps (decode). Its one
    implementation is "xla"; block_sizes must be None. The sequence splits over devices
    as the chunked form's does (sequence_axes, Explicit axes, sequence_axes naming Auto
    axes under jit)."""
    platform.named_implementations(implementation, RECURRENT_IMPLEMENTATIONS)
    if auto := sharding.auto_sequence_axes(sequence_axes):
        return _over_auto_axes(
            fused_recurrent_gated_delta_rule, auto, q, k, v, g, beta, initial_state,
            cu_seqlens, output_final_state, scale=scale,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, implementation=implementation,
            block_sizes=block_sizes)
    sequence_axes = sharding.sequence_axes_in_context(sequence_axes, auto_too=True)
    if block_sizes is not None:
        raise TypeError("block_sizes: fused_recurrent_gated_delta_rule's only "
                        f"implementation (xla) takes none; got {block_sizes!r}")
    scale, init = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, None,
                           block_sizes, sequence_axes)
    form = functools.partial(ref.gated_delta_rule_sequential, output_final_state=True)
    return _run(form, q, k, v, g, beta, scale, init, cu_seqlens, use_qk_l2norm_in_kernel,
                output_final_state, sequence_axes=sequence_axes,
                split_sequence=not sequence_axes)


def gated_delta_rule_step(
    state: Float[Array, "slots Hv K V"],
    q: Float[Array, "b Hk K"],
    k: Float[Array, "b Hk K"],
    v: Float[Array, "b Hv V"],
    g: Float[Array, "b Hv"],
    beta: Float[Array, "b Hv"],
    *,
    scale: float | None = None,
    state_batch_indices: Integer[Array, " b"] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    implementation: str | Sequence[str] | None = None,
) -> tuple[Float[Array, "b Hv V"], Float[Array, "slots Hv K V"]]:
    """One decode token per batch row: (o [b, Hv, V] in v's dtype, the state cache with
    each named slot advanced one step, in the state's dtype).

    state [slots, Hv, K, V] in fp32 or bf16; q, k [b, Hk, K]; v [b, Hv, V]; g, beta
    [b, Hv]. state_batch_indices [b]: each row's slot (continuous batching); without
    it, row i uses slot i and slots must equal b. A row whose index is outside
    [0, slots) is padding: it touches no slot and gets o = 0. Slots no row names keep
    their bits. Donate the cache (`jax.jit(..., donate_argnames="state")`) to update it
    in place. implementation: "pallas_triton" (a CUDA GPU from sm80; interpreted when
    named on a CPU), "xla", a sequence, or None (that order). No gradient: it is a
    decode step (train with chunk_gated_delta_rule).
    """
    ref.validate_gated_delta_rule_step(state, q, k, v, g, beta, scale=scale,
                                       state_batch_indices=state_batch_indices)
    name = decoding.step_backend("gated_delta_rule_step", implementation)
    slots_of_rows = slots.slots_of_rows(state_batch_indices, q.shape[0])
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    stop = decoding.no_gradient("gated_delta_rule_step", "chunk_gated_delta_rule")
    state, q, k, v, g, beta = map(stop, (state, q, k, v, g, beta))
    if name == "xla":
        return ref.on_slots(state, q, k, v, g, beta, scale, slots_of_rows,
                            use_qk_l2norm_in_kernel)
    from pallasite.kernels.gated_delta import step_pallas_triton

    return step_pallas_triton.update(state, q, k, v, g, beta, scale, slots_of_rows,
                                     use_qk_l2norm_in_kernel,
                                     interpret=jax.default_backend() == "cpu")
