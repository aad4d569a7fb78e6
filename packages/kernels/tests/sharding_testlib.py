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


# ------------------------------------------------------------ the lowered program

BOUNDARIES = ("shard_map", "custom_partitioning")


def _sub_jaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(getattr(v, "jaxpr", None), "eqns"):
                yield v.jaxpr


def boundaries(fn, *args) -> list[tuple[str, frozenset, tuple]]:
    """(primitive, its manual axes, enclosing boundaries) for every shard_map,
    custom_partitioning and pallas_call eqn of fn's jaxpr, in order (a pallas_call's
    kernel body is not entered). The manual axes are a shard_map's, empty for the others;
    the enclosing boundaries are (primitive, manual axes) pairs, outermost first. Traced
    under whatever mesh is in context."""
    found = []

    def walk(jaxpr, chain):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name not in BOUNDARIES and name != "pallas_call":
                for sub in _sub_jaxprs(eqn.params):
                    walk(sub, chain)
                continue
            axes = frozenset(eqn.params.get("newly_manual_axes", ()))
            found.append((name, axes, chain))
            if name != "pallas_call":
                for sub in _sub_jaxprs(eqn.params):
                    walk(sub, chain + ((name, axes),))

    walk(jax.make_jaxpr(fn)(*args).jaxpr, ())
    return found


def lowered_counts(fn, *args) -> dict[str, int]:
    """How many shard_map bodies (sdy.manual_computation) and custom_partitioning calls
    the lowered StableHLO of jit(fn) holds."""
    text = jax.jit(fn).lower(*args).as_text()
    return {"shard_map": text.count("sdy.manual_computation("),
            "custom_partitioning": text.count("@CustomSPMDPartitioning")}


def assert_kernel_boundaries(fn, args, *, way: str, axes, products: int):
    """The lowered program of fn (a forward and backward) holds the kernel boundaries
    `way` calls for (docs/sharding.md, "Kernel boundaries"), read from its jaxpr (the
    nesting) and its StableHLO (the same count):
      "explicit": one pallasite shard_map per product over `axes`, every kernel in one;
      "auto": one custom_partitioning per product, every kernel in one, no shard_map;
      "caller": the caller's shard_maps over `axes` only, every kernel directly in one,
        nothing nested in them and no custom_partitioning.
    `products`: how many products fn computes (forward plus backward), one boundary each.
    Returns `boundaries(fn, *args)`."""
    if way not in ("explicit", "auto", "caller"):
        raise ValueError(f"way must be 'explicit', 'auto' or 'caller'; got {way!r}")
    found = boundaries(fn, *args)
    outer = [(name, axes) for name, axes, chain in found if name in BOUNDARIES and not chain]
    nested = [(name, chain) for name, _, chain in found if name in BOUNDARIES and chain]
    kernels = {chain for name, _, chain in found if name == "pallas_call"}
    counts = lowered_counts(fn, *args)
    assert not nested, f"boundaries nested in others: {nested}"
    if way == "auto":
        assert outer == [("custom_partitioning", frozenset())] * products, outer
        assert kernels <= {(("custom_partitioning", frozenset()),)}, kernels
        assert counts == {"shard_map": 0, "custom_partitioning": products}, counts
        return found
    shard_map = ("shard_map", frozenset(axes))
    assert outer and set(outer) == {shard_map}, outer
    assert kernels <= {(shard_map,)}, kernels
    assert counts == {"shard_map": len(outer), "custom_partitioning": 0}, counts
    if way == "explicit":
        assert len(outer) == products, outer
    return found


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
