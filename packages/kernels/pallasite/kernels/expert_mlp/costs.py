"""Cost estimates of grouped_mlp's fused kernels, through pallasite.kernels.cost: each
row meets one group's weights, so the body-equivalent is one dense product plus the
epilogue's elementwise work on the [m, f] (gate-up) or [m, n] (down) result. Rows past the
total are counted: the grid cannot know the total."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallasite.kernels import cost
from pallasite.kernels.expert_mlp import epilogue

_F32 = jnp.float32
_DOT = (((1,), (0,)), ((), ()))


def gate_up(m: int, k: int, f: int, dtype, activation: str, *, grad: bool, inputs, outputs):
    """[m, k] x [k, 2f] (gate | up), then act(gate) * up; with `grad` the epilogue is
    d(pre) = (act'(gate) up dh, act(gate) dh) on an [m, f] dh instead."""
    def body(a, w, *dh):
        pre = jax.lax.dot_general(a, w, _DOT, preferred_element_type=_F32)
        gate, up = pre[:, :f], pre[:, f:]
        if grad:
            return epilogue.d_pre(gate, up, dh[0].astype(_F32), activation)
        return epilogue.gated(gate, up, activation)

    operands = [cost.struct((m, k), dtype), cost.struct((k, 2 * f), dtype)]
    if grad:
        operands.append(cost.struct((m, f), dtype))
    return cost.estimate(body, *operands, inputs=inputs, outputs=outputs)


def down_weighted(m: int, f: int, n: int, dtype, *, grad: bool, inputs, outputs):
    """[m, f] x [f, n] scaled by each row's weight; with `grad`, t = [m, n] x [f, n]^T,
    then dh = weight * t and the row sums of h * t."""
    def forward(h, w, rw):
        return jax.lax.dot_general(h, w, _DOT, preferred_element_type=_F32) * rw[:, None]

    def backward(dy, w, rw, h):
        t = jax.lax.dot_general(dy, w, (((1,), (1,)), ((), ())), preferred_element_type=_F32)
        return t * rw[:, None], jnp.sum(h.astype(_F32) * t, axis=1)

    rows = cost.struct((m,), _F32)
    if grad:
        return cost.estimate(backward, cost.struct((m, n), dtype), cost.struct((f, n), dtype),
                             rows, cost.struct((m, f), dtype), inputs=inputs, outputs=outputs)
    return cost.estimate(forward, cost.struct((m, f), dtype), cost.struct((f, n), dtype), rows,
                         inputs=inputs, outputs=outputs)
