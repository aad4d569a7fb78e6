"""Autotune benchmarks for the grouped_projection GPU kernels: synthetic inputs, checked rows.

Here, not in pallasite.bench, because a kernel call that misses the tuned table and the
autotune cache tunes itself (each GPU backend's resolve_block_sizes passes one of these to
pallasite.tuning.select_block_sizes), and the kernels cannot import the bench package.
`bazel run //packages/bench:autotune` uses the same benchmarks offline.

A Benchmark runs one product (forward gmm, dx gmm with transpose_rhs, dkernel tgmm) of one
backend module with a candidate config on fixed synthetic inputs of the call's shape and
dtype (pallasite.reference.inputs, seeded). A candidate may win only if its output matches
exact products: sampled rows of gmm (group edges, where tiles meet groups, plus random
rows), two groups' whole tgmm blocks, each recomputed at HIGHEST precision in fp32.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pallasite import tuning
from pallasite.kernels.grouped_matmul import config, fit
from pallasite.reference import inputs as ref_inputs
from pallasite.reference import quantization
from pallasite.tuning import Benchmark


def synthetic_inputs(dims: Mapping[str, int], dtype, seed: int = 0):
    """(x [m,k], kernel [g,k,n], group_sizes [g], dy [m,n]) for dims m, k, n, g."""
    m, k, n, g = dims["m"], dims["k"], dims["n"], dims["g"]
    x, kernel, group_sizes = ref_inputs.grouped_projection_inputs(jax.random.key(seed), m, k, n, g, dtype)
    dy = jax.random.normal(jax.random.key(seed + 1), (m, n), dtype)
    return x, kernel, group_sizes, dy


def sample_rows(group_sizes: np.ndarray, count: int = 48) -> np.ndarray:
    """Each of a few groups' first and last rows plus random rows: where tiles meet groups."""
    ends = np.cumsum(group_sizes)
    starts = ends - group_sizes
    edges = [int(r) for s, e in zip(starts, ends) if e > s for r in (s, e - 1)][: count // 2]
    rng = np.random.default_rng(7)
    rand = rng.integers(0, max(int(ends[-1]), 1), count - len(edges)).tolist()
    return np.asarray(sorted(set(edges + rand)), np.int32)


def exact_rows(lhs, weight_of: Callable[[int], jax.Array], rows: np.ndarray, group_sizes: np.ndarray):
    """out[r] = lhs[r] @ weight_of(group(r)) with exact bf16 products summed in fp32."""
    groups = np.searchsorted(np.cumsum(group_sizes), rows, side="right")
    picked = lhs[jnp.asarray(rows)]
    out = None
    for gi in np.unique(groups):
        full = jnp.dot(picked, weight_of(int(gi)), preferred_element_type=jnp.float32,
                       precision=jax.lax.Precision.HIGHEST)
        out = full if out is None else jnp.where(jnp.asarray(groups == gi)[:, None], full, out)
    return out


def _as_multiplied(backend: ModuleType, product: str, x, kernel, gs, dy):
    """(lhs, group i's kernel, dy) as the backend's products multiply them: an fp8
    backend's (a module named *_fp8) after the block quantization (the oracle's), so that
    its reference checks the sums, not the quantization error. The kernel is quantized a
    group at a time, for the groups the check reads: DeepSeek-V3's whole kernel in fp32
    is 15 GB."""
    if not backend.__name__.endswith("_fp8"):
        return x, (lambda i: kernel[i]), dy
    if product == "dkernel":
        return (quantization.quantized_tokens(x, gs), lambda i: kernel[i],
                quantization.quantized_tokens(dy, gs))
    return (quantization.quantized_rows(x),
            lambda i: quantization.quantized_kernel(kernel[i:i + 1])[0],
            quantization.quantized_rows(dy))


def benchmark(backend: ModuleType, product: str, dims: Mapping[str, int], dtype="bfloat16",
              interpret: bool = False) -> Benchmark:
    """One product of `backend` (a module with gmm and tgmm taking block_sizes=), checked.

    product: 'forward' (x @ kernel), 'dx' (dy @ kernel^T, gmm with transpose_rhs) or
    'dkernel' (tgmm(x, dy), checked on the largest and the smallest non-empty group).
    """
    x, kernel, gs, dy = synthetic_inputs(dims, dtype)
    xr, kernel_of, dyr = _as_multiplied(backend, product, x, kernel, gs, dy)
    gs_np = np.asarray(gs)
    rows = sample_rows(gs_np)
    rows_j = jnp.asarray(rows)
    g = dims["g"]
    if product == "dkernel":
        ends = np.cumsum(gs_np)
        picks = sorted({int(np.argmax(gs_np)), int(np.argmin(np.where(gs_np > 0, gs_np, ends[-1] + 1)))})

        def build(cfg):
            f = jax.jit(lambda a, b, s: backend.tgmm(a, b, s, num_groups=g, out_dtype=dtype,
                                                     block_sizes=cfg, interpret=interpret)[jnp.asarray(picks)])
            return lambda: f(x, dy, gs)

        def reference():
            return jnp.stack([
                jnp.dot(xr[ends[i] - gs_np[i]:ends[i]].T, dyr[ends[i] - gs_np[i]:ends[i]],
                        preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
                for i in picks])
    else:
        transpose = product == "dx"
        lhs = dy if transpose else x  # dx = gmm(dy, kernel, transpose_rhs=True): kernel is [g, k, n]
        lhs_r = dyr if transpose else xr

        def build(cfg):
            f = jax.jit(lambda a, w, s: backend.gmm(a, w, s, transpose_rhs=transpose, out_dtype=dtype,
                                                    block_sizes=cfg, interpret=interpret)[rows_j])
            return lambda: f(lhs, kernel, gs)

        def reference():
            return exact_rows(lhs_r, (lambda i: kernel_of(i).T) if transpose else kernel_of,
                              rows, gs_np)

    # bf16 output against an fp32 reference: one rounding, 2^-8 relative, well inside 1e-2.
    return Benchmark(build=build, reference=reference, atol=0.0, rtol=1e-2, warmup=1, reps=5)


def select_block_sizes(backend: ModuleType, name: str, config_type: type, block_sizes, *,
                       product: str, dims: Mapping[str, int], dtype, default,
                       tune_here: bool):
    """The GPU backends' one way to pick a product's blocks (pallasite.tuning's order):
    the caller's (which must be `config_type` and fit: fit.check_caller), else the table /
    cache entry, else a bounded autotune with `benchmark` when `tune_here` (the kernel runs
    compiled on the backend's GPU) and the caller gave none, else `default`. Table, cache
    and candidate configs pass the backend's fit rule (fit.reason: tile sizes and, for
    Triton, the shared memory of the device's generation) or are passed over."""
    chosen = config.for_product(block_sizes, product)
    if chosen is not None and not isinstance(chosen, config_type):
        raise TypeError(f"block_sizes for {name} must be {config_type.__name__}, got {chosen!r}")
    if chosen is not None:
        fit.check_caller(name, chosen, product, dims, dtype)
    measure = None
    if chosen is None and tune_here:
        measure = lambda: benchmark(backend, product, dims, dtype)  # noqa: E731
    return tuning.select_block_sizes(
        "grouped_projection", f"{name}:{product}", device_kind=tuning.device_kind(),
        dtypes=(dtype,), shape=dims, config_type=config_type, caller=chosen, default=default,
        measure=measure,
        fits=lambda cfg, shape: fit.reason(name, cfg, product, shape, dtype) is None,
    ).config
