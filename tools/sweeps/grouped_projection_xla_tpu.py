"""grouped_projection's XLA path on a TPU against a bare jax.lax.ragged_dot, and where its
time goes (the containment of non-finite weights, the fp32 output and its cast).

    OUT=FOLDER python3 tools/sweeps/grouped_projection_xla_tpu.py [mixtral qwen3 ...]

For each shape (the bench's; `tiny` runs on a CPU in seconds) it times, by the bench
harness's queued method, each in its own jit:
  - the public API with implementation="xla", forward and forward+backward, with
    non-finite weights always contained and contained only when there are some
    (xla.CONTAIN_ONLY_NONFINITE_ON naming this platform or not);
  - jax.lax.ragged_dot alone, bf16 out, forward and forward+backward (JAX's own rules);
  - the pieces: ragged_dot with fp32 out, its cast to bf16, the weights' all-finite
    reduction and their masked copy;
and checks, bit for bit, that ragged_dot's bf16 output is its fp32 output rounded once
and that both API forms agree, and whether a bare ragged_dot leaves the rows past the
groups' total zero. JSON lines to $OUT/grouped_projection_xla_tpu.jsonl.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from knobs import knobs
import records  # tools/sweeps/records.py, beside this script
from grouped_sweeps import inputs, ragged_dot
from pallasite.bench import harness
from pallasite.kernels import grouped_projection
from pallasite.kernels.grouped_matmul import xla

SHAPES = {"mixtral": (32768, 4096, 14336, 8), "qwen3": (65536, 2048, 768, 128),
          "olmoe": (32768, 2048, 1024, 64), "tiny": (512, 256, 384, 4)}
BF16 = jnp.bfloat16


def _emit(folder, **record):
    records.emit(record, folder, "grouped_projection_xla_tpu.jsonl")


def _here() -> str:
    """This device's platform as jax.lax.platform_dependent names it."""
    platform = jax.devices()[0].platform
    return "cuda" if platform == "gpu" else platform


def _api(i, contain_only_nonfinite: bool, backward: bool):
    on = (_here(),) if contain_only_nonfinite else ()
    with knobs(xla, CONTAIN_ONLY_NONFINITE_ON=on):
        f = lambda x, w: grouped_projection(x, w, i["group_sizes"], BF16,  # noqa: E731
                                            implementation="xla")
        if not backward:
            return f(i["x"], i["kernel"])
        y, vjp = jax.vjp(f, i["x"], i["kernel"])
        return (y, *vjp(i["dy"]))


VARIANTS = {
    "api_xla_fwd": lambda i: _api(i, False, False),
    "api_xla_fwd_contain_only_nonfinite": lambda i: _api(i, True, False),
    "ragged_dot_fwd": lambda i: ragged_dot(i),
    "api_xla_fwd_bwd": lambda i: _api(i, False, True),
    "api_xla_fwd_bwd_contain_only_nonfinite": lambda i: _api(i, True, True),
    "ragged_dot_fwd_bwd": lambda i: ragged_dot(i, backward=True),
    "ragged_dot_fp32_out": lambda i: ragged_dot(i, jnp.float32),
    "ragged_dot_fp32_out_cast": lambda i: ragged_dot(i, jnp.float32).astype(BF16),
    "weights_all_finite": lambda i: jnp.isfinite(i["kernel"]).all(),
    "weights_masked_copy": lambda i: jnp.where(jnp.isfinite(i["kernel"]), i["kernel"], 0),
}
# Pairs whose outputs must agree bit for bit (the first output of each, on a row sample).
SAME = [("ragged_dot_fwd", "ragged_dot_fp32_out_cast"), ("ragged_dot_fwd", "api_xla_fwd"),
        ("api_xla_fwd", "api_xla_fwd_contain_only_nonfinite")]


def run(shape: str, folder: str) -> None:
    sets = inputs(shape, SHAPES[shape])
    kept = {}
    for name, fn in VARIANTS.items():
        try:
            call, compile_s = harness.compile_jax(jax.jit(fn), sets[0])
            t = harness.steady_state(call, sets, harness.jax_sync, compile_s=compile_s,
                                     warmup=2, samples=5, budget_s=1.0)
            _emit(folder, kind="time", shape=shape, variant=name, ms=t.median_s * 1e3,
                  p10_ms=t.p10_s * 1e3, p90_ms=t.p90_s * 1e3, compile_s=compile_s)
            if any(name in pair for pair in SAME):
                first = jax.tree.leaves(call(sets[0]))[0]
                kept[name] = np.asarray(first[::8].astype(jnp.float32))
        except Exception as err:  # noqa: BLE001 - a failing variant is a record
            _emit(folder, kind="error", shape=shape, variant=name,
                  error=f"{type(err).__name__}: {str(err)[:300]}")
    for a, b in SAME:
        if a in kept and b in kept:
            diff = np.abs(kept[a] - kept[b])
            _emit(folder, kind="compare", shape=shape, a=a, b=b,
                  bitwise_equal=bool((kept[a] == kept[b]).all()),
                  max_abs=float(np.nanmax(diff)), differing=int((diff > 0).sum()))
    half = sets[0]["group_sizes"] // 2
    total = int(np.asarray(half).sum())
    for out_dtype in (BF16, jnp.float32):
        y = jax.jit(lambda x, w, s, t=out_dtype: jax.lax.ragged_dot(
            x, w, s, preferred_element_type=t))(sets[0]["x"], sets[0]["kernel"], half)
        past = np.asarray(y[total:].astype(jnp.float32))
        _emit(folder, kind="rows_past_total", shape=shape, out_dtype=jnp.dtype(out_dtype).name,
              total=total, rows=int(y.shape[0]), nonzero=int((past != 0).sum()))


def main(argv: list[str]) -> None:
    folder = os.environ.get("OUT", ".")
    _emit(folder, kind="device", device=jax.devices()[0].device_kind, jax=jax.__version__)
    for shape in argv or ["mixtral", "qwen3"]:
        run(shape, folder)


if __name__ == "__main__":
    main(sys.argv[1:])
