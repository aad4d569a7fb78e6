"""`grouped_mlp`: the expert MLP as grouped_projection calls (the composition path).

The definition is pallasite.reference.grouped_mlp's: the gate-up product's fp32 sums go
through the activation before h is rounded once to compute, and the down product's
fp32 sums are scaled by the row weights before y is rounded once. Here the two
products are grouped_projection calls in compute, so every backend (Mosaic GPU's
16-bit kernels included), group_offset, expert parallelism and sharding route of
grouped_projection serves grouped_mlp. JAX differentiates the composition: each product
by grouped_projection's backward, the activation and the row weights by autodiff.

The composition rounds twice more than the definition: the `[m, 2f]` pre-activation to
compute before the activation, and y before the row weights. With fp32 compute that is
no rounding at all; with bf16 it is within the bf16 parity tolerance
(docs/grouped_mlp.md). The fused kernels, which are not built yet, keep the sums in fp32
through both epilogues. This path also writes and reads back the pre-activation, and
the backward keeps it.

recipe="fp8" runs both products through grouped_projection's fp8 recipe (h quantized by
the down product's own quantizer, not by the gate-up epilogue).

The fused gate-up (expert_mlp.ops: act(gate) * up in the kernel's epilogue, h rounded
once, the pre-activation recomputed in the backward), and on Triton the down product
with the row weights in its epilogue (y rounded once; dh and d row_weights from one
kernel), run where a caller names one of the fused backends alone
(implementation="pallas_mosaic_gpu" or "pallas_triton") and nothing asks for more than
it does (_fused_refusal): 16-bit compute, no recipe or block sizes,
first-order reverse mode at most, operands local (unsharded, or a shard_map's). The
default (implementation=None) stays the composition until the fused kernels are
measured on a GPU against it (docs/grouped_mlp.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallasite.kernels import autodiff, sharding
from pallasite.kernels.expert_mlp import ops
from pallasite.kernels.grouped_matmul.api import backend_refusal, grouped_projection
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
    """`[m, n]` in compute: `h = act(x W_gate) * (x W_up)` per group, then
    `y = (h W_down) * row_weights`, each rounded to compute (this composition also
    rounds the pre-activation and y before the row weights: the module docstring).

    x [m, k] sorted by group; gate_up_kernel [g, k, 2f] (the first f columns the gate,
    the last f the up); down_kernel [g, f, n]; group_sizes [G] int32 (G = g, or with
    group_offset the global count); row_weights [m] (the router's weight of each routed
    row) or None. activation: "swiglu" (silu) or "geglu" (tanh-approximate GELU). Rows
    past sum(group_sizes), and of other experts with a group_offset, are zero.
    interpret_on_cpu, implementation, block_sizes, recipe: grouped_projection's, for both
    products; "pallas_mosaic_gpu" or "pallas_triton" named alone runs the gate-up fused
    where it can (the module docstring).
    Differentiable in x, both kernels and row_weights.
    """
    validate_grouped_mlp(x, gate_up_kernel, down_kernel, group_sizes, compute,
                         row_weights=row_weights, activation=activation,
                         group_offset=group_offset)
    compute = np.dtype(compute)
    product = dict(group_offset=group_offset, implementation=implementation,
                   block_sizes=block_sizes, recipe=recipe)
    interpret = bool(interpret_on_cpu) and jax.default_backend() == "cpu"
    why = _fused_refusal(implementation, compute, (x, gate_up_kernel, down_kernel),
                         block_sizes, recipe, interpret)
    if why is None:
        h = ops.gate_up_activation(x, gate_up_kernel, group_sizes, compute,
                                   backend=implementation, activation=activation,
                                   group_offset=group_offset, interpret=interpret)
    else:
        pre = grouped_projection(x, gate_up_kernel, group_sizes, compute, interpret_on_cpu,
                                 **product)
        h = activate(pre.astype(_F32), activation).astype(compute)
    if why is None and row_weights is not None and ops.has_down_weighted(implementation):
        return ops.down_weighted(h, down_kernel, group_sizes, row_weights, compute,
                                 backend=implementation, group_offset=group_offset,
                                 interpret=interpret)
    y = grouped_projection(h, down_kernel, group_sizes, compute, interpret_on_cpu, **product)
    if row_weights is None:
        return y
    return (y.astype(_F32) * row_weights.astype(_F32)[:, None]).astype(compute)


def _fused_refusal(implementation, compute, operands, block_sizes, recipe, interpret
                   ) -> str | None:
    """Why the gate-up takes the composition rather than the fused kernel (None: fused)."""
    if not isinstance(implementation, str) or implementation not in ops.FUSED_BACKENDS:
        return f"implementation={implementation!r} names no fused backend alone"
    if recipe is not None or block_sizes is not None:
        return "a recipe or block sizes (the composition's products take them)"
    if np.dtype(compute).itemsize != 2:
        return f"compute={np.dtype(compute).name} (the fused kernels take 16-bit compute)"
    if 0 in operands[0].shape or 0 in operands[1].shape:
        return "a zero-size operand"
    if (why := autodiff.beyond_first_order(*operands)) is not None:
        return why
    mesh = sharding.context_mesh(operands)
    if not mesh.empty and set(mesh.axis_names) - set(mesh.manual_axes):
        return "operands laid out over mesh axes (the fused kernels run on local operands)"
    return backend_refusal(implementation, compute, operands[:2], interpret)
