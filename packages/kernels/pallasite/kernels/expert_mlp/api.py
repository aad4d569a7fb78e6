"""`grouped_mlp`: the expert MLP as grouped_projection calls (the composition path).

The definition is pallasite.reference.grouped_mlp's: the gate-up product's fp32 sums
go through the activation before h is rounded, once, to compute; the down product's fp32
sums are scaled by the row weights before y is rounded once. Here the two products are
grouped_projection calls with an fp32 output, on compute-rounded operands:
`grouped_projection(x_c, W_c, ..., compute=float32)` multiplies exactly the values a
compute-dtype product would (a bf16 or fp16 value is exact in fp32 and TF32) and returns
the fp32 sums. So every backend, group_offset, expert parallelism and sharding route of
grouped_projection serves grouped_mlp, and JAX differentiates the composition: each
product by grouped_projection's backward, the activation and the row weights by
autodiff.

What this path costs (and what fused kernels would save): the products read fp32
operands, and fp32 tensor-core rates are half of bf16's or less; the `[m, 2f]`
pre-activation is written and read back in fp32; the backward keeps it and recomputes
nothing. recipe="fp8" runs both products through grouped_projection's fp8 recipe (h
quantized by the down product's own quantizer, not by the gate-up epilogue).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallasite.kernels.grouped_matmul.api import grouped_projection
from pallasite.reference.grouped_mlp import activate, validate_grouped_mlp
from pallasite.reference.grouped_projection import Dtype

_F32 = jnp.float32


def grouped_mlp(
    x: Float[Array, "m k"],
    gate_up_kernel: Float[Array, "g k two_f"],
    down_kernel: Float[Array, "g f n"],
    group_sizes: Int[Array, "G"],
    compute: Dtype,
    interpret_on_cpu: bool = False,
    *,
    row_weights: Float[Array, " m"] | None = None,
    activation: str = "swiglu",
    group_offset=None,
    implementation: str | Sequence[str] | None = None,
    block_sizes=None,
    recipe: str | None = None,
) -> Float[Array, "m n"]:
    """`[m, n]` in compute: `h = act(x W_gate) * (x W_up)` per group, rounded once to
    compute, then `y = (h W_down) * row_weights`, rounded once.

    x [m, k] sorted by group; gate_up_kernel [g, k, 2f] (the first f columns the gate,
    the last f the up); down_kernel [g, f, n]; group_sizes [G] int32 (G = g, or with
    group_offset the global count); row_weights [m] (the router's weight of each routed
    row) or None. activation: "swiglu" (silu) or "geglu" (tanh-approximate GELU). Rows
    past sum(group_sizes), and of other experts with a group_offset, are zero.
    interpret_on_cpu, implementation, block_sizes, recipe: grouped_projection's, for both
    products.
    Differentiable in x, both kernels and row_weights.
    """
    validate_grouped_mlp(x, gate_up_kernel, down_kernel, group_sizes, compute,
                         row_weights=row_weights, activation=activation,
                         group_offset=group_offset)
    compute = np.dtype(compute)
    product = dict(group_offset=group_offset, implementation=implementation,
                   block_sizes=block_sizes, recipe=recipe)
    if recipe is None:  # the compute-dtype operands, multiplied with fp32 sums
        x, gate_up_kernel, down_kernel = (t.astype(compute) for t in (x, gate_up_kernel,
                                                                      down_kernel))
    pre = grouped_projection(x, gate_up_kernel, group_sizes, _F32, interpret_on_cpu, **product)
    h = activate(pre, activation).astype(compute)
    y = grouped_projection(h, down_kernel, group_sizes, _F32, interpret_on_cpu, **product)
    if row_weights is not None:
        y = y * row_weights.astype(_F32)[:, None]
    return y.astype(compute)
