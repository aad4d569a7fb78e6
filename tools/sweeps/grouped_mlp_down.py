"""grouped_mlp's down product with the row weights in the kernels' epilogues, against the
same contract composed around the grouped gmm, forward and backward, per backend.

    OUT=folder python3 tools/sweeps/grouped_mlp_down.py [--smoke] [--backends ...]

- forward: `down_weighted(h, W, sizes, weights)` (the weights scale the fp32 sums in the
  epilogue, y rounded once) against gmm(h, W) in fp32, scaled and rounded by XLA;
- backward for h: `down_weighted_grad(dy, W, sizes, weights, h)` (dh = weights * t and
  each row's sum of h * t from the tiles of t = dy W^T) against gmm(dy, W^T) in fp32 and
  the same elementwise work in XLA (t through memory).

Each fused result is checked against the composed one (max abs difference, relative to
the composed result's max), then both are timed by the bench harness's queued method on
input sets in rotation. bf16, the down products of mixtral, qwen3 and dsv3 at the bench's
routed rows (f = the expert width, n = the model width). `--smoke` runs tiny shapes
through the interpreters on a CPU. JSON lines to $OUT/grouped_mlp_down.jsonl.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import jax
import jax.numpy as jnp

import records  # tools/sweeps/records.py, beside this script
from pallasite.bench import harness

BF16, F32 = jnp.bfloat16, jnp.float32
SHAPES = {  # name: (routed rows m, expert width f, model width n, experts)
    "mixtral": (32768, 14336, 4096, 8),
    "qwen3": (65536, 768, 2048, 128),
    "dsv3": (65536, 2048, 7168, 256),
}
SMOKE = {"tiny": (256, 128, 128, 4)}
BACKENDS = ("pallas_mosaic_gpu", "pallas_triton")


def _modules(backend):
    return (importlib.import_module(f"pallasite.kernels.expert_mlp.{backend}"),
            importlib.import_module(f"pallasite.kernels.grouped_matmul.{backend}"))


def _inputs(seed, m, f, n, g):
    k = jax.random.split(jax.random.key(seed), 4)
    sizes = jnp.full((g,), m // g, jnp.int32)
    return (jax.random.normal(k[0], (m, f), F32).astype(BF16),
            (jax.random.normal(k[1], (g, f, n), F32) / f ** 0.5).astype(BF16), sizes,
            jax.random.uniform(k[2], (m,), minval=0.1, maxval=1.0),
            jax.random.normal(k[3], (m, n), F32).astype(BF16))


def _variants(backend, interpret):
    fused, grouped = _modules(backend)

    def fused_forward(h, w, sizes, weights, dy):
        del dy
        return fused.down_weighted(h, w, sizes, weights, interpret=interpret)

    def composed_forward(h, w, sizes, weights, dy):
        del dy
        sums = grouped.gmm(h, w, sizes, out_dtype=F32, interpret=interpret)
        return (sums * weights[:, None]).astype(BF16)

    def fused_backward(h, w, sizes, weights, dy):
        return fused.down_weighted_grad(dy, w, sizes, weights, h, interpret=interpret)

    def composed_backward(h, w, sizes, weights, dy):
        t = grouped.gmm(dy, w, sizes, transpose_rhs=True, out_dtype=F32, interpret=interpret)
        return (t * weights[:, None]).astype(BF16), jnp.sum(h.astype(F32) * t, axis=1)

    return {"forward": (fused_forward, composed_forward),
            "backward": (fused_backward, composed_backward)}


def _difference(got, want) -> float:
    worst = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = a.astype(F32), b.astype(F32)
        worst = max(worst, float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)))
    return worst


def _time(fn, sets, smoke):
    compiled, compile_s = harness.compile_jax(jax.jit(lambda args: fn(*args)), sets[0])
    t = harness.steady_state(compiled, sets, harness.jax_sync, compile_s=compile_s,
                             warmup=1 if smoke else 2, samples=2 if smoke else 10,
                             budget_s=0.5 if smoke else 2.0)
    return t.median_s


def run(out, backends, smoke: bool):
    interpret = smoke and jax.default_backend() == "cpu"
    for name, (m, f, n, g) in (SMOKE if smoke else SHAPES).items():
        sets = [_inputs(s, m, f, n, g) for s in range(1 if smoke else 3)]
        for backend in backends:
            for product, (fused, composed) in _variants(backend, interpret).items():
                rec = {"shape": name, "m": m, "f": f, "n": n, "g": g, "backend": backend,
                       "product": product, "device": jax.devices()[0].device_kind}
                try:
                    rec["max_rel_difference"] = _difference(jax.jit(fused)(*sets[0]),
                                                            jax.jit(composed)(*sets[0]))
                    rec["fused_ms"] = 1e3 * _time(fused, sets, smoke)
                    rec["composed_ms"] = 1e3 * _time(composed, sets, smoke)
                    rec["speedup"] = rec["composed_ms"] / rec["fused_ms"]
                except Exception as error:  # noqa: BLE001 - record it and go on
                    rec["error"] = f"{type(error).__name__}: {error}"[:400]
                records.emit(rec, out, "grouped_mlp_down.jsonl")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    args = p.parse_args(argv)
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    run(out, args.backends, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
