"""Shared SSD backend tests: inputs, the reference comparison and the parity grids.

Every SSD backend's test file (xla, pallas_mosaic_tpu, pallas_triton) imports this module
and runs the same comparisons against pallasite.reference.ssd, so a backend is held to
exactly what the others are:

- `run_case(platform)` -> a check_parity runner: y and final_state of ssd_chunk_scan, and
  the gradients wrt x, a, b, c and initial_state through its custom_vjp, against
  jax.vjp of the reference's chunked form (fresh random inputs and cotangents per case).
- `check_forward_contract(module, ...)`: a backend file's forward returns the chunk entry
  states the reference computes, and its backward, fed those, the reference's gradients.
- `CPU_CASES` (small enough for the interpreters on 2 CPU cores) and `FULL_CASES` (the
  issue's grid: chunk 64/128/256 x head_dim 64/128 x state 64/128 x groups 1/8 x
  bf16/fp32, random initial states) for hardware runs.

Collected by pytest as a file of no tests; the backends' files are the tests.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from pallasite.kernels.ssd.api import ssd_chunk_scan
from pallasite.reference import parity
from pallasite.reference.inputs import ssd_initial_state, ssd_inputs
from pallasite.reference.ssd import ssd_chunk_scan_reference, to_chunks


def case(batch, chunks, chunk, heads, head_dim, state, groups, dtype, *, a_scale=1.0,
         tol=None) -> parity.Case:
    """One parity case; `a_scale` multiplies a (20 gives strong in-chunk decay)."""
    shape = dict(b=batch, nc=chunks, C=chunk, h=heads, p=head_dim, n=state, g=groups)
    name = "C{C} p{p} n{n} g{g} h{h} b{b} nc{nc}".format(**shape)
    if a_scale != 1.0:
        name += f" a*{a_scale:g}"
    return parity.Case(name, shape, jnp.dtype(dtype), {"a_scale": a_scale}, tol)


def chunked_inputs(key, shape, dtype, a_scale=1.0):
    """(x, a, b, c, initial_state) in the chunked layout, as docs/targets.md draws them."""
    k_in, k_s = jax.random.split(key)
    length = shape["nc"] * shape["C"]
    x, a, b, c = ssd_inputs(k_in, shape["b"], length, shape["h"], shape["p"], shape["n"],
                            shape["g"], dtype)
    s0 = ssd_initial_state(k_s, shape["b"], shape["h"], shape["p"], shape["n"])
    return (*(to_chunks(t, shape["C"]) for t in (x, a * a_scale, b, c)), s0)


def cotangents(key, y, final):
    ky, kf = jax.random.split(key)
    return (jax.random.normal(ky, y.shape, jnp.float32).astype(y.dtype),
            jax.random.normal(kf, final.shape, jnp.float32))


def _values_and_grads(fn, args, key):
    """fn's outputs and its vjp at cotangents drawn from key, as one jitted program (one
    compile instead of many eager dispatches: ~4x faster through the interpreters)."""

    @jax.jit
    def both(args, key):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(cotangents(key, *out))

    return both(args, key)


def run_case(platform):
    """A check_parity runner for ssd_chunk_scan(..., platform): values and all gradients."""

    def run(c: parity.Case, key):
        k_in, k_ct = jax.random.split(key)
        args = chunked_inputs(k_in, c.shape, c.dtype, c.params.get("a_scale", 1.0))
        (y, final), grads = _values_and_grads(lambda *t: ssd_chunk_scan(*t, platform),
                                              args, k_ct)
        (y_ref, final_ref), grads_ref = _values_and_grads(ssd_chunk_scan_reference, args, k_ct)
        out = {"y": (y, y_ref), "final_state": (final, final_ref)}
        for name, got, want in zip(("dx", "da", "db", "dc", "dinitial"), grads, grads_ref):
            assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
            out[name] = (got, want)
        assert y.dtype == c.dtype and final.dtype == jnp.float32
        return out

    return run


def check_forward_contract(module, key, shape, dtype, *, interpret, tol=None):
    """module.forward/backward against the reference: chunk states and gradients."""
    k_in, k_ct = jax.random.split(key)
    args = chunked_inputs(k_in, shape, dtype)
    y, final, states = module.forward(*args, interpret=interpret)
    y_ref, final_ref, states_ref = ssd_chunk_scan_reference(*args, return_chunk_states=True)
    tol = tol or parity.tolerance(dtype)
    for what, got, want in (("y", y, y_ref), ("final", final, final_ref),
                            ("chunk_states", states, states_ref)):
        parity.assert_close(got, want, dtype=dtype, what=what, tol=tol)
    cts = cotangents(k_ct, y_ref, final_ref)
    grads = module.backward(*args[:4], states, *cts, interpret=interpret)
    _, vjp_ref = jax.vjp(ssd_chunk_scan_reference, *args)
    for what, got, want in zip(("dx", "da", "db", "dc", "dinitial"), grads, vjp_ref(cts)):
        assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
        parity.assert_close(got, want, dtype=dtype, what=what, tol=tol)


# fp32 on both sides on CPU (interpreters and XLA at HIGHEST): summation order only.
CPU_TOL = {jnp.dtype(jnp.float32): parity.EXACT_FP32}

CPU_CASES = [
    # many chunks, batch, groups, a tiny geometry: state passing forward and backward
    case(2, 3, 16, 4, 8, 8, 2, jnp.float32, tol=parity.EXACT_FP32),
    # the widths at the smallest programs that reach them
    # strong in-chunk decay (a x 20): where segment sums lose accuracy if done naively
    case(1, 2, 64, 2, 64, 64, 1, jnp.float32, a_scale=20.0, tol=parity.EXACT_FP32),
    case(1, 1, 128, 8, 128, 64, 8, jnp.float32, tol=parity.EXACT_FP32),
    case(1, 2, 256, 1, 64, 128, 1, jnp.bfloat16),
    case(1, 2, 256, 8, 128, 128, 8, jnp.float32, tol=parity.EXACT_FP32),
    # a head dim wider than the chunk (row sums over p and over C differ in width)
    case(1, 2, 32, 2, 64, 32, 1, jnp.float32, tol=parity.EXACT_FP32),
]

FULL_CASES = [
    case(2, 2, chunk, 8, p, n, g, dtype)
    for chunk, p, n, g, dtype in itertools.product(
        (64, 128, 256), (64, 128), (64, 128), (1, 8), (jnp.bfloat16, jnp.float32))
]
