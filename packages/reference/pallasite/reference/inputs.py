"""Seeded input generators shared by the tests and the benchmark.

Same key, same inputs, on every machine: the benchmark's error column and a failing test
can be reproduced from the seed alone. Nothing drawn here is zero (normal draws and
softplus/exp of them), so an unwritten output row or a dropped term shows up as an error
instead of hiding behind a zero input.

Cheap to compile: every array of an input set comes from ONE threefry draw of a flat
buffer whose length is bucketed (a power of two up to 2^24, then multiples of 2^24), so
nearby shapes share a compiled draw. On this 2-core CPU one jitted threefry normal costs
~0.8 s of compile and separate draws per array cost 2-3 s per SSD input set (a test
suite with a dozen shapes spent most of its time there). The Dirichlet split of the group
sizes uses numpy's PCG64 seeded from the key's data: g numbers, no compile, and just as
deterministic.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = [
    "random_group_sizes",
    "skewed_group_sizes",
    "zipf_group_sizes",
    "aligned_group_sizes",
    "one_group_sizes",
    "grouped_projection_inputs",
    "ssd_inputs",
    "ssd_initial_state",
    "gated_delta_inputs",
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


def _bucket(size: int) -> int:
    if size <= 1 << 24:
        return max(1 << 10, 1 << (size - 1).bit_length())
    return -(-size // (1 << 24)) * (1 << 24)


@functools.partial(jax.jit, static_argnums=1)
def _flat_normal(key, size):
    return jax.random.normal(key, (size,), jnp.float32)


def _normals(key: jax.Array, *shapes: tuple[int, ...]) -> list[Array]:
    """fp32 N(0, 1) arrays of `shapes`, all cut from one bucketed flat draw."""
    sizes = [int(np.prod(shape)) for shape in shapes]
    flat = _flat_normal(key, _bucket(sum(sizes)))
    offsets = np.cumsum([0] + sizes)
    return [flat[o:o + n].reshape(shape) for o, n, shape in zip(offsets, sizes, shapes)]


def _dirichlet(key: jax.Array, g: int, alpha: float) -> np.ndarray:
    seed = np.asarray(jax.random.key_data(key)).ravel().tolist()
    return np.random.default_rng(seed).dirichlet(np.full((g,), alpha))


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

    As in docs/targets.md: uneven but not degenerate groups (alpha=4.0). Groups listed in
    `empty` get zero rows and the others share the total. Sums to `total` exactly.
    """
    total = _total(m, total)
    weights = np.asarray(_dirichlet(key, g, float(alpha)))
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


def zipf_group_sizes(
    key: jax.Array, m: int, g: int, *, exponent: float = 1.0, total: int | None = None,
) -> Int[Array, "g"]:
    """Rows split by Zipf's law: the group of rank r gets a share proportional to
    r^-exponent, ranks shuffled over the groups by `key` (a router's long tail: at g = 256
    and exponent 1 the largest group holds about 16% of the rows, the median group 0.13%)."""
    total = _total(m, total)
    seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
    ranks = np.random.default_rng(seed).permutation(g) + 1
    return jnp.asarray(_split(ranks.astype(np.float64) ** -float(exponent), total))


def aligned_group_sizes(key: jax.Array, m: int, g: int, *, align: int = 128,
                        alpha: float = 4.0) -> Int[Array, "g"]:
    """The Dirichlet(alpha) split of random_group_sizes in whole multiples of `align`
    rows (m must be one): every group starts on an `align`-row boundary, as fp8 grouped
    GEMMs that need aligned groups (torch._scaled_grouped_mm's peers) are measured."""
    if m % align:
        raise ValueError(f"m={m} must be a multiple of align={align}")
    weights = np.maximum(np.asarray(_dirichlet(key, g, float(alpha)), np.float64), 1e-12)
    return jnp.asarray(_split(weights, m // align) * align)


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
    kd, kg = jax.random.split(key)
    x, kernel = _normals(kd, (m, k), (g, k, n))
    x, kernel = x.astype(dtype), (kernel * (1.0 / np.sqrt(k))).astype(dtype)
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
    """(x, a, b, c) in [batch, length, heads, ...] layout, as docs/targets.md draws them.

    dt = softplus(randn - 4) per step and head (mean ~0.02, Mamba-2's dt range),
    A = -exp(uniform[0, 1)) per head (the uniform is Phi(randn), from the same draw),
    a = A*dt <= 0, x = randn * dt (x arrives scaled by dt), B and C ~ N(0, 1) per group. x, b, c are in `dtype`; a in fp32 (float64 when
    dtype is float64), as Mamba keeps dt and A in fp32.
    """
    shapes = ((batch, length, heads, head_dim), (batch, length, heads), (heads,),
              (batch, length, groups, state), (batch, length, groups, state))
    return _ssd_finish(*_normals(key, *shapes), np.dtype(dtype))


@functools.partial(jax.jit, static_argnums=5)
def _ssd_finish(zx, zdt, za, zb, zc, dtype):
    wide = jnp.float64 if dtype == np.float64 else jnp.float32
    dt = jax.nn.softplus(zdt.astype(wide) - 4.0)
    big_a = -jnp.exp(jax.scipy.special.ndtr(za.astype(wide)))
    x = zx.astype(wide) * dt[..., None]
    return x.astype(dtype), (big_a * dt).astype(wide), zb.astype(dtype), zc.astype(dtype)


def ssd_initial_state(
    key: jax.Array, batch: int, heads: int, head_dim: int, state: int, dtype=jnp.float32
) -> Float[Array, "batch heads head_dim state"]:
    """A random (nonzero) initial state [batch, heads, head_dim, state], fp32 by default."""
    (state0,) = _normals(key, (batch, heads, head_dim, state))
    return state0.astype(dtype)


def gated_delta_inputs(
    key: jax.Array, state_key: jax.Array, batch: int, length: int, key_heads: int,
    value_heads: int, key_dim: int, value_dim: int, dtype, *, states: int | None = None,
) -> dict[str, Array]:
    """chunk_gated_delta_rule's arrays as a Gated DeltaNet layer has them: q ~ N(0, 1), k
    L2-normalised, v ~ N(0, 1) in `dtype` ([batch, length, heads, dim]); g =
    logsigmoid(N(4, 1)) (decays near 1, as trained layers have them) and beta =
    sigmoid(N(0, 1)) in fp32 ([batch, length, value_heads]); from `state_key`, a random
    fp32 initial state [states (default batch), value_heads, key_dim, value_dim] x 0.1."""
    ks = jax.random.split(key, 5)
    keys_shape = (batch, length, key_heads, key_dim)
    k = jax.random.normal(ks[1], keys_shape)
    return {"q": jax.random.normal(ks[0], keys_shape).astype(dtype),
            "k": (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype),
            "v": jax.random.normal(ks[2], (batch, length, value_heads, value_dim)).astype(dtype),
            "g": jax.nn.log_sigmoid(jax.random.normal(ks[3], (batch, length, value_heads)) + 4.0),
            "beta": jax.nn.sigmoid(jax.random.normal(ks[4], (batch, length, value_heads))),
            "initial_state": 0.1 * jax.random.normal(
                state_key, (batch if states is None else states, value_heads, key_dim,
                            value_dim))}
