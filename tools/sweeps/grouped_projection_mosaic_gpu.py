"""H200 check + benchmark of the Mosaic GPU grouped projection (issue 7), one process.

For each TARGETS shape (bf16, Dirichlet(4.0) group sizes, seeded) and a few extra cases:
  1. forward, dx and dkernel times for the configs in CONFIGS, best kept, each config's
     output checked against fp32 dots on sampled groups and rows (the full fp32
     reference does not fit for dsv3), incl. rows past the total and empty groups;
  2. forward and forward+backward through the public API for pallas_mosaic_gpu,
     pallas_triton, jax.lax.ragged_dot (XLA) and tokamax mosaic (when importable).
Times: median over 3 repetitions of back-to-back calls (~50 ms each), after a warm-up
call; results stream to FOLDER/results.jsonl (--out FOLDER) so a timeout still leaves them.

  python3 tools/sweeps/grouped_projection_mosaic_gpu.py --out FOLDER [--budget-s 200] [--shapes ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
import traceback

# Time the configs named here (or the table/defaults), never an autotune on a miss.
os.environ.setdefault("PALLASITE_AUTOTUNE", "0")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for pkg in ("reference", "kernels", "tuning", "bench"):
    sys.path.insert(0, os.path.join(ROOT, "packages", pkg))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import records  # noqa: E402 - tools/sweeps/records.py, beside this script
from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu as M  # noqa: E402
from pallasite.reference.inputs import random_group_sizes, skewed_group_sizes  # noqa: E402

PEAK_TFLOPS = 989.4  # H200 SXM dense bf16, datasheet (pallasite.bench.roofline)
PEAK_TBPS = 4.8
OUT = "results"  # --out
START = time.time()

SHAPES = {
    "mixtral": (32768, 4096, 14336, 8),
    "dsv3": (65536, 7168, 2048, 256),
    "qwen3": (65536, 2048, 768, 128),
    "olmoe": (32768, 2048, 1024, 64),
    "qwen3_skewed": (65536, 2048, 768, 128),
    "small_m": (4096, 2048, 768, 128),
}

B = M.MosaicGpuBlockSizes
# None = the backend's default for the shape (resolve_block_sizes).
_WS = [B(128, 128, 64, 3, 8, True), B(128, 128, 64, 3, 16, True), B(64, 128, 64, 4, 8, True),
       B(128, 64, 64, 6, 8, True)]
CONFIGS = {
    "fwd": [None] + _WS,
    "dx": [None] + _WS,
    "dk": [None, B(128, 128, 64, 3, 8, True), B(128, 128, 64, 3, 4, True),
           B(128, 128, 64, 3, 16, True), B(128, 64, 64, 6, 8, True)],
}
# --ws-delay-release 0,1: time the warp-specialised configs once per value of their
# delay_release field.
WS_DELAYS = [None]
PRODUCTS = ["fwd", "dx", "dk"]


def emit(rec):
    rec["elapsed_s"] = round(time.time() - START, 1)
    records.emit(rec, OUT, "results.jsonl")


def timed(fn, *args, target_s=0.05):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t0, 1e-5)
    n = int(min(max(target_s / one, 2), 50))
    reps = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        reps.append((time.perf_counter() - t0) / n)
    return float(np.median(reps)), first


@jax.jit
def _err(a, e):
    a, e = a.astype(jnp.float32), e.astype(jnp.float32)
    d = jnp.abs(a - e)
    return (jnp.linalg.norm(d) / jnp.maximum(jnp.linalg.norm(e), 1e-30),
            d.max() / jnp.maximum(jnp.abs(e).max(), 1e-30), jnp.isfinite(a).all())


def err(actual, expected):
    """Relative l2 and max error (over max |expected|), on the device in fp32."""
    rel, mx, fin = _err(actual, expected)
    return {"rel_l2": float(rel), "max_abs_over_scale": float(mx), "finite": bool(fin)}


def inputs(name, m, k, n, g, seed=0):
    kx, kw, kd, kg = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(jnp.bfloat16)
    if name == "qwen3_skewed":
        gs = skewed_group_sizes(kg, m, g, hot=g // 2, hot_fraction=0.5)
    else:
        gs = random_group_sizes(kg, m, g)
    return x, w, dy, gs


def product_check(prod, out, x, w, dy, gs):
    """fp32 dots on the sampled rows of 3 groups (dk: their whole contraction) for one
    product's output."""
    sizes = np.asarray(gs)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    nz = np.flatnonzero(sizes)
    hi = jax.lax.Precision.HIGHEST
    worst = {"rel_l2": 0.0, "max_abs_over_scale": 0.0, "finite": True}
    for i in sorted({int(nz[0]), int(nz[len(nz) // 2]), int(nz[-1])}):
        s, z = int(starts[i]), int(sizes[i])
        rows = np.unique(np.concatenate([np.arange(s, min(s + 96, s + z)),
                                         np.arange(max(s, s + z - 96), s + z)]))
        wi = w[i].astype(jnp.float32)
        if prod == "fwd":
            e = err(out[rows], jnp.dot(x[rows].astype(jnp.float32), wi, precision=hi))
        elif prod == "dx":
            e = err(out[rows], jnp.dot(dy[rows].astype(jnp.float32), wi.T, precision=hi))
        elif z <= 8192:  # dk: the group's whole contraction
            full = slice(s, s + z)
            e = err(out[i], jnp.dot(x[full].astype(jnp.float32).T,
                                    dy[full].astype(jnp.float32), precision=hi))
        else:
            continue
        worst = {"rel_l2": max(worst["rel_l2"], e["rel_l2"]),
                 "max_abs_over_scale": max(worst["max_abs_over_scale"], e["max_abs_over_scale"]),
                 "finite": worst["finite"] and e["finite"]}
    total = int(sizes.sum())
    if prod == "dk":
        worst["empty_zero"] = bool((np.asarray(out[np.flatnonzero(sizes == 0)]) == 0).all())
    else:
        worst["tail_zero"] = bool(total >= out.shape[0] or (np.asarray(out[total:]) == 0).all())
    return worst


def roofline(flops, nbytes, t):
    tflops = flops / t / 1e12
    ceiling = min(PEAK_TFLOPS, flops / nbytes * PEAK_TBPS)
    return round(tflops, 1), round(tflops / ceiling, 3)


def bench_products(name, x, w, dy, gs, budget_s):
    m, k = x.shape
    g, _, n = w.shape
    flops = 2 * m * k * n
    prods = {
        "fwd": (lambda bs: jax.jit(lambda a, b, c: M.gmm(a, b, c, block_sizes=bs)), (x, w, gs),
                m * k * 2 + g * k * n * 2 + m * n * 2),
        "dx": (lambda bs: jax.jit(lambda a, b, c: M.gmm(a, b, c, transpose_rhs=True,
                                                         block_sizes=bs)), (dy, w, gs),
               m * k * 2 + g * k * n * 2 + m * n * 2),
        "dk": (lambda bs: jax.jit(lambda a, b, c: M.tgmm(a, b, c, num_groups=g, block_sizes=bs)),
               (x, dy, gs), m * k * 2 + g * k * n * 2 + m * n * 2),
    }
    best = {}
    trials = [(prod, bs, d) for prod in PRODUCTS for bs in CONFIGS[prod]
              for d in (WS_DELAYS if bs is not None and bs.warp_specialized else [None])]
    for i, (prod, bs, delay) in enumerate(trials):
        make, args, nbytes = prods[prod]
        if i > 0 and time.time() - START > budget_s:
            emit({"shape": name, "product": prod, "config": str(bs), "skipped": "budget"})
            continue
        try:
            if delay is not None:
                bs = dataclasses.replace(bs, delay_release=delay)
            fn = make(bs)
            t, first = timed(fn, *args)
            tf, frac = roofline(flops, nbytes, t)
            emit({"shape": name, "product": prod, "impl": "pallas_mosaic_gpu",
                  "config": str(bs), "ws_delay_release": delay,
                  "ms": round(t * 1e3, 4), "tflops": tf,
                  "roofline_frac": frac, "first_call_s": round(first, 2),
                  "check": product_check(prod, fn(*args), x, w, dy, gs)})
            if prod not in best or t < best[prod][0]:
                best[prod] = (t, bs)
        except Exception as e:  # noqa: BLE001
            emit({"shape": name, "product": prod, "config": str(bs),
                  "error": f"{type(e).__name__}: {str(e)[:800]}"})
    return best


def peers(name, x, w, dy, gs, best, with_peers):
    from pallasite.kernels.grouped_matmul.api import grouped_projection
    from pallasite.kernels.grouped_matmul import config

    m, k = x.shape
    g, _, n = w.shape
    flops = 2 * m * k * n
    bf16 = jnp.bfloat16
    ours_bs = None
    if len(best) == 3:
        ours_bs = config.GroupedProjectionBlockSizes(
            forward=best["fwd"][1], dx=best["dx"][1], dkernel=best["dk"][1])

    def api(impl, bs=None):
        return lambda a, b: grouped_projection(a, b, gs, bf16, implementation=impl, block_sizes=bs)

    impls = {"pallas_mosaic_gpu": api("pallas_mosaic_gpu", ours_bs)}
    if with_peers:
        impls["pallas_triton"] = api("pallas_triton")
        if name != "dsv3":  # XLA's ragged_dot asks for 224 GiB here (docs/targets.md)
            impls["xla_ragged_dot"] = lambda a, b: jax.lax.ragged_dot(
                a, b, gs, preferred_element_type=jnp.float32).astype(bf16)
        try:
            import tokamax

            impls["tokamax_mosaic"] = lambda a, b: tokamax.ragged_dot(
                a, b, gs, implementation="mosaic")
        except Exception as e:  # noqa: BLE001
            emit({"shape": name, "impl": "tokamax_mosaic", "error": f"import: {e}"[:400]})
    for impl, f in impls.items():
        for mode in ("fwd", "fwd_bwd"):
            try:
                if mode == "fwd":
                    fn = jax.jit(f)
                    args = (x, w)
                    fl = flops
                else:
                    def fb(a, b, c, f=f):
                        out, vjp = jax.vjp(f, a, b)
                        return out, vjp(c)
                    fn = jax.jit(fb)
                    args = (x, w, dy)
                    fl = 3 * flops
                t, first = timed(fn, *args)
                emit({"shape": name, "mode": mode, "impl": impl, "ms": round(t * 1e3, 4),
                      "tflops": round(fl / t / 1e12, 1), "first_call_s": round(first, 2)})
            except Exception as e:  # noqa: BLE001
                emit({"shape": name, "mode": mode, "impl": impl,
                      "error": f"{type(e).__name__}: {str(e)[:600]}"})


def main():
    global OUT
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results", help="folder for results.jsonl")
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--shapes", nargs="*", default=list(SHAPES))
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--peer-shapes", nargs="*", default=["mixtral", "dsv3", "qwen3", "olmoe"])
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, interpreter")
    p.add_argument("--default-only", action="store_true", help="one config per product")
    p.add_argument("--products", nargs="*", default=["fwd", "dx", "dk"])
    p.add_argument("--ws-delay-release", default=None, help="comma list, e.g. 0,1")
    args = p.parse_args()
    PRODUCTS[:] = args.products
    if args.ws_delay_release:
        WS_DELAYS[:] = [int(v) for v in args.ws_delay_release.split(",")]
    if args.default_only:
        for prod in CONFIGS:
            CONFIGS[prod] = [None]
    if args.dry_run:  # exercise this script's plumbing on a CPU
        import functools
        SHAPES.update({s: (256, 64, 128, 4) for s in SHAPES})
        for prod in CONFIGS:
            CONFIGS[prod] = [B(64, 64, 64, 2, 2), B(64, 64, 64, 2, 2, True)]
        M.gmm = functools.partial(M.gmm, interpret=True)
        M.tgmm = functools.partial(M.tgmm, interpret=True)
    OUT = args.out
    os.makedirs(OUT, exist_ok=True)
    dev = jax.devices()[0]
    emit({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
          "device": dev.device_kind, "sms": getattr(dev, "core_count", None),
          "jax": jax.__version__, "command": " ".join(sys.argv)})
    for name in args.shapes:
        m, k, n, g = SHAPES[name]
        try:
            x, w, dy, gs = inputs(name, m, k, n, g)
            best = bench_products(name, x, w, dy, gs, args.budget_s)
            peers(name, x, w, dy, gs, best,
                  with_peers=not args.no_peers and name in args.peer_shapes)
            del x, w, dy
        except Exception:  # noqa: BLE001
            emit({"shape": name, "error": traceback.format_exc()[-1500:]})


if __name__ == "__main__":
    main()
