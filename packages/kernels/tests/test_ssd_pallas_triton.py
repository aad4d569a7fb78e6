"""pallasite.kernels.ssd.pallas_triton: values and every gradient against an oracle.

CPU: the Triton interpreter on tiny shapes (fp32 and bf16, groups 1 and > 1, initial
states), input validation and the CUDA lowering (sharding: test_ssd_sharding).
GPU (-m gpu): the TARGETS shapes scaled down, bf16, groups 1 and 8, compiled kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_ssd_base as base
from cuda_export_testlib import TRITON_CALL, cuda_module
from pallasite.kernels.ssd import pallas_triton as pt
from pallasite.reference import parity
from pallasite.reference.inputs import ssd_initial_state, ssd_inputs

_HI = jax.lax.Precision.HIGHEST


def _sequential(x, a, b, c, s0):
    """The recurrence one step at a time, fp32 HIGHEST: x [b,l,h,p], a [b,l,h],
    b/c [b,l,g,n], s0 [b,h,p,n] -> (y [b,l,h,p], final [b,h,p,n])."""
    hpg = x.shape[2] // b.shape[2]
    bh, ch = jnp.repeat(b, hpg, axis=2), jnp.repeat(c, hpg, axis=2)

    def step(s, inp):
        xt, at, bt, ct = inp
        s = jnp.exp(at)[..., None, None] * s + xt[..., :, None] * bt[..., None, :]
        return s, jnp.einsum("bhpn,bhn->bhp", s, ct, precision=_HI)

    sw = lambda t: jnp.swapaxes(t, 0, 1)
    s, ys = jax.lax.scan(step, s0, (sw(x), sw(a), sw(bh), sw(ch)))
    return sw(ys), s


def _oracle(x, a, b, c, s0):
    """pallasite.reference.ssd's sequential oracle where it exists, else the local one."""
    try:
        from pallasite.reference.ssd import ssd_sequential  # noqa: PLC0415
    except ImportError:
        return _sequential(x, a, b, c, s0)
    return ssd_sequential(x, a, b, c, initial_state=s0)


def _chunked(t, chunk):
    return t.reshape(t.shape[0], t.shape[1] // chunk, chunk, *t.shape[2:])


def _rel(actual, expected) -> float:
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    return float(np.max(np.abs(actual - expected)) / (np.max(np.abs(expected)) + 1e-30))


def _check(shape, dtype, chunk, tol, *, interpret, block_sizes=None, seed=0):
    bsz, length, h, p, n, g = shape
    key = jax.random.key(seed)
    x, a, b, c = ssd_inputs(key, bsz, length, h, p, n, g, dtype)
    s0 = ssd_initial_state(jax.random.fold_in(key, 1), bsz, h, p, n)
    dy = jax.random.normal(jax.random.fold_in(key, 2), x.shape, jnp.float32)
    dfin = jax.random.normal(jax.random.fold_in(key, 3), s0.shape, jnp.float32)
    f32 = lambda t: t.astype(jnp.float32)
    (y_ref, fin_ref), vjp = jax.vjp(_oracle, f32(x), f32(a), f32(b), f32(c), s0)
    grads_ref = vjp((dy, dfin))

    ch = lambda t: _chunked(t, chunk)
    # Poisoned outputs would show as NaN or huge errors: every output is fully written
    # or the comparison fails.
    y, fin, states = pt.forward(
        ch(x), ch(a), ch(b), ch(c), s0, interpret=interpret, block_sizes=block_sizes
    )
    # The entry states leave in the matmul operand dtype (the dtype they multiply in).
    assert y.dtype == x.dtype and fin.dtype == jnp.float32 and states.dtype == x.dtype
    errs = {"y": _rel(y.reshape(y_ref.shape), y_ref), "final": _rel(fin, fin_ref)}
    grads = pt.backward(
        ch(x), ch(a), ch(b), ch(c), states, ch(dy.astype(dtype)), dfin,
        interpret=interpret, block_sizes=block_sizes,
    )
    for name, got, want, primal in zip(
        ("dx", "da", "db", "dc", "dinitial"), grads, grads_ref, (x, a, b, c, s0)
    ):
        assert got.dtype == primal.dtype, name
        errs[name] = _rel(got.reshape(want.shape), want)
    bad = {k: v for k, v in errs.items() if not np.isfinite(v) or v > tol}
    assert not bad, f"{shape} {jnp.dtype(dtype).name}: {errs}"
    return errs


@pytest.mark.parametrize(
    "shape,dtype,chunk,bm,tol",
    [
        ((2, 64, 4, 16, 16, 2), jnp.float32, 32, 16, 2e-5),
        ((1, 64, 6, 16, 32, 1), jnp.bfloat16, 64, 32, 2e-2),
        ((2, 64, 8, 32, 16, 8), jnp.bfloat16, 32, 16, 2e-2),
    ],
)
def test_interpret_matches_oracle(shape, dtype, chunk, bm, tol):
    bs = pt.BlockSizes(block_m=bm, block_t=bm)
    _check(shape, dtype, chunk, tol, interpret=True, block_sizes=bs)


@pytest.mark.parametrize(
    "shape,heads,block_n",
    [
        ((1, 64, 8, 16, 32, 2), 2, 16),  # 2 heads per output program, state in 2 columns
        ((1, 64, 8, 16, 32, 1), 4, 32),  # 4 heads sharing each C B^T block
        ((1, 64, 6, 16, 32, 2), 4, 16),  # 3 heads a group: falls back to 1 per program
        ((1, 64, 4, 16, 32, 1), 1, 32),  # one head per program, one column block
    ],
)
def test_interpret_heads_and_state_columns(shape, heads, block_n):
    """Output programs holding one or several heads of a group, and the state scan whole
    or split over state columns, all against the oracle."""
    bs = pt.BlockSizes(block_m=16, block_t=16, heads=heads, block_n=block_n)
    _check(shape, jnp.float32, 32, 2e-5, interpret=True, block_sizes=bs)


def test_interpret_head_dim_128_groups_8_chunk_128():
    """The extra bench geometry (head_dim 128, 8 groups, chunk 128) with the default
    blocks: two heads per output program, 64 state columns per scan program."""
    _check((1, 256, 16, 128, 128, 8), jnp.bfloat16, 128, 2e-2, interpret=True,
           block_sizes=pt.BlockSizes())


def test_output_heads_divides_the_group():
    assert pt.output_heads(pt.BlockSizes(heads=4), 32, 1) == 4
    assert pt.output_heads(pt.BlockSizes(heads=4), 64, 8) == 4
    assert pt.output_heads(pt.BlockSizes(heads=4), 12, 2) == 2
    assert pt.output_heads(pt.BlockSizes(heads=4), 6, 2) == 1


# The shared SSD test base (the same comparisons every backend meets), at widths the
# Triton dots take (>= 16): the backend contract directly, and through ssd.api's custom_vjp.
_BASE_CASES = [
    base.case(2, 2, 32, 4, 16, 32, 2, jnp.float32, tol=parity.EXACT_FP32),
    base.case(1, 2, 64, 2, 16, 16, 1, jnp.float32, a_scale=20.0, tol=parity.EXACT_FP32),
]


@pytest.mark.parametrize("c", _BASE_CASES[:1], ids=lambda c: c.name)
def test_backend_contract_interpret(c):
    base.check_forward_contract(pt, jax.random.key(0), c.shape, c.dtype, interpret=True,
                                tol=c.tol)


def test_api_custom_vjp_parity_interpret():
    rows = parity.check_parity(_BASE_CASES, base.run_case(("pallas_triton", True)))
    assert all(r.ok for r in rows), parity.format_table(rows)


def test_bad_input_names_argument():
    x = jnp.zeros((1, 2, 32, 4, 16), jnp.float32)
    a = jnp.zeros((1, 2, 32, 4), jnp.float32)
    b = jnp.zeros((1, 2, 32, 3, 16), jnp.float32)
    s0 = jnp.zeros((1, 4, 16, 16), jnp.float32)
    with pytest.raises(ValueError, match="groups"):
        pt.forward(x, a, b, b, s0, interpret=True)
    with pytest.raises(ValueError, match="a must be"):
        pt.forward(x, a[:, :, :16], b[:, :, :, :1], b[:, :, :, :1], s0, interpret=True)
    with pytest.raises(ValueError, match="initial_state"):
        pt.forward(x, a, b[:, :, :, :1], b[:, :, :, :1], s0[:, :2], interpret=True)
    with pytest.raises(ValueError, match="head_dim"):
        x3 = jnp.zeros((1, 2, 32, 4, 24), jnp.float32)
        s3 = jnp.zeros((1, 4, 24, 16), jnp.float32)
        pt.forward(x3, a, b[:, :, :, :1], b[:, :, :, :1], s3, interpret=True)


@pytest.mark.parametrize("shape,dtype,tol", [((2, 64, 4, 16, 16, 2), jnp.float32, 2e-5),
                                             ((1, 64, 6, 16, 32, 1), jnp.bfloat16, 2e-2)])
def test_scan_weights_on_the_left_operand(shape, dtype, tol, monkeypatch):
    """SCAN_WEIGHTS_ON_LEFT flipped (the state scans' chunk weights on x or dy rather than
    on B or C): values and gradients against the oracle, and the kernels still lower for
    CUDA."""
    monkeypatch.setattr(pt, "SCAN_WEIGHTS_ON_LEFT", not pt.SCAN_WEIGHTS_ON_LEFT)
    _check(shape, dtype, 32, tol, interpret=True,
           block_sizes=pt.BlockSizes(block_m=16, block_t=16))
    test_cuda_lowering_on_cpu()


def _lowering_args(c, h, p, g, n):
    """(forward's, backward's) argument structs: one row, two chunks of c steps."""
    S = jax.ShapeDtypeStruct
    x = S((1, 2, c, h, p), jnp.bfloat16)
    a = S((1, 2, c, h), jnp.float32)
    b = S((1, 2, c, g, n), jnp.bfloat16)
    s0 = S((1, h, p, n), jnp.float32)
    st = S((1, 2, h, p, n), jnp.float32)
    return (x, a, b, b, s0), (x, a, b, b, st, x, s0)


def test_cuda_lowering_on_cpu():
    """The kernels lower to Triton for an H200 without one (C = 256, p = 64, n = 128)."""
    wide = pt.BlockSizes(heads=4, block_n=128, block_t=64, num_warps=8)
    fwd, bwd = _lowering_args(256, 4, 64, 2, 128)
    fwd128, bwd128 = _lowering_args(128, 16, 128, 8, 128)
    for fn, args, kernels in (
        (pt.forward, fwd, 2),
        (pt.backward, bwd, 3),
        (functools.partial(pt.forward, block_sizes=wide), fwd, 2),
        (functools.partial(pt.backward, block_sizes=wide), bwd, 3),
        (pt.forward, fwd128, 2),
        (pt.backward, bwd128, 3),
    ):
        assert cuda_module(fn, *args).count(TRITON_CALL) >= kernels


# TARGETS rows (b, l, h, p, n, g) scaled down in batch, length and heads; chunk 256.
_GPU_SHAPES = [
    (2, 1024, 8, 64, 128, 1),
    (1, 2048, 16, 64, 128, 8),
    (1, 1024, 10, 64, 128, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", _GPU_SHAPES)
def test_gpu_matches_oracle(shape):
    _check(shape, jnp.bfloat16, 256, 2e-2, interpret=False)


@pytest.mark.gpu
def test_gpu_scan_weights_on_the_left_operand(monkeypatch):
    """The state scans' other form (SCAN_WEIGHTS_ON_LEFT flipped) compiled, against the
    oracle."""
    monkeypatch.setattr(pt, "SCAN_WEIGHTS_ON_LEFT", not pt.SCAN_WEIGHTS_ON_LEFT)
    _check(_GPU_SHAPES[1], jnp.bfloat16, 256, 2e-2, interpret=False)


def test_backward_row_kernels_at_their_own_pipeline_depth(monkeypatch):
    """BWD_ROWS_NUM_STAGES set: lowered for CUDA, the two row kernels' Triton calls carry
    that depth and the reverse state scan keeps the config's."""
    import re  # noqa: PLC0415

    monkeypatch.setattr(pt, "BWD_ROWS_NUM_STAGES", 1)
    text = cuda_module(functools.partial(pt.backward, block_sizes=pt.BlockSizes(num_stages=2)),
                       *_lowering_args(256, 4, 64, 2, 128)[1])
    stages = dict(re.findall(r'name = "(\w+)", num_stages = (\d+) : i32', text))
    assert stages == {"ssd_state_scan_reverse": "2", "ssd_bwd_rows_j": "1",
                      "ssd_bwd_rows_i": "1"}, stages


@pytest.mark.gpu
def test_gpu_backward_row_kernels_at_one_stage(monkeypatch):
    """The backward row kernels at one pipeline stage (BWD_ROWS_NUM_STAGES) compiled,
    against the oracle."""
    monkeypatch.setattr(pt, "BWD_ROWS_NUM_STAGES", 1)
    _check(_GPU_SHAPES[0], jnp.bfloat16, 256, 2e-2, interpret=False)


@pytest.mark.gpu
def test_gpu_fp32_matches_oracle():
    _check((1, 512, 4, 64, 128, 2), jnp.float32, 256, 2e-2, interpret=False)
