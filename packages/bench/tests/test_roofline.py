"""Roofline table lookups per device generation and the bound classification."""

import types

import pytest

from pallasite.bench import roofline


@pytest.mark.parametrize(
    "generation, kind, name, bf16, tbps",
    [
        ("sm90", "NVIDIA H200", "NVIDIA H200 SXM", 989.4, 4.8),
        ("sm90", "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5", 989.4, 3.35),
        ("sm90", "NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 756.0, 2.0),
        ("sm80", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB SXM", 312.0, 2.039),
        ("sm80", "NVIDIA A100-SXM4-40GB", "NVIDIA A100 40GB", 312.0, 1.555),
        ("sm89", "NVIDIA L4", "NVIDIA L4", 121.0, 0.3),
        ("sm89", "NVIDIA GeForce RTX 4080", "NVIDIA GeForce RTX 4080", 97.5, 0.717),
        ("v4", "TPU v4", "TPU v4", 275.0, 1.2),
        ("v5e", "TPU v5 lite", "TPU v5e", 197.0, 0.819),
        ("v5p", "TPU v5p", "TPU v5p", 459.0, 2.765),
        ("v6e", "TPU v6 lite", "TPU v6e (Trillium)", 918.0, 1.64),
    ],
)
def test_lookup_datasheet_figures(generation, kind, name, bf16, tbps):
    roof = roofline.lookup(generation, kind)
    assert roof.name == name
    assert roof.peak_tflops("bfloat16") == bf16
    assert roof.tbps == tbps
    assert roof.source  # every entry cites where its figures come from
    assert roof.l2_bytes > 0


def test_cpu_and_unlisted_devices():
    assert roofline.lookup("cpu", "cpu").name.startswith("CPU")
    assert "unlisted GPU" in roofline.lookup("sm120", "NVIDIA RTX PRO 6000").name
    assert "unlisted TPU" in roofline.lookup("tpu", "TPU v9").name


def test_for_device_keys_on_device_generation():
    fake = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200",
                                 compute_capability="9.0")
    assert roofline.for_device(fake).name == "NVIDIA H200 SXM"
    tpu = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    assert roofline.for_device(tpu).name == "TPU v5e"


def test_classify_compute_and_memory_bound():
    roof = roofline.lookup("sm90", "NVIDIA H200")
    # TARGETS mixtral forward: 3.85e15/1e15... intensity far above the ridge (~206 flop/B).
    flops, nbytes = 2 * 32768 * 4096 * 14336, 1.5e9
    c = roofline.classify(flops, nbytes, "bfloat16", roof, seconds=flops / 500e12)
    assert c.bound == "compute"
    assert c.attainable_s == pytest.approx(flops / 989.4e12)
    assert c.fraction == pytest.approx(500 / 989.4)
    assert c.ridge == pytest.approx(989.4 / 4.8)
    # An elementwise-like op: 1 flop per 4 bytes is memory bound.
    m = roofline.classify(1e9, 4e9, "bfloat16", roof, seconds=2e-3)
    assert m.bound == "memory"
    assert m.attainable_s == pytest.approx(4e9 / 4.8e12)
    assert m.fraction == pytest.approx(4e9 / 4.8e12 / 2e-3)
    assert roofline.classify(1e9, 4e9, "bfloat16", roof).fraction is None


def test_fp32_uses_tf32_peak_on_nvidia():
    roof = roofline.lookup("sm90", "NVIDIA H100 80GB HBM3")
    assert roof.peak_tflops("float32") == 494.7


def test_measure_ceilings_on_cpu_is_small_and_positive():
    roof = roofline.measure_ceilings(matmul_n=128, copy_bytes=1 << 20, repeats=3)
    assert roof.peak_tflops("bfloat16") > 0 and roof.tbps > 0
    assert roof.source.startswith("measured")
