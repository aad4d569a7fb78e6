"""Platform predicates: every branch on faked devices, and the real GPU under -m gpu."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest

from pallasite.kernels import platform


@dataclass
class FakeDevice:
    platform: str
    device_kind: str = ""
    compute_capability: str | None = None


CASES = [
    # device, generation, bf16_dot, triton, mosaic_gpu
    (FakeDevice("gpu", "NVIDIA H200", "9.0"), "sm90", True, True, True),
    (FakeDevice("gpu", "NVIDIA H100 80GB HBM3", "9.0"), "sm90", True, True, True),
    (FakeDevice("cuda", "NVIDIA L4", "8.9"), "sm89", True, True, False),
    (FakeDevice("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), "sm80", True, True, False),
    (FakeDevice("gpu", "NVIDIA B200", "10.0"), "sm100", True, True, False),
    (FakeDevice("gpu", "Tesla V100", "7.0"), "sm70", False, False, False),
    (FakeDevice("gpu", "Tesla T4", "7.5"), "sm75", False, False, False),
    (FakeDevice("gpu", "AMD Instinct MI300X", None), "gpu", False, False, False),
    (FakeDevice("tpu", "TPU v6 lite"), "v6e", True, False, False),
    (FakeDevice("tpu", "TPU v6e"), "v6e", True, False, False),
    (FakeDevice("tpu", "TPU v5 lite"), "v5e", True, False, False),
    (FakeDevice("tpu", "TPU v5e"), "v5e", True, False, False),
    (FakeDevice("tpu", "TPU v5p"), "v5p", True, False, False),
    (FakeDevice("tpu", "TPU v5"), "v5p", True, False, False),
    (FakeDevice("tpu", "TPU v4"), "v4", True, False, False),
    (FakeDevice("tpu", "TPU v3"), "v3", True, False, False),
    (FakeDevice("tpu", "TPU v7x"), "tpu", True, False, False),
    (FakeDevice("cpu", "cpu"), "cpu", True, False, False),
    (FakeDevice("METAL", "Apple M3"), "METAL", False, False, False),
]


@pytest.mark.parametrize("device,generation,bf16,triton,mosaic_gpu", CASES, ids=lambda c: getattr(c, "device_kind", None))
def test_predicates_on_faked_devices(device, generation, bf16, triton, mosaic_gpu):
    assert platform.device_generation(device) == generation
    assert platform.bf16_dot_runs(device) is bf16
    assert platform.triton_runs(device) is triton
    assert platform.mosaic_gpu_runs(device) is mosaic_gpu


@pytest.mark.parametrize("device,target", [
    (FakeDevice("gpu", "NVIDIA H200", "9.0"), "cuda"),
    (FakeDevice("cuda", "NVIDIA L4", "8.9"), "cuda"),
    (FakeDevice("gpu", "AMD Instinct MI300X", None), "rocm"),
    (FakeDevice("tpu", "TPU v5 lite"), "tpu"),
    (FakeDevice("cpu", "cpu"), "cpu"),
], ids=lambda c: getattr(c, "device_kind", None))
def test_compile_target_on_faked_devices(device, target):
    """The platform a compiled kernel targets, as the backends' refusals name it."""
    assert platform.compile_target(device) == target


def test_mosaic_tpu_block_dtypes():
    """fp16 blocks are refused on a TPU (its compiler does not load them), by name."""
    assert platform.mosaic_tpu_dtype_reason("k", {"x": jnp.bfloat16, "y": jnp.float32}) is None
    why = platform.mosaic_tpu_dtype_reason("k", {"x": jnp.float16, "y": jnp.float32})
    assert why is not None and "x float16" in why and "y" not in why.split("got")[1]


def test_default_device_is_the_first_jax_device():
    assert platform.device_generation() == platform.device_generation(jax.devices()[0])


def test_cpu_host():
    cpu = jax.devices("cpu")[0]
    assert platform.device_generation(cpu) == "cpu"
    assert platform.bf16_dot_runs(cpu)
    assert not platform.triton_runs(cpu)
    assert not platform.mosaic_gpu_runs(cpu)


@pytest.mark.gpu
def test_real_gpu():
    gpu = jax.devices("gpu")[0]
    major, minor = (int(v) for v in gpu.compute_capability.split("."))
    assert platform.device_generation(gpu) == f"sm{major}{minor}"
    assert platform.triton_runs(gpu) is (major >= 8)
    assert platform.bf16_dot_runs(gpu) is (major >= 8)
    assert platform.mosaic_gpu_runs(gpu) is ((major, minor) == (9, 0))
    if "H200" in gpu.device_kind or "H100" in gpu.device_kind:
        assert platform.device_generation(gpu) == "sm90"
        assert platform.mosaic_gpu_runs(gpu)
