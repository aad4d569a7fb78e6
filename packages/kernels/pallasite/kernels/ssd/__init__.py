"""Mamba-2 SSD chunked scan: custom_vjp scan, user-facing chunk_ssd, backend predicates.

Backends (one file each, same forward/backward contract): xla (plain JAX, the fallback and
the backward oracle), pallas_mosaic_tpu, pallas_triton (GPU). See docs/ssd.md.
"""

from pallasite.kernels.ssd.api import chunk_ssd, ssd_chunk_scan
from pallasite.kernels.ssd.predicates import (
    ssd_kernel_platform,
    ssd_kernel_reason,
    ssd_kernel_runs,
)

__all__ = [
    "chunk_ssd",
    "ssd_chunk_scan",
    "ssd_kernel_platform",
    "ssd_kernel_reason",
    "ssd_kernel_runs",
]
