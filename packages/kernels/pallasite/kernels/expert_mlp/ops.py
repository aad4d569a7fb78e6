"""The fused gate-up as a differentiable op over one backend (megablox's ops.py shape):

    forward   h = gate_up(x, W)                      the backend's fused kernel
    backward  pre = gmm(x, W) (fp32)                 recomputed, never stored
              d_pre = [act'(gate) up dh, act(gate) dh], fp32, rounded once to compute
              dx = gmm(d_pre, W, transpose_rhs=True)
              dW = tgmm(x, d_pre)

Nothing [m, 2f] is kept between the passes; the backward pays one more gate-up product
(recomputing the pre-activation) for it. The products run on the backend's grouped
kernels (grouped_matmul.<backend>), the gate-up on expert_mlp.<backend>.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from pallasite.kernels.expert_mlp import epilogue

FUSED_BACKENDS = ("pallas_mosaic_gpu", "pallas_triton")
_F32 = jnp.float32


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


def _forward(backend, activation, all_groups, interpret, compute, x, w, group_sizes, offset):
    fused, _ = _modules(backend)
    h = fused.gate_up(x.astype(compute), w.astype(compute), group_sizes,
                      activation=activation, group_offset=None if all_groups else offset,
                      interpret=interpret)
    return h, (x, w, group_sizes, offset)


def _backward(backend, activation, all_groups, interpret, compute, residuals, dh):
    x, w, group_sizes, offset = residuals
    _, grouped = _modules(backend)
    local = dict(group_offset=None if all_groups else offset, interpret=interpret)
    x_c, w_c = x.astype(compute), w.astype(compute)
    f = w.shape[2] // 2
    pre = grouped.gmm(x_c, w_c, group_sizes, out_dtype=_F32, **local)
    gate, up = pre[:, :f], pre[:, f:]
    dh = dh.astype(_F32)
    act, act_vjp = jax.vjp(lambda t: epilogue.activation_fp32(t, activation), gate)
    (d_gate,) = act_vjp(dh * up)
    d_pre = jnp.concatenate([d_gate, dh * act], axis=1).astype(compute)
    dx = grouped.gmm(d_pre, w_c, group_sizes, transpose_rhs=True, out_dtype=x.dtype, **local)
    dw = grouped.tgmm(x_c, d_pre, group_sizes, num_groups=w.shape[0], out_dtype=w.dtype,
                      **local)
    return dx, dw, None, None


_gate_up.defvjp(_forward, _backward)
