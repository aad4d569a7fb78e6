"""The one way a pallas_call gets its cost estimate: pl.estimate_cost on a body-equivalent
function for the work, the call's own operands and results for the bytes.

A body-equivalent function does the kernel body's arithmetic (its dots, elementwise ops
and exps) vectorised over the grid, on stand-in operands of the shapes the body sees; it
is traced, never run. pl.estimate_cost counts 2*m*k*n per dot, one flop per element of an
elementwise op, one transcendental per element of an exp, and nothing for selects, casts
and reductions. Its byte count is that of the stand-ins, which are not what the call
moves, so bytes_accessed is the size of the call's inputs and outputs: each read or
written once, the compulsory HBM traffic (re-reads that hit L2 are left out, not guessed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import pallas as pl


def io_bytes(*arrays) -> int:
    """Bytes of arrays or ShapeDtypeStructs (None entries skipped)."""
    return int(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize
                   for a in arrays if a is not None))


def struct(shape, dtype) -> jax.ShapeDtypeStruct:
    """A stand-in operand for a body-equivalent function."""
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)


def estimate(body: Callable, *operands: jax.ShapeDtypeStruct, inputs: Sequence,
             outputs: Sequence) -> pl.CostEstimate:
    """flops and transcendentals of `body(*operands)`; bytes of the call's `inputs` and
    `outputs` (its operands and results, or their ShapeDtypeStructs)."""
    work = pl.estimate_cost(body, *operands)
    return pl.CostEstimate(flops=int(work.flops), transcendentals=int(work.transcendentals),
                           bytes_accessed=io_bytes(*inputs, *outputs))
