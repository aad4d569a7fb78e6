"""grouped_projection: the MoE expert projection (ragged matmul), forward and backward.

api.py (public function, backend order), ops.py (custom_vjp, sharding), layouts.py (what
each product keeps local on sharded arrays), group_metadata.py (row tiles per group),
config.py (block sizes), predicates.py (ragged_dot_runs), and one
file per backend: xla.py, pallas_triton.py, pallas_mosaic_tpu.py, pallas_mosaic_gpu.py.
"""

from pallasite.kernels.grouped_matmul.api import (
    IMPLEMENTATIONS,
    checked_group_sizes,
    grouped_projection,
)
from pallasite.kernels.grouped_matmul.config import (
    GroupedProjectionBlockSizes,
    MosaicTpuBlockSizes,
    TritonBlockSizes,
)
from pallasite.kernels.grouped_matmul.predicates import ragged_dot_runs

__all__ = [
    "IMPLEMENTATIONS",
    "GroupedProjectionBlockSizes",
    "MosaicTpuBlockSizes",
    "TritonBlockSizes",
    "checked_group_sizes",
    "grouped_projection",
    "ragged_dot_runs",
]
