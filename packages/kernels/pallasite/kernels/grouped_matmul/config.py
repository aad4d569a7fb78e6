"""Block sizes for the grouped-projection kernels: frozen, hashable, one class per backend.

A `block_sizes=` argument is either one backend's class (used for the forward, dx and
dkernel products alike) or a `GroupedProjectionBlockSizes` naming each product's blocks
separately. Each backend resolves what it gets in one function, `resolve_block_sizes`,
so the tuning package can later put its tables behind that one call.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TritonBlockSizes:
    """Pallas Triton tiles. gmm: a program computes a [block_m, block_n] output tile,
    stepping block_k along the contraction; tgmm: a [block_k, block_n] tile of one
    group's x^T dy, stepping block_m rows. All three must be powers of two (Triton
    tensor shapes), at least 16 (mma tiles). group_m programs along m share each
    weight tile, so it is read from L2 rather than HBM.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TritonBlockSizes.{name}={v}: need a power of two >= 16")
        if self.group_m < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"TritonBlockSizes: group_m, num_warps, num_stages >= 1: {self}")


@dataclasses.dataclass(frozen=True)
class MosaicTpuBlockSizes:
    """Mosaic TPU tiles (megablox style): tm rows, tk contraction, tn output columns.
    Multiples of 128 in k and n (the lane width), of 16 in m (bf16 sublane packing)."""

    tm: int = 128
    tk: int = 128
    tn: int = 128

    def __post_init__(self):
        if self.tm % 16 or self.tk % 128 or self.tn % 128 or min(self.tm, self.tk, self.tn) <= 0:
            raise ValueError(f"MosaicTpuBlockSizes: tm % 16, tk % 128, tn % 128 must be 0: {self}")


@dataclasses.dataclass(frozen=True)
class GroupedProjectionBlockSizes:
    """Per-product blocks; None means the backend's default for that product."""

    forward: object | None = None
    dx: object | None = None
    dkernel: object | None = None


def for_product(block_sizes, product: str):
    """The blocks a caller gave for one product ('forward', 'dx', 'dkernel'), or None."""
    if isinstance(block_sizes, GroupedProjectionBlockSizes):
        return getattr(block_sizes, product)
    return block_sizes
