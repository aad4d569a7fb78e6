"""Whether a block config fits a grouped product: one rule per backend.

Every config (the caller's, the tuned table's, the autotune cache's, a tuning candidate,
the default) is checked here before a kernel is built with it (docs/tuning.md). A config
that does not fit is refused: the caller's with a ValueError naming it, a table or cache
entry passed over (logged, then re-tuned). Two things are checked:
- no tile is larger than its dimension needs (the dimension rounded up to the tile's
  granule; 256 is always allowed, so defaults fit small shapes): a block of 2**20 rows
  would make the interpreters allocate terabytes and the compiled kernels fail to build;
- the buffers one program holds fit the backend's on-chip budget. Triton: the shared
  memory of triton_fit's model within the budget platform gives for the device's
  generation (platform.SHARED_MEMORY_KIB). pallasite's own choices (default, table,
  cache, candidates) are held to platform.triton_shared_memory_budget, which off CUDA is
  the smallest GPU's, so that they fit every GPU; a caller's config to the device's own
  (platform.shared_memory_bytes; no limit off CUDA, where only the interpreter runs it,
  and a caller may be exporting for a larger GPU). Triton fp8: the same budgets, for
  tiles of one byte, with the contraction step and gmm's column tile fixed at 128 (one
  scale block). Mosaic GPU: the kernel's own budget
  (sm90's shared memory less its barriers). Mosaic TPU: platform.TPU_VMEM_BYTES.

`reason(backend, config, product, dims, dtype)` says why not (None: it fits).
Products: 'forward' gmm [m, k] x [k, n]; 'dx' gmm [m, n] x [n, k]; 'dkernel' tgmm.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pallasite.kernels import platform
from pallasite.kernels.grouped_matmul import triton_fit


# Tiles up to this size are allowed on any dimension, however small: the defaults and the
# tuned configs (up to 256 wide) stay usable on small shapes, where they only pad.
_ANY_DIM = 256


def _ceil(value: int, granule: int) -> int:
    return max(_ANY_DIM, -(-value // granule) * granule)


def _pow2_ceil(value: int, least: int) -> int:
    return max(_ANY_DIM, least, 1 << max(int(value) - 1, 0).bit_length())


def _product_dims(product: str, dims: Mapping[str, int]) -> tuple[int, int, int]:
    """(rows, contraction, columns) of the product."""
    m, k, n = dims["m"], dims["k"], dims["n"]
    return (m, n, k) if product == "dx" else (m, k, n)


def _too_large(named: Mapping[str, tuple[int, int]]) -> str | None:
    for name, (block, limit) in named.items():
        if block > limit:
            return f"{name}={block} exceeds {limit}, what the dimension needs"
    return None


def triton_budget(caller: bool = False, device=None) -> int | None:
    """The shared memory a Triton config may use (module docstring): a caller's config
    the device's own (None off CUDA: no limit), pallasite's own choices the budget that
    fits every GPU they may run on."""
    if caller:
        return platform.shared_memory_bytes(device)
    return platform.triton_shared_memory_budget(device)


def triton_reason(bs, product: str, dims: Mapping[str, int], dtype, *,
                  caller: bool = False) -> str | None:
    rows, contraction, cols = _product_dims(product, dims)  # dkernel: block_m steps m
    sizes = {"block_m": (bs.block_m, _pow2_ceil(rows, 16)),
             "block_k": (bs.block_k, _pow2_ceil(contraction, 16)),
             "block_n": (bs.block_n, _pow2_ceil(cols, 16))}
    if (why := _too_large(sizes)) is not None:
        return why
    if bs.num_warps not in (1, 2, 4, 8, 16):
        return f"num_warps={bs.num_warps} is not 1, 2, 4, 8 or 16"
    need = triton_fit.shared_memory_bytes(bs, np.dtype(dtype).itemsize, product)
    budget = triton_budget(caller)
    if budget is not None and need > budget:
        return f"{bs.num_stages} stages need {need} bytes of shared memory > {budget}"
    return None


def triton_fp8_reason(bs, product: str, dims: Mapping[str, int], dtype, *,
                      caller: bool = False) -> str | None:
    """pallas_triton_fp8 reads TritonBlockSizes as A[M, K] @ B[N, K]^T for every product
    (its module docstring): block_k is one 128-deep scale step; gmm's block_n one
    128-column weight scale block and its block_m 64 or 128 rows; each of num_stages
    holds an A and a B tile of one byte per element (triton_fit's gmm footprint, for the
    dkernel too)."""
    del dtype  # the operands are fp8 whatever the caller's dtype
    if bs.block_k != 128:
        return f"block_k={bs.block_k}: the fp8 kernels contract one 128-deep scale step"
    if product != "dkernel" and bs.block_n != 128:
        return f"block_n={bs.block_n}: the fp8 gmm tiles one 128-column weight scale block"
    if product != "dkernel" and bs.block_m not in (64, 128):
        return f"block_m={bs.block_m}: the fp8 gmm tiles 64 or 128 rows"
    rows, _, cols = _product_dims(product, dims)
    if product == "dkernel":  # A = x^T: rows over k, contracted over the tokens
        rows, cols = dims["k"], dims["n"]
    sizes = {"block_m": (bs.block_m, _pow2_ceil(rows, 16)),
             "block_n": (bs.block_n, _pow2_ceil(cols, 16))}
    if (why := _too_large(sizes)) is not None:
        return why
    if bs.num_warps not in (1, 2, 4, 8, 16):
        return f"num_warps={bs.num_warps} is not 1, 2, 4, 8 or 16"
    need = triton_fit.shared_memory_bytes(bs, 1, "forward")
    budget = triton_budget(caller)
    if budget is not None and need > budget:
        return f"{bs.num_stages} stages need {need} bytes of shared memory > {budget}"
    return None


def mosaic_gpu_reason(bs, product: str, dims: Mapping[str, int], dtype, *,
                      caller: bool = False) -> str | None:
    del caller  # one budget: the kernel runs on sm90 only
    from pallasite.kernels.grouped_matmul import pallas_mosaic_gpu  # Hopper only

    rows, contraction, cols = _product_dims(product, dims)
    if product == "dkernel":
        rows, contraction, cols = dims["k"], dims["m"], dims["n"]
    sizes = {"block_m": (bs.block_m, _ceil(rows, 64)), "block_k": (bs.block_k, _ceil(contraction, 64)),
             "block_n": (bs.block_n, _ceil(cols, 64))}
    if (why := _too_large(sizes)) is not None:
        return why
    width = np.dtype(dtype).itemsize
    # The one-warpgroup kernel at 2 stages (the warp-specialised one cuts its stages to
    # what fits, _fit_warp_specialized): operand buffers plus the output tile.
    need = 2 * (bs.block_m * bs.block_k + bs.block_k * bs.block_n) * width
    need += bs.block_m * bs.block_n * width
    if need > pallas_mosaic_gpu._SMEM_BYTES:
        return f"tiles need {need} bytes of shared memory > {pallas_mosaic_gpu._SMEM_BYTES}"
    return None


def mosaic_tpu_reason(bs, product: str, dims: Mapping[str, int], dtype, *,
                      caller: bool = False) -> str | None:
    del caller  # one budget: the scoped VMEM every TPU generation has
    rows, contraction, cols = _product_dims(product, dims)
    if product == "dkernel":
        rows, contraction, cols = dims["k"], dims["m"], dims["n"]
        sizes = {"tm": (bs.tm, _ceil(dims["m"], 16)), "tk": (bs.tk, _ceil(dims["k"], 128)),
                 "tn": (bs.tn, _ceil(dims["n"], 128))}
    else:
        sizes = {"tm": (bs.tm, _ceil(rows, 16)), "tk": (bs.tk, _ceil(contraction, 128)),
                 "tn": (bs.tn, _ceil(cols, 128))}
    if (why := _too_large(sizes)) is not None:
        return why
    need = (2 * (bs.tm * bs.tk + bs.tk * bs.tn + bs.tm * bs.tn) + bs.tm * bs.tn) * 4
    if need > platform.TPU_VMEM_BYTES:
        return f"tiles need {need} bytes of VMEM > {platform.TPU_VMEM_BYTES}"
    return None


REASONS = {"pallas_triton": triton_reason, "pallas_triton_fp8": triton_fp8_reason,
           "pallas_mosaic_gpu": mosaic_gpu_reason, "pallas_mosaic_tpu": mosaic_tpu_reason}


def reason(backend: str, config, product: str, dims: Mapping[str, int], dtype, *,
           caller: bool = False) -> str | None:
    """Why `config` cannot run `product` of this shape on `backend` (None: it fits).
    caller: the caller's own config (Triton holds it to the device's shared memory)."""
    rule = REASONS.get(backend)
    return None if rule is None else rule(config, product, dims, dtype, caller=caller)


def check_caller(backend: str, config, product: str, dims: Mapping[str, int], dtype) -> None:
    """ValueError naming the caller's config when it does not fit."""
    if (why := reason(backend, config, product, dims, dtype, caller=True)) is not None:
        raise ValueError(f"block_sizes {config!r} for {backend} does not fit the {product} "
                         f"product of m={dims['m']}, k={dims['k']}, n={dims['n']}: {why}")
