"""Which shardings the fused gate-up and down product run on locally: planners for
`pallasite.kernels.sharding.run` (shard_map under Explicit axes, a custom_partitioning
under Auto axes, the local arrays inside a caller's shard_map).

The activation pairs column j of the gate with column j of the up and is not linear in
the sums, so the contraction (k) and the columns (2f) are taken whole. The rows and the
experts stay split as grouped_projection's forward keeps them (grouped_matmul.layouts):
each row shard runs its part of the global groups, each expert shard its own experts
(their h summed over the expert axes, exact: every row has one non-zero term).

The backward (d_pre from the recomputed pre-activation, then dx and dW) keeps the same
split: dx is summed over the expert axes (exact), dW over the row axes (fp32, rounded
once); rows split over the expert axes too (the forward's gather and reduce-scatter)
take the experts whole here.

The fused down product (y = (h W_down) * row_weights, the weights in the epilogue) is
linear in its sums, so its forward keeps every split grouped_projection's does (rows,
experts, the contraction f and the columns n), the row weights laid out with h's rows.
Its backward (dh and d row_weights from one kernel, dW_down from the grouped dkernel)
keeps rows and experts split, as the gate-up's does; f and n are taken whole there.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallasite.kernels import sharding
from pallasite.kernels.grouped_matmul import layouts as grouped
from pallasite.kernels.sharding import Plan

# Shardy rules for the Auto-axes path (factor names): m rows, c the contraction, q the
# kernel's 2f columns, o the result's f columns, e the kernel's experts, G the global
# group sizes.
# A reduction factor may not name a result's dimension: the forward's are those it sums
# or takes whole; the backward's results name every operand factor but o.
FORWARD_RULE = "m c, e c q, G, -> m o"
FORWARD_REDUCTION = ("c", "e", "q")
BACKWARD_RULE = "m c, e c q, G, , m o -> m c, e c q"
BACKWARD_REDUCTION = ("o",)
# The down product: c = f, o = n; its row weights follow m.
DOWN_FORWARD_RULE = "m c, e c o, G, , m -> m o"
DOWN_FORWARD_REDUCTION = ("c", "e")
DOWN_BACKWARD_RULE = "m c, e c q, G, , m, m o -> m c, e c q, m"
DOWN_BACKWARD_REDUCTION = ("o",)


def forward_planner(gate_up: Callable, *, out_dtype, shapes,
                    offset_given: bool) -> sharding.Planner:
    """gate_up(x [m, k], w [g, k, 2f], group_sizes, group_offset=..., out_dtype=...) ->
    h [m, f] on local arrays: grouped_projection's forward planner with the contraction
    and the columns whole."""
    return grouped.gmm_planner(gate_up, transpose_rhs=False, out_dtype=out_dtype,
                               shapes=shapes, offset_given=offset_given, whole=True)


def backward_planner(grads: Callable, *, dtypes, shapes,
                     offset_given: bool) -> sharding.Planner:
    """grads(x, w, group_sizes, dh, group_offset=..., dtypes=(dx, dw)) -> (dx [m, k],
    dw [g_local, k, 2f]) on local arrays, over operands (x, w, group_sizes, group_offset,
    dh). dtypes: the gradients' dtypes as the caller wants them."""
    (m, _), (g, _, _) = shapes
    dx_dtype, dw_dtype = dtypes

    def plan(given, axis_sizes) -> Plan:
        (x_m, _), w_dims, _, _, (dh_m, _) = given
        rows = sharding.fits(x_m, m, axis_sizes) if x_m == dh_m else ()
        e_axes, m_axes, scatter = grouped._experts(w_dims[0], g, rows, axis_sizes)
        if scatter:  # rows over the expert axes too: the experts taken whole
            e_axes, m_axes = (), rows

        def local(x, w, group_sizes, group_offset, dh):
            sizes = grouped._rows(group_sizes, x.shape[0], m_axes)
            offset = grouped._offset(group_offset, offset_given, e_axes, w.shape[0])
            dx, dw = grads(x, w, sizes, dh, group_offset=offset,
                           dtypes=(dx_dtype, jnp.float32 if m_axes else dw_dtype))
            if e_axes:
                dx = jax.lax.psum(dx, e_axes)
            return dx, sharding.psum_f32(dw, m_axes, dw_dtype)

        return Plan(in_dims=((m_axes, ()), (e_axes, (), ()), ((),), (), (m_axes, ())),
                    out_dims=((m_axes, ()), (e_axes, (), ())), local=local)

    return plan


def down_forward_planner(down: Callable, *, out_dtype, shapes,
                         offset_given: bool) -> sharding.Planner:
    """down(h [m, f], w [g, f, n], group_sizes, row_weights [m], group_offset=...,
    out_dtype=...) -> y [m, n] on local arrays, over operands (h, w, group_sizes,
    group_offset, row_weights): grouped_projection's forward planner, the row weights
    laid out with the rows."""
    return grouped.gmm_planner(down, transpose_rhs=False, out_dtype=out_dtype, shapes=shapes,
                               offset_given=offset_given, row_operands=1)


def down_backward_planner(grads: Callable, *, dtypes, shapes,
                          offset_given: bool) -> sharding.Planner:
    """grads(h, w, group_sizes, row_weights, dy, group_offset=..., dtypes=(dh, dw)) ->
    (dh [m, f], dw [g_local, f, n], d row_weights [m] fp32) on local arrays, over operands
    (h, w, group_sizes, group_offset, row_weights, dy). dh and d row_weights are summed
    over the expert axes (exact: a row's terms come from its one expert), dW over the row
    axes (fp32, rounded once)."""
    (m, _), (g, _, _) = shapes
    dh_dtype, dw_dtype = dtypes

    def plan(given, axis_sizes) -> Plan:
        (h_m, _), w_dims, _, _, _, (dy_m, _) = given
        rows = sharding.fits(h_m, m, axis_sizes) if h_m == dy_m else ()
        e_axes, m_axes, scatter = grouped._experts(w_dims[0], g, rows, axis_sizes)
        if scatter:  # rows over the expert axes too: the experts taken whole
            e_axes, m_axes = (), rows

        def local(h, w, group_sizes, group_offset, row_weights, dy):
            sizes = grouped._rows(group_sizes, h.shape[0], m_axes)
            offset = grouped._offset(group_offset, offset_given, e_axes, w.shape[0])
            dh, dw, d_rw = grads(h, w, sizes, row_weights, dy, group_offset=offset,
                                 dtypes=(dh_dtype, jnp.float32 if m_axes else dw_dtype))
            if e_axes:
                dh, d_rw = jax.lax.psum(dh, e_axes), jax.lax.psum(d_rw, e_axes)
            return dh, sharding.psum_f32(dw, m_axes, dw_dtype), d_rw

        row = (m_axes, ())
        return Plan(in_dims=(row, (e_axes, (), ()), ((),), (), (m_axes,), row),
                    out_dims=(row, (e_axes, (), ()), (m_axes,)), local=local)

    return plan
