"""Shared helpers for the sharding tests: meshes in each of the ways users build them,
placement, and the collectives of a compiled program.

Collectives are read from the compiled HLO (after SPMD partitioning), never only from the
lowered text, where a gather the partitioner inserts does not show yet.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from pallasite.kernels.grouped_matmul import (
    GroupedProjectionBlockSizes,
    MosaicTpuBlockSizes,
    TritonBlockSizes,
)
from pallasite.kernels.grouped_matmul.pallas_mosaic_gpu import MosaicGpuBlockSizes

AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit

# grouped_projection's backends with blocks small enough for the sharding tests' shapes.
GROUPED_BLOCKS = {
    "xla": None,
    "pallas_triton": TritonBlockSizes(block_m=16, block_n=16, block_k=16, group_m=2),
    "pallas_mosaic_gpu": MosaicGpuBlockSizes(block_m=64, block_n=64, block_k=64, stages=2,
                                             grid_block_n=2),
    "pallas_mosaic_tpu": GroupedProjectionBlockSizes(
        forward=MosaicTpuBlockSizes(16, 128, 128), dx=MosaicTpuBlockSizes(16, 128, 128),
        dkernel=MosaicTpuBlockSizes(16, 128, 128)),
}
GROUPED_ON_CPU = ("xla", "pallas_triton")  # run for values on CPU
GROUPED_MOSAIC = ("pallas_mosaic_gpu", "pallas_mosaic_tpu")  # compiled for collectives


def bf16_exact(t):
    """Values bf16 holds exactly: bf16 and fp32 products then differ only in summation."""
    return t.astype(jnp.bfloat16).astype(jnp.float32)


def grouped_inputs(seed, m, k, n, g):
    """(x [m, k], kernel [g, k, n], loss weights [m, n]) for grouped_projection: fp32
    arrays of bf16-exact values, the kernel scaled by 1/sqrt(k), drawn from key(seed)."""
    kx, kw, kr = jax.random.split(jax.random.key(seed), 3)
    x = bf16_exact(jax.random.normal(kx, (m, k), jnp.float32))
    w = bf16_exact(jax.random.normal(kw, (g, k, n), jnp.float32) / np.sqrt(k))
    weights = bf16_exact(jax.random.normal(kr, (m, n), jnp.float32))
    return x, w, weights

_COLLECTIVE = re.compile(
    r"=\s*(?P<type>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\][^ ]*)\s+"
    r"(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def mesh(shape, names, axis_type=EXPLICIT, devices=None):
    """A mesh over the first prod(shape) devices, every axis of one type."""
    count = int(np.prod(shape))
    devices = np.asarray(devices if devices is not None else jax.devices()[:count])
    return jax.sharding.Mesh(devices.reshape(shape), names,
                             axis_types=(axis_type,) * len(shape))


def put(x, mesh_, *spec):
    return jax.device_put(x, NamedSharding(mesh_, P(*spec)))


def collectives(compiled_text: str) -> dict[str, list[tuple[int, ...]]]:
    """{op: [result shape of each instance]} for every collective in compiled HLO (a
    combined collective lists each of its results)."""
    found: dict[str, list[tuple[int, ...]]] = {}
    for match in _COLLECTIVE.finditer(compiled_text):
        shapes = [tuple(int(d) for d in dims.split(",") if d)
                  for _, dims in _ARRAY.findall(match.group("type"))]
        found.setdefault(match.group("op"), []).extend(shapes)
    return found


def big(shapes, minimum: int = 2):
    """The shapes with at least `minimum` elements (drops a loss's scalar reduction)."""
    return sorted(s for s in shapes if int(np.prod(s)) >= minimum)


def compiled_collectives(fn, *args):
    return collectives(jax.jit(fn).lower(*args).compile().as_text())


def dims(array) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of each dimension of a placed array, () where replicated."""
    out = []
    spec = tuple(array.sharding.spec)
    for i in range(array.ndim):
        entry = spec[i] if i < len(spec) else None
        out.append(() if entry is None else (entry,) if isinstance(entry, str) else tuple(entry))
    return tuple(out)


def gpus(two: bool):
    """Two GPUs, or skip. two=False: one will do (a caller's shard_map over a one-device
    mesh still checks the compiled kernels' varying types under check_vma)."""
    try:
        found = jax.devices("gpu")
    except RuntimeError:
        found = []
    if len(found) >= 2:
        return found[:2]
    if found and not two:
        return found[:1]
    pytest.skip("needs two GPUs" if two else "needs a GPU")
