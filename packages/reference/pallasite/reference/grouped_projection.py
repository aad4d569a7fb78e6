"""Grouped projection (MoE expert matmul): the plain-JAX oracle, its validation, and the
fp32 building blocks every kernel backend is tested against.

Math. Rows of `x[m, k]` are sorted by group; group i owns the next `group_sizes[i]` rows
and multiplies them by `kernel[i]` (`[k, n]`). Rows past `sum(group_sizes)` belong to no
group: their output is zero and so is their gradient. With `group_offset` (local experts)
`kernel` holds groups [group_offset, group_offset + g) of the G in `group_sizes`; rows of
every other group are zero too, with zero gradient.

Numerics contract (docs/grouped_projection.md): operands are cast to `compute`, products accumulate in fp32
and round once to `compute`. The vjp takes the cotangent in `compute` and the rounded
operands, sums in fp32, and rounds once: dx to `x.dtype`, dkernel to `kernel.dtype`.
Autodiff of `astype -> dot -> astype` would not honour this (JAX's dot transpose rounds to
the operand dtype first, then converts: two roundings for fp32 x under bf16 compute), so
both forms here carry a hand-written custom_vjp.

Two forms, cross-checked in tests:
- `grouped_projection`: over `jax.lax.ragged_dot` / `ragged_dot_general` (the fallback path
  every shape and backend without a kernel takes).
- `grouped_projection_per_group`: a Python loop over groups with a row mask and dense dots;
  O(g*m*k*n) work, for small test shapes only.

Accumulation is fp32, or float64 when x64 is enabled and the compute dtype (or, for the
building blocks, an operand) is float64, so tests can hold the two forms equal in float64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer, Shaped

__all__ = [
    "Dtype",
    "PrecisionLike",
    "validate_grouped_projection",
    "grouped_projection",
    "grouped_projection_per_group",
    "gmm_reference",
    "tgmm_reference",
    "gmm_per_group",
    "tgmm_per_group",
    "accumulation_dtype",
]

_HIGHEST = jax.lax.Precision.HIGHEST

# The types of `compute` and `precision`, here and in pallasite.kernels' grouped
# projection: a dtype, its name or a scalar type (jnp.bfloat16); a precision in any of
# JAX's spellings (None, jax.lax.Precision, a DotAlgorithmPreset, their names, a pair).
Dtype = jax.typing.DTypeLike
PrecisionLike = jax.lax.PrecisionLike


# --------------------------------------------------------------------------- validation


def _shape(a) -> tuple[int, ...]:
    return tuple(getattr(a, "shape", np.shape(a)))


def _dtype(a) -> np.dtype:
    dtype = getattr(a, "dtype", None)
    return np.dtype(dtype if dtype is not None else np.asarray(a).dtype)


def _static_values(a) -> np.ndarray | None:
    """The values of `a` if they are known while tracing (not a tracer), else None."""
    if isinstance(a, jax.core.Tracer) or isinstance(a, jax.ShapeDtypeStruct):
        return None
    try:
        return np.asarray(a)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def validate_grouped_projection(
    x: Shaped[Array, "..."],
    kernel: Shaped[Array, "..."],
    group_sizes: Shaped[Array, "..."],
    compute: Dtype,
    *,
    group_offset=None,
) -> None:
    """Refuse bad input with a ValueError/TypeError naming the argument and its shape.

    Checks: x rank 2 and floating; kernel rank 3 `[g, k, n]` with g >= 1, floating, and k
    equal to x's; group_sizes rank 1 of length g (G >= g with a group_offset) and dtype
    int32; group_offset an integer scalar, within [0, G - g] where it is concrete; compute
    a floating dtype. Where group_sizes is concrete (not traced), negative entries and a
    total above m are refused too. Kernels call this same function before building
    anything.
    """
    xs, ks, gs = _shape(x), _shape(kernel), _shape(group_sizes)
    if len(xs) != 2:
        raise ValueError(f"x must be rank 2 [m, k]; got shape {xs}")
    if len(ks) != 3:
        raise ValueError(f"kernel must be rank 3 [g, k, n]; got shape {ks}")
    if ks[0] < 1:
        raise ValueError(f"kernel must hold at least one group; got shape {ks}")
    if xs[1] != ks[1]:
        raise ValueError(
            f"x and kernel disagree on k: x shape {xs} (k={xs[1]}), kernel shape {ks} (k={ks[1]})"
        )
    if group_offset is None and (len(gs) != 1 or gs[0] != ks[0]):
        raise ValueError(
            f"group_sizes must be rank 1 of length g={ks[0]} (kernel shape {ks}); got shape {gs}"
        )
    if group_offset is not None:
        _validate_group_offset(group_offset, gs, ks)
    if _dtype(group_sizes) != np.int32:
        raise TypeError(f"group_sizes must be int32; got {_dtype(group_sizes)} (shape {gs})")
    for name, a in (("x", x), ("kernel", kernel)):
        if not jnp.issubdtype(_dtype(a), jnp.floating):
            raise TypeError(f"{name} must be floating; got {_dtype(a)} (shape {_shape(a)})")
    if compute is None:  # np.dtype(None) is float64: never a default here
        raise TypeError("compute must be a floating dtype; got None")
    try:
        compute_dtype = np.dtype(compute)
    except TypeError as e:
        raise TypeError(f"compute must be a floating dtype; got {compute!r}") from e
    if not jnp.issubdtype(compute_dtype, jnp.floating):
        raise TypeError(f"compute must be a floating dtype; got {compute_dtype}")
    values = _static_values(group_sizes)
    if values is not None:
        if (values < 0).any():
            raise ValueError(f"group_sizes must be non-negative; got {values.tolist()}")
        total = int(values.astype(np.int64).sum())
        if total > xs[0]:
            raise ValueError(
                f"group_sizes sum to {total}, more than the m={xs[0]} rows of x (shape {xs})"
            )


def _validate_group_offset(group_offset, gs, ks) -> None:
    if len(gs) != 1 or gs[0] < ks[0]:
        raise ValueError(
            f"with group_offset, group_sizes must be rank 1 of length G >= g={ks[0]} (kernel "
            f"shape {ks}); got shape {gs}")
    if _shape(group_offset) != () or not jnp.issubdtype(_dtype(group_offset), jnp.integer):
        raise TypeError(f"group_offset must be an integer scalar; got {group_offset!r}")
    value = _static_values(group_offset)
    if value is not None and not 0 <= int(value) <= gs[0] - ks[0]:
        raise ValueError(
            f"group_offset={int(value)}: kernel (shape {ks}) holds groups [group_offset, "
            f"group_offset + {ks[0]}) of the G={gs[0]} in group_sizes, so it must lie in "
            f"[0, {gs[0] - ks[0]}]")


# ------------------------------------------------------------------ fp32 building blocks


def accumulation_dtype(*dtypes) -> np.dtype:
    """fp32, or float64 if any of `dtypes` is float64 (x64 tests)."""
    if any(np.dtype(d) == np.float64 for d in dtypes):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def _valid_rows(m: int, group_sizes: Integer[Array, "g"]) -> Array:
    """[m, 1] bool: row r belongs to some group (r < sum(group_sizes))."""
    total = jnp.sum(group_sizes.astype(jnp.int32))
    return (jnp.arange(m, dtype=jnp.int32) < total)[:, None]


def gmm_reference(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "g k n"] | Float[Array, "g n k"],
    group_sizes: Integer[Array, "g"],
    *,
    transpose_rhs: bool = False,
    precision=_HIGHEST,
) -> Float[Array, "m n"]:
    """Ragged product `out[r] = lhs[r] @ rhs[group(r)]` in fp32; rows past the total are 0.

    `rhs` is `[g, k, n]`, or `[g, n, k]` with `transpose_rhs=True` (so dx = gmm(dy, kernel,
    transpose_rhs=True)). Operands are widened to the accumulation dtype first (exact:
    the product of the values as given), and the product runs at HIGHEST precision by
    default so an fp32 oracle is not TF32 on GPU; a TPU's ragged_dot refuses bf16
    operands at HIGHEST (Mosaic's "Bad lhs type", a TPU v5e, jax 0.10.2). The row mask is
    explicit: the contract must not rest on what ragged_dot happens to leave in rows it
    does not own.
    """
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    acc = accumulation_dtype(lhs.dtype, rhs.dtype)
    out = jax.lax.ragged_dot(
        lhs.astype(acc), rhs.astype(acc), group_sizes, precision=precision,
        preferred_element_type=acc
    )
    return jnp.where(_valid_rows(lhs.shape[0], group_sizes), out, 0)


def tgmm_reference(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "m n"],
    group_sizes: Integer[Array, "g"],
    num_groups: int,
    *,
    precision=_HIGHEST,
) -> Float[Array, "g k n"]:
    """Per-group `lhs_g^T @ rhs_g` in fp32 (a ragged contraction over m); empty groups -> 0.

    This is dkernel = tgmm(x, dy). Rows past the total belong to no group and add nothing.
    """
    if group_sizes.shape != (num_groups,):
        raise ValueError(
            f"group_sizes must have shape ({num_groups},) for num_groups={num_groups}; "
            f"got {group_sizes.shape}"
        )
    acc = accumulation_dtype(lhs.dtype, rhs.dtype)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(  # operands widened as in gmm_reference
        lhs.astype(acc), rhs.astype(acc), group_sizes, dims, precision=precision,
        preferred_element_type=acc
    )


def _group_masks(m: int, group_sizes: Integer[Array, "g"]) -> Array:
    """[g, m] bool: row r belongs to group i (segment mask; works on traced sizes)."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    rows = jnp.arange(m, dtype=jnp.int32)[None, :]
    return (rows >= starts[:, None]) & (rows < ends[:, None])


def gmm_per_group(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "g k n"] | Float[Array, "g n k"],
    group_sizes: Integer[Array, "g"],
    *,
    transpose_rhs: bool = False,
    precision=_HIGHEST,
) -> Float[Array, "m n"]:
    """`gmm_reference` written as one dense masked dot per group (small shapes only)."""
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    acc = accumulation_dtype(lhs.dtype, rhs.dtype)
    masks = _group_masks(lhs.shape[0], group_sizes)
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]), acc)
    for i in range(rhs.shape[0]):
        dense = jnp.dot(lhs, rhs[i], precision=precision, preferred_element_type=acc)
        out = out + jnp.where(masks[i][:, None], dense, 0)
    return out


def tgmm_per_group(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "m n"],
    group_sizes: Integer[Array, "g"],
    num_groups: int,
    *,
    precision=_HIGHEST,
) -> Float[Array, "g k n"]:
    """`tgmm_reference` written as one dense masked dot per group (small shapes only)."""
    acc = accumulation_dtype(lhs.dtype, rhs.dtype)
    masks = _group_masks(lhs.shape[0], group_sizes)
    blocks = []
    for i in range(num_groups):
        masked = jnp.where(masks[i][:, None], lhs, 0)
        blocks.append(jnp.dot(masked.T, rhs, precision=precision, preferred_element_type=acc))
    return jnp.stack(blocks)


# ------------------------------------------------------------- the projection and its vjp


def _make_projection(gmm, tgmm):
    """custom_vjp projection built from a (gmm, tgmm) pair, under the numerics contract."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def projection(x, kernel, group_sizes, compute, precision):
        out, _ = forward(x, kernel, group_sizes, compute, precision)
        return out

    def forward(x, kernel, group_sizes, compute, precision):
        xc, kc = x.astype(compute), kernel.astype(compute)
        out = gmm(xc, kc, group_sizes, precision=precision).astype(compute)
        # Residuals: the rounded operands (what the contract sums from) and the input
        # dtypes, carried as empty arrays so they stay pytree leaves.
        return out, (xc, kc, group_sizes, jnp.zeros((0,), x.dtype), jnp.zeros((0,), kernel.dtype))

    def backward(compute, precision, residuals, dy):
        xc, kc, group_sizes, x_proto, k_proto = residuals
        dy = dy.astype(compute)
        dx = gmm(dy, kc, group_sizes, transpose_rhs=True, precision=precision)
        dk = tgmm(xc, dy, group_sizes, kc.shape[0], precision=precision)
        return dx.astype(x_proto.dtype), dk.astype(k_proto.dtype), None

    projection.defvjp(forward, backward)
    return projection


_projection_ragged = _make_projection(gmm_reference, tgmm_reference)
_projection_per_group = _make_projection(gmm_per_group, tgmm_per_group)


def _with_offset(projection, x, kernel, group_sizes, group_offset, compute, precision):
    """`projection` of local experts: groups [group_offset, group_offset + g) of
    group_sizes. Written as one more leading group with zero weights over the rows of the
    earlier groups, and a row mask, so the oracle needs no kernel of its own."""
    if group_offset is None:
        return projection(x, kernel, group_sizes, compute, precision)
    g, total_groups = kernel.shape[0], group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    offset = jnp.asarray(group_offset, jnp.int32)
    index = offset + jnp.arange(g, dtype=jnp.int32)
    local = jnp.where((index >= 0) & (index < total_groups),
                      sizes[jnp.clip(index, 0, total_groups - 1)], 0)
    before = jnp.sum(jnp.where(jnp.arange(total_groups) < offset, sizes, 0))
    head = jnp.zeros((1,) + kernel.shape[1:], kernel.dtype)
    out = projection(x, jnp.concatenate([head, kernel]), jnp.concatenate([before[None], local]),
                     compute, precision)
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
    mine = (rows >= before) & (rows < before + jnp.sum(local))
    return jnp.where(mine, out, jnp.zeros((), out.dtype))


def grouped_projection(
    x: Float[Array, "m k"],
    kernel: Float[Array, "g k n"],
    group_sizes: Integer[Array, "g"],
    compute: Dtype,
    *,
    precision: PrecisionLike = None,
    group_offset=None,
) -> Float[Array, "m n"]:
    """`[m, n]` in `compute`: rows of each group times that group's kernel (ragged_dot form).

    Forward: `ragged_dot(x.astype(compute), kernel.astype(compute), preferred_element_type=
    fp32)` rounded once to `compute`; rows past `sum(group_sizes)` are zero. Backward
    (custom_vjp): dx = gmm(dy, kernel^T) in x.dtype, dkernel = tgmm(x, dy) in kernel.dtype,
    each accumulated in fp32 from the compute-dtype cotangent and the rounded operands and
    rounded once; rows past the total get zero dx, empty groups zero dkernel.
    `precision=None` is the default matmul precision (TF32 for fp32 on GPU), as the
    contract says; pass `jax.lax.Precision.HIGHEST` for an exact fp32 oracle.
    group_offset: local experts (module docstring); None: kernel holds every group.
    """
    validate_grouped_projection(x, kernel, group_sizes, compute, group_offset=group_offset)
    return _with_offset(_projection_ragged, x, kernel, group_sizes, group_offset,
                        np.dtype(compute), precision)


def grouped_projection_per_group(
    x: Float[Array, "m k"],
    kernel: Float[Array, "g k n"],
    group_sizes: Integer[Array, "g"],
    compute: Dtype,
    *,
    precision: PrecisionLike = None,
    group_offset=None,
) -> Float[Array, "m n"]:
    """`grouped_projection` written per group with a segment mask and dense dots.

    Same contract, values and gradients; independent of ragged_dot so each form checks the
    other. Work is O(g*m*k*n): small shapes only.
    """
    validate_grouped_projection(x, kernel, group_sizes, compute, group_offset=group_offset)
    return _with_offset(_projection_per_group, x, kernel, group_sizes, group_offset,
                        np.dtype(compute), precision)
