"""grouped_projection in fp8: the recipe's checks and the pre-quantized forward.

recipe="fp8" runs through the same selection and custom_vjp as the bf16 products
(api.py, ops.py), on each backend's `<name>_fp8` module. This module holds what is fp8's
own: which recipes and compute dtypes there are, which backends can run them here
(`refusal`), and the forward of operands that arrive quantized (`BlockScaled`), which is
an inference path: it is not differentiable, and says so when differentiated.

Pre-quantized operands run on the arrays they are given: inside a caller's shard_map
on its local arrays; under jit over sharded arrays XLA gathers what the kernel call
needs (docs/fp8.md). Sharding of the training recipe is the bf16 products' own
(docs/sharding.md): each product quantizes its local operands.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.kernels import platform
from pallasite.kernels.grouped_matmul import ops
from pallasite.kernels.quantization import BlockScaled, quantize
from pallasite.reference import quantization as ref
from pallasite.reference.grouped_projection import validate_grouped_projection

log = logging.getLogger(__name__)

RECIPES = ops.RECIPES
# The output dtypes of an fp8 product: its fp32 sums round once to one of these.
COMPUTE = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
X_BLOCK = (1, ref.TOKEN_BLOCK)
KERNEL_BLOCK = (1, ref.TOKEN_BLOCK, ref.TOKEN_BLOCK)
# The default order on CUDA, as for bf16: Hopper's Mosaic GPU kernels, then Triton
# (sm89+), then XLA.
CUDA_ORDER = ["pallas_mosaic_gpu", "pallas_triton", "xla"]


def validate_recipe(recipe, x, kernel, compute) -> None:
    """ValueError/TypeError for an unknown recipe, or an fp8 call whose compute is not
    bf16, fp16 or fp32 or whose operands are wider than fp32."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if recipe is None:
        return
    if np.dtype(compute) not in COMPUTE:
        raise TypeError(f"recipe='fp8': compute must be one of "
                        f"{[d.name for d in COMPUTE]} (the output dtype), got "
                        f"{np.dtype(compute).name}")
    for name, a in (("x", x), ("kernel", kernel)):
        if np.dtype(a.dtype).itemsize > 4:
            raise TypeError(f"recipe='fp8': {name} must be at most 32-bit floating (it is "
                            f"quantized to e4m3), got {np.dtype(a.dtype).name}")


def refusal(name: str, compute, operands, *, target: str | None) -> str | None:
    """Why backend `name`'s fp8 products cannot run compiled for `target` (a platform;
    None: interpreted). None: they can. Under x64 the kernels' int32 group offsets would
    widen (as for bf16)."""
    if jax.config.jax_enable_x64:
        return f"{name} (fp8): the kernels refuse x64 mode (int32 group offsets)"
    return ops.backend(name, "fp8").refusal(compute, operands, target=target)


def beyond_first_order(why: str) -> NotImplementedError:
    return NotImplementedError(
        f"grouped_projection: recipe='fp8' supports first-order reverse mode only "
        f"(jax.grad, jax.vjp, jax.linearize); {why} would differentiate through the "
        f"quantization: use recipe=None there")


# --------------------------------------------------------------- pre-quantized operands


def _as_block_scaled(a, block, name: str, interpret_on_cpu: bool) -> BlockScaled:
    """`a` as a BlockScaled in `block` blocks: checked if it is one, quantized if not."""
    if isinstance(a, BlockScaled):
        a.check(name)
        if a.block_shape != block:
            raise ValueError(f"{name}: a pre-quantized {name} must use blocks of {block}, "
                             f"got {a.block_shape}")
        if a.dtype != np.dtype(jnp.float8_e4m3fn):
            raise TypeError(f"{name}: the fp8 products take float8_e4m3fn values, got "
                            f"{a.dtype.name}")
        return a
    if not hasattr(a, "dtype") or not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating array or a BlockScaled, got "
                        f"{type(a).__name__}")
    return quantize(a, block, interpret_on_cpu=interpret_on_cpu)


def _order(implementation, interpret: bool) -> list[str]:
    if implementation is not None:
        names = [implementation] if isinstance(implementation, str) else list(implementation)
        unknown = [n for n in names if n not in ops.FP8_BACKENDS]
        if not names or unknown:
            raise ValueError(f"implementation={implementation!r}: fp8 products run on "
                             f"{ops.FP8_BACKENDS}")
        return names
    if interpret:
        return ["pallas_triton", "xla"]
    if jax.default_backend() in ("gpu", "cuda"):
        return CUDA_ORDER
    return ["xla"]


def _not_differentiable(why):
    @jax.custom_vjp
    def forward_only(x, kernel):
        return why(x, kernel)

    def fwd(x, kernel):
        return why(x, kernel), None

    def bwd(_, dy):
        raise TypeError(
            "grouped_projection: a call with pre-quantized (BlockScaled) operands is not "
            "differentiable (the quantization has no gradient); train with the unquantized "
            "arrays and recipe='fp8'")

    forward_only.defvjp(fwd, bwd)
    return forward_only


def project_quantized(x, kernel, group_sizes, compute, *, group_offset=None,
                      implementation=None, interpret_on_cpu: bool = False, block_sizes=None,
                      recipe=None):
    """The forward of a BlockScaled x (1 x 128) and/or kernel (1 x 128 x 128) in
    `compute` (api.grouped_projection's docstring)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    xs = _as_block_scaled(x, X_BLOCK, "x", interpret_on_cpu)
    ks = _as_block_scaled(kernel, KERNEL_BLOCK, "kernel", interpret_on_cpu)
    validate_grouped_projection(xs.values, ks.values, group_sizes, compute,
                                group_offset=group_offset)
    validate_recipe("fp8", xs.values, ks.values, compute)
    compute = np.dtype(compute)
    m, n = xs.shape[0], ks.shape[2]
    if 0 in xs.shape or 0 in ks.shape[1:]:
        return jnp.zeros((m, n), compute)
    interpret = bool(interpret_on_cpu) and jax.default_backend() == "cpu"
    names = _order(implementation, interpret)
    target = None if interpret else platform.compile_target()
    offset = None if group_offset is None else jnp.asarray(group_offset, jnp.int32)

    def run(x_values, x_scales, k_values, k_scales):
        # The kernels' layouts: x's scales [k / 128, m]; the kernel K-major, [g, n, k].
        args = (x_values, x_scales.T, jnp.swapaxes(k_values, 1, 2), jnp.swapaxes(k_scales, 1, 2),
                group_sizes)
        errors = []
        for name in names:
            try:
                if (why := refusal(name, compute, (), target=target)) is not None:
                    raise RuntimeError(why)
                blocks = block_sizes if name != "xla" else None
                return ops.backend(name, "fp8").gmm_quantized(
                    *args, group_offset=offset, out_dtype=compute, block_sizes=blocks,
                    interpret=interpret)
            except Exception as e:  # noqa: BLE001 - every backend's failure is reported
                if len(names) == 1:
                    raise
                errors.append(e)
                log.warning("grouped_projection (pre-quantized): %s failed (%s: %s)",
                            name, type(e).__name__, e)
        raise ExceptionGroup(f"grouped_projection: every implementation failed: {names}",
                             errors)

    forward = _not_differentiable(lambda xq, kq: run(xq.values, xq.scales, kq.values, kq.scales))
    return forward(xs, ks)

