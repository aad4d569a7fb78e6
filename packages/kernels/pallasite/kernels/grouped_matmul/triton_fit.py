"""Whether a Pallas Triton block config of the grouped matmuls fits a GPU's shared memory.

Triton software-pipelines the contraction loop: each of `num_stages` stages holds one
operand tile of each input in shared memory, so a config needs about
  gmm:  num_stages * (block_m * block_k + block_k * block_n) * itemsize
  tgmm: num_stages * (block_m * block_k + block_m * block_n) * itemsize
(tgmm steps block_m rows of both operands). The H200 default gmm tile, 128x256x64 with 3
bf16 stages, needs 144 KiB: inside sm90's 227 KiB and sm80's 163 KiB, past the 99 KiB of
an sm86 or sm89 GPU, which therefore gets a smaller default. Every default, table entry
and autotune candidate is checked against this rule for the device it runs on.
"""

from __future__ import annotations

from collections.abc import Sequence


def shared_memory_bytes(bs, itemsize: int, product: str) -> int:
    """Bytes of shared memory `bs` (a TritonBlockSizes) asks for on one product."""
    rhs_rows = bs.block_m if product == "dkernel" else bs.block_k
    return bs.num_stages * (bs.block_m * bs.block_k + rhs_rows * bs.block_n) * itemsize


def fits(bs, itemsize: int, product: str, budget: int) -> bool:
    return shared_memory_bytes(bs, itemsize, product) <= budget


def first_fitting(configs: Sequence, itemsize: int, product: str, budget: int):
    """The first of `configs` (best first) that fits `budget`, else the last (smallest)."""
    for bs in configs:
        if fits(bs, itemsize, product, budget):
            return bs
    return configs[-1]
