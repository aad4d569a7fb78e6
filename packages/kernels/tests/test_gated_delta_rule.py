"""The gated delta rule: the XLA chunked (WY) form against the float64 step-by-step
definition (relative L2 <= 1e-5 for outputs, final states and all six gradients, fp32
inputs), under strong decay, beta of exactly 0 and 1, packed sequences (traced
cu_seqlens, an empty one, one ending on a chunk boundary), grouped value heads, the
in-kernel L2 norm, a long sequence, state chaining, bf16 inputs; the step-by-step form;
the argument checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import gated_delta_testlib as testlib
from pallasite.kernels import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from pallasite.reference.gated_delta_rule import gated_delta_rule_sequential

REL_L2, NAMES = testlib.REL_L2, testlib.NAMES


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


_inputs, _wide, _rel = testlib.inputs, testlib.wide, testlib.rel
_values_and_grads = testlib.values_and_grads


def _check_against_definition(a, **kw):
    errors = testlib.errors(chunk_gated_delta_rule, a, **kw)
    assert max(errors.values()) <= REL_L2, errors


CASES = {
    "grouped_value_heads": dict(),
    "one_head_each": dict(hk=1, hv=1, b=1),
    "l2norm_and_scale": dict(kw=dict(use_qk_l2norm_in_kernel=True, scale=0.3)),
    "chunk_16_length_not_a_multiple": dict(t=37, kw=dict(chunk_size=16)),
    "strong_decay": dict(decay=20.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_form_against_the_definition(case):
    spec = dict(CASES[case])
    kw = spec.pop("kw", {})
    _check_against_definition(_inputs(1, **spec), **kw)


def test_beta_exactly_zero_and_one_and_decay_down_to_minus_twenty():
    _check_against_definition(testlib.with_extremes(_inputs(2, t=100)), chunk_size=32)


def test_packed_sequences_with_traced_cu_seqlens():
    """Five sequences in one row: an empty one, one ending on a chunk boundary (64), one
    spanning several chunks; each from its own initial state, each its own final state
    (the empty one's is its initial state). cu_seqlens is a jit argument."""
    a = _inputs(3, b=1, t=300, n=5)
    cu = jnp.asarray([0, 10, 10, 64, 230, 300], jnp.int32)

    testlib.check_packed(chunk_gated_delta_rule, a, cu)


def test_state_chaining_through_initial_state():
    a = _inputs(4, t=200)
    args = [a[k] for k in NAMES[:5]]
    whole, final = chunk_gated_delta_rule(*args, initial_state=a["initial_state"],
                                          output_final_state=True)
    first, mid = chunk_gated_delta_rule(*(x[:, :77] for x in args),
                                        initial_state=a["initial_state"],
                                        output_final_state=True)
    second, end = chunk_gated_delta_rule(*(x[:, 77:] for x in args), initial_state=mid,
                                         output_final_state=True)
    assert _rel(jnp.concatenate([first, second], 1), whole) <= REL_L2
    assert _rel(end, final) <= REL_L2


def test_long_sequence():
    a = _inputs(5, b=1, t=32768, hk=1, hv=1, dk=16, dv=16)
    args = [a[k] for k in NAMES[:5]]
    o, final = jax.jit(functools.partial(chunk_gated_delta_rule, output_final_state=True))(
        *args, initial_state=a["initial_state"])
    o_ref, final_ref = gated_delta_rule_sequential(
        *(x.astype(jnp.float64) for x in args),
        initial_state=a["initial_state"].astype(jnp.float64), output_final_state=True)
    assert _rel(o, o_ref) <= REL_L2 and _rel(final, final_ref) <= REL_L2


def test_bf16_inputs_within_the_bf16_tolerance():
    a = _inputs(6, dtype=jnp.bfloat16)
    testlib.check_bf16(chunk_gated_delta_rule, a)


def test_fused_recurrent_form_equals_the_chunked_one():
    a = _inputs(7, b=1, t=90, n=3)
    cu = jnp.asarray([0, 40, 41, 90], jnp.int32)
    args = [a[k] for k in NAMES[:5]]
    kw = dict(initial_state=a["initial_state"], output_final_state=True, cu_seqlens=cu,
              use_qk_l2norm_in_kernel=True)
    o, final = fused_recurrent_gated_delta_rule(*args, **kw)
    o_c, final_c = chunk_gated_delta_rule(*args, **kw)
    assert _rel(o, o_c) <= REL_L2 and _rel(final, final_c) <= REL_L2
    o_none, none = fused_recurrent_gated_delta_rule(*args[:5])
    assert none is None and o_none.shape == a["v"].shape


@pytest.mark.parametrize("change, error, message", [
    (dict(k=jnp.zeros((2, 150, 2, 8))), ValueError, "k must be"),
    (dict(v=jnp.zeros((2, 150, 3, 32))), ValueError, "multiple of q's and k's"),
    (dict(g=jnp.zeros((2, 150, 2))), ValueError, "g must be"),
    (dict(beta=jnp.zeros((2, 149, 4))), ValueError, "beta must be"),
    (dict(initial_state=jnp.zeros((2, 4, 16, 16))), ValueError, "initial_state must be"),
    (dict(cu_seqlens=jnp.asarray([0, 150])), ValueError, "batch must be 1"),
    (dict(cu_seqlens=jnp.asarray([0.0, 150.0])), TypeError, "cu_seqlens must be an integer"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(implementation="mosaic_tpu"), ValueError, "implementation='mosaic_tpu'"),
    (dict(implementation="pallas_triton", chunk_size=48), ValueError, "chunk_size=48"),
    (dict(block_sizes=object()), TypeError, "block_sizes"),
    (dict(q=jnp.zeros((2, 150, 2, 16), jnp.int32)), TypeError, "q must be floating"),
])
def test_bad_arguments_are_named(change, error, message):
    a = _inputs(8)
    with pytest.raises(error, match=message):
        chunk_gated_delta_rule(**{**a, **change})


def test_cu_seqlens_must_cover_the_time_axis():
    a = _inputs(9, b=1, n=2)
    with pytest.raises(ValueError, match="end at the length 150"):
        chunk_gated_delta_rule(**a, cu_seqlens=jnp.asarray([0, 20, 140]))
