"""The gate-up epilogue's activations in the operations every kernel lowering has (exp,
tanh, arithmetic): the reference's jax.nn forms (pallasite.reference.grouped_mlp
.ACTIVATIONS) written out, so the fused kernels and their backward compute the same
function."""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATION_NAMES = ("swiglu", "geglu")
_GELU_C = 0.7978845608028654  # sqrt(2 / pi)


def check_activation(activation: str) -> None:
    """ValueError naming a bad activation."""
    if activation not in ACTIVATION_NAMES:
        raise ValueError(f"activation={activation!r}: one of {ACTIVATION_NAMES}")


def check_gate_up(lhs, rhs, activation: str, dh=None) -> None:
    """The fused gate-up's operands, as every backend takes them: lhs [m, k], rhs [g, k,
    2f] (gate columns, then up) of lhs's dtype, a known activation, and for its gradient
    dh [m, f] (else ValueError or TypeError naming the argument)."""
    check_activation(activation)
    if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1] or rhs.shape[2] % 2:
        raise ValueError(f"lhs must be [m, k] and rhs [g, k, 2f] (gate columns, then up, so "
                         f"an even last dim); got {lhs.shape} and {rhs.shape}")
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"lhs and rhs must share the compute dtype, got {lhs.dtype} and "
                        f"{rhs.dtype}")
    want = (lhs.shape[0], rhs.shape[2] // 2)
    if dh is not None and tuple(dh.shape) != want:
        raise ValueError(f"dh must be [m, f] = {want}, got {dh.shape}")


def check_fp8_f(f: int, block: int = 128) -> None:
    """The fp8 gate-up's f (rhs.shape[2] / 2) a multiple of the 1 x 128 block, so that a
    column tile's up columns are one weight-scale block row (else ValueError naming rhs)."""
    if f % block:
        raise ValueError(f"rhs: the fp8 gate-up needs f (rhs.shape[2] / 2) a multiple of "
                         f"{block}, got f={f}")


def activation_fp32(gate: jax.Array, activation: str) -> jax.Array:
    """act(gate): silu for "swiglu", the tanh-approximate GELU for "geglu"."""
    check_activation(activation)
    if activation == "swiglu":
        return gate / (1.0 + jnp.exp(-gate))
    return 0.5 * gate * (1.0 + jnp.tanh(_GELU_C * (gate + 0.044715 * gate * gate * gate)))


def activation_and_derivative(gate: jax.Array, activation: str
                              ) -> tuple[jax.Array, jax.Array]:
    """(act(gate), act'(gate)) written out: the backward kernels' epilogue (a jvp of
    activation_fp32 would need a power -2, which Mosaic GPU does not lower)."""
    check_activation(activation)
    if activation == "swiglu":
        s = 1.0 / (1.0 + jnp.exp(-gate))
        return gate * s, s * (1.0 + gate * (1.0 - s))
    inner = _GELU_C * (gate + 0.044715 * gate * gate * gate)
    t = jnp.tanh(inner)
    d_inner = _GELU_C * (1.0 + 3 * 0.044715 * gate * gate)
    return 0.5 * gate * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * gate * (1.0 - t * t) * d_inner


def d_pre(gate, up, dh, activation: str) -> tuple[jax.Array, jax.Array]:
    """The gradient of h = act(gate) * up: (act'(gate) up dh, act(gate) dh)."""
    act, d_act = activation_and_derivative(gate, activation)
    return d_act * up * dh, act * dh


def gated(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    """h = act(gate) * up, the fused kernels' epilogue on their fp32 accumulators."""
    return activation_fp32(gate, activation) * up


def check_down(h, rhs, row_weights, dy=None) -> None:
    """The fused down product's operands, as every backend takes them: h [m, f] and rhs
    [g, f, n] of one dtype, row_weights [m], and for its backward dy [m, n] of h's dtype
    (else ValueError naming the argument)."""
    if h.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != h.shape[1] or h.dtype != rhs.dtype:
        raise ValueError(f"h must be [m, f] and rhs [g, f, n] of one dtype; got {h.shape} "
                         f"{h.dtype} and {rhs.shape} {rhs.dtype}")
    if row_weights.shape != (h.shape[0],):
        raise ValueError(f"row_weights must be [m] = [{h.shape[0]}], got {row_weights.shape}")
    if dy is not None and (dy.shape != (h.shape[0], rhs.shape[2]) or dy.dtype != h.dtype):
        raise ValueError(f"dy must be [m, n] = {(h.shape[0], rhs.shape[2])} of h's dtype "
                         f"{h.dtype}, got {dy.shape} {dy.dtype}")
