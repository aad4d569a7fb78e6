"""Autotune-on-miss in the GPU backends, and the benchmarks it runs (tuning_benchmarks).

A kernel whose block sizes miss the tuned table and the cache tunes itself while its
caller is traced, but only when it will run compiled on a GPU it supports: never in
interpret mode, never on a CPU or TPU, never for a caller's config. On this CPU the "GPU"
is a monkeypatched platform predicate and the candidates run through the interpreter; the
selection itself is the one a GPU would make.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite import tuning
from pallasite.kernels import platform
from pallasite.kernels.grouped_matmul import TritonBlockSizes, grouped_projection
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu, pallas_triton
from pallasite.kernels.grouped_matmul import tuning_benchmarks as gp_benchmarks
from pallasite.kernels.ssd import pallas_triton as ssd_triton
from pallasite.kernels.ssd import ssd_chunk_scan
from pallasite.kernels.ssd import tuning_benchmarks as ssd_benchmarks
from pallasite.reference.inputs import grouped_projection_inputs
from pallasite.tuning import autotune, cache
from pallasite.tuning import select as select_module
from pallasite.tuning.configs import config_to_dict

GP_DIMS = {"m": 48, "k": 32, "n": 32, "g": 3}
SSD_DIMS = {"batch": 1, "length": 64, "heads": 2, "head_dim": 16, "state": 16, "groups": 1, "chunk": 32}
SMALL = TritonBlockSizes(block_m=16, block_n=16, block_k=16, group_m=1, num_stages=1)


@pytest.fixture
def tuning_on(tmp_path, monkeypatch):
    """Autotune on (the root conftest turns it off for tests), a fresh cache, a spy on the
    selections the backends make. Returns the list of (implementation, measure, Selection)."""
    monkeypatch.setenv(cache.ENV_AUTOTUNE, "1")
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setattr(select_module, "_memo", {})
    monkeypatch.setattr(select_module, "_failed", {})
    seen = []
    real = tuning.select_block_sizes

    def spy(op, implementation, **kw):
        sel = real(op, implementation, **kw)
        seen.append((implementation, kw.get("measure"), sel))
        return sel

    monkeypatch.setattr(tuning, "select_block_sizes", spy)
    return seen


def _cache_files(tmp_path):
    return sorted((tmp_path / "cache").glob("*.json"))


def _gp_operands(dtype=jnp.float32):
    x, kernel, sizes = grouped_projection_inputs(jax.random.key(0), GP_DIMS["m"], GP_DIMS["k"],
                                                 GP_DIMS["n"], GP_DIMS["g"], dtype)
    return x, kernel, sizes


def _assert_tuned_once_then_cached(seen):
    """Each product's first selection tunes and every later one reads the cache.

    The default path traces each product more than once under jit(value_and_grad): the
    switch of lax.platform_dependent traces its branches, then differentiates them, which
    traces the custom_vjp's forward (and backward) again. Selections with source "caller"
    are the tuner's own candidate runs."""
    sources: dict[str, list[str]] = {}
    for impl, _, sel in seen:
        if sel.source != "caller":
            sources.setdefault(impl, []).append(sel.source)
    assert len(sources) == 3, sources
    for impl, got in sources.items():
        # "autotune" also when the default won: it is the first candidate timed.
        assert got[0] == "autotune" and set(got[1:]) <= {"cache"}, (impl, got)


# --------------------------------------------------------------------- the benchmarks


def _sequential(x, a, b, c, s0):
    s = np.array(s0, np.float64)
    ys = []
    for t in range(x.shape[0]):
        s = np.exp(a[t]) * s + np.outer(x[t], b[t])
        ys.append(s @ c[t])
    return np.array(ys), s


def test_ssd_numpy_matches_the_step_recurrence():
    rng = np.random.default_rng(0)
    l, p, n = 40, 3, 5
    x, b, c = rng.normal(size=(l, p)), rng.normal(size=(l, n)), rng.normal(size=(l, n))
    a = -rng.uniform(0.01, 0.5, size=l)
    s0 = rng.normal(size=(p, n))
    y, s = ssd_benchmarks.ssd_numpy(x, a, b, c, s0, block=16)  # 16 does not divide 40: a short block
    y_ref, s_ref = _sequential(x, a, b, c, s0)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s, s_ref, rtol=1e-12, atol=1e-12)


def test_sample_rows_take_group_edges():
    gs = np.array([3, 0, 5, 1], np.int32)
    rows = gp_benchmarks.sample_rows(gs, 16)
    assert {0, 2, 3, 7, 8} <= set(rows.tolist()) and rows.max() < gs.sum()


@pytest.mark.parametrize("product", ["forward", "dx", "dkernel"])
def test_gp_benchmark_passes_a_good_config_and_fails_a_wrong_one(product):
    bench = gp_benchmarks.benchmark(pallas_triton, product, GP_DIMS, "float32", interpret=True)
    r = autotune.autotune([SMALL], bench, confirm_rounds=0)
    assert [t.status for t in r.trials] == [autotune.OK], r.trials
    wrong = autotune.Benchmark(build=lambda cfg: (lambda: jax.tree.map(lambda t: t + 1, bench.build(cfg)())),
                               reference=bench.reference, atol=bench.atol, rtol=bench.rtol)
    assert autotune.autotune([SMALL], wrong).trials[0].status == autotune.WRONG_RESULT


@pytest.mark.parametrize("product", ["forward", "dx", "dkernel"])
def test_fp8_benchmark_checks_against_the_quantized_operands(product):
    """An fp8 backend's benchmark compares with the product of its quantized operands
    (the kernel quantized a group at a time): the default passes, an output off by one
    does not."""
    from pallasite.kernels.grouped_matmul import pallas_triton_fp8

    dims = dict(m=320, k=256, n=256, g=3)
    bench = gp_benchmarks.benchmark(pallas_triton_fp8, product, dims, "bfloat16",
                                    interpret=True)
    default = pallas_triton_fp8.default_block_sizes(product=product, **dims)
    r = autotune.autotune([default], bench, confirm_rounds=0)
    assert [t.status for t in r.trials] == [autotune.OK], r.trials
    wrong = autotune.Benchmark(build=lambda cfg: (lambda: bench.build(cfg)() + 1),
                               reference=bench.reference, atol=bench.atol, rtol=bench.rtol)
    assert autotune.autotune([default], wrong).trials[0].status == autotune.WRONG_RESULT


@pytest.mark.parametrize("make", [ssd_benchmarks.forward_benchmark, ssd_benchmarks.backward_benchmark])
def test_ssd_benchmarks_pass_the_default(make):
    bench = make(ssd_triton, SSD_DIMS, "float32", interpret=True)
    r = autotune.autotune([ssd_triton.BlockSizes(16, 16)], bench, confirm_rounds=0)
    assert [t.status for t in r.trials] == [autotune.OK], r.trials


# ------------------------------------------------------------------ when it tunes


def test_triton_tunes_under_jit_custom_vjp_and_shard_map_when_compiled_on_a_gpu(
        tuning_on, tmp_path, monkeypatch):
    """The public function, named backend, not interpreted, on a 'GPU': the forward (under
    jit, custom_vjp, shard_map) and dx, dkernel (the custom_vjp backward) each tune."""
    monkeypatch.setattr(platform, "triton_runs", lambda device=None: True)
    # Candidates run through the interpreter (this is a CPU); two per key: default + one.
    monkeypatch.setattr(gp_benchmarks, "benchmark",
                        functools.partial(gp_benchmarks.benchmark, interpret=True))
    monkeypatch.setattr(select_module, "ON_MISS_MAX_CANDIDATES", 2)
    x, kernel, sizes = _gp_operands()

    def loss(x, kernel):
        y = grouped_projection(x, kernel, sizes, jnp.float32, implementation="pallas_triton")
        return jnp.sum(y * y)

    # Traced (and the kernels traced for Triton), not lowered: Triton has no CPU lowering.
    jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, kernel)
    tuned = {impl: sel for impl, _, sel in tuning_on}
    assert set(tuned) == {"pallas_triton:forward", "pallas_triton:dx", "pallas_triton:dkernel"}
    for impl, sel in tuned.items():
        assert sel.source == "autotune", (impl, sel)
        # The default runs; the table's first candidate runs or, where it needs more shared
        # memory than this (CPU: any sm80+ GPU's 99 KiB) allows in fp32, is never built.
        statuses = [t.status for t in sel.tune.trials]
        assert statuses[0] == autotune.OK and len(statuses) == 2, (impl, sel.tune)
        assert statuses[1] in (autotune.OK, autotune.DOES_NOT_FIT), (impl, sel.tune)
    assert len(_cache_files(tmp_path)) == 3
    # The next trace reads the cache: nothing is timed again.
    tuning_on.clear()
    jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, kernel)
    assert {sel.source for _, _, sel in tuning_on} == {"cache"}


def test_default_path_tunes_each_product_once_under_value_and_grad(tuning_on, tmp_path,
                                                                  monkeypatch):
    """The GPU test below on this CPU: the default order (platform_dependent) on a 'GPU'
    traces each product twice under jit(value_and_grad); it tunes once per product."""
    monkeypatch.setattr(platform, "triton_runs", lambda device=None: True)
    monkeypatch.setattr(platform, "mosaic_gpu_runs", lambda device=None: False)
    monkeypatch.setattr(gp_benchmarks, "benchmark",
                        functools.partial(gp_benchmarks.benchmark, interpret=True))
    monkeypatch.setattr(select_module, "ON_MISS_MAX_CANDIDATES", 1)
    x, kernel, sizes = _gp_operands(jnp.bfloat16)

    def loss(x, kernel):
        return jnp.sum(grouped_projection(x, kernel, sizes, jnp.bfloat16).astype(jnp.float32) ** 2)

    jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(x, kernel)
    _assert_tuned_once_then_cached(tuning_on)
    assert len(_cache_files(tmp_path)) == 3


def test_ssd_tunes_on_a_miss_writes_the_cache_and_reads_it_back(tuning_on, tmp_path,
                                                               monkeypatch):
    """SSD end to end: the public chunked scan, compiled (not interpreted) on a 'GPU'
    Triton runs on, under jit(grad): the forward and the backward each tune once (the
    candidates through the interpreter, this being a CPU), each winner is written to the
    cache, the file holds it, and the next trace (in-process memory cleared) reads it
    back from disk."""
    monkeypatch.setattr(platform, "triton_runs", lambda device=None: True)
    for name in ("forward_benchmark", "backward_benchmark"):
        monkeypatch.setattr(ssd_benchmarks, name,
                            functools.partial(getattr(ssd_benchmarks, name), interpret=True))
    monkeypatch.setattr(select_module, "ON_MISS_MAX_CANDIDATES", 2)
    _, chunked, init = ssd_benchmarks.synthetic_inputs(SSD_DIMS, jnp.float32)

    def loss(x, a, b, c, s0):
        y, final = ssd_chunk_scan(x, a, b, c, s0, ("pallas_triton", False))
        return jnp.sum(y * y) + jnp.sum(final)

    def trace():
        # A fresh jit each time (a reused one may answer from its trace cache). Traced (the
        # kernels traced for Triton), not lowered: Triton has no CPU lowering.
        jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*chunked, init)

    trace()
    sources: dict[str, list[str]] = {}
    tuned = {}
    for impl, _, sel in tuning_on:
        sources.setdefault(impl, []).append(sel.source)
        if sel.source == "autotune":
            tuned[impl] = sel
    assert set(sources) == {"pallas_triton:forward", "pallas_triton:backward"}, sources
    for impl, got in sources.items():
        assert got[0] == "autotune" and set(got[1:]) <= {"cache"}, (impl, got)
        assert tuned[impl].tune.trials[0].status == autotune.OK, tuned[impl].tune
    files = _cache_files(tmp_path)
    assert len(files) == 2
    written = {}
    for path in files:
        data = json.loads(path.read_text())
        assert data["status"] == cache.OK
        written[data["key"]["implementation"]] = data["config"]
    assert written == {impl: config_to_dict(sel.config) for impl, sel in tuned.items()}

    tuning_on.clear()
    monkeypatch.setattr(select_module, "_memo", {})
    trace()
    assert {impl: sel.source for impl, _, sel in tuning_on} == {
        "pallas_triton:forward": "cache", "pallas_triton:backward": "cache"}
    for impl, _, sel in tuning_on:
        assert sel.config == tuned[impl].config and sel.detail != "in-process memo"


def test_a_failing_benchmark_falls_back_to_the_default(tuning_on, monkeypatch, caplog):
    monkeypatch.setattr(platform, "triton_runs", lambda device=None: True)

    def broken(*args, **kw):
        raise MemoryError("no room for the synthetic inputs")

    monkeypatch.setattr(gp_benchmarks, "benchmark", broken)
    x, kernel, sizes = _gp_operands()
    with caplog.at_level("WARNING", logger="pallasite.tuning.select"):
        jax.make_jaxpr(lambda x: pallas_triton.gmm(x, kernel, sizes))(x)
    ((_, measure, sel),) = tuning_on
    assert measure is not None and sel.source == "default" and "MemoryError" in sel.detail
    assert sel.config == pallas_triton.default_block_sizes(product="forward", dtype=x.dtype, **GP_DIMS)
    assert "MemoryError" in caplog.text


def test_interpret_mode_never_tunes(tuning_on, tmp_path, monkeypatch):
    """Even on a 'GPU' with tuning on: the interpreter's timings say nothing about a GPU."""
    monkeypatch.setattr(platform, "triton_runs", lambda device=None: True)
    x, kernel, sizes = _gp_operands()
    y = jax.jit(lambda x: pallas_triton.gmm(x, kernel, sizes, interpret=True))(x)
    assert np.isfinite(np.asarray(y)).all()
    jax.jit(lambda x: pallas_triton.tgmm(x, x, sizes, interpret=True))(x)
    assert {(impl, m, sel.source) for impl, m, sel in tuning_on} == {
        ("pallas_triton:forward", None, "default"), ("pallas_triton:dkernel", None, "default")}
    assert _cache_files(tmp_path) == []


def test_no_tuning_off_a_gpu_or_for_a_callers_config(tuning_on, tmp_path, monkeypatch):
    x, kernel, sizes = _gp_operands()
    # This CPU: compiled kernels traced (never run), no measure.
    jax.make_jaxpr(lambda x: pallas_triton.gmm(x, kernel, sizes))(x)
    monkeypatch.setattr(platform, "triton_runs", lambda device=None: True)
    jax.make_jaxpr(lambda x: pallas_triton.gmm(x, kernel, sizes, block_sizes=SMALL))(x)
    assert [(m, sel.source) for _, m, sel in tuning_on] == [(None, "default"), (None, "caller")]
    assert _cache_files(tmp_path) == []


def test_mosaic_gpu_and_ssd_pass_a_measure_only_when_compiled_on_their_gpu(monkeypatch):
    """Which calls would tune (the measure given to select_block_sizes), without tuning."""
    seen = []

    def record(op, implementation, **kw):
        seen.append((implementation, kw["measure"] is not None))
        return select_module.Selection(kw.get("caller") or kw["default"], "default")

    monkeypatch.setattr(tuning, "select_block_sizes", record)
    resolve = functools.partial(pallas_mosaic_gpu.resolve_block_sizes, None, product="forward",
                                dtype=jnp.bfloat16, **GP_DIMS)
    resolve(interpret=False)  # this CPU is not a Hopper GPU
    monkeypatch.setattr(platform, "mosaic_gpu_runs", lambda device=None: True)
    resolve(interpret=True)
    resolve(interpret=False)
    x = jnp.zeros((1, 2, 32, 2, 16), jnp.float32)
    b = jnp.zeros((1, 2, 32, 1, 16), jnp.float32)
    ssd = functools.partial(ssd_triton.resolve_block_sizes, None, 32, x=x, b=b)
    ssd(pass_name="forward", interpret=False)  # no Triton GPU here
    monkeypatch.setattr(platform, "triton_runs", lambda device=None: True)
    ssd(pass_name="forward", interpret=True)
    ssd(pass_name="forward", interpret=False)
    ssd(pass_name="backward", interpret=False)
    assert seen == [("pallas_mosaic_gpu:forward", False), ("pallas_mosaic_gpu:forward", False),
                    ("pallas_mosaic_gpu:forward", True), ("pallas_triton:forward", False),
                    ("pallas_triton:forward", False), ("pallas_triton:forward", True),
                    ("pallas_triton:backward", True)]


# ----------------------------------------------------------------------------- the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,g", [(4096, 512, 1024, 8), (2048, 256, 384, 16)])
def test_gpu_default_call_tunes_once_then_reads_the_cache(tuning_on, tmp_path, m, k, n, g):
    """On a real GPU, no table entry for these shapes: the default call (Mosaic GPU at
    >= 256 rows per group on Hopper, Triton otherwise) tunes forward, dx and dkernel once,
    matches the reference, and the next trace reads the cache."""
    from pallasite.reference.grouped_projection import grouped_projection as reference
    from pallasite.reference.parity import assert_close

    x, kernel, sizes = grouped_projection_inputs(jax.random.key(3), m, k, n, g, jnp.bfloat16)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2)

    ours = jax.jit(jax.value_and_grad(
        loss(lambda x, w: grouped_projection(x, w, sizes, jnp.bfloat16)), argnums=(0, 1)))
    got = ours(x, kernel)
    _assert_tuned_once_then_cached(tuning_on)
    assert len(_cache_files(tmp_path)) == 3
    ref = jax.jit(jax.value_and_grad(loss(lambda x, w: reference(
        x.astype(jnp.float32), w.astype(jnp.float32), sizes, jnp.float32,
        precision=jax.lax.Precision.HIGHEST)), argnums=(0, 1)))(x, kernel)
    assert_close(got[1][0], ref[1][0], dtype=jnp.bfloat16, what="dx")
    assert_close(got[1][1], ref[1][1], dtype=jnp.bfloat16, what="dkernel")
    tuning_on.clear()
    jax.jit(jax.value_and_grad(
        loss(lambda x, w: grouped_projection(x, w, sizes, jnp.bfloat16)),
        argnums=(0, 1))).trace(x, kernel)
    assert {sel.source for _, _, sel in tuning_on} == {"cache"}


@pytest.mark.parametrize("module", [pallas_triton, pallas_mosaic_gpu],
                         ids=["triton", "mosaic_gpu"])
def test_dx_is_keyed_by_the_projections_dims(module, monkeypatch, tmp_path):
    """dx = gmm(dy [m, n], kernel [g, k, n], transpose_rhs=True) looks up the table, the
    cache and the autotuner under the projection's (m, k, n, g), as the autotuner
    measures it: the dsv3 dx entry of the H200 table (k 7168, n 2048) reaches a default
    dx call on an (abstract) H200. Keyed by the product's own dims (k and n swapped),
    no dx entry matched a call."""
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setattr(select_module, "_memo", {})
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    monkeypatch.setattr(platform, "triton_shared_memory_budget", lambda device=None: 232448)
    seen = []
    with tuning.recording() as seen:
        m, k, n, g = 65536, 7168, 2048, 256
        dy = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
        kernel = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16)
        sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
        jax.eval_shape(lambda a, w, s: module.gmm(a, w, s, transpose_rhs=True), dy, kernel,
                       sizes)
    ((_, implementation, sel),) = seen
    assert implementation.endswith(":dx")
    if module is pallas_triton:  # the table's entry
        assert sel.source == "table", sel
        assert (sel.config.block_m, sel.config.block_n, sel.config.num_stages) == (128, 256, 4)
    else:  # no Mosaic GPU dx entry: the default for dx's output width, k = 7168
        assert sel.source == "default"
        assert sel.config == pallas_mosaic_gpu.default_block_sizes(product="dx", m=m, k=k,
                                                                   n=n, g=g)


def _assert_h200_table_picks(module, name, product, dims, expected, monkeypatch, tmp_path):
    """A default call of `product` on module (gmm / tgmm) at dims, traced for an
    (abstract) H200, selects `name:product` from the table with the `expected` fields."""
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setattr(select_module, "_memo", {})
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    m, k, n, g = dims
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    dy = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    kernel = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
    calls = {
        "forward": (lambda a, w, s: module.gmm(a, w, s), (x, kernel, sizes)),
        "dx": (lambda a, w, s: module.gmm(a, w, s, transpose_rhs=True), (dy, kernel, sizes)),
        "dkernel": (lambda a, b, s: module.tgmm(a, b, s), (x, dy, sizes)),
    }
    fn, args = calls[product]
    with tuning.recording() as seen:
        jax.eval_shape(fn, *args)
    ((_, implementation, sel),) = seen
    assert implementation == f"{name}:{product}"
    assert sel.source == "table", sel
    for field, value in expected.items():
        assert getattr(sel.config, field) == value, (field, sel.config)


@pytest.mark.parametrize("product, dims, expected", [
    ("forward", (32768, 2048, 1024, 64), {"grid_block_n": 16}),          # olmoe
    ("dx", (65536, 2880, 5760, 128), {"block_n": 192, "stages": 4}),     # k = 45 x 64
    ("dkernel", (65536, 2880, 5760, 128), {"block_m": 192, "stages": 4}),
])
def test_h200_mosaic_gpu_entries_reach_default_calls(product, dims, expected, monkeypatch,
                                                      tmp_path):
    """The Mosaic GPU entries the H200 autotune run earned (2026-12-03) are what a default
    call of each product picks on an (abstract) H200, keyed by the projection's dims."""
    _assert_h200_table_picks(pallas_mosaic_gpu, "pallas_mosaic_gpu", product, dims, expected,
                             monkeypatch, tmp_path)


@pytest.mark.parametrize("product, expected", [
    ("forward", {"stages": 3, "grid_block_n": 16}),
    ("dx", {"stages": 3, "grid_block_n": 8}),
    ("dkernel", {"stages": 4, "grid_block_n": 16}),
])
def test_h200_fp8_entries_reach_default_calls(product, expected, monkeypatch, tmp_path):
    """The fp8 Mosaic GPU entries the H200 autotune run earned at qwen3's dims
    (2026-12-04) are what a default call of each fp8 product picks on an (abstract) H200;
    the key's dtype is the operands' before quantization."""
    from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu_fp8

    _assert_h200_table_picks(pallas_mosaic_gpu_fp8, "pallas_mosaic_gpu_fp8", product,
                             (65536, 2048, 768, 128), expected, monkeypatch, tmp_path)
