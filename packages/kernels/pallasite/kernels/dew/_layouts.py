"""What dew's chunked delta-rule pieces share: the pairwise decay of a chunk and the
operand checks, in dew's layouts ([B, H, NC, C, width] per chunk, [B, H, NC, C] per
step, states [B, H, Dk, Dv])."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def chunk_decay(hi, lo, *, strict: bool = False):
    """exp((hi_t - hi_j) + (lo_t - lo_j)) for j <= t (j < t when `strict`), else 0, for
    [..., C] log decays cumulated within a chunk as a compensated pair (hi + lo): the
    difference of each half is taken before the sum, and the exponent is masked before
    exp so an unused entry cannot overflow."""
    size = hi.shape[-1]
    rows = jnp.arange(size)[:, None]
    cols = jnp.arange(size)[None, :]
    keep = rows > cols if strict else rows >= cols
    diff = (hi[..., :, None] - hi[..., None, :]) + (lo[..., :, None] - lo[..., None, :])
    return jnp.where(keep, jnp.exp(jnp.where(keep, diff, 0.0)), 0.0)


def check_chunked(name: str, array, leading: tuple[int, ...], ndim: int) -> None:
    """ValueError naming `name` unless it has `ndim` dimensions led by `leading`."""
    shape = tuple(array.shape)
    if len(shape) != ndim or shape[:len(leading)] != tuple(leading):
        raise ValueError(f"{name} must be {ndim}-d with leading dimensions {tuple(leading)} "
                         f"([batch, heads, chunks, ...] as dew lays it out); got shape {shape}")


def f32(*arrays):
    return tuple(jnp.asarray(a, F32) for a in arrays)


def unpaired(key, value) -> str | None:
    """Why [B, H, NC, C, Dk] keys and [B, H, NC, C, Dv] values do not describe the same
    chunks, or None: what every piece's `refusal` comes down to here, where the
    plain-JAX forms take any width and dtype that dew's kernels bound."""
    if key.ndim != 5 or value.ndim != 5 or key.shape[:4] != value.shape[:4]:
        return (f"keys {tuple(key.shape)} and values {tuple(value.shape)} are not "
                "[batch, heads, chunks, chunk, width] arrays of the same chunks")
    return None
