"""Mixtral's forward through pallasite's default Mosaic GPU gmm, JAX's own Hopper
ragged-dot example kernel and torch._grouped_mm, in one process on the same inputs.

The example (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu, jax 0.11.2) runs at the
config its own sweep found best for this shape: 192x128x64 blocks, 4 stages, snake width
8. targets.md quotes 684.5 TFLOP/s for it; this script times it the way everything else
here is timed (queued: N calls back to back, one synchronisation, time / N, median of 5)
and by CUPTI kernel time (jax.experimental.mosaic.gpu.profiler.measure, 30 iterations,
median), in three interleaved rounds, on two group splits: the bench's Dirichlet split
and the example's own (sorted uniform random boundaries). Outputs are compared with
ours (max_diff_vs_pallasite).

  OUT=FOLDER python3 tools/sweeps/grouped_forward_vs_jax_example.py

Results go to FOLDER/example.jsonl.
"""
import os
import sys

os.environ.setdefault("PALLASITE_AUTOTUNE", "0")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for pkg in ("reference", "kernels", "tuning", "bench"):
    sys.path.insert(0, os.path.join(ROOT, "packages", pkg))
sys.path.insert(0, HERE)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.mosaic.gpu import profiler  # noqa: E402
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: E402

from grouped_products_mosaic_gpu import queued  # noqa: E402
import records  # noqa: E402 - tools/sweeps/records.py, beside this script
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu  # noqa: E402
from pallasite.reference.inputs import random_group_sizes  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
M, K, N, G = 32768, 4096, 14336, 8
FLOPS = 2 * M * K * N


def emit(rec):
    records.emit(rec, OUT, "example.jsonl")


def cupti_ms(fn, *args):
    """Median over 30 calls of the longest kernel's time (the grouped kernel) and of all
    kernels' sum (with ours, the tile table's few small ones)."""
    _, per_call = profiler.measure(fn, aggregate=False, iterations=30)(*args)
    longest = np.median([max(t for _, t in call) for call in per_call])
    total = np.median([sum(t for _, t in call) for call in per_call])
    return float(longest), float(total), [name for name, _ in per_call[0]]


def main():
    import torch

    kx, kw, kg, kb = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (G, K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    bounds = jnp.sort(jax.random.randint(kb, (G - 1,), 0, M, jnp.int32))
    edges = jnp.concatenate([jnp.zeros(1, jnp.int32), bounds, jnp.full(1, M, jnp.int32)])
    splits = {"dirichlet": random_group_sizes(kg, M, G), "example_uniform": jnp.diff(edges)}
    impls = {
        "pallasite": jax.jit(lambda a, b, c: pallas_mosaic_gpu.gmm(a, b, c)),
        "jax_example_192x128_4st_gbn8": jax.jit(lambda a, b, c: ragged_dot_mgpu.ragged_dot(
            a, b, group_sizes=c, block_m=192, block_n=128, block_k=64,
            max_concurrent_steps=4, grid_block_n=8)),
    }
    tx, tw = torch.from_dlpack(x), torch.from_dlpack(w)
    for split, sizes in splits.items():
        emit({"split": split, "group_sizes": [int(v) for v in sizes]})
        ours = impls["pallasite"](x, w, sizes)
        offs = torch.cumsum(torch.from_dlpack(sizes), 0).to(torch.int32)
        for round_ in range(3):
            for name, fn in impls.items():
                diff = jnp.max(jnp.abs(fn(x, w, sizes).astype(jnp.float32) - ours.astype(jnp.float32)))
                t = queued(fn, x, w, sizes)
                longest, total, kernels = cupti_ms(fn, x, w, sizes)
                emit({"split": split, "round": round_, "impl": name,
                      "queued_ms": round(t * 1e3, 4), "queued_tflops": round(FLOPS / t / 1e12, 1),
                      "cupti_kernel_ms": round(longest, 4),
                      "cupti_kernel_tflops": round(FLOPS / (longest * 1e-3) / 1e12, 1),
                      "cupti_all_kernels_ms": round(total, 4), "kernels": kernels,
                      "max_diff_vs_pallasite": float(diff)})
            t = queued(lambda: torch._grouped_mm(tx, tw, offs=offs, out_dtype=tx.dtype),
                       sync=lambda _: torch.cuda.synchronize())
            emit({"split": split, "round": round_, "impl": "torch._grouped_mm",
                  "queued_ms": round(t * 1e3, 4), "queued_tflops": round(FLOPS / t / 1e12, 1)})


if __name__ == "__main__":
    main()
