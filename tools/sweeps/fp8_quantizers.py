"""The fp8 quantizers' bandwidth beside a plain cast and the XLA forms, and the fp8 kernels'
stage and tile variants, on one GPU; JSON lines to $OUT/fp8_quantizers.jsonl.

    OUT=folder python3 tools/sweeps/fp8_quantizers.py [--smoke]

Quantizers: each Pallas Triton quantizer (rows, token blocks, weight blocks) and its XLA
form, on mixtral's and dsv3's operands (x and dy of 65536 tokens, the experts' kernels),
against an XLA cast of the same array to e4m3 (reads 2 bytes and writes 1 per element:
the traffic of a quantizer without its scales, the practical ceiling). TB/s counts each
call's input and output bytes once. Timed by the bench harness's queued method (calls
back to back, one sync per sample, inputs rotated past the L2).

Kernels (`--stages`): the Mosaic GPU fp8 forward, dx and dkernel of mixtral and dsv3 at
3, 4 and 5 stages and snake widths 4 and 8, from pre-quantized operands (values are
checked by tests/test_grouped_projection_fp8.py, not here).
Forward variants (`--forward-variants`): the Mosaic GPU fp8 forward and dx with one and
two 128-deep steps per stage (steps_per_stage), A multicast to clusters of two
(cluster), stage counts and snake widths, on mixtral (its 8
experts, and one group of the same dims: the grouped loop against a dense one) and dsv3;
each variant's output is compared with the default's.
Token-block variants (`--token-variants`): the Pallas Triton token-block quantizer with
COLUMNS (columns per program) and TOKEN_NUM_WARPS set to each pair of a small grid, the
amax over the input's own 16 bits and over a fp32 copy (NARROW_AMAX), on the same
operands, with values compared to the default's, beside a bare e4m3 cast of the input
(the copy ceiling of the same run).
Cast variants (`--cast-variants`): each Pallas quantizer with the oracle's clip before
the fp8 cast and without it (SATURATING_CAST), values compared.
Paired gate-up (`--paired-gate-up`): grouped_mlp's fp8 gate-up on Mosaic GPU from
pre-quantized operands, at mixtral's, qwen3's and dsv3's (32 local experts) dims: the
plain fp8 gmm writing the [m, 2f] pre-activation in bf16 (the composition's product),
the paired kernel quantizing h in its epilogue ("quantized_h"), and its backward half
("d_pre") on both its row tiles (D_PRE_TILE_ROWS 64 and 128), each at 2 m k 2f flops:
what the pairing costs against the plain loop.
--smoke: tiny shapes through the interpreters (a CPU check of the script).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys

import jax
import jax.numpy as jnp

from knobs import knobs  # tools/sweeps/knobs.py, beside this script
import records  # tools/sweeps/records.py, beside this script
from pallasite.bench import harness
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu_fp8 as mgpu_fp8
from pallasite.kernels.grouped_matmul.token_blocks import token_blocks
from pallasite.kernels.quantization import pallas_triton, xla
from pallasite.reference import inputs as ref_inputs

F8 = jnp.float8_e4m3fn


def _nbytes(tree) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree)))


def _time(fn, sets):
    compiled, compile_s = harness.compile_jax(jax.jit(fn), sets[0])
    t = harness.steady_state(compiled, sets, harness.jax_sync, compile_s=compile_s,
                             warmup=2, samples=10, budget_s=2.0)
    return t.median_s


def _sets(make, count):
    return [make(s) for s in range(count)]


def quantizers(out, smoke: bool):
    interpret = smoke
    shapes = ([("tiny", 256, 256, 4, 128)] if smoke else
              [("mixtral_x", 32768, 4096, 8, 14336), ("mixtral_dy", 32768, 14336, 8, 4096),
               ("dsv3_x", 65536, 7168, 256, 2048)])
    for name, m, c, g, n in shapes:
        copies = 2 if smoke else 3
        xs = _sets(lambda s: jax.random.normal(jax.random.key(s), (m, c), jnp.bfloat16), copies)
        sizes = ref_inputs.random_group_sizes(jax.random.key(1234), m, g)
        table = token_blocks(sizes, m)
        runs = {
            "cast_e4m3": lambda x: x.astype(F8),
            "rows.pallas_triton": lambda x: pallas_triton.rows(x, F8, interpret=interpret),
            "rows.xla": lambda x: xla.rows(x, F8),
            "token_blocks.pallas_triton": lambda x: pallas_triton.token_blocks(
                x, table.start, table.rows, F8, interpret=interpret),
            "token_blocks.xla": lambda x: xla.token_blocks(x, table.start, table.rows, F8),
        }
        for impl, fn in runs.items():
            t = _time(fn, xs)
            moved = _nbytes(xs[0]) + _nbytes(jax.eval_shape(fn, xs[0]))
            _write(out, {"what": "quantizer", "shape": name, "m": m, "c": c, "impl": impl,
                         "ms": t * 1e3, "tbps": moved / t / 1e12})
        w_shape = (g, c, n)
        ws = _sets(lambda s: jax.random.normal(jax.random.key(s), w_shape, jnp.bfloat16), 2)
        for impl, fn in {"cast_e4m3": lambda w: w.astype(F8),
                         "weights.pallas_triton": lambda w: pallas_triton.weight_blocks(
                             w, F8, transpose=True, interpret=interpret),
                         "weights.xla": lambda w: xla.weight_blocks(w, F8, transpose=True)}.items():
            t = _time(fn, ws)
            moved = _nbytes(ws[0]) + _nbytes(jax.eval_shape(fn, ws[0]))
            _write(out, {"what": "quantizer", "shape": name + "_kernel", "dims": list(w_shape),
                         "impl": impl, "ms": t * 1e3, "tbps": moved / t / 1e12})


def _weight_blocks(q, w, *, transpose: bool, experts: int = 64):
    """q.weight_blocks of w, 64 experts at a time (the blocks never span experts, so the
    values are the whole array's): dsv3's kernel is past the Pallas quantizer's 32-bit
    offsets, and its XLA form needs a 14 GiB fp32 temporary."""
    parts = [q.weight_blocks(w[i:i + experts], F8, transpose=transpose)
             for i in range(0, w.shape[0], experts)]
    return tuple(jnp.concatenate(a) for a in zip(*parts))


def kernels(out, smoke: bool):
    interpret = smoke
    shapes = ([("tiny", 512, 256, 256, 4)] if smoke else
              [("mixtral", 32768, 4096, 14336, 8), ("dsv3", 65536, 7168, 2048, 256)])
    variants = ([(2, 2)] if smoke else [(3, 8), (4, 8), (5, 8), (4, 4)])
    for name, m, k, n, g in shapes:
        x, w, _ = ref_inputs.grouped_projection_inputs(jax.random.key(0), m, k, n, g, jnp.bfloat16)
        sizes = ref_inputs.aligned_group_sizes(jax.random.key(1234), m, g)
        dy = jax.random.normal(jax.random.key(1), (m, n), jnp.bfloat16)
        q = xla if smoke else pallas_triton
        xq, xs = q.rows(x, F8)
        wq, wsc = _weight_blocks(q, w, transpose=True)
        dyq, dys = q.rows(dy, F8)
        wq2, wsc2 = _weight_blocks(q, w, transpose=False)
        table = token_blocks(sizes, m)
        xt, xts = q.token_blocks(x, table.start, table.rows, F8)
        dyt, dyts = q.token_blocks(dy, table.start, table.rows, F8)
        for stages, width in variants:
            bs = mgpu_fp8.MosaicGpuFp8BlockSizes(stages=stages, grid_block_n=width)
            products = {
                "forward": (lambda a: mgpu_fp8.gmm_quantized(
                    *a, sizes, out_dtype=jnp.bfloat16, block_sizes=bs, interpret=interpret),
                    (xq, xs, wq, wsc), 2 * m * k * n),
                "dx": (lambda a: mgpu_fp8.gmm_quantized(
                    *a, sizes, out_dtype=jnp.bfloat16, block_sizes=bs, interpret=interpret,
                    product="dx"), (dyq, dys, wq2, wsc2), 2 * m * k * n),
                "dkernel": (lambda a: mgpu_fp8.tgmm_quantized(
                    *a, table.first, table.count, out_dtype=jnp.bfloat16, block_sizes=bs,
                    interpret=interpret, m=m), (xt, xts, dyt, dyts), 2 * m * k * n),
            }
            for product, (fn, args, flops) in products.items():
                t = _time(fn, [args])
                _write(out, {"what": "kernel", "shape": name, "product": product,
                             "stages": stages, "grid_block_n": width, "ms": t * 1e3,
                             "tflops": flops / t / 1e12})


def forward_variants(out, smoke: bool):
    interpret = smoke
    shapes = ([("tiny", 512, 512, 256, 4)] if smoke else
              [("mixtral", 32768, 4096, 14336, 8), ("mixtral_one_group", 32768, 4096, 14336, 1),
               ("dsv3", 65536, 7168, 2048, 256)])
    variants = ([(2, 2, 1, 1), (2, 2, 2, 1)] if smoke else
                [(4, 8, 1, 1), (4, 8, 2, 1), (4, 16, 1, 2), (3, 8, 1, 1)])
    q = xla if smoke else pallas_triton
    for name, m, k, n, g in shapes:
        x, w, _ = ref_inputs.grouped_projection_inputs(jax.random.key(0), m, k, n, g, jnp.bfloat16)
        sizes = ref_inputs.aligned_group_sizes(jax.random.key(1234), m, g)
        dy = jax.random.normal(jax.random.key(1), (m, n), jnp.bfloat16)
        operands = {"forward": (*q.rows(x, F8), *_weight_blocks(q, w, transpose=True)),
                    "dx": (*q.rows(dy, F8), *_weight_blocks(q, w, transpose=False))}
        for product, args in operands.items():
            want = None
            for stages, width, depth, cluster in variants:
                bs = mgpu_fp8.MosaicGpuFp8BlockSizes(stages=stages, grid_block_n=width,
                                                     steps_per_stage=depth, cluster=cluster)
                fn = (lambda a, bs=bs, product=product: mgpu_fp8.gmm_quantized(
                    *a, sizes, out_dtype=jnp.bfloat16, block_sizes=bs, interpret=interpret,
                    product=product))
                got = jax.jit(fn)(args).astype(jnp.float32)
                want = got if want is None else want
                diff = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                t = _time(fn, [args])
                _write(out, {"what": "forward_variant", "shape": name, "g": g,
                             "product": product, "stages": stages, "grid_block_n": width,
                             "steps_per_stage": depth, "cluster": cluster, "ms": t * 1e3,
                             "tflops": 2 * m * k * n / t / 1e12,
                             "max_diff_vs_first_rel": diff})
                del got
            del want
        del x, w, dy, operands, args
        gc.collect()


def paired_gate_up(out, smoke: bool):
    from pallasite.kernels.expert_mlp import pallas_mosaic_gpu_fp8 as fused

    interpret = smoke
    shapes = ([("tiny", 512, 256, 256, 4)] if smoke else
              [("mixtral", 32768, 4096, 14336, 8), ("qwen3", 65536, 2048, 768, 128),
               ("dsv3_local", 65536, 7168, 2048, 32)])
    q = xla if smoke else pallas_triton
    for name, m, k, f, g in shapes:
        x, w, _ = ref_inputs.grouped_projection_inputs(jax.random.key(0), m, k, 2 * f, g,
                                                       jnp.bfloat16)
        sizes = ref_inputs.aligned_group_sizes(jax.random.key(1234), m, g)
        dh = jax.random.normal(jax.random.key(1), (m, f), jnp.bfloat16)
        args = (*q.rows(x, F8), *_weight_blocks(q, w, transpose=True))
        call = functools.partial(mgpu_fp8.gmm_call, group_offset=None, bs=mgpu_fp8.DEFAULT,
                                 interpret=interpret)
        paired = functools.partial(fused.paired_call, activation="swiglu", interpret=interpret)
        d_pre = lambda a: paired(*a[:4], sizes, kind="d_pre", dh=a[4],  # noqa: E731
                                 out_dtype=jnp.bfloat16)
        runs = {  # name: (function, the kernel module's knobs while it is traced)
            "plain_pre_bf16": (lambda a: call(*a, sizes, 2 * f, out_dtype=jnp.bfloat16), {}),
            "quantized_h": (lambda a: paired(*a, sizes, kind="quantized_h"), {}),
            "d_pre": (d_pre, {"D_PRE_TILE_ROWS": 64}),
            "d_pre_128_rows": (d_pre, {"D_PRE_TILE_ROWS": 128}),
        }
        for kernel, (fn, settings) in runs.items():
            with knobs(fused, **settings):
                fn = functools.partial(lambda a, fn: fn(a), fn=fn)  # traced afresh
                t = _time(fn, [args + (dh,) if kernel.startswith("d_pre") else args])
            _write(out, {"what": "paired_gate_up", "shape": name, "kernel": kernel,
                         "m": m, "k": k, "f": f, "g": g, "ms": t * 1e3,
                         "tflops": 2 * m * k * 2 * f / t / 1e12})
        del x, w, dh, args
        gc.collect()


def _same_used_blocks(got, want, rows) -> bool:
    """Values and scales equal in the blocks that hold rows (an unused block's values
    are never written, so they are not compared)."""
    used = rows > 0
    (gv, gs), (wv, ws) = got, want
    c = gv.shape[0]
    block = lambda v: v.astype(jnp.float32).reshape(c, -1, 128)[:, used]  # noqa: E731
    return bool(jnp.array_equal(block(gv), block(wv))
                and jnp.array_equal(gs[used], ws[used]))


def token_variants(out, smoke: bool):
    """The token-block quantizer's columns per program and warps, each timed and checked
    against the module's default on the same input."""
    interpret = smoke
    shapes = ([("tiny", 256, 256, 4)] if smoke else
              [("mixtral_x", 32768, 4096, 8), ("dsv3_x", 65536, 7168, 256)])
    grid = [(64, 4, True)] if smoke else [
        (c, w, narrow) for narrow in (True, False) for c, w in
        ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8))]
    for name, m, c, g in shapes:
        xs = _sets(lambda s: jax.random.normal(jax.random.key(s), (m, c), jnp.bfloat16),
                   2 if smoke else 3)
        table = token_blocks(ref_inputs.random_group_sizes(jax.random.key(1234), m, g), m)

        def run(x):
            return pallas_triton.token_blocks(x, table.start, table.rows, F8,
                                              interpret=interpret)
        want = jax.jit(run)(xs[0])
        used = int((table.rows > 0).sum())  # unused blocks are never written
        _, rec = _variant(lambda x: x.astype(F8), xs, lambda got: _nbytes(xs[0]) + _nbytes(got))
        _write(out, {"what": "token_variant", "shape": name, "impl": "e4m3 cast", **rec})
        for columns, warps, narrow in grid:
            with knobs(pallas_triton, COLUMNS=columns, TOKEN_NUM_WARPS=warps,
                       NARROW_AMAX=narrow):
                got, rec = _variant(run, xs, lambda got: _nbytes(xs[0]) + _nbytes(got[1])
                                    + used * 128 * c * got[0].dtype.itemsize)
            if got is not None:
                rec["same_as_default"] = _same_used_blocks(got, want, table.rows)
            _write(out, {"what": "token_variant", "shape": name, "columns": columns,
                         "warps": warps, "narrow_amax": narrow, **rec})


def cast_variants(out, smoke: bool):
    """Each Pallas quantizer with the oracle's clip before the cast and without it
    (SATURATING_CAST: the cast saturates), timed on the same input, values compared."""
    interpret = smoke
    shapes = ([("tiny", 256, 256, 4, 128)] if smoke else
              [("mixtral_x", 32768, 4096, 8, 14336), ("mixtral_dy", 32768, 14336, 8, 4096),
               ("dsv3_x", 65536, 7168, 256, 2048)])
    only = os.environ.get("CAST_VARIANTS")  # e.g. "token_blocks": that quantizer alone
    for name, m, c, g, n in shapes:
        xs = _sets(lambda s: jax.random.normal(jax.random.key(s), (m, c), jnp.bfloat16),
                   2 if smoke else 3)
        table = token_blocks(ref_inputs.random_group_sizes(jax.random.key(1234), m, g), m)
        ws = _sets(lambda s: jax.random.normal(jax.random.key(s), (8, c, n), jnp.bfloat16), 2)
        runs = {
            "rows": (xs, lambda x: pallas_triton.rows(x, F8, interpret=interpret)),
            "token_blocks": (xs, lambda x: pallas_triton.token_blocks(
                x, table.start, table.rows, F8, interpret=interpret)),
            "weight_blocks": (ws, lambda w: pallas_triton.weight_blocks(
                w, F8, transpose=True, interpret=interpret)),
        }
        for impl, (sets, run) in runs.items():
            if only and impl != only:
                continue
            results = {}
            for saturating in (False, True):
                with knobs(pallas_triton, SATURATING_CAST=saturating):
                    got, rec = _variant(run, sets,
                                        lambda got: _nbytes(sets[0]) + _nbytes(got))
                if got is not None:
                    results[saturating] = got
                if saturating and len(results) == 2:
                    if impl == "token_blocks":  # unused blocks are never written
                        same = _same_used_blocks(results[True], results[False], table.rows)
                    else:
                        same = all(bool(jnp.array_equal(a.astype(jnp.float32),
                                                        b.astype(jnp.float32), equal_nan=True))
                                   for a, b in zip(results[False], results[True]))
                    rec["same_as_clip"] = same
                _write(out, {"what": "cast_variant", "shape": name, "impl": impl,
                             "saturating_cast": saturating, **rec})


def _variant(run, sets, moved):
    """(run's output on sets[0], {"ms", "tbps"}) with run traced afresh (the knobs as
    set now) and timed over sets, `moved(output)` bytes a call; (None, {"error"}) where
    it fails: a variant that fails is a result."""
    try:
        fn = lambda a: run(a)  # noqa: E731  (a new function: traced again)
        got = jax.jit(fn)(sets[0])
        t = _time(fn, sets)
        return got, {"ms": t * 1e3, "tbps": moved(got) / t / 1e12}
    except Exception as e:  # noqa: BLE001
        return None, {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def _write(out, rec):
    records.emit(rec, out, "fp8_quantizers.jsonl")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--stages", action="store_true", help="also time the kernel variants")
    p.add_argument("--forward-variants", action="store_true",
                   help="only the fp8 forward's and dx's steps per stage and clusters")
    p.add_argument("--token-variants", action="store_true",
                   help="only the token-block quantizer's columns and warps")
    p.add_argument("--cast-variants", action="store_true",
                   help="time the quantizers with and without the clip before the cast")
    p.add_argument("--paired-gate-up", action="store_true",
                   help="only grouped_mlp's paired fp8 gate-up against the plain fp8 gmm")
    args = p.parse_args(argv)
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    # Each of these flags runs its sweep alone (the first set, in this order).
    alone = {"forward_variants": forward_variants, "token_variants": token_variants,
             "cast_variants": cast_variants, "paired_gate_up": paired_gate_up}
    for flag, sweep in alone.items():
        if getattr(args, flag):
            sweep(out, args.smoke)
            return
    quantizers(out, args.smoke)
    if args.stages:
        kernels(out, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
