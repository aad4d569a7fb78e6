"""What the fp8 forward's per-step promotion costs: the Mosaic GPU fp8 forward against
variants of its step that leave parts of the promotion out, on one GPU; JSON lines to
$OUT/fp8_promotion_bounds.jsonl.

    OUT=folder python3 tools/sweeps/fp8_promotion_bounds.py [--smoke]

Each 128-deep step of pallas_mosaic_gpu_fp8's gmm issues its wgmmas into a fresh
(zeroed) accumulator, waits for them and adds them, times the row and weight scales,
into the fp32 total (`_promote`). Variants, each replacing `_promote` for one call:
  default     the kernel as it is;
  no_scale    the scales are not loaded or applied (total + fresh): the cost of the scale
              loads and multiply;
  no_promote  the wgmmas accumulate into the total itself, with no fresh accumulator
              and no promotion (the product is wrong: a bound, not a kernel): the cost
              of the promotion and the fresh accumulator;
  halves      the step's wgmmas in two 64-column halves, the first half promoted while
              the second runs (one wgmma group in flight).
Only `default` and `halves` compute the product; the others are timing bounds. Shapes:
mixtral's forward (8 experts), a dense 8192^3 (one group) and qwen3's forward, from
operands quantized by the Pallas Triton quantizers, timed by the bench harness's queued
method. --smoke: a tiny shape through the interpreter (a CPU check of the script;
no_promote, whose accumulator the interpreter cannot run, is left out there).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import records  # tools/sweeps/records.py, beside this script
from pallasite.bench import harness
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu_fp8 as mgpu_fp8
from pallasite.kernels.quantization import pallas_triton, xla
from pallasite.reference import inputs as ref_inputs

F8 = jnp.float8_e4m3fn
ROWS, HALF = mgpu_fp8._CONSUMER_ROWS, mgpu_fp8.BLOCK // 2


def _no_scale(total, a, b_t, scale, live):
    def product(acc_ref):
        @pl.when(live)
        def _():
            plgpu.wgmma(acc_ref, a, b_t.transpose((1, 0)))

        return acc_ref[...]

    return total + pl.run_scoped(product, plgpu.ACC((ROWS, mgpu_fp8.BLOCK), jnp.float32))


def _no_promote(total, a, b_t, scale, live):
    def product(acc_ref):
        @pl.when(live)
        def _():
            plgpu.wgmma(acc_ref, a, b_t.transpose((1, 0)))

    return pl.run_state(product)(plgpu.ACC.init(total))


def _halves(total, a, b_t, scale, live):
    def first(acc0):
        def second(acc1):
            @pl.when(live)
            def _():
                plgpu.wgmma(acc0, a, b_t.at[pl.ds(0, HALF)].transpose((1, 0)))
                plgpu.wgmma(acc1, a, b_t.at[pl.ds(HALF, HALF)].transpose((1, 0)))

            factor = scale()
            low = total[:, :HALF] + (plgpu.wgmma_accumulator_load(acc0, wait_n=1)
                                     * factor[:, :HALF])
            high = total[:, HALF:] + acc1[...] * factor[:, HALF:]
            return jnp.concatenate([low, high], axis=1)

        return pl.run_scoped(second, plgpu.ACC((ROWS, HALF), jnp.float32))

    return pl.run_scoped(first, plgpu.ACC((ROWS, HALF), jnp.float32))


VARIANTS = {"default": mgpu_fp8._promote, "no_scale": _no_scale,
            "no_promote": _no_promote, "halves": _halves}
COMPUTES_THE_PRODUCT = ("default", "halves")


def _time(fn, args):
    compiled, compile_s = harness.compile_jax(jax.jit(fn), args)
    return harness.steady_state(compiled, [args], harness.jax_sync, compile_s=compile_s,
                                warmup=2, samples=10, budget_s=2.0).median_s


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    interpret = args.smoke
    shapes = ([("tiny", 512, 256, 256, 2)] if interpret else
              [("mixtral", 32768, 4096, 14336, 8), ("dense8192", 8192, 8192, 8192, 1),
               ("qwen3", 65536, 2048, 768, 128)])
    q = xla if interpret else pallas_triton
    real = mgpu_fp8._promote
    try:
        for name, m, k, n, g in shapes:
            x, w, _ = ref_inputs.grouped_projection_inputs(jax.random.key(0), m, k, n, g,
                                                            jnp.bfloat16)
            sizes = ref_inputs.aligned_group_sizes(jax.random.key(1234), m, g)
            operands = (*q.rows(x, F8), *q.weight_blocks(w, F8, transpose=True))
            want = None
            for label, promote in VARIANTS.items():
                if interpret and label == "no_promote":
                    continue  # the interpreter cannot run an accumulator given by run_state
                mgpu_fp8._promote = promote
                fn = (lambda a: mgpu_fp8.gmm_quantized(*a, sizes, out_dtype=jnp.bfloat16,
                                                       interpret=interpret))
                got = jax.jit(fn)(operands).astype(jnp.float32)
                want = got if want is None else want
                rec = {"shape": name, "m": m, "k": k, "n": n, "g": g, "variant": label}
                if label in COMPUTES_THE_PRODUCT:
                    rec["equals_default"] = bool(jnp.array_equal(got, want))
                t = _time(fn, operands)
                rec.update(ms=t * 1e3, tflops=2 * m * k * n / t / 1e12)
                records.emit(rec, out, "fp8_promotion_bounds.jsonl")
    finally:
        mgpu_fp8._promote = real


if __name__ == "__main__":
    sys.exit(main())
