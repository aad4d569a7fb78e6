"""When the chunked gated delta rule's Pallas Triton kernels serve a call, and why not.

Two questions, asked together by `pallas_triton_reason`:
- the device: a CUDA GPU from sm80 (platform.triton_runs), or a CPU where the caller
  named the kernels (they then run through the Triton interpreter: tests, not speed);
- the problem (pallas_triton.geometry_reason): K and V powers of two in [16, 256], a
  chunk of 16, 32 or 64 steps, inputs in bf16, fp16 or fp32, at least one step.
The default order (api.IMPLEMENTATIONS) takes the kernels wherever both hold, else XLA.
"""

from __future__ import annotations

import jax

from pallasite.kernels import platform
from pallasite.kernels.gated_delta import pallas_mosaic_tpu, pallas_triton


def check_block_sizes(block_sizes) -> None:
    """TypeError for anything but None or a dict, ValueError for a dict the kernels do
    not take (unknown keys, sizes that are not powers of two from 16)."""
    if block_sizes is None:
        return
    if not isinstance(block_sizes, dict):
        raise TypeError(f"block_sizes must be None or a dict with keys from "
                        f"{pallas_triton.BLOCK_SIZE_KEYS}; got {block_sizes!r}")
    why = pallas_triton.block_sizes_reason(block_sizes)
    if why is not None:
        raise ValueError(f"block_sizes {block_sizes!r}: {why}")


def device_reason(named: bool, device=None) -> str | None:
    """Why the kernels cannot run on `device` (JAX's first by default); None where they
    can: compiled on a CUDA GPU from sm80, interpreted on a CPU when `named`."""
    if platform.triton_runs(device):
        return None
    generation = platform.device_generation(device)
    if generation == "cpu":
        return None if named else "on a CPU pallas_triton runs interpreted, only when named"
    return f"pallas_triton needs a CUDA GPU from sm80; the device is {generation}"


def pallas_triton_reason(q, k, v, g, beta, chunk_size, block_sizes=None, *,
                         named: bool = False, device=None) -> str | None:
    """None where pallas_triton serves chunk_gated_delta_rule on these (validated)
    arguments; else why not."""
    del block_sizes  # any valid dict fits: its sizes are cut to V
    why = device_reason(named, device)
    if why is not None:
        return why
    if q.shape[1] == 0:
        return "T = 0: no steps to compute"
    return pallas_triton.geometry_reason(
        q.shape[3], v.shape[3], chunk_size,
        {"q": q.dtype, "k": k.dtype, "v": v.dtype, "g": g.dtype, "beta": beta.dtype})


def pallas_mosaic_tpu_reason(q, k, v, g, beta, chunk_size, *, named: bool = False,
                             device=None) -> str | None:
    """None where pallas_mosaic_tpu serves chunk_gated_delta_rule: on a TPU, or on a CPU
    when named (the TPU interpreter); a chunk that is a multiple of 8; bf16, fp16 or fp32
    inputs (v not fp16 on a TPU: platform.MOSAIC_TPU_REFUSED_DTYPES). Never by default: it
    runs only where a caller names it."""
    device = device if device is not None else jax.devices()[0]
    if not named:
        return "pallas_mosaic_tpu runs only where named (no TPU measurement yet)"
    if device.platform not in ("tpu", "cpu"):
        return (f"pallas_mosaic_tpu needs a TPU (or a CPU, interpreted); the device is "
                f"{platform.device_generation(device)}")
    if q.shape[1] == 0:
        return "T = 0: no steps to compute"
    if device.platform == "tpu":  # q, k, v reach the kernels in fp32; o leaves in v's dtype
        reason = platform.mosaic_tpu_dtype_reason("pallas_mosaic_tpu", {"v": v.dtype})
        if reason:
            return reason
    return pallas_mosaic_tpu.geometry_reason(
        q.shape[3], v.shape[3], chunk_size,
        {"q": q.dtype, "k": k.dtype, "v": v.dtype, "g": g.dtype, "beta": beta.dtype})
