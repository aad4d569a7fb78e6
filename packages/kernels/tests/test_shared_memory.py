"""Defaults, tuned-table entries and autotune candidates fit the shared memory of every GPU
generation they can be used on (sm80 163 KiB, sm86/sm89 99 KiB, sm90 227 KiB), and the
kernels lower for CUDA with the blocks chosen for an sm80 and an sm89 device (JAX knows
the A100 and the L4 as abstract devices).

JAX lowers a Triton kernel to Triton IR for any GPU; the shared memory a config needs is
only checked when XLA compiles it on the device. So the fit is checked here against
each backend's model of its footprint (grouped_matmul.triton_fit,
ssd.predicates.triton_program_bytes), on faked devices of each generation.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

from cuda_export_testlib import TRITON_CALL, cuda_module
from pallasite import tuning
from pallasite.kernels import grouped_projection, platform
from pallasite.kernels.grouped_matmul import config, pallas_triton, triton_fit
from pallasite.kernels.ssd import pallas_triton as ssd_triton
from pallasite.kernels.ssd import predicates as ssd_predicates
from pallasite.tuning import config_from_dict, load_table


@dataclasses.dataclass
class FakeGpu:
    device_kind: str
    compute_capability: str
    platform: str = "gpu"


GPUS = {
    "sm80": FakeGpu("NVIDIA A100-SXM4-80GB", "8.0"),
    "sm86": FakeGpu("NVIDIA A10", "8.6"),
    "sm89": FakeGpu("NVIDIA L4", "8.9"),
    "sm90": FakeGpu("NVIDIA H200", "9.0"),
}
KIB = {"sm80": 163, "sm86": 99, "sm89": 99, "sm90": 227}
# The device kinds the tuned tables hold entries for, and their generation.
TABLE_KINDS = {"nvidia h200": "sm90"}
GP_PRODUCTS = ("forward", "dx", "dkernel")
GP_SHAPES = [dict(m=65536, k=2048, n=768, g=128), dict(m=32768, k=4096, n=14336, g=8)]


def _budget(generation):
    return platform.triton_shared_memory_budget(GPUS[generation])


def test_shared_memory_per_generation():
    for generation, kib in KIB.items():
        assert platform.device_generation(GPUS[generation]) == generation
        assert platform.shared_memory_bytes(GPUS[generation]) == kib * 1024
    assert platform.shared_memory_bytes(jax.devices("cpu")[0]) is None
    # Off CUDA (the interpreter, a lowering for an unknown GPU): what every GPU has.
    assert platform.triton_shared_memory_budget(jax.devices("cpu")[0]) == 99 * 1024
    assert platform.shared_memory_bytes(FakeGpu("NVIDIA future", "11.0")) == 99 * 1024


def test_the_h200_tile_needs_144_kib():
    assert triton_fit.shared_memory_bytes(pallas_triton.GMM_16BIT, 2, "forward") == 144 * 1024


def test_fp8_candidates_parse_and_fit():
    """The fp8 keys' search spaces: every Triton candidate passes the fp8 tile rules and
    fits sm90's shared memory, some fit sm89's too (the fit rule passes over the others
    there), and every Mosaic GPU one is a valid MosaicGpuFp8BlockSizes; each list is
    non-empty, for each product."""
    from pallasite.kernels.grouped_matmul import fit, pallas_mosaic_gpu_fp8

    table = load_table("grouped_projection")
    for product in GP_PRODUCTS:
        triton = table.candidates_for(f"pallas_triton_fp8:{product}")
        mosaic = table.candidates_for(f"pallas_mosaic_gpu_fp8:{product}")
        assert triton and mosaic, product
        cands = [config_from_dict(config.TritonBlockSizes, raw) for raw in triton]
        for bs in cands:  # the tile rules (block_k one scale step, ...) and sm90's memory
            assert triton_fit.fits(bs, 1, product, _budget("sm90")), (product, bs)
            why = fit.triton_fp8_reason(bs, product, GP_SHAPES[1], jnp.bfloat16)
            assert why is None or "shared memory" in why, (product, bs, why)
        assert any(triton_fit.fits(bs, 1, product, _budget("sm89")) for bs in cands)
        for raw in mosaic:
            config_from_dict(pallas_mosaic_gpu_fp8.MosaicGpuFp8BlockSizes, raw)


@pytest.mark.parametrize("generation", sorted(GPUS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_grouped_triton_defaults_fit(generation, dtype):
    itemsize = jnp.dtype(dtype).itemsize
    for product, dims in itertools.product(GP_PRODUCTS, GP_SHAPES):
        bs = pallas_triton.default_block_sizes(product=product, dtype=dtype,
                                               device=GPUS[generation], **dims)
        assert triton_fit.fits(bs, itemsize, product, _budget(generation)), (product, bs)


def test_grouped_triton_default_follows_the_generation():
    pick = lambda gen: pallas_triton.default_block_sizes(  # noqa: E731
        product="forward", dtype=jnp.bfloat16, device=GPUS[gen], **GP_SHAPES[0])
    assert pick("sm90") == pick("sm80") == pallas_triton.GMM_16BIT
    assert pick("sm89") == pick("sm86") == pallas_triton.GMM_16BIT_99K


def _entries(op):
    table = load_table(op)
    return table, [e for e in table.entries if e.implementation.startswith("pallas_triton")]


def test_table_entries_fit_their_device():
    table, entries = _entries("grouped_projection")
    for entry in entries:
        generation = TABLE_KINDS[entry.device_kind.casefold()]
        bs = config_from_dict(config.TritonBlockSizes, entry.config)
        product = entry.implementation.split(":")[1]
        itemsize = max(jnp.dtype(d).itemsize for d in entry.dtypes)
        assert triton_fit.fits(bs, itemsize, product, _budget(generation)), entry
    _, ssd_entries = _entries("ssd")
    for entry in ssd_entries:
        generation = TABLE_KINDS[entry.device_kind.casefold()]
        bs = config_from_dict(ssd_triton.BlockSizes, entry.config)
        assert ssd_triton.fits(bs, 64, 128, GPUS[generation]), entry


def test_grouped_candidates_used_only_where_they_fit(monkeypatch):
    """Every bf16 candidate fits sm90, whose tables they were written for; elsewhere the
    backend's `fits` rule (given to the tuner) refuses exactly those that do not fit."""
    table = load_table("grouped_projection")
    for product in GP_PRODUCTS:
        raw = table.candidates_for(f"pallas_triton:{product}")
        cands = [config_from_dict(config.TritonBlockSizes, c) for c in raw]
        assert cands
        assert all(triton_fit.fits(c, 2, product, _budget("sm90")) for c in cands), product
        for generation, dtype in itertools.product(GPUS, (jnp.bfloat16, jnp.float32)):
            monkeypatch.setattr(platform, "_default_device", lambda g=generation: GPUS[g])
            seen = {}

            def spy(op, implementation, **kw):
                seen.update(kw)
                return tuning.Selection(kw["default"], "default")

            monkeypatch.setattr(tuning, "select_block_sizes", spy)
            pallas_triton.resolve_block_sizes(None, product=product, dtype=dtype,
                                              **GP_SHAPES[0])
            itemsize = jnp.dtype(dtype).itemsize
            for c in cands:
                want = triton_fit.shared_memory_bytes(c, itemsize, product) <= \
                    KIB[generation] * 1024
                assert seen["fits"](c, GP_SHAPES[0]) is want, (generation, product, c)
            assert seen["fits"](seen["default"], GP_SHAPES[0])


@pytest.mark.parametrize("generation", sorted(GPUS))
@pytest.mark.parametrize("head_dim,state", [(64, 128), (128, 128), (64, 64)])
def test_ssd_defaults_admission_and_candidates_fit(generation, head_dim, state):
    device = GPUS[generation]
    default = ssd_triton.default_block_sizes(head_dim, state, device)
    assert ssd_triton.fits(default, head_dim, state, device)
    # Admitted where a program of the smallest admitted block fits.
    smallest = ssd_predicates.triton_program_bytes(head_dim, state,
                                                   ssd_predicates.TRITON_MIN_BLOCK_M)
    assert ssd_predicates.ssd_kernel_runs(256, head_dim, state, "pallas_triton", device) is (
        smallest <= KIB[generation] * 1024)
    table = load_table("ssd")
    for pass_name in ("forward", "backward"):
        for raw in table.candidates_for(f"pallas_triton:{pass_name}"):
            bs = config_from_dict(ssd_triton.BlockSizes, raw)
            need = ssd_predicates.triton_program_bytes(head_dim, state, bs.block_m,
                                                       bs.num_stages, heads=bs.heads)
            assert ssd_triton.fits(bs, head_dim, state, device) is (
                need <= KIB[generation] * 1024)


def test_ssd_admission_follows_the_generation():
    """p=64, n=128 (the targets rows): the default's 104 KiB fits sm80 and sm90; sm89 runs
    32-row blocks. p=128, n=256 needs 140 KiB even then: refused on sm86/sm89 only."""
    assert ssd_triton.default_block_sizes(64, 128, GPUS["sm90"]) == ssd_triton.DEFAULT_BLOCK_SIZES
    assert ssd_triton.default_block_sizes(64, 128, GPUS["sm80"]) == ssd_triton.DEFAULT_BLOCK_SIZES
    assert ssd_triton.default_block_sizes(64, 128, GPUS["sm89"]).block_m == 32
    runs = {g: ssd_predicates.ssd_kernel_runs(256, 128, 256, "pallas_triton", GPUS[g])
            for g in GPUS}
    assert runs == {"sm80": True, "sm86": False, "sm89": False, "sm90": True}
    why = ssd_predicates.ssd_kernel_reason(256, 128, 256, "pallas_triton", GPUS["sm89"])
    assert "budget 101376" in why


# ---------------------------------------------- lowering for abstract sm80 / sm89 GPUs


def _spy_selections(monkeypatch):
    chosen = []
    real = tuning.select_block_sizes

    def spy(op, implementation, **kw):
        sel = real(op, implementation, **kw)
        chosen.append((implementation, sel.config))
        return sel

    monkeypatch.setattr(tuning, "select_block_sizes", spy)
    return chosen


@pytest.mark.parametrize("generation", ["sm80", "sm89"])
def test_grouped_projection_lowers_for_an_abstract_gpu(monkeypatch, generation):
    device = GPUS[generation]
    monkeypatch.setattr(platform, "_default_device", lambda: device)
    chosen = _spy_selections(monkeypatch)
    specs = (jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16),
             jax.ShapeDtypeStruct((8, 1024, 768), jnp.bfloat16),
             jax.ShapeDtypeStruct((8,), jnp.int32))

    def loss(x, w, s):
        return jnp.sum(grouped_projection(x, w, s, jnp.bfloat16).astype(jnp.float32) ** 2)

    text = cuda_module(jax.value_and_grad(loss, argnums=(0, 1)), *specs,
                       device_kind=device.device_kind)
    assert text.count(TRITON_CALL) == 3
    assert {impl for impl, _ in chosen} == {f"pallas_triton:{p}" for p in GP_PRODUCTS}
    for impl, bs in chosen:
        assert triton_fit.fits(bs, 2, impl.split(":")[1], KIB[generation] * 1024), (impl, bs)


@pytest.mark.parametrize("generation", ["sm80", "sm89"])
def test_ssd_lowers_for_an_abstract_gpu(monkeypatch, generation):
    device = GPUS[generation]
    monkeypatch.setattr(platform, "_default_device", lambda: device)
    chosen = _spy_selections(monkeypatch)
    S = jax.ShapeDtypeStruct
    x, a = S((1, 2, 256, 4, 64), jnp.bfloat16), S((1, 2, 256, 4), jnp.float32)
    b, s0 = S((1, 2, 256, 2, 128), jnp.bfloat16), S((1, 4, 64, 128), jnp.float32)
    st = S((1, 2, 4, 64, 128), jnp.float32)
    for fn, args in ((ssd_triton.forward, (x, a, b, b, s0)),
                     (ssd_triton.backward, (x, a, b, b, st, x, s0))):
        assert TRITON_CALL in cuda_module(fn, *args, device_kind=device.device_kind)
    assert len(chosen) == 2
    for _, bs in chosen:
        assert ssd_triton.fits(bs, 64, 128, device)
    assert chosen[0][1].block_m == (64 if generation == "sm80" else 32)
