"""The whole Mamba-2 scan (mamba_ssm's `mamba_chunk_scan_combined`), one step at a time.

Per batch row, step t, head h (group g = h // (heads // groups)):

    dt_t  = dt[t, h] (+ dt_bias[h]), through softplus when asked, clamped to dt_limit
    S     = 0                                  where seq_idx changes at t (a new sequence)
    S     = exp(A[h] dt_t) S + dt_t x[t, h] B[t, g]^T                    [p, n]
    y_t   = S C[t, g] + D[h] x[t, h]                                      (D when given)
    y_t   = y_t * silu(z[t, h])                                           (z when given)

The state enters step 0 as initial_state (the first sequence's), or zero. With
cu_seqlens (batch 1) the sequences are the runs [cu_seqlens[s], cu_seqlens[s + 1]) and
`varlen_states[s]` is the state after the last step of sequence s (zero for an empty
one). Where seq_idx is not given and cu_seqlens is, seq_idx is the run each step falls in.

This is the definition the kernels' composition (pallasite.kernels.mamba_chunk_scan) is
held to: a lax.scan over steps with an explicit zero at every sequence start, in fp32, or
float64 where x64 is on and an input is float64. It keeps every step's state to read the
sequences' final states, so it is for test sizes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer

from pallasite.reference import ssd_decode
from pallasite.reference.checks import check_cu_seqlens, check_floating_arrays
from pallasite.reference.checks import need_shape as _need
from pallasite.reference.checks import shape_of as _shape

__all__ = ["mamba_chunk_scan_reference", "validate_mamba_chunk_scan", "process_dt",
           "seq_idx_from_cu_seqlens"]

_HIGHEST = jax.lax.Precision.HIGHEST


def validate_mamba_chunk_scan(x, dt, A, B, C, chunk_size, *, D=None, z=None, dt_bias=None,
                              dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None,
                              cu_seqlens=None, return_varlen_states=False) -> None:
    """ValueError/TypeError naming the argument for what the scan does not take. Concrete
    cu_seqlens are checked to start at 0, not decrease and end at the length."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(f"chunk_size must be an int; got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    check_floating_arrays(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                          initial_states=initial_states)
    if x.ndim != 4:
        raise ValueError(f"x must be [batch, length, heads, head_dim]; got shape {_shape(x)}")
    b, length, h, p = _shape(x)
    _need("dt", dt, (b, length, h), "[batch, length, heads]")
    _need("A", A, (h,), "[heads]")
    if B.ndim != 4:
        raise ValueError(f"B must be [batch, length, groups, state_size]; got shape "
                         f"{_shape(B)}")
    g, n = _shape(B)[2:]
    _need("B", B, (b, length, g, n), "[batch, length, groups, state_size]")
    _need("C", C, (b, length, g, n), "[batch, length, groups, state_size]")
    if g == 0 or h % g:
        raise ValueError(f"heads ({h}) must be a multiple of B's groups ({g})")
    if D is not None and _shape(D) not in ((h,), (h, p)):
        raise ValueError(f"D must be [heads] or [heads, head_dim] = {(h,)} or {(h, p)}; "
                         f"got {_shape(D)}")
    if z is not None:
        _need("z", z, (b, length, h, p), "[batch, length, heads, head_dim]")
    if dt_bias is not None:
        _need("dt_bias", dt_bias, (h,), "[heads]")
    if initial_states is not None:
        _need("initial_states", initial_states, (b, h, p, n),
              "[batch, heads, head_dim, state_size]")
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise TypeError(f"dt_limit must be a pair of numbers (min, max); got {dt_limit!r}")
    if not lo <= hi:
        raise ValueError(f"dt_limit must be (min, max) with min <= max; got {dt_limit!r}")
    for name, t in (("seq_idx", seq_idx), ("cu_seqlens", cu_seqlens)):
        if t is not None and (not hasattr(t, "dtype") or not jnp.issubdtype(t.dtype,
                                                                           jnp.integer)):
            raise TypeError(f"{name} must be an integer array; got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    if seq_idx is not None:
        _need("seq_idx", seq_idx, (b, length), "[batch, length]")
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states=True needs cu_seqlens (the sequences' "
                         "boundaries)")
    if cu_seqlens is None:
        return
    check_cu_seqlens(cu_seqlens, b, length, f"x of shape {_shape(x)}")


def clamps(dt_limit) -> bool:
    """Whether process_dt clamps dt to dt_limit: only when it is not (0, inf), as
    mamba_ssm."""
    return tuple(float(v) for v in dt_limit) != (0.0, math.inf)


def process_dt(dt, dt_bias, dt_softplus: bool, dt_limit):
    """dt in fp32 (or wider) with its bias, softplus (the identity above 20, as mamba_ssm)
    and clamp to dt_limit (only when it is not (0, inf), as mamba_ssm)."""
    dt = ssd_decode.process_dt(dt, dt_bias, dt_softplus)
    if clamps(dt_limit):
        dt = jnp.clip(dt, *(float(v) for v in dt_limit))
    return dt


def seq_idx_from_cu_seqlens(cu_seqlens, length: int) -> Integer[Array, "1 length"]:
    """[1, length] int32: the sequence each step belongs to."""
    steps = jnp.arange(length, dtype=jnp.int32)
    ends = cu_seqlens[1:].astype(jnp.int32)
    return jnp.searchsorted(ends, steps, side="right").astype(jnp.int32)[None]


def mamba_chunk_scan_reference(
    x: Float[Array, "b l h p"],
    dt: Float[Array, "b l h"],
    A: Float[Array, " h"],
    B: Float[Array, "b l g n"],
    C: Float[Array, "b l g n"],
    chunk_size: int,
    *,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus: bool = False,
    dt_limit=(0.0, math.inf),
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
):
    """mamba_ssm's outputs in its order: y, then final_states [b, h, p, n] when asked,
    then varlen_states [num_sequences, h, p, n] when asked (states fp32 or wider, y in x's
    dtype). chunk_size is checked and otherwise unused: the definition has no chunks."""
    validate_mamba_chunk_scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                              dt_limit=dt_limit, initial_states=initial_states,
                              seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                              return_varlen_states=return_varlen_states)
    wide = jnp.result_type(jnp.float32, *(t.dtype for t in (x, dt, A, B, C, D, z, dt_bias,
                                                              initial_states) if t is not None))
    bsz, length, h, p = x.shape
    g, n = B.shape[2:]
    if seq_idx is None and cu_seqlens is not None:
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, length)
    w = lambda t: None if t is None else t.astype(wide)  # noqa: E731
    dtp = process_dt(w(dt), w(dt_bias), dt_softplus, dt_limit)  # [b, l, h]
    if seq_idx is None:
        starts = jnp.zeros((bsz, length), bool)
    else:
        starts = jnp.concatenate([jnp.zeros((bsz, 1), bool),
                                  seq_idx[:, 1:] != seq_idx[:, :-1]], axis=1)
    state0 = (jnp.zeros((bsz, h, p, n), wide) if initial_states is None
              else initial_states.astype(wide))
    rep = h // g
    Af = A.astype(wide)

    def step(state, inputs):
        x_t, dt_t, b_t, c_t, start = inputs  # [b,h,p], [b,h], [b,g,n], [b,g,n], [b]
        state = jnp.where(start[:, None, None, None], 0.0, state)
        b_h = jnp.repeat(b_t, rep, axis=1)
        c_h = jnp.repeat(c_t, rep, axis=1)
        state = (jnp.exp(Af[None] * dt_t)[..., None, None] * state
                 + (dt_t[..., None] * x_t)[..., None] * b_h[:, :, None, :])
        y_t = jnp.einsum("bhpn,bhn->bhp", state, c_h, precision=_HIGHEST)
        return state, (y_t, state)

    seq = tuple(jnp.moveaxis(t, 1, 0) for t in (w(x), dtp, w(B), w(C), starts))
    final, (ys, states) = jax.lax.scan(step, state0, seq)
    y = ssd_decode.skip_and_gate(jnp.moveaxis(ys, 0, 1), w(x), w(D), w(z))  # [b, l, h, p]
    out = [y.astype(x.dtype)]
    if return_final_states:
        out.append(final)
    if return_varlen_states:
        ends = cu_seqlens.astype(jnp.int32)
        last = jnp.clip(ends[1:] - 1, 0, length - 1)
        varlen = states[last, 0]  # [s, h, p, n]
        out.append(jnp.where((ends[1:] > ends[:-1])[:, None, None, None], varlen, 0.0))
    return out[0] if len(out) == 1 else tuple(out)
