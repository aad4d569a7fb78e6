"""grouped_projection's public API: selection, fallbacks, errors, predicates, sharding,
and lowering for CUDA (Triton) and TPU (Mosaic) from this CPU host."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.export import DisabledSafetyCheck

from cuda_export_testlib import TRITON_CALL, cuda_module, gpu_mesh
from grouped_projection_testlib import CPU_CASES, check_case, draw
from pallasite.kernels import platform
from pallasite.kernels.grouped_matmul import (
    TritonBlockSizes,
    api,
    grouped_projection,
    ops,
    pallas_triton,
    predicates,
    ragged_dot_runs,
)
from pallasite.reference.grouped_projection import grouped_projection as reference

SMALL = TritonBlockSizes(block_m=16, block_n=16, block_k=16, group_m=2)


def _inputs(m=40, k=24, n=20, g=4, total=33):
    key = jax.random.key(1)
    x = jax.random.normal(key, (m, k), jnp.float32)
    kernel = jax.random.normal(jax.random.fold_in(key, 1), (g, k, n), jnp.float32)
    sizes = np.full(g, total // g, np.int32)
    sizes[0] += total - sizes.sum()
    return x, kernel, jnp.asarray(sizes)


# ------------------------------------------------------------------- ragged_dot_runs


@pytest.mark.parametrize("compute", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("precision", [None, jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST])
def test_ragged_dot_runs_16bit_any_precision(compute, precision):
    assert ragged_dot_runs(compute, (jnp.zeros(2, jnp.float32),), precision)


def test_ragged_dot_runs_fp32_default_only():
    ops_ = (jnp.zeros(2, jnp.float32),)
    assert ragged_dot_runs(jnp.float32, ops_, None)
    assert ragged_dot_runs(jnp.float32, ops_, jax.lax.Precision.DEFAULT)
    assert not ragged_dot_runs(jnp.float32, ops_, jax.lax.Precision.HIGHEST)
    assert not ragged_dot_runs(jnp.float32, ops_, jax.lax.Precision.HIGH)
    with jax.default_matmul_precision("highest"):
        assert not ragged_dot_runs(jnp.float32, ops_, None)
    with jax.default_matmul_precision("tensorfloat32"):  # HIGH by another name
        assert not ragged_dot_runs(jnp.float32, ops_, None)


def test_ragged_dot_runs_refuses_wide_operands_and_x64():
    assert not ragged_dot_runs(jnp.bfloat16, (np.zeros(2, np.float64),), None)
    assert not ragged_dot_runs(jnp.float64, (), None)
    with jax.enable_x64(True):
        assert not ragged_dot_runs(jnp.bfloat16, (jnp.zeros(2, jnp.float32),), None)


# ------------------------------------------------------------------------ bad input


@pytest.fixture
def no_kernel(monkeypatch):
    """Fail loudly if anything reaches a backend."""

    def boom(*a, **k):
        raise AssertionError("a kernel was built before validation")

    monkeypatch.setattr(ops, "project", boom)


@pytest.mark.parametrize(
    "x_shape, k_shape, gs, compute, error, match",
    [
        ((4, 8, 1), (2, 8, 3), np.array([2, 2], np.int32), jnp.bfloat16, ValueError, "x must be rank 2"),
        ((4, 8), (8, 3), np.array([2, 2], np.int32), jnp.bfloat16, ValueError, "kernel must be rank 3"),
        ((4, 8), (2, 7, 3), np.array([2, 2], np.int32), jnp.bfloat16, ValueError, "disagree on k"),
        ((4, 8), (2, 8, 3), np.array([2, 1, 1], np.int32), jnp.bfloat16, ValueError, "length g=2"),
        ((4, 8), (2, 8, 3), np.array([[2, 2]], np.int32), jnp.bfloat16, ValueError, "rank 1"),
        ((4, 8), (2, 8, 3), np.array([2, 2], np.int64), jnp.bfloat16, TypeError, "int32"),
        ((4, 8), (2, 8, 3), np.array([2, 2], np.int32), jnp.int32, TypeError, "compute"),
        ((4, 8), (2, 8, 3), np.array([3, 2], np.int32), jnp.bfloat16, ValueError, "more than"),
    ],
)
def test_bad_input(no_kernel, x_shape, k_shape, gs, compute, error, match):
    x, kernel = jnp.ones(x_shape, jnp.float32), jnp.ones(k_shape, jnp.float32)
    with pytest.raises(error, match=match):
        grouped_projection(x, kernel, jnp.asarray(gs) if gs.dtype == np.int32 else gs, compute)


def test_bad_implementation_and_block_sizes(no_kernel):
    x, kernel, sizes = _inputs()
    with pytest.raises(ValueError, match="not one of"):
        grouped_projection(x, kernel, sizes, jnp.bfloat16, implementation="cublas")
    with pytest.raises(ValueError, match="need names"):
        grouped_projection(x, kernel, sizes, jnp.bfloat16, implementation=["xla", "nope"])
    with pytest.raises(TypeError, match="block_sizes"):
        grouped_projection(x, kernel, sizes, jnp.bfloat16, block_sizes=(128, 128, 128))


# ------------------------------------------------------------ selection and fallback


def _expected(x, kernel, sizes, compute=jnp.bfloat16):
    return np.asarray(reference(x, kernel, sizes, compute), np.float32)


def _jaxpr_has_pallas(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_default_on_cpu_is_xla_and_interpret_runs_the_kernel():
    x, kernel, sizes = _inputs()
    plain = lambda x, w: grouped_projection(x, w, sizes, jnp.bfloat16)  # noqa: E731
    interp = lambda x, w: grouped_projection(x, w, sizes, jnp.bfloat16, True,  # noqa: E731
                                             block_sizes=SMALL)
    low = jax.jit(plain).lower(x, kernel).as_text()
    assert TRITON_CALL not in low and "pallas" not in low.lower()
    assert _jaxpr_has_pallas(interp, x, kernel)
    want = _expected(x, kernel, sizes)
    for fn in (plain, interp):
        np.testing.assert_array_equal(np.asarray(fn(x, kernel), np.float32), want)


def test_single_name_fails_fast():
    x, kernel, sizes = _inputs()
    with pytest.raises(RuntimeError, match="sm80"):
        grouped_projection(x, kernel, sizes, jnp.bfloat16, implementation="pallas_triton")


def test_sequence_falls_back_and_logs(caplog):
    x, kernel, sizes = _inputs()
    with caplog.at_level(logging.WARNING, logger=api.__name__):
        out = grouped_projection(x, kernel, sizes, jnp.bfloat16,
                                 implementation=["pallas_triton", "pallas_mosaic_tpu", "xla"])
    np.testing.assert_array_equal(np.asarray(out, np.float32), _expected(x, kernel, sizes))
    text = caplog.text
    assert "pallas_triton failed" in text and "sm80" in text
    assert "pallas_mosaic_tpu failed" in text and "needs a TPU" in text


@pytest.mark.parametrize("name, triton, hopper, compute, message", [
    ("pallas_triton", False, False, jnp.bfloat16, "pallas_triton needs a CUDA GPU from sm80"),
    ("pallas_triton", True, False, jnp.float32, None),
    ("pallas_mosaic_gpu", True, False, jnp.bfloat16, "needs a Hopper GPU (sm90)"),
    ("pallas_mosaic_gpu", True, True, jnp.float32, "takes 16-bit compute (bf16, fp16); "
                                                   "compute=float32"),
    ("pallas_mosaic_gpu", True, True, jnp.bfloat16, None),
    ("pallas_mosaic_tpu", True, True, jnp.bfloat16, "pallas_mosaic_tpu needs a TPU; "
                                                    "the target is cpu"),
])
def test_each_backend_owns_its_device_refusal(monkeypatch, name, triton, hopper, compute,
                                              message):
    """Each backend module says what its target and dtypes need (`refusal`); api.py asks
    it after the generic checks, for the target this process compiles for (a named
    call), and the backend passes every interpreted call."""
    monkeypatch.setattr(platform, "triton_runs", lambda device=None: triton)
    monkeypatch.setattr(platform, "mosaic_gpu_runs", lambda device=None: hopper)
    x, kernel, _ = _inputs()
    why = api._refusal(name, compute, (x, kernel), interpret=False)
    assert why == ops.backend(name).refusal(compute, (x, kernel), target="cpu")
    assert platform.compile_target() == "cpu"
    assert (why is None) if message is None else (message in why)
    assert api._refusal(name, compute, (x, kernel), interpret=True) is None


def test_trace_error_falls_back(monkeypatch, caplog):
    x, kernel, sizes = _inputs()

    def broken(*a, **k):
        raise NotImplementedError("no such lowering")

    monkeypatch.setattr(pallas_triton, "gmm", broken)
    with caplog.at_level(logging.WARNING, logger=api.__name__):
        out = grouped_projection(x, kernel, sizes, jnp.bfloat16, True,
                                 implementation=["pallas_triton", "xla"])
    np.testing.assert_array_equal(np.asarray(out, np.float32), _expected(x, kernel, sizes))
    assert "NotImplementedError: no such lowering" in caplog.text


def test_refused_by_ragged_dot_runs_falls_back(caplog):
    x, kernel, sizes = _inputs()
    with jax.default_matmul_precision("highest"), caplog.at_level(logging.WARNING, api.__name__):
        grouped_projection(x, kernel, sizes, jnp.float32, True,
                           implementation=["pallas_triton", "xla"])
    assert "ragged_dot_runs refuses" in caplog.text


def test_all_fail_raises_every_reason():
    x, kernel, sizes = _inputs()
    with pytest.raises(ExceptionGroup) as info:
        grouped_projection(x, kernel, sizes, jnp.bfloat16,
                           implementation=["pallas_triton", "pallas_mosaic_tpu"])
    messages = [str(e) for e in info.value.exceptions]
    assert len(messages) == 2 and "sm80" in messages[0] and "TPU" in messages[1]


def test_sequence_uses_the_first_that_works(caplog):
    x, kernel, sizes = _inputs()
    fn = lambda x, w: grouped_projection(x, w, sizes, jnp.bfloat16, True,  # noqa: E731
                                         implementation=["pallas_triton", "xla"],
                                         block_sizes=SMALL)
    with caplog.at_level(logging.WARNING, logger=api.__name__):
        assert _jaxpr_has_pallas(fn, x, kernel)
    assert "failed" not in caplog.text


def test_block_sizes_go_only_to_their_backend():
    from pallasite.kernels.grouped_matmul import GroupedProjectionBlockSizes, MosaicTpuBlockSizes
    mixed = GroupedProjectionBlockSizes(forward=SMALL, dkernel=MosaicTpuBlockSizes())
    assert api._blocks_for("pallas_triton", mixed) == GroupedProjectionBlockSizes(forward=SMALL)
    assert api._blocks_for("pallas_mosaic_tpu", mixed) == GroupedProjectionBlockSizes(
        dkernel=MosaicTpuBlockSizes())
    assert api._blocks_for("xla", mixed) is None
    assert api._blocks_for("pallas_mosaic_tpu", SMALL) is None


def test_mosaic_gpu_left_out_when_it_does_not_import(monkeypatch):
    real = api._importable
    monkeypatch.setattr(api, "_importable", lambda n, *a: "gone" if n == "pallas_mosaic_gpu" else real(n, *a))
    x, kernel, sizes = _inputs()
    with pytest.raises(RuntimeError, match="gone"):  # one backend: its own error
        grouped_projection(x, kernel, sizes, jnp.bfloat16, implementation=["pallas_mosaic_gpu"])


# ------------------------------------------------- lowering for CUDA and TPU from CPU


def _export(fn, platforms, *args):
    checks = [DisabledSafetyCheck.custom_call(TRITON_CALL)]
    return jax.export.export(jax.jit(fn), platforms=platforms, disabled_checks=checks)(*args)


def _loss(implementation=None, compute=jnp.bfloat16):
    def loss(x, kernel, sizes):
        y = grouped_projection(x, kernel, sizes, compute, implementation=implementation)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1))


def _specs(m=300, k=200, n=96, g=6):
    return (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((g,), jnp.int32))


@pytest.fixture
def fake_sm80(monkeypatch):
    """The CUDA branch keys on the local device; pretend it is an sm80+ GPU without
    Hopper, so the default order lands on pallas_triton."""
    monkeypatch.setattr(platform, "triton_runs", lambda device=None: True)
    monkeypatch.setattr(platform, "mosaic_gpu_runs", lambda device=None: False)


def test_cuda_default_lowers_to_triton(fake_sm80):
    text = cuda_module(_loss(), *_specs())
    assert text.count(TRITON_CALL) == 3  # forward, dx, dkernel


def test_cuda_fp32_highest_lowers_to_xla(fake_sm80):
    specs = [jax.ShapeDtypeStruct(s.shape, jnp.float32 if i < 2 else s.dtype)
             for i, s in enumerate(_specs())]
    with jax.default_matmul_precision("highest"):
        text = cuda_module(_loss(compute=jnp.float32), *specs)
    assert TRITON_CALL not in text


def test_cuda_without_a_gpu_lowers_to_xla():
    text = cuda_module(_loss(), *_specs())
    assert TRITON_CALL not in text


@pytest.mark.parametrize("m,g,preferred", [(4096, 8, True), (65536, 128, True),
                                            (65536, 256, True), (65536, 512, False),
                                            (1024, 8, False), (255, 1, False), (256, 1, True)])
def test_mosaic_gpu_preferred_from_256_rows_per_group(m, g, preferred):
    assert predicates.mosaic_gpu_preferred(m, g) is preferred


@pytest.fixture
def fake_hopper(monkeypatch):
    from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu

    monkeypatch.setattr(platform, "triton_runs", lambda device=None: True)
    monkeypatch.setattr(platform, "mosaic_gpu_runs", lambda device=None: True)
    monkeypatch.setattr(pallas_mosaic_gpu, "_num_programs", lambda interpret: 132)


@pytest.mark.parametrize("m,expected", [(2048, "mosaic_gpu"), (1024, TRITON_CALL)])
def test_cuda_default_on_hopper_picks_by_rows_per_group(fake_hopper, m, expected):
    """256 rows per group or more: Mosaic GPU for all three products; fewer: Triton."""
    text = cuda_module(_loss(), *_specs(m=m, k=512, n=1024, g=8))
    other = TRITON_CALL if expected == "mosaic_gpu" else "mosaic_gpu"
    assert expected in text and other not in text


@pytest.mark.parametrize("m, g, compute, kernels", [
    (1024, 4, jnp.bfloat16, True),    # 256 rows per group: the Mosaic TPU kernels
    (1024, 4, jnp.float32, True),
    (32, 4, jnp.bfloat16, True),      # 8 rows per group: still the kernels
    (1024, 1, jnp.bfloat16, False),   # one group: XLA's dense dot (mosaic_tpu_preferred)
    (1024, 4, jnp.float16, False),    # the TPU compiler takes no fp16 blocks: XLA
], ids=["256_rows_bf16", "256_rows_fp32", "8_rows_bf16", "one_group_bf16", "256_rows_fp16"])
def test_tpu_default_picks_by_group_count_and_dtype(m, g, compute, kernels):
    """A TPU lowering from this host: all three products in the Mosaic TPU kernels where
    there is more than one group and the compute dtype compiles, else XLA's (a one-group
    product is a dense dot there)."""
    assert api.TPU_ORDER == ["pallas_mosaic_tpu", "xla"]
    text = _export(_loss(compute=compute), ["tpu"], *_specs(m=m, k=256, n=128, g=g)
                   ).mlir_module()
    assert text.count("tpu_custom_call") == (3 if kernels else 0)
    assert TRITON_CALL not in text
    if g > 1:
        assert bool(re.findall(r"\b(?:chlo|stablehlo)\.ragged\w*", text)) is not kernels


def test_one_function_exports_for_each_platform(fake_sm80):
    """The same function, exported once per platform, picks each platform's backend.
    (A single multi-platform export cannot hold the kernels: JAX 0.11.2 lowers every
    branch of a platform_dependent for every platform, and a Triton or Mosaic pallas_call
    has no lowering on the others; the test below pins that, so we notice when it lifts.)"""
    specs, loss = _specs(m=256, k=256, n=128, g=4), _loss()
    cuda = cuda_module(loss, *specs)
    tpu = _export(loss, ["tpu"], *specs).mlir_module()
    cpu = _export(loss, ["cpu"], *specs).mlir_module()
    assert TRITON_CALL in cuda and "tpu_custom_call" not in cuda
    assert tpu.count("tpu_custom_call") == 3 and TRITON_CALL not in tpu
    assert TRITON_CALL not in cpu and "tpu_custom_call" not in cpu


def test_multi_platform_export_with_kernels_is_refused_by_jax(fake_sm80):
    with gpu_mesh(), pytest.raises(ValueError, match="Only interpret mode"):
        _export(_loss(), ["cpu", "cuda"], *_specs(m=256, k=256, n=128, g=4))


def test_default_path_value_and_gradient_parity():
    """The XLA path under the same contract (through the default order on CPU)."""
    case = CPU_CASES[1]
    check_case(case, lambda x, w, s: grouped_projection(x, w, s, jnp.dtype(case.compute)))
    x, *_ = draw(case)
    assert x.dtype == jnp.float32
