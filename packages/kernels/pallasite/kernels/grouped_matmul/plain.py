"""The plain-JAX grouped projection: what runs where the custom_vjp cannot.

The backends (ops.project) differentiate through a hand-written custom_vjp: first-order
reverse mode only. This path is jax.lax.ragged_dot with no custom rules, so JAX
differentiates it in forward mode and to any order; api.py sends it
- forward-mode and higher-order differentiation (pallasite.kernels.autodiff), and
- float64 compute under x64, which the kernels refuse and which sums in float64 here
  (the XLA backend's contract sums in fp32).
Operands are cast to `compute`, products summed in fp32 (float64 for float64 compute)
and rounded once; rows past the total are zero. Its first-order gradients are JAX's
transposes of the same products (the contract's up to the order of the roundings).

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


def accumulation(compute) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(compute) == np.float64 else np.dtype(np.float32)


def project(
    x: Float[Array, "m k"],
    kernel: Float[Array, "g k n"],
    group_sizes: Int[Array, "g"],
    compute,
) -> Float[Array, "m n"]:
    """[m, n] in `compute`; see the module docstring."""
    acc = accumulation(compute)
    xc, kc = x.astype(compute), kernel.astype(compute)
    finite = jnp.isfinite(kc)
    out = jax.lax.ragged_dot(xc, jnp.where(finite, kc, 0), group_sizes,
                             preferred_element_type=acc)
    # [m, n]: the row's group has a non-finite weight in that column (a ragged product of
    # finite flags, so nothing non-finite reaches another group's rows).
    poisoned = jax.lax.ragged_dot(
        jnp.ones((x.shape[0], 1), jnp.float32),
        (~finite.all(axis=1, keepdims=True)).astype(jnp.float32),
        group_sizes, preferred_element_type=jnp.float32) > 0
    out = jnp.where(poisoned, jnp.nan, out)
    valid = jnp.arange(x.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes, dtype=jnp.int32)
    return jnp.where(valid[:, None], out, 0).astype(compute)
