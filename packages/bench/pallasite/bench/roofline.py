"""Roofline model: datasheet ceilings per device generation, measured ceilings, bound class.

A record's roofline fraction is `attainable_time / measured_time`, where the attainable time
is `max(flops / peak_rate, bytes / bandwidth)` for the operation's declared flops and
minimum bytes. The larger term names the bound ("compute" or "memory").

The figures below are the vendors' dense (no 2:4 sparsity) peaks; each entry carries its
source. Datasheet peaks are optimistic: on one H200 (docs/targets.md, 2026-11-30) an 8192^3 bf16
matmul through XLA reached 594 TFLOP/s (PyTorch about 790) of the 989 quoted, and a copy
4.3 TB/s of the 4.8 quoted, so `--measure-ceilings` replaces them with measurements.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any

# Every peak in TFLOP/s, bandwidth in TB/s, caches in bytes.
_MB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The ceilings of one device: matrix rate per operand dtype and memory bandwidth."""

    name: str
    tflops: dict[str, float]  # operand dtype -> dense peak (fp32 means TF32 on NVIDIA)
    tbps: float  # main-memory bandwidth
    l2_bytes: int  # last-level on-chip cache the input rotation must defeat
    source: str  # where the figures come from

    def peak_tflops(self, dtype: str) -> float:
        return self.tflops.get(dtype, self.tflops["bfloat16"])


def _gpu(name, bf16, tf32, tbps, l2_mb, source, fp8=None):
    """fp8: the e4m3 tensor rate where the generation has one (sm89 and later: twice bf16)."""
    rates = {"bfloat16": bf16, "float16": bf16, "float32": tf32}
    if fp8:
        rates["fp8"] = fp8
    return Roofline(name, rates, tbps, l2_mb * _MB, source)


def _tpu(name, bf16, tbps, source):
    # TPUs run fp32 matmuls at default precision as one bf16 pass, so fp32 shares bf16's peak.
    # The vector memory (VMEM, 16-128 MiB) is software managed; rotation sizes against 32 MiB.
    return Roofline(name, {"bfloat16": bf16, "float16": bf16, "float32": bf16}, tbps,
                    32 * _MB, source)


# (device_generation, device_kind pattern, roofline); first match wins.
_TABLE: tuple[tuple[str, str, Roofline], ...] = (
    ("sm90", r"H200", _gpu(
        "NVIDIA H200 SXM", 989.4, 494.7, 4.8, 60,
        "NVIDIA H200 Tensor Core GPU datasheet (2024): BF16/FP16 1979 TFLOPS, FP8 3958 and "
        "TF32 989 TFLOPS with sparsity (dense = half), HBM3e 4.8 TB/s; L2 as PyTorch "
        "reports it", fp8=1978.9)),
    ("sm90", r"H100.*PCIe", _gpu(
        "NVIDIA H100 PCIe", 756.0, 378.0, 2.0, 50,
        "NVIDIA H100 Tensor Core GPU datasheet (2023), PCIe column: BF16 1513 / FP8 3026 / "
        "TF32 756 TFLOPS with sparsity, HBM2e 2.0 TB/s; L2 50 MB (Hopper whitepaper)",
        fp8=1513.0)),
    ("sm90", r"H100|GH200|H800", _gpu(
        "NVIDIA H100 SXM5", 989.4, 494.7, 3.35, 50,
        "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM column: BF16 1979 / FP8 3958 / "
        "TF32 989 TFLOPS with sparsity, HBM3 3.35 TB/s; L2 50 MB (Hopper whitepaper)",
        fp8=1978.9)),
    ("sm80", r"A100.*40GB", _gpu(
        "NVIDIA A100 40GB", 312.0, 156.0, 1.555, 40,
        "NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312, TF32 156 TFLOPS dense, "
        "HBM2 1555 GB/s; L2 40 MB (Ampere whitepaper)")),
    ("sm80", r"A100|A800", _gpu(
        "NVIDIA A100 80GB SXM", 312.0, 156.0, 2.039, 40,
        "NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312, TF32 156 TFLOPS dense, "
        "HBM2e 2039 GB/s (80GB SXM); L2 40 MB (Ampere whitepaper)")),
    ("sm89", r"L4\b", _gpu(
        "NVIDIA L4", 121.0, 60.0, 0.3, 48,
        "NVIDIA L4 Tensor Core GPU datasheet (2023): BF16 242 / TF32 120 TFLOPS with "
        "sparsity, GDDR6 300 GB/s; L2 48 MB (Ada whitepaper)")),
    ("sm89", r"RTX 40|RTX 4080|4090|4070|Ada", _gpu(
        "NVIDIA GeForce RTX 4080", 97.5, 48.7, 0.717, 64,
        "NVIDIA Ada Lovelace GPU architecture whitepaper v1.1, appendix table for RTX 4080: "
        "FP16/BF16 tensor with FP32 accumulate 97.5 TFLOPS dense, TF32 48.7, GDDR6X 716.8 "
        "GB/s, L2 64 MB")),
    ("v6e", r"", _tpu(
        "TPU v6e (Trillium)", 918.0, 1.64,
        "cloud.google.com/tpu/docs/v6e: 918 TFLOPS bf16 per chip, HBM 1640 GBps")),
    ("v5p", r"", _tpu(
        "TPU v5p", 459.0, 2.765,
        "cloud.google.com/tpu/docs/v5p: 459 TFLOPS bf16 per chip, HBM 2765 GBps")),
    ("v5e", r"", _tpu(
        "TPU v5e", 197.0, 0.819,
        "cloud.google.com/tpu/docs/v5e: 197 TFLOPS bf16 per chip, HBM 819 GBps")),
    ("v4", r"", _tpu(
        "TPU v4", 275.0, 1.2,
        "cloud.google.com/tpu/docs/v4: 275 TFLOPS bf16 per chip, HBM 1200 GBps")),
)


def cpu_roofline(cores: int | None = None) -> Roofline:
    """A nominal CPU ceiling (there is no datasheet for 'a CPU'); measure it to be exact.

    cores x 3 GHz x 32 fp32 FLOP/cycle (two AVX2 FMA units of 8 lanes) and 20 GB/s, one
    DDR4 channel's worth. XLA:CPU runs bf16 dots through fp32, so all dtypes share the rate.
    """
    cores = cores or os.cpu_count() or 1
    rate = cores * 3.0e9 * 32 / 1e12
    return Roofline(f"CPU ({cores} cores, nominal)",
                    {"bfloat16": rate, "float16": rate, "float32": rate}, 0.02, 32 * _MB,
                    "nominal: cores x 3 GHz x 32 FLOP/cycle (AVX2 FMA), 20 GB/s; not a "
                    "datasheet, use --measure-ceilings")


def lookup(generation: str, device_kind: str) -> Roofline:
    """The roofline for a device_generation ('sm90', 'v5e', 'cpu', ...) and device_kind."""
    for gen, pattern, roof in _TABLE:
        if gen == generation and re.search(pattern, device_kind or "", re.I):
            return roof
    for gen, pattern, roof in _TABLE:  # right kind string, generation not in the table
        if pattern and re.search(pattern, device_kind or "", re.I):
            return roof
    if generation.startswith("sm") or generation == "gpu":
        # An unlisted GPU: the H100 SXM figures overstate it, so fractions read low, not high.
        roof = _TABLE[2][2]
        return dataclasses.replace(roof, name=f"unlisted GPU {device_kind!r} (H100 figures)")
    if generation in ("tpu",) or generation.startswith("v"):
        roof = _TABLE[7][2]
        return dataclasses.replace(roof, name=f"unlisted TPU {device_kind!r} (v6e figures)")
    return cpu_roofline()


def for_device(device: Any = None) -> Roofline:
    """The roofline of `device` (default: JAX's first device), keyed on device_generation."""
    import jax

    from pallasite.kernels.platform import device_generation

    device = device if device is not None else jax.devices()[0]
    return lookup(device_generation(device), getattr(device, "device_kind", ""))


@dataclasses.dataclass(frozen=True)
class Classification:
    bound: str  # "compute" or "memory"
    attainable_s: float  # max(flops / peak, bytes / bandwidth)
    fraction: float | None  # attainable_s / measured time; None without a time
    intensity: float  # flops per byte
    ridge: float  # the intensity where the two ceilings meet


def classify(flops: float, nbytes: float, dtype: str, roof: Roofline,
             seconds: float | None = None) -> Classification:
    """Which ceiling bounds an op of `flops` and `nbytes`, and the fraction of it reached."""
    compute_s = flops / (roof.peak_tflops(dtype) * 1e12)
    memory_s = nbytes / (roof.tbps * 1e12)
    attainable = max(compute_s, memory_s)
    fraction = attainable / seconds if seconds else None
    return Classification(
        bound="compute" if compute_s >= memory_s else "memory",
        attainable_s=attainable,
        fraction=fraction,
        intensity=flops / nbytes if nbytes else float("inf"),
        ridge=roof.peak_tflops(dtype) / roof.tbps,
    )


def _median_time(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_ceilings(device: Any = None, *, matmul_n: int | None = None,
                     copy_bytes: int | None = None, repeats: int = 10) -> Roofline:
    """Measure a large bf16 matmul and a large copy on `device`; return that roofline.

    Defaults: 8192^3 and 2 GiB on an accelerator, 1024^3 and 64 MiB on a CPU. The copy
    counts bytes read plus bytes written. fp32 gets the bf16 rate measured at default
    precision (TF32 on NVIDIA), which is what the kernels run.
    """
    import jax
    import jax.numpy as jnp

    device = device if device is not None else jax.devices()[0]
    on_cpu = device.platform == "cpu"
    n = matmul_n or (1024 if on_cpu else 8192)
    nbytes = copy_bytes or ((64 if on_cpu else 2048) * _MB)
    key = jax.random.key(0)
    a = jax.device_put(jax.random.normal(key, (n, n), jnp.bfloat16), device)
    b = jax.device_put(jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16), device)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)
                     .astype(jnp.bfloat16))
    t_mm = _median_time(matmul, (a, b), repeats)
    src = jax.device_put(jax.random.normal(key, (nbytes // 4,), jnp.float32), device)
    copy = jax.jit(lambda x: x * 2.0)  # an elementwise pass: read once, write once
    t_cp = _median_time(copy, (src,), repeats)
    base = for_device(device)
    rate = 2 * n**3 / t_mm / 1e12
    return Roofline(
        name=f"{base.name} (measured)",
        tflops={"bfloat16": rate, "float16": rate, "float32": rate},
        tbps=2 * nbytes / t_cp / 1e12,
        l2_bytes=base.l2_bytes,
        source=f"measured: {n}^3 bf16 matmul {rate:.1f} TFLOP/s, {nbytes >> 20} MiB "
               f"elementwise copy {2 * nbytes / t_cp / 1e12:.3f} TB/s (median of {repeats})",
    )
