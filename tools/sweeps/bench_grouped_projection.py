"""H200 benchmark of grouped_projection's Pallas Triton path vs jax.lax.ragged_dot.

Usage (on a GPU machine, repo root): python3 tools/sweeps/bench_grouped_projection.py FOLDER
Writes FOLDER/grouped_projection_bench.jsonl (one record per measurement, flushed as it goes,
so a timeout still leaves what was measured) and prints a summary.

Shapes: docs/targets.md (mixtral, dsv3, qwen3, olmoe), bf16, group sizes a seeded
Dirichlet(4.0) split of m. Each Triton block config is timed per product (forward gmm,
dx gmm with the kernel transposed, dkernel tgmm) through the backend functions under jit;
then forward and forward+backward through the public API with the best config per
product, and jax.lax.ragged_dot (forward; forward+backward by autodiff) in the same
process. Times: median of timed runs after warm-up, each synchronised.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

# Time the configs named here (or the table/defaults), never an autotune on a miss.
os.environ.setdefault("PALLASITE_AUTOTUNE", "0")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _pkg in ("reference", "kernels", "tuning", "bench"):
    sys.path.insert(0, os.path.join(_ROOT, "packages", _pkg))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import records  # noqa: E402 - tools/sweeps/records.py, beside this script
from pallasite.bench import harness  # noqa: E402
from pallasite.kernels.grouped_matmul import grouped_projection  # noqa: E402
from pallasite.kernels.grouped_matmul import pallas_triton as pt  # noqa: E402
from pallasite.kernels.grouped_matmul.config import (  # noqa: E402
    GroupedProjectionBlockSizes,
    TritonBlockSizes,
)
from pallasite.reference.inputs import random_group_sizes  # noqa: E402

SHAPES = {  # name: (m, k, n, g)
    "mixtral": (32768, 4096, 14336, 8),
    "dsv3": (65536, 7168, 2048, 256),
    "qwen3": (65536, 2048, 768, 128),
    "olmoe": (32768, 2048, 1024, 64),
}
# Run 1 (2026-11-30) tried (128,128,64,w4,s4) and (128,256,64,w8,s3) for gmm, (64,128,128,
# w4,s3) and (128,128,128,w8,s3) for tgmm; the winners stay, beside two new variants each.
CONFIGS = {
    "forward": [
        TritonBlockSizes(128, 256, 64, 8, 8, 3),
        TritonBlockSizes(128, 256, 64, 8, 8, 4),
        TritonBlockSizes(64, 256, 64, 8, 4, 4),
    ],
    "dkernel": [
        TritonBlockSizes(64, 128, 128, 1, 4, 3),
        TritonBlockSizes(64, 256, 128, 1, 8, 3),
        TritonBlockSizes(32, 128, 128, 1, 4, 4),
    ],
}
CONFIGS["dx"] = CONFIGS["forward"]
# XLA's forward+backward takes ~25 s per shape to compile and run out of memory on two of
# four shapes; BENCH_PEER_BACKWARD=0 skips it (a sweep run), 1 measures it.
PEER_BACKWARD = os.environ.get("BENCH_PEER_BACKWARD", "1") == "1"


def timeit(fn, *args, warmup=1, runs=5):
    """Seconds per call by the bench harness's queued method (N calls back to back, one
    synchronisation; median over `runs` samples)."""
    return harness.steady_state(lambda _: fn(*args), [None], harness.jax_sync, compile_s=0.0,
                                warmup=warmup, samples=runs).median_s


def record(folder, **fields):
    fields["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    fields["device"] = jax.devices()[0].device_kind
    records.emit(fields, folder, "grouped_projection_bench.jsonl")


def product_fn(product, bs, g):
    if product == "forward":
        return jax.jit(lambda x, w, gs, dy: pt.gmm(x, w, gs, out_dtype=x.dtype, block_sizes=bs))
    if product == "dx":
        return jax.jit(lambda x, w, gs, dy: pt.gmm(dy, w, gs, transpose_rhs=True,
                                                    out_dtype=x.dtype, block_sizes=bs))
    return jax.jit(lambda x, w, gs, dy: pt.tgmm(x, dy, gs, num_groups=g, out_dtype=w.dtype,
                                                 block_sizes=bs))


def bench_shape(folder, name, m, k, n, g):
    key = jax.random.key(0)
    kx, kw, kg, kd = jax.random.split(key, 4)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    gs = random_group_sizes(kg, m, g, alpha=4.0)
    dy = jax.random.normal(kd, (m, n), jnp.bfloat16)
    flops = 2 * m * k * n
    best = {}
    for product, configs in CONFIGS.items():
        for bs in configs:
            try:
                t = timeit(product_fn(product, bs, g), x, w, gs, dy)
                record(folder, shape=name, impl="pallas_triton", product=product,
                       block_sizes=str(bs), ms=t * 1e3, tflops=flops / t / 1e12)
                if product not in best or t < best[product][0]:
                    best[product] = (t, bs)
            except Exception as e:  # noqa: BLE001 - record and go on
                record(folder, shape=name, impl="pallas_triton", product=product,
                       block_sizes=str(bs), error=f"{type(e).__name__}: {str(e)[:300]}")
    blocks = GroupedProjectionBlockSizes(**{p: b for p, (t, b) in best.items()})

    ours = lambda x, w: grouped_projection(x, w, gs, jnp.bfloat16,  # noqa: E731
                                           implementation="pallas_triton", block_sizes=blocks)
    peer = lambda x, w: jax.lax.ragged_dot(  # noqa: E731
        x, w, gs, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    ref_y = None
    for impl, f in (("xla_ragged_dot", peer), ("pallas_triton", ours)):
        fwd = jax.jit(f)
        fwdbwd = jax.jit(lambda x, w, dy, f=f: jax.vjp(f, x, w)[1](dy) + (f(x, w),))
        for mode, fn, args, fl in (("forward", fwd, (x, w), flops),
                                   ("forward+backward", fwdbwd, (x, w, dy), 3 * flops)):
            if impl != "pallas_triton" and mode != "forward" and not PEER_BACKWARD:
                continue
            try:
                t = timeit(fn, *args)
                err = None
                if mode == "forward":
                    y = fn(*args).astype(jnp.float32)
                    if ref_y is None:
                        ref_y = y
                    else:
                        err = float(jnp.max(jnp.abs(y - ref_y)) / jnp.max(jnp.abs(ref_y)))
                    del y
                record(folder, shape=name, impl=impl, product=mode,
                       block_sizes=str(blocks) if impl == "pallas_triton" else None,
                       ms=t * 1e3, tflops=fl / t / 1e12, max_rel_err_vs_xla=err)
            except Exception as e:  # noqa: BLE001 - XLA runs out of memory on dsv3
                record(folder, shape=name, impl=impl, product=mode,
                       error=f"{type(e).__name__}: {str(e)[:300]}")


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SHAPES)
    for name in names:
        try:
            bench_shape(out_dir, name, *SHAPES[name])
        except Exception:  # noqa: BLE001
            record(out_dir, shape=name, error=traceback.format_exc()[-500:])


if __name__ == "__main__":
    main()
