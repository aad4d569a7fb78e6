"""The differentiable grouped projection over one backend: custom_vjp and shard_map.

Forward  out    = gmm(x_c, kernel_c)                      -> compute
Backward dx     = gmm(dy_c, kernel_c, transpose_rhs=True) -> x.dtype
         dkernel = tgmm(x_c, dy_c)                         -> kernel.dtype
where `_c` is the cast to `compute` and every product sums in fp32 and rounds once
(DESIGN's numerics contract). The residuals are the rounded operands, so the backward
multiplies exactly what the forward did. dx reads the forward weights in place
(transpose_rhs), no transposed copy.

Every backend call runs inside an explicit `jax.shard_map`: rows and groups stay local
(replicated specs; group boundaries are global, so rows cannot be split without a
re-sort), and the kernel's n dimension is split over the mesh axis named `model` when the
ambient mesh has one that divides n. Then the forward and dkernel are local per shard,
and dx, which contracts over n, is summed in fp32 across the axis (one psum) and rounded
once after it.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

MODEL_AXIS = "model"
BACKENDS = ("pallas_mosaic_gpu", "pallas_triton", "pallas_mosaic_tpu", "xla")
# Backends that wrap their own pallas_calls in a shard_map (nesting one would fail).
_SELF_SHARDED = frozenset({"pallas_mosaic_gpu"})


def backend(name: str) -> ModuleType:
    """The backend module `name` (imported on first use: a missing backend is a file)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown grouped_projection implementation {name!r}; known: {BACKENDS}")
    return importlib.import_module(f"pallasite.kernels.grouped_projection.{name}")


def ambient_mesh():
    """The mesh in context, else a one-device mesh (so a shard_map is always explicit)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("grouped_projection",))
    return mesh


def _model_axis(mesh, n: int) -> str | None:
    if MODEL_AXIS in mesh.axis_names and n % dict(mesh.shape)[MODEL_AXIS] == 0:
        return MODEL_AXIS
    return None


def _sharded(name: str, fn, in_specs, out_specs, *args):
    if name in _SELF_SHARDED:
        return fn(*args)
    return jax.shard_map(fn, mesh=ambient_mesh(), in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)


def _forward(x, kernel, group_sizes, name, block_sizes, interpret):
    be, n = backend(name), kernel.shape[2]
    ax = _model_axis(ambient_mesh(), n) if name not in _SELF_SHARDED else None
    local = functools.partial(be.gmm, transpose_rhs=False, out_dtype=x.dtype,
                              block_sizes=block_sizes, interpret=interpret)
    return _sharded(name, local, (P(), P(None, None, ax), P()), P(None, ax),
                    x, kernel, group_sizes)


def _dx(dy, kernel, group_sizes, out_dtype, name, block_sizes, interpret):
    be, n = backend(name), kernel.shape[2]
    ax = _model_axis(ambient_mesh(), n) if name not in _SELF_SHARDED else None

    def local(dy, kernel, group_sizes):
        dx = be.gmm(dy, kernel, group_sizes, transpose_rhs=True,
                    out_dtype=jnp.float32 if ax else out_dtype,
                    block_sizes=block_sizes, interpret=interpret)
        return jax.lax.psum(dx, ax).astype(out_dtype) if ax else dx

    return _sharded(name, local, (P(None, ax), P(None, None, ax), P()), P(),
                    dy, kernel, group_sizes)


def _dkernel(x, dy, group_sizes, num_groups, out_dtype, name, block_sizes, interpret):
    be = backend(name)
    ax = _model_axis(ambient_mesh(), dy.shape[1]) if name not in _SELF_SHARDED else None
    local = functools.partial(be.tgmm, num_groups=num_groups, out_dtype=out_dtype,
                              block_sizes=block_sizes, interpret=interpret)
    return _sharded(name, local, (P(), P(None, ax), P()), P(None, None, ax),
                    x, dy, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def project(x, kernel, group_sizes, name, compute, block_sizes, interpret):
    """grouped projection through backend `name`; see the module docstring."""
    out, _ = _project_fwd(x, kernel, group_sizes, name, compute, block_sizes, interpret)
    return out


def _project_fwd(x, kernel, group_sizes, name, compute, block_sizes, interpret):
    xc, kc = x.astype(compute), kernel.astype(compute)
    out = _forward(xc, kc, group_sizes, name, block_sizes, interpret)
    # Input dtypes ride along as empty arrays (residuals must be pytrees of arrays).
    protos = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), kernel.dtype))
    return out, (xc, kc, group_sizes, protos)


def _project_bwd(name, compute, block_sizes, interpret, residuals, dy):
    xc, kc, group_sizes, (x_proto, k_proto) = residuals
    dy = dy.astype(compute)
    dx = _dx(dy, kc, group_sizes, x_proto.dtype, name, block_sizes, interpret)
    dk = _dkernel(xc, dy, group_sizes, kc.shape[0], k_proto.dtype, name, block_sizes, interpret)
    return dx, dk, None


project.defvjp(_project_fwd, _project_bwd)
