"""Argument checks the oracles share: each error names the argument and shows what came."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def shape_of(t) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def need_shape(name: str, t, shape: tuple[int, ...], layout: str) -> None:
    """ValueError naming `name` unless t has `shape` (`layout` names its axes)."""
    if shape_of(t) != shape:
        raise ValueError(f"{name} must be {layout} = {shape}; got {shape_of(t)}")


def check_floating_arrays(**arrays) -> None:
    """TypeError naming the argument unless each (not None) is a floating array."""
    for name, t in arrays.items():
        if t is None:
            continue
        if not hasattr(t, "shape") or not hasattr(t, "dtype"):
            raise TypeError(f"{name} must be an array; got {type(t).__name__}")
        if not jnp.issubdtype(t.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating; got {t.dtype}")


def check_cu_seqlens(cu_seqlens, batch: int, length: int, first: str) -> int:
    """cu_seqlens [num_sequences + 1] (int) packing sequences into one row of `length`
    steps: the row count `batch` must be 1 (`first` names the array that shows it), and
    concrete values must start at 0, never decrease and end at the length. Returns the
    number of sequences."""
    if not hasattr(cu_seqlens, "dtype") or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise TypeError(f"cu_seqlens must be an integer array; got "
                        f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be [num_sequences + 1] with at least one "
                         f"sequence; got shape {shape_of(cu_seqlens)}")
    if batch != 1:
        raise ValueError(f"cu_seqlens packs sequences into one row: batch must be 1; got "
                         f"{first}")
    if not isinstance(cu_seqlens, jax.core.Tracer):
        v = np.asarray(cu_seqlens).astype(np.int64)
        if v[0] != 0 or v[-1] != length or (np.diff(v) < 0).any():
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the "
                             f"length {length}; got {v.tolist()}")
    return int(cu_seqlens.shape[0]) - 1
