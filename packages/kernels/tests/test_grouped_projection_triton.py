"""grouped_projection through the Pallas Triton kernels: the interpreter on CPU (small
blocks, so the grid has many tiles per group) and the real kernels on a GPU (gpu mark)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grouped_projection_testlib import ACCELERATOR_CASES, CPU_CASES, check_case
from pallasite.kernels.grouped_matmul import TritonBlockSizes, grouped_projection
from pallasite.kernels.grouped_matmul import group_metadata, pallas_triton

SMALL = TritonBlockSizes(block_m=16, block_n=16, block_k=16, group_m=2)


def _project(compute, implementation="pallas_triton", block_sizes=SMALL, interpret=True):
    return lambda x, kernel, sizes: grouped_projection(
        x, kernel, sizes, jnp.dtype(compute), interpret,
        implementation=implementation, block_sizes=block_sizes)


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_interpret_parity(case):
    check_case(case, _project(case.compute))


@pytest.mark.parametrize("aligned", [False, True])
def test_group_metadata_covers_each_row_once(aligned):
    sizes = jnp.array([5, 0, 17, 9, 0, 1], jnp.int32)
    m, tile = 40, 8
    md = group_metadata.make_group_metadata(sizes, m, tile, aligned=aligned, include_tail=True)
    assert md.group.shape == (group_metadata.num_visits(m, 6, tile),)
    owner = np.full(m, -1)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for grp, start, end, tile_id in zip(*map(np.asarray, md[1:])):
        assert end - start <= tile
        if end > start:
            assert (owner[start:end] == -1).all(), "row visited twice"
            owner[start:end] = grp
            if aligned:
                assert start // tile == tile_id == (end - 1) // tile
    expect = np.searchsorted(offsets[1:], np.arange(m), side="right")  # tail -> 6
    np.testing.assert_array_equal(owner, expect)


def test_group_metadata_has_no_loop():
    """The visit table is one pass of compares, not a binary search: that is a while loop
    of tiny kernels the host issues one by one (docs/performance.md, "one-pass tile
    table")."""
    make = lambda s: group_metadata.make_group_metadata(  # noqa: E731
        s, 4096, 64, aligned=False, include_tail=True)
    text = str(jax.make_jaxpr(make)(jnp.ones((64,), jnp.int32)))
    assert "scan[" not in text and "while[" not in text


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_cost_estimates(transpose_rhs):
    """flops 2*m*k*n; bytes = operands (metadata included) and result, once each."""
    import jax

    m, k, n, g = 100, 48, 40, 3
    lhs = jnp.zeros((m, k), jnp.bfloat16)
    rhs = jnp.zeros((g, n, k) if transpose_rhs else (g, k, n), jnp.bfloat16)
    sizes = jnp.array([30, 0, 50], jnp.int32)
    dy = jnp.zeros((m, n), jnp.bfloat16)
    cases = [(lambda: pallas_triton.gmm(lhs, rhs, sizes, transpose_rhs=transpose_rhs,
                                        block_sizes=SMALL, interpret=True),
              3 * group_metadata.num_visits(m, g, SMALL.block_m) * 4 + (m * k + g * k * n + m * n) * 2),
             (lambda: pallas_triton.tgmm(lhs, dy, sizes, block_sizes=SMALL, interpret=True),
              (g + 1) * 4 + (m * k + m * n + g * k * n) * 2)]
    for fn, want_bytes in cases:
        eqns = [e for e in jax.make_jaxpr(fn)().eqns if e.primitive.name == "pallas_call"]
        assert len(eqns) == 1
        cost = eqns[0].params["cost_estimate"]
        assert cost.flops == 2 * m * k * n and cost.transcendentals == 0
        assert cost.bytes_accessed == want_bytes


def test_block_sizes_rejected():
    with pytest.raises(ValueError, match="block_m"):
        TritonBlockSizes(block_m=48)
    with pytest.raises(TypeError, match="TritonBlockSizes"):
        pallas_triton.resolve_block_sizes(object(), product="forward", m=1, k=1, n=1, g=1,
                                          dtype=jnp.bfloat16)




@pytest.mark.gpu
@pytest.mark.parametrize("case", ACCELERATOR_CASES, ids=str)
def test_gpu_parity(case):
    check_case(case, _project(case.compute, block_sizes=None, interpret=False), platform="gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ACCELERATOR_CASES[1:3], ids=str)
def test_gpu_parity_small_blocks(case):
    check_case(case, _project(case.compute, block_sizes=SMALL, interpret=False), platform="gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ACCELERATOR_CASES[:3], ids=str)
def test_gpu_default_order(case):
    check_case(case, _project(case.compute, implementation=None, block_sizes=None,
                              interpret=False), platform="gpu")
