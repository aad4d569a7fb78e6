"""The fused gate-up as a differentiable op over one backend (megablox's ops.py shape):

    forward   h = gate_up(x, W)                      the backend's fused kernel
    backward  d_pre = gate_up_grad(x, W, dh)         [act'(gate) up dh, act(gate) dh],
                                                     (gate | up) = x W recomputed in the
                                                     kernel, never written
              dx = gmm(d_pre, W, transpose_rhs=True)
              dW = tgmm(x, d_pre)

Nothing [m, 2f] is kept between the passes; the backward pays one more gate-up product
(recomputing the pre-activation) for it. Where f is wide (backward_slices) the backward
runs the columns in 2 or 4 runs of gate|up pairs, one after another, so d(pre) is
[m, 2f / runs] at a time rather than [m, 2f]. The products run on the backend's grouped
kernels (grouped_matmul.<backend>), the gate-up on expert_mlp.<backend>. d_pre is
rounded once to the compute dtype, as the products take it.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from pallasite.kernels import sharding
from pallasite.kernels.expert_mlp import epilogue, layouts

FUSED_BACKENDS = ("pallas_mosaic_gpu", "pallas_triton")
_F32 = jnp.float32


# The backward's d(pre) is formed for runs of at least this many of the f columns at a
# time (backward_slices), in 128-column multiples the kernels' tiles take whole.
BACKWARD_SLICE_COLUMNS = 1024


def backward_slices(f: int) -> int:
    """How many runs of gate|up column pairs the fused backward takes one after another:
    4 or 2 where each run keeps at least BACKWARD_SLICE_COLUMNS of the f columns in
    whole 128-column tiles, else 1. d(pre) in memory is [m, 2f / runs]."""
    for runs in (4, 2):
        if f % (runs * 128) == 0 and f // runs >= BACKWARD_SLICE_COLUMNS:
            return runs
    return 1


def _modules(backend: str):
    if backend not in FUSED_BACKENDS:
        raise ValueError(f"backend={backend!r}: the fused gate-up runs on {FUSED_BACKENDS}")
    fused = importlib.import_module(f"pallasite.kernels.expert_mlp.{backend}")
    grouped = importlib.import_module(f"pallasite.kernels.grouped_matmul.{backend}")
    return fused, grouped


def gate_up_activation(x, gate_up_kernel, group_sizes, compute, *, backend: str,
                       activation: str = "swiglu", group_offset=None, interpret: bool = False):
    """h = act(x W_gate) * (x W_up) in `compute`, differentiable in x and gate_up_kernel
    (gradients in their dtypes; rows of no local group get zero gradient). backend: one
    of FUSED_BACKENDS (Mosaic GPU takes 16-bit compute). On local operands (a
    shard_map's, or unsharded), as every backend function."""
    _modules(backend)
    epilogue.check_activation(activation)
    offset = jnp.asarray(0 if group_offset is None else group_offset, jnp.int32)
    return _gate_up(backend, activation, group_offset is None, bool(interpret),
                    jnp.dtype(compute), x, gate_up_kernel, group_sizes, offset)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _gate_up(backend, activation, all_groups, interpret, compute, x, w, group_sizes, offset):
    return _forward(backend, activation, all_groups, interpret, compute, x, w, group_sizes,
                    offset)[0]


# Each pass runs through sharding.run with its planner (expert_mlp.layouts): under jit
# over sharded operands the rows and experts stay split; inside a shard_map its operands
# take one varying type, as grouped_projection's kernels do (the interpreters compute
# from invariant copies there).
def _forward(backend, activation, all_groups, interpret, compute, x, w, group_sizes, offset):
    fused, _ = _modules(backend)

    def gate_up(x_c, w_c, sizes, group_offset, out_dtype):
        del out_dtype  # compute: the plan never splits the sums
        return fused.gate_up(x_c, w_c, sizes, activation=activation,
                             group_offset=group_offset, interpret=interpret)

    operands = (x.astype(compute), w.astype(compute), group_sizes, offset)
    planner = layouts.forward_planner(gate_up, out_dtype=compute, shapes=(x.shape, w.shape),
                                      offset_given=not all_groups)
    (h,) = sharding.run(planner, operands, rule=layouts.FORWARD_RULE,
                        reduction_factors=layouts.FORWARD_REDUCTION,
                        **sharding.backend_options(backend, interpret))
    return h, (x, w, group_sizes, offset)


def _backward(backend, activation, all_groups, interpret, compute, residuals, dh):
    x, w, group_sizes, offset = residuals
    fused, grouped = _modules(backend)

    operands = (x.astype(compute), w.astype(compute), group_sizes, offset, dh.astype(compute))
    # Each gradient leaves its kernel in its primal's dtype, or in fp32 where it is still
    # to be summed over manual axes the primal does not vary over (an expert's share of
    # dx), then rounded once (sharding.cotangent_like). An fp32 dW would be a second,
    # twice-as-large copy of the weights in memory (28 GiB at DeepSeek-V3's gate-up).
    dx_dtype = sharding.cotangent_dtype(operands, x, x.dtype)
    dw_dtype = sharding.cotangent_dtype(operands, w, w.dtype)

    def grads(x_c, w_c, sizes, dh, *, group_offset, dtypes):
        local = dict(group_offset=group_offset, interpret=interpret)

        def pieces(w_part, dh_part, dx_dtype):
            # d(pre) from the gate and up sums recomputed in the kernel, never stored
            d_pre = fused.gate_up_grad(x_c, w_part, sizes, dh_part, activation=activation,
                                       **local)
            return (grouped.gmm(d_pre, w_part, sizes, transpose_rhs=True, out_dtype=dx_dtype,
                                **local),
                    grouped.tgmm(x_c, d_pre, sizes, num_groups=w_part.shape[0],
                                 out_dtype=dtypes[1], **local))

        g, k, two_f = w_c.shape
        slices = backward_slices(two_f // 2)
        if slices == 1:
            return pieces(w_c, dh, dtypes[0])
        # The columns in `slices` runs of gate|up pairs, one at a time (a loop, so one
        # run's d(pre) is dead before the next is formed): d(pre) is [m, 2f / slices].
        # dx sums the runs in fp32 and rounds once; each run's dW lands in its columns.
        width = two_f // 2 // slices
        w_runs = w_c.reshape(g, k, 2, slices, width)
        dh_runs = dh.reshape(dh.shape[0], slices, width)

        def run(i, carry):
            dx, dw = carry
            w_i = jax.lax.dynamic_index_in_dim(w_runs, i, axis=3, keepdims=False)
            dh_i = jax.lax.dynamic_index_in_dim(dh_runs, i, axis=1, keepdims=False)
            dx_i, dw_i = pieces(w_i.reshape(g, k, 2 * width), dh_i, _F32)
            dw = jax.lax.dynamic_update_index_in_dim(dw, dw_i.reshape(g, k, 2, width), i, 3)
            return dx + dx_i, dw

        dx, dw = jax.lax.fori_loop(
            0, slices, run, (jnp.zeros((x_c.shape[0], k), _F32),
                             jnp.zeros((g, k, 2, slices, width), dtypes[1])))
        return dx.astype(dtypes[0]), dw.reshape(g, k, two_f)

    planner = layouts.backward_planner(grads, dtypes=(dx_dtype, dw_dtype),
                                       shapes=(x.shape, w.shape), offset_given=not all_groups)
    dx, dw = sharding.run(planner, operands, rule=layouts.BACKWARD_RULE,
                          reduction_factors=layouts.BACKWARD_REDUCTION,
                          **sharding.backend_options(backend, interpret))
    return (sharding.cotangent_like(dx, x).astype(x.dtype),
            sharding.cotangent_like(dw, w).astype(w.dtype), None, None)


_gate_up.defvjp(_forward, _backward)


# ------------------------------------------------------------------ the down product


def _down_pieces(backend: str):
    """(down_weighted, down_weighted_grad) of the backend: kernels that scale the fp32
    sums by the row weights in their epilogue, and whose backward forms dh = weights * t
    and each row's share of d row_weights (the sum over f of h * t) from the tiles of
    t = dy W_down^T, so it needs h and the weights, not y, and t never reaches memory."""
    fused, _ = _modules(backend)
    return fused.down_weighted, fused.down_weighted_grad


def down_weighted(h, down_kernel, group_sizes, row_weights, compute, *, backend: str,
                  group_offset=None, interpret: bool = False):
    """y = (h W_down) * row_weights in `compute`, the weights applied to the fp32 sums
    in the down kernel's epilogue, y rounded once; differentiable in h, down_kernel and
    row_weights. The backward gets dh and d row_weights from t = dy W_down^T (one kernel
    where fused: its epilogue forms both from the same tiles, with no pass over y) and
    dW_down from the grouped dkernel on dy * weights; it keeps h and the weights, never
    y. backend: one of FUSED_BACKENDS."""
    _modules(backend)
    offset = jnp.asarray(0 if group_offset is None else group_offset, jnp.int32)
    return _down(backend, group_offset is None, bool(interpret), jnp.dtype(compute), h,
                 down_kernel, group_sizes, row_weights, offset)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _down(backend, all_groups, interpret, compute, h, w, group_sizes, row_weights, offset):
    return _down_forward(backend, all_groups, interpret, compute, h, w, group_sizes,
                         row_weights, offset)[0]


def _down_forward(backend, all_groups, interpret, compute, h, w, group_sizes, row_weights,
                  offset):
    weighted, _ = _down_pieces(backend)

    def down(h_c, w_c, sizes, rw, *, group_offset, out_dtype):
        return weighted(h_c, w_c, sizes, rw, out_dtype=out_dtype, group_offset=group_offset,
                        interpret=interpret)

    operands = (h.astype(compute), w.astype(compute), group_sizes, offset,
                row_weights.astype(_F32))
    planner = layouts.down_forward_planner(down, out_dtype=compute, shapes=(h.shape, w.shape),
                                           offset_given=not all_groups)
    (y,) = sharding.run(planner, operands, rule=layouts.DOWN_FORWARD_RULE,
                        reduction_factors=layouts.DOWN_FORWARD_REDUCTION,
                        **sharding.backend_options(backend, interpret))
    return y, (h, w, group_sizes, row_weights, offset)


def _down_backward(backend, all_groups, interpret, compute, residuals, dy):
    h, w, group_sizes, row_weights, offset = residuals
    _, grouped = _modules(backend)
    _, weighted_grad = _down_pieces(backend)

    operands = (h.astype(compute), w.astype(compute), group_sizes, offset,
                row_weights.astype(_F32), dy.astype(compute))
    dh_dtype = sharding.cotangent_dtype(operands, h, h.dtype)  # as in _backward
    dw_dtype = sharding.cotangent_dtype(operands, w, w.dtype)

    def grads(h_c, w_c, sizes, rw, dy, *, group_offset, dtypes):
        local = dict(group_offset=group_offset, interpret=interpret)
        dh, d_rw = weighted_grad(dy, w_c, sizes, rw, h_c, dh_dtype=dtypes[0], **local)
        dy_weighted = (dy.astype(_F32) * rw[:, None]).astype(compute)
        dw = grouped.tgmm(h_c, dy_weighted, sizes, num_groups=w_c.shape[0],
                          out_dtype=dtypes[1], **local)
        return dh, dw, d_rw

    planner = layouts.down_backward_planner(grads, dtypes=(dh_dtype, dw_dtype),
                                            shapes=(h.shape, w.shape),
                                            offset_given=not all_groups)
    dh, dw, d_rw = sharding.run(planner, operands, rule=layouts.DOWN_BACKWARD_RULE,
                                reduction_factors=layouts.DOWN_BACKWARD_REDUCTION,
                                **sharding.backend_options(backend, interpret))
    return (sharding.cotangent_like(dh, h).astype(h.dtype),
            sharding.cotangent_like(dw, w).astype(w.dtype), None,
            sharding.cotangent_like(d_rw, row_weights).astype(row_weights.dtype), None)


_down.defvjp(_down_forward, _down_backward)
