"""The differentiable grouped projection over one backend: custom_vjp and sharding.

Forward  out    = gmm(x_c, kernel_c)                      -> compute
Backward dx     = gmm(dy_c, kernel_c, transpose_rhs=True) -> x.dtype
         dkernel = tgmm(x_c, dy_c)                         -> kernel.dtype
where `_c` is the cast to `compute` and every product sums in fp32 and rounds once
(the numerics contract). The residuals are the rounded operands, so the backward
multiplies exactly what the forward did. dx reads the forward weights in place
(transpose_rhs), no transposed copy.

Every product runs through `pallasite.kernels.sharding.run` with its planner from
`layouts`: local on the caller's shards inside a shard_map, and under jit over sharded
arrays on the layouts of the inputs (rows, the contraction or the columns sharded), each
product summed once over the axes that split what it contracts. Inside a shard_map with
check_vma, a cotangent that varies over axes its primal does not (dkernel of replicated
weights from sharded tokens, dx of replicated tokens through column-sharded weights) is
summed over them in fp32 and rounded once, as jax.grad does for a dot.

recipe="fp8" runs the same three products through a backend's fp8 module
(`<backend>_fp8.py`), whose gmm and tgmm quantize their operands (1 x 128 blocks for
x and dy, 128 x 128 for the kernel, 128-token blocks aligned to groups for dkernel) and
multiply in e4m3: the operands are not cast to `compute` first, and the gradients are
straight-through (dx in x's dtype, dkernel in the kernel's), quantized again in each
product from the residual x and kernel.

group_offset (local experts) rides through every product: the kernel holds groups
[offset, offset + g) of the global group_sizes. Where the kernel's group axis is sharded
(expert parallelism) the planners add each device's own first expert to it; dkernel's
tgmm takes the kernel as a layout-only operand so it stays sharded like the kernel.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import jax
import jax.numpy as jnp

from pallasite.kernels import sharding
from pallasite.kernels.grouped_matmul import layouts

BACKENDS = ("pallas_mosaic_gpu", "pallas_triton", "pallas_mosaic_tpu", "xla")
# The backends with fp8 products (recipe="fp8", pre-quantized operands); Mosaic TPU has
# none (docs/fp8.md).
FP8_BACKENDS = ("pallas_mosaic_gpu", "pallas_triton", "xla")
RECIPES = (None, "fp8")


def backend(name: str, recipe: str | None = None) -> ModuleType:
    """The backend module `name`, or its fp8 module with recipe="fp8" (imported on first
    use: a missing backend is a file)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown grouped_projection implementation {name!r}; known: {BACKENDS}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if recipe == "fp8":
        if name not in FP8_BACKENDS:
            raise ValueError(f"{name} has no fp8 products; recipe='fp8' runs on {FP8_BACKENDS}")
        name = f"{name}_fp8"
    return importlib.import_module(f"pallasite.kernels.grouped_matmul.{name}")


def _offset_operand(group_offset):
    """(the scalar operand, whether the caller gave one): `run` takes arrays only, and a
    missing offset must stay statically absent (all groups, the backends' plain path)."""
    if group_offset is None:
        return jnp.zeros((), jnp.int32), False
    return group_offset, True


def _gmm(lhs, rhs, group_sizes, group_offset, *, transpose_rhs, out_dtype, name, block_sizes,
         interpret, recipe=None):
    offset, given = _offset_operand(group_offset)
    local = functools.partial(backend(name, recipe).gmm, transpose_rhs=transpose_rhs,
                              block_sizes=block_sizes, interpret=interpret)
    planner = layouts.gmm_planner(local, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                                  shapes=(lhs.shape, rhs.shape), offset_given=given)
    rule = layouts.GMM_TRANSPOSED_RULE if transpose_rhs else layouts.GMM_RULE
    out, = sharding.run(planner, (lhs, rhs, group_sizes, offset), rule=rule,
                        reduction_factors=("c", "e"), **sharding.backend_options(name, interpret))
    return out


def _tgmm(lhs, rhs, group_sizes, group_offset, kernel, *, out_dtype, name, block_sizes,
          interpret, recipe=None):
    offset, given = _offset_operand(group_offset)
    local = functools.partial(backend(name, recipe).tgmm, block_sizes=block_sizes, interpret=interpret)
    planner = layouts.tgmm_planner(local, out_dtype=out_dtype,
                                   shapes=(lhs.shape, rhs.shape, kernel.shape),
                                   offset_given=given)
    out, = sharding.run(planner, (lhs, rhs, group_sizes, offset, kernel), rule=layouts.TGMM_RULE,
                        reduction_factors=("m", "p", "q"),
                        **sharding.backend_options(name, interpret))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def project(x, kernel, group_sizes, group_offset, name, compute, block_sizes, interpret,
            recipe=None):
    """grouped projection through backend `name`; see the module docstring. group_offset:
    None, or the int32 index in group_sizes of kernel's first group. recipe: None, or
    "fp8" (e4m3 products of block-quantized operands)."""
    out, _ = _project_fwd(x, kernel, group_sizes, group_offset, name, compute, block_sizes,
                          interpret, recipe)
    return out


def _project_fwd(x, kernel, group_sizes, group_offset, name, compute, block_sizes, interpret,
                 recipe=None):
    # The fp8 recipe quantizes the operands as given: a cast to `compute` first would
    # round twice.
    xc, kc = (x, kernel) if recipe == "fp8" else (x.astype(compute), kernel.astype(compute))
    out = _gmm(xc, kc, group_sizes, group_offset, transpose_rhs=False, out_dtype=compute,
               name=name, block_sizes=block_sizes, interpret=interpret, recipe=recipe)
    # Input dtypes ride along as empty arrays (residuals must be pytrees of arrays).
    protos = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), kernel.dtype))
    return out, (xc, kc, group_sizes, group_offset, protos)


def _project_bwd(name, compute, block_sizes, interpret, recipe, residuals, dy):
    xc, kc, group_sizes, group_offset, (x_proto, k_proto) = residuals
    dy = dy.astype(compute)
    common = dict(name=name, block_sizes=block_sizes, interpret=interpret, recipe=recipe)
    dx_dtype = sharding.cotangent_dtype((dy, kc, group_sizes), xc, x_proto.dtype)
    dk_dtype = sharding.cotangent_dtype((xc, dy, group_sizes), kc, k_proto.dtype)
    dx = _gmm(dy, kc, group_sizes, group_offset, transpose_rhs=True, out_dtype=dx_dtype,
              **common)
    dk = _tgmm(xc, dy, group_sizes, group_offset, kc, out_dtype=dk_dtype, **common)
    dx = sharding.cotangent_like(dx, xc).astype(x_proto.dtype)
    dk = sharding.cotangent_like(dk, kc).astype(k_proto.dtype)
    return dx, dk, None, None


project.defvjp(_project_fwd, _project_bwd)
