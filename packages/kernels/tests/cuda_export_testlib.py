"""A function exported for CUDA from a host with no GPU, as MLIR text.

The CPU tests check that the GPU kernels lower for an H200 (Triton's and Mosaic GPU's
lowerings run; nothing is compiled): jax.export for platforms=["cuda"] under an abstract
mesh of one GPU, whose device kind the lowerings read in place of a device. Triton's custom
call has no compatibility guarantee, so its export check is disabled; Mosaic GPU's call
needs no such exception.
"""

from __future__ import annotations

import jax
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh

TRITON_CALL = "__gpu$xla.gpu.triton"


def gpu_mesh(device_kind: str = "NVIDIA H200"):
    """A context manager: the abstract mesh of one CUDA GPU of `device_kind`."""
    return jax.sharding.use_abstract_mesh(
        AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind, None, "cuda")))


def cuda_module(fn, *args, device_kind: str = "NVIDIA H200", allow_triton: bool = True) -> str:
    """The MLIR text of jax.jit(fn)(*args) exported for CUDA under gpu_mesh(device_kind).
    allow_triton=False leaves the custom-call check on: the export then fails on a Triton
    call (the Mosaic GPU lowering tests, whose functions must hold none)."""
    checks = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)] if allow_triton else []
    with gpu_mesh(device_kind):
        return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
            *args).mlir_module()
