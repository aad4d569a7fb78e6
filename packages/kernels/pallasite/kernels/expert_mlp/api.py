"""`grouped_mlp`: the expert MLP as grouped_projection calls (the composition path).

The definition is pallasite.reference.grouped_mlp's: the gate-up product's fp32 sums go
through the activation before h is rounded once to compute, and the down product's
fp32 sums are scaled by the row weights before y is rounded once. Here the two
products are grouped_projection calls in compute, so every backend (Mosaic GPU's
16-bit kernels included), group_offset, expert parallelism and sharding route of
grouped_projection serves grouped_mlp. JAX differentiates the composition: each product
by grouped_projection's backward, the activation and the row weights by autodiff.

The composition rounds twice more than the definition: the `[m, 2f]` pre-activation to
compute before the activation, and y before the row weights. With fp32 compute that is
no rounding at all; with bf16 it is within the bf16 parity tolerance
(docs/grouped_mlp.md). The fused kernels (fuse_activation, below) keep the gate-up's
sums in fp32 through the activation. This path also writes and reads back the pre-activation, and
the backward keeps it.

recipe="fp8" runs both products through grouped_projection's fp8 recipe (h quantized by
the down product's own quantizer). With fuse_activation=True too it runs ops.mlp_fp8:
the fp8 gate-up quantizes h in its epilogue (h never in 16 bits), the down product reads
it as it is, and the backward keeps h's e4m3 values, not the pre-activation
(_fused_fp8_backend says where it runs: on Mosaic GPU on Hopper, else on Pallas Triton
on fp8 GPUs, there with no operand past Pallas Triton's 32-bit offsets; f a multiple of
128, no block sizes, first order). Over a
jit's mesh it keeps the rows and the experts split and takes the rest whole
(layouts.mlp_fp8_forward_planner); inside a shard_map it runs on the local arrays.

With `fuse_activation=True` the gate-up runs fused (expert_mlp.ops: act(gate) * up in
the kernel's epilogue, h rounded once, the pre-activation recomputed in the backward),
and the down product takes the row weights on its fp32 sums (y rounded once, in the
kernel's epilogue on either backend; dh and d row_weights from one kernel), its
backward keeping h and not y. It is a memory trade, not a speed-up: measured on an H200
(docs/grouped_mlp.md) the fused forward runs from 2% faster to 8% slower than the
composition, and the backward pays one more gate-up product (9-21% more time fwd+bwd)
for keeping no [m, 2f] pre-activation. It runs on a fused backend (the one named, or with
implementation=None the first of ops.FUSED_BACKENDS that can run here) when nothing
asks for more than it does (_fused_refusal): 16-bit compute, no recipe or block sizes,
first-order reverse mode at most; else it raises, naming why. Over a jit's mesh
(Explicit or Auto axes) the fused gate-up keeps the rows and the experts split, takes
the contraction whole and keeps a tensor-parallel split of the 2f columns in gate|up
pairs (expert_mlp.layouts); inside a shard_map it
runs on the local arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallasite.kernels import autodiff, platform
from pallasite.kernels.expert_mlp import ops
from pallasite.kernels.grouped_matmul import fp8
from pallasite.kernels.quantization import api as quantization
from pallasite.kernels.grouped_matmul.api import backend_refusal, grouped_projection
from pallasite.reference.grouped_mlp import activate, validate_grouped_mlp
from pallasite.reference.grouped_projection import Dtype

_F32 = jnp.float32


def grouped_mlp(
    x: Float[Array, "m k"],
    gate_up_kernel: Float[Array, "g k two_f"],
    down_kernel: Float[Array, "g f n"],
    group_sizes: Int[Array, "G"],
    compute: Dtype,
    interpret_on_cpu: bool = False,
    *,
    row_weights: Float[Array, " m"] | None = None,
    activation: str = "swiglu",
    group_offset=None,
    implementation: str | Sequence[str] | None = None,
    block_sizes=None,
    recipe: str | None = None,
    fuse_activation: bool = False,
) -> Float[Array, "m n"]:
    """`[m, n]` in compute: `h = act(x W_gate) * (x W_up)` per group, then
    `y = (h W_down) * row_weights`, each rounded to compute (this composition also
    rounds the pre-activation and y before the row weights: the module docstring).

    x [m, k] sorted by group; gate_up_kernel [g, k, 2f] (the first f columns the gate,
    the last f the up); down_kernel [g, f, n]; group_sizes [G] int32 (G = g, or with
    group_offset the global count); row_weights [m] (the router's weight of each routed
    row) or None. activation: "swiglu" (silu) or "geglu" (tanh-approximate GELU). Rows
    past sum(group_sizes), and of other experts with a group_offset, are zero.
    interpret_on_cpu, implementation, block_sizes, recipe: grouped_projection's, for both
    products. fuse_activation: the activation in the gate-up kernel's epilogue and the
    pre-activation recomputed in the backward (less memory, more time: the module
    docstring); raises where it cannot run. With recipe="fp8" it is the fp8 fused route
    (h quantized in the gate-up epilogue; the module docstring).
    Differentiable in x, both kernels and row_weights.
    """
    validate_grouped_mlp(x, gate_up_kernel, down_kernel, group_sizes, compute,
                         row_weights=row_weights, activation=activation,
                         group_offset=group_offset)
    if not isinstance(fuse_activation, bool):
        raise TypeError(f"fuse_activation must be a bool, got {fuse_activation!r}")
    fp8.validate_recipe(recipe, x, gate_up_kernel, compute)
    compute = np.dtype(compute)
    product = dict(group_offset=group_offset, implementation=implementation,
                   block_sizes=block_sizes, recipe=recipe)
    interpret = bool(interpret_on_cpu) and jax.default_backend() == "cpu"
    backend = None
    if fuse_activation and recipe == "fp8" and 0 not in x.shape and 0 not in gate_up_kernel.shape:
        backend = _fused_fp8_backend(implementation, compute,
                                     (x, gate_up_kernel, down_kernel, row_weights),
                                     block_sizes, interpret)
        return ops.mlp_fp8(x, gate_up_kernel, down_kernel, group_sizes, row_weights, compute,
                           backend=backend, activation=activation, group_offset=group_offset,
                           interpret=interpret)
    if fuse_activation and 0 not in x.shape and 0 not in gate_up_kernel.shape:
        backend = _fused_backend(implementation, compute, (x, gate_up_kernel, down_kernel),
                                 block_sizes, recipe, interpret)
        h = ops.gate_up_activation(x, gate_up_kernel, group_sizes, compute,
                                   backend=backend, activation=activation,
                                   group_offset=group_offset, interpret=interpret)
    else:
        pre = grouped_projection(x, gate_up_kernel, group_sizes, compute, interpret_on_cpu,
                                 **product)
        h = _activate_saving_input(pre, activation, compute)
    if backend is not None and row_weights is not None:
        return ops.down_weighted(h, down_kernel, group_sizes, row_weights, compute,
                                 backend=backend, group_offset=group_offset,
                                 interpret=interpret)
    if backend is not None:
        product["implementation"] = backend
    y = grouped_projection(h, down_kernel, group_sizes, compute, interpret_on_cpu, **product)
    if row_weights is None:
        return y
    return _weigh_saving_input(y, row_weights, compute)


# The composition's elementwise steps, rematerialised: their backward keeps the compute-
# dtype input (pre [m, 2f], y [m, n]) and forms the fp32 intermediates again, where plain
# autodiff would keep four fp32 [m, f] arrays of the activation and y in fp32 between the
# passes.
@functools.partial(jax.checkpoint, static_argnums=(1, 2))
def _activate_saving_input(pre, activation, compute):
    return activate(pre.astype(_F32), activation).astype(compute)


@functools.partial(jax.checkpoint, static_argnums=(2,))
def _weigh_saving_input(y, row_weights, compute):
    return (y.astype(_F32) * row_weights.astype(_F32)[:, None]).astype(compute)


def _fused_backend(implementation, compute, operands, block_sizes, recipe, interpret) -> str:
    """The fused backend fuse_activation=True runs on: the one named, or with
    implementation=None the first of ops.FUSED_BACKENDS that can run here."""
    if implementation is None:
        why = {name: _fused_refusal(name, compute, operands, block_sizes, recipe, interpret)
               for name in ops.FUSED_BACKENDS}
        for name, reason in why.items():
            if reason is None:
                return name
        raise ValueError("grouped_mlp: fuse_activation=True, but no fused backend can run "
                         "here: " + "; ".join(f"{k}: {v}" for k, v in why.items()))
    if not isinstance(implementation, str) or implementation not in ops.FUSED_BACKENDS:
        raise ValueError(f"grouped_mlp: fuse_activation=True takes implementation=None or "
                         f"one of {ops.FUSED_BACKENDS}, got {implementation!r}")
    why = _fused_refusal(implementation, compute, operands, block_sizes, recipe, interpret)
    if why is not None:
        raise ValueError(f"grouped_mlp: fuse_activation=True cannot run on {implementation}: "
                         f"{why}")
    return implementation


def _fused_refusal(implementation, compute, operands, block_sizes, recipe, interpret
                   ) -> str | None:
    """Why fused backend `implementation` cannot run this call's gate-up (None: it can)."""
    if recipe is not None:  # recipe="fp8" takes its own route (_fused_fp8_backend)
        return f"recipe={recipe!r}"
    if block_sizes is not None:
        return "block sizes (the composition's products take them)"
    if np.dtype(compute).itemsize != 2:
        return f"compute={np.dtype(compute).name} (the fused kernels take 16-bit compute)"
    if (why := autodiff.beyond_first_order(*operands)) is not None:
        return why
    return backend_refusal(implementation, compute, operands[:2], interpret)


def _fused_fp8_backend(implementation, compute, operands, block_sizes, interpret) -> str:
    """The backend recipe="fp8" with fuse_activation=True runs on (ops.FP8_FUSED_BACKENDS,
    the one named or the first that can run); raises naming why none can."""
    default = ops.FP8_FUSED_BACKENDS[::-1] if interpret else ops.FP8_FUSED_BACKENDS
    names = default if implementation is None else implementation
    if isinstance(names, str):
        names = (names,)
    unknown = [n for n in names if n not in ops.FP8_FUSED_BACKENDS]
    if unknown or not names:
        raise ValueError(f"grouped_mlp: recipe='fp8' with fuse_activation=True takes "
                         f"implementation=None or one of {ops.FP8_FUSED_BACKENDS}, got "
                         f"{implementation!r}")
    why = {n: _fused_fp8_refusal(n, compute, operands, block_sizes, interpret) for n in names}
    for name, reason in why.items():
        if reason is None:
            return name
    raise ValueError("grouped_mlp: recipe='fp8' with fuse_activation=True cannot run here: "
                     + "; ".join(f"{k}: {v}" for k, v in why.items()))


def _fused_fp8_refusal(implementation, compute, operands, block_sizes, interpret
                       ) -> str | None:
    """Why the fp8 fused route cannot run on `implementation` (None: it can)."""
    x, gate_up_kernel, down_kernel = operands[:3]
    fp8.validate_recipe("fp8", x, down_kernel, compute)  # grouped_mlp checked the gate-up's
    if block_sizes is not None:
        return "block sizes (the composition's products take them)"
    f = down_kernel.shape[1]
    if f % 128:
        return (f"f={f} is not a multiple of 128 (the gate-up quantizes h in the 1 x 128 "
                f"blocks of its column tiles)")
    if (why := autodiff.beyond_first_order(*operands)) is not None:
        return why
    for name, a in (("x", x), ("gate_up_kernel", gate_up_kernel), ("down_kernel", down_kernel)):
        if (implementation == "pallas_triton"
                and not quantization.pallas_triton.offsets_fit(a.shape, jnp.float8_e4m3fn)):
            return (f"{name} {tuple(a.shape)} has more than 2**31 elements, past the 32-bit "
                    f"offsets Pallas Triton addresses its fp8 values with (take "
                    f"fuse_activation=False, or fewer local experts)")
    return fp8.refusal(implementation, compute, (),
                       target=None if interpret else platform.compile_target())
