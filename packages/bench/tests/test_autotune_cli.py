"""The table regenerator's dry run lists every key with the backend's own default, for each
op, without running a kernel (the device run starts from it); the gated delta rule's
benchmark through the interpreter."""

import pytest

from pallasite.bench import autotune


@pytest.mark.parametrize("op, impls", [
    ("grouped_projection", ("pallas_triton:forward", "pallas_mosaic_gpu:dkernel",
                            "pallas_mosaic_gpu_fp8:forward", "pallas_triton_fp8:dkernel")),
    ("ssd", ("pallas_triton:forward", "pallas_triton:backward")),
    ("gated_delta_rule", ("pallas_triton",)),
])
def test_dry_run_lists_every_key(op, impls, capsys):
    assert autotune.main(["--op", op, "--device-kind", "NVIDIA H200", "--dry-run",
                          "--interpret"]) == 0
    out = capsys.readouterr().out
    for impl in impls:
        for shape in autotune.targets(op):
            assert any(line.startswith(impl) and f" {shape} " in line and "dry run" in line
                       for line in out.splitlines()), (impl, shape, out)


def test_ssd_default_is_what_a_call_resolves():
    from pallasite.kernels.ssd import pallas_triton

    dims = dict(zip(autotune.SSD_DIMS, (2, 512, 4, 64, 128, 1, 64)))
    default = autotune._ssd_default(pallas_triton, dims)
    expected = pallas_triton.default_block_sizes(64, 128, itemsize=2)
    assert default.block_m == min(expected.block_m, 64)
    assert default.block_t == min(expected.block_t, 64)
    assert (default.num_warps, default.num_stages) == (expected.num_warps, expected.num_stages)


def test_gated_delta_rule_tunes_through_the_interpreter(capsys, tmp_path):
    """A tiny shape through the interpreter: every candidate timed matches the XLA form
    (status ok), and --no-write leaves the table alone."""
    results = tmp_path / "r.jsonl"
    assert autotune.main(["--op", "gated_delta_rule", "--device-kind", "NVIDIA H200",
                          "--interpret", "--no-write", "--max-candidates", "3",
                          "--budget-s", "120", "--results", str(results),
                          "--custom-shape",
                          "batch=1,length=64,heads=2,key_dim=16,value_dim=32,chunk=32,"
                          "key_heads=1"]) == 0
    import json

    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert [t["status"] for t in record["trials"]] == ["ok"] * 3, record
