"""grouped_projection through the Mosaic TPU kernels: pltpu.InterpretParams() on CPU
(the default tiles cut to each small case: one row block that the groups share, k and n
padded to 128), the lowering for TPU from this host, the default tiles' rule, and
tpu-marked cases for real hardware."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mosaic_tpu_testlib
from grouped_projection_testlib import ACCELERATOR_CASES, CPU_CASES, Case, check_case, draw
from pallasite.kernels.grouped_matmul import MosaicTpuBlockSizes, fit, grouped_projection
from pallasite.kernels.grouped_matmul import pallas_mosaic_tpu


def _project(compute, interpret=True, block_sizes=None):
    return lambda x, kernel, sizes: grouped_projection(
        x, kernel, sizes, jnp.dtype(compute), interpret,
        implementation="pallas_mosaic_tpu", block_sizes=block_sizes)


# Interpreting Mosaic is slow (about 15 s per case here): empty groups and total < m in
# bf16, g = 64 with most blocks shared, and exact fp32.
TPU_INTERPRET_CASES = [CPU_CASES[1], CPU_CASES[2], CPU_CASES[5]]


@pytest.mark.parametrize("case", TPU_INTERPRET_CASES, ids=str)
def test_interpret_parity(case):
    check_case(case, _project(case.compute))


@pytest.mark.parametrize("x64", [False, True])
def test_lowers_for_tpu_with_scalar_prefetch(x64):
    """gmm, dx and tgmm exported for TPU from this host: three Mosaic modules, none holding
    what a TPU refused (mosaic_tpu_testlib), jax_enable_x64 on or off."""
    specs = (jax.ShapeDtypeStruct((300, 200), jnp.bfloat16),
             jax.ShapeDtypeStruct((6, 200, 136), jnp.bfloat16),
             jax.ShapeDtypeStruct((6,), jnp.int32),
             jax.ShapeDtypeStruct((300, 136), jnp.bfloat16))

    def f(x, kernel, sizes, dy):
        return (pallas_mosaic_tpu.gmm(x, kernel, sizes),
                pallas_mosaic_tpu.gmm(dy, kernel, sizes, transpose_rhs=True),
                pallas_mosaic_tpu.tgmm(x, dy, sizes, num_groups=6))

    exported = mosaic_tpu_testlib.mosaic_modules(f, *specs, x64=x64)
    mosaic_tpu_testlib.assert_no_known_refusals(
        exported, ["grouped_projection_gmm", "grouped_projection_gmm_dx",
                   "grouped_projection_tgmm"])


def test_known_refusals_read_the_lines_a_tpu_refused():
    """mosaic_tpu_testlib's reading, on lines a TPU v5e refused (2026-12-06) and on lines
    it compiled: it finds the first two and not the others."""
    refused = [
        "return %arg0, %arg2, %arg1, %c0_i64, %c0_i64_0 : i32, i32, i32, i64, i64",
        '%149 = "tpu.matmul"(%144, %146, %148) <{precision = #tpu.contract_precision<fp32>}>'
        " : (vector<16x128xbf16>, vector<128x128xbf16>, vector<16x128xf32>)"
        " -> vector<16x128xf32>",
    ]
    compiled = [
        "func.func @k(%arg0: i32) attributes {iteration_bounds = array<i64: 1, 4>, "
        "scalar_prefetch = 2 : i64} {",
        '%9 = "tpu.matmul"(%1, %2, %3) <{precision = #tpu.contract_precision<fp32>}>'
        " : (vector<64x64xf32>, vector<64x64xf32>, vector<64x64xf32>) -> vector<64x64xf32>",
        '%9 = "tpu.matmul"(%1, %2, %3) : (vector<128x128xbf16>, vector<128x128xbf16>,'
        " vector<128x128xf32>) -> vector<128x128xf32>",
    ]
    assert mosaic_tpu_testlib.known_refusals("\n".join(refused)) == refused
    assert mosaic_tpu_testlib.known_refusals("\n".join(compiled)) == []


def test_cost_estimates():
    """Each call carries flops 2*m*k*n of the padded problem it runs (128^3 tiles)."""
    lhs = jnp.zeros((200, 130), jnp.bfloat16)
    rhs = jnp.zeros((3, 130, 120), jnp.bfloat16)
    sizes = jnp.array([30, 0, 150], jnp.int32)
    dy = jnp.zeros((200, 120), jnp.bfloat16)
    tiles = MosaicTpuBlockSizes(128, 128, 128)
    for fn in (lambda: pallas_mosaic_tpu.gmm(lhs, rhs, sizes, block_sizes=tiles),
               lambda: pallas_mosaic_tpu.gmm(dy, rhs, sizes, transpose_rhs=True,
                                             block_sizes=tiles),
               lambda: pallas_mosaic_tpu.tgmm(lhs, dy, sizes, block_sizes=tiles)):
        [eqn] = [e for e in jax.make_jaxpr(fn)().eqns if e.primitive.name == "pallas_call"]
        cost = eqn.params["cost_estimate"]
        assert cost.flops == 2 * 256 * 256 * 128 and cost.bytes_accessed > 256 * 256 * 2


def test_fp16_refused_on_a_tpu():
    """A TPU's compiler does not load fp16 blocks ("Invalid vector type for load", TPU
    v5e): compiled for a TPU the backend refuses fp16 compute by name, so the default
    order moves on to XLA; the interpreter keeps it (test_interpret_parity's fp16 case),
    and other targets are refused whatever the dtype."""
    why = pallas_mosaic_tpu.refusal(jnp.float16, (), target="tpu")
    assert why is not None and "compute float16" in why
    assert pallas_mosaic_tpu.refusal(jnp.bfloat16, (), target="tpu") is None
    assert pallas_mosaic_tpu.refusal(jnp.float32, (), target="tpu") is None
    assert pallas_mosaic_tpu.refusal(jnp.float16, (), target=None) is None
    assert "the target is cuda" in pallas_mosaic_tpu.refusal(jnp.bfloat16, (), target="cuda")


def test_block_sizes_rejected():
    with pytest.raises(ValueError, match="tk % 128"):
        MosaicTpuBlockSizes(tk=64)


# (m, k, n, g), product, dtype -> the default (tm, tk, tn): 256 x 1024 x 1024 cut to the
# product's rows, contraction and columns, balanced so that aligned weights are not padded.
DEFAULT_TILES = [
    ((32768, 4096, 14336, 8), "forward", jnp.bfloat16, (256, 1024, 1024)),
    ((32768, 4096, 14336, 8), "dkernel", jnp.bfloat16, (256, 1024, 1024)),
    ((65536, 2048, 768, 128), "forward", jnp.bfloat16, (256, 1024, 768)),
    ((65536, 2048, 768, 128), "dx", jnp.bfloat16, (256, 768, 1024)),
    ((65536, 1536, 1408, 64), "forward", jnp.bfloat16, (256, 768, 768)),
    ((65536, 7168, 2048, 256), "dkernel", jnp.float32, (256, 512, 512)),
    ((50, 24, 40, 1), "forward", jnp.bfloat16, (64, 128, 128)),
]


@pytest.mark.parametrize("dims, product, dtype, want", DEFAULT_TILES, ids=str)
def test_default_tiles(dims, product, dtype, want):
    m, k, n, g = dims
    got = pallas_mosaic_tpu.default_block_sizes(product=product, m=m, k=k, n=n, g=g,
                                                dtype=dtype)
    assert (got.tm, got.tk, got.tn) == want
    assert fit.reason("pallas_mosaic_tpu", got, product, {"m": m, "k": k, "n": n, "g": g},
                      dtype) is None


@pytest.mark.tpu
@pytest.mark.parametrize("case", ACCELERATOR_CASES, ids=str)
def test_tpu_parity(case):
    if case.compute == "float16":  # refused on a TPU (test_fp16_refused_on_a_tpu)
        with pytest.raises(RuntimeError, match="compute float16"):
            check_case(case, _project(case.compute, interpret=False), platform="tpu")
        check_case(case, lambda x, kernel, sizes: grouped_projection(  # XLA takes it
            x, kernel, sizes, jnp.float16, implementation=("pallas_mosaic_tpu", "xla")),
            platform="tpu")
        return
    check_case(case, _project(case.compute, interpret=False), platform="tpu")


@pytest.mark.tpu
def test_tpu_larger_tiles():
    check_case(ACCELERATOR_CASES[-2], _project("bfloat16", interpret=False,
                                       block_sizes=MosaicTpuBlockSizes(256, 256, 256)),
               platform="tpu")


@pytest.mark.tpu
@pytest.mark.parametrize("case", ACCELERATOR_CASES, ids=str)
def test_tpu_default_path_parity(case):
    """What a TPU runs by default: the Mosaic TPU kernels at their default tiles, and for
    one group (mosaic_tpu_preferred) or fp16 the XLA path, in the form that contains
    non-finite weights only when there are some (xla.CONTAIN_ONLY_NONFINITE_ON). Rows past
    the total must be zero: a bare ragged_dot on a TPU v5e left them non-zero."""
    check_case(case, lambda x, kernel, sizes: grouped_projection(
        x, kernel, sizes, jnp.dtype(case.compute)), platform="tpu")


# Cases whose groups average 256 rows or more (several row blocks per group, k and n past
# one tile, one group empty).
ROWS_CASES = [Case("g4_rows_bf16", 2048, 1280, 1152, 4, total=2000, empty=(2,)),
              Case("g2_rows_fp32", 1024, 640, 520, 2, compute="float32")]


@pytest.mark.tpu
@pytest.mark.parametrize("case", ROWS_CASES, ids=str)
def test_tpu_default_path_with_large_groups(case):
    check_case(case, lambda x, kernel, sizes: grouped_projection(
        x, kernel, sizes, jnp.dtype(case.compute)), platform="tpu")


@pytest.mark.tpu
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("case, implementation", [
    (ACCELERATOR_CASES[-1], "xla"), (ACCELERATOR_CASES[-1], None), (ROWS_CASES[0], None)],
    ids=["xla", "default_small_groups", "default_large_groups"])
def test_tpu_contains_non_finite_weights(value, case, implementation):
    """A non-finite weight reaches only its own group's rows, in the columns it feeds, on
    the XLA path (the lax.cond's containing branch) and on the default path, the Mosaic
    TPU kernels (rows of other groups in a shared row block are masked at the store)."""
    x, kernel, sizes, _ = draw(case)
    ends = np.cumsum(np.asarray(sizes))
    g = int(np.flatnonzero(np.asarray(sizes))[0])  # a group with rows
    y = np.asarray(grouped_projection(x, kernel.at[g, 3, 5].set(value), sizes, jnp.float32,
                                      implementation=implementation), np.float32)
    rows = slice(ends[g] - sizes[g], ends[g])
    assert not np.isfinite(y[rows, 5]).any()
    assert np.isfinite(np.delete(y[rows], 5, axis=1)).all()
    assert np.isfinite(np.delete(y, np.arange(rows.start, rows.stop), axis=0)).all()


@pytest.mark.parametrize("group_offset", [None, 2], ids=["all_groups", "one_local_expert"])
def test_default_path_with_one_group_lowers_without_ragged_dot(group_offset):
    """With one (local) group the XLA path's products, forward and both gradients, are
    dense dots (xla.py, ONE_GROUP): a TPU v5e's compiler failed on ragged_dot with one
    group. Lowered for a TPU from this host."""
    x, kernel = jnp.ones((50, 24), jnp.float32), jnp.ones((1, 24, 40), jnp.float32)
    sizes = jnp.asarray([50] if group_offset is None else [10, 5, 30, 5], jnp.int32)
    grad = jax.jit(jax.grad(lambda x, k: grouped_projection(
        x, k, sizes, jnp.bfloat16, group_offset=group_offset).astype(jnp.float32).sum(),
        argnums=(0, 1)))
    module = jax.export.export(grad, platforms=["tpu"])(x, kernel).mlir_module()
    assert not re.findall(r"\b(?:chlo|stablehlo)\.ragged\w*", module)
    assert re.findall(r"\bstablehlo\.dot_general\b", module)
