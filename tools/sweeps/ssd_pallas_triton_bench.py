"""H200 benchmark of the SSD Pallas Triton kernels (issue 8), with its peers in-process.

Run on a GPU machine from the repo root (mamba_ssm's public source copied into .peers/,
carried, not vendored):

    PYTHONUNBUFFERED=1 python3 tools/sweeps/ssd_pallas_triton_bench.py [--sweep] [--stages] [--out FOLDER]
    ... ssd_pallas_triton_bench.py --scan-forms [--rows 0,1,2]   # the state scans' two forms
    ... ssd_pallas_triton_bench.py --rows-stages [--rows 0,1,2]  # the row kernels' depths

For each TARGETS row (bf16, chunk 256): forward and forward+backward of the Pallas Triton
backend, the XLA path (pallasite.kernels.ssd.xla) and mamba_ssm's
mamba_chunk_scan_combined, each timed by the bench harness's queued method
(pallasite.bench.harness.steady_state: N calls back to back, one synchronisation; median
over samples), the same for all three; the kernel's error against
the XLA path; bytes moved and the fraction of the 4.3 TB/s copy rate. Writes JSON lines
to FOLDER/ssd_bench.jsonl with --out FOLDER.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

# Time the configs named here (or the table/defaults), never an autotune on a miss.
os.environ.setdefault("PALLASITE_AUTOTUNE", "0")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for sub in ("packages/reference", "packages/kernels", "packages/tuning", "packages/bench", ".peers"):
    sys.path.insert(0, os.path.join(ROOT, sub))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from knobs import knobs  # noqa: E402 - tools/sweeps/knobs.py, beside this script
import records  # noqa: E402 - tools/sweeps/records.py, beside this script

from pallasite.bench import harness  # noqa: E402
from pallasite.kernels.ssd import pallas_triton as pt  # noqa: E402
from pallasite.kernels.ssd import xla as sx  # noqa: E402
from pallasite.reference.inputs import ssd_inputs  # noqa: E402

ROWS = [(8, 4096, 32, 64, 128, 1), (4, 8192, 64, 64, 128, 8), (2, 16384, 80, 64, 128, 1)]
CHUNK = 256
COPY_RATE = 4.3e12
OUT = None  # --out


def emit(rec):
    records.emit(rec, OUT, "ssd_bench.jsonl")


def time_queued(call, sync, warmup=3, samples=15):
    """ms per call: harness.steady_state on one input set (the call closes over it)."""
    timing = harness.steady_state(lambda _: call(), [None], sync, compile_s=0.0,
                                  warmup=warmup, samples=samples)
    return timing.median_s * 1e3


def time_jax(fn, args, warmup=3, iters=15):
    return time_queued(lambda: fn(*args), harness.jax_sync, warmup, iters)


def nbytes(*arrays):
    return int(sum(a.size * a.dtype.itemsize for a in arrays))


def inputs(row):
    bsz, length, h, p, n, g = row
    x, a, b, c = ssd_inputs(jax.random.key(0), bsz, length, h, p, n, g, jnp.bfloat16)
    ch = lambda t: t.reshape(t.shape[0], length // CHUNK, CHUNK, *t.shape[2:])
    s0 = jnp.zeros((bsz, h, p, n), jnp.float32)
    dy = jax.random.normal(jax.random.key(1), x.shape, jnp.float32).astype(jnp.bfloat16)
    dfin = jax.random.normal(jax.random.key(2), s0.shape, jnp.float32)
    return ch(x), ch(a), ch(b), ch(c), s0, ch(dy), dfin


def jax_fns(mod, bs=None):
    kw = {} if bs is None else {"block_sizes": bs}
    fwd = jax.jit(lambda x, a, b, c, s0: mod.forward(x, a, b, c, s0, **kw))

    def step(x, a, b, c, s0, dy, dfin):
        y, fin, states = mod.forward(x, a, b, c, s0, **kw)
        return (y, fin) + tuple(mod.backward(x, a, b, c, states, dy, dfin, **kw))

    return fwd, jax.jit(step)


def rel(u, v):
    u = np.asarray(u.astype(jnp.float32), np.float64)
    v = np.asarray(v.astype(jnp.float32), np.float64)
    return float(np.max(np.abs(u - v)) / (np.max(np.abs(v)) + 1e-30))


def mamba_times(row):
    try:
        import torch
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as e:  # noqa: BLE001
        return {"mamba_error": repr(e)}
    bsz, length, h, p, n, g = row
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = "cuda"
    x = torch.randn(bsz, length, h, p, device=dev, generator=gen).to(torch.bfloat16)
    dt = torch.nn.functional.softplus(torch.randn(bsz, length, h, device=dev, generator=gen) - 4)
    A = -torch.exp(torch.rand(h, device=dev, generator=gen))
    B = torch.randn(bsz, length, g, n, device=dev, generator=gen).to(torch.bfloat16)
    C = torch.randn(bsz, length, g, n, device=dev, generator=gen).to(torch.bfloat16)
    dy = torch.randn_like(x)
    out = {}
    sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    with torch.no_grad():
        out["mamba_fwd_ms"] = time_queued(
            lambda: mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK), sync)
    leaves = [t.detach().requires_grad_() for t in (x, dt, A, B, C)]

    def fb():
        for t in leaves:
            t.grad = None
        mamba_chunk_scan_combined(*leaves, CHUNK).backward(dy)

    out["mamba_fwdbwd_ms"] = time_queued(fb, sync)
    return out


def bench_row(row, bs=None, peers=True):
    args = inputs(row)
    x, a, b, c, s0, dy, dfin = args
    rec = {"row": row, "chunk": CHUNK, "device": str(jax.devices()[0].device_kind)}
    if bs is not None:
        rec["block_sizes"] = pt.dataclasses.asdict(bs)
    kf, kfb = jax_fns(pt, bs)
    t0 = time.perf_counter()
    outs_k = jax.block_until_ready(kfb(*args))
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    rec["pallas_fwd_ms"] = time_jax(kf, args[:5])
    rec["pallas_fwdbwd_ms"] = time_jax(kfb, args)
    y, fin, states = jax.block_until_ready(kf(*args[:5]))
    rec["bytes_fwd"] = nbytes(x, a, b, c, y, fin, states)
    rec["bytes_fwdbwd"] = rec["bytes_fwd"] + nbytes(x, a, b, c, states, dy, dfin, x, a, b, c, s0)
    rec["copy_frac_fwd"] = rec["bytes_fwd"] / COPY_RATE / (rec["pallas_fwd_ms"] * 1e-3)
    rec["copy_frac_fwdbwd"] = rec["bytes_fwdbwd"] / COPY_RATE / (rec["pallas_fwdbwd_ms"] * 1e-3)
    if peers:
        xf, xfb = jax_fns(sx)
        outs_x = jax.block_until_ready(xfb(*args))
        names = ("y", "final", "dx", "da", "db", "dc", "dinitial")
        rec["err_vs_xla"] = {k: rel(u, v) for k, u, v in zip(names, outs_k, outs_x)}
        del outs_x
        rec["xla_fwd_ms"] = time_jax(xf, args[:5], warmup=2, iters=10)
        rec["xla_fwdbwd_ms"] = time_jax(xfb, args, warmup=2, iters=10)
        rec["speedup_fwd"] = rec["xla_fwd_ms"] / rec["pallas_fwd_ms"]
        rec["speedup_fwdbwd"] = rec["xla_fwdbwd_ms"] / rec["pallas_fwdbwd_ms"]
    del outs_k, y, fin, states, args
    emit(rec)
    return rec


def scan_operands(a):
    """The state scans' per-chunk operands from a [b, nc, C, h]: the cumulative decay pair
    acs, the forward scan's weights w_out = exp(acs_last - acs), the reverse scan's w_in =
    exp(acs) and each chunk's whole decay e = exp(acs_last)."""
    acs, last = pt._cumsums(a)
    w_out = jnp.exp(pt._segment(tuple(t[:, :, None, :] for t in last), acs))
    return acs, w_out, jnp.exp(acs[0] + acs[1]), jnp.exp(last[0] + last[1])


def stages(row, bs=None):
    """Each pallas_call of the default config alone (ms), and the XLA prologue."""
    x, a, b, c, s0, dy, dfin = inputs(row)
    bs = pt.resolve_block_sizes(bs, CHUNK)
    acs, w_out, w_in, e = scan_operands(a)
    states, _ = pt._state_scan(x, b, w_out, e, s0, bs, False)
    grads, _, _ = pt._state_scan_reverse(dy, c, w_in, e, states, dfin, bs, False)
    fns = {
        "prologue": (pt._cumsums, (a,)),
        "state_scan": (lambda x, b, w, e, s0: pt._state_scan(x, b, w, e, s0, bs, False),
                       (x, b, w_out, e, s0)),
        "chunk_output": (
            lambda x, b, c, acs, st: pt._chunk_output(x, b, c, acs, st, bs, False),
            (x, b, c, acs, states),
        ),
        "state_scan_reverse": (
            lambda d, c, w, e, st, f: pt._state_scan_reverse(d, c, w, e, st, f, bs, False),
            (dy, c, w_in, e, states, dfin),
        ),
        "bwd_rows_j": (
            lambda *t: pt._bwd_rows_j(*t, bs, False), (x, dy, b, c, acs, grads)
        ),
        "bwd_rows_i": (
            lambda *t: pt._bwd_rows_i(*t, bs, False), (x, dy, b, c, acs, states)
        ),
    }
    rec = {"row": row, "stages_ms": {k: time_jax(jax.jit(f), t) for k, (f, t) in fns.items()}}
    emit(rec)


def scan_forms(row):
    """The state scans alone, and the whole forward and forward+backward, with the chunk
    weights on the right operand (the default) and on the left (SCAN_WEIGHTS_ON_LEFT),
    each form's outputs against the default's (max abs)."""
    x, a, b, c, s0, dy, dfin = inputs(row)
    bs = pt.resolve_block_sizes(None, CHUNK)
    _, w_out, w_in, e = scan_operands(a)
    first = None
    for left in (pt.SCAN_WEIGHTS_ON_LEFT, not pt.SCAN_WEIGHTS_ON_LEFT):
        with knobs(pt, SCAN_WEIGHTS_ON_LEFT=left):  # read when the kernels are traced
            scan = jax.jit(lambda x, b, w, e, s0: pt._state_scan(x, b, w, e, s0, bs, False))
            reverse = jax.jit(lambda d, c, w, e, st, f: pt._state_scan_reverse(
                d, c, w, e, st, f, bs, False))
            states, final = scan(x, b, w_out, e, s0)
            outs = (states, final) + tuple(jax.tree.leaves(
                reverse(dy, c, w_in, e, states, dfin)))
            first = first or outs
            kf, kfb = jax_fns(pt)
            emit({"row": row, "scan_weights_on_left": left,
                  "state_scan_ms": time_jax(scan, (x, b, w_out, e, s0)),
                  "state_scan_reverse_ms": time_jax(reverse, (dy, c, w_in, e, states, dfin)),
                  "pallas_fwd_ms": time_jax(kf, (x, a, b, c, s0)),
                  "pallas_fwdbwd_ms": time_jax(kfb, (x, a, b, c, s0, dy, dfin)),
                  "max_abs_to_default": [float(jnp.max(jnp.abs(u.astype(jnp.float32)
                                                               - v.astype(jnp.float32))))
                                         for u, v in zip(outs, first)]})


def rows_stages(row):
    """The backward's two row kernels alone and the whole forward+backward at each
    pipeline depth of theirs (pt.BWD_ROWS_NUM_STAGES; None: the config's), each depth's
    gradients against the default's (max abs)."""
    x, a, b, c, s0, dy, dfin = inputs(row)
    bs = pt.resolve_block_sizes(None, CHUNK)
    acs, w_out, w_in, e = scan_operands(a)
    states, _ = pt._state_scan(x, b, w_out, e, s0, bs, False)
    grads, _, _ = pt._state_scan_reverse(dy, c, w_in, e, states, dfin, bs, False)
    first = None
    for depth in (None,) + tuple(d for d in (1, 2, 3) if d != bs.num_stages):
        with knobs(pt, BWD_ROWS_NUM_STAGES=depth):  # read when the kernels are traced
            rows_j = jax.jit(lambda *t: pt._bwd_rows_j(*t, bs, False))
            rows_i = jax.jit(lambda *t: pt._bwd_rows_i(*t, bs, False))
            _, kfb = jax_fns(pt)
            outs = jax.tree.leaves(kfb(x, a, b, c, s0, dy, dfin))
            first = first or outs
            emit({"row": row, "bwd_rows_num_stages": depth or bs.num_stages,
                  "bwd_rows_j_ms": time_jax(rows_j, (x, dy, b, c, acs, grads)),
                  "bwd_rows_i_ms": time_jax(rows_i, (x, dy, b, c, acs, states)),
                  "pallas_fwdbwd_ms": time_jax(kfb, (x, a, b, c, s0, dy, dfin)),
                  "max_abs_to_default": [float(jnp.max(jnp.abs(u.astype(jnp.float32)
                                                               - v.astype(jnp.float32))))
                                         for u, v in zip(outs, first)]})


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--scan-forms", action="store_true",
                    help="only the state scans' two forms (SCAN_WEIGHTS_ON_LEFT), each row")
    ap.add_argument("--rows-stages", action="store_true",
                    help="only the backward row kernels' pipeline depths, each row")
    ap.add_argument("--rows", default="0,1,2")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpreter (CPU)")
    ap.add_argument("--out", default=None, help="folder for ssd_bench.jsonl")
    opts = ap.parse_args()
    OUT = opts.out
    if OUT:
        os.makedirs(OUT, exist_ok=True)
    if opts.smoke:
        global CHUNK, ROWS
        CHUNK, ROWS = 32, [(2, 64, 4, 16, 16, 1), (1, 64, 4, 16, 16, 2), (1, 64, 2, 16, 16, 1)]
        pt.forward = functools.partial(pt.forward, interpret=True)
        pt.backward = functools.partial(pt.backward, interpret=True)
        real_call = pt.pl.pallas_call
        pt.pl.pallas_call = lambda *a, **k: real_call(*a, **{**k, "interpret": True})
    emit({"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
          "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    rows = [ROWS[i] for i in map(int, opts.rows.split(","))]
    if opts.scan_forms:
        for row in rows:
            scan_forms(row)
        return
    if opts.rows_stages:
        for row in rows:
            rows_stages(row)
        return
    for row in rows:
        bench_row(row)
    # mamba_ssm last: its autotuning compiles many configs on first use.
    for row in rows:
        emit({"row": row, **mamba_times(row)})
    if opts.stages:
        stages(ROWS[0])
    if opts.sweep:
        sweep = [
            dict(heads=1), dict(block_n=128), dict(block_t=64), dict(block_m=128, num_warps=8),
            dict(block_m=32),
        ]
        for i in (0,):
            for cfg in sweep:
                try:
                    bench_row(ROWS[i], pt.BlockSizes(**cfg), peers=False)
                except Exception as e:  # noqa: BLE001
                    emit({"row": ROWS[i], "block_sizes": cfg, "error": repr(e)[:500]})


if __name__ == "__main__":
    main()
