"""Block quantization in plain JAX (XLA), in the layouts the fp8 kernels read.

The fallback everywhere the Pallas quantizers do not run (TPU, CPU without the
interpreter, GPUs before sm89), and the baseline they are measured against. The math is
the oracle's (pallasite.reference.quantization); only the layouts are the kernels'.
Each function takes the Pallas quantizers' `interpret` too (unused here), so a caller
calls whichever module quantization.quantizer picks the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallasite.reference import quantization as ref

BLOCK = ref.TOKEN_BLOCK


def rows(x: jax.Array, dtype, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [m, c] in 1 x 128 blocks: (values [m, c], scales transposed [ceil(c/128), m])."""
    del interpret
    values, scales = ref.quantize_blocks(x, (1, BLOCK), dtype)
    return values, scales.T


def token_blocks(x: jax.Array, start: jax.Array, rows: jax.Array, dtype, *, transpose: bool = True,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [m, c] in the 128 x 1 blocks of rows [start[t], start[t] + rows[t]) (rows 0: an
    unused block): (values [c, 128 * bound] with block t in columns [128 t, 128 t + 128)
    and zeros past its rows, scales [bound, c]); with transpose=False values stay [m, c].
    bound = len(start)."""
    del interpret
    m, c = x.shape
    # Each row's block: the last block starting at or before it among the used ones.
    used = rows > 0
    row = jnp.arange(m, dtype=jnp.int32)
    bound = start.shape[0]
    ids = jnp.sum((row[:, None] >= start[None, :]) & used[None, :], axis=1) - 1
    ids = jnp.clip(ids, 0, bound - 1).astype(jnp.int32)
    values, scales = ref.quantize_token_blocks(x, ids, bound, dtype)
    scales = jnp.where(used[:, None], scales, 1.0)
    if not transpose:
        return values, scales
    position = BLOCK * ids + (row - start[ids])
    out = jnp.zeros((c, BLOCK * bound), values.dtype)
    return out.at[:, position].set(values.T), scales


def weight_blocks(w: jax.Array, dtype, *, transpose: bool, interpret: bool = False
                  ) -> tuple[jax.Array, jax.Array]:
    """w [g, k, n] in 1 x 128 x 128 blocks: (values, scales [g, ceil(k/128), ceil(n/128)]),
    both with the last two axes swapped when `transpose` ([g, n, k] values)."""
    del interpret
    values, scales = ref.quantize_blocks(w, (1, BLOCK, BLOCK), dtype)
    if transpose:
        return jnp.swapaxes(values, 1, 2), jnp.swapaxes(scales, 1, 2)
    return values, scales
