"""pallasite's main job: every op against its reference and its peers on the present device.

    tools/bazel run //packages/bench -- --quick          # or: python -m pallasite.bench
    pallasite-bench --shape olmoe --op grouped_projection --implementation triton

On a GPU/TPU the default suite is docs/targets.md's shapes (`--quick`: one small shape per op).
Without one it runs the CPU suite: the Pallas kernels through the interpreters for parity,
the XLA paths timed, and says that kernel timings need a GPU. Records go to
<results>/records.jsonl and .csv (one per key, see records.py), the plot to
<results>/roofline.png. docs/benchmarks.md explains every field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import textwrap
import time

from pallasite.bench import harness, impls, ops, peers, records, suites

CPU_NOTE = ("No GPU or TPU here: the Pallas kernels run through the interpreters on small "
            "shapes for parity only; the XLA paths are timed on the CPU. Kernel timings "
            "need a GPU (or TPU).")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pallasite-bench", description=__doc__.split("\n")[0],
                                epilog=LEGEND.replace("* a peer", "In the table, * marks a peer")
                                + " " + DOCS)
    p.add_argument("--quick", action="store_true", help="one small shape per op")
    p.add_argument("--smoke", action="store_true",
                   help="smallest subset (one tiny shape per op, forward): for tests")
    p.add_argument("--suite", choices=suites.SUITES,
                   help="force a suite (default: targets on an accelerator, cpu without)")
    p.add_argument("--op", action="append", choices=(ops.GP, ops.SSD, ops.MAMBA, ops.GMLP, ops.GDR),
                   dest="ops")
    p.add_argument("--shape", action="append", dest="shapes",
                   help=f"shape name (substring); known: {', '.join(suites.shape_names())}")
    p.add_argument("--implementation", action="append", dest="impls",
                   help="implementation name (substring), e.g. triton, xla, ragged_dot")
    p.add_argument("--direction", action="append", choices=ops.DIRECTIONS, dest="directions")
    p.add_argument("--dtype", action="append", choices=ops.DTYPES, dest="dtypes",
                   help="the cases of this dtype only (e.g. fp8 in the mlp suite)")
    p.add_argument("--results", default="results", help="results folder (default ./results)")
    p.add_argument("--no-peers", action="store_true", help="pallasite's implementations only")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--measure-ceilings", action="store_true",
                   help="measure a large matmul and copy; use them as the roofline")
    p.add_argument("--mamba-ssm-path", default=None,
                   help="folder holding mamba_ssm (default $PALLASITE_PEERS or "
                        "./.peers)")
    p.add_argument("--block-sizes", default=None, help="JSON dict passed as block_sizes")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--budget-s", type=float, default=20.0, help="timed seconds per record")
    p.add_argument("--copies", type=int, default=None, help="input sets to rotate (override)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks of crashes")
    args = p.parse_args(argv)
    _check_names(p, args)
    return args


def _check_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error (status 2) listing the valid names where a --shape or
    --implementation pattern matches none: a typo would otherwise run nothing and exit 0."""
    for flag, patterns, known in (("--shape", args.shapes, suites.shape_names()),
                                  ("--implementation", args.impls, _impl_names())):
        for pattern in patterns or ():
            if not any(pattern in name for name in known):
                parser.error(f"{flag} {pattern!r} matches no name (substrings of): "
                             + ", ".join(known))


def _impl_names(op: str | None = None) -> list[str]:
    return list(dict.fromkeys(i.name for i in impls.IMPLS if op in (None, i.op)))


def choose_cases(args, backend: str, devices: int = 1) -> tuple[str, list[ops.Case]]:
    name = args.suite or ("smoke" if args.smoke else
                          "cpu" if backend == "cpu" else "quick" if args.quick else "targets")
    cases = suites.suite(name, devices)
    chosen = suites.filter_cases(cases, ops_=args.ops, shapes=args.shapes,
                                 directions=args.directions, dtypes=args.dtypes)
    if not chosen and args.shapes:  # a named shape from another suite
        every = [c for s in ("targets", "extra", "quick", "cpu") for c in suites.suite(s)]
        chosen = suites.filter_cases(every, ops_=args.ops, shapes=args.shapes,
                                     directions=args.directions, dtypes=args.dtypes)
    return name, list(dict.fromkeys(chosen))


def _fmt(value, spec, scale=1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


TABLE_WIDTH = 120
_SHORT_OP = {ops.GP: "gp", ops.SSD: "ssd", ops.MAMBA: "mamba", ops.GMLP: "mlp",
             ops.GDR: "delta"}


LEGEND = ("* a peer, not pallasite's. compile_s: lower and compile; time_ms: median per call. "
          "roof%: the device's roofline time for the op's flops and minimum bytes, "
          "max(flops / peak, bytes / bandwidth), as a share of the measured time (100 is at "
          "the ceiling). rel_l2: relative L2 error ||out - ref|| / ||ref|| of the outputs "
          "against the reference; status wrong where it exceeds the dtype's tolerance.")
DOCS = "Every field, and how it is measured: docs/benchmarks.md."


def table(recs: list[records.Record], width: int = TABLE_WIDTH) -> str:
    """One line per record, at most `width` columns, then the legend. A note longer than
    the room left at the end of its row goes whole onto indented lines below it: notes
    are reasons (why unsupported, what crashed), useless cut to a few characters."""
    head = ("kernel", "shape", "implementation", "status", "compile_s", "time_ms",
            "TFLOP/s", "TB/s", "roof%", "rel_l2", "note")
    rows = [head]
    for r in recs:
        op, _, direction = r.kernel.partition(".")
        impl = r.implementation + ("*" if r.peer else "") + (f" @{r.mesh}" if r.mesh else "")
        note = " ".join((r.reason or r.timing).split())  # one line per record
        if r.timing == "device" and harness.host_bound(r.host_issue_time,
                                                       r.steady_state_time):
            note += " host-bound"  # a CPU run's dispatch and work share the host anyway
        rows.append((f"{_SHORT_OP.get(op, op)}.{direction}", r.shape.split("[")[0], impl,
                     r.status, _fmt(r.compile_time, ".2f"),
                     _fmt(r.steady_state_time, ".4g", 1e3), _fmt(r.tflops, ".3g"),
                     _fmt(r.tbps, ".3g"), _fmt(r.roofline_fraction, ".1f", 100),
                     _fmt(r.error_rel_l2, ".1e"), note))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head) - 1)]
    room = max(len(head[-1]), width - sum(widths) - 2 * len(widths))
    lines = []
    for row in rows:
        cells = [str(c).ljust(w) for c, w in zip(row, widths)]
        note = str(row[-1])
        lines.append("  ".join(cells + [note if len(note) <= room else ""]).rstrip())
        if len(note) > room:
            lines += textwrap.wrap(note, width, initial_indent="    ",
                                   subsequent_indent="    ")
    lines.insert(1, "-" * min(width, max(len(line) for line in lines)))
    return "\n".join(lines + textwrap.wrap(LEGEND, width) + [DOCS])


def scaling_table(recs: list[records.Record]) -> str:
    """Per shape and implementation: one-device time, weak-scaling (data) time and its
    efficiency (one-device time / data-parallel time, 1.0 is perfect), tensor-parallel
    time and its speedup over one device."""
    timed = [r for r in recs if r.status == "ok" and r.steady_state_time]
    base = {(r.kernel, r.shape.split("[")[0], r.implementation): r for r in timed
            if not r.mesh}
    lines = ["scaling: kernel  shape  implementation  mesh  time_ms  vs one device"]
    for r in timed:
        shape = r.shape.split("[")[0]
        one = base.get((r.kernel, shape, r.implementation))
        if not r.mesh or one is None:
            continue
        ratio = one.steady_state_time / r.steady_state_time
        what = ("weak-scaling efficiency" if r.mesh.startswith("data") else "speedup")
        lines.append(f"scaling: {r.kernel}  {shape}  {r.implementation}  {r.mesh}  "
                     f"{r.steady_state_time * 1e3:.4g} (one device "
                     f"{one.steady_state_time * 1e3:.4g})  {what} {ratio:.3f}")
    return "\n".join(lines)


def _progress(i: int, total: int, case: ops.Case, impl: impls.Impl, start: float) -> None:
    line = (f"[{i}/{total}] {time.perf_counter() - start:6.1f}s  {case.kernel} "
            f"{case.shape_name} {impl.name}" + (f" [{case.mesh_name}]" if case.mesh else ""))
    print(line, file=sys.stderr, flush=True)


HOST_DEVICES = 8


def _host_devices() -> None:
    """Eight CPU devices, as the tests have, set before JAX starts (unless XLA_FLAGS
    names a count). The Mosaic GPU interpreter runs each warpgroup as a thread executing
    its own XLA computation with host-callback barriers between them; on one CPU device
    the fp8 kernels' three warpgroups deadlocked in those barriers in about half the runs
    on two cores (2026-12-03), on eight in none. GPU and TPU runs are unaffected (only the
    CPU platform's device count changes)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={HOST_DEVICES}").strip()


def main(argv=None) -> int:
    args = parse_args(argv)
    # `bazel run` starts in the runfiles tree: resolve relative paths where the user ran it
    # (os.path.join keeps an absolute second argument as it is).
    if os.environ.get("BUILD_WORKING_DIRECTORY"):
        start = os.environ["BUILD_WORKING_DIRECTORY"]
        args.results = os.path.join(start, args.results)
        args.mamba_ssm_path = os.path.join(start, peers.peers_path(args.mamba_ssm_path))
    # A kernel call that misses the tuned table tunes itself on a GPU: its record's
    # compile_time would include the tuning and it would time a config the record does not
    # name. The suite times the tables' configs and the defaults; PALLASITE_AUTOTUNE=1 in
    # the environment times what autotune-on-miss picks instead (docs/tuning.md).
    os.environ.setdefault("PALLASITE_AUTOTUNE", "0")
    _host_devices()
    import jax

    from pallasite.bench import roofline, runner

    backend = jax.default_backend()
    suite_name, cases = choose_cases(args, backend, jax.device_count())
    pairs = [(c, i) for c in cases for i in impls.select(c.op, args.impls, c.dtype, c.direction)
             if not (args.no_peers and i.peer)]
    if not pairs:  # each filter matched something, but not together
        print(f"pallasite-bench: nothing to run: no case of suite {suite_name!r} passes "
              "these filters with an implementation matching them. Implementations: "
              + "; ".join(f"{op}: {', '.join(_impl_names(op))}" for op in (ops.GP, ops.SSD, ops.MAMBA, ops.GMLP, ops.GDR))
              + f". Shapes: {', '.join(suites.shape_names())}.", file=sys.stderr)
        return 2
    if args.list:
        for c, i in pairs:
            print(c.kernel, c.shape, i.name)
        return 0
    try:  # before any benchmark: a run must not fail, or lose its records, at the end
        records.prepare(args.results)
    except OSError as err:
        print(f"pallasite-bench: --results {args.results!r} is not writable: {err}",
              file=sys.stderr)
        return 2
    device = jax.devices()[0]
    roof = roofline.measure_ceilings(device) if args.measure_ceilings else None
    options = {"mamba_ssm_path": args.mamba_ssm_path, "warmup": args.warmup,
               "samples": args.samples, "budget_s": args.budget_s, "copies": args.copies,
               "verbose": args.verbose,
               "block_sizes": json.loads(args.block_sizes) if args.block_sizes else None}
    ctx = runner.Context(options, roof)
    if roof is not None:  # keep the measured ceilings beside the records they judge
        os.makedirs(args.results, exist_ok=True)
        with open(os.path.join(args.results, "ceilings.json"), "w") as f:
            json.dump({**dataclasses.asdict(roof), "device_kind": device.device_kind,
                       **ctx.env}, f, indent=1)
    _say(f"pallasite-bench: {device.device_kind} ({backend}), suite {suite_name!r}, "
         f"{len(pairs)} records; roofline {ctx.roof.name} ({ctx.roof.source})")
    if backend == "cpu":
        _say(CPU_NOTE)
        if args.quick and not args.suite:
            _say("--quick on a CPU: ran the cpu suite instead (tiny shapes, interpreted "
                 "kernels for parity; the quick shapes need a GPU or TPU).")
    start = time.perf_counter()
    done: list[records.Record] = []
    for n, (case, impl) in enumerate(pairs, 1):
        _progress(n, len(pairs), case, impl, start)
        done.append(runner.run_one(case, impl, ctx))
        records.write(done[-1:], args.results)  # as we go: a killed run keeps its records
    print(table(done))
    if any(r.mesh for r in done):
        print(scaling_table(done))
    if not args.no_plot:
        print(_plot(done, ctx.roof, args.results)[1])
    print(f"records: {os.path.join(args.results, records.JSONL)} (+ .csv); {_counts(done)}")
    if backend == "cpu":
        _say(CPU_NOTE)
    return exit_status(done)


def _counts(recs: list[records.Record]) -> str:
    """"9 ok, 1 wrong (1 of them a peer's), ...": a peer's wrong result is counted, and
    told apart since it does not set the exit status."""
    parts = []
    for status in records.STATUSES:
        parts.append(f"{sum(r.status == status for r in recs)} {status}")
        peers = sum(r.status == status == "wrong" and r.peer for r in recs)
        if peers:
            parts[-1] += f" ({peers} of them a peer's)"
    return ", ".join(parts)


def exit_status(recs: list[records.Record]) -> int:
    """1 where one of pallasite's own implementations is wrong, else 0. A peer's wrong
    result is reported (records, table, counts) but is not pallasite's failure: the
    status is what CI and scripts act on."""
    return 1 if any(r.status == "wrong" and not r.peer for r in recs) else 0


def _say(text: str) -> None:
    print(textwrap.fill(text, TABLE_WIDTH))


def _plot(recs, roof, folder):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None, ("plot: skipped, matplotlib is not installed (pip install "
                      "'pallasite[bench]' or matplotlib); the records and table above are "
                      "complete")
    from pallasite.bench import plot

    path = plot.roofline_png(recs, roof, os.path.join(folder, "roofline.png"))
    return path, (f"plot: {path}" if path else
                  "plot: nothing was timed (interpreter parity runs are not timed), no plot")


if __name__ == "__main__":
    sys.exit(main())
