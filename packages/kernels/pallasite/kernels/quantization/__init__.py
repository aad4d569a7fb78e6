"""Block-scaled fp8 quantization: `quantize` and the `BlockScaled` arrays it returns.

Modules: `api` (quantize and the choice of quantizer), `block_scaled` (the pytree),
`pallas_triton` (one-pass Pallas kernels in the fp8 products' layouts), `xla` (the same
layouts in plain JAX). The oracle is pallasite.reference.quantization.
"""

from pallasite.kernels.quantization.api import quantize
from pallasite.kernels.quantization.block_scaled import BlockScaled

__all__ = ["quantize", "BlockScaled"]
