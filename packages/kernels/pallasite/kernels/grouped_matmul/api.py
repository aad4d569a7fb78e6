"""`grouped_projection`: the public MoE expert projection, and how a backend is chosen.

Default order per lowering platform (jax.lax.platform_dependent, so one jitted function
exports for several platforms; each platform's branch is traced, only the lowered ones
are compiled):
  cuda: pallas_mosaic_gpu (mosaic_gpu_runs: sm90, 16-bit compute, and
        mosaic_gpu_preferred: at least 256 rows per group on average), then pallas_triton
        (triton_runs: sm80+), then xla;
  tpu:  pallas_mosaic_tpu (mosaic_tpu_preferred: more than one local group; 16-bit or
        fp32 compute, fp16 refused by the TPU compiler), then xla;
  else: xla, or pallas_triton through the interpreter when interpret_on_cpu=True.
A multi-platform export cannot hold the kernels yet: JAX 0.11.2 lowers every branch of
a platform_dependent for every platform (cond lowering), and a Triton or Mosaic
pallas_call has no lowering elsewhere; export once per platform instead (tested).
Kernels are admitted only where ragged_dot_runs says they compute what was asked (16-bit
compute, or fp32 at default precision, no x64). On the H200 the Triton path is 3-30x
jax.lax.ragged_dot and fits dsv3 where XLA runs out of memory; on Hopper the Mosaic GPU
kernels are ahead of Triton where groups average 256 rows or more, behind below that
(docs/performance.md, issue 7), hence mosaic_gpu_preferred. On a TPU v5e the Mosaic TPU
kernels ran the forward+backward in 0.56-0.91x a bare ragged_dot's time from 4096 down
to 256 rows per group, the forward within 6% of it, and both 1.5-1.8x faster than the XLA
path from 128 down to 2 rows per group (docs/grouped_projection.md); one group is a dense
dot, which XLA's path computes as such and faster (mosaic_tpu_preferred). Naming a
backend skips those preferences (not the can-it-run predicates).

`implementation=` a name: that backend or its error (fails fast); a sequence: tried in
order, each fallback logged with its reason, all reasons raised together (an
ExceptionGroup) if none works; None: the default order above. A backend "fails" when its
predicate refuses the input/device or it raises while being traced; errors that surface
only when XLA compiles the program cannot be caught here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallasite.kernels import autodiff, platform
from pallasite.kernels.grouped_matmul import config, fit, fp8, ops, plain
from pallasite.kernels.grouped_matmul.group_metadata import group_offsets
from pallasite.kernels.quantization import BlockScaled
from pallasite.kernels.grouped_matmul.predicates import (
    MOSAIC_GPU_MIN_ROWS_PER_GROUP,
    mosaic_gpu_preferred,
    mosaic_tpu_preferred,
    ragged_dot_runs,
)
from pallasite.reference.grouped_projection import Dtype, validate_grouped_projection

log = logging.getLogger(__name__)

# The default order on CUDA: each backend's predicate picks the first that runs (Mosaic GPU
# on sm90 with 16-bit compute and long enough groups, Triton on sm80+, XLA anywhere). The
# Mosaic GPU backend's whole GPU parity grid passes on the H200 (2026-11-30, issue 7).
CUDA_ORDER = ["pallas_mosaic_gpu", "pallas_triton", "xla"]
# A backend joins a platform's default order only when a benchmark on that hardware shows
# it ahead of XLA. On a TPU v5e (2026-12-07, docs/performance.md) the Mosaic TPU kernels,
# at 256 x 1024 x 1024 tiles, beat the XLA path at every grouped shape timed.
TPU_ORDER = ["pallas_mosaic_tpu", "xla"]
IMPLEMENTATIONS = ops.BACKENDS
# The backends whose CPU interpreter runs the kernel through host callbacks (the Mosaic
# interpreters; Triton's does not), which JAX cannot differentiate inside jax.checkpoint.
CALLBACK_INTERPRETERS = ("pallas_mosaic_gpu", "pallas_mosaic_tpu")

# Which backend a bare block-size class belongs to (by class name: the Hopper backend's
# classes live in their own modules), and the recipes it serves.
_BLOCKS_OWNER = {
    "TritonBlockSizes": ("pallas_triton", (None, "fp8")),
    "MosaicTpuBlockSizes": ("pallas_mosaic_tpu", (None,)),
    "MosaicGpuBlockSizes": ("pallas_mosaic_gpu", (None,)),
    "MosaicGpuFp8BlockSizes": ("pallas_mosaic_gpu", ("fp8",)),
}


def _importable(name: str, recipe=None) -> str | None:
    try:
        ops.backend(name, recipe)
    except ImportError as e:  # a backend that is not there is simply not in the order
        return f"{name} does not import: {e}"
    except ValueError as e:  # no products for this recipe (Mosaic TPU has no fp8)
        return str(e)
    return None


def _refusal(name: str, compute: Dtype, operands: Sequence[jax.Array], interpret: bool,
             branch: str | None = None, recipe=None) -> str | None:
    """Why backend `name` cannot run here (None: it can). interpret: CPU interpreter.
    The generic checks are here (the module imports, ragged_dot_runs); each backend's
    module says what its target and dtypes need (its `refusal`). branch: the platform of
    the platform_dependent branch being traced (None: a named call, compiled for this
    process's device). The TPU branch is only lowered for a TPU, and every TPU runs the
    Mosaic kernels, so exporting for a TPU from a CPU host still gets them."""
    if name == "xla":
        return None
    if (why := _importable(name, recipe)) is not None:
        return why
    if interpret and name in CALLBACK_INTERPRETERS and autodiff.differentiated_checkpoint():
        return autodiff.checkpoint_refusal("grouped_projection", name)
    target = None if interpret else branch or platform.compile_target()
    if recipe == "fp8":
        return fp8.refusal(name, compute, operands, target=target)
    if not ragged_dot_runs(compute, operands):
        return (f"{name}: ragged_dot_runs refuses compute={np.dtype(compute).name} with "
                f"operands {[np.dtype(o.dtype).name for o in operands]} "
                f"(x64={jax.config.jax_enable_x64}, precision="
                f"{jax.config.jax_default_matmul_precision})")
    return ops.backend(name).refusal(compute, operands, target=target)


def backend_refusal(name: str, compute: Dtype, operands: Sequence[jax.Array],
                    interpret: bool) -> str | None:
    """Why backend `name` cannot run grouped products of `compute` over `operands` here
    (None: it can), as grouped_projection asks before running it by name; for ops built
    on these backends' kernels (grouped_mlp's fused gate-up)."""
    return _refusal(name, compute, operands, interpret)


def _slower_here(name: str, x, kernel, group_sizes, recipe=None) -> str | None:
    """Why the default order passes over backend `name` although it could run (None: it
    does not): a measured preference, not a capability, so a named backend ignores it.
    Rows per group count all G groups: with local experts (group_offset) the rows of the
    kernel's own groups are about m / G each."""
    m, g = x.shape[0], group_sizes.shape[0]
    if recipe is None and name == "pallas_mosaic_gpu" and not mosaic_gpu_preferred(m, g):
        return (f"pallas_mosaic_gpu: Triton is faster with m/g = {m}/{g} < "
                f"{MOSAIC_GPU_MIN_ROWS_PER_GROUP} rows per group (mosaic_gpu_preferred)")
    if name == "pallas_mosaic_tpu" and not mosaic_tpu_preferred(kernel.shape[0]):
        return ("pallas_mosaic_tpu: one local group is a dense product, which the XLA "
                "path computes as a dense dot (mosaic_tpu_preferred)")
    return None


def _owner(blocks, recipe=None) -> str | None:
    """The backend a block config belongs to; None where it serves no product of
    `recipe` (fp8 blocks in a bf16 call, or the reverse)."""
    if blocks is None:
        return None
    owner = _BLOCKS_OWNER.get(type(blocks).__name__)
    if owner is None:
        raise TypeError(f"block_sizes must be a backend's BlockSizes or "
                        f"GroupedProjectionBlockSizes; got {blocks!r}")
    name, recipes = owner
    return name if recipe in recipes else None


def _blocks_for(name: str, block_sizes, recipe=None):
    """The part of `block_sizes` that backend `name` can use: blocks of another backend's
    class (or recipe) are dropped (that backend's default applies), so a fallback never
    receives blocks it cannot read."""
    if isinstance(block_sizes, config.GroupedProjectionBlockSizes):
        kept = {p: b if _owner(b, recipe) == name else None
                for p, b in (("forward", block_sizes.forward), ("dx", block_sizes.dx),
                             ("dkernel", block_sizes.dkernel))}
        return config.GroupedProjectionBlockSizes(**kept) if any(kept.values()) else None
    return block_sizes if _owner(block_sizes, recipe) == name else None


def _run(name, x, kernel, group_sizes, group_offset, compute, block_sizes, interpret,
         recipe=None):
    return ops.project(x, kernel, group_sizes, group_offset, name, np.dtype(compute),
                       _blocks_for(name, block_sizes, recipe), interpret, recipe)


def _try_in_order(names, x, kernel, group_sizes, group_offset, compute, block_sizes, interpret,
                  strict, branch=None, recipe=None):
    """Run the first backend of `names` that accepts; log each fallback; raise them all.
    With one name (or strict) that backend's own error is raised, not a group of one."""
    errors = []
    for i, name in enumerate(names):
        why = _refusal(name, compute, (x, kernel), interpret, branch, recipe)
        try:
            if why is not None:
                raise RuntimeError(why)
            return _run(name, x, kernel, group_sizes, group_offset, compute, block_sizes,
                        interpret, recipe)
        except Exception as e:  # noqa: BLE001 - every backend's failure is reported
            if strict or len(names) == 1:
                raise
            errors.append(e)
            if i + 1 < len(names):
                log.warning("grouped_projection: %s failed (%s: %s); trying %s",
                            name, type(e).__name__, e, names[i + 1])
    raise ExceptionGroup(
        f"grouped_projection: every implementation failed: {list(names)}", errors)


def _default(x, kernel, group_sizes, group_offset, compute, block_sizes, interpret_on_cpu,
             recipe=None):
    def branch(names, interpret=False, platform_name=None):
        names = [n for n in names if n == "xla" or _importable(n, recipe) is None]

        def run(x, kernel, group_sizes, group_offset):
            for name in names:  # the predicates pick; xla always accepts
                why = (_refusal(name, compute, (x, kernel), interpret, platform_name, recipe)
                       or _slower_here(name, x, kernel, group_sizes, recipe))
                if why is None:
                    return _try_in_order(names[names.index(name):], x, kernel, group_sizes,
                                         group_offset, compute, block_sizes, interpret,
                                         strict=False, branch=platform_name,
                                         recipe=recipe)
                log.info("grouped_projection: skipping %s: %s", name, why)
            raise AssertionError("unreachable: xla always accepts")

        return run

    cpu = ["pallas_triton", "xla"] if interpret_on_cpu else ["xla"]
    return jax.lax.platform_dependent(
        x, kernel, group_sizes, group_offset,
        cuda=branch(CUDA_ORDER, platform_name="cuda"),
        tpu=branch(TPU_ORDER, platform_name="tpu"),
        cpu=branch(cpu, interpret=bool(interpret_on_cpu)),
        default=branch(["xla"]),
    )


def checked_group_sizes(group_sizes: Int[Array, "g"], m: int) -> Int[Array, "g"]:
    """`group_sizes`, with jax.experimental.checkify checks that no size is negative and
    that they sum to at most `m` rows: traced sizes cannot be checked while tracing, so
    grouped_projection does not (it reads a negative size as 0 and cuts the groups at
    row m, docs/grouped_projection.md). Use it inside a function wrapped in checkify.checkify:

        err, y = checkify.checkify(lambda x, k, s: grouped_projection(
            x, k, checked_group_sizes(s, x.shape[0]), compute))(x, k, s)
        err.throw()
    """
    from jax.experimental import checkify

    checkify.check(jnp.all(group_sizes >= 0), "group_sizes has a negative entry: {sizes}",
                   sizes=group_sizes)
    total = group_offsets(group_sizes)[-1]  # saturates at 2**31 - 1, never wraps
    checkify.check(total <= m, "group_sizes sum to {total}, more than the {m} rows of x "
                   "(sums stop at 2**31 - 1)", total=total, m=jnp.int32(m))
    return group_sizes


def _zeros(x, kernel, compute):
    """The [m, n] result where m, k or n is zero: zeros, and zero gradients (a constant
    has none), without building a kernel over an empty grid."""
    return jnp.zeros((x.shape[0], kernel.shape[2]), compute)


def _plain_reason(x, kernel, compute) -> str | None:
    """Why the call takes the plain-JAX path (plain.py) instead of a backend, or None."""
    if np.dtype(compute) == np.float64 and jax.config.jax_enable_x64:
        return "float64 compute (summed in float64)"
    return autodiff.beyond_first_order(x, kernel)


def _plain(why, implementation, x, kernel, group_sizes, group_offset, compute):
    """plain.project, unless the caller named only Pallas backends (then say why not)."""
    names = [implementation] if isinstance(implementation, str) else list(implementation or ["xla"])
    if "xla" not in names:
        if why.startswith("float64"):
            raise RuntimeError(f"grouped_projection: {names} refuse {why}: the kernels sum in "
                               "fp32; implementation='xla' sums in float64")
        raise autodiff.first_order_error("grouped_projection", ", ".join(names), why, "xla")
    log.info("grouped_projection: %s: the plain-JAX path", why)
    return plain.project(x, kernel, group_sizes, compute, group_offset=group_offset)


def grouped_projection(
    x: Float[Array, "m k"],
    kernel: Float[Array, "g k n"],
    group_sizes: Int[Array, "g"],
    compute: Dtype,
    interpret_on_cpu: bool = False,
    *,
    group_offset=None,
    implementation: str | Sequence[str] | None = None,
    block_sizes=None,
    recipe: str | None = None,
) -> Float[Array, "m n"]:
    """`[m, n]` in `compute`: rows of group i (sorted, `group_sizes[i]` of them) times
    `kernel[i]`; rows past `sum(group_sizes)` are zero. Operands are cast to `compute`,
    products summed in fp32 and rounded once; differentiable (dx in x.dtype, dkernel in
    kernel.dtype, fp32 sums, empty groups zero dkernel).

    implementation: None, a name from IMPLEMENTATIONS, or a sequence of them (see the
    module docstring). block_sizes: a backend's BlockSizes (used by that backend only) or
    a GroupedProjectionBlockSizes per product; None: the backend's tuned default.
    interpret_on_cpu: on CPU, run the kernel through the Pallas interpreter (tests).
    group_offset: local experts (expert parallelism). None: `kernel` holds every group of
    `group_sizes`. Else an int (or int32 scalar, traced allowed, e.g. `axis_index * g`):
    `kernel` holds groups [group_offset, group_offset + g) of the G >= g in
    `group_sizes`, which still counts every sorted row of x; rows of other groups are
    zero with zero gradient, and the kernels spend no matmul on them. Groups past G are
    empty. Under jit with the kernel's group axis sharded, pallasite sets it per device
    (docs/sharding.md).

    Zero-size m, k or n give zeros (no kernel runs). The backends differentiate in
    first-order reverse mode (jax.grad, jax.vjp, jax.linearize); forward mode (jax.jvp),
    higher orders and float64 compute under x64 take the plain-JAX path (plain.py, which
    honours group_offset too), or fail naming 'xla' where only Pallas backends were named.
    group_sizes are not checked when traced: every backend reads a negative size as 0
    and cuts the groups at row m (docs/grouped_projection.md), and `checked_group_sizes`
    checks them under jax.experimental.checkify.

    fp8 (docs/fp8.md): recipe="fp8" quantizes x (1 x 128 blocks) and the kernel
    (128 x 128 blocks) inside and multiplies in e4m3, with fp32 sums promoted every 128
    deep, output in `compute` (bf16, fp16 or fp32); its backward quantizes dy the same
    way and the dkernel operands in 128-token blocks aligned to groups, and returns
    straight-through gradients in x's and kernel's dtypes. A `BlockScaled` x (1 x 128)
    and/or kernel (1 x 128 x 128, from `pallasite.kernels.quantize`) runs the same
    forward on the given values (the other operand is quantized inside); such a call is
    not differentiable (it raises under jax.grad: train with recipe="fp8").
    """
    if isinstance(x, BlockScaled) or isinstance(kernel, BlockScaled):
        return fp8.project_quantized(
            x, kernel, group_sizes, compute, group_offset=group_offset,
            implementation=implementation, interpret_on_cpu=interpret_on_cpu,
            block_sizes=block_sizes, recipe=recipe)
    validate_grouped_projection(x, kernel, group_sizes, compute, group_offset=group_offset)
    fp8.validate_recipe(recipe, x, kernel, compute)
    if implementation is not None:
        _check_names(implementation)
    if group_offset is not None:
        group_offset = jnp.asarray(group_offset, jnp.int32)
    if block_sizes is not None:
        _blocks_for("xla", block_sizes)  # a wrong type fails here, before any kernel
        _check_fit(block_sizes, x, kernel, compute, recipe)
    if 0 in x.shape or 0 in kernel.shape[1:]:
        return _zeros(x, kernel, compute)
    if (why := _plain_reason(x, kernel, compute)) is not None:
        if recipe == "fp8":
            raise fp8.beyond_first_order(why)
        return _plain(why, implementation, x, kernel, group_sizes, group_offset, compute)
    if implementation is None:
        return _default(x, kernel, group_sizes, group_offset, compute, block_sizes,
                        interpret_on_cpu, recipe)
    interpret = bool(interpret_on_cpu) and jax.default_backend() == "cpu"
    if isinstance(implementation, str):
        return _try_in_order([implementation], x, kernel, group_sizes, group_offset, compute,
                             block_sizes, interpret, strict=True, recipe=recipe)
    return _try_in_order(list(implementation), x, kernel, group_sizes, group_offset, compute,
                         block_sizes, interpret, strict=False, recipe=recipe)


def _check_fit(block_sizes, x, kernel, compute, recipe=None) -> None:
    """ValueError naming a caller's block config that does not fit its product here."""
    dims = {"m": x.shape[0], "k": x.shape[1], "n": kernel.shape[2], "g": kernel.shape[0]}
    suffix = "_fp8" if recipe == "fp8" else ""
    for product in ("forward", "dx", "dkernel"):
        blocks = config.for_product(block_sizes, product)
        owner = _owner(blocks, recipe)
        if owner is not None:
            fit.check_caller(owner + suffix, blocks, product, dims, np.dtype(compute))


def _check_names(implementation) -> None:
    """ValueError unless `implementation` is a known name or a non-empty sequence of them."""
    if isinstance(implementation, str):
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
        return
    names = list(implementation)
    unknown = [n for n in names if n not in IMPLEMENTATIONS]
    if not names or unknown:
        raise ValueError(f"implementation={implementation!r}: need names from {IMPLEMENTATIONS}")
