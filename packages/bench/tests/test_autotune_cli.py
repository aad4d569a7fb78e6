"""The table regenerator's dry run lists every key with the backend's own default, for both
ops, without running a kernel (the device run starts from it)."""

import pytest

from pallasite.bench import autotune


@pytest.mark.parametrize("op, impls", [
    ("grouped_projection", ("pallas_triton:forward", "pallas_mosaic_gpu:dkernel")),
    ("ssd", ("pallas_triton:forward", "pallas_triton:backward")),
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
