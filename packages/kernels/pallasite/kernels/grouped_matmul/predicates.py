"""`ragged_dot_runs`: whether the grouped-projection kernels compute the product asked for.

The kernels multiply compute-dtype operands on tensor cores (MXU on TPU) and sum in fp32.
- 16-bit compute (bf16, fp16): each product of two 16-bit numbers is exact in fp32, so
  the kernel's sum is what any precision asks for.
- fp32 compute: the tensor cores round the operands to TF32 (10-bit mantissa), which is
  what JAX's default precision means on GPU and TPU; HIGH/HIGHEST (or a
  `jax_default_matmul_precision` that asks for them) want more, so they are refused.
- An operand wider than fp32 (f64, i64) or x64 mode (the int32 group offsets would widen
  and the kernels' index math assumes int32) is refused.
Refusal means the caller takes the XLA path (jax.lax.ragged_dot), never a wrong answer.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# jax_default_matmul_precision values that mean "TF32 or less on fp32 operands".
_DEFAULT_NAMES = (None, "default", "fastest", "bfloat16", "tensorfloat32", "DEFAULT")


def _dtype(operand: Any) -> np.dtype:
    return np.dtype(getattr(operand, "dtype", operand))


def _is_default(precision: Any) -> bool:
    if precision is None:
        return jax.config.jax_default_matmul_precision in _DEFAULT_NAMES
    if isinstance(precision, (tuple, list)):
        return all(_is_default(p) for p in precision)
    if isinstance(precision, str):
        return precision.lower() in ("default", "fastest", "bfloat16", "tensorfloat32")
    if precision == jax.lax.Precision.DEFAULT:
        return True
    if precision == jax.lax.DotAlgorithmPreset.DEFAULT:
        return True
    return False


def ragged_dot_runs(compute: Any, operands: Sequence[Any] = (), precision: Any = None) -> bool:
    """True when the Pallas kernels compute `compute`-dtype grouped products exactly as
    requested: 16-bit compute at any precision, fp32 compute at default precision only;
    never with operands wider than fp32 or in x64 mode."""
    if jax.config.jax_enable_x64:
        return False
    if any(_dtype(op).itemsize > 4 for op in operands):
        return False
    compute = _dtype(compute)
    if compute in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return True
    if compute == jnp.dtype(jnp.float32):
        return _is_default(precision)
    return False


# Average rows per group (m / g) from which the default order puts the Mosaic GPU kernels
# ahead of the Triton ones on Hopper. Measured on one H200 in bench runs of the
# warp-specialised kernels (2026-11-30 18:2x UTC, docs/performance.md, issue 7),
# bf16 TFLOP/s Mosaic GPU / Triton, forward and fwd+bwd: mixtral (4096 rows per group)
# 643/585, 630/543; qwen3 and olmoe (512) 472/368 and 474/429, 422/340 and 427/389; dsv3
# (256) 497/477, 364/350; dsv3 with 90% of rows in one group 430/431, 350/333. Below 256,
# Triton: mixtral at m=1024 (128) 318/304 forward but 249/278 fwd+bwd; 8 rows per group
# 32/33, 22/26. (The one-warpgroup kernels of the 17:00 UTC runs needed 512.)
MOSAIC_GPU_MIN_ROWS_PER_GROUP = 256


def mosaic_gpu_preferred(m: int, g: int) -> bool:
    """Whether the default order tries pallas_mosaic_gpu before pallas_triton for an
    [m, k] x [g, k, n] projection: m / g >= MOSAIC_GPU_MIN_ROWS_PER_GROUP. The group sizes
    themselves are traced values; only the static average is known when choosing."""
    return m >= MOSAIC_GPU_MIN_ROWS_PER_GROUP * max(g, 1)
