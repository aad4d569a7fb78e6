"""SSD chunked scan as Mosaic TPU kernels: forward and the reverse-chunk backward.

One program per (batch, head, chunk), chunks innermost and "arbitrary" so the state passes
from one chunk to the next in a VMEM scratch (fp32) instead of through HBM; batch and head
are "parallel" (megacore splits them). Everything inside is fp32 but the matmul operands:
fp32 at HIGHEST for fp32 inputs, the input dtype for 16-bit ones (_operand_dtype).

Why the operands are transposed to head-major ([b, h, nc, C, p]) before the call: Mosaic
tiles the last two dimensions of a block in (8, 128) and the chunked layout puts heads in
the second-minor position, so a per-head block would be one row high. The head-major view
costs one XLA transpose of x, y, dx and of B/C each way; B and C stay per group
([b, g, nc, C, n]) and the index maps pick group head // (h // g), so nothing is copied per
head on the way in. Only dB and dC leave per head (fp32) and are summed per group in XLA:
the head loop is outside the chunk loop, so no program could accumulate over heads.

acs (the in-chunk cumulative sum of a) is computed in XLA as a double-float pair hi + lo
(ssd.decay: an associative scan of error-free additions, 8 levels for C=256; `a = -inf`
clamped there, an exact state reset)
and enters as rows [2, C] and columns [C, 2], so the kernel never transposes a vector.
The decay is exp((hi_i - hi_j) + (lo_i - lo_j)), masked to i >= j before the exp (so
growth above the diagonal never reaches inf * 0). hi_i - hi_j is exact when the two are
within 2x of each other (Sterbenz) -- the short segments late in a strongly decaying chunk,
where the plain difference of fp32 cumulative sums loses eps * |acs|; with the lo parts the
segment sum is good to ~eps * |segment|. Measured (docs/ssd.md): with a 50x docs/targets.md's
decay, the plain difference put y 4.4e-06 (rel L2) from a float64 oracle, this form 2e-07,
as the XLA path's masked sums.

The chunk count reaches the kernels as a Python constant, not pl.num_programs: jax 0.11.2's
TPU interpreter reused a kernel traced for 2 chunks when called with 1 and never wrote
the final state (NaN poison), seen in tests/test_ssd_api.py.

The backward runs the chunks in reverse (index map nc - 1 - k), carrying dS, the cotangent
of the state, in scratch; each chunk recomputes its own [C, C] matrices from its inputs
and its entry state (the forward's chunk_states, the only residual).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

from pallasite.kernels import cost, platform, sharding
from pallasite.kernels.ssd import costs, decay
from pallasite.reference import ssd as ref

_block_spec = platform.mosaic_tpu_block_spec  # int32 block indices under x64 too

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """The kernel's only knob: the scoped VMEM limit (its tiles are the chunk itself)."""

    vmem_limit_bytes: int = 32 * 1024 * 1024


DEFAULT = BlockSizes()


# The JAX backends (jax.default_backend()) this kernel runs on; "cpu" through the interpreter.
RUNS_ON = ("tpu", "cpu")


def refusal(device: str, dtypes=None) -> str | None:
    """Why this kernel cannot run on JAX backend `device` over operands of `dtypes`
    ({what: dtype}; None: it can). api.py asks after the geometry rule
    (predicates.ssd_kernel_reason), which is not the device's."""
    if device not in RUNS_ON:
        return f"pallas_mosaic_tpu does not run on {device} (runs on {RUNS_ON}, cpu interpreted)"
    if device == "tpu":
        return platform.mosaic_tpu_dtype_reason("pallas_mosaic_tpu", dtypes or {})
    return None


def resolve_block_sizes(block_sizes: BlockSizes | None) -> BlockSizes:
    """The caller's block sizes, else the default (the one place tuning will route)."""
    return block_sizes or DEFAULT


def _operand_dtype(dtype):
    """The matmul operand dtype for inputs of `dtype`: fp32 inputs keep fp32 operands (at
    HIGHEST: the fp32 contract is exact), 16-bit inputs give 16-bit operands, one MXU pass
    each, as the Triton kernels and mamba_ssm's do (chunk states and the decayed C B^T
    rounded to the input dtype before their products, sums in fp32)."""
    return _F32 if jnp.dtype(dtype).itemsize == 4 else jnp.dtype(dtype)


def _dot(lhs, rhs, lhs_axis, rhs_axis, operand):
    dims = (((lhs_axis,), (rhs_axis,)), ((), ()))
    precision = _HI if operand == _F32 else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(lhs.astype(operand), rhs.astype(operand), dims,
                               precision=precision, preferred_element_type=_F32)


def _nn(lhs, rhs, operand=_F32):
    return _dot(lhs, rhs, 1, 0, operand)


def _nt(lhs, rhs, operand=_F32):
    return _dot(lhs, rhs, 1, 1, operand)


def _tn(lhs, rhs, operand=_F32):
    return _dot(lhs, rhs, 0, 0, operand)


def _causal(size):
    """[C, C] True on and below the diagonal (i >= j)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
    return rows >= cols


def _decay(col, row):
    """L [C, C] = exp(acs_i - acs_j) on and below the diagonal, 0 above (hi/lo parts)."""
    diff = (col[:, 0:1] - row[0:1, :]) + (col[:, 1:2] - row[1:2, :])
    return jnp.exp(jnp.where(_causal(col.shape[0]), diff, jnp.asarray(-jnp.inf, diff.dtype)))


def _decays(col, row):
    """(L, e = exp(acs) [C, 1], w = exp(acs_last - acs) [C, 1], exp(acs_last) [1, 1])."""
    hi_last, lo_last = row[0:1, -1:], row[1:2, -1:]
    e = jnp.exp(col[:, 0:1] + col[:, 1:2])
    w = jnp.exp((hi_last - col[:, 0:1]) + (lo_last - col[:, 1:2]))
    return _decay(col, row), e, w, jnp.exp(hi_last + lo_last)


def _row_weights(row):
    """e = exp(acs) and w = exp(acs_last - acs) as rows [1, C]."""
    hi_last, lo_last = row[0:1, -1:], row[1:2, -1:]
    return (jnp.exp(row[0:1, :] + row[1:2, :]),
            jnp.exp((hi_last - row[0:1, :]) + (lo_last - row[1:2, :])))


def _rowsums_as_row(t):
    """[C, K] -> [1, C]: sum over K of each row, laid out along lanes."""
    ones = jnp.ones((8, t.shape[1]), _F32)
    return _nt(ones, t)[0:1, :]


def _load(ref):
    return ref[...].astype(_F32)


def _forward_kernel(x_ref, b_ref, c_ref, row_ref, col_ref, init_ref,
                    y_ref, final_ref, states_ref, state_scr, *, num_chunks):
    k = pl.program_id(2)
    op = _operand_dtype(x_ref.dtype)

    @pl.when(k == 0)
    def _():
        state_scr[...] = _load(init_ref)

    state = state_scr[...]
    states_ref[...] = state
    x, bm, cm = _load(x_ref), _load(b_ref), _load(c_ref)
    decay, e, w, total = _decays(col_ref[...], row_ref[...])
    # Causal for non-finite x and B (pallasite.reference.ssd): a select, not the zeros of
    # L, removes the terms above the diagonal, and x's non-finite entries reach y as NaN
    # from their step on instead of through the product.
    mix = _nt(cm, bm, op) * decay
    mix = jnp.where(_causal(x.shape[0]), mix, jnp.zeros_like(mix))
    y = _nn(mix, ref.finite_part(x), op) + e * _nt(cm, state, op)
    y_ref[...] = ref.poison(y, ref.nonfinite_since(x, axis=0)).astype(y_ref.dtype)
    new = total * state + _tn(x * w, bm, op)
    state_scr[...] = new

    @pl.when(k == num_chunks - 1)
    def _():
        final_ref[...] = new


def _backward_kernel(x_ref, b_ref, c_ref, row_ref, col_ref, states_ref, dy_ref, dfinal_ref,
                     dx_ref, db_ref, dc_ref, dacs_ref, dinit_ref, carry_scr, *, num_chunks):
    k = pl.program_id(2)
    op = _operand_dtype(x_ref.dtype)

    @pl.when(k == 0)
    def _():
        carry_scr[...] = _load(dfinal_ref)

    dexit = carry_scr[...]  # dS': cotangent of the state this chunk leaves with
    state = states_ref[...]
    x, bm, cm, dy = _load(x_ref), _load(b_ref), _load(c_ref), _load(dy_ref)
    size = x.shape[0]
    decay, e, w, total = _decays(col_ref[...], row_ref[...])
    gram = _nt(cm, bm, op)
    dmix = _nt(dy, x, op) * decay  # d(C B^T) through M = (C B^T) * L
    u = _nt(bm, dexit, op)  # B dS'^T [C, p]
    dx_ref[...] = (_tn(gram * decay, dy, op) + w * u).astype(dx_ref.dtype)
    dc_ref[...] = _nn(dmix, bm, op) + e * _nn(dy, state, op)
    db_ref[...] = _tn(dmix, cm, op) + w * _nn(x, dexit, op)

    # d acs as a row [1, C] (lanes): row sums become rows through an 8-row ones matmul
    # (NT, MXU-shaped), column sums are sublane reductions; no vector transposes.
    pm = dmix * gram
    e_row, w_row = _row_weights(row_ref[...])
    wdw = w_row * _rowsums_as_row(x * u)
    dacs = _rowsums_as_row(pm) - jnp.sum(pm, axis=0, keepdims=True) - wdw
    dacs = dacs + e_row * _rowsums_as_row(dy * _nt(cm, state, op))
    to_last = jnp.sum(wdw, axis=(0, 1), keepdims=True) + total * jnp.sum(
        dexit * state, axis=(0, 1), keepdims=True)
    is_last = jax.lax.broadcasted_iota(jnp.int32, (1, size), 1) == size - 1
    dacs_ref[...] = dacs + jnp.where(is_last, to_last, jnp.zeros_like(to_last))

    new = total * dexit + _tn(dy * e, cm, op)
    carry_scr[...] = new

    @pl.when(k == num_chunks - 1)
    def _():
        dinit_ref[...] = new


def _head_major(t):
    """[b, nc, C, h, w] -> [b, h, nc, C, w]."""
    return jnp.transpose(t, (0, 3, 1, 2, 4))


def _chunk_major(t):
    """[b, h, nc, C, w] -> [b, nc, C, h, w]."""
    return jnp.transpose(t, (0, 2, 3, 1, 4))


def _cumsums(a):
    """acs = hi + lo as rows [b, h, nc, 2, C] and columns [b, h, nc, C, 2], fp32 (the
    double-float cumulative sums of ssd.decay, resets clamped)."""
    a = jnp.transpose(a, (0, 3, 1, 2))  # [b, h, nc, C]
    hi, lo = decay.cumsum_pair(a, axis=-1)
    return jnp.stack([hi, lo], axis=-2), jnp.stack([hi, lo], axis=-1)


def _specs(shape_x, groups):
    """BlockSpecs: x-like, B/C, acs rows/columns, d acs, per-(b, h) state, per-chunk state."""
    _, nc, size, h, p = shape_x
    heads_per_group = h // groups
    return dict(
        x=lambda rev, w: _block_spec((None, None, None, size, w),
                                     lambda i, j, k: (i, j, _chunk(k, nc, rev), 0, 0)),
        bc=lambda rev, n: _block_spec(
            (None, None, None, size, n),
            # lax.div, not //: floor division of a traced int32 by a Python int makes an
            # int64 constant under jax_enable_x64 (head ids are non-negative: one quotient)
            lambda i, j, k: (i, jax.lax.div(j, jnp.int32(heads_per_group)),
                             _chunk(k, nc, rev), 0, 0)),
        row=lambda rev: _block_spec((None, None, None, 2, size),
                                    lambda i, j, k: (i, j, _chunk(k, nc, rev), 0, 0)),
        col=lambda rev: _block_spec((None, None, None, size, 2),
                                    lambda i, j, k: (i, j, _chunk(k, nc, rev), 0, 0)),
        dacs=lambda rev: _block_spec((None, None, None, 1, size),
                                     lambda i, j, k: (i, j, _chunk(k, nc, rev), 0, 0)),
        state=lambda n: _block_spec((None, None, p, n), lambda i, j, k: (i, j, 0, 0)),
        chunk_state=lambda rev, n: _block_spec(
            (None, None, None, p, n), lambda i, j, k: (i, _chunk(k, nc, rev), j, 0, 0)),
    )


def _chunk(k, nc, rev):
    return nc - 1 - k if rev else k


def _params(block_sizes):
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=block_sizes.vmem_limit_bytes,
    )


def forward_cost(shape_x, groups, n, inputs, outputs) -> pl.CostEstimate:
    """The forward program's work (costs.tpu_forward) and the call's bytes. B and C are
    read once per head (each head's program reads its group's block)."""
    del groups
    bsz, nc, size, h, p = shape_x
    return costs.tpu_forward(bsz * h * nc, size, p, n, inputs=inputs, outputs=outputs)


def backward_cost(shape_x, groups, n, inputs, outputs) -> pl.CostEstimate:
    """The backward program's work (costs.tpu_backward) and the call's bytes."""
    del groups
    bsz, nc, size, h, p = shape_x
    return costs.tpu_backward(bsz * h * nc, size, p, n, inputs=inputs, outputs=outputs)


@sharding.local_operands("chunk_ssd")
def forward(
    x: Float[Array, "b nc C h p"],
    a: Float[Array, "b nc C h"],
    b: Float[Array, "b nc C g n"],
    c: Float[Array, "b nc C g n"],
    initial_state: Float[Array, "b h p n"],
    *,
    interpret=False,
    block_sizes=None,
) -> tuple[Float[Array, "b nc C h p"], Float[Array, "b h p n"], Float[Array, "b nc h p n"]]:
    """(y [b,nc,C,h,p] x.dtype, final_state [b,h,p,n] fp32, chunk_states [b,nc,h,p,n] fp32)."""
    block_sizes = resolve_block_sizes(block_sizes)
    bsz, nc, size, h, p = x.shape
    groups, n = b.shape[-2], b.shape[-1]
    specs = _specs(x.shape, groups)
    row, col = _cumsums(a)
    out_shapes = [sharding.out_struct((bsz, h, nc, size, p), x.dtype, like=x),
                  sharding.out_struct((bsz, h, p, n), _F32, like=x),
                  sharding.out_struct((bsz, nc, h, p, n), _F32, like=x)]
    y, final, states = pl.pallas_call(
        functools.partial(_forward_kernel, num_chunks=nc),
        grid=(bsz, h, nc),
        in_specs=[specs["x"](False, p), specs["bc"](False, n), specs["bc"](False, n),
                  specs["row"](False), specs["col"](False), specs["state"](n)],
        out_specs=[specs["x"](False, p), specs["state"](n), specs["chunk_state"](False, n)],
        out_shape=out_shapes,
        scratch_shapes=[pltpu.VMEM((p, n), _F32)],
        compiler_params=_params(block_sizes),
        cost_estimate=forward_cost(x.shape, groups, n, outputs=out_shapes, inputs=(
            x, b, c, row, col, cost.struct(initial_state.shape, _F32))),
        interpret=platform.mosaic_tpu_interpret(interpret),
        name="ssd_forward_mosaic_tpu",
    )(_head_major(x), _head_major(b), _head_major(c), row, col, initial_state.astype(_F32))
    return _chunk_major(y), final, states


@sharding.local_operands("chunk_ssd")
def backward(
    x: Float[Array, "b nc C h p"],
    a: Float[Array, "b nc C h"],
    b: Float[Array, "b nc C g n"],
    c: Float[Array, "b nc C g n"],
    chunk_states: Float[Array, "b nc h p n"],
    dy: Float[Array, "b nc C h p"],
    dfinal_state: Float[Array, "b h p n"],
    *,
    interpret=False,
    block_sizes=None,
) -> tuple[Float[Array, "b nc C h p"], Float[Array, "b nc C h"], Float[Array, "b nc C g n"],
           Float[Array, "b nc C g n"], Float[Array, "b h p n"]]:
    """(dx, da, db, dc, d initial_state) in the primal dtypes (d initial_state fp32)."""
    block_sizes = resolve_block_sizes(block_sizes)
    bsz, nc, size, h, p = x.shape
    groups, n = b.shape[-2], b.shape[-1]
    specs = _specs(x.shape, groups)
    row, col = _cumsums(a)
    per_head = sharding.out_struct((bsz, h, nc, size, n), _F32, like=x)
    out_shapes = [sharding.out_struct((bsz, h, nc, size, p), x.dtype, like=x), per_head,
                  per_head, sharding.out_struct((bsz, h, nc, 1, size), _F32, like=x),
                  sharding.out_struct((bsz, h, p, n), _F32, like=x)]
    dx, db, dc, dacs, dinit = pl.pallas_call(
        functools.partial(_backward_kernel, num_chunks=nc),
        grid=(bsz, h, nc),
        in_specs=[specs["x"](True, p), specs["bc"](True, n), specs["bc"](True, n),
                  specs["row"](True), specs["col"](True), specs["chunk_state"](True, n),
                  specs["x"](True, p), specs["state"](n)],
        out_specs=[specs["x"](True, p), specs["x"](True, n), specs["x"](True, n),
                   specs["dacs"](True), specs["state"](n)],
        out_shape=out_shapes,
        scratch_shapes=[pltpu.VMEM((p, n), _F32)],
        compiler_params=_params(block_sizes),
        cost_estimate=backward_cost(x.shape, groups, n, outputs=out_shapes, inputs=(
            x, b, c, row, col, cost.struct(chunk_states.shape, _F32), x,
            cost.struct(dfinal_state.shape, _F32))),
        interpret=platform.mosaic_tpu_interpret(interpret),
        name="ssd_backward_mosaic_tpu",
    )(_head_major(x), _head_major(b), _head_major(c), row, col, chunk_states.astype(_F32),
      _head_major(dy.astype(x.dtype)), dfinal_state.astype(_F32))
    da = jnp.flip(jnp.cumsum(jnp.flip(dacs[..., 0, :], -1), -1), -1)  # [b, h, nc, C]
    da = jnp.where(decay.reset_mask(jnp.transpose(a, (0, 3, 1, 2))), da, 0.0)
    return (
        _chunk_major(dx),
        jnp.transpose(da, (0, 2, 3, 1)).astype(a.dtype),
        _group_sum(db, groups).astype(b.dtype),
        _group_sum(dc, groups).astype(c.dtype),
        dinit,
    )


def _group_sum(per_head, groups):
    """[b, h, nc, C, n] per head -> [b, nc, C, g, n] summed over each group's heads."""
    bsz, h, nc, size, n = per_head.shape
    summed = per_head.reshape(bsz, groups, h // groups, nc, size, n).sum(axis=2)
    return jnp.transpose(summed, (0, 2, 3, 1, 4))
