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

import dataclasses
from types import ModuleType
from typing import Mapping

import jax
import jax.numpy as jnp

from pallasite.tuning import Benchmark

# The shape keys of the table (pallas_triton._resolve's lookup), then the benchmark's own.
DIMS = ("batch", "length", "heads", "key_dim", "value_dim", "chunk", "key_heads")


def synthetic_inputs(dims: Mapping[str, int], dtype):
    """q, k (unit rows, as a model's L2-normalised keys), v in `dtype`; g <= 0, beta in
    (0, 1) and the initial states [batch, Hv, K, V] fp32; seeded."""
    b, t, hv, dk, dv = (dims[k] for k in ("batch", "length", "heads", "key_dim", "value_dim"))
    hk = dims["key_heads"]
    ks = jax.random.split(jax.random.key(0), 6)
    unit = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True))  # noqa: E731
    f = lambda i, s: jax.random.normal(ks[i], s, jnp.float32)  # noqa: E731
    return dict(q=unit(f(0, (b, t, hk, dk))).astype(dtype),
                k=unit(f(1, (b, t, hk, dk))).astype(dtype),
                v=f(2, (b, t, hv, dv)).astype(dtype),
                g=-jax.nn.softplus(f(3, (b, t, hv)) - 2.0),
                beta=jax.nn.sigmoid(f(4, (b, t, hv))),
                initial_state=0.1 * f(5, (b, hv, dk, dv)))


def _block_dict(config) -> dict:
    return {k: v for k, v in dataclasses.asdict(config).items() if v is not None}


def benchmark(backend: ModuleType, dims: Mapping[str, int], dtype="bfloat16",
              interpret: bool = False) -> Benchmark:
    """`backend.forward` (the pallas_triton module) and its VJP with each candidate's
    blocks, against the XLA form in fp32."""
    from pallasite.kernels.gated_delta import xla

    a = synthetic_inputs(dims, jnp.dtype(dtype))
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
                                             block_sizes=_block_dict(cfg))
        f = jax.jit(lambda *x: checked(fn, *x))
        return lambda: f(*(a[n] for n in names))

    def reference():
        f32 = [a[n].astype(jnp.float32) for n in names]
        return jax.jit(lambda *x: checked(xla.forward, *x))(*f32)

    return Benchmark(build=build, reference=reference, atol=0.0, rtol=2e-2, warmup=1, reps=5)
