"""The XLA SSD backend: forward, and the hand-written backward against jax.grad of the
reference (exact in float64, EXACT_FP32 in fp32), through ssd_chunk_scan's custom_vjp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_ssd_base as base
from pallasite.kernels.ssd import xla
from pallasite.reference import parity
from pallasite.reference.ssd import segsum as reference_segsum
from pallasite.reference.ssd import ssd_chunk_scan_reference, ssd_sequential, to_chunks, from_chunks


def test_parity_cpu():
    parity.check_parity(base.CPU_CASES, base.run_case("xla"), seed=5)


def test_forward_contract_fp32():
    shape = dict(b=2, nc=3, C=16, h=4, p=8, n=8, g=2)
    base.check_forward_contract(xla, jax.random.key(1), shape, jnp.float32,
                                interpret=False, tol=parity.EXACT_FP32)


def test_backward_exact_in_float64():
    """The hand-written backward is the derivative: equal to jax.vjp of the sequential
    definition to float64 rounding (measured ~1e-15 relative)."""
    with jax.enable_x64(True):
        shape = dict(b=2, nc=3, C=8, h=4, p=4, n=8, g=2)
        args = base.chunked_inputs(jax.random.key(2), shape, jnp.float64)
        args = args[:4] + (args[4].astype(jnp.float64),)
        y, final, states = xla.forward(*args)

        def sequential(x, a, b, c, s0):
            y, f = ssd_sequential(*(from_chunks(t) for t in (x, a, b, c)), s0)
            return to_chunks(y, shape["C"]), f

        (y_ref, final_ref), vjp = jax.vjp(sequential, *args)
        parity.assert_close(y, y_ref, dtype=jnp.float64, what="y")
        parity.assert_close(final, final_ref, dtype=jnp.float64, what="final")
        cts = (jax.random.normal(jax.random.key(3), y.shape, jnp.float64),
               jax.random.normal(jax.random.key(4), final.shape, jnp.float64))
        grads = xla.backward(*args[:4], states, *cts)
        for what, got, want in zip(("dx", "da", "db", "dc", "dinitial"), grads, vjp(cts)):
            parity.assert_close(got, want, dtype=jnp.float64, what=what)


def test_segsum_matches_reference():
    a = -jax.random.uniform(jax.random.key(0), (3, 32))
    got, want = xla.segsum(a), reference_segsum(a)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(want)[finite], rtol=0, atol=1e-6)


def test_saves_only_entry_states():
    """The custom_vjp residuals: the inputs and [b, nc, h, p, n] entry states, no [C, C]."""
    shape = dict(b=1, nc=2, C=16, h=2, p=8, n=8, g=1)
    args = base.chunked_inputs(jax.random.key(0), shape, jnp.float32)
    from pallasite.kernels.ssd.api import _scan_fwd

    _, residuals = jax.eval_shape(lambda *t: _scan_fwd(*t, "xla"), *args)
    shapes = sorted(tuple(r.shape) for r in residuals)
    assert (1, 2, 2, 8, 8) in shapes
    assert not any(s[-2:] == (16, 16) for s in shapes), shapes
