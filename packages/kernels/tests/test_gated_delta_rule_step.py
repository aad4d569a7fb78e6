"""gated_delta_rule_step (the gated delta rule's decode step): both backends against the
oracle (the Triton kernel through its interpreter on CPU, compiled on a GPU), unnamed
slots left alone bit for bit, padding rows, in-place updates, a prefill by
chunk_gated_delta_rule then steps against one chunked call, the refusals, and the
kernel's lowering for CUDA from the CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode_testlib
from cuda_export_testlib import TRITON_CALL, cuda_module
from pallasite.kernels import chunk_gated_delta_rule, gated_delta_rule_step, platform
from pallasite.kernels.gated_delta import step_pallas_triton
from pallasite.reference.gated_delta_rule import gated_delta_rule_step_reference

BACKENDS = ["xla", "pallas_triton"]


def _inputs(seed, slots=7, b=4, hk=2, hv=4, dk=16, dv=32, state_dtype=jnp.float32,
            dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 6)
    f = lambda i, s, dt=dtype: jax.random.normal(ks[i], s, jnp.float32).astype(dt)  # noqa: E731
    return dict(state=f(0, (slots, hv, dk, dv), state_dtype), q=f(1, (b, hk, dk)),
                k=f(2, (b, hk, dk)), v=f(3, (b, hv, dv)),
                g=-jax.nn.softplus(f(4, (b, hv), jnp.float32)),
                beta=jax.nn.sigmoid(f(5, (b, hv), jnp.float32)))


CASES = {
    "fp32": dict(),
    "bf16_state_and_inputs": dict(state_dtype=jnp.bfloat16, dtype=jnp.bfloat16),
    "one_head_each": dict(hk=1, hv=1),
    "odd_dims": dict(dk=20, dv=40, hk=3, hv=3, b=2, slots=2),
    "wide_state": dict(dk=128, dv=128, hk=2, hv=4, b=3, slots=5),
}


_close = decode_testlib.close


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_oracle_and_leaves_other_slots_alone(case, backend):
    a = _inputs(1, **CASES[case])
    state, idx = decode_testlib.poisoned_cache(a["state"], a["q"].shape[0])
    kw = dict(a, state=state, state_batch_indices=idx)
    want = gated_delta_rule_step_reference(**kw, use_qk_l2norm_in_kernel=True)
    got = jax.jit(functools.partial(gated_delta_rule_step, implementation=backend,
                                    use_qk_l2norm_in_kernel=True))(**kw)
    decode_testlib.check_step(got, want, idx, a["v"].dtype, a["state"].dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_donated_cache_is_updated_in_place_with_a_scale(backend):
    a = _inputs(2, slots=4)
    want = gated_delta_rule_step_reference(**a, scale=0.3)
    step = jax.jit(functools.partial(gated_delta_rule_step, implementation=backend, scale=0.3),
                   donate_argnames="state")
    o, state = step(**{**a, "state": a["state"] + 0})
    _close(o, want[0], jnp.float32)
    _close(state, want[1], jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefill_then_steps_is_one_chunked_call(backend):
    """chunk_gated_delta_rule over 40 of 48 steps, its final state as the cache, then 8
    steps: the outputs and the state equal one chunked call over the 48."""
    b, t, hk, hv, dk, dv, prefill = 2, 48, 2, 4, 16, 16, 40
    ks = jax.random.split(jax.random.key(3), 6)
    q, k = (jax.random.normal(ks[i], (b, t, hk, dk)) for i in (0, 1))
    v = jax.random.normal(ks[2], (b, t, hv, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, hv)))
    s0 = jax.random.normal(ks[5], (b, hv, dk, dv))
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              chunk_size=16)
    o_all, final_all = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    _, state = chunk_gated_delta_rule(*(x[:, :prefill] for x in (q, k, v, g, beta)), **kw)
    step = jax.jit(functools.partial(gated_delta_rule_step, implementation=backend,
                                     use_qk_l2norm_in_kernel=True))
    for i in range(prefill, t):
        o, state = step(state, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
        np.testing.assert_allclose(o, o_all[:, i], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state, final_all, rtol=1e-4, atol=1e-4)


def test_the_default_on_a_cpu_is_xla():
    a = _inputs(4, slots=4)
    text = str(jax.make_jaxpr(lambda **kw: gated_delta_rule_step(**kw))(**a))
    assert "pallas_call" not in text and "scatter" in text


def test_refusals_are_named():
    a = _inputs(5, slots=4)
    with pytest.raises(ValueError, match="implementation="):
        gated_delta_rule_step(**a, implementation="mosaic")
    with pytest.raises(ValueError, match="v must be"):
        gated_delta_rule_step(**{**a, "v": a["v"][:, :, :3]})
    with pytest.raises(ValueError, match="state has 4 slots for a batch of 2"):
        gated_delta_rule_step(**{name: (t if name == "state" else t[:2])
                                 for name, t in a.items()})
    with pytest.raises(ValueError, match="names a slot twice"):
        gated_delta_rule_step(**a, state_batch_indices=jnp.asarray([0, 1, 1, 2], jnp.int32))
    with pytest.raises(TypeError, match="no gradient"):
        jax.grad(lambda v: jnp.sum(gated_delta_rule_step(**{**a, "v": v})[0]))(a["v"])


def test_the_kernel_lowers_for_cuda_from_cpu():
    s = jax.ShapeDtypeStruct
    slots, b, hk, hv, dk, dv = 64, 8, 16, 32, 128, 128
    args = (s((slots, hv, dk, dv), jnp.float32), s((b, hk, dk), jnp.bfloat16),
            s((b, hk, dk), jnp.bfloat16), s((b, hv, dv), jnp.bfloat16), s((b, hv), jnp.float32),
            s((b, hv), jnp.float32))
    idx = s((b,), jnp.int32)
    text = cuda_module(lambda *a: step_pallas_triton.update(*a[:6], 0.1, a[6], True), *args, idx)
    assert TRITON_CALL in text


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_kernel_matches_the_oracle(case):
    if not platform.triton_runs():
        pytest.skip(f"needs a CUDA GPU from sm80; the device is {platform.device_generation()}")
    a = _inputs(6, **CASES[case])
    state, idx = decode_testlib.poisoned_cache(a["state"], a["q"].shape[0])
    kw = dict(a, state=state, state_batch_indices=idx)
    want = gated_delta_rule_step_reference(**kw, use_qk_l2norm_in_kernel=True)
    got = jax.jit(functools.partial(gated_delta_rule_step, implementation="pallas_triton",
                                    use_qk_l2norm_in_kernel=True),
                  donate_argnames="state")(**{**kw, "state": state + 0})
    decode_testlib.check_step(got, want, idx, a["v"].dtype, a["state"].dtype)
