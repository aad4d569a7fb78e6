"""What the grouped_projection sweeps share: their inputs (the bench's draws) and a bare
jax.lax.ragged_dot, the peer they time beside pallasite."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallasite.bench import ops

BF16 = jnp.bfloat16


def inputs(name: str, dims: tuple[int, int, int, int], copies: int = 2) -> list[dict]:
    """`copies` input sets (x, kernel, group_sizes, dy) of an (m, k, n, g) projection."""
    m, k, n, g = dims
    case = ops.gp_case(name, m, k, n, g, direction="fwd_bwd")
    keep = ("x", "kernel", "group_sizes", "dy")
    return [{key: jnp.asarray(v) for key, v in ops.make_inputs(case, seed=s).items()
             if key in keep} for s in range(copies)]


def ragged_dot(i: dict, out_dtype=BF16, backward: bool = False):
    """jax.lax.ragged_dot's forward, or its forward and both gradients (JAX's own rules)."""
    f = lambda x, w: jax.lax.ragged_dot(x, w, i["group_sizes"],  # noqa: E731
                                        preferred_element_type=out_dtype)
    if not backward:
        return f(i["x"], i["kernel"])
    y, vjp = jax.vjp(f, i["x"], i["kernel"])
    return (y, *vjp(i["dy"].astype(out_dtype)))
