"""chunk_gated_delta_rule's Mosaic TPU kernels (gated_delta/pallas_mosaic_tpu.py) through
the TPU interpreter on the CPU: o, the final states and all six gradients against the
float64 definition, packed sequences, extreme gates, bf16, every output written, the
refusals, and the lowering for TPU from the CPU (jax.export); tpu-marked, the same cases
compiled on a TPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import gated_delta_testlib as testlib
import jaxpr_testlib
import mosaic_tpu_testlib
from pallasite.kernels import chunk_gated_delta_rule, platform
from pallasite.kernels.gated_delta import pallas_mosaic_tpu, predicates

REL_L2, NAMES = testlib.REL_L2, testlib.NAMES


class FakeTpu:
    platform, device_kind = "tpu", "TPU v5 lite"

KERNEL = functools.partial(chunk_gated_delta_rule, implementation="pallas_mosaic_tpu")


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


_inputs = functools.partial(testlib.inputs, b=1, t=100, hk=1, hv=2, dk=32, dv=32)

CASES = {
    "grouped_value_heads": dict(b=2, kw=dict(chunk_size=32)),
    "l2norm_and_scale": dict(kw=dict(use_qk_l2norm_in_kernel=True, scale=0.3)),
    "chunk_8_length_not_a_multiple": dict(t=37, dk=16, dv=64, kw=dict(chunk_size=8)),
    "chunk_24_two_key_heads": dict(t=70, hk=2, hv=4, dk=16, dv=16, kw=dict(chunk_size=24)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_against_the_definition(case):
    spec = dict(CASES[case])
    kw = spec.pop("kw", {})
    errors = testlib.errors(KERNEL, _inputs(1, **spec), **kw)
    assert max(errors.values()) <= REL_L2, errors


def test_beta_exactly_zero_and_one_and_decay_down_to_minus_twenty():
    errors = testlib.errors(KERNEL, testlib.with_extremes(_inputs(2, t=90, decay=20.0)),
                            chunk_size=32)
    assert max(errors.values()) <= REL_L2, errors


def test_packed_sequences_with_traced_cu_seqlens():
    """Five sequences (one shorter than a chunk, an empty one, one ending on a chunk
    boundary, one spanning chunks) in one row, cu_seqlens traced, trailing padding
    chunks after the last."""
    a = _inputs(3, t=100, n=5)
    cu = jnp.asarray([0, 5, 5, 32, 90, 100], jnp.int32)
    testlib.check_packed(functools.partial(KERNEL, chunk_size=16), a, cu)


def test_bf16_inputs_within_the_bf16_tolerance():
    testlib.check_bf16(functools.partial(KERNEL, chunk_size=32),
                       _inputs(4, dtype=jnp.bfloat16))


# On a TPU the tests above run the kernels compiled (the API interprets on a CPU only);
# `bazel test --config=tpu` runs the tpu-marked ones, so these mark them. On a TPU v5e
# (2026-12-06) the definition cases, the extremes and bf16 passed compiled.
@pytest.mark.tpu
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_against_the_definition_on_a_tpu(case):
    test_kernels_against_the_definition(case)


@pytest.mark.tpu
def test_extremes_bf16_and_packed_on_a_tpu():
    test_beta_exactly_zero_and_one_and_decay_down_to_minus_twenty()
    test_bf16_inputs_within_the_bf16_tolerance()
    test_packed_sequences_with_traced_cu_seqlens()


def test_every_kernel_output_is_written():
    """The interpreter fills outputs with NaN before the kernels run (its
    uninitialized_memory default): o, the entry states, the final states and every
    cotangent the backward kernel writes finite means every block was written (two
    packed sequences, trailing padding chunks, an empty sequence)."""
    a = _inputs(5, t=75, n=4)
    cu = jnp.asarray([0, 5, 5, 70, 75], jnp.int32)
    assert platform.mosaic_tpu_interpret(True).uninitialized_memory == "nan"
    seen = []
    real = pallas_mosaic_tpu._scan_forward, pallas_mosaic_tpu._scan_backward

    def spy(fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            seen.extend(out)
            return out
        return call

    def run(*args):
        return pallas_mosaic_tpu.forward(*args[:5], scale=0.2, initial_state=args[5],
                                         cu_seqlens=cu, chunk_size=16,
                                         use_qk_l2norm_in_kernel=False, interpret=True)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pallas_mosaic_tpu, "_scan_forward", spy(real[0]))
        mp.setattr(pallas_mosaic_tpu, "_scan_backward", spy(real[1]))
        (o, final), pull = jax.vjp(run, *(a[n] for n in NAMES))
        grads = pull((jnp.ones_like(o), jnp.ones_like(final)))
    assert len(seen) == 3 + 7
    for leaf in seen + [o, final] + list(grads):
        assert bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32))))


def test_named_only_and_refusals_name_the_argument():
    a = _inputs(6, t=20)
    text = str(jax.make_jaxpr(lambda **kw: chunk_gated_delta_rule(**kw))(**a))
    assert "mosaic_tpu" not in text  # never by default
    text = str(jax.make_jaxpr(lambda **kw: KERNEL(**kw))(**a))
    assert "gated_delta_rule_forward_mosaic_tpu" in text
    with pytest.raises(ValueError, match="chunk_size=12 is not a multiple of 8"):
        KERNEL(**a, chunk_size=12)
    with pytest.raises(ValueError, match="q has dtype float64"):
        KERNEL(**{**a, "q": a["q"].astype(jnp.float64)})
    # A sequence falls through to XLA where the kernels refuse.
    o, _ = chunk_gated_delta_rule(**a, chunk_size=12,
                                  implementation=("pallas_mosaic_tpu", "xla"))
    assert o.shape == a["v"].shape


def test_fp16_refused_on_a_tpu_only():
    """A TPU's compiler does not load fp16 blocks (platform.MOSAIC_TPU_REFUSED_DTYPES): the
    predicate refuses an fp16 v (o's dtype) there, by name, and keeps it for the
    interpreter."""
    a = {name: t.astype(jnp.float16) if name in ("q", "k", "v") else t
         for name, t in _inputs(7, t=20).items()}
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"], 16)
    tpu = FakeTpu()
    why = predicates.pallas_mosaic_tpu_reason(*args, named=True, device=tpu)
    assert why is not None and "v float16" in why  # o's dtype; q and k reach it in fp32
    assert predicates.pallas_mosaic_tpu_reason(*args, named=True,
                                               device=jax.devices("cpu")[0]) is None


def test_the_backward_kernel_aliases_no_buffer():
    """On a TPU v5e (2026-12-07) the backward kernel with its final cotangents aliased to
    the initial states' gave wrong dk, dv, dg and dbeta for packed sequences (relative L2
    0.33-0.76; the interpreter's right): the last sequence's block, first visited at the
    trailing padding chunks, read back what they wrote at its last chunk. The backward
    aliases nothing; the forward aliases init to the final states, each block of which it
    reads at its first visit only."""
    a = _inputs(9, t=40, n=2)
    cu = jnp.asarray([0, 17, 40], jnp.int32)

    def loss(*args):
        o, final = KERNEL(*args[:5], initial_state=args[5], cu_seqlens=cu,
                          output_final_state=True, chunk_size=16)
        return jnp.sum(o) + jnp.sum(final)

    calls = jaxpr_testlib.traced_pallas_calls(jax.grad(loss, argnums=tuple(range(6))),
                                              *(a[n] for n in NAMES))
    aliases = {str(e.params["name"]): tuple(e.params["input_output_aliases"]) for e in calls}
    assert len(calls) == 2 and aliases == {"gated_delta_rule_forward_mosaic_tpu": ((8, 2),),
                       "gated_delta_rule_backward_mosaic_tpu": ()}, aliases


@pytest.mark.parametrize("kind", ["TPU v5 lite", "TPU v6 lite"])
@pytest.mark.parametrize("x64", [False, True])
def test_the_kernels_lower_for_tpu_from_cpu(kind, x64):
    """Forward and gradient exported for TPU from the CPU at Qwen3-Next's heads: one
    forward and one backward Mosaic module, neither holding what a TPU refused (an int64
    or float64 value, a bf16 product at fp32 precision: mosaic_tpu_testlib), with
    jax_enable_x64 on (as these tests run) or off (with x64 on, the index maps' literal
    zeros were int64 and a TPU v5e refused every kernel)."""
    s = jax.ShapeDtypeStruct
    b, t, hk, hv, dk, dv = 1, 256, 16, 32, 128, 128
    args = (s((b, t, hk, dk), jnp.bfloat16), s((b, t, hk, dk), jnp.bfloat16),
            s((b, t, hv, dv), jnp.bfloat16), s((b, t, hv), jnp.float32),
            s((b, t, hv), jnp.float32), s((b, hv, dk, dv), jnp.float32))

    def loss(q, k, v, g, beta, s0):
        o, final = pallas_mosaic_tpu.forward(
            q, k, v, g, beta, scale=dk ** -0.5, initial_state=s0, cu_seqlens=None,
            chunk_size=64, use_qk_l2norm_in_kernel=True)
        return o.astype(jnp.float32).sum() + final.sum()

    exported = mosaic_tpu_testlib.mosaic_modules(jax.grad(loss, argnums=range(6)), *args,
                                                 kind=kind, x64=x64)
    mosaic_tpu_testlib.assert_no_known_refusals(
        exported, ["gated_delta_rule_forward_mosaic_tpu", "gated_delta_rule_backward_mosaic_tpu"])
