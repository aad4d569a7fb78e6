"""Platform predicates: the one place that says what the present device can run.

Every kernel selector keys on these functions; none inspects devices itself. Each takes an
optional `device` (anything with jax.Device's `platform`, `device_kind` and, on CUDA,
`compute_capability` attributes) so tests can fake hardware; by default it asks JAX for
the first device of the default backend.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp

# TPU device_kind strings as the runtimes report them, most specific first.
_TPU_KINDS = (
    (re.compile(r"v6\s*(lite|e)|trillium", re.I), "v6e"),
    (re.compile(r"v5\s*(lite|e)", re.I), "v5e"),
    (re.compile(r"v5\s*p|v5$", re.I), "v5p"),
    (re.compile(r"v4", re.I), "v4"),
    (re.compile(r"v3", re.I), "v3"),
    (re.compile(r"v2", re.I), "v2"),
)


# Shared memory one thread block may use (the opt-in maximum), KiB, per CUDA generation,
# from the CUDA C Programming Guide's table of compute capabilities. Defaults and
# admission follow these, not the H200's 227 KiB: an sm86 or sm89 GPU has 99 KiB.
SHARED_MEMORY_KIB = {"sm80": 163, "sm86": 99, "sm87": 163, "sm89": 99, "sm90": 227,
                     "sm100": 227, "sm120": 99}

# VMEM one Mosaic TPU program may hold: the scoped default is 16 MiB on v5e, 32 MiB on
# v6e; the kernels keep to the smaller, which every TPU generation has.
TPU_VMEM_BYTES = 16 * 1024 * 1024


def _default_device() -> Any:
    return jax.devices()[0]


def _cuda_capability(device: Any) -> tuple[int, int] | None:
    """(major, minor) for a CUDA device, None for anything else (ROCm has none)."""
    cc = getattr(device, "compute_capability", None)
    if device.platform not in ("gpu", "cuda") or not cc:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def device_generation(device: Any = None) -> str:
    """'sm90', 'sm89', ... for CUDA; 'v6e', 'v5e', 'v5p', 'v4', ... for TPU; else the platform.

    An unrecognised TPU kind gives 'tpu', a GPU without a CUDA capability (ROCm) 'gpu'.
    """
    device = device if device is not None else _default_device()
    cc = _cuda_capability(device)
    if cc is not None:
        return f"sm{cc[0]}{cc[1]}"
    if device.platform == "tpu":
        kind = getattr(device, "device_kind", "")
        for pattern, name in _TPU_KINDS:
            if pattern.search(kind):
                return name
        return "tpu"
    return device.platform


def compile_target(device: Any = None) -> str:
    """The platform a compiled (not interpreted) kernel targets on `device` (default:
    JAX's first), as the backends' `refusal(..., target=)` names it: 'cuda', 'rocm'
    (a GPU without a CUDA capability), 'tpu', or the platform ('cpu')."""
    device = device if device is not None else _default_device()
    if _cuda_capability(device) is not None:
        return "cuda"
    if device.platform == "gpu":
        return "rocm"
    return device.platform


def mosaic_tpu_interpret(interpret):
    """pallas_call's `interpret` for a Mosaic TPU kernel: True -> the TPU interpreter
    (default InterpretParams: unwritten outputs read as NaN), False -> compiled; an
    InterpretParams passes through."""
    if interpret is True:
        from jax.experimental.pallas import tpu as pltpu  # only where a kernel runs

        return pltpu.InterpretParams()
    return interpret or False


def mosaic_tpu_block_spec(block_shape, index_map, **kwargs):
    """pl.BlockSpec for a Mosaic TPU kernel, its index map returning int32 block indices.
    Under jax_enable_x64 a literal 0 in an index map traces as int64: the interpreter and
    the lowering take it, the TPU compiler does not ("failed to legalize operation
    'func.func'", seen on a TPU v5e, jax 0.10.2, 2026-12-06)."""
    from jax.experimental import pallas as pl  # only where a kernel is built

    def int32_indices(*args):
        return tuple(jnp.asarray(i, jnp.int32) for i in index_map(*args))

    return pl.BlockSpec(block_shape, int32_indices, **kwargs)


# Block dtypes a compiled Mosaic TPU kernel cannot load: the TPU compiler refused
# grouped_projection's fp16 blocks ("Invalid vector type for load", memref<128x128xf16> ->
# vector<8x128x2xf16>; a TPU v5e, jax 0.10.2, 2026-12-06). bf16 and fp32 blocks ran. The
# TPU interpreter takes every dtype.
MOSAIC_TPU_REFUSED_DTYPES = ("float16",)


def mosaic_tpu_dtype_reason(name: str, dtypes) -> str | None:
    """Why Mosaic TPU kernel `name` cannot take blocks of `dtypes` ({what: dtype}) on a
    TPU (None: it can, as far as this rule goes: each op checks its own dtypes). Callers
    ask only where the kernel compiles (not interpreted)."""
    bad = {what: jnp.dtype(d).name for what, d in dtypes.items()
           if jnp.dtype(d).name in MOSAIC_TPU_REFUSED_DTYPES}
    if not bad:
        return None
    return (f"{name} on a TPU takes no {' or '.join(MOSAIC_TPU_REFUSED_DTYPES)} blocks "
            f"(the TPU compiler does not load them), got "
            + ", ".join(f"{what} {dtype}" for what, dtype in bad.items()))


def triton_runs(device: Any = None) -> bool:
    """Pallas Triton kernels: a CUDA GPU from sm80 (Ampere), where bf16 mma exists."""
    device = device if device is not None else _default_device()
    cc = _cuda_capability(device)
    return cc is not None and cc >= (8, 0)


def mosaic_gpu_runs(device: Any = None) -> bool:
    """Mosaic GPU kernels (wgmma, TMA): Hopper, sm90, only; Blackwell has no wgmma."""
    device = device if device is not None else _default_device()
    return _cuda_capability(device) == (9, 0)


def fp8_runs(device: Any = None) -> bool:
    """fp8 (e4m3, e5m2) conversions and tensor-core products: a CUDA GPU from sm89 (Ada,
    Hopper and later). Triton refuses the float8_e4m3fn cast below sm89."""
    device = device if device is not None else _default_device()
    cc = _cuda_capability(device)
    return cc is not None and cc >= (8, 9)


def bf16_dot_runs(device: Any = None) -> bool:
    """A bf16 x bf16 -> fp32 dot runs natively: every TPU and CPU, a CUDA GPU from sm80."""
    device = device if device is not None else _default_device()
    if device.platform in ("tpu", "cpu"):
        return True
    return triton_runs(device)


def shared_memory_bytes(device: Any = None) -> int | None:
    """Shared memory per thread block of a CUDA device, in bytes; None off CUDA. A CUDA
    generation missing from SHARED_MEMORY_KIB gets the smallest budget listed."""
    device = device if device is not None else _default_device()
    if _cuda_capability(device) is None:
        return None
    kib = SHARED_MEMORY_KIB.get(device_generation(device), min(SHARED_MEMORY_KIB.values()))
    return kib * 1024


def triton_shared_memory_budget(device: Any = None) -> int:
    """The shared memory a Triton block config may use: the device's, or where the device
    is no CUDA GPU (the CPU interpreter, a lowering for a GPU not known here) the smallest
    budget of any generation from sm80, so that the choice fits every GPU Triton runs on."""
    own = shared_memory_bytes(device)
    if own is not None:
        return own
    return min(kib for gen, kib in SHARED_MEMORY_KIB.items() if int(gen[2:]) >= 80) * 1024


def named_implementations(implementation, known: tuple[str, ...], note: str = "") -> list[str]:
    """The implementations to try, in order: `known` for None, else the one name or the
    sequence given (ValueError for an empty one or an unknown name, listing `known`)."""
    if implementation is None:
        return list(known)
    names = [implementation] if isinstance(implementation, str) else list(implementation)
    if not names or any(n not in known for n in names):
        raise ValueError(f"implementation={implementation!r}: one of {known}, a sequence of "
                         f"them, or None{note}")
    return names
