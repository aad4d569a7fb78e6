"""selective_state_update (the Mamba-2 decode step): both backends against the oracle
(the Triton kernel through its interpreter on CPU, compiled on a GPU), slots left alone,
padding rows, in-place updates, a prefill by chunk_ssd then steps against one scan, the
refusals, and the kernel's lowering for CUDA from the CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode_testlib
from cuda_export_testlib import TRITON_CALL, cuda_module
from pallasite.kernels import chunk_ssd, platform, selective_state_update
from pallasite.kernels.ssd_decode import pallas_triton
from pallasite.reference.ssd_decode import selective_state_update_reference

BACKENDS = ["xla", "pallas_triton"]


def _inputs(seed, slots=7, b=4, h=4, p=20, n=24, g=2, state_dtype=jnp.float32,
            dtype=jnp.float32, d_shape="hp"):
    k = jax.random.split(jax.random.key(seed), 9)
    f = lambda i, shape, dt=dtype: jax.random.normal(k[i], shape, jnp.float32).astype(dt)  # noqa: E731
    d = {"hp": (h, p), "h": (h,)}[d_shape]
    return dict(state=f(0, (slots, h, p, n), state_dtype), x=f(1, (b, h, p)),
                dt=f(2, (b, h)), A=-jnp.exp(f(3, (h,), jnp.float32)), B=f(4, (b, g, n)),
                C=f(5, (b, g, n)), D=f(6, d, jnp.float32), z=f(7, (b, h, p)),
                dt_bias=f(8, (h,), jnp.float32))


CASES = {
    "fp32": dict(),
    "bf16_state_and_inputs": dict(state_dtype=jnp.bfloat16, dtype=jnp.bfloat16),
    "d_per_head_one_group": dict(g=1, d_shape="h"),
    "odd_dims": dict(p=17, n=13, h=3, g=3, b=2, slots=2),
    "wide_state": dict(p=64, n=128, h=2, g=1, b=3, slots=5),
}


_close = decode_testlib.close


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_oracle_and_leaves_other_slots_alone(case, backend):
    a = _inputs(1, **CASES[case])
    # Named slots from the end, a padding row, every other slot poisoned with NaN: they
    # must come back NaN, bit for bit, and no NaN may reach a named slot or y.
    state, idx = decode_testlib.poisoned_cache(a["state"], a["x"].shape[0])
    kw = dict(a, state=state, state_batch_indices=idx)
    want = selective_state_update_reference(**kw, dt_softplus=True)
    got = jax.jit(functools.partial(selective_state_update, implementation=backend,
                                    dt_softplus=True))(**kw)
    decode_testlib.check_step(got, want, idx, a["x"].dtype, a["state"].dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_indices_optional_arguments_or_softplus(backend):
    a = _inputs(2, slots=4)
    plain = {k: a[k] for k in ("state", "x", "dt", "A", "B", "C")}
    for extra in ({}, {"D": a["D"]}, {"z": a["z"]}, {"dt_bias": a["dt_bias"]}):
        want = selective_state_update_reference(**plain, **extra)
        got = selective_state_update(**plain, **extra, implementation=backend)
        _close(got[0], want[0], jnp.float32)
        _close(got[1], want[1], jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_donated_cache_is_updated_in_place(backend):
    a = _inputs(3, slots=4)
    want = selective_state_update_reference(**a)
    step = jax.jit(functools.partial(selective_state_update, implementation=backend),
                   donate_argnames="state")
    y, state = step(**{**a, "state": a["state"] + 0})
    _close(y, want[0], jnp.float32)
    _close(state, want[1], jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefill_by_chunk_ssd_then_steps_is_one_scan(backend):
    bsz, length, h, p, n, g, prefill = 2, 40, 4, 16, 16, 2, 32
    k = jax.random.split(jax.random.key(4), 5)
    x = jax.random.normal(k[0], (bsz, length, h, p))
    dt = jax.nn.softplus(jax.random.normal(k[1], (bsz, length, h)))
    A = -jnp.exp(jax.random.normal(k[2], (h,)))
    B = jax.random.normal(k[3], (bsz, length, g, n))
    C = jax.random.normal(k[4], (bsz, length, g, n))
    scaled, a = x * dt[..., None], A * dt
    y_all, _ = chunk_ssd(scaled, a, B, C, chunk_size=16, implementation="xla")
    _, state = chunk_ssd(scaled[:, :prefill], a[:, :prefill], B[:, :prefill],
                         C[:, :prefill], chunk_size=16, implementation="xla")
    step = jax.jit(functools.partial(selective_state_update, implementation=backend))
    for t in range(prefill, length):
        y, state = step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        np.testing.assert_allclose(y, y_all[:, t], rtol=1e-4, atol=1e-4)


def test_the_default_on_a_cpu_is_xla():
    a = _inputs(5, slots=4)
    text = str(jax.make_jaxpr(lambda **kw: selective_state_update(**kw))(**a))
    assert "pallas_call" not in text and "scatter" in text


def test_refusals_are_named():
    a = _inputs(6, slots=4)
    with pytest.raises(ValueError, match="implementation="):
        selective_state_update(**a, implementation="mosaic")
    with pytest.raises(TypeError, match="dt_softplus"):
        selective_state_update(**a, dt_softplus=1)
    with pytest.raises(ValueError, match="z must be"):
        selective_state_update(**{**a, "z": a["z"][:, :, :3]})
    with pytest.raises(TypeError, match="no gradient"):
        jax.grad(lambda x: jnp.sum(selective_state_update(**{**a, "x": x})[0]))(a["x"])


def test_the_kernel_lowers_for_cuda_from_cpu():
    s = jax.ShapeDtypeStruct
    b, h, p, n, g, slots = 8, 32, 64, 128, 1, 64
    args = (s((slots, h, p, n), jnp.float32), s((b, h, p), jnp.bfloat16), s((b, h), jnp.float32),
            s((h,), jnp.float32), s((b, g, n), jnp.bfloat16), s((b, g, n), jnp.bfloat16),
            s((h,), jnp.float32), s((b, h, p), jnp.bfloat16), s((b,), jnp.int32))
    assert TRITON_CALL in cuda_module(pallas_triton.update, *args)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_kernel_matches_the_oracle(case):
    if not platform.triton_runs():
        pytest.skip(f"needs a CUDA GPU from sm80; the device is {platform.device_generation()}")
    a = _inputs(7, **CASES[case])
    state, idx = decode_testlib.poisoned_cache(a["state"], a["x"].shape[0])
    kw = dict(a, state=state, state_batch_indices=idx)
    want = selective_state_update_reference(**kw, dt_softplus=True)
    got = jax.jit(functools.partial(selective_state_update, implementation="pallas_triton",
                                    dt_softplus=True),
                  donate_argnames="state")(**{**kw, "state": state + 0})
    decode_testlib.check_step(got, want, idx, a["x"].dtype, a["state"].dtype)
