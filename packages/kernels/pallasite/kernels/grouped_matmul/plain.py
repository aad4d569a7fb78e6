"""The plain-JAX grouped projection: what runs where the custom_vjp cannot.

The backends (ops.project) differentiate through a hand-written custom_vjp: first-order
reverse mode only. This path is jax.lax.ragged_dot with no custom rules, so JAX
differentiates it in forward mode and to any order; api.py sends it
- forward-mode and higher-order differentiation (pallasite.kernels.autodiff), and
- float64 compute under x64, which the kernels refuse and which sums in float64 here
  (the XLA backend's contract sums in fp32).
Operands are cast to `compute`, products summed in fp32 (float64 for float64 compute)
and rounded once; rows past the total are zero, and so are the rows of groups outside
the kernel's with a `group_offset` (local experts, group_metadata.local_groups: a
leading group of zero weights takes the rows before them, so ragged_dot's groups still
start at row 0), with zero gradient. Its first-order gradients are JAX's transposes of the same products (the
contract's up to the order of the roundings).

Non-finite weights stay in their group's rows: ragged_dot may multiply a group's weights
by the zeroed rows of other groups (0 * inf = NaN everywhere), so the product runs on the
finite part of the weights and every row of a group whose weight column holds a
non-finite value is NaN in that column.

It is not sharding-aware: under a sharded jit XLA's partitioner lays out ragged_dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallasite.kernels.grouped_matmul.group_metadata import local_groups


def accumulation(compute) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(compute) == np.float64 else np.dtype(np.float32)


def project(
    x: Float[Array, "m k"],
    kernel: Float[Array, "g k n"],
    group_sizes: Int[Array, "G"],
    compute,
    *,
    group_offset=None,
) -> Float[Array, "m n"]:
    """[m, n] in `compute`; see the module docstring. group_offset: None (kernel holds
    every group) or the index in group_sizes of kernel's first group."""
    acc = accumulation(compute)
    xc, kc = x.astype(compute), kernel.astype(compute)
    sizes, row_start = local_groups(group_sizes, group_offset, kernel.shape[0])
    finite = jnp.isfinite(kc)
    weights = jnp.where(finite, kc, 0)
    flags = (~finite.all(axis=1, keepdims=True)).astype(jnp.float32)  # [g, 1, n]
    first = jnp.int32(0)
    if row_start is not None:  # the rows before the local groups: one zero-weight group
        first = row_start
        weights = jnp.concatenate([jnp.zeros((1,) + weights.shape[1:], weights.dtype), weights])
        flags = jnp.concatenate([jnp.zeros((1,) + flags.shape[1:], flags.dtype), flags])
        sizes = jnp.concatenate([row_start[None].astype(sizes.dtype), sizes])
    out = jax.lax.ragged_dot(xc, weights, sizes, preferred_element_type=acc)
    # [m, n]: the row's group has a non-finite weight in that column (a ragged product of
    # finite flags, so nothing non-finite reaches another group's rows).
    poisoned = jax.lax.ragged_dot(jnp.ones((x.shape[0], 1), jnp.float32), flags, sizes,
                                  preferred_element_type=jnp.float32) > 0
    out = jnp.where(poisoned, jnp.nan, out)
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)
    valid = (rows >= first) & (rows < jnp.sum(sizes, dtype=jnp.int32))
    return jnp.where(valid[:, None], out, 0).astype(compute)
