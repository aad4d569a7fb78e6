"""Per-product times of the Mosaic GPU grouped kernels in named variants, beside
torch._grouped_mm's forward, dx and dkernel, every time by the queued method (N calls back
to back, one synchronisation, time / N; median of 5).

A variant is a "+"-joined list of changes to the product's default blocks: stagesN, gbnN
(snake width), delayN (delay_release), epiN (epilogue_block_n), bmN (block_m), bnN (block_n), pingpong
(the ping-pong kernels), coop (the cooperative warp-specialised gmm and dx instead),
onewg (the one-warpgroup kernel); or to the dkernel's boundary masks: chunkN (rows per
masked chunk) and fullmask (whole blocks in the accumulator layout, the form before
2026-12-02); "default" changes nothing.
Each variant's output is compared with the first variant's (max_diff_vs_default; the
same accumulation order gives 0.0). Two diagnostic variants compute wrong values on
purpose, to show what a part of the kernel costs: nostore (the warp-specialised kernels
store nothing) and nomask (the dkernel skips its boundary-row masks).

  OUT=FOLDER SHAPES=dsv3,mixtral VARIANTS=default,epi64+stages4 \
      [VARIANTS_DK=...] [PRODUCTS=fwd,dx,dk] [TORCH=0] \
      python3 tools/sweeps/grouped_products_mosaic_gpu.py

VARIANTS_FWD / VARIANTS_DX / VARIANTS_DK narrow VARIANTS for one product. Results go to
FOLDER/products.jsonl.
"""
import dataclasses
import os
import sys
import time

os.environ.setdefault("PALLASITE_AUTOTUNE", "0")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for pkg in ("reference", "kernels", "tuning", "bench"):
    sys.path.insert(0, os.path.join(ROOT, "packages", pkg))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

import records  # tools/sweeps/records.py, beside this script
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu as M
from pallasite.reference.inputs import random_group_sizes

OUT = os.environ.get("OUT", "/tmp")
SHAPES = {"mixtral": (32768, 4096, 14336, 8), "dsv3": (65536, 7168, 2048, 256),
          "w1408_up": (32768, 2048, 1408, 64), "w5504_up": (32768, 2048, 5504, 16),
          "qwen3": (65536, 2048, 768, 128), "olmoe": (32768, 2048, 1024, 64),
          "w1408_down": (32768, 1408, 2048, 64), "w5504_down": (32768, 5504, 2048, 16),
          "w2880": (65536, 2880, 5760, 128)}
VARIANTS = os.environ.get("VARIANTS", "default").split(",")
PRODUCTS = os.environ.get("PRODUCTS", "fwd,dx,dk").split(",")


def emit(rec):
    records.emit(rec, OUT, "products.jsonl")


def queued(fn, *args, n=None, sync=None):
    sync = sync or jax.block_until_ready
    sync(fn(*args)); sync(fn(*args))
    t0 = time.perf_counter(); sync(fn(*args)); one = time.perf_counter() - t0
    n = n or int(min(max(0.25 / max(one, 1e-5), 3), 200))
    reps = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        sync(out)
        reps.append((time.perf_counter() - t0) / n)
    return float(np.median(reps))


def _full_block_mask(step, start, size, base, bk, lhs_smem, rhs_smem):
    """The boundary masks before 2026-12-02: both whole blocks through the wgmma
    accumulator layout on every boundary step."""
    lo = start - base - step * bk
    hi = start + size - base - step * bk

    @pl.when((lo > 0) | (hi < bk))
    def _():
        for ref in (lhs_smem, rhs_smem):
            rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, ref.shape, 0),
                                     plgpu.Layout.WGMMA)
            x = ref[...]
            ref[...] = jnp.where((rows >= lo) & (rows < hi), x, jnp.zeros_like(x))
        plgpu.commit_smem()


_orig = {"mask": M._mask_outside_group, "live": M._live_half, "chunk": M._MASK_CHUNK_ROWS}


def apply(variant):
    M._mask_outside_group = _orig["mask"]
    M._live_half = _orig["live"]
    M._MASK_CHUNK_ROWS = _orig["chunk"]
    for part in variant.split("+"):
        if part.startswith("chunk"):
            M._MASK_CHUNK_ROWS = int(part[5:])
    if "fullmask" in variant:
        M._mask_outside_group = _full_block_mask
    if "nomask" in variant:
        M._mask_outside_group = lambda *a, **k: None
    if "nostore" in variant:
        M._live_half = lambda ni, wg, bs, n: ni < 0


def bs_for(variant, prod, m, k, n, g):
    product = {"fwd": "forward", "dx": "dx", "dk": "dkernel"}[prod]
    # default_block_sizes takes the projection's dims for every product (the dx's output
    # width is k) and picks each product's default from them, as gmm and tgmm do.
    bs = M.default_block_sizes(product=product, m=m, k=k, n=n, g=g)
    for part in variant.split("+"):
        if part.startswith("stages"):
            bs = dataclasses.replace(bs, stages=int(part[6:]))
        if part.startswith("gbn"):
            bs = dataclasses.replace(bs, grid_block_n=int(part[3:]))
        if part == "onewg":
            bs = dataclasses.replace(bs, warp_specialized=False, delay_release=0,
                                     epilogue_block_n=None, pingpong=False)
        if part.startswith("bn") and part[2:].isdigit():
            bs = dataclasses.replace(bs, block_n=int(part[2:]))
        if part.startswith("bm") and part[2:].isdigit():
            bs = dataclasses.replace(bs, block_m=int(part[2:]))
        if part.startswith("epi"):
            bs = dataclasses.replace(bs, epilogue_block_n=int(part[3:]))
        if part.startswith("delay"):
            bs = dataclasses.replace(bs, delay_release=int(part[5:]))
        if part == "pingpong":
            bs = dataclasses.replace(bs, warp_specialized=True, pingpong=True)
        if part == "coop":
            bs = dataclasses.replace(M.GMM_WARP_SPECIALIZED, grid_block_n=bs.grid_block_n)
    return bs


def main():
    for name in os.environ.get("SHAPES", "mixtral,dsv3").split(","):
        m, k, n, g = SHAPES[name]
        kx, kw, kd, kg = jax.random.split(jax.random.key(0), 4)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        dy = jax.random.normal(kd, (m, n), jnp.float32).astype(jnp.bfloat16)
        gs = random_group_sizes(kg, m, g)
        flops = 2 * m * k * n
        ref = {}
        for variant in VARIANTS:
            apply(variant)
            for prod in PRODUCTS:
                if any(p in variant for p in ("nomask", "fullmask", "chunk")) and prod != "dk":
                    continue
                if variant not in os.environ.get(f"VARIANTS_{prod.upper()}", ",".join(VARIANTS)).split(","):
                    continue
                bs = bs_for(variant, prod, m, k, n, g)
                if prod == "fwd":
                    fn = jax.jit(lambda a, b, c, bs=bs: M.gmm(a, b, c, block_sizes=bs)); args = (x, w, gs)
                elif prod == "dx":
                    fn = jax.jit(lambda a, b, c, bs=bs: M.gmm(a, b, c, transpose_rhs=True, block_sizes=bs)); args = (dy, w, gs)
                else:
                    fn = jax.jit(lambda a, b, c, bs=bs: M.tgmm(a, b, c, num_groups=g, block_sizes=bs)); args = (x, dy, gs)
                try:
                    t = queued(fn, *args)
                    rec = {"shape": name, "variant": variant, "product": prod, "bs": str(bs),
                           "ms": round(t * 1e3, 4), "tflops": round(flops / t / 1e12, 1)}
                    if "no" not in variant:
                        out = fn(*args)
                        if prod in ref:
                            rec["max_diff_vs_default"] = float(jnp.max(jnp.abs(
                                out.astype(jnp.float32) - ref[prod].astype(jnp.float32))))
                        else:
                            ref[prod] = out
                    emit(rec)
                except Exception as e:  # noqa: BLE001
                    emit({"shape": name, "variant": variant, "product": prod, "error": str(e)[:600]})
        apply("default")
        if os.environ.get("TORCH", "1") == "1":
            import torch
            tx = torch.from_dlpack(x); tw = torch.from_dlpack(w); tdy = torch.from_dlpack(dy)
            offs = torch.cumsum(torch.from_dlpack(gs), 0).to(torch.int32)
            sync = lambda o: torch.cuda.synchronize()
            calls = {"fwd": lambda: torch._grouped_mm(tx, tw, offs=offs, out_dtype=tx.dtype),
                     "dx": lambda: torch._grouped_mm(tdy, tw.transpose(-2, -1), offs=offs, out_dtype=tx.dtype),
                     "dk": lambda: torch._grouped_mm(tx.t(), tdy, offs=offs, out_dtype=tx.dtype)}
            for prod in PRODUCTS:
                try:
                    t = queued(calls[prod], sync=sync)
                    emit({"shape": name, "variant": "torch", "product": prod,
                          "ms": round(t * 1e3, 4), "tflops": round(flops / t / 1e12, 1)})
                except Exception as e:  # noqa: BLE001
                    emit({"shape": name, "variant": "torch", "product": prod, "error": str(e)[:600]})
        del x, w, dy, ref


if __name__ == "__main__":
    main()
