"""Flop and byte formulas on known shapes; error sampling. (The float64 SSD recurrence the
checks use is tested with the kernels: tests/test_autotune_on_miss.py.)"""

import numpy as np
import pytest

from pallasite.bench import ops, suites


def test_grouped_projection_flops_and_bytes():
    fwd = ops.gp_case("mixtral", 32768, 4096, 14336, 8)
    assert fwd.flops == 2 * 32768 * 4096 * 14336
    assert fwd.bytes == (32768 * 4096 + 8 * 4096 * 14336 + 32768 * 14336) * 2 + 4 * 8
    both = ops.gp_case("mixtral", 32768, 4096, 14336, 8, direction="fwd_bwd")
    assert both.flops == 3 * fwd.flops
    assert both.bytes == 3 * fwd.bytes
    small = ops.gp_case("s", 4, 3, 5, 2, dtype="float32")
    assert small.flops == 120 and small.bytes == (12 + 30 + 20) * 4 + 8


def test_ssd_flops_and_bytes():
    # One chunk, one head, one group, T = C(C+1)/2 = 10 causal pairs: 2Tp + 4Cpn + 2pn + 2Tn.
    c = ops.ssd_case("s", 1, 4, 1, 2, 3, 1, chunk=4)
    assert c.flops == 2 * 10 * 2 + 4 * 4 * 2 * 3 + 2 * 2 * 3 + 2 * 10 * 3
    x, a, bc, st = 4 * 2 * 2, 4 * 4, 2 * 4 * 3 * 2, 2 * 3 * 4
    assert c.bytes == 2 * x + a + bc + 2 * st
    # docs/targets.md first Mamba-2 row: "reads and writes about 0.8 GB" forward+backward.
    row = ops.ssd_case("r", 8, 4096, 32, 64, 128, 1, direction="fwd_bwd")
    assert row.bytes == pytest.approx(0.77e9, rel=0.02)
    fwd = ops.ssd_case("r", 8, 4096, 32, 64, 128, 1)
    assert row.flops == 3 * fwd.flops
    assert fwd.flops == pytest.approx(52.8e9, rel=0.01)


def test_case_names_and_keys():
    c = ops.gp_case("olmoe", 32768, 2048, 1024, 64, direction="fwd_bwd")
    assert c.kernel == "grouped_projection.fwd_bwd"
    assert c.shape == "olmoe[m=32768,k=2048,n=1024,g=64]"


def test_suites_cover_targets_and_filters():
    targets = suites.suite("targets")
    names = {c.shape_name for c in targets}
    assert {"mixtral", "dsv3", "qwen3", "olmoe"} <= names
    assert {c.direction for c in targets} == {"fwd", "fwd_bwd"}
    assert len([c for c in targets if c.op == ops.SSD]) == 6
    only = suites.filter_cases(targets, ops_=[ops.GP], shapes=["qwen"], directions=["fwd"])
    assert [c.shape_name for c in only] == ["qwen3"]
    mlp_fp8 = suites.filter_cases(suites.suite("mlp"), dtypes=[ops.FP8])
    assert mlp_fp8 and {c.dtype for c in mlp_fp8} == {ops.FP8}
    smoke = suites.suite("smoke")
    assert {c.op for c in smoke} == {ops.GP, ops.SSD} and len(smoke) == 2


def test_sample_rows_hit_every_group_boundary():
    gs = np.array([3, 0, 5, 1], np.int32)
    rows = ops._sample_rows(gs, 64)
    assert {0, 2, 3, 7, 8} <= set(rows.tolist())
    assert rows.max() < gs.sum()
    np.testing.assert_array_equal(ops._group_of(np.array([0, 2, 3, 8]), gs), [0, 0, 2, 3])


def test_sample_rows_reach_the_last_of_many_groups():
    """256 groups, 64 rows: the samples spread over the groups up to the last one (a
    fault in late groups only, as a 32-bit offset wrap gives, must show)."""
    gs = np.full(256, 256, np.int32)
    groups = ops._group_of(ops._sample_rows(gs, 64), gs)
    assert groups.min() == 0 and groups.max() == 255 and len(set(groups.tolist())) == 32


def test_check_grouped_projection_flags_a_wrong_row():
    import jax.numpy as jnp

    case = ops.gp_case("t", 24, 16, 8, 3, dtype="float32")
    inputs = ops.make_inputs(case, seed=0)
    x, w, gs = (np.asarray(inputs[k], np.float64) for k in ("x", "kernel", "group_sizes"))
    owner = ops._group_of(np.arange(24), gs.astype(np.int64))
    y = np.einsum("mk,mkn->mn", x, w[owner])
    good = ops.check_grouped_projection(case, inputs, (jnp.asarray(y, jnp.float32),))
    assert good.ok and good.rel_l2 < 1e-5
    y[int(gs[0])] += 1.0  # the first row of group 1
    bad = ops.check_grouped_projection(case, inputs, (jnp.asarray(y, jnp.float32),))
    assert not bad.ok


def test_block_sizes_for_builds_the_kernels_class():
    from pallasite.bench import impls
    from pallasite.kernels.grouped_matmul import TritonBlockSizes

    triton = next(i for i in impls.IMPLS if i.op == ops.GP and i.name == "pallas_triton")
    xla = next(i for i in impls.IMPLS if i.op == ops.GP and i.name == "xla")
    assert impls.block_sizes_for(triton, None) is None
    blocks = impls.block_sizes_for(triton, {"block_m": 16, "block_n": 16, "block_k": 16})
    assert isinstance(blocks, TritonBlockSizes) and blocks.block_m == 16
    with pytest.raises(ValueError, match="does not fit pallas_triton"):
        impls.block_sizes_for(triton, {"tile": 3})
    with pytest.raises(NotImplementedError, match="takes no block sizes"):
        impls.block_sizes_for(xla, {"block_m": 16})


def test_mamba_cases_flops_bytes_and_suite():
    c = ops.mamba_case("r", 8, 4096, 32, 64, 128, 1, seqs=8)
    assert c.kernel == "mamba_chunk_scan.fwd" and "seqs=8" in c.shape
    assert c.flops == ops.ssd_case("r", 8, 4096, 32, 64, 128, 1).flops
    x, dt, bc, st = 8 * 4096 * 32 * 64 * 2, 8 * 4096 * 32 * 4, 2 * 8 * 4096 * 128 * 2, \
        8 * 32 * 64 * 128 * 4
    inputs = 2 * x + dt + bc + st
    assert c.bytes == inputs + x + st
    both = ops.mamba_case("r", 8, 4096, 32, 64, 128, 1, direction="fwd_bwd")
    assert both.bytes == (inputs + x + st) + inputs + (x + st) + inputs
    cases = suites.suite("mamba")
    assert len(cases) == 12 and {c.op for c in cases} == {ops.MAMBA}
    assert {c.d["seqs"] for c in cases} == {1, 8}


def test_check_mamba_accepts_the_xla_path_and_flags_a_wrong_head():
    """The float64 check (dt, resets, D, z around the recurrence) admits the XLA path's
    outputs on packed inputs and rejects them with one head's y shifted."""
    import jax.numpy as jnp

    from pallasite.bench import impls

    case = ops.mamba_case("tiny", 2, 128, 4, 16, 16, 2, chunk=64, seqs=3)
    inputs = ops.make_inputs(case, 0)
    assert "seq_idx" in inputs
    outputs = impls.build_mamba(None, case, None, name="xla")(inputs)
    assert ops.check_mamba(case, inputs, outputs).ok
    y = jnp.asarray(outputs[0]).at[0, :, 0].add(1.0)
    assert not ops.check_mamba(case, inputs, (y,) + tuple(outputs[1:])).ok


def test_grouped_mlp_cases_flops_bytes_and_check():
    c = ops.mlp_case("mixtral_mlp", 32768, 4096, 14336, 8)
    assert c.kernel == "grouped_mlp.fwd" and c.flops == 6 * 32768 * 4096 * 14336
    x, w = 32768 * 4096 * 2, 3 * 8 * 4096 * 14336 * 2
    assert c.bytes == 2 * x + w + 4 * 8
    both = ops.mlp_case("mixtral_mlp", 32768, 4096, 14336, 8, direction="fwd_bwd")
    assert both.flops == 3 * c.flops and both.bytes == c.bytes + (2 * x + w) + (x + w)
    mlp = suites.suite("mlp")
    assert {k.op for k in mlp} == {ops.GMLP} and len(mlp) == 12
    assert sorted({k.dtype for k in mlp}) == ["bfloat16", ops.FP8]
    from pallasite.bench import impls

    tiny = ops.mlp_case("tiny_mlp", 96, 64, 64, 4, direction="fwd_bwd")
    inputs = ops.make_inputs(tiny, 0)
    xla = next(i for i in impls.IMPLS if i.op == ops.GMLP and i.name == "xla")
    outputs = impls.build_grouped_mlp(xla, tiny, impls.current_platform())(inputs)
    assert ops.check_grouped_mlp(tiny, inputs, outputs).ok
    wrong = (outputs[0], outputs[1].at[0].add(1.0)) + tuple(outputs[2:])
    assert not ops.check_grouped_mlp(tiny, inputs, wrong).ok


@pytest.mark.parametrize("name", ["xla", "pallas_triton.fused", "pallas_mosaic_gpu.fused"])
def test_grouped_mlp_fp8_cases_pass_the_check_and_a_wrong_one_does_not(name):
    """recipe="fp8" cases: the composition on XLA and the fused route on either backend
    (its gate-up quantizing h in the epilogue, interpreted) pass the check against the
    unquantized definition within e4m3's error; y 1.5 times too large does not."""
    from pallasite.bench import impls

    impl = next(i for i in impls.IMPLS if i.op == ops.GMLP and i.name == name)
    case = ops.mlp_case("tiny_mlp_fp8", 256, 128, 128, 4, direction="fwd_bwd", dtype=ops.FP8)
    inputs = ops.make_inputs(case, 0)
    outputs = impls.build_grouped_mlp(impl, case, impls.current_platform())(inputs)
    error = ops.check_grouped_mlp(case, inputs, outputs)
    assert error.ok and 1e-2 < error.rel_l2 < 0.1, error
    assert not ops.check_grouped_mlp(case, inputs, (outputs[0] * 1.5,) + tuple(outputs[1:])).ok


@pytest.mark.parametrize("name", ["pallas_mosaic_gpu.fused", "pallas_triton.fused"])
def test_grouped_mlp_fused_implementations_pass_the_check(name):
    """The fused gate-up implementations (interpreted here): forward and the four
    outputs of forward+backward pass the grouped_mlp check; parity only on a CPU."""
    from pallasite.bench import impls

    impl = next(i for i in impls.IMPLS if i.op == ops.GMLP and i.name == name)
    plat = impls.current_platform()
    assert impls.unavailable(impl, plat, {}) is None and impls.parity_only(impl, plat)
    tiny = ops.mlp_case("tiny_mlp", 96, 64, 64, 4, direction="fwd_bwd")
    inputs = ops.make_inputs(tiny, 0)
    outputs = impls.build_grouped_mlp(impl, tiny, plat)(inputs)
    assert len(outputs) == 4 and ops.check_grouped_mlp(tiny, inputs, outputs).ok


def test_gated_delta_rule_cases_and_check():
    c = ops.delta_case("qwen3_next", 1, 32768, 16, 32, 128, 128)
    assert c.kernel == "gated_delta_rule.fwd"
    assert c.flops == 32768 * 32 * (6 * 128 * 128 + 64 * (3 * 128 + 2 * 128))
    cases = suites.suite("delta")
    assert len(cases) == 6 and {k.op for k in cases} == {ops.GDR}
    from pallasite.bench import impls

    tiny = ops.delta_case("tiny_delta", 1, 100, 1, 2, 16, 16, chunk=16, seqs=3,
                          direction="fwd_bwd")
    inputs = ops.make_inputs(tiny, 0)
    assert inputs["cu_seqlens"].shape == (4,) and inputs["initial_state"].shape[0] == 3
    outputs = impls.build_gated_delta_rule(None, tiny, None, name="xla")(inputs)
    grads = impls.delta_grads_reference(tiny, inputs)
    assert ops.check_gated_delta_rule(tiny, inputs, outputs, grads).ok
    wrong = (outputs[0].at[0, 50, 0].add(1.0),) + tuple(outputs[1:])
    assert not ops.check_gated_delta_rule(tiny, inputs, wrong, grads).ok
