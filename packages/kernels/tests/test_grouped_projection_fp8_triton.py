"""Pallas Triton fp8 grouped products (pallas_triton_fp8): the backend contract's gmm and
tgmm against the fp8 recipe's oracle, block sizes, cost estimates, the CUDA lowering.

CPU (no mark): the kernels through the Triton interpreter. The oracle is
pallasite.reference.quantization's: the operands quantized and dequantized, the ragged
products summed exactly in fp32 (gmm_reference / tgmm_reference). The kernels sum the
same dequantized values, each 128-deep step's dot in fp32, so with fp32 outputs they
differ from it by summation order alone (relative L2 <= 1e-5). The interpreter fills
outputs with NaN before the kernel runs (checked below), so an unwritten row fails.
The lowering for CUDA runs from this CPU under faked sm89 and sm90 devices (the Triton
IR is built, nothing executes).
GPU (-m gpu, sm89 or later): the compiled kernels against the same oracle, within 1e-3
(the tensor cores' own fp8 sums within a step keep fewer bits than fp32).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from cuda_export_testlib import TRITON_CALL, cuda_module
from pallasite.kernels import platform
from pallasite.kernels.grouped_matmul import config, fit, pallas_triton_fp8 as tf
from pallasite.kernels.grouped_matmul import group_metadata, token_blocks
from pallasite.reference import quantization as q
from pallasite.reference.grouped_projection import gmm_reference, tgmm_reference

F8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16
# 64-row tiles, so the interpreter's groups span several tiles; 2 stages keep it cheap.
SMALL = config.TritonBlockSizes(64, 128, 128, group_m=2, num_warps=4, num_stages=2)
# The dkernel with 64 x 64 output tiles: k and n split into several tiles each.
SMALL_TGMM = config.TritonBlockSizes(64, 64, 128, group_m=1, num_warps=4, num_stages=2)


@dataclasses.dataclass
class FakeGpu:
    device_kind: str
    compute_capability: str
    platform: str = "gpu"


GPUS = {"sm89": FakeGpu("NVIDIA L4", "8.9"), "sm90": FakeGpu("NVIDIA H200", "9.0")}


# ----------------------------------------------------------------------------- helpers


def _operands(key, m, k, n, g):
    kx, kw, kd = jax.random.split(key, 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(BF16)
    w = (jax.random.normal(kw, (g, k, n), jnp.float32) / np.sqrt(k)).astype(BF16)
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(BF16)
    return x, w, dy


def _local_rows(sizes, m, offset=None, g=None):
    """Which of the m rows belong to groups [offset, offset + g) (all groups when None)."""
    ends = np.cumsum(sizes)
    starts = ends - np.asarray(sizes)
    lo, hi = (0, len(sizes)) if offset is None else (offset, offset + g)
    rows = np.zeros(m, bool)
    for s, e in zip(starts[lo:hi], ends[lo:hi]):
        rows[s:min(e, m)] = True
    return rows


def _oracle(x, w, dy, sizes, offset=None, g=None):
    """(forward, dx, dkernel) of the fp8 recipe's oracle for local groups [offset,
    offset + g) of `sizes` (w holds all of them): quantized, dequantized, exact fp32."""
    gs = jnp.asarray(sizes, jnp.int32)
    xq, dyq, wq = q.quantized_rows(x, F8), q.quantized_rows(dy, F8), q.quantized_kernel(w, F8)
    keep = jnp.asarray(_local_rows(sizes, x.shape[0], offset, g))[:, None]
    fwd = jnp.where(keep, gmm_reference(xq, wq, gs), 0.0)
    dx = jnp.where(keep, gmm_reference(dyq, wq, gs, transpose_rhs=True), 0.0)
    dk = tgmm_reference(q.quantized_tokens(x, gs, F8), q.quantized_tokens(dy, gs, F8), gs, len(sizes))
    lo = 0 if offset is None else offset
    hi = len(sizes) if offset is None else offset + g
    return fwd, dx, dk[lo:hi]


def _rel_l2(actual, expected):
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def _assert_matches(actual, expected, what, tol=1e-5):
    """Finite where the oracle is (NaN outputs, an unwritten row among them, fail), and
    within `tol` relative L2 of it; exactly zero where it is all zero."""
    a, e = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert a.shape == e.shape, (what, a.shape, e.shape)
    assert np.isfinite(a).all(), f"{what}: {np.sum(~np.isfinite(a))} non-finite entries"
    if not e.any():
        assert not a.any(), f"{what}: the oracle is zero, the kernel is not"
        return
    err = _rel_l2(a, e)
    assert err <= tol, f"{what}: relative L2 {err:.2e} > {tol:.0e}"


@functools.partial(jax.jit, static_argnames=("offset", "g", "out_dtype", "interpret",
                                             "gmm_blocks", "tgmm_blocks"))
def _products(x, w, dy, gs, *, offset=None, g=None, out_dtype=jnp.float32, interpret=True,
              gmm_blocks=SMALL, tgmm_blocks=SMALL_TGMM):
    """(forward, dx, dkernel) through the backend contract; w holds the local groups."""
    off = None if offset is None else jnp.int32(offset)
    fwd = tf.gmm(x, w, gs, group_offset=off, out_dtype=out_dtype, block_sizes=gmm_blocks,
                 interpret=interpret)
    dx = tf.gmm(dy, w, gs, group_offset=off, transpose_rhs=True, out_dtype=out_dtype,
                block_sizes=gmm_blocks, interpret=interpret)
    dk = tf.tgmm(x, dy, gs, num_groups=g, group_offset=off, out_dtype=out_dtype,
                 block_sizes=tgmm_blocks, interpret=interpret)
    return fwd, dx, dk


def _poison_rows(a, rows):
    """a with NaN in `rows` (a boolean mask)."""
    return jnp.where(jnp.asarray(rows)[:, None], jnp.nan, a).astype(a.dtype)


# ----------------------------------------------------------------------------- the interpreter


def test_interpreter_poisons_unwritten_outputs():
    """What the parity tests rely on: an output entry no program writes is NaN in the
    interpreter, so it cannot pass as a zero."""
    def kernel(x_ref, o_ref):
        o_ref[pl.ds(0, 8)] = x_ref[...]  # o[8:] unwritten

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                         interpret=True)(jnp.ones((8,), jnp.float32))
    out = np.asarray(out)
    assert (out[:8] == 1).all() and np.isnan(out[8:]).all()


# (m, k, n, group sizes, NaN rows past the total): uneven groups with an empty one, total
# < m with m not a multiple of 8 and k, n not multiples of 128, one group holding every
# row, every group empty.
CASES = {
    "uneven_empty": (200, 256, 128, [70, 0, 100, 30], False),
    "total_lt_m": (131, 200, 300, [3, 60, 1, 0, 37], True),
    "one_group": (128, 64, 96, [0, 128, 0], False),
    "all_empty": (96, 64, 64, [0, 0, 0], True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_products_match_the_oracle(case):
    """forward, dx and dkernel in fp32 against the oracle; rows of no group exactly zero,
    with NaN in those rows of x and dy where the case says so."""
    m, k, n, sizes, poison = CASES[case]
    x, w, dy = _operands(jax.random.key(m), m, k, n, len(sizes))
    fwd_ref, dx_ref, dk_ref = _oracle(x, w, dy, sizes)
    past = ~_local_rows(sizes, m)
    if poison:
        x, dy = _poison_rows(x, past), _poison_rows(dy, past)
    fwd, dx, dk = _products(x, w, dy, jnp.asarray(sizes, jnp.int32))
    _assert_matches(fwd, fwd_ref, "forward")
    _assert_matches(dx, dx_ref, "dx")
    _assert_matches(dk, dk_ref, "dkernel")
    assert not np.asarray(fwd)[past].any() and not np.asarray(dx)[past].any()
    empty = [i for i, s in enumerate(sizes) if s == 0]
    assert not np.asarray(dk)[empty].any()


def test_local_experts_match_the_oracle():
    """group_offset: the kernel holds groups [1, 4) of 5; the other experts' rows (NaN
    here) are zeros, their groups absent from the dkernel."""
    sizes, offset, g = [30, 40, 0, 50, 60], 1, 3
    m, k, n = 200, 160, 136
    x, w_all, dy = _operands(jax.random.key(5), m, k, n, len(sizes))
    fwd_ref, dx_ref, dk_ref = _oracle(x, w_all, dy, sizes, offset, g)
    other = ~_local_rows(sizes, m, offset, g)
    x, dy = _poison_rows(x, other), _poison_rows(dy, other)
    fwd, dx, dk = _products(x, w_all[offset:offset + g], dy, jnp.asarray(sizes, jnp.int32),
                            offset=offset, g=g)
    _assert_matches(fwd, fwd_ref, "forward")
    _assert_matches(dx, dx_ref, "dx")
    _assert_matches(dk, dk_ref, "dkernel")
    assert not np.asarray(fwd)[other].any() and not np.asarray(dx)[other].any()


def test_bf16_outputs_round_the_fp32_sums_once():
    m, k, n, sizes = 136, 256, 128, [50, 0, 86]
    x, w, dy = _operands(jax.random.key(9), m, k, n, len(sizes))
    out = _products(x, w, dy, jnp.asarray(sizes, jnp.int32), out_dtype=BF16)
    for got, ref, what in zip(out, _oracle(x, w, dy, sizes), ("forward", "dx", "dkernel")):
        assert got.dtype == BF16
        # fp32 sums differ only in order; after one rounding nearly every entry agrees.
        same = np.mean(np.asarray(got, np.float32) == np.asarray(ref.astype(BF16), np.float32))
        assert same > 0.95, (what, same)
        _assert_matches(got, ref, what, tol=4e-3)  # one bf16 rounding: ~2.3e-3


def test_a_nan_row_stays_in_its_row_and_its_group():
    """NaN at x[75, 130] (group 2 of [70, 0, 100]) and dy[10, 7] (group 0): the forward's
    row 75 and the dx's row 10 are NaN (their 1 x 128 blocks' scales are), every other
    row matches the oracle; in the dkernel, group 2's row 130 and group 0's column 7 are
    NaN (their token blocks' column scales are), the rest matches, empty group 1 is zero."""
    m, k, n, sizes = 180, 256, 128, [70, 0, 100]
    x, w, dy = _operands(jax.random.key(3), m, k, n, len(sizes))
    fwd_ref, dx_ref, dk_ref = map(np.asarray, _oracle(x, w, dy, sizes))
    x = x.at[75, 130].set(jnp.nan)
    dy = dy.at[10, 7].set(jnp.nan)
    fwd, dx, dk = map(np.asarray, _products(x, w, dy, jnp.asarray(sizes, jnp.int32)))
    assert np.isnan(fwd[75]).all() and np.isnan(dx[10]).all()
    _assert_matches(np.delete(fwd, 75, 0), np.delete(fwd_ref, 75, 0), "forward, other rows")
    _assert_matches(np.delete(dx, 10, 0), np.delete(dx_ref, 10, 0), "dx, other rows")
    assert np.isnan(dk[2, 130]).all() and np.isnan(dk[0, :, 7]).all()
    _assert_matches(np.delete(dk[2], 130, 0), np.delete(dk_ref[2], 130, 0), "dkernel 2")
    _assert_matches(np.delete(dk[0], 7, 1), np.delete(dk_ref[0], 7, 1), "dkernel 0")
    assert not dk[1].any()


# ----------------------------------------------------------------------------- arguments


def test_bad_arguments():
    x, w, dy = _operands(jax.random.key(0), 64, 128, 128, 2)
    gs = jnp.array([30, 34], jnp.int32)
    with pytest.raises(TypeError, match="lhs is int32"):
        tf.gmm(x.astype(jnp.int32), w, gs, interpret=True)
    with pytest.raises(TypeError, match="rhs is float64"):
        tf.gmm(x, np.asarray(w, np.float64), gs, interpret=True)
    with pytest.raises(TypeError, match="group_sizes must be int32"):
        tf.tgmm(x, dy, gs.astype(jnp.float32), interpret=True)
    with pytest.raises(TypeError, match="TritonBlockSizes"):
        tf.gmm(x, w, gs, block_sizes=object(), interpret=True)
    bad = {"block_k": dataclasses.replace(SMALL, block_k=64),
           "block_n": dataclasses.replace(SMALL, block_n=256),
           "block_m": dataclasses.replace(SMALL, block_m=32)}
    for name, blocks in bad.items():
        with pytest.raises(ValueError, match=name):
            tf.gmm(x, w, gs, block_sizes=blocks, interpret=True)
    with pytest.raises(ValueError, match="block_k"):
        tf.tgmm(x, dy, gs, block_sizes=dataclasses.replace(SMALL_TGMM, block_k=64),
                interpret=True)


def test_oversized_fp8_operands_are_refused_by_name():
    """DeepSeek-V3's 256 experts (7168 x 2048) in fp8 pass 2**31 elements in under 4 GiB:
    Pallas Triton's 32-bit offsets would wrap, so the kernels refuse them (traced only)."""
    s = jax.ShapeDtypeStruct
    lhs, lhs_scales = s((256, 7168), F8), s((56, 256), jnp.float32)
    rhs, rhs_scales = s((256, 2048, 7168), F8), s((256, 16, 56), jnp.float32)
    with pytest.raises(ValueError, match=r"rhs \(256, 2048, 7168\) float8_e4m3fn .* 2\*\*31"):
        jax.eval_shape(lambda *a: tf.gmm_quantized(*a, interpret=True), lhs, lhs_scales, rhs,
                       rhs_scales, s((256,), jnp.int32))
    with pytest.raises(ValueError, match="lhs_t"):
        jax.eval_shape(lambda *a: tf.tgmm_quantized(*a, interpret=True),
                       s((7168, 2**19), F8), s((2**12, 7168), jnp.float32), s((64, 2**19), F8),
                       s((2**12, 64), jnp.float32), s((8,), jnp.int32), s((8,), jnp.int32))


def test_zero_sizes_give_zeros():
    gs = jnp.array([3, 0], jnp.int32)
    out = tf.gmm(jnp.zeros((0, 128), BF16), jnp.zeros((2, 128, 64), BF16), gs, interpret=True)
    assert out.shape == (0, 64)
    out = tf.gmm(jnp.ones((8, 0), BF16), jnp.ones((2, 0, 64), BF16), gs, interpret=True,
                 out_dtype=jnp.float32)
    assert out.shape == (8, 64) and not np.asarray(out).any()
    dk = tf.tgmm(jnp.ones((8, 0), BF16), jnp.ones((8, 64), BF16), gs, interpret=True)
    assert dk.shape == (2, 0, 64)


# ----------------------------------------------------------------------------- block sizes


# The 128 x 128 tiles on 8 warps with 3 stages (96 KiB), the runner-up measured on the H200.
WIDE = config.TritonBlockSizes(128, 128, 128, group_m=8, num_warps=8, num_stages=3)


def test_fit_rule():
    dims = dict(m=65536, k=2048, n=768, g=128)
    reason = functools.partial(fit.reason, "pallas_triton_fp8", dims=dims, dtype=F8)
    for product in ("forward", "dx", "dkernel"):
        assert reason(WIDE, product) is None
    assert "block_k=64" in reason(dataclasses.replace(WIDE, block_k=64), "dx")
    assert "block_n=256" in reason(dataclasses.replace(WIDE, block_n=256), "forward")
    assert "block_m=256" in reason(dataclasses.replace(WIDE, block_m=256, num_stages=1),
                                   "forward")
    assert reason(dataclasses.replace(tf.TGMM_FP8, block_n=256, num_stages=2),
                  "dkernel") is None  # the dkernel's columns are per-column scales
    # Off CUDA pallasite's own choices get the budget every fp8 GPU has (sm89's 99 KiB):
    # 4 stages of 128 x 128 tiles (32 KiB each) do not fit; the caller's own config is
    # not held to it.
    four = dataclasses.replace(WIDE, num_stages=4)
    assert "131072 bytes" in reason(four, "forward")
    assert fit.reason("pallas_triton_fp8", four, "forward", dims, F8, caller=True) is None
    # Tiles no larger than the dimension needs: 128 rows of A for k = 40 is allowed (256
    # always is), 512 rows is not.
    small = dict(m=64, k=40, n=40, g=2)
    assert fit.reason("pallas_triton_fp8", WIDE, "dkernel", small, F8) is None
    big = dataclasses.replace(WIDE, block_m=512, num_stages=1)
    assert "block_m=512" in fit.reason("pallas_triton_fp8", big, "dkernel", small, F8)


@pytest.mark.parametrize("generation", sorted(GPUS))
def test_defaults_fit_every_fp8_gpu(generation, monkeypatch):
    """The measured defaults (96 KiB) pass the fit rule on sm89 (99 KiB) and sm90, and
    are what an untuned call resolves to there."""
    monkeypatch.setattr(platform, "_default_device", lambda: GPUS[generation])
    dims = dict(m=32768, k=4096, n=14336, g=8)
    for product in ("forward", "dx", "dkernel"):
        bs = tf.resolve_block_sizes(None, product=product, **dims)
        assert bs == (tf.TGMM_FP8 if product == "dkernel" else tf.GMM_FP8), (product, bs)
        assert fit.reason("pallas_triton_fp8", bs, product, dims, F8) is None


def test_defaults_off_cuda():
    for product in ("forward", "dx", "dkernel"):
        bs = tf.resolve_block_sizes(None, product=product, m=4096, k=512, n=512, g=8)
        assert bs == (tf.TGMM_FP8 if product == "dkernel" else tf.GMM_FP8), (product, bs)


# ----------------------------------------------------------------------------- cost estimates


def _cost_of(fn):
    eqns = [e for e in jax.make_jaxpr(fn)().eqns if e.primitive.name == "pallas_call"]
    assert len(eqns) == 1
    return eqns[0].params["cost_estimate"]


def test_cost_estimates():
    """flops 2*M*K*N of the A [M, K] @ B [N, K]^T product; bytes: the call's operands
    (fp8 values, fp32 scales, int32 tables) and result, once each."""
    m, k, n, g = 100, 200, 136, 3
    kb, nb = 2, 2
    sizes = jnp.array([30, 0, 50], jnp.int32)
    lhs, rhs = jnp.zeros((m, k), F8), jnp.zeros((g, n, k), F8)
    lhs_s, rhs_s = jnp.ones((kb, m), jnp.float32), jnp.ones((g, nb, kb), jnp.float32)
    cost = _cost_of(lambda: tf.gmm_quantized(lhs, lhs_s, rhs, rhs_s, sizes,
                                             out_dtype=jnp.float32, block_sizes=SMALL,
                                             interpret=True))
    visits = group_metadata.num_visits(m, g, SMALL.block_m)
    assert cost.flops == 2 * m * k * n and cost.transcendentals == 0
    assert cost.bytes_accessed == (3 * visits * 4 + m * k + 4 * kb * m + g * n * k
                                   + 4 * g * nb * kb + 4 * m * n)
    t = token_blocks.bound(m, g)
    p = 128 * t
    cost = _cost_of(lambda: tf.tgmm_quantized(
        jnp.zeros((k, p), F8), jnp.ones((t, k), jnp.float32), jnp.zeros((n, p), F8),
        jnp.ones((t, n), jnp.float32), jnp.zeros((g,), jnp.int32), jnp.zeros((g,), jnp.int32),
        out_dtype=BF16, block_sizes=SMALL_TGMM, interpret=True))
    assert cost.flops == 2 * k * p * n
    assert cost.bytes_accessed == (2 * g * 4 + k * p + 4 * t * k + n * p + 4 * t * n
                                   + 2 * g * k * n)


# ----------------------------------------------------------------------------- lowering


def _cuda_module(f, args, generation, monkeypatch):
    """f lowered for CUDA from this CPU with the default device faked as `generation` (so
    the quantizers are the Triton ones), under an abstract mesh of that GPU (Triton's
    lowering needs its device)."""
    monkeypatch.setattr(platform, "_default_device", lambda: GPUS[generation])
    return cuda_module(f, *args, device_kind=GPUS[generation].device_kind)


@pytest.mark.parametrize("generation,blocks", [("sm89", None), ("sm90", None), ("sm90", WIDE)])
@pytest.mark.parametrize("product", ["forward", "dx", "dkernel"])
def test_lowers_for_cuda_from_cpu(product, generation, blocks, monkeypatch):
    """Each product lowers to Triton (the default blocks, and the 128 x 128 tiles), with
    its two quantizers (three Triton calls), local experts (a traced offset), and k, n
    not multiples of 128."""
    m, k, n, g = 4096, 1408, 704, 8
    s = jax.ShapeDtypeStruct
    gs, off = s((2 * g,), jnp.int32), s((), jnp.int32)
    if product == "dkernel":
        f = lambda a, b, c, o: tf.tgmm(a, b, c, num_groups=g, group_offset=o,  # noqa: E731
                                       block_sizes=blocks)
        args = (s((m, k), BF16), s((m, n), BF16), gs, off)
    else:
        dx = product == "dx"
        f = lambda a, b, c, o: tf.gmm(a, b, c, group_offset=o, transpose_rhs=dx,  # noqa: E731
                                      block_sizes=blocks)
        args = (s((m, n if dx else k), BF16), s((g, k, n), BF16), gs, off)
    text = _cuda_module(f, args, generation, monkeypatch)
    assert text.count(TRITON_CALL) == 3, text.count(TRITON_CALL)
    name = "tgmm" if product == "dkernel" else "gmm"
    assert f"grouped_projection_{name}_fp8_triton" in text


# ----------------------------------------------------------------------------- GPU


def _gpu_cases():
    from pallasite.reference.inputs import random_group_sizes

    ks = jax.random.split(jax.random.key(11), 2)
    return [
        ("dirichlet", 4096, 512, 768, random_group_sizes(ks[0], 4096, 8)),
        ("total_lt_m", 4096, 256, 384, random_group_sizes(ks[1], 4096, 8, total=3001,
                                                          empty=(2, 5))),
        ("odd", 1000, 200, 328, jnp.array([1, 300, 0, 7, 600], jnp.int32)),
        ("all_empty", 512, 128, 256, jnp.zeros((4,), jnp.int32)),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", ["default", "wide"])
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: c[0])
def test_gpu_products_match_the_oracle(case, blocks):
    """The compiled kernels against the oracle. The tensor cores' fp8 sums within one
    128-deep step keep fewer bits than fp32 (the reason for the per-step promotion), so
    the bound is looser than the interpreter's."""
    if not platform.fp8_runs():
        pytest.skip(f"fp8 needs a CUDA GPU from sm89; the device is "
                    f"{platform.device_generation()}")
    _, m, k, n, gs = case
    sizes = [int(s) for s in np.asarray(gs)]
    x, w, dy = _operands(jax.random.key(m), m, k, n, len(sizes))
    blk = {"default": (None, None), "wide": (WIDE, WIDE)}[blocks]
    out = _products(x, w, dy, jnp.asarray(sizes, jnp.int32), interpret=False,
                    gmm_blocks=blk[0], tgmm_blocks=blk[1])
    for got, ref, what in zip(out, _oracle(x, w, dy, sizes), ("forward", "dx", "dkernel")):
        _assert_matches(got, ref, what, tol=1e-3)
    past = ~_local_rows(sizes, m)
    assert not np.asarray(out[0])[past].any() and not np.asarray(out[1])[past].any()
