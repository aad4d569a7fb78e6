"""The autotune benchmark of the gated delta rule's Pallas Triton kernels: synthetic inputs,
checked outputs. `bazel run //packages/bench:autotune -- --op gated_delta_rule` runs it
over the table's candidates; the kernels do not tune on a miss (pallas_triton._resolve).

One table key covers the forward and the backward (block_v serves both state passes), so
a candidate is timed on a whole forward+backward: o, then the VJP of o and the final
states under fixed cotangents. It may win only if o, dq, dk, dv, dg, dbeta and the
initial states' cotangent, on the first and last value heads, match the XLA form's in
fp32 on the same (rounded) inputs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Mapping

import jax
import jax.numpy as jnp

from pallasite.reference import inputs as ref_inputs
from pallasite.tuning import Benchmark

# The shape keys of the table (pallas_triton._resolve's lookup), then the benchmark's own.
DIMS = ("batch", "length", "heads", "key_dim", "value_dim", "chunk", "key_heads")


def benchmark(backend: ModuleType, dims: Mapping[str, int], dtype="bfloat16",
              interpret: bool = False) -> Benchmark:
    """`backend.forward` (the pallas_triton module) and its VJP with each candidate's
    blocks, against the XLA form in fp32."""
    from pallasite.kernels.gated_delta import xla

    a = ref_inputs.gated_delta_inputs(
        jax.random.key(0), jax.random.key(2), dims["batch"], dims["length"],
        dims["key_heads"], dims["heads"], dims["key_dim"], dims["value_dim"], jnp.dtype(dtype))
    names = tuple(a)
    hv, chunk = dims["heads"], dims["chunk"]
    heads = jnp.asarray(sorted({0, hv - 1}))
    kw = dict(scale=dims["key_dim"] ** -0.5, cu_seqlens=None, chunk_size=chunk,
              use_qk_l2norm_in_kernel=False)
    ks = jax.random.split(jax.random.key(1), 2)
    do = jax.random.normal(ks[0], a["v"].shape, jnp.float32)
    dfinal = jax.random.normal(ks[1], a["initial_state"].shape, jnp.float32)

    def checked(fn, *arrays):
        (o, _), pull = jax.vjp(lambda *x: fn(*x[:5], initial_state=x[5], **kw), *arrays)
        dq, dk, dv, dg, dbeta, dinit = pull((do.astype(o.dtype), dfinal))
        per_value_head = lambda t: t[:, :, heads].astype(jnp.float32)  # noqa: E731
        return (per_value_head(o), per_value_head(dv), per_value_head(dg),
                per_value_head(dbeta), dinit[:, heads], dq.astype(jnp.float32),
                dk.astype(jnp.float32))

    def build(cfg):
        fn = lambda *x, **k: backend.forward(*x, **k, interpret=interpret,  # noqa: E731
                                             block_sizes=backend.as_block_dict(cfg))
        f = jax.jit(lambda *x: checked(fn, *x))
        return lambda: f(*(a[n] for n in names))

    def reference():
        f32 = [a[n].astype(jnp.float32) for n in names]
        return jax.jit(lambda *x: checked(xla.forward, *x))(*f32)

    return Benchmark(build=build, reference=reference, atol=0.0, rtol=2e-2, warmup=1, reps=5)
