"""The whole expert MLP of a mixture-of-experts layer, group by group: the definition.

For the rows of group i (x sorted by group, group_sizes[i] rows each; with group_offset,
the kernels hold groups [offset, offset + g) of the G in group_sizes):

    pre = x_c W_c[i]                  gate_up_kernel[i] is [k, 2f]: gate | up
    h   = act(pre[:, :f]) * pre[:, f:]   rounded once to compute
    y   = (h W_down_c[i]) * row_weights  rounded once to compute

x_c and W_c are the operands cast to `compute`; the sums, the activation and the row
weights are in fp32 (float64 under x64 with a float64 input). act is silu ("swiglu") or
the tanh-approximate GELU ("geglu"). Rows of no local group (past sum(group_sizes), or
of other experts) are zero. One dense masked product per group: small shapes only,
independent of ragged_dot, of grouped_projection and of every kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallasite.reference.grouped_projection import (Dtype, accumulation_dtype,
                                                    validate_grouped_projection)

__all__ = ["ACTIVATIONS", "activate", "grouped_mlp_reference", "validate_grouped_mlp"]

_HIGHEST = jax.lax.Precision.HIGHEST

ACTIVATIONS = {
    "swiglu": jax.nn.silu,
    "geglu": lambda t: jax.nn.gelu(t, approximate=True),
}


def activate(pre, activation: str):
    """act(gate) * up of a [..., 2f] pre-activation (gate first), in pre's dtype."""
    f = pre.shape[-1] // 2
    return ACTIVATIONS[activation](pre[..., :f]) * pre[..., f:]


def validate_grouped_mlp(x, gate_up_kernel, down_kernel, group_sizes, compute, *,
                         row_weights=None, activation="swiglu", group_offset=None) -> None:
    """ValueError/TypeError naming the argument (grouped_projection's checks for both
    products, then the MLP's own)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: one of {tuple(ACTIVATIONS)}")
    validate_grouped_projection(x, gate_up_kernel, group_sizes, compute,
                                group_offset=group_offset)
    g, k, two_f = (int(d) for d in gate_up_kernel.shape)
    if two_f % 2:
        raise ValueError(f"gate_up_kernel must be [g, k, 2f] (gate columns, then up); its "
                         f"last dim is odd: shape {tuple(gate_up_kernel.shape)}")
    if down_kernel.ndim != 3 or tuple(down_kernel.shape[:2]) != (g, two_f // 2):
        raise ValueError(f"down_kernel must be [g, f, n] = [{g}, {two_f // 2}, n] to follow "
                         f"gate_up_kernel {tuple(gate_up_kernel.shape)}; got shape "
                         f"{tuple(down_kernel.shape)}")
    if not jnp.issubdtype(down_kernel.dtype, jnp.floating):
        raise TypeError(f"down_kernel must be floating; got {down_kernel.dtype}")
    if row_weights is not None:
        if tuple(row_weights.shape) != (x.shape[0],):
            raise ValueError(f"row_weights must be [m] = [{x.shape[0]}] (one per row of x); "
                             f"got shape {tuple(row_weights.shape)}")
        if not jnp.issubdtype(row_weights.dtype, jnp.floating):
            raise TypeError(f"row_weights must be floating; got {row_weights.dtype}")


def _local_group_of_rows(m: int, group_sizes, group_offset, g: int):
    """[m] int32: each row's local group in [0, g), or -1 for rows of no local group."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.cumsum(sizes)
    rows = jnp.arange(m, dtype=jnp.int32)
    group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    local = group - (0 if group_offset is None else jnp.asarray(group_offset, jnp.int32))
    return jnp.where((rows < ends[-1]) & (local >= 0) & (local < g), local, -1)


def grouped_mlp_reference(
    x: Float[Array, "m k"],
    gate_up_kernel: Float[Array, "g k two_f"],
    down_kernel: Float[Array, "g f n"],
    group_sizes: Int[Array, "G"],
    compute: Dtype,
    *,
    row_weights: Float[Array, " m"] | None = None,
    activation: str = "swiglu",
    group_offset=None,
) -> Float[Array, "m n"]:
    """[m, n] in compute: the module docstring's definition."""
    validate_grouped_mlp(x, gate_up_kernel, down_kernel, group_sizes, compute,
                         row_weights=row_weights, activation=activation,
                         group_offset=group_offset)
    compute = np.dtype(compute)
    wide = accumulation_dtype(x.dtype, gate_up_kernel.dtype, down_kernel.dtype,
                              *(() if row_weights is None else (row_weights.dtype,)))
    g, m = gate_up_kernel.shape[0], x.shape[0]
    group = _local_group_of_rows(m, group_sizes, group_offset, g)
    xc = x.astype(compute)
    pre = jnp.zeros((m, gate_up_kernel.shape[2]), wide)
    for i in range(g):
        dense = jnp.dot(xc, gate_up_kernel[i].astype(compute), precision=_HIGHEST,
                        preferred_element_type=wide)
        pre = jnp.where((group == i)[:, None], dense, pre)
    h = activate(pre, activation).astype(compute)
    y = jnp.zeros((m, down_kernel.shape[2]), wide)
    for i in range(g):
        dense = jnp.dot(h, down_kernel[i].astype(compute), precision=_HIGHEST,
                        preferred_element_type=wide)
        y = jnp.where((group == i)[:, None], dense, y)
    if row_weights is not None:
        y = y * row_weights.astype(wide)[:, None]
    return jnp.where((group >= 0)[:, None], y, 0).astype(compute)
