"""BlockScaled: an array stored as fp8 values and one fp32 scale per block.

A pytree (values and scales are its leaves, block_shape is static), so it passes through
jit, vmap, shard_map and device_put like the arrays it holds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.reference import quantization as ref


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockScaled:
    """`values` (fp8, the array's shape) times the fp32 `scales` of their blocks.

    scales has shape ceil(values.shape / block_shape): the last block along a dimension
    may be partial. `pallasite.kernels.quantize` makes one; `dequantize()` gives back the
    fp32 (or `dtype`) array it stands for.
    """

    values: jax.Array
    scales: jax.Array
    block_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def check(self, name: str = "BlockScaled") -> "BlockScaled":
        """self, after checking that the leaves agree with block_shape (ValueError or
        TypeError naming `name`). Not done on construction: vmap and tree maps rebuild the
        class around batched or placeholder leaves."""
        block = ref.check_block_shape(self.values.shape, self.block_shape)
        want = ref.scales_shape(self.values.shape, block)
        if tuple(self.scales.shape) != want:
            raise ValueError(f"{name}: scales shape {tuple(self.scales.shape)} does not match "
                             f"values {tuple(self.values.shape)} in blocks of {block} "
                             f"(want {want})")
        if np.dtype(self.values.dtype) not in [np.dtype(d) for d in ref.FP8_DTYPES]:
            raise TypeError(f"{name}: values must be fp8 (float8_e4m3fn, float8_e5m2), got "
                            f"{np.dtype(self.values.dtype).name}")
        if np.dtype(self.scales.dtype) != np.float32:
            raise TypeError(f"{name}: scales must be float32, got "
                            f"{np.dtype(self.scales.dtype).name}")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def dtype(self) -> np.dtype:
        """The values' fp8 dtype."""
        return np.dtype(self.values.dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """values x their blocks' scales, in `dtype`."""
        return ref.dequantize_blocks(self.values, self.scales, self.block_shape, dtype)
