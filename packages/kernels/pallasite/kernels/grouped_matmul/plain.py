"""The plain-JAX grouped projection: what runs where the custom_vjp cannot.

The backends (ops.project) differentiate through a hand-written custom_vjp: first-order
reverse mode only. This path is the XLA backend's ragged product (xla.ragged_product:
jax.lax.ragged_dot_general with no custom rules) run as a bilinear.call, so JAX
differentiates it in forward mode and to any order, and vmaps every derivative (jax.jacfwd,
jax.hessian: ragged_dot alone batches only on leading axes); api.py sends it
- forward-mode and higher-order differentiation (pallasite.kernels.autodiff), and
- float64 compute under x64, which the kernels refuse and which sums in float64 here
  (the XLA backend's contract sums in fp32).
Operands are cast to `compute`, products summed in fp32 (float64 for float64 compute)
and rounded once; rows past the total are zero, and so are the rows of groups outside
the kernel's with a `group_offset` (local experts, group_metadata.local_groups), with
zero gradient. Its first-order gradients are JAX's transposes of the same products (the
contract's up to the order of the roundings).

Non-finite weights stay in their group's rows, as on the XLA backend (xla.py says how).

It is not sharding-aware: under a sharded jit XLA's partitioner lays out ragged_dot.
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from pallasite.kernels.grouped_matmul import xla
from pallasite.kernels.grouped_matmul.group_metadata import local_groups
from pallasite.reference.grouped_projection import Dtype, accumulation_dtype


def project(
    x: Float[Array, "m k"],
    kernel: Float[Array, "g k n"],
    group_sizes: Int[Array, "G"],
    compute: Dtype,
    *,
    group_offset=None,
) -> Float[Array, "m n"]:
    """[m, n] in `compute`; see the module docstring. group_offset: None (kernel holds
    every group) or the index in group_sizes of kernel's first group."""
    sizes, row_start = local_groups(group_sizes, group_offset, kernel.shape[0])
    out = xla.ragged_product(x.astype(compute), kernel.astype(compute), sizes, row_start,
                             accumulate=accumulation_dtype(compute), any_order=True)
    return out.astype(compute)
