"""jax.checkpoint (jax.remat) around grouped_projection and chunk_ssd, differentiated.

The XLA paths and the Triton interpreter run under it, values and gradients equal to the
call without it. The Mosaic TPU and Mosaic GPU interpreters run their kernels through
host callbacks, which JAX cannot differentiate inside a checkpoint: a backend named alone
is refused with an error naming pallasite and the cause, a sequence falls back to the
next backend, and the compiled kernels (traced here for their devices, never run) hold
no such callback, so a checkpoint around them differentiates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.kernels import chunk_ssd, grouped_projection
from pallasite.kernels.grouped_matmul import TritonBlockSizes, ops
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu as mgpu
from pallasite.kernels.ssd import ssd_chunk_scan

SMALL = TritonBlockSizes(block_m=16, block_n=16, block_k=16, group_m=2)
REFUSED = r"pallasite {op}: {name} .*jax\.checkpoint"


def _grouped_inputs():
    key = jax.random.key(5)
    x = jax.random.normal(key, (40, 24), jnp.float32)
    kernel = jax.random.normal(jax.random.fold_in(key, 1), (4, 24, 20), jnp.float32)
    return x, kernel, jnp.asarray([9, 0, 14, 10], jnp.int32)


def _grads(project, checkpointed, x, kernel):
    f = jax.checkpoint(project) if checkpointed else project
    loss = lambda x, k: jnp.sum(jnp.sin(f(x, k).astype(jnp.float32)))  # noqa: E731
    return jax.grad(loss, argnums=(0, 1))(x, kernel)


def _grouped(implementation, sizes, compute=jnp.float32):
    blocks = SMALL if implementation == "pallas_triton" else None
    return lambda x, k: grouped_projection(x, k, sizes, compute, True,
                                           implementation=implementation, block_sizes=blocks)


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton", None])
def test_grouped_projection_differentiates_under_checkpoint(implementation):
    x, kernel, sizes = _grouped_inputs()
    project = _grouped(implementation, sizes)
    for got, want in zip(_grads(project, True, x, kernel), _grads(project, False, x, kernel)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["pallas_mosaic_tpu", "pallas_mosaic_gpu"])
def test_grouped_projection_interpreted_mosaic_refused_by_name(name):
    x, kernel, sizes = _grouped_inputs()
    project = _grouped(name, sizes, jnp.bfloat16)
    with pytest.raises(RuntimeError, match=REFUSED.format(op="grouped_projection", name=name)):
        _grads(project, True, x, kernel)
    jax.checkpoint(project)(x, kernel)  # undifferentiated, the checkpoint is no obstacle


def test_grouped_projection_sequence_falls_back_under_checkpoint():
    x, kernel, sizes = _grouped_inputs()
    got = _grads(_grouped(("pallas_mosaic_tpu", "xla"), sizes), True, x, kernel)
    want = _grads(_grouped("xla", sizes), False, x, kernel)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["pallas_mosaic_tpu", "pallas_mosaic_gpu"])
def test_compiled_mosaic_kernels_differentiate_under_checkpoint(name, monkeypatch):
    """Traced (not run) for their own devices: no host callback in the checkpoint."""
    monkeypatch.setattr(mgpu, "_num_programs", lambda interpret: 132)
    x, kernel, sizes = _grouped_inputs()
    project = lambda x, k: ops.project(x, k, sizes, None, name,  # noqa: E731
                                       np.dtype(jnp.bfloat16), None, False)
    jaxpr = jax.make_jaxpr(lambda x, k: _grads(project, True, x, k))(x, kernel)
    assert not jaxpr.effects


def _ssd_inputs(b=1, length=128, h=2, p=16, g=1, n=16):
    keys = jax.random.split(jax.random.key(6), 4)
    x = jax.random.normal(keys[0], (b, length, h, p), jnp.float32)
    a = -jnp.abs(jax.random.normal(keys[1], (b, length, h), jnp.float32))
    bb = jax.random.normal(keys[2], (b, length, g, n), jnp.float32)
    c = jax.random.normal(keys[3], (b, length, g, n), jnp.float32)
    return x, a, bb, c


def _ssd_grads(implementation, checkpointed):
    x, a, b, c = _ssd_inputs()

    def f(x, b):
        return chunk_ssd(x, a, b, c, chunk_size=64, implementation=implementation)[0]

    f = jax.checkpoint(f) if checkpointed else f
    return jax.grad(lambda x, b: jnp.sum(jnp.sin(f(x, b))), argnums=(0, 1))(x, b)


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
def test_chunk_ssd_differentiates_under_checkpoint(implementation):
    for got, want in zip(_ssd_grads(implementation, True), _ssd_grads(implementation, False)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_chunk_ssd_interpreted_mosaic_refused_by_name():
    with pytest.raises(ValueError, match=REFUSED.format(op="chunk_ssd", name="pallas_mosaic_tpu")):
        _ssd_grads("pallas_mosaic_tpu", True)


def test_chunk_ssd_sequence_falls_back_under_checkpoint():
    got = _ssd_grads(("pallas_mosaic_tpu", "xla"), True)
    for g, w in zip(got, _ssd_grads("xla", False)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_compiled_mosaic_tpu_ssd_differentiates_under_checkpoint():
    x, a, b, c = _ssd_inputs()
    chunked = [t.reshape(1, 2, 64, *t.shape[2:]) for t in (x, a, b, c)]
    state = jnp.zeros((1, 2, 16, 16), jnp.float32)

    def loss(x):
        y, _ = jax.checkpoint(lambda x: ssd_chunk_scan(
            x, *chunked[1:], state, ("pallas_mosaic_tpu", False)))(x)
        return jnp.sum(y)

    assert not jax.make_jaxpr(jax.grad(loss))(chunked[0]).effects
