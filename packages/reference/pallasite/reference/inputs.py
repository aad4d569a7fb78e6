"""Seeded input generators shared by the tests and the benchmark.

Same key, same inputs, on every machine: the benchmark's error column and a failing test
can be reproduced from the seed alone. Nothing drawn here is zero (normal draws and
softplus/exp of them), so an unwritten output row or a dropped term shows up as an error
instead of hiding behind a zero input.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = [
    "random_group_sizes",
    "skewed_group_sizes",
    "one_group_sizes",
    "grouped_projection_inputs",
    "ssd_inputs",
    "ssd_initial_state",
]


def _split(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer split of `total` proportional to `weights` (largest remainder), int32."""
    weights = np.asarray(weights, np.float64)
    share = weights / weights.sum() * total
    sizes = np.floor(share).astype(np.int64)
    short = total - int(sizes.sum())
    if short > 0:
        order = np.argsort(-(share - sizes), kind="stable")
        sizes[order[:short]] += 1
    return sizes.astype(np.int32)


def _total(m: int, total: int | None) -> int:
    total = m if total is None else int(total)
    if not 0 <= total <= m:
        raise ValueError(f"total must be in [0, m={m}]; got {total}")
    return total


def random_group_sizes(
    key: jax.Array,
    m: int,
    g: int,
    *,
    total: int | None = None,
    alpha: float = 4.0,
    empty: Sequence[int] = (),
) -> Int[Array, "g"]:
    """Group sizes from a Dirichlet(alpha) split of `total` (default m) rows, int32.

    As in TARGETS.md: uneven but not degenerate groups (alpha=4.0). Groups listed in
    `empty` get zero rows and the others share the total. Sums to `total` exactly.
    """
    total = _total(m, total)
    weights = np.asarray(jax.random.dirichlet(key, jnp.full((g,), alpha, jnp.float32)))
    weights = np.maximum(weights.astype(np.float64), 1e-12)
    weights[list(empty)] = 0.0
    if weights.sum() == 0:  # every group listed as empty
        if total:
            raise ValueError(f"every group is empty but total={total} rows must be placed")
        return jnp.zeros((g,), jnp.int32)
    return jnp.asarray(_split(weights, total))


def skewed_group_sizes(
    key: jax.Array,
    m: int,
    g: int,
    *,
    hot: int = 0,
    hot_fraction: float = 0.9,
    total: int | None = None,
) -> Int[Array, "g"]:
    """One hot group holding `hot_fraction` of the rows; the rest a Dirichlet split."""
    total = _total(m, total)
    if g == 1:
        return jnp.full((1,), total, jnp.int32)
    hot_rows = int(round(total * hot_fraction))
    sizes = np.array(random_group_sizes(key, total - hot_rows, g, empty=(hot,)))
    sizes[hot] += hot_rows
    return jnp.asarray(sizes)


def one_group_sizes(m: int, g: int, *, index: int = 0, total: int | None = None) -> Int[Array, "g"]:
    """Every row (or `total` of them) in group `index`, the others empty."""
    sizes = np.zeros((g,), np.int32)
    sizes[index] = _total(m, total)
    return jnp.asarray(sizes)


def grouped_projection_inputs(
    key: jax.Array,
    m: int,
    k: int,
    n: int,
    g: int,
    dtype,
    *,
    total: int | None = None,
    alpha: float = 4.0,
) -> tuple[Float[Array, "m k"], Float[Array, "g k n"], Int[Array, "g"]]:
    """(x [m,k], kernel [g,k,n], group_sizes [g] int32) for grouped_projection.

    x ~ N(0, 1); kernel ~ N(0, 1/k) so outputs are O(1) at every k (bf16 tolerances are
    relative, but fp16 would overflow on unscaled products at k=7168).
    """
    kx, kk, kg = jax.random.split(key, 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    kernel = (jax.random.normal(kk, (g, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    return x, kernel, random_group_sizes(kg, m, g, total=total, alpha=alpha)


def ssd_inputs(
    key: jax.Array,
    batch: int,
    length: int,
    heads: int,
    head_dim: int,
    state: int,
    groups: int,
    dtype,
) -> tuple[
    Float[Array, "batch length heads head_dim"],
    Float[Array, "batch length heads"],
    Float[Array, "batch length groups state"],
    Float[Array, "batch length groups state"],
]:
    """(x, a, b, c) in [batch, length, heads, ...] layout, as TARGETS.md draws them.

    dt = softplus(randn - 4) per step and head (mean ~0.02, Mamba-2's dt range),
    A = -exp(uniform[0, 1)) per head, a = A*dt <= 0, x = randn * dt (x arrives scaled by
    dt), B and C ~ N(0, 1) per group. x, b, c are in `dtype`; a in fp32 (float64 when
    dtype is float64), as Mamba keeps dt and A in fp32.
    """
    kx, kdt, ka, kb, kc = jax.random.split(key, 5)
    wide = jnp.float64 if np.dtype(dtype) == np.float64 else jnp.float32
    dt = jax.nn.softplus(jax.random.normal(kdt, (batch, length, heads), wide) - 4.0)
    big_a = -jnp.exp(jax.random.uniform(ka, (heads,), wide))
    x = jax.random.normal(kx, (batch, length, heads, head_dim), wide) * dt[..., None]
    b = jax.random.normal(kb, (batch, length, groups, state), wide)
    c = jax.random.normal(kc, (batch, length, groups, state), wide)
    return x.astype(dtype), (big_a * dt).astype(wide), b.astype(dtype), c.astype(dtype)


def ssd_initial_state(
    key: jax.Array, batch: int, heads: int, head_dim: int, state: int, dtype=jnp.float32
) -> Float[Array, "batch heads head_dim state"]:
    """A random (nonzero) initial state [batch, heads, head_dim, state], fp32 by default."""
    return jax.random.normal(key, (batch, heads, head_dim, state), dtype)
