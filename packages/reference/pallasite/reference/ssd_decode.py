"""The Mamba-2 decode step (mamba_ssm's `selective_state_update`): one token per batch
row advances its slot of a state cache and reads its output.

Per batch row i, slot s = state_batch_indices[i] (i when None), head h, group
g = h // (heads // groups):

    dt    = softplus(dt[i, h] + dt_bias[h])   (the bias and the softplus when given)
    S     = exp(A[h] dt) S[s, h] + dt x[i, h] B[i, g]^T          [p, n]
    y     = S C[i, g] + D[h] x[i, h]                              [p]
    y     = y * silu(z[i, h])                                     (when z is given)

The state is stored in its own dtype (fp32 or bf16); the step computes in fp32 and
rounds y to x's dtype. This is the chunked scan's recurrence (pallasite.reference.ssd)
with x scaled by dt and a = A dt, one step at a time: a prefill by the scan followed by
steps equals one scan over the whole sequence.

Slots: a batch row whose index is outside [0, slots) is a padding row (mamba_ssm's
pad_slot_id): no slot is read or written for it and its y is zero. Every slot no row
names keeps its bits. Two rows naming the same slot are the caller's error; which of
their writes lands is unspecified (as in mamba_ssm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer

from pallasite.reference import slots as slots_
from pallasite.reference.checks import check_floating_arrays, need_shape, shape_of

__all__ = ["selective_state_update_reference", "validate_selective_state_update",
           "process_dt", "skip_and_gate", "STATE_DTYPES"]

STATE_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


_shape = shape_of


def validate_selective_state_update(state, x, dt, A, B, C, *, D=None, z=None,
                                    dt_bias=None, state_batch_indices=None) -> None:
    """ValueError/TypeError naming the argument for shapes and dtypes the step does not
    take. Concrete slot indices are checked for repeats."""
    check_floating_arrays(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    if state.ndim != 4:
        raise ValueError(f"state must be [slots, heads, head_dim, state_size]; got shape "
                         f"{_shape(state)}")
    if np.dtype(state.dtype) not in STATE_DTYPES:
        raise TypeError(f"state must be float32 or bfloat16; got {state.dtype}")
    slots, h, p, n = _shape(state)
    if x.ndim != 3:
        raise ValueError(f"x must be [batch, heads, head_dim]; got shape {_shape(x)}")
    b = _shape(x)[0]
    need_shape("x", x, (b, h, p), "[batch, heads, head_dim]")
    need_shape("dt", dt, (b, h), "[batch, heads]")
    need_shape("A", A, (h,), "[heads]")
    if B.ndim != 3:
        raise ValueError(f"B must be [batch, groups, state_size]; got shape {_shape(B)}")
    g = _shape(B)[1]
    need_shape("B", B, (b, g, n), "[batch, groups, state_size]")
    need_shape("C", C, (b, g, n), "[batch, groups, state_size]")
    if g == 0 or h % g:
        raise ValueError(f"heads ({h}) must be a multiple of B's groups ({g})")
    if D is not None and _shape(D) not in ((h,), (h, p)):
        raise ValueError(f"D must be [heads] or [heads, head_dim] = {(h,)} or {(h, p)}; got "
                         f"{_shape(D)}")
    if z is not None:
        need_shape("z", z, (b, h, p), "[batch, heads, head_dim]")
    if dt_bias is not None:
        need_shape("dt_bias", dt_bias, (h,), "[heads]")
    slots_.check_slot_indices(state_batch_indices, slots, b)


def process_dt(dt, dt_bias, dt_softplus: bool):
    """dt in fp32 (float64 where it is) with its bias added and, when asked, through
    softplus (above 20 the identity, as mamba_ssm, where log1p(exp(dt)) equals dt in fp32)."""
    dt = dt.astype(jnp.promote_types(dt.dtype, jnp.float32))
    if dt_bias is not None:
        dt = dt + dt_bias.astype(dt.dtype)
    if dt_softplus:
        dt = jnp.where(dt <= 20.0, jnp.log1p(jnp.exp(jnp.minimum(dt, 20.0))), dt)
    return dt


def step(state_rows, x, dt, A, B, C, D, z):
    """One step on the rows' own states (all fp32, dt processed): (y [b, h, p], new
    states [b, h, p, n]). B, C [b, g, n] serve heads // g consecutive heads each."""
    b, h, p = x.shape
    g = B.shape[1]
    per = h // g
    Bh = jnp.repeat(B, per, axis=1)  # [b, h, n]
    Ch = jnp.repeat(C, per, axis=1)
    decay = jnp.exp(A[None, :] * dt)  # [b, h]
    new = (state_rows * decay[:, :, None, None]
           + (dt[:, :, None] * x)[..., None] * Bh[:, :, None, :])
    y = jnp.einsum("bhpn,bhn->bhp", new, Ch, precision=jax.lax.Precision.HIGHEST)
    return skip_and_gate(y, x, D, z), new


def skip_and_gate(y, x, D, z):
    """Mamba-2's output around the scan: y + D x, then y silu(z) (each when given), in
    the operands' one dtype. y, x and z end in [..., h, p]; D is [h] or [h, p]."""
    if D is not None:
        y = y + (D[:, None] if D.ndim == 1 else D) * x
    if z is not None:
        y = y * (z * jax.nn.sigmoid(z))
    return y


def selective_state_update_reference(
    state: Float[Array, "slots h p n"],
    x: Float[Array, "b h p"],
    dt: Float[Array, "b h"],
    A: Float[Array, " h"],
    B: Float[Array, "b g n"],
    C: Float[Array, "b g n"],
    *,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus: bool = False,
    state_batch_indices: Integer[Array, " b"] | None = None,
) -> tuple[Float[Array, "b h p"], Float[Array, "slots h p n"]]:
    """(y [b, h, p] in x's dtype, the whole state cache with the named slots advanced, in
    the state's dtype): the module docstring's step, in fp32."""
    validate_selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                    state_batch_indices=state_batch_indices)
    idx = slots_.slots_of_rows(state_batch_indices, x.shape[0])
    return on_slots(state, x, process_dt(dt, dt_bias, dt_softplus), A, B, C, D, z, idx)


def on_slots(state, x, dt, A, B, C, D, z, slots_of_rows):
    """The step on the cache: the rows' slots gathered, stepped in fp32 and scattered
    back; rows outside [0, slots) read and write nothing and give y = 0. dt processed."""
    f32 = lambda t: None if t is None else t.astype(jnp.float32)  # noqa: E731
    rows, live = slots_.gather(state, slots_of_rows)
    y, new = step(rows, f32(x), dt, f32(A), f32(B), f32(C), f32(D), f32(z))
    y = jnp.where(live[:, None, None], y, 0.0)
    return y.astype(x.dtype), slots_.scatter(state, new, slots_of_rows, live)
