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

What is not used locally is resharded (replicated along that dimension): the group axis of
the kernel, the contraction when x and the kernel split it differently, a dimension the
axes do not divide, an output dimension that would reuse the axes of another. docs/
sharding.md lists what each costs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from pallasite.kernels import sharding
from pallasite.kernels.sharding import Axes, Plan

# Shardy rules for the Auto-axes path: m rows, c the contraction, o the output columns,
# G the groups (factor names, not the axes).
GMM_RULE = "m c, G c o, G -> m o"
GMM_TRANSPOSED_RULE = "m c, G o c, G -> m o"
TGMM_RULE = "m k, m n, G -> G k n"


def local_group_sizes(group_sizes, rows: int, shard):
    """Group sizes within rows [shard * rows, (shard + 1) * rows) of the global sorted rows:
    the global offsets clipped to this shard's range (int32; rows past the total belong to
    no group)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    lo = shard.astype(jnp.int32) * rows
    hi = lo + rows
    return (jnp.clip(ends, lo, hi) - jnp.clip(starts, lo, hi)).astype(group_sizes.dtype)


def _apart(axes: Axes, *taken: Axes) -> Axes:
    """`axes` unless one of them already shards another dimension of the result."""
    used = {a for t in taken for a in t}
    return () if used & set(axes) else axes


def _rows(group_sizes, rows: int, m_axes: Axes):
    if not m_axes:
        return group_sizes
    return local_group_sizes(group_sizes, rows, sharding.shard_index(m_axes))


def gmm_planner(gmm: Callable, *, transpose_rhs: bool, out_dtype,
                shapes) -> sharding.Planner:
    """Planner for gmm(lhs [m, c], rhs [G, c, o] or [G, o, c], group_sizes) -> [m, o].

    gmm(lhs, rhs, group_sizes, out_dtype=...) is the backend product on local arrays;
    shapes are the global (lhs, rhs) shapes."""
    (m, c), rhs_shape = shapes
    ci, oi = (2, 1) if transpose_rhs else (1, 2)
    o = rhs_shape[oi]

    def plan(given, axis_sizes) -> Plan:
        (lhs_m, lhs_c), rhs_dims, _ = given
        m_axes = sharding.fits(lhs_m, m, axis_sizes)
        c_axes = sharding.fits(lhs_c, c, axis_sizes) if lhs_c == rhs_dims[ci] else ()
        o_axes = _apart(sharding.fits(rhs_dims[oi], o, axis_sizes), m_axes, c_axes)
        rhs = [(), (), ()]
        rhs[ci], rhs[oi] = c_axes, o_axes

        def local(lhs, rhs, group_sizes):
            sizes = _rows(group_sizes, lhs.shape[0], m_axes)
            out = gmm(lhs, rhs, sizes, out_dtype=jnp.float32 if c_axes else out_dtype)
            return (sharding.psum_f32(out, c_axes, out_dtype),)

        return Plan(in_dims=((m_axes, c_axes), tuple(rhs), ((),)),
                    out_dims=((m_axes, o_axes),), local=local)

    return plan


def tgmm_planner(tgmm: Callable, *, out_dtype, shapes) -> sharding.Planner:
    """Planner for tgmm(lhs [m, k], rhs [m, n], group_sizes) -> [G, k, n].

    tgmm(lhs, rhs, group_sizes, out_dtype=...) is the backend product on local arrays;
    shapes are the global (lhs, rhs) shapes."""
    (m, k), (_, n) = shapes

    def plan(given, axis_sizes) -> Plan:
        (lhs_m, lhs_k), (rhs_m, rhs_n), _ = given
        m_axes = sharding.fits(lhs_m, m, axis_sizes) if lhs_m == rhs_m else ()
        k_axes = _apart(sharding.fits(lhs_k, k, axis_sizes), m_axes)
        n_axes = _apart(sharding.fits(rhs_n, n, axis_sizes), m_axes, k_axes)

        def local(lhs, rhs, group_sizes):
            sizes = _rows(group_sizes, lhs.shape[0], m_axes)
            out = tgmm(lhs, rhs, sizes, out_dtype=jnp.float32 if m_axes else out_dtype)
            return (sharding.psum_f32(out, m_axes, out_dtype),)

        return Plan(in_dims=((m_axes, k_axes), (m_axes, n_axes), ((),)),
                    out_dims=(((), k_axes, n_axes),), local=local)

    return plan
