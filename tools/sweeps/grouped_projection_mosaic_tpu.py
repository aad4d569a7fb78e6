"""grouped_projection's Mosaic TPU kernels over their tiles (tm, tk, tn), on a TPU.

    OUT=FOLDER python3 tools/sweeps/grouped_projection_mosaic_tpu.py [--tiles TM,TK,TN ...] [shape ...]

At 128^3 tiles (megablox's) the kernels spent about 0.4 us a grid step for a 4 MFLOP
tile (docs/performance.md), so the step overhead, not the MXU, bounded them; each
larger tile divides the step count. For each shape (the bench's, `rows_*`: one product
with 4096 down to 2 rows per group, and one group;
`tiny` runs on a CPU through the interpreter)
and each tile it times, by the bench harness's queued method, the public API with
implementation="pallas_mosaic_tpu", forward and forward+backward (one
MosaicTpuBlockSizes for every product, or `default`: the backend's own per product),
and beside them jax.lax.ragged_dot and the API's XLA path (`api_xla_*`); it checks
each forward against ragged_dot's fp32 result (max abs error relative to the result's
max). A tile that does not fit or compile is an error record. JSON lines to
$OUT/grouped_projection_mosaic_tpu.jsonl.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

import records  # tools/sweeps/records.py, beside this script
from grouped_sweeps import inputs, ragged_dot
from pallasite.bench import harness
from pallasite.kernels import MosaicTpuBlockSizes, grouped_projection

SHAPES = {"mixtral": (32768, 4096, 14336, 8), "qwen3": (65536, 2048, 768, 128),
          "olmoe": (32768, 2048, 1024, 64), "tiny": (512, 256, 384, 4),
          # one product, fewer and larger groups: where the kernels overtake ragged_dot
          **{f"rows_{32768 // g}": (32768, 2048, 2048, g) for g in (8, 32, 128)},
          # below 256 rows per group
          **{f"rows_{8192 // g}": (8192, 2048, 2048, g) for g in (64, 128)},
          "rows_8": (1024, 2048, 2048, 128), "rows_2": (256, 2048, 2048, 128),
          # one group, which pallasite's XLA path computes as dense dots
          "one_group": (8192, 2048, 2048, 1), "one_group_wide": (4096, 4096, 14336, 1)}
TILES = [(128, 128, 128), (256, 512, 512), (512, 512, 512), (512, 1024, 1024),
         (256, 1024, 1024), (512, 2048, 512), (1024, 1024, 512)]
BF16 = jnp.bfloat16


def _emit(folder, **record):
    records.emit(record, folder, "grouped_projection_mosaic_tpu.jsonl")


def _named(tiles):
    return "default" if tiles is None else list(tiles)


def _api(i, tiles, backward: bool, interpret: bool, implementation="pallas_mosaic_tpu"):
    blocks = None if tiles is None else MosaicTpuBlockSizes(*tiles)
    f = lambda x, w: grouped_projection(x, w, i["group_sizes"], BF16, interpret,  # noqa: E731
                                        implementation=implementation, block_sizes=blocks)
    if not backward:
        return f(i["x"], i["kernel"])
    y, vjp = jax.vjp(f, i["x"], i["kernel"])
    return (y, *vjp(i["dy"]))


def _time(folder, shape, variant, fn, sets, **extra):
    call, compile_s = harness.compile_jax(jax.jit(fn), sets[0])
    t = harness.steady_state(call, sets, harness.jax_sync, compile_s=compile_s,
                             warmup=2, samples=5, budget_s=1.0)
    _emit(folder, kind="time", shape=shape, variant=variant, ms=t.median_s * 1e3,
          p10_ms=t.p10_s * 1e3, p90_ms=t.p90_s * 1e3, compile_s=compile_s, **extra)
    return call


def run(shape: str, tiles_list, folder: str) -> None:
    interpret = jax.devices()[0].platform == "cpu"
    sets = inputs(shape, SHAPES[shape])
    m, k, n, g = SHAPES[shape]
    flops = 2 * m * k * n
    want = np.asarray(jax.jit(lambda i: ragged_dot(i, jnp.float32))(sets[0]))
    scale = float(np.abs(want).max())
    for backward in (False, True):
        name = "ragged_dot_fwd_bwd" if backward else "ragged_dot_fwd"
        try:
            _time(folder, shape, name, lambda i, b=backward: ragged_dot(i, backward=b), sets)
            _time(folder, shape, name.replace("ragged_dot", "api_xla"),
                  lambda i, b=backward: _api(i, None, b, interpret, "xla"), sets)
        except Exception as err:  # noqa: BLE001 - a failing variant is a record
            _emit(folder, kind="error", shape=shape, variant=name,
                  error=f"{type(err).__name__}: {str(err)[:300]}")
    for tiles in tiles_list:
        for backward in (False, True):
            name = "mosaic_tpu_fwd_bwd" if backward else "mosaic_tpu_fwd"
            try:
                call = _time(folder, shape, name,
                             lambda i, t=tiles, b=backward: _api(i, t, b, interpret), sets,
                             tiles=_named(tiles))
                if not backward:
                    got = np.asarray(call(sets[0]).astype(jnp.float32))
                    _emit(folder, kind="error_vs_ragged_dot_fp32", shape=shape,
                          tiles=_named(tiles), flops_fwd=flops,
                          max_rel=float(np.abs(got - want).max()) / scale)
            except Exception as err:  # noqa: BLE001 - a failing tile is a record
                _emit(folder, kind="error", shape=shape, variant=name, tiles=_named(tiles),
                      error=f"{type(err).__name__}: {str(err)[:300]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", default=["qwen3", "mixtral"], choices=sorted(SHAPES))
    p.add_argument("--tiles", action="append", default=None,
                   help="TM,TK,TN or 'default' (the backend's own choice), repeatable; "
                        "default: a ladder from 128^3 to 1024")
    args = p.parse_args()
    tiles = ([None if t == "default" else tuple(int(v) for v in t.split(","))
              for t in args.tiles] if args.tiles else TILES)
    folder = os.environ.get("OUT", ".")
    _emit(folder, kind="device", device=jax.devices()[0].device_kind, jax=jax.__version__)
    for shape in args.shapes:
        run(shape, tiles, folder)


if __name__ == "__main__":
    main()
