"""pallasite.kernels: the public API.

Pallas kernels for the operations XLA does not fuse well, each with a plain-JAX reference
(pallasite.reference) it is tested against and falls back to.
"""

from pallasite.kernels.grouped_matmul import (
    GroupedProjectionBlockSizes,
    MosaicTpuBlockSizes,
    TritonBlockSizes,
    checked_group_sizes,
    grouped_projection,
    ragged_dot_runs,
)
from pallasite.kernels.platform import (
    bf16_dot_runs,
    device_generation,
    fp8_runs,
    mosaic_gpu_runs,
    triton_runs,
)
from pallasite.kernels.expert_mlp import grouped_mlp
from pallasite.kernels.gated_delta import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    gated_delta_rule_step,
)
from pallasite.kernels.mamba_scan import mamba_chunk_scan
from pallasite.kernels.quantization import BlockScaled, quantize
from pallasite.kernels.ssd_decode import selective_state_update
from pallasite.kernels.ssd import (
    chunk_ssd,
    ssd_chunk_scan,
    ssd_kernel_platform,
    ssd_kernel_runs,
)

__all__ = [
    "BlockScaled",
    "GroupedProjectionBlockSizes",
    "MosaicTpuBlockSizes",
    "TritonBlockSizes",
    "checked_group_sizes",
    "chunk_gated_delta_rule",
    "grouped_mlp",
    "grouped_projection",
    "ragged_dot_runs",
    "bf16_dot_runs",
    "chunk_ssd",
    "device_generation",
    "fp8_runs",
    "fused_recurrent_gated_delta_rule",
    "gated_delta_rule_step",
    "mamba_chunk_scan",
    "mosaic_gpu_runs",
    "quantize",
    "selective_state_update",
    "ssd_chunk_scan",
    "ssd_kernel_platform",
    "ssd_kernel_runs",
    "triton_runs",
]
