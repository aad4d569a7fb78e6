"""`mamba_chunk_scan`: mamba_ssm's `mamba_chunk_scan_combined` on pallasite's SSD scan.

The definition is pallasite.reference.mamba_chunk_scan's. Here it is put together from
the chunked scan every SSD backend runs (chunk_ssd, whose selection, fallbacks, block
sizes and sequence sharding it inherits) and elementwise work around it:

- dt: bias, softplus and clamp (the reference's own function), then the scan's inputs
  a = A dt and x dt, in fp32, x dt rounded to x's dtype (the kernels' operand dtype);
- packed sequences: a = -inf at each step where seq_idx changes, an exact state reset in
  every backend (pallasite.kernels.ssd.decay), so no state or output crosses it, with no
  gradient through the reset step's decay (it multiplies nothing);
- D and z: y + D x, then y silu(z), in fp32, rounded once to x's dtype;
- varlen_states: each packed sequence's final state (varlen.py).

JAX differentiates the whole: the scan by its backend's hand-written backward, the rest
by autodiff.

Where the Pallas Triton backend runs first (fused.eligible), on any layout chunk_ssd
serves (a sequence split over devices included), the forward puts x dt, D and z into its
kernels instead (fused.py): the output kernel scales its tile's columns by dt and
applies D x and the gate in its epilogue, y rounded once. A differentiated call takes
the composition's forward and backward there too (autodiff.values_from), which measured
faster (fused.py). On the other backends the elementwise work is XLA ops beside the
kernels.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from pallasite.kernels import autodiff, sharding
from pallasite.kernels.mamba_scan import fused, varlen
from pallasite.kernels.ssd import api as ssd_api
from pallasite.kernels.ssd import context_parallel
from pallasite.reference import mamba_chunk_scan as ref
from pallasite.reference import ssd_decode

_F32 = jnp.float32
_LOG = logging.getLogger("pallasite.ssd")


def _sequence_starts(seq_idx, sequence_axes):
    """[b, l] bool: the steps where a new sequence begins (never the first step of the
    whole sequence). Inside a shard_map that splits the sequence, a part's first step
    compares with the previous part's last. Under jit a sequence split over Explicit
    axes is read whole here: seq_idx is 4 bytes a step, the shift would otherwise need
    a layout no single device holds."""
    if sequence_axes:
        before = context_parallel.previous_part(seq_idx[:, -1:], seq_idx[:, :1],
                                                sequence_axes)
    else:
        seq_idx = sharding.whole_along(seq_idx, (1,))
        before = seq_idx[:, :1]
    return jnp.concatenate([before, seq_idx[:, :-1]], axis=1) != seq_idx


def _epilogue(y, x, D, z):
    """y + D x, then y silu(z), in fp32; y rounded once, to x's dtype."""
    f32 = lambda t: None if t is None else t.astype(_F32)  # noqa: E731
    return ssd_decode.skip_and_gate(f32(y), f32(x), f32(D), f32(z)).astype(x.dtype)


def _times_dt(x, dt):
    """x dt in dt's dtype, rounded to x's (the kernels' operand dtype)."""
    return (x.astype(dt.dtype) * dt[..., None]).astype(x.dtype)


def _composition(x, dt, a, B, C, initial_state, D, z, *, chunk_size, implementation,
                 block_sizes, sequence_axes):
    """(y, final): chunk_ssd on x dt, then the epilogue."""
    y, final = ssd_api.chunk_ssd(_times_dt(x, dt), a, B, C, chunk_size=chunk_size,
                                 initial_state=initial_state, implementation=implementation,
                                 block_sizes=block_sizes, sequence_axes=sequence_axes or None)
    return _epilogue(y, x, D, z), final


def mamba_chunk_scan(
    x: Float[Array, "batch length heads head_dim"],
    dt: Float[Array, "batch length heads"],
    A: Float[Array, " heads"],
    B: Float[Array, "batch length groups state"],
    C: Float[Array, "batch length groups state"],
    chunk_size: int,
    *,
    D: Float[Array, "heads"] | Float[Array, "heads head_dim"] | None = None,
    z: Float[Array, "batch length heads head_dim"] | None = None,
    dt_bias: Float[Array, " heads"] | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_states: Float[Array, "batch heads head_dim state"] | None = None,
    seq_idx: Integer[Array, "batch length"] | None = None,
    cu_seqlens: Integer[Array, " sequences_plus_one"] | None = None,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    implementation: str | Sequence[str] | None = None,
    block_sizes=None,
    sequence_axes: str | Sequence[str] | None = None,
):
    """The Mamba-2 scan with mamba_ssm's arguments, layouts and return order:
    y [batch, length, heads, head_dim] in x's dtype, then final_states [batch, heads,
    head_dim, state] (fp32) when `return_final_states`, then varlen_states
    [num_sequences, heads, head_dim, state] (fp32) when `return_varlen_states`.

    x [b, l, h, p]; dt [b, l, h]; A [h]; B, C [b, l, g, n] (h a multiple of g); D [h] or
    [h, p]; z [b, l, h, p]; dt_bias [h]. dt is dt + dt_bias, through softplus when
    `dt_softplus`, clamped to `dt_limit` when that is not (0, inf). initial_states
    [b, h, p, n] enters step 0 (the first sequence of each row).
    seq_idx [b, l] (int): no state crosses a step where it changes. cu_seqlens
    [num_sequences + 1] (int, batch 1): the packed sequences' boundaries; it gives
    varlen_states and, where seq_idx is not given, the sequences themselves (mamba_ssm
    uses it for varlen_states only and resets on seq_idx alone).
    implementation, block_sizes, sequence_axes: as chunk_ssd's (the scan's backend,
    block sizes, and inside a shard_map the manual axes splitting the sequence). Where
    the fused Triton route fails while tracing and more than one implementation may run
    (a sequence, or None), the failure is logged and chunk_ssd's selection takes the
    call with the elementwise work around it; one name raises the route's own error.
    (A failure in the compiler, after tracing, reaches the caller, as chunk_ssd's do.)
    Differentiable in x, dt, A, B, C, D, z, dt_bias and initial_states (varlen_states
    included, which mamba_ssm's backward refuses).
    """
    ref.validate_mamba_chunk_scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                                  dt_limit=dt_limit, initial_states=initial_states,
                                  seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                                  return_varlen_states=return_varlen_states)
    sequence_axes = sharding.sequence_axes_in_context(sequence_axes)
    if return_varlen_states and sequence_axes:
        raise NotImplementedError(
            "mamba_chunk_scan: return_varlen_states with sequence_axes (cu_seqlens are "
            "positions in the whole sequence, each device holds a part); call it under jit "
            "on the sharded arrays instead")
    if seq_idx is None and cu_seqlens is not None:
        if sequence_axes:
            raise ValueError("mamba_chunk_scan: with sequence_axes, pass seq_idx (each "
                             "device's part of it); cu_seqlens name whole-sequence "
                             "positions")
        seq_idx = ref.seq_idx_from_cu_seqlens(cu_seqlens, x.shape[1])
    dtp = ref.process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [b, l, h], fp32 or wider
    a = A.astype(dtp.dtype)[None, None] * dtp
    if seq_idx is not None:
        a = jnp.where(_sequence_starts(seq_idx, sequence_axes)[..., None], -jnp.inf, a)
    bsz, _, h, p = x.shape
    s0 = (jnp.zeros((bsz, h, p, B.shape[3]), _F32) if initial_states is None
          else initial_states)
    composition = functools.partial(_composition, chunk_size=chunk_size,
                                    implementation=implementation, block_sizes=block_sizes,
                                    sequence_axes=sequence_axes)
    out = None
    if fused.eligible(implementation, chunk_size, (x, dtp, a, B, C, D, z, initial_states),
                      block_sizes):
        skip = None if D is None else jnp.broadcast_to(
            (D[:, None] if D.ndim == 1 else D).astype(_F32), (h, p))
        # softplus, or a clamp from 0 or above, leaves no dt < 0 (NaN stays NaN either way)
        nonnegative = dt_softplus or (ref.clamps(dt_limit) and float(dt_limit[0]) >= 0)
        fused_forward = functools.partial(
            fused.scan, chunk_size=chunk_size, dt_nonnegative=nonnegative,
            block_sizes=block_sizes, sequence_axes=sequence_axes)
        try:
            # The fused kernels' values; differentiated, the composition's forward and
            # backward (fused.py says why).
            y, final = autodiff.values_from(fused_forward, composition)(
                x, dtp.astype(_F32), a.astype(_F32), B, C, s0.astype(_F32), skip, z)
            out = [y]
        except Exception as error:  # noqa: BLE001 - the composition is the fallback
            if isinstance(implementation, str):
                raise  # one backend named: its own error
            _LOG.warning("mamba_chunk_scan: the fused pallas_triton route failed while "
                         "tracing (%s: %s); taking chunk_ssd with the elementwise work "
                         "around it", type(error).__name__, error)
    if out is None:
        y, final = composition(x, dtp, a, B, C, initial_states, D, z)
        out = [y]
    if return_final_states:
        out.append(final)
    if return_varlen_states:
        out.append(varlen.varlen_states(_times_dt(x, dtp), a, B, s0, cu_seqlens,
                                        chunk_size))
    return out[0] if len(out) == 1 else tuple(out)
