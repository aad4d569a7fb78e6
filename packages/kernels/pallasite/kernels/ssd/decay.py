"""The decays every SSD backend shares: state resets and stable in-chunk cumulative sums.

State reset. `a = -inf` at a step (how packed sequences are separated) means the state
is forgotten there: no earlier step reaches a later output or the state after it. Every
backend first clamps `a` at RESET = -1e4. exp of any segment sum that contains a clamped
step is then exactly 0 in fp32 (exp underflows to 0 below about -104), so the reset is
exact, and no exponent is ever -inf - (-inf) = NaN. The gradient of `a` is zero at a
clamped step (`reset_mask`), as it is at -inf. A step between -1e4 and -inf is a reset
too; one above -1e4 is kept as given, and so is a NaN (no comparison holds for it): it
propagates as in the definition (exp(NaN) = NaN), with a NaN gradient, and is never
mistaken for a reset. (Growth: a chunk's own positive total would have
to exceed 1e4 - 104 for a clamped step to stop underflowing; exp overflows long before.)

Stable segment sums. The kernels cannot afford a [C, C] masked cumulative sum per chunk,
so they form sum_{j<k<=i} a_k from cumulative sums. The plain difference of two fp32
cumulative sums loses eps * |acs| (an absolute error in the exponent, so a relative error
of the decay), which under strong decay (|acs| in the thousands) is 1e-4. Here the
cumulative sum is a double-float pair hi + lo (an associative scan of error-free
additions, log2(C) levels on [b, nc, C, h]): (hi_i - hi_j) + (lo_i - lo_j) is good to
eps * |segment| (hi_i - hi_j is exact where the two are within 2x: Sterbenz), the accuracy
of the masked form. Measured figures are in docs/ssd.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

RESET = -1e4
_F32 = jnp.float32


def clamp_resets(a: jax.Array) -> jax.Array:
    """a (fp32, or wider where it is) with every step at or below RESET (-inf included)
    set to RESET; NaN stays NaN (`a > RESET` would be False for it and clamp it)."""
    a = a.astype(jnp.promote_types(a.dtype, _F32))
    return jnp.where(a <= RESET, RESET, a)


def reset_mask(a: jax.Array) -> jax.Array:
    """True where a step is kept as given (NaN included), False where it was clamped (a
    reset): the gradient of `a` is zero there."""
    return ~(a <= RESET)


def _two_sum(x, y):
    """Double-float addition of (hi, lo) pairs: error-free s = x + y, then renormalise."""
    (xh, xl), (yh, yl) = x, y
    s = xh + yh
    v = s - xh
    err = (xh - (s - v)) + (yh - v) + (xl + yl)
    hi = s + err
    return hi, err - (hi - s)


def cumsum_pair(a: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """The inclusive cumulative sum of clamp_resets(a) along `axis` as fp32 (hi, lo)."""
    a = clamp_resets(a).astype(_F32)
    return jax.lax.associative_scan(_two_sum, (a, jnp.zeros_like(a)), axis=axis)
