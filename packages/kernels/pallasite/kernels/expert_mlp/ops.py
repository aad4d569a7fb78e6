"""The fused gate-up as a differentiable op over one backend (megablox's ops.py shape):

    forward   h = gate_up(x, W)                      the backend's fused kernel
    backward  d_pre = gate_up_grad(x, W, dh)         [act'(gate) up dh, act(gate) dh],
                                                     (gate | up) = x W recomputed in the
                                                     kernel, never written
              dx = gmm(d_pre, W, transpose_rhs=True)
              dW = tgmm(x, d_pre)

Nothing [m, 2f] is kept between the passes; the backward pays one more gate-up product
(recomputing the pre-activation) for it. d(pre) is formed whole: taking the columns in
runs, one after another in a loop, measured slower and with more temporary memory on an
H200 (docs/grouped_mlp.md). The products run on the backend's grouped kernels
(grouped_matmul.<backend>), the gate-up on expert_mlp.<backend>. d_pre is rounded once
to the compute dtype, as the products take it.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from pallasite.kernels import platform, sharding
from pallasite.kernels.grouped_matmul import fp8 as grouped_fp8
from pallasite.kernels.grouped_matmul import ops as grouped_ops
from pallasite.kernels.expert_mlp import epilogue, layouts

FUSED_BACKENDS = ("pallas_mosaic_gpu", "pallas_triton")
_F32 = jnp.float32


def _modules(backend: str):
    if backend not in FUSED_BACKENDS:
        raise ValueError(f"backend={backend!r}: the fused gate-up runs on {FUSED_BACKENDS}")
    fused = importlib.import_module(f"pallasite.kernels.expert_mlp.{backend}")
    return fused, grouped_ops.backend(backend)


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
        # d(pre) from the gate and up sums recomputed in the kernel, never stored
        d_pre = fused.gate_up_grad(x_c, w_c, sizes, dh, activation=activation, **local)
        return (grouped.gmm(d_pre, w_c, sizes, transpose_rhs=True, out_dtype=dtypes[0],
                            **local),
                grouped.tgmm(x_c, d_pre, sizes, num_groups=w_c.shape[0], out_dtype=dtypes[1],
                             **local))

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


# ------------------------------------------------------------------ fp8

# The fp8 fused route's backends, in the default order on a device: Hopper's Mosaic GPU
# forward kernels, then Triton (sm89+). The interpreter takes Triton first, as
# grouped_projection's fp8 products do (api._fused_fp8_backend).
FP8_FUSED_BACKENDS = ("pallas_mosaic_gpu", "pallas_triton")
PLAIN_FP8_ON_HOPPER = "pallas_mosaic_gpu"


def _fused_fp8_module(backend: str):
    if backend not in FP8_FUSED_BACKENDS:
        raise ValueError(f"backend={backend!r}: the fp8 fused gate-up runs on "
                         f"{FP8_FUSED_BACKENDS}")
    return importlib.import_module(f"pallasite.kernels.expert_mlp.{backend}_fp8")


def _plain_fp8_module(backend: str, interpret: bool, compute, operands):
    """The module of the fused route's plain fp8 products (the backward's dx and its two
    dkernels): on Hopper the Mosaic GPU kernels, the fp8 composition's own (there the
    Triton fp8 products run at about half of bf16, the Mosaic GPU ones above it:
    docs/performance.md); else, and in the interpreter, Triton's (the Mosaic GPU
    interpreter runs neither inside a shard_map nor beside the Triton interpreter in one
    program on a small host: grouped_matmul.pallas_mosaic_gpu_fp8._quantizer)."""
    name = "pallas_triton"
    if not interpret and grouped_fp8.refusal(PLAIN_FP8_ON_HOPPER, compute, operands,
                                             target=platform.compile_target()) is None:
        name = PLAIN_FP8_ON_HOPPER
    return grouped_ops.backend(name, "fp8")


def mlp_fp8(x, gate_up_kernel, down_kernel, group_sizes, row_weights, compute, *,
            backend: str, activation: str = "swiglu", group_offset=None,
            interpret: bool = False):
    """y = (Q(h) Q(W_down)) * row_weights in `compute`, h = act(Q(x) Q(W_gate)) *
    (Q(x) Q(W_up)) quantized in 1 x 128 blocks by the gate-up kernel's epilogue (never
    written in 16 bits), the down product's fp32 sums weighted in its epilogue before y
    is rounded once.
    Q: the fp8 recipe's blocks (docs/fp8.md). row_weights None weighs every row 1.

    Differentiable, first order, in x, both kernels and row_weights, straight through
    the quantizations, as grouped_projection's recipe: the backward keeps h's e4m3
    values and scales (half of a 16-bit h), never the pre-activation, and runs
      dh = row_weights * t and d row_weights = sum_f h * t from the tiles of
        t = Q(dy) Q(W_down)^T in one kernel (t never stored),
      dW_down = Qt(h)^T Qt(dy * row_weights),
      d(pre) = [act'(gate) up dh, act(gate) dh], (gate | up) = Q(x) Q(W_gate_up)
        recomputed in the fp8 gate-up kernel, never stored,
      dx = Q(d pre) Q(W_gate_up)^T, dW_gate_up = Qt(x)^T Qt(d pre),
    the fused products on the backend's fp8 kernels (on Hopper Mosaic GPU's,
    pallas_mosaic_gpu_fp8.py), dx and the two dW on Hopper on the Mosaic GPU fp8
    kernels whichever the backend (_plain_fp8_module). Sharded as layouts.mlp_fp8_forward_planner
    says: under jit the rows and experts stay split (Explicit or Auto axes), inside a
    caller's shard_map it runs on the local arrays."""
    _fused_fp8_module(backend)
    epilogue.check_activation(activation)
    offset = jnp.asarray(0 if group_offset is None else group_offset, jnp.int32)
    weights = (jnp.ones((x.shape[0],), _F32) if row_weights is None else row_weights)
    return _mlp_fp8(backend, activation, group_offset is None, bool(interpret),
                    jnp.dtype(compute), x, gate_up_kernel, down_kernel, group_sizes,
                    weights, offset)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _mlp_fp8(backend, activation, all_groups, interpret, compute, x, w_gate_up, w_down,
             group_sizes, row_weights, offset):
    return _mlp_fp8_forward(backend, activation, all_groups, interpret, compute, x,
                            w_gate_up, w_down, group_sizes, row_weights, offset)[0]


# Both passes run through sharding.run with their planners (expert_mlp.layouts): rows and
# experts stay split under jit over sharded operands; inside a shard_map, the local
# arrays.
def _mlp_fp8_forward(backend, activation, all_groups, interpret, compute, x, w_gate_up,
                     w_down, group_sizes, row_weights, offset):
    fused = _fused_fp8_module(backend)

    def forward(x, w_gate_up, w_down, group_sizes, row_weights, *, group_offset):
        local = dict(group_offset=group_offset, interpret=interpret)
        h, h_scales_t = fused.gate_up_quantized(x, w_gate_up, group_sizes,
                                                activation=activation, **local)
        y = fused.down_weighted_quantized(h, h_scales_t, w_down, group_sizes,
                                          row_weights.astype(_F32), out_dtype=compute,
                                          **local)
        return y, h, h_scales_t

    planner = layouts.mlp_fp8_forward_planner(
        forward, shapes=(x.shape, w_gate_up.shape), offset_given=not all_groups)
    y, h, h_scales_t = sharding.run(
        planner, (x, w_gate_up, w_down, group_sizes, offset, row_weights),
        rule=layouts.FP8_FORWARD_RULE, reduction_factors=layouts.FP8_FORWARD_REDUCTION,
        **sharding.backend_options(backend, interpret))
    return y, (x, w_gate_up, w_down, group_sizes, offset, row_weights, h, h_scales_t)


def _mlp_fp8_backward(backend, activation, all_groups, interpret, compute, residuals, dy):
    x, w_gate_up, w_down, group_sizes, offset, row_weights = residuals[:6]
    fused = _fused_fp8_module(backend)
    grouped = _plain_fp8_module(backend, interpret, compute, (x, w_gate_up, w_down, dy))

    def backward(x, w_gate_up, w_down, group_sizes, row_weights, h, h_scales_t, dy, *,
                 group_offset, dtypes):
        local = dict(group_offset=group_offset, interpret=interpret)
        dx_dtype, dw_gate_up_dtype, dw_down_dtype = dtypes
        weights = row_weights.astype(_F32)
        # the down product's backward, from h as the forward multiplied it: dh and
        # d row_weights from the tiles of t = dy W_down^T, which never reaches memory
        h = h.astype(_F32) * jnp.repeat(h_scales_t.T, h.shape[1] // h_scales_t.shape[0],
                                        axis=1)
        dh, d_weights = fused.down_weighted_grad_quantized(dy, w_down, group_sizes, weights,
                                                           h, dh_dtype=compute, **local)
        dy_weighted = (dy.astype(_F32) * weights[:, None]).astype(compute)
        dw_down = grouped.tgmm(h, dy_weighted, group_sizes, num_groups=w_down.shape[0],
                               out_dtype=dw_down_dtype, **local)
        # the gate-up's: d(pre) from the gate and up sums recomputed in the kernel
        d_pre = fused.gate_up_grad_quantized(x, w_gate_up, group_sizes, dh,
                                             activation=activation, out_dtype=compute,
                                             **local)
        dx = grouped.gmm(d_pre, w_gate_up, group_sizes, transpose_rhs=True,
                         out_dtype=dx_dtype, **local)
        dw_gate_up = grouped.tgmm(x, d_pre, group_sizes, num_groups=w_gate_up.shape[0],
                                  out_dtype=dw_gate_up_dtype, **local)
        return dx, dw_gate_up, dw_down, d_weights

    operands = (*residuals, dy)
    # fp32 where a gradient is still to be summed over a caller's manual axes its primal
    # does not vary over (as _backward's), then rounded once by cotangents_like.
    dtypes = tuple(sharding.cotangent_dtype(operands, p, p.dtype)
                   for p in (x, w_gate_up, w_down))
    planner = layouts.mlp_fp8_backward_planner(
        backward, dtypes=dtypes, shapes=(x.shape, w_gate_up.shape),
        offset_given=not all_groups)
    grads = sharding.run(planner, operands, rule=layouts.FP8_BACKWARD_RULE,
                         reduction_factors=layouts.FP8_BACKWARD_REDUCTION,
                         **sharding.backend_options(backend, interpret))
    dx, dw_gate_up, dw_down, d_weights = sharding.cotangents_like(
        grads, (x, w_gate_up, w_down, row_weights))
    return dx, dw_gate_up, dw_down, None, d_weights, None


_mlp_fp8.defvjp(_mlp_fp8_forward, _mlp_fp8_backward)
