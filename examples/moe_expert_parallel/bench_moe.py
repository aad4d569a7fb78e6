"""Throughput of the expert-parallel MoE block: fwd+bwd tokens/s on 1..D GPUs, the experts
as one pallasite grouped_mlp ("pallasite"; "pallasite_fused" with fuse_activation=True;
"pallasite_fp8" and "pallasite_fp8_fused" with recipe="fp8"), as three grouped_projection calls
("pallasite_unfused": what records before 2026-12-03 call "pallasite", under the key
"project"), or as three jax.lax.ragged_dot calls ("ragged_dot", the peer).

    python examples/moe_expert_parallel/bench_moe.py --config mixtral --devices 1 2 \\
        --experts pallasite pallasite_unfused ragged_dot --capacity-factor none 1.25 \\
        --out moe.jsonl

Weak scaling: each device routes `--tokens` tokens of its own. fwd+bwd is
value_and_grad of a weighted sum of the block's output with respect to every weight and
the input. Timing is pallasite.bench's: warm-up, then samples of N calls queued back to
back and one sync, the median of time / N; the inputs rotate over two sets. Model TFLOP/s
counts the expert matmuls only: 3 x 2 d f per (token, expert) pick forward, 3x that for
fwd+bwd (rows dropped past a capacity are still counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import time

# XLA's default GPU lowering of ragged-all-to-all (jaxlib 0.11.2) took 206 ms for this
# block's fwd+bwd dispatch on one H200, its decomposer 5.6 ms (docs/performance.md): on
# unless the caller's XLA_FLAGS say otherwise. Read when JAX starts, so set before import.
RAGGED_DECOMPOSER = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer"
if RAGGED_DECOMPOSER not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {RAGGED_DECOMPOSER}=true".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import moe  # noqa: E402
from pallasite.bench import harness  # noqa: E402

CONFIGS = {
    # Mixtral 8x7B's FFN: 8 experts of 4096 -> 14336, top 2.
    "mixtral": moe.MoeConfig(d_model=4096, d_ff=14336, num_experts=8, top_k=2),
    # Qwen3-30B-A3B's: 128 narrow experts, 2048 -> 768, top 8.
    "qwen3": moe.MoeConfig(d_model=2048, d_ff=768, num_experts=128, top_k=8),
}
EXPERTS = {
    "pallasite": moe.pallasite_experts,
    "pallasite_fused": moe.pallasite_fused_experts,
    "pallasite_fp8": moe.pallasite_fp8_experts,
    "pallasite_fp8_fused": functools.partial(moe.pallasite_fp8_experts, fuse_activation=True),
    "pallasite_unfused": lambda compute: moe.unfused_experts(moe.pallasite_project(compute)),
    "ragged_dot": lambda compute: moe.unfused_experts(moe.ragged_dot_project(compute)),
}


def _step(config, mesh, dispatch, capacity_factor, experts):
    block = functools.partial(moe.moe_block, config=config, mesh=mesh, dispatch=dispatch,
                              capacity_factor=capacity_factor,
                              experts=experts(jnp.dtype(config.compute)))

    def loss(params, x, weights):
        return jnp.sum(block(params, x).astype(jnp.float32) * weights)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def run(config_name, devices, experts_name, dispatch, capacity_factor, tokens, seed=0):
    """One timed variant, as a record (dict)."""
    config = CONFIGS[config_name]
    chips = jax.devices()[:devices]
    mesh = jax.make_mesh((devices,), ("expert",), devices=chips,
                         axis_types=(jax.sharding.AxisType.Explicit,))

    def put(a, *spec):
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))

    params = moe.init_params(jax.random.key(seed), config, jnp.bfloat16)
    params = {name: put(p, *(() if name == "router" else ("expert",)))
              for name, p in params.items()}
    total = tokens * devices
    sets = []
    for i in range(2):
        kx, kw = jax.random.split(jax.random.key(seed + 1 + i))
        x = put(jax.random.normal(kx, (total, config.d_model), jnp.bfloat16), "expert")
        w = put(jax.random.normal(kw, (total, config.d_model), jnp.bfloat16), "expert")
        sets.append((params, x, w))
    step = _step(config, mesh, dispatch, capacity_factor, EXPERTS[experts_name])
    start = time.perf_counter()
    compiled = step.lower(*sets[0]).compile()
    compile_s = time.perf_counter() - start
    timing = harness.steady_state(lambda s: compiled(*s), sets, harness.jax_sync,
                                  compile_s=compile_s, warmup=2, samples=10, budget_s=6.0)
    flops = 3 * 3 * 2 * config.d_model * config.d_ff * config.top_k * total
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": chips[0].device_kind, "devices": devices, "config": config_name,
        **dataclasses.asdict(config), "tokens_per_device": tokens, "experts": experts_name,
        "dispatch": dispatch, "capacity_factor": capacity_factor,
        "median_s": timing.median_s, "p10_s": timing.p10_s, "p90_s": timing.p90_s,
        "compile_s": round(compile_s, 1), "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "tokens_per_s": total / timing.median_s,
        "model_tflops": flops / timing.median_s / 1e12,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="mixtral")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--experts", choices=sorted(EXPERTS), nargs="+",
                        default=["pallasite", "pallasite_unfused", "ragged_dot"])
    parser.add_argument("--dispatch", choices=moe.DISPATCHES, nargs="+", default=["ragged"])
    parser.add_argument("--capacity-factor", nargs="+", default=["none", "1.25"],
                        help="receive rows per device as a multiple of the average; none: "
                             "the worst case (nothing dropped); one device always takes none")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per device")
    parser.add_argument("--out", help="append the JSON records here")
    args = parser.parse_args(argv)
    factors = [None if f == "none" else float(f) for f in args.capacity_factor]
    variants = [(devices, dispatch, factor, experts)
                for devices in args.devices for dispatch in args.dispatch
                for factor in (factors if devices > 1 else [None])  # one device: every row
                for experts in args.experts]
    for devices, dispatch, factor, experts in variants:
        try:
            record = run(args.config, devices, experts, dispatch, factor, args.tokens)
        except Exception as e:  # noqa: BLE001 - one variant's failure is reported
            record = {"config": args.config, "devices": devices, "experts": experts,
                      "dispatch": dispatch, "capacity_factor": factor,
                      "error": f"{type(e).__name__}: {e}"}
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
