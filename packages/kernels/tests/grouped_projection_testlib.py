"""Shared test base for every grouped_projection backend (imported by the test files).

A case draws fresh nonzero inputs, runs the projection and its vjp against a random
cotangent, and compares y, dx and dkernel with the reference package's fp32 building
blocks applied to the same rounded operands (HIGHEST precision). The interpreters fill
outputs with NaN before a kernel runs, so a row a kernel forgets to write fails the
comparison instead of passing as a zero.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.reference import parity
from pallasite.reference.grouped_projection import gmm_reference, tgmm_reference
from pallasite.reference.inputs import grouped_projection_inputs, random_group_sizes


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    m: int
    k: int
    n: int
    g: int
    compute: str = "bfloat16"
    total: int | None = None  # rows in groups; None: all m
    empty: tuple[int, ...] = ()  # groups forced empty

    def __str__(self):
        return self.name


# The grid of the issue: m not a multiple of the tile (16 or 128), k and n not powers of
# two, g = 1, 8, 64, empty groups, every group empty, total < m; three compute dtypes.
CPU_CASES = [
    Case("g1_bf16", 50, 24, 40, 1),
    Case("g8_empty_partial_bf16", 53, 36, 20, 8, total=41, empty=(0, 3, 7)),
    Case("g64_sparse_bf16", 70, 20, 24, 64, total=60),
    Case("g8_all_empty_bf16", 40, 24, 20, 8, total=0),
    Case("g8_fp16", 45, 40, 36, 8, compute="float16", total=40, empty=(2,)),
    Case("g8_fp32", 45, 28, 36, 8, compute="float32", total=44, empty=(5,)),
]

# On real hardware (GPU, TPU) the same grid plus shapes that span several tiles per group.
ACCELERATOR_CASES = CPU_CASES + [
    Case("g64_medium_bf16", 4100, 520, 392, 64, total=4000, empty=(1, 40)),
    Case("g8_medium_fp32", 2000, 264, 200, 8, compute="float32"),
]


def draw(case: Case, seed: int = 0):
    """(x, kernel, group_sizes, dy): x fp32, kernel fp32, so the casts are exercised."""
    key = jax.random.fold_in(jax.random.key(seed), hash(case.name) % (2**31))
    kx, kg, kd = jax.random.split(key, 3)
    x, kernel, _ = grouped_projection_inputs(kx, case.m, case.k, case.n, case.g, jnp.float32)
    total = case.m if case.total is None else case.total
    if total == 0:
        sizes = jnp.zeros((case.g,), jnp.int32)
    else:
        sizes = random_group_sizes(kg, case.m, case.g, total=total, empty=case.empty)
    dy = jax.random.normal(kd, (case.m, case.n), jnp.float32)
    return x, kernel, sizes, dy


def expected(x, kernel, sizes, dy, compute):
    """y, dx, dkernel in fp32 from the operands rounded to `compute` (the contract)."""
    xc, kc, dyc = (a.astype(compute) for a in (x, kernel, dy))
    return {
        "y": gmm_reference(xc, kc, sizes),
        "dx": gmm_reference(dyc, kc, sizes, transpose_rhs=True),
        "dkernel": tgmm_reference(xc, dyc, sizes, kernel.shape[0]),
    }


def actual(project, x, kernel, sizes, dy):
    """y, dx, dkernel of `project(x, kernel, sizes)` through its vjp, under one jit."""

    @jax.jit
    def run(x, kernel, sizes, dy):
        y, vjp = jax.vjp(lambda x, kernel: project(x, kernel, sizes), x, kernel)
        dx, dk = vjp(dy.astype(y.dtype))
        return {"y": y, "dx": dx, "dkernel": dk}

    return run(x, kernel, sizes, dy)


def tolerance(compute, platform: str):
    if np.dtype(compute) == np.float32 and platform == "cpu":
        return parity.EXACT_FP32  # the interpreter's dots are true fp32
    return parity.tolerance(compute)


def check_case(case: Case, project, platform: str = "cpu", seed: int = 0):
    """Run `project` on `case` and assert y, dx, dkernel match the reference."""
    x, kernel, sizes, dy = draw(case, seed)
    got = actual(project, x, kernel, sizes, dy)
    want = expected(x, kernel, sizes, dy, case.compute)
    assert got["y"].dtype == np.dtype(case.compute), got["y"].dtype
    assert got["dx"].dtype == x.dtype and got["dkernel"].dtype == kernel.dtype
    total = int(np.sum(sizes))
    assert not np.any(np.asarray(got["y"][total:], np.float32)), "rows past the total not zero"
    assert not np.any(np.asarray(got["dx"][total:], np.float32)), "dx past the total not zero"
    tol = tolerance(case.compute, platform)
    for what in ("y", "dx", "dkernel"):
        parity.assert_close(got[what], want[what], dtype=case.compute, tol=tol,
                            what=f"{case.name}/{what}")
    empty = np.flatnonzero(np.asarray(sizes) == 0)
    assert not np.any(np.asarray(got["dkernel"])[empty]), "empty group with nonzero dkernel"
