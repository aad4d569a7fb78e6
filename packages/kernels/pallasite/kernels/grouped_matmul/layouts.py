"""Which shardings the grouped products run on locally: the planners for
`pallasite.kernels.sharding.run` (which applies them under shard_map, Explicit or Auto
axes alike), one per product.

Each product contracts one dimension, and is summed (fp32, rounded once) over the mesh
axes that shard it; every other sharded dimension stays local:
  forward  gmm(x [m,k], kernel [g,k,n]) -> y [m,n]      sums over k's axes
  dx       gmm(dy [m,n], kernel [g,k,n]^T) -> dx [m,k]  sums over n's axes (tensor parallel)
  dkernel  tgmm(x [m,k], dy [m,n]) -> dk [g,k,n]        sums over m's axes (data parallel)
With the rows (m) sharded, `group_sizes` stays the global count over the global sorted
rows: each shard clips the global group offsets to its own row range (`local_group_sizes`),
so x and y are never gathered and rows past the total stay zero.

Expert parallelism: with the kernel's group axis sharded (an `expert` axis), each device
keeps its own experts and runs the backends with `group_offset` = its first expert: only
its experts' rows are computed, the others come out zero. The forward and dx are then
combined with one sum over the expert axes (exact in any dtype: every row has one
non-zero contribution), or a reduce-scatter where the rows are sharded over those same
axes (the tokens are gathered, the weights never move). dkernel stays sharded like the
kernel: tgmm takes the kernel itself as a layout-only operand (`template`), so its planner
sees the group sharding the cotangent must have.

What is not used locally is resharded (replicated along that dimension): the contraction
when x and the kernel split it differently, a dimension the axes do not divide, an output
dimension that would reuse the axes of another, the group axis when the rows are split
over the expert axes in another order than minor-most. docs/sharding.md lists what each
costs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallasite.kernels import sharding
from pallasite.kernels.grouped_matmul.group_metadata import group_offsets
from pallasite.kernels.sharding import Axes, Plan

# Shardy rules for the Auto-axes path: m rows, c the contraction, o the output columns,
# G the groups (factor names, not the axes).
# e the kernel's own group axis (expert parallel), a reduction factor like c: the global
# group_sizes (G) and the scalar group offset stay replicated. tgmm's last operand is the
# layout template (the kernel): its factors are its own, only e reaches the result.
GMM_RULE = "m c, e c o, G, -> m o"
GMM_TRANSPOSED_RULE = "m c, e o c, G, -> m o"
TGMM_RULE = "m k, m n, G, , e p q -> e k n"


def local_group_sizes(group_sizes, rows: int, shard):
    """Group sizes within rows [shard * rows, (shard + 1) * rows) of the global sorted rows:
    the global offsets (group_metadata.group_offsets, as every backend reads them)
    clipped to this shard's range (int32; rows past the total belong to no group)."""
    lo = shard.astype(jnp.int32) * rows
    offsets = jnp.clip(group_offsets(group_sizes), lo, lo + rows)
    return jnp.diff(offsets).astype(group_sizes.dtype)


def _apart(axes: Axes, *taken: Axes) -> Axes:
    """`axes` unless one of them already shards another dimension of the result."""
    used = {a for t in taken for a in t}
    return () if used & set(axes) else axes


def _rows(group_sizes, rows: int, m_axes: Axes):
    if not m_axes:
        return group_sizes
    return local_group_sizes(group_sizes, rows, sharding.shard_index(m_axes))


def _experts(e_given: Axes, num_groups: int, m_axes: Axes, axis_sizes) -> tuple[Axes, Axes, bool]:
    """(expert axes kept, row axes kept, whether the rows are gathered over the expert
    axes and the result reduce-scattered back): the kernel's group axes stay local where
    they divide its groups and, if they also shard the rows, are the rows' minor-most
    axes (so gathering them and scattering the result back keeps the row order)."""
    e_axes = sharding.fits(e_given, num_groups, axis_sizes)
    shared = set(e_axes) & set(m_axes)
    if not shared:
        return e_axes, m_axes, False
    if m_axes[len(m_axes) - len(e_axes):] == e_axes:
        return e_axes, m_axes[:len(m_axes) - len(e_axes)], True
    return (), m_axes, False


def _offset(group_offset, given: bool, e_axes: Axes, local_groups: int):
    """The global index of this device's first expert: the caller's offset (if `given`)
    plus this expert shard's; None (all groups, from row 0) when there is neither."""
    if not e_axes:
        return group_offset if given else None
    first = sharding.shard_index(e_axes).astype(jnp.int32) * local_groups
    return group_offset + first if given else first


def gmm_planner(gmm: Callable, *, transpose_rhs: bool, out_dtype, shapes,
                offset_given: bool = False, whole: bool = False,
                row_operands: int = 0) -> sharding.Planner:
    """Planner for gmm(lhs [m, c], rhs [g, c, o] or [g, o, c], group_sizes [G],
    group_offset[, *rows]) -> [m, o].

    gmm(lhs, rhs, group_sizes, group_offset=..., out_dtype=...) is the backend product on
    local arrays; shapes are the global (lhs, rhs) shapes; offset_given: whether the
    group_offset operand is the caller's (else a placeholder: all groups). whole: the
    contraction and the columns are taken whole, only rows and experts stay split, for
    a product whose epilogue is not linear in its sums or pairs its columns (the fused
    gate-up's activation of gate and up halves); its result may then be narrower than o.
    row_operands: how many [m] operands follow group_offset, laid out with lhs's rows and
    passed to gmm after group_sizes: the fused down product's row weights, which scale
    each row's sums in its epilogue (linear, so partial sums may be scaled before they
    are added)."""
    (m, c), rhs_shape = shapes
    ci, oi = (2, 1) if transpose_rhs else (1, 2)
    g, o = rhs_shape[0], rhs_shape[oi]

    def plan(given, axis_sizes) -> Plan:
        (lhs_m, lhs_c), rhs_dims, *_ = given
        e_axes, m_axes, scatter = _experts(rhs_dims[0], g, sharding.fits(lhs_m, m, axis_sizes),
                                           axis_sizes)
        c_axes = sharding.fits(lhs_c, c, axis_sizes) if lhs_c == rhs_dims[ci] else ()
        c_axes = () if whole else _apart(c_axes, e_axes)
        out_m = m_axes + e_axes if scatter else m_axes
        o_axes = () if whole else _apart(sharding.fits(rhs_dims[oi], o, axis_sizes), out_m,
                                         c_axes, e_axes)
        rhs = [e_axes, (), ()]
        rhs[ci], rhs[oi] = c_axes, o_axes

        def local(lhs, rhs, group_sizes, group_offset, *rows):
            sizes = _rows(group_sizes, lhs.shape[0], m_axes)
            offset = _offset(group_offset, offset_given, e_axes, rhs.shape[0])
            out = gmm(lhs, rhs, sizes, *rows, group_offset=offset,
                      out_dtype=jnp.float32 if c_axes else out_dtype)
            # Over the expert axes every row has one non-zero term: exact in out's dtype,
            # so they join the contraction's fp32 sum or, alone, sum in out_dtype.
            summed = c_axes if scatter else c_axes + e_axes
            if summed:
                out = jax.lax.psum(out, summed)
            if scatter:
                out = jax.lax.psum_scatter(out, e_axes, scatter_dimension=0, tiled=True)
            return (out.astype(out_dtype),)

        rows = ((m_axes,),) * row_operands
        return Plan(in_dims=((m_axes, c_axes), tuple(rhs), ((),), ()) + rows,
                    out_dims=((out_m, o_axes),), local=local)

    return plan


def tgmm_planner(tgmm: Callable, *, out_dtype, shapes,
                 offset_given: bool = False) -> sharding.Planner:
    """Planner for tgmm(lhs [m, k], rhs [m, n], group_sizes [G], group_offset, template
    [g, *, *]) -> [g, k, n], the template being the kernel whose cotangent this is: only
    its group axis's layout is read (expert parallel: each device sums its own experts).

    tgmm(lhs, rhs, group_sizes, num_groups=..., group_offset=..., out_dtype=...) is the
    backend product on local arrays; shapes are the global (lhs, rhs, template) shapes;
    offset_given as for gmm_planner."""
    (m, k), (_, n), (g, *_) = shapes

    def plan(given, axis_sizes) -> Plan:
        (lhs_m, lhs_k), (rhs_m, rhs_n), _, _, template = given
        m_axes = sharding.fits(lhs_m, m, axis_sizes) if lhs_m == rhs_m else ()
        e_axes, m_axes, _ = _experts(template[0], g, m_axes, axis_sizes)
        k_axes = _apart(sharding.fits(lhs_k, k, axis_sizes), m_axes, e_axes)
        n_axes = _apart(sharding.fits(rhs_n, n, axis_sizes), m_axes, k_axes, e_axes)

        def local(lhs, rhs, group_sizes, group_offset, template):
            sizes = _rows(group_sizes, lhs.shape[0], m_axes)
            # The template keeps its layout even where the plan drops its group axes
            # (then this device sums every group, and run reshards the result).
            local_g = template.shape[0] if e_axes else g
            out = tgmm(lhs, rhs, sizes, num_groups=local_g,
                       group_offset=_offset(group_offset, offset_given, e_axes, local_g),
                       out_dtype=jnp.float32 if m_axes else out_dtype)
            return (sharding.psum_f32(out, m_axes, out_dtype),)

        # The template keeps the layout it has (it is not read, so it never moves).
        return Plan(in_dims=((m_axes, k_axes), (m_axes, n_axes), ((),), (), template),
                    out_dims=((e_axes, k_axes, n_axes),), local=local)

    return plan
