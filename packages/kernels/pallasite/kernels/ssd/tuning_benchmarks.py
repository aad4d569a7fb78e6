"""Autotune benchmarks for the SSD Pallas Triton kernels: synthetic inputs, checked outputs.

Here, not in pallasite.bench, because a kernel call that misses the tuned table and the
autotune cache tunes itself (pallas_triton.resolve_block_sizes passes one of these to
pallasite.tuning.select_block_sizes), and the kernels cannot import the bench package.
`bazel run //packages/bench:autotune` uses the same benchmarks offline.

A Benchmark runs one block config on fixed synthetic inputs of the call's shape and dtype
(pallasite.reference.inputs, seeded); a candidate may win only if its output matches a
reference: the forward's y and final state for two (batch, head) pairs against a float64
numpy recurrence over the whole sequence, the backward against the XLA backend in fp32.
"""

from __future__ import annotations

from types import ModuleType
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.reference import inputs as ref_inputs
from pallasite.tuning import Benchmark

# The shape keys the Triton backend gives select_block_sizes, in ssd_inputs' order.
DIMS = ("batch", "length", "heads", "head_dim", "state", "groups", "chunk")


def ssd_numpy(x, a, b, c, init, block: int = 64):
    """The SSD recurrence for one (batch, head) in float64: x [l,p], a [l], b, c [l,n].

    Chunks of `block` steps in the closed form (decays exp(acs_i - acs_j), fine in float64),
    the state carried exactly between them. Returns (y [l,p], final state [p,n]).
    """
    state = np.array(init, np.float64)
    ys = []
    for s in range(0, x.shape[0], block):
        xs, as_, bs, cs = x[s:s + block], a[s:s + block], b[s:s + block], c[s:s + block]
        acs = np.cumsum(as_)
        decay = np.tril(np.exp(acs[:, None] - acs[None, :]))
        ys.append((decay * (cs @ bs.T)) @ xs + np.exp(acs)[:, None] * (cs @ state.T))
        weights = np.exp(acs[-1] - acs)
        state = np.exp(acs[-1]) * state + (xs * weights[:, None]).T @ bs
    return np.concatenate(ys), state


def numpy_reference(x, a, b, c, init, picks: Sequence[tuple[int, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(y [l,p], final [p,n]) in float64 for each (batch, head) in `picks`.

    x [b,l,h,p], a [b,l,h], b and c [b,l,g,n], init [b,h,p,n]; head h reads group
    h // (heads / groups). Cheap at any length: only the picked pairs are recomputed.
    """
    per_group = x.shape[2] // b.shape[2]
    f64 = lambda t: np.asarray(t, np.float64)  # noqa: E731
    return [ssd_numpy(f64(x[bi, :, hi]), f64(a[bi, :, hi]), f64(b[bi, :, hi // per_group]),
                      f64(c[bi, :, hi // per_group]), f64(init[bi, hi]))
            for bi, hi in picks]


def synthetic_inputs(dims: Mapping[str, int], dtype):
    """((x, a, b, c) as [b, l, ...], the same chunked [b, nc, C, ...], fp32 initial state)."""
    bsz, l, h, p, n, g, chunk = (dims[k] for k in DIMS)
    flat = ref_inputs.ssd_inputs(jax.random.key(0), bsz, l, h, p, n, g, dtype)
    init = ref_inputs.ssd_initial_state(jax.random.key(1), bsz, h, p, n)
    chunked = [t.reshape(bsz, l // chunk, chunk, *t.shape[2:]) for t in flat]
    return flat, chunked, init


def forward_benchmark(backend: ModuleType, dims: Mapping[str, int], dtype="bfloat16",
                      interpret: bool = False) -> Benchmark:
    """`backend.forward` (the pallas_triton module) with each candidate's blocks; y and the
    final state of the first and last (batch, head) checked against float64 numpy."""
    bsz, l, h, p = dims["batch"], dims["length"], dims["heads"], dims["head_dim"]
    (x, a, b, c), chunked, init = synthetic_inputs(dims, dtype)
    picks = sorted({(0, 0), (bsz - 1, h - 1)})
    bi = jnp.asarray([q[0] for q in picks])
    hi = jnp.asarray([q[1] for q in picks])

    def build(cfg):
        def run(xx, aa, bb, cc, s0):
            y, final, _ = backend.forward(xx, aa, bb, cc, s0, block_sizes=cfg, interpret=interpret)
            return y.reshape(bsz, l, h, p)[bi, :, hi], final[bi, hi]
        f = jax.jit(run)
        return lambda: f(*chunked, init)

    def reference():
        pairs = numpy_reference(x, a, b, c, init, picks)
        return np.stack([y for y, _ in pairs]), np.stack([s for _, s in pairs])

    return Benchmark(build=build, reference=reference, atol=0.0, rtol=2e-2, warmup=1, reps=5)


def backward_benchmark(backend: ModuleType, dims: Mapping[str, int], dtype="bfloat16",
                       interpret: bool = False) -> Benchmark:
    """`backend.backward` alone (dx, da, db, dc, dinitial) under the candidate's blocks; the
    chunk states come from one forward with the default blocks (explicit, so building this
    benchmark never tunes the forward; the default that fits the device). Reference: the XLA backend's forward and backward
    in fp32 on the same (rounded) inputs."""
    from pallasite.kernels.ssd import xla as ssd_xla

    _, chunked, init = synthetic_inputs(dims, dtype)
    dy = jax.random.normal(jax.random.key(2), chunked[0].shape, dtype)
    dfinal = jax.random.normal(jax.random.key(3), init.shape, jnp.float32)
    default = backend.default_block_sizes(dims["head_dim"], dims["state"],
                                          itemsize=jnp.dtype(dtype).itemsize)
    fwd = jax.jit(lambda *t: backend.forward(*t, block_sizes=default,
                                             interpret=interpret)[2])
    states = fwd(*chunked, init)

    def build(cfg):
        f = jax.jit(lambda *t: backend.backward(*t, block_sizes=cfg, interpret=interpret))
        return lambda: f(*chunked, states, dy, dfinal)

    def reference():
        f32 = [t.astype(jnp.float32) for t in chunked]
        _, _, ref_states = ssd_xla.forward(*f32, init)
        return ssd_xla.backward(*f32, ref_states, dy.astype(jnp.float32), dfinal)

    return Benchmark(build=build, reference=reference, atol=0.0, rtol=2e-2, warmup=1, reps=5)
