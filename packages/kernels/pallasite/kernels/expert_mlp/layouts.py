"""Which shardings the fused gate-up and down product run on locally: planners for
`pallasite.kernels.sharding.run` (shard_map under Explicit axes, a custom_partitioning
under Auto axes, the local arrays inside a caller's shard_map).

The activation pairs column j of the gate with column j of the up and is not linear in
the sums, so the contraction (k) is taken whole, and so are the columns (2f) unless the
axes that split them can split them in gate|up pairs (a tensor-parallel kernel: each
device's contiguous share is exchanged for the gate and up blocks of its own f / n
columns, gate_up_pairs, and h keeps the split). The rows and the
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
keeps rows and experts split, as the gate-up's does, f split where h and the kernel
split it alike (the gate-up's pairs), and n split where dy and the kernel split it alike
(a model-width split): each part's dh and d row_weights are partial sums over its n
columns, summed in fp32 and rounded once, and its dW_down columns are its own.

The fp8 fused route (ops.mlp_fp8: both products in one pass, h kept in e4m3 between
them and for the backward) keeps the rows and the experts split and takes the rest
whole. Its forward's results over the expert axes are exact sums, one non-zero term a
row: y in the compute dtype, h's e4m3 bytes as integers, and h's scales with those of
rows of no local group zeroed first (the kernel writes scale 1 there). Its backward
sums dx and d row_weights over the expert axes, the kernels' gradients over the row
axes (fp32, rounded once).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallasite.kernels import sharding
from pallasite.kernels.grouped_matmul import layouts as grouped
from pallasite.kernels.grouped_matmul import xla as grouped_xla
from pallasite.kernels.grouped_matmul.group_metadata import local_groups
from pallasite.kernels.sharding import Axes, Plan

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
DOWN_BACKWARD_RULE = "m c, e c o, G, , m, m o -> m c, e c o, m"
DOWN_BACKWARD_REDUCTION = ()
# The fp8 fused route, forward and backward: k the contraction, q the gate-up's 2f
# columns, f h's columns (the down product's contraction), n y's, b h's scale blocks
# (f / 128).
FP8_FORWARD_RULE = "m k, e k q, e f n, G, , m -> m n, m f, b m"
FP8_FORWARD_REDUCTION = ("k", "e", "q")
FP8_BACKWARD_RULE = "m k, e k q, e f n, G, , m, m f, b m, m n -> m k, e k q, e f n, m"
FP8_BACKWARD_REDUCTION = ("b",)


def _pair_axes(given: Axes, f: int, axis_sizes, *taken: Axes) -> Axes:
    """The axes that split the kernel's 2f columns, where they can be kept split in
    gate|up pairs: each shard then holds two column blocks of f / n (n = their size), so
    f must divide by n; and they must not shard another dimension already. () if not."""
    axes = grouped._apart(sharding.fits(given, 2 * f, axis_sizes), *taken)
    return axes if axes and f % sharding.size(axes, axis_sizes) == 0 else ()


def _exchange(blocks, routes, axes: Axes):
    """One block per device, sent along `routes` [(source, target, index of the block
    the source sends)], every device the target of exactly one route: each device's
    received block. One ppermute per distinct sent block; a device keeps, of what
    arrives, the one whose route targets it."""
    me = sharding.shard_index(axes)
    out = None
    for which, block in enumerate(blocks):
        perm = [(src, dst) for src, dst, b in routes if b == which]
        if not perm:
            continue
        got = jax.lax.ppermute(block, axes, perm)
        mine = jnp.isin(me, jnp.asarray([dst for _, dst in perm], jnp.int32))
        out = got if out is None else jnp.where(mine, got, out)
    return out


def _blocks(n: int):
    """Where each column block goes: (device d, its block s (0 for column block 2d, 1 for
    2d + 1), part (0 the gate, 1 the up), device i whose part it is). Of the 2n blocks of
    width f / n, blocks 0..n-1 are the gate's and n..2n-1 the up's: block b is part
    b // n of device b % n."""
    return [(d, s, (2 * d + s) // n, (2 * d + s) % n) for d in range(n) for s in (0, 1)]


def gate_up_pairs(w, axes: Axes, n: int):
    """w [g, k, 2f / n], this device's share of a kernel whose 2f columns are split over
    `axes` in n contiguous parts, to [g, k, 2f / n] = [gate block i | up block i], the
    same f / n columns of the gate and of the up for device i (h's columns
    [i f / n, (i + 1) f / n)). Device d holds column blocks 2d and 2d + 1 (_blocks):
    each block moves to one device once, a kernel's worth of bytes in all (a gather
    would move n times that)."""
    if n == 1:
        return w
    held = jnp.split(w, 2, axis=-1)  # blocks 2d, 2d + 1
    gate, up = ([(d, i, s) for d, s, p, i in _blocks(n) if p == part] for part in (0, 1))
    return jnp.concatenate([_exchange(held, gate, axes), _exchange(held, up, axes)], axis=-1)


def gate_up_unpairs(w, axes: Axes, n: int):
    """gate_up_pairs' inverse, along the same routes reversed: [gate block i | up block
    i] on device i back to column blocks 2d and 2d + 1 on device d (a kernel gradient
    into the kernel's layout)."""
    if n == 1:
        return w
    parts = jnp.split(w, 2, axis=-1)  # gate, up
    lo, hi = ([(i, d, p) for d, s, p, i in _blocks(n) if s == held] for held in (0, 1))
    return jnp.concatenate([_exchange(parts, lo, axes), _exchange(parts, hi, axes)], axis=-1)


def forward_planner(gate_up: Callable, *, out_dtype, shapes,
                    offset_given: bool) -> sharding.Planner:
    """gate_up(x [m, k], w [g, k, 2f], group_sizes, group_offset=..., out_dtype=...) ->
    h [m, f] on local arrays: grouped_projection's forward planner with the contraction
    whole, and the columns whole unless their axes split them in gate|up pairs
    (_pair_axes): then each device exchanges its column blocks for the gate and up
    blocks of its own f / n columns (gate_up_pairs) and h keeps the split."""
    whole = grouped.gmm_planner(gate_up, transpose_rhs=False, out_dtype=out_dtype,
                                shapes=shapes, offset_given=offset_given, whole=True)
    f = shapes[1][2] // 2

    def plan(given, axis_sizes) -> Plan:
        base = whole(given, axis_sizes)
        (m_axes, _), (e_axes, _, _), *_ = base.in_dims
        out_m = base.out_dims[0][0]
        q_axes = _pair_axes(given[1][2], f, axis_sizes, m_axes, e_axes, out_m)
        if not q_axes:
            return base
        n = sharding.size(q_axes, axis_sizes)

        def local(x, w, group_sizes, group_offset):
            return base.local(x, gate_up_pairs(w, q_axes, n), group_sizes, group_offset)

        in_dims = list(base.in_dims)
        in_dims[1] = (e_axes, (), q_axes)
        return Plan(in_dims=tuple(in_dims), out_dims=((out_m, q_axes),), local=local)

    return plan


def backward_planner(grads: Callable, *, dtypes, shapes,
                     offset_given: bool) -> sharding.Planner:
    """grads(x, w, group_sizes, dh, group_offset=..., dtypes=(dx, dw)) -> (dx [m, k],
    dw [g_local, k, 2f]) on local arrays, over operands (x, w, group_sizes, group_offset,
    dh). dtypes: the gradients' dtypes as the caller wants them. With the columns split
    in gate|up pairs (as the forward keeps them) each device's dx is a partial sum over
    its f / n columns, summed in fp32 over those axes, and its dW returns to the
    kernel's layout (gate_up_unpairs)."""
    (m, _), (g, _, two_f) = shapes
    dx_dtype, dw_dtype = dtypes

    def plan(given, axis_sizes) -> Plan:
        (x_m, _), w_dims, _, _, (dh_m, dh_f) = given
        rows = sharding.fits(x_m, m, axis_sizes) if x_m == dh_m else ()
        e_axes, m_axes, scatter = grouped._experts(w_dims[0], g, rows, axis_sizes)
        if scatter:  # rows over the expert axes too: the experts taken whole
            e_axes, m_axes = (), rows
        q_axes = (_pair_axes(w_dims[2], two_f // 2, axis_sizes, m_axes, e_axes)
                  if w_dims[2] == dh_f else ())
        n = sharding.size(q_axes, axis_sizes)

        def local(x, w, group_sizes, group_offset, dh):
            sizes = grouped._rows(group_sizes, x.shape[0], m_axes)
            offset = grouped._offset(group_offset, offset_given, e_axes, w.shape[0])
            if q_axes:
                w = gate_up_pairs(w, q_axes, n)
            dx, dw = grads(x, w, sizes, dh, group_offset=offset,
                           dtypes=(jnp.float32 if q_axes else dx_dtype,
                                   jnp.float32 if m_axes else dw_dtype))
            if q_axes:
                dx = jax.lax.psum(dx, q_axes + e_axes).astype(dx_dtype)
                dw = gate_up_unpairs(dw, q_axes, n)
            elif e_axes:
                dx = jax.lax.psum(dx, e_axes)
            return dx, sharding.psum_f32(dw, m_axes, dw_dtype)

        return Plan(in_dims=((m_axes, ()), (e_axes, (), q_axes), ((),), (), (m_axes, q_axes)),
                    out_dims=((m_axes, ()), (e_axes, (), q_axes)), local=local)

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
    axes (fp32, rounded once). Where h and the kernel split f alike (the gate-up's pairs
    over a tensor-parallel axis) f stays split: dh and dW are local to each part, and
    d row_weights, a sum over f, is summed over those axes too. Where dy and the kernel
    split n alike, n stays split: dh (fp32) and d row_weights are summed over those
    axes, dW's columns are local."""
    (m, f), (g, _, n) = shapes
    dh_dtype, dw_dtype = dtypes

    def plan(given, axis_sizes) -> Plan:
        (h_m, h_f), w_dims, _, _, _, (dy_m, dy_n) = given
        rows = sharding.fits(h_m, m, axis_sizes) if h_m == dy_m else ()
        e_axes, m_axes, scatter = grouped._experts(w_dims[0], g, rows, axis_sizes)
        if scatter:  # rows over the expert axes too: the experts taken whole
            e_axes, m_axes = (), rows
        f_axes = (grouped._apart(sharding.fits(h_f, f, axis_sizes), m_axes, e_axes)
                  if h_f == w_dims[1] else ())
        n_axes = (grouped._apart(sharding.fits(dy_n, n, axis_sizes), m_axes, e_axes, f_axes)
                  if dy_n == w_dims[2] else ())

        def local(h, w, group_sizes, group_offset, row_weights, dy):
            sizes = grouped._rows(group_sizes, h.shape[0], m_axes)
            offset = grouped._offset(group_offset, offset_given, e_axes, w.shape[0])
            dh, dw, d_rw = grads(h, w, sizes, row_weights, dy, group_offset=offset,
                                 dtypes=(jnp.float32 if n_axes else dh_dtype,
                                         jnp.float32 if m_axes else dw_dtype))
            if e_axes or n_axes:
                dh = sharding.psum_f32(dh, e_axes + n_axes, dh_dtype)
            if e_axes or f_axes or n_axes:
                d_rw = jax.lax.psum(d_rw, e_axes + f_axes + n_axes)
            return dh, sharding.psum_f32(dw, m_axes, dw_dtype), d_rw

        return Plan(in_dims=((m_axes, f_axes), (e_axes, f_axes, n_axes), ((),), (), (m_axes,),
                             (m_axes, n_axes)),
                    out_dims=((m_axes, f_axes), (e_axes, f_axes, n_axes), (m_axes,)),
                    local=local)

    return plan


def _rows_and_experts(x_m: Axes, e_given: Axes, m: int, g: int, axis_sizes
                      ) -> tuple[Axes, Axes]:
    """(row axes, expert axes) a pass keeps split: grouped_projection's choice, the
    experts taken whole where the rows are split over their axes too."""
    rows = sharding.fits(x_m, m, axis_sizes)
    e_axes, m_axes, scatter = grouped._experts(e_given, g, rows, axis_sizes)
    return (rows, ()) if scatter else (m_axes, e_axes)


def mlp_fp8_forward_planner(forward: Callable, *, shapes,
                            offset_given: bool) -> sharding.Planner:
    """forward(x, w_gate_up, w_down, group_sizes, row_weights, group_offset=...) -> (y
    [m, n], h [m, f] e4m3, h's scales [f / 128, m]) on local arrays, over operands (x,
    w_gate_up, w_down, group_sizes, group_offset, row_weights): rows and experts split,
    the contraction and the columns whole. Over the expert axes each device's results
    hold its experts' rows and zeros elsewhere, and are summed exactly (module
    docstring)."""
    (m, _), (g, _, _) = shapes[:2]

    def plan(given, axis_sizes) -> Plan:
        (x_m, _), (w_e, _, _), *_ = given
        m_axes, e_axes = _rows_and_experts(x_m, w_e, m, g, axis_sizes)

        def local(x, w_gate_up, w_down, group_sizes, group_offset, row_weights):
            sizes = grouped._rows(group_sizes, x.shape[0], m_axes)
            offset = grouped._offset(group_offset, offset_given, e_axes, w_gate_up.shape[0])
            y, h, scales_t = forward(x, w_gate_up, w_down, sizes, row_weights,
                                     group_offset=offset)
            if e_axes:
                # [m, 1]: the rows of this device's groups, as the backends read them
                mine = grouped_xla._row_mask(x.shape[0],
                                             *local_groups(sizes, offset, w_gate_up.shape[0]))
                y = jax.lax.psum(y, e_axes)
                bits = jax.lax.psum(jax.lax.bitcast_convert_type(h, jnp.uint8), e_axes)
                h = jax.lax.bitcast_convert_type(bits, h.dtype)
                scales_t = jax.lax.psum(jnp.where(mine.T, scales_t, 0.0), e_axes)
            return y, h, scales_t

        weights = (e_axes, (), ())
        return Plan(in_dims=((m_axes, ()), weights, weights, ((),), (), (m_axes,)),
                    out_dims=((m_axes, ()), (m_axes, ()), ((), m_axes)), local=local)

    return plan


def mlp_fp8_backward_planner(backward: Callable, *, dtypes, shapes,
                             offset_given: bool) -> sharding.Planner:
    """backward(x, w_gate_up, w_down, group_sizes, row_weights, h, h_scales_t, dy,
    group_offset=..., dtypes=(dx, dW_gate_up, dW_down)) -> (dx, dW_gate_up, dW_down,
    d row_weights fp32) on local arrays, over operands (x, w_gate_up, w_down,
    group_sizes, group_offset, row_weights, h, h_scales_t, dy): the forward's split
    (mlp_fp8_forward_planner). dx and d row_weights are summed over the expert axes
    (exact: a row's terms come from its one expert), the kernels' gradients over the
    row axes (fp32, rounded once)."""
    (m, _), (g, _, _) = shapes[:2]
    dx_dtype, dw_gate_up_dtype, dw_down_dtype = dtypes

    def plan(given, axis_sizes) -> Plan:
        (x_m, _), (w_e, _, _), *_ = given
        m_axes, e_axes = _rows_and_experts(x_m, w_e, m, g, axis_sizes)

        def local(x, w_gate_up, w_down, group_sizes, group_offset, row_weights, h,
                  scales_t, dy):
            sizes = grouped._rows(group_sizes, x.shape[0], m_axes)
            offset = grouped._offset(group_offset, offset_given, e_axes, w_gate_up.shape[0])
            wide = jnp.float32 if m_axes else None
            dx, dw_gate_up, dw_down, d_weights = backward(
                x, w_gate_up, w_down, sizes, row_weights, h, scales_t, dy,
                group_offset=offset, dtypes=(dx_dtype, wide or dw_gate_up_dtype,
                                             wide or dw_down_dtype))
            if e_axes:
                dx = jax.lax.psum(dx, e_axes)
                d_weights = jax.lax.psum(d_weights, e_axes)
            return (dx, sharding.psum_f32(dw_gate_up, m_axes, dw_gate_up_dtype),
                    sharding.psum_f32(dw_down, m_axes, dw_down_dtype), d_weights)

        weights = (e_axes, (), ())
        return Plan(in_dims=((m_axes, ()), weights, weights, ((),), (), (m_axes,),
                             (m_axes, ()), ((), m_axes), (m_axes, ())),
                    out_dims=((m_axes, ()), weights, weights, (m_axes,)), local=local)

    return plan
