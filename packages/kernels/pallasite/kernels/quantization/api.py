"""`quantize`: block-scaled fp8 arrays, and which quantizer runs where.

Backends, in order: pallas_triton (CUDA from sm89, where Triton casts to fp8; one pass,
docs/fp8.md has its bandwidth), then xla (the oracle's plain-JAX form) everywhere else.
The Pallas kernels serve the block shapes the fp8 products read: (1, 128) and (128, 1) on
matrices, (1, 128, 128) on stacks of matrices; any other block shape takes the XLA path.
The choice is made per lowering platform (jax.lax.platform_dependent), as for the other
operations. `implementation=` takes a name, a sequence tried in order, or None.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from pallasite.kernels import platform
from pallasite.kernels.quantization import pallas_triton, xla
from pallasite.kernels.quantization.block_scaled import BlockScaled
from pallasite.reference import quantization as ref

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("pallas_triton", "xla")
BLOCK = ref.TOKEN_BLOCK
ROWS = (1, BLOCK)  # 1 x 128 along the last axis: activations and output gradients
COLUMNS = (BLOCK, 1)  # 128 x 1 along the rows: the weight gradient's operands
WEIGHTS = (1, BLOCK, BLOCK)  # one scale per 128 x 128 block of each group's kernel


def quantizer(interpret: bool) -> ModuleType:
    """The module the fp8 kernels quantize their operands with: the Pallas kernels where
    they run (an fp8-capable GPU, or the CPU interpreter), else the XLA forms."""
    return pallas_triton if interpret or platform.fp8_runs() else xla


def _kernel_shape(shape: tuple[int, ...], block: tuple[int, ...]) -> bool:
    return (len(shape) == 2 and block in (ROWS, COLUMNS)) or (len(shape) == 3 and block == WEIGHTS)


def _quantize_with(backend: ModuleType, x, block, dtype, interpret: bool):
    """values and scales in the public layout (x's shape; scales ceil(shape / block))."""
    if backend is xla or not _kernel_shape(x.shape, block):
        return ref.quantize_blocks(x, block, dtype)
    if block == ROWS:
        values, scales_t = backend.rows(x, dtype, interpret=interpret)
        return values, scales_t.T
    if block == WEIGHTS:
        return backend.weight_blocks(x, dtype, transpose=False, interpret=interpret)
    m = x.shape[0]  # COLUMNS: plain 128-row blocks from row 0
    bound = -(-m // BLOCK)
    start = jnp.arange(bound, dtype=jnp.int32) * BLOCK
    rows = jnp.minimum(m - start, BLOCK).astype(jnp.int32)
    return backend.token_blocks(x, start, rows, dtype, transpose=False, interpret=interpret)


def _refusal(name: str, interpret: bool) -> str | None:
    if name == "xla" or interpret:
        return None
    if not platform.fp8_runs():
        return (f"{name} needs a CUDA GPU from sm89 (fp8 conversions); the device is "
                f"{platform.device_generation()}")
    return None


def _check_names(implementation) -> list[str]:
    names = [implementation] if isinstance(implementation, str) else list(implementation)
    unknown = [n for n in names if n not in IMPLEMENTATIONS]
    if not names or unknown:
        raise ValueError(f"implementation={implementation!r}: need names from {IMPLEMENTATIONS}")
    return names


def _in_order(names, x, block, dtype, interpret):
    errors = []
    for name in names:
        try:
            if (why := _refusal(name, interpret)) is not None:
                raise RuntimeError(why)
            backend = xla if name == "xla" else pallas_triton
            return _quantize_with(backend, x, block, dtype, interpret)
        except Exception as e:  # noqa: BLE001 - every backend's failure is reported
            if len(names) == 1:
                raise
            errors.append(e)
            log.warning("quantize: %s failed (%s: %s)", name, type(e).__name__, e)
    raise ExceptionGroup(f"quantize: every implementation failed: {names}", errors)


def quantize(
    x: Float[Array, "..."],
    block_shape: Sequence[int],
    dtype=jnp.float8_e4m3fn,
    *,
    implementation: str | Sequence[str] | None = None,
    interpret_on_cpu: bool = False,
) -> BlockScaled:
    """x as fp8 values with one fp32 scale per block of `block_shape`.

    scale = amax(|block|) / max finite of dtype (448 for e4m3); values = x / scale
    rounded to dtype. An all-zero block gets scale 1 and zero values; a block holding a
    NaN or an infinity gets a non-finite scale (so it stays inside that block). The last
    block along a dimension may be partial: the scales cover it. Usual shapes: (1, 128)
    for activations [m, k], (1, 128, 128) for kernels [g, k, n], (128, 1) for operands
    contracted over tokens. Not differentiable (a straight-through gradient is what
    grouped_projection's recipe="fp8" gives).
    """
    if not hasattr(x, "shape") or not jnp.issubdtype(getattr(x, "dtype", None), jnp.floating):
        raise TypeError(f"quantize: x must be a floating-point array, got {type(x).__name__} "
                        f"of dtype {getattr(x, 'dtype', None)}")
    block = ref.check_block_shape(x.shape, block_shape)
    if np.dtype(dtype) not in [np.dtype(d) for d in ref.FP8_DTYPES]:
        raise TypeError(f"quantize: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    dtype = np.dtype(dtype)
    if 0 in x.shape:
        values, scales = ref.quantize_blocks(x, block, dtype)
        return BlockScaled(values, scales, block)
    if implementation is not None:
        interpret = bool(interpret_on_cpu) and jax.default_backend() == "cpu"
        values, scales = _in_order(_check_names(implementation), x, block, dtype, interpret)
        return BlockScaled(values, scales, block)

    def branch(interpret: bool, kernels: bool):
        def run(x):
            if kernels and _refusal("pallas_triton", interpret) is None:
                return _quantize_with(pallas_triton, x, block, dtype, interpret)
            return ref.quantize_blocks(x, block, dtype)
        return run

    values, scales = jax.lax.platform_dependent(
        x, cuda=branch(False, True), cpu=branch(True, bool(interpret_on_cpu)),
        default=branch(False, False))
    return BlockScaled(values, scales, block)
