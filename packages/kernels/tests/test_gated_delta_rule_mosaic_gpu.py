"""The gated delta rule's Mosaic GPU forward state pass (gated_delta/pallas_mosaic_gpu.py):
its states, u and finals against a float64 loop over the chunks and against the Pallas
Triton state pass on the same operands (the Mosaic GPU interpreter on the CPU, compiled on
a Hopper GPU under the `gpu` mark); the forward and its gradients with the pass selected
(MOSAIC_GPU_STATE_PASS) against the definition; what it refuses, by name; its lowering
for CUDA from the CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_delta_testlib as testlib
from cuda_export_testlib import cuda_module
from pallasite.kernels import chunk_gated_delta_rule, platform
from pallasite.kernels.gated_delta import packing, pallas_mosaic_gpu, pallas_triton
from pallasite.kernels.ssd import decay
from pallasite.reference import parity
from pallasite.reference.gated_delta_rule import gated_delta_rule_sequential

BF16, F32 = jnp.bfloat16, jnp.float32
KERNEL = functools.partial(chunk_gated_delta_rule, implementation="pallas_triton")


def _operands(seed, b, nc, hv, hk, dk, dv, dtype=BF16):
    """The state pass's operands in the chunk layout (chunk 64): W, U, k, the cumulative
    decay pair, fp32 initial states. Random, never zero."""
    ks = jax.random.split(jax.random.key(seed), 6)
    f = lambda i, s, x=1.0: (jax.random.normal(ks[i], s, F32) * x)  # noqa: E731
    c = pallas_mosaic_gpu.CHUNK
    g = -jax.nn.softplus(f(3, (b, nc, c, hv))) * 0.2
    hi, lo = decay.cumsum_pair(g, axis=2)
    return (f(0, (b, nc, c, hv, dk), 0.1).astype(dtype), f(1, (b, nc, c, hv, dv)).astype(dtype),
            f(2, (b, nc, c, hk, dk), 0.1).astype(dtype), hi, lo, f(4, (b, hv, dk, dv)))


def _loop(w, big_u, k, hi, lo, init):
    """(states, u, finals) by the definition of the pass, chunk by chunk in float64:
    u = U - W S, S' = exp(G_last) S + (exp(G_last - G) k)^T u."""
    f = lambda a: np.asarray(jnp.asarray(a, F32), np.float64)  # noqa: E731
    w, big_u, k, hi, lo, init = map(f, (w, big_u, k, hi, lo, init))
    b, nc, _, hv, _ = w.shape
    per = hv // k.shape[3]
    states = np.zeros((b, nc, hv) + init.shape[2:])
    u = np.zeros(big_u.shape)
    finals = np.zeros(init.shape)
    for i in range(b):
        for h in range(hv):
            s = init[i, h]
            for c in range(nc):
                big_g = hi[i, c, :, h] + lo[i, c, :, h]
                states[i, c, h] = s
                u[i, c, :, h] = big_u[i, c, :, h] - w[i, c, :, h] @ s
                keys = k[i, c, :, h // per] * np.exp(big_g[-1] - big_g)[:, None]
                s = np.exp(big_g[-1]) * s + keys.T @ u[i, c, :, h]
            finals[i, h] = s
    return states, u, finals


GEOMETRIES = {"block_v_32_grouped_keys": (2, 3, 4, 2, 64, 64, 32),
              "block_v_64_k_128": (1, 3, 2, 1, 128, 128, 64)}


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_state_pass_against_a_float64_loop_and_the_triton_pass(geometry):
    b, nc, hv, hk, dk, dv, bv = GEOMETRIES[geometry]
    ops = _operands(1, b, nc, hv, hk, dk, dv)
    got = pallas_mosaic_gpu.state_pass(*ops, bv, interpret=True)
    tables = packing.chunk_tables(b, nc, None, None)
    bs = pallas_triton.BlockSizes(block_v=bv, output_block_v=dv, grads_block_v=dv)
    triton = pallas_triton._state_pass(*ops[:5], *tables, ops[5], bs, False, True, packed=False)
    for name, g, t, want in zip(("states", "u", "finals"), got, triton, _loop(*ops)):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        g32 = np.asarray(g, np.float32)
        assert np.isfinite(g32).all(), name
        parity.assert_close(g32, want.astype(np.float32), dtype=BF16, what=name)
        # the same arithmetic as the Triton pass, to a rounding of the compute dtype
        scale = float(np.abs(want).max())
        assert float(np.abs(g32 - np.asarray(t, np.float32)).max()) <= 1e-2 * scale, name


def _selected(monkeypatch):
    monkeypatch.setattr(pallas_triton, "MOSAIC_GPU_STATE_PASS", True)
    calls = []
    real = pallas_mosaic_gpu.state_pass

    def spy(*args, **kwargs):
        calls.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(pallas_mosaic_gpu, "state_pass", spy)
    return calls


def test_forward_and_gradients_with_the_mosaic_gpu_pass(monkeypatch):
    """bf16 inputs, rows of one sequence each: o, the finals and all six gradients (the
    backward reads the pass's states and u) against the definition, and against the
    forward with the Triton pass."""
    a = testlib.inputs(2, b=1, t=150, hk=1, hv=2, dk=64, dv=64, dtype=BF16)
    kernel = functools.partial(KERNEL, block_sizes=dict(block_v=32))
    triton = testlib.values_and_grads(kernel, a)
    calls = _selected(monkeypatch)
    got = testlib.values_and_grads(kernel, a)
    assert calls == [32]
    want = testlib.values_and_grads(gated_delta_rule_sequential,
                                    {k: v.astype(F32) for k, v in a.items()})
    for i, (g, t, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(triton),
                                      jax.tree.leaves(want))):
        g32 = np.asarray(g, np.float32)
        parity.assert_close(g32, np.asarray(w, np.float32), dtype=BF16, what=f"output {i}")
        parity.assert_close(g32, np.asarray(t, np.float32), dtype=BF16, what=f"output {i}")


def test_the_triton_pass_runs_what_the_mosaic_gpu_pass_refuses(monkeypatch):
    calls = _selected(monkeypatch)
    a = testlib.inputs(3, b=1, t=100, hk=1, hv=2, dk=64, dv=64, dtype=BF16)
    kernel = functools.partial(KERNEL, block_sizes=dict(block_v=32))
    kernel(**{k: a[k] for k in testlib.NAMES[:5]}, initial_state=a["initial_state"],
           use_qk_l2norm_in_kernel=True)
    kernel(**{k: a[k].astype(F32) if k in ("q", "k", "v") else a[k] for k in testlib.NAMES[:5]},
           initial_state=a["initial_state"])
    assert calls == []


@pytest.mark.parametrize("kwargs,named", [
    (dict(packed=True), "packed sequences"),
    (dict(l2norm=True), "normalised"),
    (dict(dtype=F32), "bf16 or fp16"),
    (dict(chunk=32), "chunk_size=32"),
    (dict(dk=32), "K = 32"),
    (dict(block_v=16), "block_v = 16"),
])
def test_refusals_name_their_cause(kwargs, named):
    args = dict(chunk=64, dk=128, block_v=32, dtype=BF16, packed=False, l2norm=False)
    assert pallas_mosaic_gpu.reason(**args) is None
    assert named in pallas_mosaic_gpu.reason(**{**args, **kwargs})


def test_lowers_for_cuda_from_cpu(monkeypatch):
    """Layout inference and the TMA/wgmma lowering of the pass inside the forward, at
    Qwen3-Next's heads (K = V = 128, block_v 32) and at block_v 64."""
    monkeypatch.setattr(pallas_triton, "MOSAIC_GPU_STATE_PASS", True)
    monkeypatch.setattr(platform, "mosaic_gpu_runs", lambda device=None: True)
    s = jax.ShapeDtypeStruct
    for bv in (32, 64):
        args = (s((1, 512, 16, 128), BF16), s((1, 512, 16, 128), BF16),
                s((1, 512, 32, 128), BF16), s((1, 512, 32), F32), s((1, 512, 32), F32),
                s((1, 32, 128, 128), F32))

        def forward(*a, bv=bv):
            return pallas_triton.forward(*a[:5], scale=0.1, initial_state=a[5],
                                         cu_seqlens=None, chunk_size=64,
                                         use_qk_l2norm_in_kernel=False,
                                         block_sizes=dict(block_v=bv))

        with jax.enable_x64(False):
            text = cuda_module(forward, *args)
        assert "gated_delta_rule_state_pass_mosaic_gpu" in text
        assert "gated_delta_rule_state_pass\"" not in text  # the Triton pass is not used


@pytest.mark.gpu
@pytest.mark.parametrize("block_v", [32, 64])
def test_compiled_state_pass_against_the_triton_pass(block_v):
    if not platform.mosaic_gpu_runs():
        pytest.skip(f"needs Hopper (sm90); the device is {platform.device_generation()}")
    ops = _operands(5, 2, 16, 4, 2, 128, 128)
    got = jax.jit(lambda *a: pallas_mosaic_gpu.state_pass(*a, block_v))(*ops)
    tables = packing.chunk_tables(2, 16, None, None)
    bs = pallas_triton.BlockSizes(block_v=block_v, output_block_v=128, grads_block_v=128)
    triton = jax.jit(lambda *a: pallas_triton._state_pass(
        *a[:5], *tables, a[5], bs, False, False, packed=False))(*ops)
    for name, g, t, want in zip(("states", "u", "finals"), got, triton, _loop(*ops)):
        g32 = np.asarray(g, np.float32)
        parity.assert_close(g32, want.astype(np.float32), dtype=BF16, what=name)
        parity.assert_close(g32, np.asarray(t, np.float32), dtype=BF16, what=name)


@pytest.mark.gpu
def test_compiled_forward_with_the_mosaic_gpu_pass(monkeypatch):
    if not platform.mosaic_gpu_runs():
        pytest.skip(f"needs Hopper (sm90); the device is {platform.device_generation()}")
    calls = _selected(monkeypatch)
    a = testlib.inputs(6, b=2, t=1000, hk=2, hv=4, dk=128, dv=128, dtype=BF16)
    got = testlib.values_and_grads(functools.partial(KERNEL, block_sizes=dict(block_v=32)), a)
    assert calls == [32]
    want = testlib.values_and_grads(gated_delta_rule_sequential,
                                    {k: v.astype(F32) for k, v in a.items()})
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        parity.assert_close(np.asarray(g, np.float32), np.asarray(w, np.float32),
                            dtype=BF16, what=f"output {i}")
