"""The Mosaic TPU SSD kernels: parity through pltpu.InterpretParams() on CPU (values and
every gradient against the reference), lowering for TPU through jax.export on CPU, the
cost estimates, and the full parity grid and the default path on real TPUs (tpu mark)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_testlib
import mosaic_tpu_testlib
import test_ssd_base as base
from pallasite.kernels.ssd import pallas_mosaic_tpu as kernel
from pallasite.kernels.ssd.api import ssd_chunk_scan
from pallasite.reference import parity

INTERPRET = ("pallas_mosaic_tpu", True)  # InterpretParams poisons scratch/outputs with NaN


def test_parity_interpret():
    parity.check_parity(base.CPU_CASES, base.run_case(INTERPRET), seed=7)


def test_forward_contract_interpret():
    shape = dict(b=2, nc=3, C=16, h=4, p=8, n=8, g=2)
    base.check_forward_contract(kernel, jax.random.key(3), shape, jnp.float32,
                                interpret=True, tol=parity.EXACT_FP32)


def _abstract_args(b=2, nc=2, C=128, h=4, p=64, n=128, g=2, dtype=jnp.bfloat16):
    s = jax.ShapeDtypeStruct
    return (s((b, nc, C, h, p), dtype), s((b, nc, C, h), jnp.float32),
            s((b, nc, C, g, n), dtype), s((b, nc, C, g, n), dtype),
            s((b, h, p, n), jnp.float32))


@pytest.mark.parametrize("kind", ["TPU v5 lite", "TPU v6 lite"])
@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("chunk,head_dim", [(128, 64), (64, 128)])
def test_lowers_for_tpu(kind, x64, chunk, head_dim):
    """Forward and gradient export for TPU from a CPU host: two Mosaic modules, neither
    holding what a TPU refused (mosaic_tpu_testlib), jax_enable_x64 on or off; and a head
    dim wider than the chunk (the backward's cost estimate once sized its row sums by
    the chunk alone and failed to trace there: 8 of the tpu grid's cases on a TPU)."""

    def loss(x, a, b, c, s0):
        y, final = ssd_chunk_scan(x, a, b, c, s0, ("pallas_mosaic_tpu", False))
        return y.astype(jnp.float32).sum() + final.sum()

    exported = mosaic_tpu_testlib.mosaic_modules(
        jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *_abstract_args(C=chunk, p=head_dim),
        kind=kind, x64=x64)
    mosaic_tpu_testlib.assert_no_known_refusals(
        exported, ["ssd_forward_mosaic_tpu", "ssd_backward_mosaic_tpu"])


def test_cost_estimates():
    """Flops of the chunk matmuls, one exp per [C, C] entry plus 2C + 1, bytes > 0."""
    b, nc, C, h, p, n, g = 1, 2, 64, 2, 64, 32, 1
    args = _abstract_args(b, nc, C, h, p, n, g, jnp.float32)
    (eqn,) = jaxpr_testlib.traced_pallas_calls(
        lambda *t: kernel.forward(*t, interpret=False), *args)
    cost = eqn.params["cost_estimate"]
    programs = b * h * nc
    # Hand count per program (tests/test_cost_estimates.py has every call's).
    assert cost.flops == programs * (C * C * (2 * n + 2 * p + 4) + C * (4 * n * p + 3 * p + 4)
                                     + 2 * p * n + 1)
    assert cost.transcendentals == programs * (C * C + 2 * C + 1)
    x_bytes = b * nc * C * h * p * 4
    assert cost.bytes_accessed >= 2 * x_bytes
    states = jax.ShapeDtypeStruct((b, nc, h, p, n), jnp.float32)
    (eqn,) = jaxpr_testlib.traced_pallas_calls(
        lambda *t: kernel.backward(*t, interpret=False), *args[:4], states, args[0], args[4])
    cost = eqn.params["cost_estimate"]
    assert cost.flops == programs * (C * C * (6 * n + 4 * p + 22) + 10 * C * n * p
                                     + 37 * C * p + 4 * C * n + 20 * C + 2 * p * n + 1)
    assert cost.bytes_accessed >= 4 * x_bytes


@pytest.mark.tpu
@pytest.mark.parametrize("index", range(len(base.FULL_CASES)),
                         ids=[f"{c.name}-{jnp.dtype(c.dtype).name}" for c in base.FULL_CASES])
def test_parity_full_grid_on_tpu(index):
    """The issue's whole grid on hardware (fp32 at the default fp32 tolerance), one test a
    case: each compiles its own kernels and reference, so a run with a time limit can take
    the grid in slices (`-k`) and every finished case is reported."""
    parity.check_parity([base.FULL_CASES[index]], base.run_case("pallas_mosaic_tpu"),
                        seed=11 + index, report=print)


@pytest.mark.tpu
def test_forward_contract_on_tpu():
    shape = dict(b=2, nc=4, C=256, h=8, p=64, n=128, g=8)
    base.check_forward_contract(kernel, jax.random.key(4), shape, jnp.bfloat16,
                                interpret=False)


@pytest.mark.tpu
def test_tpu_default_path_takes_the_kernel():
    """On a TPU the default order runs the Mosaic TPU kernels (predicates.ADMITTED), for
    chunk_ssd and for mamba_chunk_scan with every option on and packed sequences: values
    and every gradient equal the XLA path's to bf16's tolerance."""
    from pallasite.kernels import chunk_ssd, mamba_chunk_scan
    from pallasite.kernels.ssd.predicates import ssd_kernel_platform

    bsz, length, h, p, n, g, chunk = 2, 256, 4, 64, 64, 2, 64
    assert ssd_kernel_platform(chunk, p, n) == "pallas_mosaic_tpu"
    keys = jax.random.split(jax.random.key(5), 9)
    bf16 = jnp.bfloat16
    x = jax.random.normal(keys[0], (bsz, length, h, p), bf16)
    dt = jax.random.uniform(keys[1], (bsz, length, h), jnp.float32, -3.0, 0.0)
    A = -jax.random.uniform(keys[2], (h,), jnp.float32, 0.5, 2.0)
    B = jax.random.normal(keys[3], (bsz, length, g, n), bf16)
    C = jax.random.normal(keys[4], (bsz, length, g, n), bf16)
    z = jax.random.normal(keys[5], (bsz, length, h, p), bf16)
    D = jax.random.normal(keys[6], (h,), jnp.float32)
    dt_bias = jax.random.normal(keys[7], (h,), jnp.float32)
    seq_idx = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) // 96, (bsz, length))
    dy = jax.random.normal(keys[8], x.shape, jnp.float32)
    a = jax.nn.softplus(dt + dt_bias) * A  # chunk_ssd's per-step log decay, < 0

    def ssd(implementation):
        def loss(x, a, b, c):
            y, final = chunk_ssd(x, a, b, c, chunk_size=chunk, implementation=implementation)
            return jnp.sum(y.astype(jnp.float32) * dy) + final.sum(), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
            x, a, B, C)

    def mamba(implementation):
        def loss(x, dt, A, b, c, D, z, dt_bias):
            y = mamba_chunk_scan(x, dt, A, b, c, chunk, D=D, z=z, dt_bias=dt_bias,
                                 dt_softplus=True, seq_idx=seq_idx,
                                 implementation=implementation)
            return jnp.sum(y.astype(jnp.float32) * dy), y
        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(8)), has_aux=True))(
            x, dt, A, B, C, D, z, dt_bias)

    for run in (ssd, mamba):
        (_, y), grads = run(None)
        (_, y_xla), grads_xla = run("xla")
        parity.assert_close(y, y_xla, dtype=bf16, what=f"{run.__name__} y")
        for i, (got, want) in enumerate(zip(grads, grads_xla)):
            parity.assert_close(got, want, dtype=bf16, what=f"{run.__name__} grad {i}")


def test_decay_from_double_float_cumsums():
    """The kernel's segment sums: acs as hi + lo (error-free additions) gives exp(segsum)
    to ~1e-7 of float64 even with 50x TARGETS' decay, where the plain fp32 difference of
    cumulative sums is off by >1e-6 (docs/ssd.md: 2e-07 vs 4.4e-06 in y)."""
    a = jax.random.uniform(jax.random.key(0), (1, 1, 256, 1), minval=-3.0, maxval=0.0)
    row, col = kernel._cumsums(a)
    decay, e, w, total = kernel._decays(col[0, 0, 0], row[0, 0, 0])
    a64 = np.asarray(a[0, 0, :, 0], np.float64)
    acs = np.cumsum(a64)
    exact = np.tril(np.exp(np.minimum(acs[:, None] - acs[None, :], 0.0)))
    naive_acs = np.cumsum(np.asarray(a[0, 0, :, 0], np.float32), dtype=np.float32)
    naive = np.tril(np.exp((naive_acs[:, None] - naive_acs[None, :]).astype(np.float64)))
    assert np.abs(np.asarray(decay) - exact).max() < 2e-7
    assert np.abs(naive - exact).max() > 5 * np.abs(np.asarray(decay) - exact).max()
    np.testing.assert_allclose(np.asarray(w)[:, 0], np.exp(acs[-1] - acs), rtol=2e-6,
                               atol=1e-30)
    np.testing.assert_allclose(np.asarray(e)[:, 0], np.exp(acs), rtol=2e-6, atol=1e-30)
