"""chunk_gated_delta_rule's Pallas Triton kernels (gated_delta/pallas_triton.py) against
the float64 step-by-step definition: through the Triton interpreter on the CPU (tiny
shapes), compiled on a GPU (the `gpu` mark). Outputs, final states and all six gradients
(relative L2 <= 1e-5 with fp32 inputs; the gradients from the backward kernels) under
grouped value heads, the in-kernel L2 norm with a scale, chunks of 16 and 32 on lengths
that are not multiples, strong decay with beta of exactly 0 and 1, packed sequences
(traced cu_seqlens: one shorter than a chunk, one spanning chunks, an empty one, one
ending on a chunk boundary), bf16 inputs; every kernel output written, forward and
backward (the interpreter fills unwritten ones with NaN); value-column blocks; the value
heads split over two devices (the kernels on the local heads); the selection and its
refusals; the lowering for CUDA from the CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_delta_testlib as testlib
import jaxpr_testlib
from cuda_export_testlib import TRITON_CALL, cuda_module
from pallasite.kernels import chunk_gated_delta_rule, platform, sharding
from pallasite.kernels.gated_delta import packing, pallas_triton, pallas_triton_bwd, predicates
from pallasite.kernels.ssd import decay
from pallasite.reference import parity
from pallasite.reference.gated_delta_rule import gated_delta_rule_sequential

REL_L2, NAMES = testlib.REL_L2, testlib.NAMES
KERNEL = functools.partial(chunk_gated_delta_rule, implementation="pallas_triton")


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


_inputs = functools.partial(testlib.inputs, b=1, t=100, hk=1, hv=2, dk=32, dv=32)
_wide, _rel, _values_and_grads = testlib.wide, testlib.rel, testlib.values_and_grads


def _errors(a, **kw):
    """Relative L2 of o, the final states and the six gradients against the definition."""
    return testlib.errors(KERNEL, a, **kw)


CASES = {
    "grouped_value_heads": dict(b=2),
    "l2norm_and_scale": dict(kw=dict(use_qk_l2norm_in_kernel=True, scale=0.3)),
    "chunk_16_length_not_a_multiple": dict(t=37, dk=16, dv=64, kw=dict(chunk_size=16)),
    "chunk_32_two_key_heads": dict(t=70, hk=2, hv=4, dk=16, dv=16, kw=dict(chunk_size=32)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_against_the_definition(case):
    spec = dict(CASES[case])
    kw = spec.pop("kw", {})
    errors = _errors(_inputs(1, **spec), **kw)
    assert max(errors.values()) <= REL_L2, errors


def test_beta_exactly_zero_and_one_and_decay_down_to_minus_twenty():
    errors = _errors(testlib.with_extremes(_inputs(2, t=90, decay=20.0)))
    assert max(errors.values()) <= REL_L2, errors


def test_packed_sequences_with_traced_cu_seqlens():
    """Five sequences in one row: one shorter than a chunk (10), an empty one, one ending
    on a chunk boundary (54 + 10 = 64), one spanning chunks (100), a last short one
    (20). Each from its own initial state, each its own final state (the empty one's is
    its initial state, to the bit). cu_seqlens is a jit argument."""
    a = _inputs(3, t=184, n=5)
    cu = jnp.asarray([0, 10, 10, 64, 164, 184], jnp.int32)

    testlib.check_packed(KERNEL, a, cu)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_packed_long_sequences_forward_alone(chunk_size):
    """Three sequences (the middle one empty) of many chunks each at chunk 16, fewer at 64:
    the state pass walks runs (at 16; one loop over the row at 64), carrying S^T where
    block_v allows, and the forward alone reads q, k, v and writes o in the packed row."""
    a = _inputs(4, t=300, n=3)
    cu = jnp.asarray([0, 150, 150, 300], jnp.int32)
    kernel = functools.partial(KERNEL, chunk_size=chunk_size)
    want = gated_delta_rule_sequential(
        *(testlib.wide(a)[k] for k in NAMES[:5]),
        initial_state=testlib.wide(a)["initial_state"], output_final_state=True,
        cu_seqlens=cu)
    testlib.check_packed_forward(kernel, a, cu, want)


# pallas_triton's form flags, each test run with the named flags flipped from their
# defaults: every form stays correct, so any can become the default on a measurement.
KERNEL_FORMS = {"state_io": ("STATE_IO_IN_BRANCHES",),
                "decay": ("DECAY_ON_VALUES", "STATE_TRANSPOSED"),
                "state_io_and_decay": ("STATE_IO_IN_BRANCHES", "DECAY_ON_VALUES",
                                       "STATE_TRANSPOSED"),
                "prep": ("PREP_IN_TWO_KERNELS",),
                "apply_in_solve": ("APPLY_IN_SOLVE_KERNEL",),
                "short_sequences": ("SHORT_SEQUENCES_IN_ONE_LOOP",),
                "solve_diagonal": ("SOLVE_DIAGONAL_AT_ONCE",),
                "solve_rows_loaded": ("SOLVE_ROWS_LOADED",),
                "dg_spans_in_bf16_pieces": ("DG_SPANS_IN_BF16_PIECES",),
                "state_transposed": ("STATE_TRANSPOSED",),
                "packed_rows_laid_out": ("PACKED_ROWS_IN_PLACE",),
                "fused_output": ("FUSED_OUTPUT",),
                "fused_output_plain_carry": ("FUSED_OUTPUT", "STATE_TRANSPOSED"),
                "grads_solve_through_w": ("GRADS_SOLVE_THROUGH_U",),
                "grads_solve_through_w_values_first": ("GRADS_SOLVE_THROUGH_U",
                                                       "GRADS_SOLVE_KEYS_FIRST")}


def _flip_forms(form, monkeypatch):
    for flag in KERNEL_FORMS[form]:
        module = pallas_triton if hasattr(pallas_triton, flag) else pallas_triton_bwd
        monkeypatch.setattr(module, flag, not getattr(module, flag))


@pytest.mark.parametrize("form", list(KERNEL_FORMS))
def test_the_kernel_forms_against_the_definition(form, monkeypatch):
    """The kernels' other forms (pallas_triton's flags flipped: the state pass's
    STATE_IO_IN_BRANCHES, which the backward's reverse pass follows too, its carry
    transposed or not, STATE_TRANSPOSED, and DECAY_ON_VALUES with the plain carry; the
    prep in one or two kernels, PREP_IN_TWO_KERNELS, or the two's bodies in one,
    APPLY_IN_SOLVE_KERNEL; short packed sequences in one loop over the row,
    SHORT_SEQUENCES_IN_ONE_LOOP (the packed inputs here are short); the solve's
    diagonal blocks inverted together or one by one, SOLVE_DIAGONAL_AT_ONCE, their rows
    loaded from the solve's buffer or picked from registers, SOLVE_ROWS_LOADED; dg's spans
    on the tensor cores in bf16 pieces or at fp32 on the CUDA cores,
    DG_SPANS_IN_BF16_PIECES), values and
    gradients on rows of one sequence each (the states loaded and stored around the
    passes' chunk loops) and under packed sequences (inside them, mid-row), and lowered
    for CUDA from the CPU, differentiated (a branch inside each pass's chunk loop; the
    solve's barriers)."""
    _flip_forms(form, monkeypatch)
    errors = _errors(_inputs(15, b=2, t=150))
    assert max(errors.values()) <= REL_L2, errors
    a = _inputs(12, t=184, n=5)
    testlib.check_packed(KERNEL, a, jnp.asarray([0, 10, 10, 64, 164, 184], jnp.int32))
    s = jax.ShapeDtypeStruct
    args = (s((1, 256, 2, 128), jnp.bfloat16), s((1, 256, 2, 128), jnp.bfloat16),
            s((1, 256, 4, 128), jnp.bfloat16), s((1, 256, 4), jnp.float32),
            s((1, 256, 4), jnp.float32), s((3, 4, 128, 128), jnp.float32),
            s((4,), jnp.int32))

    def loss(*x):
        o, final = pallas_triton.forward(*x[:5], scale=0.1, initial_state=x[5],
                                         cu_seqlens=x[6], chunk_size=64,
                                         use_qk_l2norm_in_kernel=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    with jax.enable_x64(False):
        text = cuda_module(jax.grad(loss, argnums=tuple(range(6))), *args)
    # prep (one kernel or two) and the state pass, then the reverse pass and the two
    # chunk-gradient kernels (the gradient alone leaves the output kernel out)
    assert text.count(TRITON_CALL) == 4 + pallas_triton.prep_kernel_count()


def _prep_forms(monkeypatch, seed, chunk, dtype, l2norm, forms, b=1, hk=1, hv=2):
    """The prep's (U, W, T) on fresh inputs (strong decay, beta in [0, 1], K 32, V 16,
    two chunks a row) under each of `forms` (dicts of pallas_triton's flags), in order."""
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((b, 2, chunk, hk, 32)), dtype)
    v = jnp.asarray(rng.standard_normal((b, 2, chunk, hv, 16)), dtype)
    g = jnp.asarray(rng.uniform(-4.0, 0.0, (b, 2, chunk, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, 2, chunk, hv)), jnp.float32)
    hi, lo = decay.cumsum_pair(g, axis=2)
    outs = []
    for form in forms:
        for flag, value in form.items():
            monkeypatch.setattr(pallas_triton, flag, value)
        outs.append(pallas_triton._prep(k, v, hi, lo, beta, hv, dtype, l2norm, True,
                                        store_inverse=True))
    return outs


@pytest.mark.parametrize("chunk", pallas_triton.CHUNK_SIZES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_two_kernel_prep_matches_the_one_kernel_prep(chunk, dtype, monkeypatch):
    """U, W and T of the two prep forms (the solve's whole-chunk K K^T and the apply's
    whole-chunk products against 16-row blocks) at every chunk size, L2-normalised keys,
    strong decay, grouped heads: equal up to the sums' order (fp32) and one rounding of
    U and W (bf16)."""
    two, one = _prep_forms(monkeypatch, 21, chunk, dtype, True,
                           [dict(PREP_IN_TWO_KERNELS=True), dict(PREP_IN_TWO_KERNELS=False)],
                           b=2, hk=2, hv=4)
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    for name, got, want in zip(("U", "W", "T"), two, one):
        assert bool(jnp.all(jnp.isfinite(got))), name
        assert _rel(got, want) <= tolerance, (name, _rel(got, want))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_apply_in_the_solve_kernel_matches_the_two_kernels(dtype, monkeypatch):
    """APPLY_IN_SOLVE_KERNEL runs the two kernels' bodies in one program, T read back
    from where the solve stored it: U, W and T equal the two kernels' exactly."""
    fused, two = _prep_forms(monkeypatch, 23, 64, dtype, False, [
        dict(PREP_IN_TWO_KERNELS=True, APPLY_IN_SOLVE_KERNEL=True),
        dict(APPLY_IN_SOLVE_KERNEL=False)])
    for name, got, want in zip(("U", "W", "T"), fused, two):
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(want, np.float32), err_msg=name)


@pytest.mark.parametrize("chunk", pallas_triton.CHUNK_SIZES)
def test_the_solve_inverts_its_diagonal_blocks_together(chunk, monkeypatch):
    """SOLVE_DIAGONAL_AT_ONCE runs the same arithmetic per element as the block-by-block
    substitution, batched over the blocks: U, W and T agree in fp32 up to the compiler's
    order of operations (1e-18 absolute at chunk 16 in the interpreter, else equal)."""
    at_once, by_block = _prep_forms(monkeypatch, 22, chunk, jnp.float32, True, [
        dict(PREP_IN_TWO_KERNELS=True, SOLVE_DIAGONAL_AT_ONCE=True),
        dict(SOLVE_DIAGONAL_AT_ONCE=False)])
    for name, got, want in zip(("U", "W", "T"), at_once, by_block):
        assert bool(jnp.all(jnp.isfinite(want))), name
        assert _rel(got, want) <= 1e-6, (name, _rel(got, want))


@pytest.mark.parametrize("chunk", pallas_triton.CHUNK_SIZES)
def test_the_solve_loads_its_rows_or_picks_them_from_registers(chunk, monkeypatch):
    """SOLVE_ROWS_LOADED reads each row of A's diagonal blocks from the solve's buffer
    instead of picking it out of registers: the same values, the same arithmetic after
    them, so U, W and T agree in fp32 to the compiler's order of operations."""
    loaded, picked = _prep_forms(monkeypatch, 23, chunk, jnp.float32, True, [
        dict(PREP_IN_TWO_KERNELS=True, SOLVE_DIAGONAL_AT_ONCE=True, SOLVE_ROWS_LOADED=True),
        dict(SOLVE_ROWS_LOADED=False)])
    for name, got, want in zip(("U", "W", "T"), loaded, picked):
        assert bool(jnp.all(jnp.isfinite(got))), name
        assert _rel(got, want) <= 1e-6, (name, _rel(got, want))


def test_bf16_inputs_within_the_bf16_tolerance():
    a = _inputs(6, b=2, dtype=jnp.bfloat16)
    testlib.check_bf16(KERNEL, a)


def test_every_kernel_output_is_written():
    """The interpreter fills a kernel's outputs with NaN before it runs: U, W, T, the
    entry states, u, o, the final states and the backward's dS', du, initial-state
    cotangents, dq, dk, dv, dbeta and dg all finite means every row was written (packed
    sequences with padding chunks and an empty sequence, two rows, grouped heads)."""
    a = _inputs(7, t=75, n=4)
    cu = jnp.asarray([0, 5, 5, 70, 75], jnp.int32)
    f32 = jnp.float32
    stages = {}
    modules = {"_prep": pallas_triton, "_state_pass": pallas_triton,
               "_output": pallas_triton, "_reverse_pass": pallas_triton_bwd,
               "_chunk_grads": pallas_triton_bwd}
    real = {name: getattr(module, name) for name, module in modules.items()}

    def spy(name):
        def call(*args, **kwargs):
            out = real[name](*args, **kwargs)
            stages[name] = out
            return out
        return call

    def run(*args):
        return pallas_triton.forward(*args[:5], scale=0.2, initial_state=args[5],
                                     cu_seqlens=cu, chunk_size=32,
                                     use_qk_l2norm_in_kernel=False, interpret=True)

    def run_in_place(planner, args, **options):
        # each pass's local function on the arrays as they are, not inside sharding.run's
        # custom_vmap and custom_partitioning (whose traced functions would keep the
        # spied outputs to themselves)
        del options
        plan = planner(tuple(sharding.replicated(a.ndim) for a in args), {})
        return tuple(plan.local(*args))

    with pytest.MonkeyPatch.context() as mp:
        for name, module in modules.items():
            mp.setattr(module, name, spy(name))
        mp.setattr(sharding, "run", run_in_place)
        (o, final), pull = jax.vjp(run, *(a[n] for n in NAMES))
        grads = pull((jnp.ones_like(o), jnp.ones_like(final)))
    leaves = jax.tree.leaves(stages) + [o, final] + list(grads)
    assert len(leaves) == 23
    for leaf in leaves:
        assert bool(jnp.all(jnp.isfinite(leaf.astype(f32))))


def test_the_state_passes_runs_cover_every_chunk_once():
    """packing.sequence_runs: packed, one run per sequence over its own chunks (none for
    an empty one, which loads and stores nothing), then the padding chunks from zero;
    unpacked, one run per row over all of them."""
    cu = jnp.asarray([0, 5, 5, 70, 75, 200], jnp.int32)
    _, padded, first, counts = packing.packed_positions(cu, 200, 32)
    nc = padded // 32
    entering, leaving = packing.chunk_tables(1, nc, first, counts)
    start, count, seq = (np.asarray(t[0]) for t in packing.sequence_runs(
        entering, leaving, 5, packed=True))
    np.testing.assert_array_equal(seq, [0, -1, 2, 3, 4, -1])
    np.testing.assert_array_equal(count[:5], np.asarray(counts))
    np.testing.assert_array_equal(start[[0, 2, 3, 4]], np.asarray(first)[[0, 2, 3, 4]])
    covered = np.concatenate([np.arange(a, a + c) for a, c in zip(start, count)])
    np.testing.assert_array_equal(covered, np.arange(nc))  # each chunk once, in order
    assert count[5] == nc - int(np.sum(counts)) > 0
    entering, leaving = packing.chunk_tables(3, 4, None, None)
    runs = packing.sequence_runs(entering, leaving, 3, packed=False)
    np.testing.assert_array_equal(np.stack([np.asarray(t) for t in runs]),
                                  [[[0]] * 3, [[4]] * 3, [[0], [1], [2]]])


def test_the_chunk_layout_is_gathered_both_ways():
    """packing.lay_out with cu_seqlens: each step at its position and zeros between (the
    indexed update that defines it), steps_of its inverse, and the layout's cotangent the
    update's (the cotangent read at the positions), with no scatter either way (the map
    from positions to steps is searched, not scattered)."""
    cu = jnp.asarray([0, 5, 5, 70, 96, 200], jnp.int32)
    x = jax.random.normal(jax.random.key(3), (1, 200, 3, 5))
    ct = jax.random.normal(jax.random.key(4), (1, 384, 3, 5))

    def layout(x):
        (out,), padded, positions, _, _ = packing.lay_out((x,), cu, 200, 32)
        return out, padded, positions

    out, padded, positions = layout(x)
    assert padded == 384
    defined = jnp.zeros((1, padded, 3, 5)).at[:, positions].set(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(defined))
    np.testing.assert_array_equal(np.asarray(packing.steps_of(out, 200, positions)),
                                  np.asarray(x))
    grad = jax.grad(lambda x: jnp.sum(layout(x)[0] * ct))(x)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(ct[:, positions]))
    jaxpr = jax.make_jaxpr(jax.value_and_grad(lambda x: jnp.sum(layout(x)[0] * ct)))(x)

    scatters = [eqn for eqn in jaxpr_testlib.equations(jaxpr.jaxpr)
                if eqn.primitive.name.startswith("scatter")]
    assert not scatters, scatters


def test_short_packed_sequences_take_one_loop_where_asked(monkeypatch):
    """pallas_triton.pass_runs: with SHORT_SEQUENCES_IN_ONE_LOOP, packed sequences of
    fewer than SHORT_SEQUENCE_CHUNKS chunks on average are one run over the row (nothing
    loaded or stored around it) with the per-chunk tables; longer ones, or rows without
    cu_seqlens, keep their runs and no tables."""
    entering, leaving = packing.chunk_tables(1, 12, jnp.asarray([0, 1, 1, 4, 5]),
                                             jnp.asarray([1, 0, 3, 1, 4]))
    monkeypatch.setattr(pallas_triton, "SHORT_SEQUENCES_IN_ONE_LOOP", True)
    monkeypatch.setattr(pallas_triton, "SHORT_SEQUENCE_CHUNKS", 3)  # 12 chunks < 3 x 5
    runs, tables = pallas_triton.pass_runs(entering, leaving, 5, packed=True)
    np.testing.assert_array_equal(np.stack([np.asarray(t) for t in runs]), [[[0]], [[12]],
                                                                           [[-1]]])
    assert tables == (entering, leaving)
    monkeypatch.setattr(pallas_triton, "SHORT_SEQUENCE_CHUNKS", 2)  # 12 chunks >= 2 x 5
    runs, tables = pallas_triton.pass_runs(entering, leaving, 5, packed=True)
    assert runs[0].shape == (1, 6) and tables == ()
    assert pallas_triton.pass_runs(*packing.chunk_tables(2, 12, None, None), 2,
                                   packed=False)[1] == ()


def _traces_the_kernels(jaxpr_text):
    """Whether a jaxpr holds the forward's prep (one kernel or the solve of two) and
    output kernels (the output kernel, or the state pass that forms o: FUSED_OUTPUT)."""
    prep = "solve" if pallas_triton.PREP_IN_TWO_KERNELS else "prep"
    output = "state_output_pass" if pallas_triton.FUSED_OUTPUT else "output"
    return all(f"gated_delta_rule_{name}" in jaxpr_text for name in (prep, output))


def test_the_default_on_a_cpu_is_xla_and_refusals_name_the_argument():
    a = _inputs(8, t=20)
    text = str(jax.make_jaxpr(lambda **kw: chunk_gated_delta_rule(**kw))(**a))
    assert "pallas_call" not in text
    text = str(jax.make_jaxpr(lambda **kw: KERNEL(**kw))(**a))
    assert _traces_the_kernels(text)
    with pytest.raises(ValueError, match="chunk_size=48"):
        KERNEL(**a, chunk_size=48)
    with pytest.raises(ValueError, match=r"V \(v's last dim\) = 24"):
        KERNEL(**{**a, "v": a["v"][..., :24], "initial_state": a["initial_state"][..., :24]})
    with pytest.raises(ValueError, match="q has dtype float64"):
        KERNEL(**{**a, "q": a["q"].astype(jnp.float64)})
    with pytest.raises(ValueError, match="unknown keys"):
        KERNEL(**a, block_sizes={"block_m": 16})
    with pytest.raises(ValueError, match="block_v=24"):
        KERNEL(**a, block_sizes={"block_v": 24})
    with pytest.raises(TypeError, match="block_sizes must be None or a dict"):
        KERNEL(**a, block_sizes=(16, 16))
    # A sequence falls through to XLA where the kernels refuse.
    o, _ = chunk_gated_delta_rule(**a, chunk_size=48, implementation=("pallas_triton", "xla"))
    assert o.shape == a["v"].shape
    gpu = type("Gpu", (), {"platform": "gpu", "compute_capability": "7.5"})()
    assert "sm75" in predicates.device_reason(named=True, device=gpu)


def test_the_default_on_a_gpu_from_sm80_is_the_kernels(monkeypatch):
    """Where Triton runs (faked: the CPU taken for an sm80+ GPU) a call naming no
    implementation traces the kernels; a problem they refuse (chunk 48) takes XLA."""
    monkeypatch.setattr(predicates.platform, "triton_runs", lambda device=None: True)
    a = _inputs(8, t=20)
    text = str(jax.make_jaxpr(lambda **kw: chunk_gated_delta_rule(**kw))(**a))
    assert _traces_the_kernels(text)
    text = str(jax.make_jaxpr(lambda **kw: chunk_gated_delta_rule(**kw, chunk_size=48))(**a))
    assert "pallas_call" not in text


def test_block_v_follows_the_program_count():
    """The state passes' default block: the widest that keeps about one program per SM."""
    assert pallas_triton.default_block_v(1, 32, 128) == 32  # 4 x 32 = 128 programs
    assert pallas_triton.default_block_v(8, 32, 128) == 64
    assert pallas_triton.default_block_v(1, 4, 128) == 16
    assert pallas_triton.default_block_v(1, 4, 16) == 16
    dims = dict(batch=1, length=64, hv=4, dk=16, dv=32, chunk=32, dtype=jnp.float32)
    assert pallas_triton._resolve({"block_v": 64}, **dims).block_v == 32
    assert pallas_triton._resolve(None, **dims).block_v == 16  # no table entry on a CPU


# Shared memory (bytes) of state-pass kernels compiled for sm_90 by triton 3.6
# (tools/sweeps/triton_resources.py, 2026-12-06, branch form, chunk 64):
# (K, block_v, itemsize, key operands (2 forward, 3 reverse), stages) -> bytes.
COMPILED_SHARED_BYTES = {
    (128, 32, 2, 2, 3): 111656, (128, 32, 2, 3, 3): 176168, (128, 64, 2, 3, 3): 191528,
    (128, 128, 2, 3, 2): 157732, (256, 128, 2, 2, 2): 180772, (64, 16, 2, 3, 4): 120876,
    (128, 16, 4, 2, 3): 177192, (128, 16, 4, 3, 3): 233512, (128, 32, 4, 3, 3): 249896,
    (256, 16, 4, 3, 2): 235556, (64, 64, 4, 2, 4): 181804,
}


@pytest.mark.parametrize("budget", [232448, 166912, 101376])  # sm90, sm80, sm86 per block
def test_the_state_passes_pipeline_only_as_deep_as_shared_memory_holds(budget, monkeypatch):
    """pass_stages never picks a depth at or past a recorded compile that overflowed the
    budget; the measured default (3) holds at Qwen3-Next's heads on Hopper
    (bf16, K 128, block_v 32 and 64), and fp32 falls back (its 3 stages asked for more
    than Hopper has: the failure this rule prevents)."""
    monkeypatch.setattr(platform, "triton_shared_memory_budget", lambda device=None: budget)
    for (dk, bv, itemsize, operands, stages), used in COMPILED_SHARED_BYTES.items():
        picked = pallas_triton.pass_stages(64, dk, bv, itemsize, operands)
        assert 1 <= picked <= pallas_triton.STATE_PASS_STAGES
        # a depth at or past one that overflowed the budget would overflow too
        assert picked < stages or used <= budget, (dk, bv, itemsize, operands, stages)
    if budget == 232448:
        for bv in (32, 64):
            for operands in (2, 3):
                assert pallas_triton.pass_stages(64, 128, bv, 2, operands) == 3
        assert pallas_triton.pass_stages(64, 128, 16, 4, 3) == 2
    monkeypatch.setattr(pallas_triton, "STATE_PASS_STAGES", 1)
    assert pallas_triton.pass_stages(64, 16, 16, 2, 2) == 1


def _table_with(tmp_path, config, device_kind="NVIDIA H200"):
    """The checked-in gated_delta_rule table plus one entry for the small shapes below."""
    import json

    from pallasite.tuning import tables

    data = json.loads(tables.table_path("gated_delta_rule").read_text())
    data["entries"] = [{
        "implementation": "pallas_triton", "device_kind": device_kind,
        "dtypes": ["bfloat16"], "config": config,
        "bucket": {"batch": "upto_1", "length": "upto_4k", "heads": "upto_16",
                   "key_dim": "upto_64", "value_dim": "upto_64", "chunk": "upto_32"},
        "measured": {"shape": "a test's"}}]
    (tmp_path / "gated_delta_rule.json").write_text(json.dumps(data))
    return tmp_path


def test_a_table_entry_sets_both_passes_blocks(monkeypatch, tmp_path):
    """With no block_sizes, the forward and the backward look up pallasite.tuning's table
    under one key (device kind, compute dtype, shape bucket) and run its entry: here
    grads_block_v 16 splits the chunk gradients' 64 value columns into 4 programs. A
    caller's block_sizes (any key) bypasses the table; another device kind's entry, or
    an entry that is not valid block sizes, is passed over for the defaults."""
    from pallasite import tuning
    from pallasite.tuning import tables

    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    a = _inputs(3, t=40, hk=1, hv=2, dk=32, dv=64, dtype=jnp.bfloat16)
    args = [a[n] for n in NAMES]

    def trace(block_sizes=None):
        def loss(*x):
            o, final = pallas_triton.forward(
                *x[:5], scale=0.2, initial_state=x[5], cu_seqlens=None, chunk_size=32,
                use_qk_l2norm_in_kernel=False, interpret=True, block_sizes=block_sizes)
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

        with tuning.recording() as seen:
            text = str(jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(6))))(*args))
        return seen, text

    entry = {"block_v": 32, "output_block_v": 64, "grads_block_v": 16}
    monkeypatch.setattr(tables, "DATA_DIR", _table_with(tmp_path, entry))
    seen, text = trace()
    assert [(op, impl, sel.source) for op, impl, sel in seen] == [
        ("gated_delta_rule", "pallas_triton", "table")] * 2  # forward, backward
    assert all(sel.config == pallas_triton.BlockSizes(**entry) for _, _, sel in seen)
    assert "f32[4,1,2,32,2,32]" in text  # dq's shares: one per 16-column block
    assert trace({"grads_block_v": 64})[0] == []  # the caller's: no lookup

    for other, kind in ((entry, "NVIDIA A100"), ({**entry, "grads_block_v": 24}, "NVIDIA H200")):
        monkeypatch.setattr(tables, "DATA_DIR", _table_with(tmp_path, other, kind))
        seen, _ = trace()
        assert {sel.source for _, _, sel in seen} == {"default"}


def test_the_kernels_run_on_local_heads_under_explicit_axes():
    """With the value heads (and their key heads) over 2 devices under Explicit axes, the
    sharding plan (layouts.py) runs the kernels on each device's heads: values and
    gradients equal the unsharded call's, packed sequences included."""
    import sharding_testlib as st

    a = _inputs(12, t=50, hk=2, hv=4, dk=16, dv=16, n=2)
    cu = jnp.asarray([0, 20, 50], jnp.int32)
    mesh = st.mesh((2,), ("x",), st.EXPLICIT, devices=jax.devices()[:2])
    heads = {"q": (None, None, "x"), "k": (None, None, "x"), "v": (None, None, "x"),
             "g": (None, None, "x"), "beta": (None, None, "x"), "initial_state": (None, "x")}
    placed = {name: st.put(t, mesh, *heads[name]) for name, t in a.items()}
    with jax.set_mesh(mesh):
        got = _values_and_grads(KERNEL, placed, cu_seqlens=cu, chunk_size=16)
    want = _values_and_grads(KERNEL, a, cu_seqlens=cu, chunk_size=16)
    errors = [_rel(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    assert max(errors) <= 1e-6, errors


def test_block_sizes_change_no_result():
    """Values and gradients with one and with two value-column blocks per program (the
    backward's chunk-gradient kernel sums its blocks' shares)."""
    a = _inputs(9, t=20, dk=16, dv=32)
    got = _values_and_grads(KERNEL, a)
    split = _values_and_grads(functools.partial(KERNEL, block_sizes={
        "block_v": 16, "output_block_v": 16, "grads_block_v": 16}), a)
    errors = [_rel(g, w) for g, w in zip(jax.tree.leaves(split), jax.tree.leaves(got))]
    assert max(errors) <= REL_L2, errors  # sums in another order


@pytest.mark.parametrize("packed", [False, True])
def test_the_kernels_lower_for_cuda_from_cpu(packed):
    """The forward and the differentiated call at Qwen3-Next's heads (16 q/k, 32 v, K = V
    = 128, bf16), a short sequence: three Triton calls in the forward, five with the
    backward."""
    s = jax.ShapeDtypeStruct
    t, hk, hv, d = 256, 16, 32, 128
    n = 3 if packed else 1
    args = (s((1, t, hk, d), jnp.bfloat16), s((1, t, hk, d), jnp.bfloat16),
            s((1, t, hv, d), jnp.bfloat16), s((1, t, hv), jnp.float32),
            s((1, t, hv), jnp.float32), s((n, hv, d, d), jnp.float32))
    cu = (s((n + 1,), jnp.int32),) if packed else ()

    def forward(*a):
        return pallas_triton.forward(*a[:5], scale=d ** -0.5, initial_state=a[5],
                                     cu_seqlens=a[6] if packed else None, chunk_size=64,
                                     use_qk_l2norm_in_kernel=True)

    def loss(*a):
        o, final = forward(*a)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    with jax.enable_x64(False):
        text = cuda_module(forward, *args, *cu)
        forward_kernels = pallas_triton.forward_kernel_count()
        assert text.count(TRITON_CALL) == forward_kernels
        # The forward's (value_and_grad keeps its output kernel) and the backward's three:
        # the reverse state pass and the two chunk-gradient kernels.
        grads = cuda_module(jax.value_and_grad(loss, argnums=tuple(range(6))), *args, *cu)
        assert grads.count(TRITON_CALL) == forward_kernels + 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_kernels_against_the_definition(dtype):
    if not platform.triton_runs():
        pytest.skip(f"needs a CUDA GPU from sm80; the device is {platform.device_generation()}")
    dt = jnp.dtype(dtype)
    a = _inputs(10, b=2, t=300, hk=2, hv=4, dk=64, dv=128, dtype=dt)
    # The gradients below come from the compiled backward kernels.
    text = str(jax.make_jaxpr(lambda *x: _values_and_grads(KERNEL, dict(zip(NAMES, x))))(
        *(a[n] for n in NAMES)))
    assert "gated_delta_rule_reverse_state_pass" in text
    assert "gated_delta_rule_chunk_grads" in text
    cu = jnp.asarray([0, 10, 10, 64, 230, 300], jnp.int32)
    packed = {**_inputs(11, t=300, hk=2, hv=4, dk=128, dv=64, n=5, dtype=dt)}
    for arrays, kw in ((a, {}), (packed, dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True))):
        got = _values_and_grads(functools.partial(KERNEL, **kw), arrays)
        # and (o, final) of the forward alone: no residuals, packed rows read in place
        got = (got, testlib.forward_alone(KERNEL, arrays, **kw))
        if dt == jnp.float32:
            want = _values_and_grads(functools.partial(gated_delta_rule_sequential, **kw),
                                     _wide(arrays))
            want = (want, want[0])
            errors = [_rel(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
            assert max(errors) <= REL_L2, errors
            continue
        wide = {k: v.astype(jnp.float32) for k, v in arrays.items()}
        want = _values_and_grads(functools.partial(gated_delta_rule_sequential, **kw), wide)
        want = (want, want[0])
        for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            parity.assert_close(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                dtype=jnp.bfloat16, what=f"output {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("form", list(KERNEL_FORMS))
def test_compiled_kernel_forms_against_the_definition(form, monkeypatch):
    """The kernels' other forms compiled (fp32, rows of one sequence each and packed
    sequences, values and gradients), so that any can become the default on a
    measurement."""
    if not platform.triton_runs():
        pytest.skip(f"needs a CUDA GPU from sm80; the device is {platform.device_generation()}")
    _flip_forms(form, monkeypatch)
    errors = _errors(_inputs(16, b=2, t=300, hk=2, hv=4, dk=128, dv=64))
    assert max(errors.values()) <= REL_L2, errors
    a = _inputs(13, t=300, hk=2, hv=4, dk=128, dv=64, n=5)
    testlib.check_packed(KERNEL, a, jnp.asarray([0, 10, 10, 64, 230, 300], jnp.int32))
