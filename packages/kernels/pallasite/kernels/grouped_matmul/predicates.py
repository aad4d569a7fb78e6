"""`ragged_dot_runs`: whether the grouped-projection kernels compute the product asked for.

The kernels multiply compute-dtype operands on tensor cores (MXU on TPU) and sum in fp32.
- 16-bit compute (bf16, fp16): each product of two 16-bit numbers is exact in fp32, so
  the kernel's sum is what any precision asks for.
- fp32 compute: the tensor cores round the operands to TF32 (10-bit mantissa), which is
  what JAX's default precision means on GPU and TPU; only the default is accepted, in
  every spelling (None, Precision.DEFAULT, 'default', 'fastest', 'bfloat16',
  DotAlgorithmPreset.DEFAULT, or a `jax_default_matmul_precision` that says one of
  them). HIGH in every spelling ('high', 'tensorfloat32', 'bfloat16_3x'), HIGHEST
  ('highest', 'float32') and every other algorithm preset (TF32_TF32_F32 included) are
  refused: docs/grouped_projection.md has the table.
- An operand wider than fp32 (f64, i64) or x64 mode (the int32 group offsets would widen
  and the kernels' index math assumes int32) is refused.
Refusal means the caller takes the XLA path (jax.lax.ragged_dot), never a wrong answer.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.reference.grouped_projection import Dtype, PrecisionLike

_PRESETS = {preset.name.lower(): preset for preset in jax.lax.DotAlgorithmPreset}


def _dtype(operand: Any, what: str) -> np.dtype:
    """The dtype of an array, a dtype, or a dtype's name; TypeError naming `what`."""
    if operand is None:
        raise TypeError(f"{what} must be a dtype or an array; got None")
    try:
        return np.dtype(getattr(operand, "dtype", operand))
    except TypeError as e:
        raise TypeError(f"{what} must be a dtype or an array; got {operand!r}") from e


def _resolve(precision: Any, what: str):
    """A precision in any of its spellings as a jax.lax.Precision or DotAlgorithmPreset:
    None, the enums, their names in any case ('default', 'HIGH', 'tensorfloat32',
    'bf16_bf16_f32'), or a pair of them (lhs, rhs). TypeError for anything else."""
    if isinstance(precision, (jax.lax.Precision, jax.lax.DotAlgorithmPreset)):
        return precision
    if isinstance(precision, str):
        name = precision.strip().lower()
        if name in _PRESETS:
            return _PRESETS[name]
        try:
            return jax.lax.Precision(name)
        except ValueError:
            pass
        try:
            return jax.lax.Precision[name.upper()]
        except KeyError:
            pass
    raise TypeError(f"{what} must be None, a jax.lax.Precision, a DotAlgorithmPreset, one of "
                    f"their names, or a pair of them; got {precision!r}")


def _is_default(precision: Any) -> bool:
    """Whether `precision` asks for the default precision (what the kernels compute for
    fp32: TF32 on tensor cores). HIGH (= 'tensorfloat32', 'bfloat16_3x') and HIGHEST
    (= 'float32') ask for more than that one pass, and any explicit algorithm preset
    other than DEFAULT (TF32_TF32_F32 included) names an algorithm the kernels do not
    promise, so all of them are refused alike. None reads jax_default_matmul_precision."""
    if precision is None:
        configured = jax.config.jax_default_matmul_precision
        if configured is None:
            return True
        return _is_default(_resolve(configured, "jax_default_matmul_precision"))
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2:
            raise TypeError(f"precision must be one value or a pair; got {precision!r}")
        return all(_is_default(p) for p in precision)
    resolved = _resolve(precision, "precision")
    return resolved in (jax.lax.Precision.DEFAULT, jax.lax.DotAlgorithmPreset.DEFAULT)


def ragged_dot_runs(compute: Dtype, operands: Sequence[jax.Array | Dtype] = (),
                    precision: PrecisionLike = None) -> bool:
    """True when the Pallas kernels compute `compute`-dtype grouped products exactly as
    requested: 16-bit compute at any precision, fp32 compute at default precision only;
    never with operands wider than fp32 or in x64 mode. Every spelling of a precision
    gives the same answer; an argument that is not a dtype or a precision is a TypeError.
    """
    compute = _dtype(compute, "compute")
    if not jnp.issubdtype(compute, jnp.floating):
        raise TypeError(f"compute must be a floating dtype; got {compute}")
    widths = [_dtype(op, "operands[%d]" % i).itemsize for i, op in enumerate(operands)]
    default = _is_default(precision)  # checks the argument even where it does not matter
    if jax.config.jax_enable_x64 or any(w > 4 for w in widths):
        return False
    if compute in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return True
    return compute == jnp.dtype(jnp.float32) and default


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


# Measured on a TPU v5e (2026-12-07, docs/performance.md) at the default tiles, the Mosaic
# TPU kernels against pallasite's XLA path (the other default), ms forward and fwd+bwd:
# mixtral (4096 rows per group) 29.6/35.7, 81.8/155.5; qwen3 (512) 2.50/3.98, 7.09/12.71;
# 2, 8, 64 and 128 rows per group 2.02/3.23, 1.83/3.24, 2.49/3.82, 1.53/2.27 and
# 6.09/10.42, 5.95/10.37, 7.55/12.41, 4.50/7.33. One group (8192 x 2048 x 2048 and
# 4096 x 4096 x 14336): 0.607/0.486, 1.438/1.339 and 4.134/2.983, 10.898/8.688. So every
# grouped product takes the kernels; a single local group stays with XLA, whose path
# computes it as a dense dot (xla.py, ONE_GROUP), 7-28% faster.
def mosaic_tpu_preferred(local_groups: int) -> bool:
    """Whether a TPU's default order tries pallas_mosaic_tpu before xla, given the
    kernel's group count: with more than one group (one is a dense product)."""
    return local_groups > 1
