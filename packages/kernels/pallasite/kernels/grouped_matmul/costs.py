"""Cost estimates of the grouped matmuls (every backend's gmm and tgmm), through
pallasite.kernels.cost: each row meets one group's [k, n] weights, so the body-equivalent
is one dense [m, k] x [k, n] product (tgmm: [m, k]^T x [m, n]); 2*m*k*n flops. Rows past
the total are counted: the grid cannot know the total."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallasite.kernels import cost


def gmm(m: int, k: int, n: int, dtype, *, transpose_rhs: bool, inputs, outputs):
    rhs = (n, k) if transpose_rhs else (k, n)
    dims = (((1,), (1 if transpose_rhs else 0,)), ((), ()))
    body = lambda a, w: jax.lax.dot_general(a, w, dims, preferred_element_type=jnp.float32)  # noqa: E731
    return cost.estimate(body, cost.struct((m, k), dtype), cost.struct(rhs, dtype),
                         inputs=inputs, outputs=outputs)


def tgmm(m: int, k: int, n: int, dtype, *, inputs, outputs):
    dims = (((0,), (0,)), ((), ()))
    body = lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)  # noqa: E731
    return cost.estimate(body, cost.struct((m, k), dtype), cost.struct((m, n), dtype),
                         inputs=inputs, outputs=outputs)
