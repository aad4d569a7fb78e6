"""The decode steps' bandwidth against their peers, on one GPU, in one process: pallasite's
selective_state_update and gated_delta_rule_step (Pallas Triton and XLA) beside mamba_ssm's
selective_state_update and flash-linear-attention's fused recurrent step, and a copy of the
same state bytes (the ceiling). JSON lines to $OUT/decode_steps.jsonl, a table on stdout.

    OUT=folder PYTHONPATH=<the four package roots>:.peers python3 tools/sweeps/decode_steps.py
    python3 tools/sweeps/decode_steps.py --smoke      # tiny shapes, interpreters, no peers
    ... decode_steps.py --delta-configs               # also the delta step's launch grid

`--delta-configs` times gated_delta_rule_step's Pallas Triton kernel at every (BLOCK_V,
NUM_WARPS) of DELTA_CONFIGS as well (implementation `pallas_triton[bv=..,w=..]`), each
compared with the XLA step's y (relative L2) from the same state.

A step reads and writes each named slot's state once (fp32), which is nearly all of its
traffic: GB/s counts the named state twice plus the token's inputs and outputs, and
`of_copy` divides it by the copy's rate (an XLA copy of the named slots' state, read once
and written once, timed the same way). The goal for pallasite's kernels is 0.8.

pallasite's steps run as a server runs them: the cache donated, each call taking the
cache the last call returned, so the update is in place. mamba_ssm updates its state
tensor in place. fla's recurrent step (T = 1, one state per row, every slot named) returns
a new state tensor: the same bytes, read and written once. Timing is the bench harness's
queued method (calls back to back, one synchronisation per sample). Each peer's y is
compared with pallasite's (relative L2) from the same starting state, as a check that
both ran the same step; correctness itself is tests/test_ssd_decode.py's and
tests/test_gated_delta_rule_step.py's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.bench import harness, peers
from pallasite.kernels import gated_delta_rule_step, selective_state_update

F32, BF16 = jnp.float32, jnp.bfloat16
DELTA_CONFIGS = [(bv, w) for bv in (32, 64, 128) for w in (1, 2, 4, 8)]


class _Chain:
    """A donated step called back to back: each call takes the cache the last returned."""

    def __init__(self, step, cache):
        self.step, self.cache = step, cache

    def __call__(self, token):
        y, self.cache = self.step(self.cache, token)
        return y


def _time(call, sets, sync):
    t = harness.steady_state(call, sets, sync, compile_s=0.0, warmup=3, samples=10,
                             budget_s=1.0)
    return t.median_s


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _nbytes(tree) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree)))


def _first_y_and_time(step, impl, cache, sets):
    """(y of sets[0] from `cache`, seconds per call of the donated step chained over
    `sets`) of step(state, token, implementation=impl)."""
    run = functools.partial(step, implementation=impl)
    y = np.asarray(jax.jit(run)(cache, sets[0])[0], np.float32)
    chain = _Chain(jax.jit(run, donate_argnums=0), cache + 0.0)
    jax.block_until_ready(chain(sets[0]))
    return y, _time(chain, sets, harness.jax_sync)


def _pallasite(step, cache, sets, interpret):
    """step(state, token, implementation) on each of pallasite's backends (the kernel only
    compiled): ([(name, seconds)], {backend: y of sets[0] from `cache`})."""
    out, first_y = [], {}
    for impl in ("pallas_triton", "xla"):
        if interpret and impl == "pallas_triton":
            continue  # the interpreter is not timed; the tests check it
        first_y[impl], seconds = _first_y_and_time(step, impl, cache, sets)
        out.append(("pallasite." + impl, seconds))
    return out, first_y


def _copy_rate(named_bytes: int) -> float:
    """GB/s of an XLA copy moving `named_bytes` (read) into a new buffer (write)."""
    src = [jnp.ones((named_bytes // 4,), F32) + s for s in range(3)]
    copy = jax.jit(lambda a: a * 1.0)
    jax.block_until_ready(copy(src[0]))
    return 2 * named_bytes / _time(copy, src, harness.jax_sync) / 1e9


# ------------------------------------------------------------------- selective_state_update


def _mamba_tokens(b, h, p, g, n, seed):
    k = jax.random.split(jax.random.key(seed), 5)
    return {"x": jax.random.normal(k[0], (b, h, p), BF16),
            "dt": jax.random.normal(k[1], (b, h), F32),
            "B": jax.random.normal(k[2], (b, g, n), BF16),
            "C": jax.random.normal(k[3], (b, g, n), BF16),
            "z": jax.random.normal(k[4], (b, h, p), BF16)}


def mamba_step(rows, slots, h, p, g, n, interpret, with_peers):
    key = jax.random.key(0)
    cache = jax.random.normal(key, (slots, h, p, n), F32)
    A = -jnp.exp(jax.random.normal(jax.random.key(1), (h,), F32))
    D = jax.random.normal(jax.random.key(2), (h,), F32)
    dt_bias = jax.random.normal(jax.random.key(3), (h,), F32)
    order = jax.random.permutation(jax.random.key(4), slots)[:rows].astype(jnp.int32)
    sets = [_mamba_tokens(rows, h, p, g, n, s) for s in range(3)]
    named = rows * h * p * n * 4
    moved = 2 * named + _nbytes(sets[0]) + rows * h * p * 2
    def step(state, t, implementation):
        return selective_state_update(state, t["x"], t["dt"], A, t["B"], t["C"], D=D,
                                      z=t["z"], dt_bias=dt_bias, dt_softplus=True,
                                      state_batch_indices=order,
                                      implementation=implementation)

    out, first_y = _pallasite(step, cache, sets, interpret)
    if with_peers and (why := peers.mamba_missing(None)) is None:
        import torch
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as ssu

        t_ = lambda a: torch.from_dlpack(jax.block_until_ready(a))  # noqa: E731
        state = t_(cache + 0.0)
        A_t = t_(A)[:, None, None].expand(h, p, n)
        D_t, bias_t = t_(D)[:, None].expand(h, p), t_(dt_bias)[:, None].expand(h, p)
        idx = t_(order)
        tsets = [{k: t_(v) for k, v in s.items()} for s in sets]

        def peer(tok):
            dt = tok["dt"][:, :, None].expand(rows, h, p)
            return ssu(state, tok["x"], dt, A_t, tok["B"], tok["C"], D=D_t, z=tok["z"],
                       dt_bias=bias_t, dt_softplus=True, state_batch_indices=idx)

        y = peer(tsets[0]).float().cpu().numpy()
        state.copy_(t_(cache + 0.0))
        out.append(("mamba_ssm.triton", _time(peer, tsets, lambda _o: peers.torch_sync()),
                    _rel(y, first_y.get("pallas_triton", first_y["xla"]))))
    elif with_peers:
        print(f"mamba_ssm: {why}", file=sys.stderr)
    return named, moved, out


# -------------------------------------------------------------------- gated_delta_rule_step


def _delta_tokens(b, hk, hv, dk, dv, seed):
    k = jax.random.split(jax.random.key(seed), 5)
    return {"q": jax.random.normal(k[0], (b, hk, dk), BF16),
            "k": jax.random.normal(k[1], (b, hk, dk), BF16),
            "v": jax.random.normal(k[2], (b, hv, dv), BF16),
            "g": -jax.nn.softplus(jax.random.normal(k[3], (b, hv), F32)),
            "beta": jax.nn.sigmoid(jax.random.normal(k[4], (b, hv), F32))}


def _delta_configs(step, cache, sets, reference):
    """The Triton step at each (BLOCK_V, NUM_WARPS) of DELTA_CONFIGS (the module's own
    restored after): [(name, seconds, rel_l2 against `reference`)]."""
    from pallasite.kernels.gated_delta import step_pallas_triton as kernel

    own = (kernel.BLOCK_V, kernel.NUM_WARPS)
    out = []
    try:
        for bv, warps in DELTA_CONFIGS:
            kernel.BLOCK_V, kernel.NUM_WARPS = bv, warps
            jax.clear_caches()
            y, seconds = _first_y_and_time(step, "pallas_triton", cache, sets)
            out.append((f"pallas_triton[bv={bv},w={warps}]", seconds, _rel(y, reference)))
    finally:
        kernel.BLOCK_V, kernel.NUM_WARPS = own
        jax.clear_caches()
    return out


def delta_step(rows, slots, hk, hv, dk, dv, interpret, with_peers, configs=False):
    cache = jax.random.normal(jax.random.key(0), (slots, hv, dk, dv), F32) * 0.1
    order = jax.random.permutation(jax.random.key(4), slots)[:rows].astype(jnp.int32)
    sets = [_delta_tokens(rows, hk, hv, dk, dv, s) for s in range(3)]
    named = rows * hv * dk * dv * 4
    moved = 2 * named + _nbytes(sets[0]) + rows * hv * dv * 2
    def step(state, t, implementation):
        return gated_delta_rule_step(state, t["q"], t["k"], t["v"], t["g"], t["beta"],
                                     state_batch_indices=order,
                                     use_qk_l2norm_in_kernel=True,
                                     implementation=implementation)

    out, first_y = _pallasite(step, cache, sets, interpret)
    if configs and not interpret:
        out += _delta_configs(step, cache, sets, first_y["xla"])
    if with_peers and rows == slots and (why := peers.fla_missing()) is None:
        import torch
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_step

        t_ = lambda a: torch.from_dlpack(jax.block_until_ready(a))  # noqa: E731
        init = t_(cache[order] + 0.0)  # row i's state (fla has no slot indices)
        tsets = [{k: t_(v)[:, None] for k, v in s.items()} for s in sets]  # T = 1

        def peer(tok):
            o, _ = fla_step(tok["q"], tok["k"], tok["v"], g=tok["g"], beta=tok["beta"],
                            initial_state=init, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
            return o

        y = peer(tsets[0])[:, 0].float().cpu().numpy()
        out.append(("fla.triton", _time(peer, tsets, lambda _o: peers.torch_sync()),
                    _rel(y, first_y.get("pallas_triton", first_y["xla"]))))
    elif with_peers and rows == slots:
        print(f"fla: {why}", file=sys.stderr)
    return named, moved, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes through the interpreters")
    p.add_argument("--delta-configs", action="store_true",
                   help="also the delta step's kernel at every (BLOCK_V, NUM_WARPS)")
    args = p.parse_args(argv)
    smoke = args.smoke or jax.default_backend() == "cpu"
    cases = ([("mamba2_tiny", mamba_step, (4, 6, 4, 16, 1, 16)),
              ("delta_tiny", delta_step, (4, 6, 2, 4, 16, 16))] if smoke else
             [("mamba2_2.7b_256_of_256", mamba_step, (256, 256, 80, 64, 1, 128)),
              ("mamba2_2.7b_64_of_512", mamba_step, (64, 512, 80, 64, 1, 128)),
              ("qwen3_next_256_of_256", delta_step, (256, 256, 16, 32, 128, 128)),
              ("qwen3_next_64_of_512", delta_step, (64, 512, 16, 32, 128, 128))])
    path = os.path.join(os.environ.get("OUT", "."), "decode_steps.jsonl")
    with open(path, "a") as f:
        for name, run, dims in cases:
            extra = {"configs": args.delta_configs} if run is delta_step else {}
            named, moved, results = run(*dims, interpret=smoke, with_peers=not smoke, **extra)
            ceiling = _copy_rate(named)
            for impl, seconds, *rel in results:
                rate = moved / seconds / 1e9
                rec = {"case": name, "implementation": impl, "time_ms": seconds * 1e3,
                       "gb_per_s": rate, "copy_gb_per_s": ceiling, "of_copy": rate / ceiling,
                       "rel_l2_vs_pallasite": rel[0] if rel else None,
                       "device": jax.devices()[0].device_kind}
                f.write(json.dumps(rec) + "\n")
                print(f"{name:26s} {impl:24s} {seconds * 1e3:8.4f} ms {rate:8.1f} GB/s "
                      f"{rate / ceiling:6.2f} of copy ({ceiling:.0f} GB/s)"
                      + (f"  rel_l2 {rel[0]:.2e}" if rel else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
