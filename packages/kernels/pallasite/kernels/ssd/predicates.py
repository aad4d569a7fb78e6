"""Which SSD backend a geometry is built for, and why.

Two questions, kept apart:

- `ssd_kernel_runs(chunk_size, head_dim, state_size, backend)`: can `backend` build this
  geometry at all, and is it worth a program? (the geometry rule; it does not look at the
  device). `ssd_kernel_reason` says why not.
- `ssd_kernel_platform(chunk_size, head_dim, state_size)`: the backend to build for on the
  present device, or None for the XLA path. A backend is offered only where it runs this
  geometry AND it is admitted: a backend is admitted only where a benchmark in
  docs/performance.md shows it ahead of the XLA path.

Admission today (see ADMITTED): the Pallas Triton kernels on a GPU from sm80, for the
geometries GEOMETRY["pallas_triton"] builds (chunk 64-256, head_dim and state >= 16, the
device's shared memory per block). Measured on an H200 at chunk 256, head_dim 64, state 128 (the three
TARGETS rows): 4.4x to 6.1x ahead of the XLA path, forward and forward+backward; smaller
chunks run the same kernels with fewer tiles per row and are not separately measured. The
Mosaic TPU kernel on a TPU, for the geometries GEOMETRY["pallas_mosaic_tpu"] builds:
measured on a TPU v5e at the first TARGETS row, forward 1.27x and forward+backward 5.6x
ahead of the XLA path (bf16), the forward 1.15x-1.42x at the other two. fp16 is refused
there by the backend (the TPU compiler loads no fp16 blocks) and falls back to XLA.
Each decision is logged once per (geometry, device) at INFO on logger "pallasite.ssd".
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from pallasite.kernels import platform

_LOG = logging.getLogger("pallasite.ssd")

BACKENDS = ("pallas_mosaic_tpu", "pallas_triton")

# backend -> (admitted by default?, the measurement or the reason). Flip to True only with
# the figure that shows the kernel ahead of XLA.
ADMITTED: dict[str, tuple[bool, str]] = {
    # TPU v5e, 2026-12-07 (docs/performance.md, "chunk_ssd's Mosaic TPU kernels with 16-bit
    # matmul operands"): at the first target row, bf16, forward 12.23 ms vs XLA 15.49 and
    # forward+backward 22.13 vs 123.28 (5.6x); with fp32 operands (fp32 inputs' form)
    # 16.22 and 38.37. The bench's forward at the other rows, fp32 operands: 31.40 / 37.01
    # ms vs XLA 36.26 / 52.68.
    "pallas_mosaic_tpu": (True, "TPU v5e: forward 1.27x and forward+backward 5.6x XLA's "
                                "speed at the first target row (bf16), forward 1.15x-1.42x at "
                                "the others; docs/performance.md"),
    # Issue 8, H200, 2026-11-30 (docs/performance.md, tools/sweeps/ssd_pallas_triton_bench.py,
    # bf16, C=256, p=64, n=128, XLA path timed in the same process): forward 0.96 / 1.63 /
    # 1.96 ms vs XLA 4.65 / 9.12 / 10.80 (4.9x / 5.6x / 5.5x), forward+backward 2.70 / 4.96 /
    # 6.29 ms vs 11.89 / 23.88 / 28.47 (4.4x / 4.8x / 4.5x) on the three TARGETS rows.
    # Bench harness, same process (`python3 -m pallasite.bench --suite targets --op
    # chunk_ssd`, 17:14 UTC): forward 0.697 / 1.439 / 1.741 ms vs XLA 4.212 / 8.840 / 10.547
    # (6.0x / 6.1x / 6.1x), forward+backward 2.336 / 4.649 ms vs 11.464 / 23.383 (4.9x / 5.0x).
    "pallas_triton": (True, "H200: 4.4x-6.1x ahead of XLA on the TARGETS rows (C=256, p=64, "
                            "n=128), fwd and fwd+bwd; docs/performance.md issue 8"),
}


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One backend's limits.

    min_chunk: below it the fixed cost of a program outweighs its work. A Pallas TPU grid
      step costs ~0.35 us (Pallas TPU docs); at C=32, p=n=64 a program moves ~40 KB
      (~0.05 us at v5e's 819 GB/s) and does ~0.8 MFLOP, so overhead would be ~7x the work;
      at C=64 it is ~2x and falls with C^2 for the matmuls. The same argument holds on the
      GPU for a launch slice (the GPU owner may tighten it with measurements).
    budget_bytes: per program: VMEM (platform.TPU_VMEM_BYTES, 16 MiB: the scoped default
      on v5e, 32 MiB on v6e; the kernel asks for 32 MiB and we keep 16 as the safe
      figure), or None for Triton: the
      device's shared memory per block (platform.triton_shared_memory_budget: 163 KiB on
      sm80, 99 KiB on sm86/sm89, 227 KiB on sm90; off CUDA, the smallest of them).
    """

    min_chunk: int
    max_chunk: int
    budget_bytes: int | None
    program_bytes: object  # (chunk, head_dim, state) -> bytes one program holds
    min_width: int = 8  # head_dim and state; Triton's tensor-core dots need 16


def _mosaic_tpu_bytes(chunk: int, head_dim: int, state: int) -> int:
    """VMEM of the backward program (the larger): double-buffered blocks + scratch + temps.

    Blocks in fp32 width (bf16 halves them): x, dy, dx [C, p]; B, C, dB, dC [C, n]; the
    acs columns [C, 2] padded to 128 lanes; the acs rows [2, C] and d acs [1, C] padded to
    8 sublanes each; state, d final, d initial [p, n]; one [p, n] scratch; about 8 live
    [C, C] fp32 temporaries and 6 [C, max(p, n)] ones.
    """
    f32 = 4
    blocks = (3 * chunk * head_dim + 4 * chunk * state + chunk * 128 + 2 * 8 * chunk
              + 3 * head_dim * state) * f32
    temps = (8 * chunk * chunk + 6 * chunk * max(head_dim, state)) * f32
    return 2 * blocks + head_dim * state * f32 + temps


# The smallest row block the Triton kernels are admitted with (their BlockSizes.block_m):
# a geometry is admitted where a program of this block fits the device's shared memory.
TRITON_MIN_BLOCK_M = 32


def triton_program_bytes(head_dim: int, state: int, block_m: int = 64,
                         num_stages: int = 2, itemsize: int = 2, heads: int = 1) -> int:
    """Shared memory of the largest Triton program: the backward's rows-j kernel (issue 8),
    or the output kernel where it holds several heads (`heads`, BlockSizes.heads).

    The kernels never hold a [C, C] tile: they walk it in block_m x block_m blocks, so the
    chunk length sets the trip count, not the footprint. Per program (bf16 operands): the
    row block of x and B [block_m, p + n], num_stages pipeline stages of the streamed C
    and dy blocks [block_m, n + p], two [block_m, block_m] tiles staged for the dots, and
    one head's state [p, n]. At p=64, n=128: 104 KiB with block_m 64 (it compiled and ran
    on the H200: sm90 has 227 KiB), 56 KiB with block_m 32 (inside sm89's 99 KiB);
    p = n = 256 needs 228 KiB even at block_m 32 and is refused everywhere. itemsize: of
    the matmul operands (2 for bf16/fp16; fp32 operands, 4, stage everything twice as
    wide). Admission (the geometry rule) counts 16-bit operands.
    """
    rows = block_m * (head_dim + state) * itemsize
    rows_j = (rows + num_stages * rows + 2 * block_m * block_m * itemsize
              + head_dim * state * itemsize)
    # Per head of an output program: its x block and the two [block_m, block_m] tiles
    # staged for the dots, and its state; the C rows and streamed B blocks once. At p=64,
    # n=128, block_m 64: 8 heads asked the H200 for 308 KiB (refused at 227), 4 ran.
    output = (heads * (2 * block_m * head_dim + block_m * block_m + head_dim * state)
              + (1 + num_stages) * block_m * state) * itemsize
    return max(rows_j, output)


def _triton_bytes(chunk: int, head_dim: int, state: int) -> int:
    """The admission footprint: a program of the smallest admitted row block."""
    del chunk
    return triton_program_bytes(head_dim, state, TRITON_MIN_BLOCK_M)


GEOMETRY: dict[str, Geometry] = {
    "pallas_mosaic_tpu": Geometry(64, 512, platform.TPU_VMEM_BYTES, _mosaic_tpu_bytes),
    "pallas_triton": Geometry(64, 256, None, _triton_bytes, min_width=16),
}


def _power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def ssd_kernel_reason(chunk_size: int, head_dim: int, state_size: int, backend: str,
                      device=None) -> str | None:
    """None when `backend` can build this geometry; otherwise the reason it cannot.
    `device` (default: JAX's first) sets the Triton shared-memory budget."""
    if backend not in GEOMETRY:
        return f"unknown SSD backend {backend!r}; known: {sorted(GEOMETRY)}"
    geo = GEOMETRY[backend]
    for name, value in (("chunk_size", chunk_size), ("head_dim", head_dim),
                        ("state_size", state_size)):
        if not (_power_of_two(value) and value >= 8):
            return f"{name}={value} is not a power of two >= 8 (tiles are (8, 128)-aligned)"
    for name, value in (("head_dim", head_dim), ("state_size", state_size)):
        if value < geo.min_width:
            return f"{name}={value} < {geo.min_width}: the {backend} dots need >= {geo.min_width}"
    if chunk_size < geo.min_chunk:
        return f"chunk_size={chunk_size} < {geo.min_chunk}: too short to pay for a program"
    if chunk_size > geo.max_chunk:
        return f"chunk_size={chunk_size} > {geo.max_chunk}: [C, C] tiles exceed the program"
    need = geo.program_bytes(chunk_size, head_dim, state_size)
    budget = geo.budget_bytes or platform.triton_shared_memory_budget(device)
    if need > budget:
        return f"one program needs {need} bytes > {backend} budget {budget}"
    return None


def triton_block_sizes_reason(block_sizes, chunk_size: int | None, head_dim: int,
                              state_size: int, device=None, *, caller: bool = False,
                              itemsize: int = 2) -> str | None:
    """Why a pallas_triton BlockSizes cannot run this geometry (None: it fits): tiles that
    are powers of two from 16 (Triton's dots) no larger than the largest chunk, warps and
    stages Triton takes, and the shared memory of its programs (triton_program_bytes at
    the config's block_m, clamped to the chunk, and num_stages) within the device's
    budget. pallasite's own choices (default, table, cache, candidates) are held to
    platform.triton_shared_memory_budget (off CUDA the smallest GPU's, so that they fit
    every GPU); the caller's config (`caller`, a ValueError naming it) to the device's
    own, platform.shared_memory_bytes (no limit off CUDA, where only the interpreter runs
    it). chunk_size None: the config as given, unclamped; itemsize: of the matmul
    operands."""
    max_chunk = GEOMETRY["pallas_triton"].max_chunk
    for name in ("block_m", "block_t"):
        value = getattr(block_sizes, name)
        if not (_power_of_two(value) and value >= 16):
            return f"{name}={value} is not a power of two >= 16"
        if value > max_chunk:  # larger ones would only be clamped to the chunk
            return f"{name}={value} exceeds the largest chunk, {max_chunk}"
    if not (_power_of_two(block_sizes.block_n) and block_sizes.block_n >= 16):
        return f"block_n={block_sizes.block_n} is not a power of two >= 16"
    if not (_power_of_two(block_sizes.heads) and block_sizes.heads <= 8):
        return f"heads={block_sizes.heads} is not a power of two <= 8"
    if block_sizes.num_warps not in (1, 2, 4, 8, 16):
        return f"num_warps={block_sizes.num_warps} is not 1, 2, 4, 8 or 16"
    if not 1 <= block_sizes.num_stages <= 8:
        return f"num_stages={block_sizes.num_stages} is not in [1, 8]"
    block_m = block_sizes.block_m if chunk_size is None else min(block_sizes.block_m,
                                                                  chunk_size)
    need = triton_program_bytes(head_dim, state_size, block_m, block_sizes.num_stages,
                                itemsize, block_sizes.heads)
    budget = (platform.shared_memory_bytes(device) if caller
              else platform.triton_shared_memory_budget(device))
    if budget is not None and need > budget:
        return f"one program needs {need} bytes of shared memory > {budget}"
    return None


def ssd_kernel_runs(chunk_size: int, head_dim: int, state_size: int, backend: str,
                    device=None) -> bool:
    """Whether `backend` builds (chunk_size, head_dim, state_size) and it pays for a program
    (on `device`'s shared memory, for Triton)."""
    return ssd_kernel_reason(chunk_size, head_dim, state_size, backend, device) is None


def _device_backend(device=None) -> str | None:
    """The kernel backend the device could run: Mosaic on TPU, Triton on a GPU from sm80."""
    generation = platform.device_generation(device)
    if generation.startswith("v") or generation == "tpu":
        return "pallas_mosaic_tpu"
    if platform.triton_runs(device):
        return "pallas_triton"
    return None


def ssd_kernel_platform(chunk_size: int, head_dim: int, state_size: int,
                        device=None) -> str | None:
    """The backend to build this geometry for on `device` (default: JAX's first), or None.

    None means the XLA path: no kernel for the device, the geometry refused, or the
    backend not admitted (ADMITTED). The choice and its reason are logged once.
    """
    backend = _device_backend(device)
    if backend is None:
        choice, why = None, f"no SSD kernel for {platform.device_generation(device)}"
    elif (reason := ssd_kernel_reason(chunk_size, head_dim, state_size, backend,
                                      device)) is not None:
        choice, why = None, f"{backend} refused: {reason}"
    elif not ADMITTED[backend][0]:
        choice, why = None, f"{backend} not admitted: {ADMITTED[backend][1]}"
    else:
        choice, why = backend, f"{backend}: {ADMITTED[backend][1]}"
    _log_once(chunk_size, head_dim, state_size, backend, choice, why)
    return choice


@functools.lru_cache(maxsize=None)
def _log_once(chunk_size, head_dim, state_size, backend, choice, why) -> None:
    _LOG.info("ssd geometry chunk=%d head_dim=%d state=%d -> %s (%s)",
              chunk_size, head_dim, state_size, choice or "xla", why)
