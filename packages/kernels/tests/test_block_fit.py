"""Every block config is checked against its backend's fit rule before use: the caller's
(a ValueError naming it), the tuned table's and the autotune cache's (passed over, logged,
re-tuned where tuning runs), and unreadable cache files of any kind are misses."""

from __future__ import annotations

import logging
import types

import jax.numpy as jnp
import pytest

from pallasite import tuning
from pallasite.kernels import platform
from pallasite.kernels.grouped_matmul import (
    GroupedProjectionBlockSizes,
    MosaicTpuBlockSizes,
    TritonBlockSizes,
    fit,
    grouped_projection,
    pallas_triton,
    triton_fit,
)
from pallasite.kernels.ssd import predicates
from pallasite.kernels.ssd import pallas_triton as ssd_triton
from pallasite.tuning import cache, configs, tables
from pallasite.tuning import select as select_module

HUGE = 2 ** 20
H200 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0")
L4 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA L4", compute_capability="8.9")
DIMS = {"m": 48, "k": 32, "n": 40, "g": 3}


def _inputs():
    x = jnp.ones((DIMS["m"], DIMS["k"]), jnp.float32)
    kernel = jnp.ones((DIMS["g"], DIMS["k"], DIMS["n"]), jnp.float32)
    return x, kernel, jnp.asarray([10, 20, 18], jnp.int32)


@pytest.mark.parametrize("blocks", [
    TritonBlockSizes(HUGE, HUGE, HUGE),
    TritonBlockSizes(128, 256, 64, num_stages=64),
    GroupedProjectionBlockSizes(dkernel=TritonBlockSizes(16, 16, HUGE)),
    MosaicTpuBlockSizes(tm=HUGE, tk=128, tn=128),
], ids=["huge", "too_many_stages", "dkernel_huge", "tpu_huge"])
def test_a_caller_config_that_does_not_fit_is_named(blocks, monkeypatch):
    """Checked before any backend runs (the XLA one is named), as on an sm90 GPU (whose
    shared memory, from platform, a caller's config is held to)."""
    monkeypatch.setattr(platform, "_default_device", lambda: H200)
    x, kernel, sizes = _inputs()
    with pytest.raises(ValueError, match="block_sizes .* does not fit"):
        grouped_projection(x, kernel, sizes, jnp.float32, implementation="xla",
                           block_sizes=blocks)


def test_triton_shared_memory_budgets(monkeypatch):
    """One footprint model (triton_fit) and platform's budgets: pallasite's own choices fit
    every GPU off CUDA (99 KiB), a caller's config has no shared-memory limit there (only
    the interpreter runs it); on a device both are its own."""
    dims = {"m": 4096, "k": 1024, "n": 1024, "g": 8}
    h200_tile = pallas_triton.GMM_16BIT  # 144 KiB in bf16
    assert triton_fit.shared_memory_bytes(h200_tile, 2, "forward") == 144 * 1024
    assert "shared memory" in fit.reason("pallas_triton", h200_tile, "forward", dims,
                                         jnp.bfloat16)
    assert fit.reason("pallas_triton", h200_tile, "forward", dims, jnp.bfloat16,
                      caller=True) is None
    for device, fits in ((H200, True), (L4, False)):
        monkeypatch.setattr(platform, "_default_device", lambda d=device: d)
        for caller in (False, True):
            why = fit.reason("pallas_triton", h200_tile, "forward", dims, jnp.bfloat16,
                             caller=caller)
            assert (why is None) is fits, (device, caller, why)


def test_configs_that_fit_pass():
    assert fit.reason("pallas_triton", TritonBlockSizes(16, 64, 32), "forward", DIMS,
                      jnp.float32) is None
    assert fit.reason("pallas_triton", TritonBlockSizes(64, 32, 64), "dx", DIMS,
                      jnp.float32) is None
    assert fit.reason("pallas_mosaic_tpu", MosaicTpuBlockSizes(), "dkernel", DIMS,
                      jnp.bfloat16) is None


@pytest.fixture
def fake_gpu_cache(tmp_path, monkeypatch):
    """A fresh cache directory and a device kind no table entry names."""
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(tuning, "device_kind", lambda: "fake gpu")
    monkeypatch.setattr(select_module, "_memo", {})
    monkeypatch.setattr(select_module, "_failed", {})
    return tmp_path


def _key(op, implementation, shape, dtype):
    table = tables.load_table(op)
    bucket = (table.bucket_of(shape) if table else None) or tables.exact_bucket(
        shape, table.dims if table else None)
    return cache.CacheKey(op, implementation, "fake gpu", (dtype,), bucket)


def _store(key, config):
    cache.write(cache.CacheEntry(key=key, status=cache.OK, config=config,
                                 config_fields=configs.config_fields(type(config) if not
                                                                     isinstance(config, dict)
                                                                     else TritonBlockSizes),
                                 candidates_digest="x"))


def test_a_cached_config_that_does_not_fit_is_passed_over(fake_gpu_cache, caplog):
    """A cached block_m = block_n = block_k = 2**20 is never used: the default is."""
    key = _key("grouped_projection", "pallas_triton:forward", DIMS, "float32")
    _store(key, configs.config_to_dict(TritonBlockSizes(HUGE, HUGE, HUGE)))
    with caplog.at_level(logging.WARNING):
        got = pallas_triton.resolve_block_sizes(None, product="forward", dtype=jnp.float32,
                                                **DIMS)
    assert got == pallas_triton.default_block_sizes(product="forward", dtype=jnp.float32, **DIMS)
    assert "passed over" in caplog.text


@pytest.mark.parametrize("group_m", [8.0, 1.5, "8", True])
def test_a_cached_field_of_the_wrong_type_is_passed_over(fake_gpu_cache, caplog, group_m):
    """group_m 8.0 passes the rebuild and the fit rule but fails inside the Triton kernel's
    index arithmetic: every field is checked against its declared type, so it is a miss."""
    key = _key("grouped_projection", "pallas_triton:forward", DIMS, "float32")
    _store(key, {**configs.config_to_dict(TritonBlockSizes(16, 16, 16)), "group_m": group_m})
    with caplog.at_level(logging.WARNING):
        got = pallas_triton.resolve_block_sizes(None, product="forward", dtype=jnp.float32,
                                                **DIMS)
    assert got == pallas_triton.default_block_sizes(product="forward", dtype=jnp.float32, **DIMS)
    assert "passed over" in caplog.text and "group_m" in caplog.text


@pytest.mark.parametrize("payload", ["[" * 100000 + "]" * 100000,
                                     '{"format": 1, "key": ' + "[" * 50000 + "]" * 50000 + "}",
                                     "\x00\xff\xfe", "", '{"format": 1}'],
                         ids=["nested_list", "nested_key", "binary", "empty", "partial"])
def test_unreadable_cache_files_are_misses(fake_gpu_cache, payload):
    key = _key("grouped_projection", "pallas_triton:forward", DIMS, "float32")
    (fake_gpu_cache / key.filename()).write_bytes(payload.encode("latin-1"))
    assert cache.read(key) is None
    got = pallas_triton.resolve_block_sizes(None, product="forward", dtype=jnp.float32, **DIMS)
    assert got == pallas_triton.default_block_sizes(product="forward", dtype=jnp.float32, **DIMS)


def test_a_deeply_nested_cached_config_is_passed_over(fake_gpu_cache):
    """A well-formed entry whose config nests 100000 lists deep: a miss, not a
    RecursionError."""
    key = _key("grouped_projection", "pallas_triton:forward", DIMS, "float32")
    _store(key, {"block_m": 16})
    path = fake_gpu_cache / key.filename()
    text = path.read_text()
    assert '"block_m": 16' in text
    path.write_text(text.replace('"block_m": 16', '"block_m": ' + "[" * 100000 + "]" * 100000))
    got = pallas_triton.resolve_block_sizes(None, product="forward", dtype=jnp.float32, **DIMS)
    assert got == pallas_triton.default_block_sizes(product="forward", dtype=jnp.float32, **DIMS)


def test_a_table_entry_that_does_not_fit_is_passed_over(caplog):
    table = tables.parse_table({
        "format": 1, "op": "toy", "buckets": {"m": [["any", 0, None]]},
        "entries": [{"implementation": "impl", "device_kind": "d", "dtypes": ["float32"],
                     "bucket": {"m": "any"}, "config": {"block_m": HUGE}}]})
    with caplog.at_level(logging.WARNING):
        sel = tuning.select_block_sizes(
            "toy", "impl", device_kind="d", dtypes=("float32",), shape={"m": 48},
            config_type=TritonBlockSizes, default=TritonBlockSizes(), table=table,
            fits=lambda cfg, shape: cfg.block_m <= shape["m"], cache_directory="/nonexistent")
    assert sel.source == "default" and "passed over" in sel.detail
    assert "passed over" in caplog.text


# ------------------------------------------------------------------------- SSD


def test_ssd_caller_config_that_does_not_fit_is_named():
    x = jnp.ones((1, 64, 2, 16), jnp.float32)
    a = -jnp.ones((1, 64, 2), jnp.float32)
    b = jnp.ones((1, 64, 1, 16), jnp.float32)
    s0 = jnp.zeros((1, 2, 16, 16), jnp.float32)
    ch = lambda t: t.reshape(1, 1, 64, *t.shape[2:])  # noqa: E731
    with pytest.raises(ValueError, match="block_sizes .* does not fit"):
        ssd_triton.forward(ch(x), ch(a), ch(b), ch(b), s0, interpret=True,
                           block_sizes=ssd_triton.BlockSizes(block_m=HUGE))


def test_ssd_fit_rule():
    ok = ssd_triton.BlockSizes()
    assert predicates.triton_block_sizes_reason(ok, 64, 16, 16) is None
    for bad in (ssd_triton.BlockSizes(block_m=HUGE), ssd_triton.BlockSizes(block_t=24),
                ssd_triton.BlockSizes(num_warps=3), ssd_triton.BlockSizes(num_stages=0)):
        assert predicates.triton_block_sizes_reason(bad, 64, 16, 16) is not None
    assert predicates.triton_block_sizes_reason(ok, 64, 256, 256) is not None  # memory


def test_ssd_fit_budgets(monkeypatch):
    """p=64, n=128 at 64-row blocks: 104 KiB in bf16, 208 KiB in fp32. Off CUDA pallasite's
    own choice fits every GPU (99 KiB: refused) while a caller's blocks have no limit; on
    an H200 (227 KiB) both widths fit, on an L4 (99 KiB) neither does. Two heads per output
    program (the default) need 128 KiB in bf16 and 256 KiB in fp32, where the default
    falls back to one."""
    ok = ssd_triton.BlockSizes(heads=1)
    assert predicates.triton_program_bytes(64, 128, 64, heads=2) == 128 * 1024
    assert predicates.triton_program_bytes(64, 128, 64, itemsize=4, heads=2) == 256 * 1024
    monkeypatch.setattr(platform, "_default_device", lambda: H200)
    assert ssd_triton.default_block_sizes(64, 128) == ssd_triton.DEFAULT_BLOCK_SIZES
    assert ssd_triton.default_block_sizes(64, 128, itemsize=4) == ok
    monkeypatch.undo()
    assert predicates.triton_program_bytes(64, 128, 64) == 104 * 1024
    assert predicates.triton_program_bytes(64, 128, 64, itemsize=4) == 208 * 1024
    assert predicates.triton_block_sizes_reason(ok, 256, 64, 128) is not None
    assert predicates.triton_block_sizes_reason(ok, 256, 64, 128, caller=True) is None
    assert ssd_triton.default_block_sizes(64, 128) == ssd_triton.SMALL_SMEM_BLOCK_SIZES
    for device, fits in ((H200, True), (L4, False)):
        monkeypatch.setattr(platform, "_default_device", lambda d=device: d)
        for itemsize in (2, 4):
            for caller in (False, True):
                why = predicates.triton_block_sizes_reason(ok, 256, 64, 128, caller=caller,
                                                           itemsize=itemsize)
                assert (why is None) is fits, (device, itemsize, caller, why)
    # Blocks are clamped to the chunk: 64-row blocks at chunk 32 cost what 32-row ones do.
    assert predicates.triton_block_sizes_reason(ok, 32, 64, 128) is None
