"""Regenerate the tuned tables: `bazel run //packages/bench:autotune -- --op ... --device-kind ...`.

For each implementation of the op that is present and runs on this device, and each
docs/targets.md shape, runs pallasite.tuning's bounded autotuner over the table's candidate list
(the backend's default always first), on synthetic inputs of the real shapes in bf16, each
candidate's output checked against an exact reference on sampled rows before it may win.
Prints tuned-vs-default times and writes an entry into the source tree's table for every
key where the tuned config is at least `--min-speedup` (default 3%) faster than the
default; below that the two are within timing noise and the default stays (no entry).

Each entry's `measured` field records the shape, both times, the number of candidates
tried and failed, the date, the device and the jax version: the tables hold measurements
only. `--dry-run` lists the keys and candidates and runs nothing; `--results FILE` appends
one JSON line per key with every trial (status, time, error).

The kernels are reached through their backend functions (`gmm`/`tgmm`, SSD `forward` and
`backward`, the gated delta rule's `forward` and its VJP), called with `block_sizes=` so
the table under test never decides what is timed. `--op gated_delta_rule` tunes one key
per shape (its block sizes serve the forward and the backward) on its two bench shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import inspect
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pallasite.kernels.gated_delta import tuning_benchmarks as gdr_benchmarks
from pallasite.kernels.grouped_matmul import tuning_benchmarks as gp_benchmarks
from pallasite.kernels.ssd import tuning_benchmarks as ssd_benchmarks
from pallasite.tuning import autotune as tuner
from pallasite.tuning import tables
from pallasite.tuning.configs import config_from_dict, config_to_dict

GP = "grouped_projection"
SSD = "ssd"
GDR = "gated_delta_rule"
BF16 = "bfloat16"

# docs/targets.md shapes. grouped_projection: (m, k, n, g); ssd: SSD_DIMS.
SSD_DIMS = ssd_benchmarks.DIMS
GP_TARGETS = {
    "mixtral": (32768, 4096, 14336, 8),
    "dsv3": (65536, 7168, 2048, 256),
    "qwen3": (65536, 2048, 768, 128),
    "olmoe": (32768, 2048, 1024, 64),
}
SSD_TARGETS = {
    "b8_l4096_h32": (8, 4096, 32, 64, 128, 1, 256),
    "b4_l8192_h64_g8": (4, 8192, 64, 64, 128, 8, 256),
    "b2_l16384_h80": (2, 16384, 80, 64, 128, 1, 256),
}
# The gated delta rule's bench shapes (docs/gated_delta_rule.md): gdr_benchmarks.DIMS.
GDR_TARGETS = {
    "qwen3_next": (1, 32768, 32, 128, 128, 64, 16),
    "b8_t4096_h32": (8, 4096, 32, 128, 128, 64, 32),
}


@dataclasses.dataclass(frozen=True)
class Impl:
    """One tunable kernel: its table key, config type, default and a Benchmark factory."""

    name: str  # the table's implementation key, e.g. "pallas_triton:forward"
    config_type: type
    default: Any
    make_bench: Callable[[dict, str], tuner.Benchmark]  # (dims, dtype name) -> Benchmark


# ------------------------------------------------------------------ grouped_projection


def _shape_default(module, product: str, dims: dict, dtype: str = BF16):
    """The backend's own default for this shape, never a table entry (what tuning must beat).

    `default_block_sizes` where the backend has one (its fallback, split from the resolve
    that consults the tables); before that split, the resolve itself with no caller config.
    """
    kw = dict(product=product, m=dims["m"], k=dims["k"], n=dims["n"], g=dims["g"])
    fn = getattr(module, "default_block_sizes", None) or functools.partial(module.resolve_block_sizes, None)
    if "dtype" in inspect.signature(fn).parameters:
        kw["dtype"] = np.dtype(dtype) if dtype != BF16 else _bf16()
    return fn(**kw)


def _bf16():
    import jax.numpy as jnp

    return jnp.bfloat16


def _gp_impls(interpret: bool = False, everything: bool = False) -> list[Impl]:
    from pallasite.kernels import platform

    out = []
    if platform.triton_runs() or interpret or everything:
        mod = _try_import("pallasite.kernels.grouped_matmul.pallas_triton")
        cfg = _try_import("pallasite.kernels.grouped_matmul.config")
        if mod is not None and cfg is not None:
            out.extend(_products("pallas_triton", cfg.TritonBlockSizes, mod, interpret))
    if (platform.mosaic_gpu_runs() and not interpret) or everything:
        for name, config_type in (("pallas_mosaic_gpu", "MosaicGpuBlockSizes"),
                                  ("pallas_mosaic_gpu_fp8", "MosaicGpuFp8BlockSizes")):
            mod = _try_import(f"pallasite.kernels.grouped_matmul.{name}")
            if mod is not None:
                out.extend(_products(name, getattr(mod, config_type), mod))
    # Triton's fp8 products serve fp8 GPUs without Mosaic GPU (sm89); on Hopper the
    # Mosaic GPU module takes fp8, so its Triton keys are tuned only where asked for.
    if (platform.fp8_runs() and not platform.mosaic_gpu_runs()) or everything:
        mod = _try_import("pallasite.kernels.grouped_matmul.pallas_triton_fp8")
        cfg = _try_import("pallasite.kernels.grouped_matmul.config")
        if mod is not None and cfg is not None:
            out.extend(_products("pallas_triton_fp8", cfg.TritonBlockSizes, mod))
    return out


def _products(name: str, config_type: type, mod, interpret: bool = False) -> list[Impl]:
    """One Impl per product of a GPU backend (forward, dx, dkernel); interpret: its
    benchmarks run the interpreter (Triton's, on a CPU)."""
    return [Impl(f"{name}:{product}", config_type,
                 lambda d, p=product, m=mod: _shape_default(m, p, d),
                 lambda d, t=BF16, p=product, m=mod: gp_benchmarks.benchmark(m, p, d, t,
                                                                             interpret))
            for product in ("forward", "dx", "dkernel")]


# ------------------------------------------------------------------------------- ssd


def _ssd_default(module, dims: dict):
    """The backend's default for this shape in bf16, clamped to the chunk, as a call with no
    table entry resolves it (`resolve_block_sizes` with the caller's config)."""
    default = module.default_block_sizes(dims["head_dim"], dims["state"], itemsize=2)
    return module.resolve_block_sizes(default, dims["chunk"])


def _ssd_impls(interpret: bool = False, everything: bool = False) -> list[Impl]:
    from pallasite.kernels import platform

    out = []
    if platform.triton_runs() or interpret or everything:
        mod = _try_import("pallasite.kernels.ssd.pallas_triton")
        if mod is not None:
            out.append(Impl("pallas_triton:forward", mod.BlockSizes, lambda d: _ssd_default(mod, d),
                            lambda d, t=BF16: ssd_benchmarks.forward_benchmark(mod, d, t, interpret)))
            out.append(Impl("pallas_triton:backward", mod.BlockSizes, lambda d: _ssd_default(mod, d),
                            lambda d, t=BF16: ssd_benchmarks.backward_benchmark(mod, d, t, interpret)))
    return out


# ------------------------------------------------------------------ gated_delta_rule


def _gdr_impls(interpret: bool = False, everything: bool = False) -> list[Impl]:
    """One key, pallas_triton: its block sizes serve the forward and the backward."""
    from pallasite.kernels import platform

    mod = _try_import("pallasite.kernels.gated_delta.pallas_triton")
    if mod is None or not (platform.triton_runs() or interpret or everything):
        return []
    return [Impl("pallas_triton", mod.BlockSizes, mod.BlockSizes(),
                 lambda d, t=BF16: gdr_benchmarks.benchmark(mod, d, t, interpret))]


# ------------------------------------------------------------------------------ driver


def _try_import(name: str):
    try:
        return importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - a backend that does not import is not tuned
        print(f"autotune: skipping {name}: {type(err).__name__}: {err}", file=sys.stderr)
        return None


def targets(op: str) -> dict[str, dict]:
    """Table dims plus what the benchmark needs, per docs/targets.md shape name."""
    if op == GP:
        return {name: dict(zip("mkng", v)) for name, v in GP_TARGETS.items()}
    if op == GDR:
        return {name: dict(zip(gdr_benchmarks.DIMS, v)) for name, v in GDR_TARGETS.items()}
    return {name: dict(zip(SSD_DIMS, v))
            for name, v in SSD_TARGETS.items()}


def _candidates(table: tables.Table, impl: Impl, default: Any) -> list[Any]:
    out = [default]
    for raw in table.candidates_for(impl.name):
        out.append(config_from_dict(impl.config_type, raw))
    return list(dict.fromkeys(out))


def tune_key(op: str, impl: Impl, table: tables.Table, name: str, dims: dict, args) -> dict:
    default = impl.default(dims) if callable(impl.default) else impl.default
    cands = _candidates(table, impl, default)
    bucket = table.bucket_of(dims)
    record = {"op": op, "implementation": impl.name, "shape_name": name, "dims": dims,
              "bucket": dict(bucket) if bucket else None, "default": config_to_dict(default)}
    if args.dry_run:
        record["candidates"] = [config_to_dict(c) for c in cands]
        return record
    start = time.perf_counter()
    try:
        bench = impl.make_bench(dims, BF16)
        result = tuner.autotune(cands, bench, budget_s=args.budget_s, max_candidates=args.max_candidates,
                                confirm_rounds=args.confirm_rounds)
    except Exception as err:  # noqa: BLE001 - inputs or reference failed: report, go on
        record["error"] = f"{type(err).__name__}: {err}"[:400]
        return record
    import jax

    record["seconds"] = round(time.perf_counter() - start, 1)
    record["date"] = datetime.date.today().isoformat()
    record["jax"] = jax.__version__
    record["trials"] = [t.as_json(config_to_dict) for t in result.trials]
    # When another config won the sweep, the tuner re-timed it against the default
    # (interleaved): both times then come from that re-timing.
    record["confirmed"] = result.baseline_time_s is not None
    record["confirm_rounds"] = args.confirm_rounds
    default_s = result.baseline_time_s if record["confirmed"] else result.time_of(default)
    record["default_ms"] = None if default_s is None else default_s * 1e3
    record["tuned_ms"] = None if result.best_time_s is None else result.best_time_s * 1e3
    record["tuned"] = None if result.best is None else config_to_dict(result.best)
    if default_s and result.best_time_s:
        record["speedup"] = default_s / result.best_time_s
    return record


def _entry(record: dict, device_kind: str) -> tables.Entry:
    trials = record["trials"]
    return tables.Entry(
        implementation=record["implementation"], device_kind=device_kind, dtypes=(BF16,),
        bucket=tuple(record["bucket"].items()), config=record["tuned"],
        measured={
            "shape": f"{record['shape_name']} " + ",".join(f"{k}={v}" for k, v in record["dims"].items()),
            "default_ms": round(record["default_ms"], 4), "tuned_ms": round(record["tuned_ms"], 4),
            "speedup": round(record["speedup"], 3),
            "candidates": len(trials), "ok": sum(t["status"] == tuner.OK for t in trials),
            "timing": (f"median of {record.get('confirm_rounds', 3) * 5} calls each, default and tuned interleaved"
                       if record.get("confirmed") else "one median of 5 calls each"),
            "date": record.get("date"), "jax": record.get("jax"),
        })


def write_table(table: tables.Table, path: Path) -> None:
    """Atomic replace, like the cache: a killed run never leaves half a table."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(tables.table_to_json(table), indent=1) + "\n")
    os.replace(tmp, path)


def table_dir(args) -> Path:
    if args.table_dir:
        return Path(args.table_dir)
    ws = os.environ.get("BUILD_WORKSPACE_DIRECTORY")  # set by `bazel run`: write the source tree
    return Path(ws) / "packages/tuning/pallasite/tuning/data" if ws else tables.DATA_DIR


def _print_summary(records: list[dict]) -> None:
    print(f"{'implementation':26} {'shape':18} {'default ms':>10} {'tuned ms':>9} {'speedup':>7}  tuned config / status")
    for r in records:
        if "candidates" in r:
            print(f"{r['implementation']:26} {r['shape_name']:18} dry run: bucket {r['bucket']}, "
                  f"default {r['default']}, {len(r['candidates'])} candidates")
            continue
        if "error" in r or "trials" not in r:
            print(f"{r['implementation']:26} {r['shape_name']:18} {'-':>10} {'-':>9} {'-':>7}  {r.get('error')}")
            continue
        counts: dict[str, int] = {}
        for t in r["trials"]:
            counts[t["status"]] = counts.get(t["status"], 0) + 1
        d = "-" if r["default_ms"] is None else f"{r['default_ms']:.3f}"
        t = "-" if r["tuned_ms"] is None else f"{r['tuned_ms']:.3f}"
        s = f"{r['speedup']:.3f}" if "speedup" in r else "-"
        print(f"{r['implementation']:26} {r['shape_name']:18} {d:>10} {t:>9} {s:>7}  {r['tuned']} {counts}")


def _earns_entry(record: dict, min_speedup: float) -> bool:
    return record.get("speedup", 0) >= min_speedup and bool(record.get("bucket")) and bool(record.get("tuned"))


def _from_results(args, table: tables.Table, path: Path) -> int:
    """Entries from a results file measured elsewhere (the device run writes JSON lines)."""
    records = [json.loads(line) for line in Path(args.from_results).read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("op") == args.op]
    for record in records:
        if _earns_entry(record, args.min_speedup):
            table = tables.with_entry(table, _entry(record, record.get("device_kind") or args.device_kind))
    _print_summary(records)
    if not args.no_write:
        write_table(table, path)
        print(f"autotune: wrote {path} ({len(table.entries)} entries)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", required=True, choices=(GP, SSD, GDR))
    parser.add_argument("--device-kind", required=True,
                        help="the table key; must be this device's kind ('auto': this device's)")
    parser.add_argument("--implementation", action="append", help="only these keys (repeatable)")
    parser.add_argument("--shape", action="append", help="only these TARGETS shape names (repeatable)")
    parser.add_argument("--budget-s", type=float, default=20.0, help="time budget per (implementation, shape)")
    parser.add_argument("--deadline-s", type=float, default=None, help="stop starting new keys after this")
    parser.add_argument("--max-candidates", type=int, default=tuner.DEFAULT_MAX_CANDIDATES)
    parser.add_argument("--min-speedup", type=float, default=1.03)
    parser.add_argument("--confirm-rounds", type=int, default=3,
                        help="interleaved re-timing rounds of the winner against the default")
    parser.add_argument("--table-dir", help="where <op>.json lives (default: the source tree)")
    parser.add_argument("--results", help="append one JSON line per key here")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--interpret", action="store_true",
                        help="run the Triton kernels in interpret mode (a CPU smoke test of this tool)")
    parser.add_argument("--custom-shape", help="tune this shape instead, e.g. m=256,k=128,n=128,g=4")
    parser.add_argument("--no-write", action="store_true", help="measure and print, leave the table")
    parser.add_argument("--from-results", help="measure nothing: add the entries a --results file earns")
    args = parser.parse_args(argv)

    path = tables.table_path(args.op, table_dir(args))
    table = tables.load_table(args.op, path.parent)
    if table is None:
        parser.error(f"no table at {path}: it declares the buckets and candidates")
    if args.from_results:
        return _from_results(args, table, path)

    import jax

    actual = jax.devices()[0].device_kind
    if args.device_kind == "auto":
        args.device_kind = actual
    if not (args.dry_run or args.interpret) and tables.normalize_device_kind(actual) != tables.normalize_device_kind(args.device_kind):
        parser.error(f"--device-kind {args.device_kind!r} but this device is {actual!r}")
    # A dry run lists every implementation, whether or not this device runs it.
    impls = {GP: _gp_impls, SSD: _ssd_impls, GDR: _gdr_impls}[args.op](args.interpret,
                                                                        args.dry_run)
    if args.implementation:
        impls = [i for i in impls if i.name in args.implementation]
    if not impls:
        print(f"autotune: no {args.op} implementation runs on {actual}", file=sys.stderr)
        return 1
    shapes = {k: v for k, v in targets(args.op).items() if not args.shape or k in args.shape}
    if args.custom_shape:
        shapes = {"custom": {k: int(v) for k, v in (kv.split("=") for kv in args.custom_shape.split(","))}}
    start = time.perf_counter()
    records = []
    for name, dims in shapes.items():
        for impl in impls:
            if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
                records.append({"implementation": impl.name, "shape_name": name, "error": "deadline"})
                continue
            record = tune_key(args.op, impl, table, name, dims, args)
            record["device_kind"] = args.device_kind
            records.append(record)
            if not args.dry_run:
                print(json.dumps({k: record.get(k) for k in ("implementation", "shape_name", "default_ms",
                                                             "tuned_ms", "speedup")}), flush=True)
            if args.results:
                with open(args.results, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record, default=str) + "\n")
            if _earns_entry(record, args.min_speedup) and not args.dry_run:
                table = tables.with_entry(table, _entry(record, args.device_kind))
    _print_summary(records)
    if not (args.dry_run or args.no_write):
        write_table(table, path)
        print(f"autotune: wrote {path} ({len(table.entries)} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
