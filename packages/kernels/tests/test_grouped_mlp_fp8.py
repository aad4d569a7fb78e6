"""grouped_mlp's fp8 gate-up with h quantized in its epilogue (gate_up_quantized of
expert_mlp.pallas_triton_fp8 and expert_mlp.pallas_mosaic_gpu_fp8) against the fp8
recipe's oracle, the fp8 down products with the row weights, and the fp8 fused route.

The oracle (pallasite.reference): x in 1 x 128 blocks and the gate-up kernel in
128 x 128 blocks, quantized and dequantized; the ragged product summed in fp32; the
activation; h quantized in 1 x 128 blocks by the reference quantizer. The kernel sums
the same dequantized values 128 deep per step, so its fp32 h differs from the oracle's
by summation order alone: the scales agree to 1e-5, and an e4m3 value differs only
where h sits on a rounding boundary (one step, rarely). The interpreter fills outputs
with NaN before the kernel runs, so an unwritten row or scale fails.

CPU (no mark): the kernels through the Triton and Mosaic GPU interpreters, the fp8 down
product reading their output, the argument checks, and the lowering for an H200 from
this CPU. GPU (-m gpu, sm89 or later; Mosaic GPU on Hopper): the compiled kernels
against the same oracle.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_testlib
import sharding_testlib as st
from cuda_export_testlib import TRITON_CALL, cuda_module

from pallasite.kernels import platform
from pallasite.kernels.expert_mlp import pallas_mosaic_gpu_fp8 as mgpu_fp8
from pallasite.kernels.expert_mlp import pallas_triton_fp8 as mlp_fp8
from pallasite.kernels.grouped_matmul import config
from pallasite.kernels.grouped_matmul import pallas_triton_fp8 as tf
from pallasite.reference import quantization as q
from pallasite.reference.grouped_mlp import activate
from pallasite.reference.grouped_projection import gmm_reference

F8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16
F32 = jnp.float32
# 64-row tiles, so the interpreter's groups span several tiles; 2 stages keep it cheap.
SMALL = config.TritonBlockSizes(64, 128, 128, group_m=2, num_warps=4, num_stages=2)
# The fused fp8 kernels' backends: (module, the interpreter's block sizes).
KERNELS = {"pallas_triton": (mlp_fp8, SMALL), "pallas_mosaic_gpu": (mgpu_fp8, None)}


def _operands(seed, m, k, f, g, n=None):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), F32).astype(BF16)
    w = (jax.random.normal(kw, (g, k, 2 * f), F32) / np.sqrt(k)).astype(BF16)
    down = None if n is None else (jax.random.normal(kd, (g, f, n), F32) / np.sqrt(f)).astype(BF16)
    return x, w, down


def _local_rows(sizes, m, offset=None, g=None):
    """[m] bool: the rows of groups [offset, offset + g) (all groups when None)."""
    owner = np.repeat(np.arange(len(sizes)), sizes)[:m]  # each grouped row's group
    lo = 0 if offset is None else offset
    hi = len(sizes) if g is None else lo + g
    return np.pad((owner >= lo) & (owner < hi), (0, m - owner.size))


def _oracle_h(x, w_all, sizes, activation, offset=None, g=None):
    """(h in fp32, its reference quantization: values [m, f], scales [m, f / 128]); rows
    of no local group zero."""
    gs = jnp.asarray(sizes, jnp.int32)
    pre = gmm_reference(q.quantized_rows(x, F8), q.quantized_kernel(w_all, F8), gs)
    keep = jnp.asarray(_local_rows(sizes, x.shape[0], offset, g))[:, None]
    h = jnp.where(keep, activate(pre, activation), 0.0)
    values, scales = q.quantize_blocks(h, (1, q.TOKEN_BLOCK), F8)
    return h, values, scales


def _check_h(values, scales_t, oracle, rows_of_no_group, what):
    h, ref_values, ref_scales = oracle
    scales = np.asarray(scales_t).T
    assert np.isfinite(scales).all(), f"{what}: non-finite scales (an unwritten one?)"
    np.testing.assert_allclose(scales, np.asarray(ref_scales), rtol=1e-5, err_msg=what)
    ours = np.asarray(values.astype(F32))
    assert np.isfinite(ours).all(), f"{what}: non-finite values"
    theirs = np.asarray(ref_values.astype(F32))
    differ = np.mean(ours != theirs)
    assert differ < 5e-3, f"{what}: {differ:.2%} of the e4m3 values differ from the oracle's"
    deq = np.asarray(q.dequantize_blocks(values, scales, (1, q.TOKEN_BLOCK)), np.float64)
    ref = np.asarray(h, np.float64)
    if ref.any():
        err = np.linalg.norm(deq - ref) / np.linalg.norm(ref)
        assert err < 4e-2, f"{what}: dequantized h {err:.2e} relative L2 from fp32 h"
    if rows_of_no_group.any():  # the quantizer's zeros: values 0, scale 1
        assert not ours[rows_of_no_group].any(), what
        assert (scales[rows_of_no_group] == 1.0).all(), what


CASES = [  # (m, k, f, sizes): empty groups, rows past the total, k not a multiple of 128
    (200, 192, 256, [50, 0, 70, 33]),
    (130, 128, 128, [0, 0, 0]),
    (96, 300, 384, [96, 0]),
]


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("case", CASES, ids=["ragged", "all_empty", "full"])
def test_interpret_gate_up_quantized_matches_the_oracle(case, activation, backend):
    m, k, f, sizes = case
    module, blocks = KERNELS[backend]
    x, w, _ = _operands(0, m, k, f, len(sizes))
    values, scales_t = jax.jit(lambda a, b: module.gate_up_quantized(
        a, b, jnp.asarray(sizes, jnp.int32), activation=activation, block_sizes=blocks,
        interpret=True))(x, w)
    assert values.dtype == F8 and values.shape == (m, f)
    assert scales_t.dtype == F32 and scales_t.shape == (f // 128, m)
    _check_h(values, scales_t, _oracle_h(x, w, sizes, activation),
             ~_local_rows(sizes, m), f"{case} {activation}")


@pytest.mark.parametrize("backend", list(KERNELS))
def test_interpret_local_experts(backend):
    """Groups [1, 3) of 4 (a traced offset): the other experts' rows are the quantizer's
    zeros."""
    module, blocks = KERNELS[backend]
    sizes = [40, 50, 30, 20]
    x, w, _ = _operands(1, 150, 128, 256, 4)
    values, scales_t = jax.jit(lambda a, b, o: module.gate_up_quantized(
        a, b[1:3], jnp.asarray(sizes, jnp.int32), group_offset=o, block_sizes=blocks,
        interpret=True))(x, w, jnp.int32(1))
    _check_h(values, scales_t, _oracle_h(x, w, sizes, "swiglu", offset=1, g=2),
             ~_local_rows(sizes, 150, 1, 2), "local experts")


def test_interpret_the_down_product_reads_h_as_it_is():
    """h's values and transposed scales go straight into the fp8 down product
    (gmm_quantized) with no pass between: y equals the oracle's fp8 composition (h
    quantized by the reference quantizer) to 1e-5, rows of no group zero."""
    sizes = [60, 0, 44]
    m, k, f, n = 120, 128, 256, 192
    x, w, down = _operands(2, m, k, f, 3, n)
    gs = jnp.asarray(sizes, jnp.int32)

    @jax.jit
    def ours(a, b, d):
        values, scales_t = mlp_fp8.gate_up_quantized(a, b, gs, block_sizes=SMALL,
                                                     interpret=True)
        d_q, d_scales = q.quantize_blocks(d, (1, 128, 128), F8)
        return tf.gmm_quantized(values, scales_t, jnp.swapaxes(d_q, 1, 2),
                                jnp.swapaxes(d_scales, 1, 2), gs, out_dtype=F32,
                                block_sizes=SMALL, interpret=True)

    y = np.asarray(ours(x, w, down), np.float64)
    _, values, scales = _oracle_h(x, w, sizes, "swiglu")
    h_q = q.dequantize_blocks(values, scales, (1, q.TOKEN_BLOCK))
    y_ref = np.asarray(gmm_reference(h_q, q.quantized_kernel(down, F8), gs), np.float64)
    keep = _local_rows(sizes, m)
    assert not y[~keep].any()
    err = np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref)
    assert err < 1e-3, f"y relative L2 {err:.2e}"


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_interpret_gate_up_grad_quantized_matches_the_oracle(activation, backend):
    """d(pre) from the gate and up sums recomputed in the kernel: against the oracle's
    fp32 pre-activation of the quantized operands, differentiated through the reference
    activation, to 1e-5 in fp32 (summation order); rows of no local group zero."""
    module, blocks = KERNELS[backend]
    sizes = [40, 0, 70, 33]
    m, k, f = 160, 192, 256
    x, w, _ = _operands(15, m, k, f, 3)
    dh = jax.random.normal(jax.random.key(16), (m, f), F32)
    gs = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(lambda a, b, c, o: module.gate_up_grad_quantized(
        a, b, gs, c, activation=activation, group_offset=o, out_dtype=F32,
        block_sizes=blocks, interpret=True))(x, w, dh, jnp.int32(1))
    full = jnp.concatenate([w[:1], w], axis=0)  # groups 1..3 local; group 0 stands in
    pre = gmm_reference(q.quantized_rows(x, F8), q.quantized_kernel(full, F8), gs)
    (want,) = jax.vjp(lambda p: activate(p, activation), pre)[1](dh)
    keep = _local_rows(sizes, m, 1, 3)
    want = np.where(keep[:, None], np.asarray(want), 0.0)
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all() and not got[~keep].any()
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-5, f"d(pre) relative L2 {err:.2e}"


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_interpret_mosaic_gpu_d_pre_on_128_row_tiles(activation, monkeypatch):
    """The Mosaic GPU d(pre) kernel on its other tile (D_PRE_TILE_ROWS 128: 128 rows and
    64 columns of h a tile, a consumer's 64 rows each), held to the same oracle."""
    monkeypatch.setattr(mgpu_fp8, "D_PRE_TILE_ROWS", 128)
    test_interpret_gate_up_grad_quantized_matches_the_oracle(activation, "pallas_mosaic_gpu")


@pytest.mark.parametrize("backend", list(KERNELS))
def test_interpret_down_weighted_quantized_matches_the_oracle(backend):
    """y = (dequant(h) Q(W_down)) * row_weights, the weights on the fp32 sums in the
    epilogue: to 1e-5 of the oracle in fp32; in bf16, the oracle rounded once (within
    one bf16 step)."""
    module, blocks = KERNELS[backend]
    sizes = [60, 0, 44]
    m, f, n = 120, 256, 200
    _, _, down = _operands(17, m, 128, f, 3, n)
    h = jax.random.normal(jax.random.key(18), (m, f), F32)
    values, scales = q.quantize_blocks(h, (1, q.TOKEN_BLOCK), F8)
    rw = jax.random.uniform(jax.random.key(19), (m,), minval=0.1, maxval=1.0)
    gs = jnp.asarray(sizes, jnp.int32)

    def ours(dtype):
        return np.asarray(jax.jit(lambda v, s, d, r: module.down_weighted_quantized(
            v, s, d, gs, r, out_dtype=dtype, block_sizes=blocks, interpret=True))(
            values, scales.T, down, rw).astype(F32), np.float64)

    keep = _local_rows(sizes, m)
    want = np.asarray(gmm_reference(q.dequantize_blocks(values, scales, (1, q.TOKEN_BLOCK)),
                                    q.quantized_kernel(down, F8), gs)) * np.asarray(rw)[:, None]
    want = np.where(keep[:, None], want, 0.0)
    got = ours(F32)
    assert not got[~keep].any()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    got16 = ours(BF16)
    assert np.max(np.abs(got16 - want) / (np.abs(want) + 1e-6)) <= 2.0 ** -8


@pytest.mark.parametrize("backend", list(KERNELS))
def test_interpret_down_weighted_grad_quantized_matches_the_oracle(backend):
    """dh = row_weights * t and d row_weights = sum_f h * t, t = Q(dy) Q(W_down)^T, from
    the kernel's epilogue: to 1e-5 of the oracle in fp32; rows of no group zero."""
    module, blocks = KERNELS[backend]
    sizes = [60, 0, 44]
    m, f, n = 120, 256, 200
    _, _, down = _operands(20, m, 128, f, 3, n)
    h = jax.random.normal(jax.random.key(21), (m, f), F32)
    dy = jax.random.normal(jax.random.key(22), (m, n), F32)
    rw = jax.random.uniform(jax.random.key(23), (m,), minval=0.1, maxval=1.0)
    gs = jnp.asarray(sizes, jnp.int32)
    dh, d_rw = jax.jit(lambda a, d, r, b: module.down_weighted_grad_quantized(
        a, d, gs, r, b, block_sizes=blocks, interpret=True))(dy, down, rw, h)
    t = np.asarray(gmm_reference(q.quantized_rows(dy, F8), q.quantized_kernel(down, F8), gs,
                                 transpose_rhs=True), np.float64)
    keep = _local_rows(sizes, m)
    t = np.where(keep[:, None], t, 0.0)
    want_dh = t * np.asarray(rw)[:, None]
    want_rw = np.sum(np.asarray(h, np.float64) * t, axis=1)
    dh, d_rw = np.asarray(dh, np.float64), np.asarray(d_rw, np.float64)
    assert not dh[~keep].any() and not d_rw[~keep].any()
    assert np.linalg.norm(dh - want_dh) / np.linalg.norm(want_dh) < 1e-5
    assert np.linalg.norm(d_rw - want_rw) / np.linalg.norm(want_rw) < 1e-5


def test_bad_arguments_are_named():
    x, w, _ = _operands(3, 64, 128, 192, 2)
    sizes = jnp.array([30, 34], jnp.int32)
    with pytest.raises(ValueError, match="rhs: the fp8 gate-up needs f"):
        mlp_fp8.gate_up_quantized(x, w[..., :2 * 96], sizes, interpret=True)
    x, w, _ = _operands(3, 64, 128, 128, 2)
    wide = dataclasses.replace(SMALL, block_n=256)
    with pytest.raises(ValueError, match="block_sizes: block_k=128, block_n=256"):
        mlp_fp8.gate_up_quantized(x, w, sizes, block_sizes=wide, interpret=True)
    with pytest.raises(ValueError, match="activation"):
        mlp_fp8.gate_up_quantized(x, w, sizes, activation="relu", interpret=True)
    with pytest.raises(TypeError, match="int32"):
        mlp_fp8.gate_up_quantized(x, w, sizes.astype(jnp.int16), interpret=True)


def test_zero_rows_and_the_default_tiles(monkeypatch):
    x, w, _ = _operands(4, 64, 128, 128, 2)
    values, scales_t = mlp_fp8.gate_up_quantized(x[:0], w, jnp.zeros((2,), jnp.int32))
    assert values.shape == (0, 128) and scales_t.shape == (1, 0)
    # the default: the most of 4, 3, 2 stages inside every fp8 GPU's shared memory
    monkeypatch.setattr(platform, "_default_device",
                        lambda: FakeGpu("NVIDIA H200", "9.0"))
    bs = mlp_fp8._default()
    assert mlp_fp8.block_sizes_reason(bs, caller=False) is None
    assert mlp_fp8.pair_shared_memory_bytes(bs) == bs.num_stages * (64 * 128 + 128 * 256)


@dataclasses.dataclass
class FakeGpu:
    device_kind: str
    compute_capability: str
    platform: str = "gpu"


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_lowers_for_cuda_from_cpu(activation, monkeypatch):
    """The kernel lowers to Triton for an H200 with its two quantizers (three Triton
    calls), local experts, k not a multiple of 128, at the default tiles."""
    monkeypatch.setattr(platform, "_default_device", lambda: FakeGpu("NVIDIA H200", "9.0"))
    s = jax.ShapeDtypeStruct
    m, k, f, g = 4096, 1408, 768, 8
    fn = lambda a, b, c, o: mlp_fp8.gate_up_quantized(  # noqa: E731
        a, b, c, activation=activation, group_offset=o)
    text = cuda_module(fn, s((m, k), BF16), s((g, k, 2 * f), BF16), s((2 * g,), jnp.int32),
                       s((), jnp.int32))
    assert text.count(TRITON_CALL) == 3, text.count(TRITON_CALL)
    assert "grouped_mlp_gate_up_fp8_triton" in text


def _skip_unless_it_runs(backend):
    if not platform.fp8_runs():
        pytest.skip("needs a CUDA GPU from sm89")
    if backend == "pallas_mosaic_gpu" and not platform.mosaic_gpu_runs():
        pytest.skip("needs a Hopper GPU (sm90)")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("case", CASES[:1] + [(4096, 1024, 768, [700, 0, 1500, 1000, 896])],
                         ids=["ragged", "wide"])
def test_gpu_gate_up_quantized_matches_the_oracle(case, backend):
    _skip_unless_it_runs(backend)
    m, k, f, sizes = case
    x, w, _ = _operands(5, m, k, f, len(sizes))
    values, scales_t = jax.jit(lambda a, b: KERNELS[backend][0].gate_up_quantized(
        a, b, jnp.asarray(sizes, jnp.int32)))(x, w)
    # the tensor cores' fp8 sums within a step keep fewer bits than fp32: the scales to 1e-3
    h, ref_values, ref_scales = _oracle_h(x, w, sizes, "swiglu")
    np.testing.assert_allclose(np.asarray(scales_t).T, np.asarray(ref_scales), rtol=1e-3)
    deq = np.asarray(q.dequantize_blocks(values, np.asarray(scales_t).T, (1, q.TOKEN_BLOCK)),
                     np.float64)
    ref = np.asarray(h, np.float64)
    assert np.linalg.norm(deq - ref) / np.linalg.norm(ref) < 4e-2
    assert not np.asarray(values.astype(F32))[~_local_rows(sizes, m)].any()


# ----------------------------------------------------------------------------- grouped_mlp


def _mlp(implementation, fuse, sizes, offset=None):
    from pallasite.kernels import grouped_mlp

    def loss_and_y(x, w, down, rw, dy):
        y = grouped_mlp(x, w, down, jnp.asarray(sizes, jnp.int32), BF16, True,
                        row_weights=rw, recipe="fp8", fuse_activation=fuse,
                        implementation=implementation, group_offset=offset)
        return jnp.sum(y.astype(F32) * dy), y

    return jax.jit(jax.value_and_grad(loss_and_y, argnums=(0, 1, 2, 3), has_aux=True))


def _exact(sizes, offset):
    """y and the four gradients of the unquantized definition in fp32 (the reference)."""
    from pallasite.reference.grouped_mlp import grouped_mlp_reference

    def loss_and_y(x, w, down, rw, dy):
        y = grouped_mlp_reference(x, w, down, jnp.asarray(sizes, jnp.int32), F32,
                                  row_weights=rw, group_offset=offset)
        return jnp.sum(y * dy), y

    return jax.jit(jax.value_and_grad(loss_and_y, argnums=(0, 1, 2, 3), has_aux=True))


def _assert_as_near_as_the_composition(fused, composition, definition):
    """Each of y and the four gradients of the fused route within 1.25x (and 1e-3) of the
    fp8 composition's relative L2 distance from the definition, and under 10%."""
    names = ("y", "dx", "dW_gate_up", "dW_down", "d row_weights")
    for name, a, c, e in zip(names, fused, composition, definition):
        a, c, e = (np.asarray(v, np.float64) for v in (a, c, e))
        assert np.isfinite(a).all(), name
        ours = np.linalg.norm(a - e) / np.linalg.norm(e)
        theirs = np.linalg.norm(c - e) / np.linalg.norm(e)
        assert ours <= 1.25 * theirs + 1e-3 and ours < 1e-1, (
            f"{name}: relative L2 {ours:.2e} from the definition, the fp8 composition's "
            f"{theirs:.2e}")


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("local", [False, True], ids=["all_experts", "local_experts"])
def test_interpret_grouped_mlp_fp8_fused_against_the_composition(local, backend):
    """grouped_mlp(recipe="fp8", fuse_activation=True) interpreted on either backend
    (its plain backward products Triton's), and the fp8 composition on XLA (the recipe's
    oracle products), each against the unquantized
    definition in fp32: y and the four gradients. Both carry e4m3's error (about 6%
    relative L2); the fused route's must be no larger than the composition's (within
    25%), which a wrong or missing term (O(1)) cannot meet. Their errors are not the
    same numbers: the composition rounds the pre-activation and h to bf16 before
    quantizing h, and the fused route does not."""
    sizes = [50, 0, 70, 33]
    m, k, f, n = 180, 192, 256, 136
    x, w, down = _operands(6, m, k, f, 4, n)
    rw = jax.random.uniform(jax.random.key(7), (m,), minval=0.1, maxval=1.0)
    dy = jax.random.normal(jax.random.key(8), (m, n), F32)
    offset, g = (1, 2) if local else (None, 4)
    lo = offset or 0
    args = (x, w[lo:lo + g], down[lo:lo + g], rw, dy)
    (_, y), grads = _mlp(backend, True, sizes, offset)(*args)
    (_, y_fp8), grads_fp8 = _mlp("xla", False, sizes, offset)(*args)
    (_, y_ref), grads_ref = _exact(sizes, offset)(*(a.astype(F32) for a in args))
    keep = _local_rows(sizes, m, offset, g if local else None)
    assert not np.asarray(y, F32)[~keep].any()
    _assert_as_near_as_the_composition((y, *grads), (y_fp8, *grads_fp8), (y_ref, *grads_ref))
    assert not np.asarray(grads[0], F32)[~keep].any()  # rows of no local group
    assert not np.asarray(grads[3], F32)[~keep].any()


def test_grouped_mlp_fp8_fused_refusals_name_why():
    from pallasite.kernels import grouped_mlp

    x, w, down = _operands(9, 64, 128, 192, 2, 128)
    sizes = jnp.array([30, 34], jnp.int32)
    call = lambda **kw: grouped_mlp(x, w, down, sizes, BF16, True, recipe="fp8",  # noqa: E731
                                    fuse_activation=True, **kw)
    with pytest.raises(ValueError, match="f=192 is not a multiple of 128"):
        call()
    x, w, down = _operands(9, 64, 128, 128, 2, 128)
    with pytest.raises(ValueError, match="block sizes"):
        call(block_sizes=SMALL)
    with pytest.raises(ValueError, match="takes implementation=None or one of"):
        call(implementation="xla")
    with pytest.raises(ValueError, match="recipe must be one of"):
        grouped_mlp(x, w, down, sizes, BF16, True, recipe="fp4", fuse_activation=True)
    with pytest.raises(ValueError, match=r"forward-mode differentiation \(jvp\)"):
        jax.jvp(lambda a: grouped_mlp(a, w, down, sizes, BF16, True, recipe="fp8",
                                      fuse_activation=True), (x,), (x,))


def test_grouped_mlp_fp8_fused_refuses_kernels_past_32_bit_offsets():
    """DeepSeek-V3's down stack (256 x 2048 x 7168: 3.8e9 fp8 values in under 4 GiB) is
    past Pallas Triton's 32-bit offsets (quantization/pallas_triton.offsets_fit): the
    Triton route refuses it by name, up front (traced from shapes alone); the Mosaic GPU
    route (TMA, 64-bit addresses) takes it."""
    from pallasite.kernels import grouped_mlp

    s = jax.ShapeDtypeStruct
    args = (s((4096, 7168), BF16), s((256, 7168, 4096), BF16), s((256, 2048, 7168), BF16),
            s((256,), jnp.int32))

    def call(implementation):
        return jax.eval_shape(lambda *a: grouped_mlp(
            *a, BF16, True, recipe="fp8", fuse_activation=True,
            implementation=implementation), *args)

    with pytest.raises(ValueError, match=r"down_kernel \(256, 2048, 7168\) has more "
                                         r"than 2\*\*31 elements"):
        call("pallas_triton")
    assert call("pallas_mosaic_gpu").shape == (4096, 7168)


# The sharding routes: 4 experts over 192 rows; k = 2f = 256 and n = 128 apart from m,
# so a collective's shape tells rows and kernels apart.
_SHARDED = dict(sizes=[60, 20, 0, 90], m=192, k=256, f=128, n=128)


@functools.cache
def _sharded_operands():
    c = _SHARDED
    x, w, down = _operands(15, c["m"], c["k"], c["f"], 4, c["n"])
    rw = jax.random.uniform(jax.random.key(16), (c["m"],), minval=0.1, maxval=1.0)
    dy = jax.random.normal(jax.random.key(17), (c["m"], c["n"]), F32)
    return x, w, down, rw, dy


@functools.cache
def _unsharded_results():
    """(fused route, fp8 composition, definition): each (y, four gradients), unsharded."""
    args = _sharded_operands()
    sizes = _SHARDED["sizes"]
    flat = lambda r: (r[0][1], *r[1])  # noqa: E731
    return (flat(_mlp("pallas_triton", True, sizes)(*args)),
            flat(_mlp("xla", False, sizes)(*args)),
            flat(_exact(sizes, None)(*(a.astype(F32) for a in args))))


def test_grouped_mlp_fp8_fused_in_a_shard_map_with_check_vma():
    """Expert parallelism in a caller's shard_map (check_vma on, JAX's default): each of
    2 devices holds 2 experts (group_offset) and the rows whole, y summed over them.
    The values and the four gradients equal the unsharded fused call's bit for bit (the
    sums over devices have one non-zero term a row), and the gradients of the
    replicated x and row weights come back summed, with their primals' types."""
    from jax.sharding import PartitionSpec as P

    from pallasite.kernels import grouped_mlp

    x, w, down, rw, dy = _sharded_operands()
    gs = jnp.asarray(_SHARDED["sizes"], jnp.int32)
    mesh = st.mesh((2,), ("expert",), st.AUTO)

    def local(x, wgu, wd, rw):
        me = jax.lax.axis_index("expert") * wgu.shape[0]
        y = grouped_mlp(x, wgu, wd, gs, BF16, True, row_weights=rw, group_offset=me,
                        implementation="pallas_triton", recipe="fp8", fuse_activation=True)
        return jax.lax.psum(y.astype(F32), "expert")

    sharded = jax.shard_map(local, mesh=mesh, out_specs=P(),
                            in_specs=(P(), P("expert"), P("expert"), P()))

    def loss_and_y(*t):
        y = sharded(*t)
        return jnp.sum(y * dy), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss_and_y, argnums=(0, 1, 2, 3),
                                               has_aux=True))(x, w, down, rw)
    want = _unsharded_results()[0]
    for name, got, ref in zip(("y", "dx", "dW_gate_up", "dW_down", "d row_weights"),
                              (y, *grads), want):
        np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(ref, F32), name)


def test_grouped_mlp_fp8_fused_under_vmap():
    """jax.vmap over a batch of two token sets sharing the kernels: the value and the
    gradients are the per-element calls' (the kernels' own is their sum), exactly: the
    passes run once per element (sharding.run's batching rule)."""
    from pallasite.kernels import grouped_mlp

    x, w, down, rw, _ = _sharded_operands()
    xs = jnp.stack([x, x[::-1]])
    gs = jnp.asarray(_SHARDED["sizes"], jnp.int32)

    def y_of(x, w, down):
        return grouped_mlp(x, w, down, gs, BF16, True, row_weights=rw,
                           implementation="pallas_triton", recipe="fp8",
                           fuse_activation=True).astype(F32)

    def loss(x, w, down):
        return jnp.sum(jnp.cos(y_of(x, w, down)))

    value, grads = jax.jit(jax.value_and_grad(
        lambda *a: jnp.sum(jax.vmap(loss, in_axes=(0, None, None))(*a)),
        argnums=(0, 1, 2)))(xs, w, down)
    each = [jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(xs[i], w, down)
            for i in range(2)]
    np.testing.assert_allclose(float(value), sum(float(v) for v, _ in each), rtol=1e-6)
    for i, (_, g) in enumerate(each):
        np.testing.assert_array_equal(np.asarray(grads[0][i], F32), np.asarray(g[0], F32))
    for j in (1, 2):
        total = sum(np.asarray(g[j], F32) for _, g in each)
        np.testing.assert_allclose(np.asarray(grads[j], F32), total, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("layout", ["experts_explicit", "experts_auto", "rows_explicit",
                                    "rows_auto", "rows_and_experts_explicit",
                                    "rows_over_experts_explicit"])
def test_grouped_mlp_fp8_fused_over_a_jits_mesh(layout):
    """The fp8 fused route under jit over 4 devices keeps the rows and the experts split
    (layouts.mlp_fp8_forward_planner and its backward's), Explicit and Auto axes.
    Experts split: equal to the unsharded call bit for bit (y, h and its scales summed
    over the expert axis, one non-zero term a row), and no collective moves a kernel.
    Rows split: each device quantizes its own rows' blocks (the backward's 128-row
    blocks of x and d(pre) are cut at the shard's edge), so the results are held to the
    definition as the unsharded route is; no collective moves an array of all the rows.
    Rows over the expert axis too (its minor-most): the experts are taken whole there.
    """
    from pallasite.kernels import grouped_mlp

    c = _SHARDED
    x, w, down, rw, dy = _sharded_operands()
    kind = st.AUTO if layout.endswith("auto") else st.EXPLICIT
    if layout.startswith("rows_and_experts"):
        mesh = st.mesh((2, 2), ("data", "expert"), kind)
        rows, experts = "data", "expert"
    elif layout.startswith("rows_over_experts"):
        mesh = st.mesh((2, 2), ("data", "expert"), kind)
        rows, experts = ("data", "expert"), "expert"
    elif layout.startswith("rows"):
        mesh = st.mesh((4,), ("data",), kind)
        rows, experts = "data", None
    else:
        mesh = st.mesh((2,), ("expert",), kind)
        rows, experts = None, "expert"
    gs = jnp.asarray(c["sizes"], jnp.int32)

    def loss(x, wgu, wd, rw):
        y = grouped_mlp(x, wgu, wd, gs, BF16, True, row_weights=rw,
                        implementation="pallas_triton", recipe="fp8", fuse_activation=True)
        return jnp.sum(y.astype(F32) * dy), y

    with jax.set_mesh(mesh):
        args = (st.put(x, mesh, rows, None), st.put(w, mesh, experts),
                st.put(down, mesh, experts), st.put(rw, mesh, rows))
        run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        (_, y), grads = run(*args)
        found = st.collectives(run.lower(*args).compile().as_text())
    moved = [s for shapes in found.values() for s in shapes]
    fused, composition, definition = _unsharded_results()
    if rows is None:
        for name, got, ref in zip(("y", "dx", "dW_gate_up", "dW_down", "d row_weights"),
                                  (y, *grads), fused):
            np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(ref, F32), name)
    else:
        _assert_as_near_as_the_composition((y, *grads), composition, definition)
        assert not [s for s in moved if s and s[0] == c["m"]], found
    if experts is not None and rows != ("data", "expert"):
        assert not [s for s in moved if s and s[0] == 4], found  # a whole kernel stack


@pytest.mark.parametrize("gpu,plain", [(FakeGpu("NVIDIA H200", "9.0"), "mosaic_gpu"),
                                       (FakeGpu("NVIDIA L4", "8.9"), "triton")],
                         ids=["sm90", "sm89"])
def test_grouped_mlp_fp8_fused_fwd_bwd_lowers_for_cuda_from_cpu(gpu, plain, monkeypatch):
    """jax.value_and_grad of grouped_mlp(recipe="fp8", fuse_activation=True) lowers
    for CUDA with the default choice: the fused gate-up, the weighted down product, the
    fused d(pre) and the down product's backward on Hopper in Mosaic GPU, on sm89 in
    Triton, beside the quantizers; the backward's plain fp8 gmm (dx) and
    tgmm (both dkernels) on Hopper in Mosaic GPU (the fp8 composition's kernels), on
    sm89 in Triton."""
    from pallasite.kernels import grouped_mlp
    from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu as mgpu

    monkeypatch.setattr(platform, "_default_device", lambda: gpu)
    monkeypatch.setattr(mgpu, "_num_programs", lambda interpret: 132)
    s = jax.ShapeDtypeStruct
    m, k, f, n, g = 4096, 1024, 768, 1024, 8

    def loss(x, w, down, rw, sizes):
        y = grouped_mlp(x, w, down, sizes, BF16, row_weights=rw, recipe="fp8",
                        fuse_activation=True)
        return jnp.sum(y.astype(F32))

    text = cuda_module(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), s((m, k), BF16),
                       s((g, k, 2 * f), BF16), s((g, f, n), BF16), s((m,), F32),
                       s((g,), jnp.int32), device_kind=gpu.device_kind)
    other = "triton" if plain == "mosaic_gpu" else "mosaic_gpu"
    for name in (f"grouped_mlp_gate_up_fp8_{plain}", f"grouped_mlp_down_fp8_{plain}",
                 f"grouped_mlp_gate_up_grad_fp8_{plain}", f"grouped_mlp_down_grad_fp8_{plain}",
                 f"grouped_projection_gmm_fp8_{plain}",
                 f"grouped_projection_tgmm_fp8_{plain}"):
        assert name in text, name
    for name in (f"grouped_mlp_gate_up_fp8_{other}", f"grouped_mlp_down_fp8_{other}",
                 f"grouped_mlp_gate_up_grad_fp8_{other}", f"grouped_mlp_down_grad_fp8_{other}",
                 f"grouped_projection_gmm_fp8_{other}", f"grouped_projection_tgmm_fp8_{other}"):
        assert name not in text, name


@pytest.mark.parametrize("d_pre_tile_rows", [64, 128])
@pytest.mark.parametrize("shape", [(32768, 4096, 14336, 4096, 8), (65536, 7168, 2048, 7168, 32),
                                   (65536, 2048, 768, 2048, 128)],
                         ids=["mixtral", "dsv3_local", "qwen3"])
def test_mosaic_gpu_fp8_mlp_kernels_lower_at_model_shapes(shape, d_pre_tile_rows, monkeypatch):
    """The Mosaic GPU fp8 gate-up (a 64 x 128 x tile and the gate and up 128 x 128 tiles a
    stage, h's shared e4m3 slot), its backward half (dh tiles in, d(pre) out in bf16; on
    both its row tiles), the weighted down product and its backward (fp32 h tiles in)
    lower for an H200 at the models' dims, through Mosaic GPU's layout inference and
    shared-memory check."""
    from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu as mgpu

    monkeypatch.setattr(mgpu, "_num_programs", lambda interpret: 132)
    monkeypatch.setattr(mgpu_fp8, "D_PRE_TILE_ROWS", d_pre_tile_rows)
    m, k, f, n, g = shape
    s = jax.ShapeDtypeStruct
    fns = [(lambda a, b, c: mgpu_fp8.gate_up_quantized(a, b, c),
            (s((m, k), BF16), s((g, k, 2 * f), BF16), s((g,), jnp.int32))),
           (lambda h, hs, d, c, r: mgpu_fp8.down_weighted_quantized(h, hs, d, c, r),
            (s((m, f), F8), s((f // 128, m), F32), s((g, f, n), BF16), s((g,), jnp.int32),
             s((m,), F32))),
           (lambda a, b, c, dh: mgpu_fp8.gate_up_grad_quantized(a, b, c, dh),
            (s((m, k), BF16), s((g, k, 2 * f), BF16), s((g,), jnp.int32), s((m, f), BF16))),
           (lambda dy, d, c, r, h: mgpu_fp8.down_weighted_grad_quantized(
               dy, d, c, r, h, dh_dtype=BF16),
            (s((m, n), BF16), s((g, f, n), BF16), s((g,), jnp.int32), s((m,), F32),
             s((m, f), F32)))]
    for (fn, args), name in zip(fns, ("gate_up", "down", "gate_up_grad", "down_grad")):
        text = cuda_module(fn, *args, allow_triton=False)
        assert f"grouped_mlp_{name}_fp8_mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("d_pre_tile_rows", [64, 128])
def test_gpu_grouped_mlp_fp8_fused_against_the_composition(d_pre_tile_rows, monkeypatch):
    """On an fp8 GPU: the fused route and the fp8 composition (its default backends),
    each against the unquantized definition, as the interpreted test above; on Hopper
    with the Mosaic GPU d(pre) kernel on either of its row tiles."""
    if not platform.fp8_runs():
        pytest.skip("needs a CUDA GPU from sm89")
    monkeypatch.setattr(mgpu_fp8, "D_PRE_TILE_ROWS", d_pre_tile_rows)
    sizes = [700, 0, 1500, 1000, 896]
    m, k, f, n = 4096, 1024, 768, 512
    x, w, down = _operands(11, m, k, f, 5, n)
    rw = jax.random.uniform(jax.random.key(12), (m,), minval=0.1, maxval=1.0)
    dy = jax.random.normal(jax.random.key(13), (m, n), F32)
    args = (x, w, down, rw, dy)
    (_, y), grads = _mlp(None, True, sizes)(*args)
    (_, y_fp8), grads_fp8 = _mlp(None, False, sizes)(*args)
    (_, y_ref), grads_ref = _exact(sizes, None)(*(a.astype(F32) for a in args))
    _assert_as_near_as_the_composition((y, *grads), (y_fp8, *grads_fp8), (y_ref, *grads_ref))


def test_cost_estimate_counts_both_products_and_the_operands():
    """The fp8 gate-up's pallas_call carries expert_mlp.costs.gate_up: at least the
    2 m k 2f flops of the gate and up products, and its operands' and results' bytes
    once each (fp8 values, fp32 scales, int32 tile tables, h's values and scales)."""
    m, k, f, g = 200, 256, 256, 4
    x, w, _ = _operands(14, m, k, f, g)
    sizes = jnp.array([50, 0, 70, 80], jnp.int32)
    calls = jaxpr_testlib.traced_pallas_calls(lambda a, b: mlp_fp8.gate_up_quantized(
        a, b, sizes, block_sizes=SMALL, interpret=True), x, w)
    eqns = [e for e in calls if e.params.get("name") == "grouped_mlp_gate_up_fp8_triton"]
    assert len(eqns) == 1, len(eqns)
    cost = eqns[0].params["cost_estimate"]
    assert cost.flops >= 2 * m * k * 2 * f
    operand_bytes = sum(v.aval.size * v.aval.dtype.itemsize for v in eqns[0].invars)
    result_bytes = sum(v.aval.size * v.aval.dtype.itemsize for v in eqns[0].outvars)
    assert cost.bytes_accessed == operand_bytes + result_bytes
