"""grouped_mlp's activation memory per form: the bytes a layer keeps between its forward
and its backward, and XLA's temporary bytes of a stack of layers' forward+backward.

    OUT=folder python3 tools/sweeps/grouped_mlp_memory.py [--smoke] [--layers 4]

Forms, each on Mosaic GPU (the H200's default) but the fused Triton one: the composition
(grouped_mlp's default: grouped_projection calls, the activation and the row weights
rematerialised), the fused gate-up on Mosaic GPU and on Triton (fuse_activation=True), and
the unfused three calls the bench times (plain autodiff through the activation, no row
weights); and in fp8 (recipe="fp8"), the composition on Mosaic GPU and the fused route on
Triton (h quantized in the gate-up epilogue, kept in e4m3). Naming the backend keeps the default order's platform switch, whose branches'
outputs would list as saved arrays of their own, out of the count. bf16, mixtral, qwen3 and dsv3 at the
bench's routed rows, with row weights (but for the unfused form).

- saved bytes: every array the forward keeps for the backward that is not an argument
  (jax's saved-residuals listing, traced abstractly from shapes: exact, the same on any
  backend, so a CPU gives them too);
- stack temp bytes (on a GPU only): XLA's temporary buffers of jit(grad) over `--layers` layers in a row
  (each layer's output is the next one's x), compiled from shapes alone (nothing is
  allocated). In a stack each layer's saved bytes stay alive until the backward reaches
  it, so the difference between forms grows with the depth.

JSON lines to $OUT/grouped_mlp_memory.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
# The listing jax.ad_checkpoint.print_saved_residuals prints, as data.
from jax._src.ad_checkpoint import saved_residuals

import records  # tools/sweeps/records.py, beside this script
from pallasite import kernels

BF16 = jnp.bfloat16
SHAPES = {  # name: (routed rows m, d, f, experts)
    "mixtral": (32768, 4096, 14336, 8),
    "qwen3": (65536, 2048, 768, 128),
    "dsv3": (65536, 7168, 2048, 256),
}
FORMS = ("composition", "fused_mosaic_gpu", "fused_triton", "unfused", "composition_fp8",
         "fused_fp8_triton")


def _layer(form: str, interpret: bool):
    if form == "unfused":
        def unfused(x, gate_up, down, sizes, weights):
            del weights
            product = dict(implementation="pallas_mosaic_gpu")
            pre = kernels.grouped_projection(x, gate_up, sizes, BF16, interpret, **product)
            f = down.shape[1]
            h = (jax.nn.silu(pre[:, :f].astype(jnp.float32)) * pre[:, f:]).astype(BF16)
            return kernels.grouped_projection(h, down, sizes, BF16, interpret, **product)
        return unfused
    backend = "pallas_triton" if "triton" in form else "pallas_mosaic_gpu"
    return lambda x, gate_up, down, sizes, weights: kernels.grouped_mlp(
        x, gate_up, down, sizes, BF16, interpret, row_weights=weights,
        implementation=backend, fuse_activation=form.startswith("fused"),
        recipe="fp8" if "fp8" in form else None)


def _shapes(m, d, f, g, layers=1):
    s = jax.ShapeDtypeStruct
    return (s((m, d), BF16), [s((g, d, 2 * f), BF16)] * layers, [s((g, f, d), BF16)] * layers,
            s((g,), jnp.int32), s((m,), jnp.float32))


def saved_bytes(form, m, d, f, g, interpret) -> int:
    x, (gate_up,), (down,), _, weights = _shapes(m, d, f, g)
    layer = _layer(form, interpret)
    sizes = jnp.full((g,), m // g, jnp.int32)

    def loss(x, gate_up, down, w):
        return layer(x, gate_up, down, sizes, w).astype(jnp.float32).sum()
    listing = saved_residuals(loss, x, gate_up, down, weights)
    return int(sum(np.prod(a.shape) * a.dtype.itemsize for a, why in listing
                   if not why.startswith("from the argument")))


def stack_temp_bytes(form, m, d, f, g, layers, interpret) -> int | None:
    x, gate_ups, downs, _, weights = _shapes(m, d, f, g, layers)
    layer = _layer(form, interpret)
    sizes = jnp.full((g,), m // g, jnp.int32)

    def loss(x, gate_ups, downs, w):
        for a, b in zip(gate_ups, downs):
            x = layer(x, a, b, sizes, w)
        return x.astype(jnp.float32).sum()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(
        x, gate_ups, downs, weights).compile()
    stats = compiled.memory_analysis()
    return None if stats is None else int(stats.temp_size_in_bytes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a tiny shape only")
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    on_gpu = jax.default_backend() == "gpu"
    shapes = {"tiny": (1024, 256, 512, 8)} if args.smoke else SHAPES
    for name, (m, d, f, g) in shapes.items():
        pre = m * 2 * f * 2  # the bf16 [m, 2f] pre-activation
        for form in FORMS:
            rec = {"what": "grouped_mlp_memory", "shape": name, "form": form,
                   "pre_activation_bytes": pre, "layers": args.layers}
            try:
                rec["saved_bytes"] = saved_bytes(form, m, d, f, g, not on_gpu)
                if on_gpu:
                    rec["stack_temp_bytes"] = stack_temp_bytes(form, m, d, f, g, args.layers,
                                                               False)
            except Exception as e:  # noqa: BLE001 - a form that cannot run is a result
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            records.emit(rec, out, "grouped_mlp_memory.jsonl")


if __name__ == "__main__":
    sys.exit(main())
