"""The chunked gated delta rule's state pass as Mosaic TPU kernels, forward and backward.

The WY form (xla.py's docstring has the math) splits into work that is parallel over
chunks and a pass that walks them in order. On a TPU the parallel part is what XLA does
well: the per-chunk terms U, W, exp(G) Q, the masked D * Q K^T, exp(G_last) and
exp(G_last - G) K come from xla.chunk_terms (one batched unit-triangular solve per chunk,
on the MXU). The pass is one Mosaic kernel per direction, one program per (row, value
head, chunk), chunks innermost and "arbitrary", so the fp32 state [K, V] stays in VMEM
scratch from one chunk to the next:

  forward    u = U - W S,  o = scale (exp(G) Q S + (D * Q K^T) u),
             S' = exp(G_last) S + (exp(G_last - G) K)^T u;
             it stores each chunk's entry state (the backward's residual).
  backward   (chunks in reverse, dS' the cotangent of a chunk's exit state, in scratch)
             du = scale (D * Q K^T)^T do + (exp(G_last - G) K) dS',
             dS = exp(G_last) dS' + scale (exp(G) Q)^T do - W^T du,
             and the terms' cotangents: dU = du, dW = -du S^T, d(exp(G) Q) = scale do S^T,
             d(D * Q K^T) = scale do u^T, d(exp(G_last - G) K) = u dS'^T,
             d exp(G_last) = <S, dS'>.
JAX differentiates chunk_terms (the solve included) around the kernels' custom_vjp.

Packed sequences: per-chunk tables, prefetched as scalars, say which sequence's initial
state a chunk enters with (`entering`) and which sequence owns it (`owner`: the latest
sequence start at or before it). The final states' block follows the owner, so each
sequence's block is written at each of its chunks and leaves the kernel holding its last
chunk's exit; trailing padding chunks (identity steps) rewrite the last sequence's with
the same state. The final states' buffer is the initial states' (aliased): a sequence
that owns no chunk (empty) keeps its initial state. The backward mirrors it: a
sequence's final-state cotangent enters at its last chunk (`leaving`), its initial
state's leaves at its first. Its buffers are not aliased: walking in reverse, the last
sequence's block is visited first at the trailing padding chunks, and on a TPU v5e an
aliased final cotangent read at the sequence's last chunk came back as what those
chunks had written (zero), while the interpreter read the original. Sequences that own
no chunk take their final cotangent afterwards.

Everything in the kernels is fp32 and every dot runs at HIGHEST. The inputs may be bf16,
fp16 or fp32; the terms are formed in fp32. Named on a CPU the kernels run through the
TPU interpreter (tests); `jax.export(..., platforms=["tpu"])` lowers them to Mosaic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallasite.kernels import cost, platform, sharding
from pallasite.kernels.gated_delta import packing, xla
from pallasite.reference.gated_delta_rule import expand_heads, l2norm

_block_spec = platform.mosaic_tpu_block_spec  # int32 block indices under x64 too

F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
VMEM_LIMIT_BYTES = 32 * 1024 * 1024


def geometry_reason(dk: int, dv: int, chunk_size: int, dtypes) -> str | None:
    """Why the kernels cannot run this problem (None: they can): the chunk a multiple of
    8 (a TPU tile's rows), the inputs bf16, fp16 or fp32."""
    del dk, dv  # the blocks span K and V whole
    if chunk_size % 8:
        return f"chunk_size={chunk_size} is not a multiple of 8 (a TPU tile's rows)"
    for name, dtype in dtypes.items():
        if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
            return f"{name} has dtype {jnp.dtype(dtype)}; the kernels take bf16, fp16 or fp32"
    return None


def _dot(a, b, trans_a=False, trans_b=False):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=_HI, preferred_element_type=F32)


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                vmem_limit_bytes=VMEM_LIMIT_BYTES)


# --------------------------------------------------------------------------- kernels


def _forward_kernel(entering_ref, owner_ref, u_part_ref, w_ref, eq_ref, qk_ref, ed_ref,
                    kd_ref, init_ref, o_ref, states_ref, finals_ref, state_scr, *, scale):
    del owner_ref  # in the index maps only
    bi, ci = pl.program_id(0), pl.program_id(2)

    @pl.when(ci == 0)
    def _():
        state_scr[...] = jnp.zeros_like(state_scr)

    state = jnp.where(entering_ref[bi, ci] >= 0, init_ref[...], state_scr[...])
    states_ref[...] = state
    u = u_part_ref[...] - _dot(w_ref[...], state)
    o = scale * (_dot(eq_ref[...], state) + _dot(qk_ref[...], u))
    o_ref[...] = o.astype(o_ref.dtype)
    new = ed_ref[...] * state + _dot(kd_ref[...], u, trans_a=True)
    state_scr[...] = new
    finals_ref[...] = new


def _backward_kernel(entering_ref, leaving_ref, owner_ref, u_part_ref, w_ref, eq_ref,
                     qk_ref, ed_ref, kd_ref, states_ref, do_ref, dfinal_ref, du_ref, dw_ref,
                     deq_ref, dqk_ref, ded_ref, dkd_ref, dinit_ref, carry_scr, *, scale,
                     num_chunks):
    del owner_ref
    bi, step = pl.program_id(0), pl.program_id(2)
    ci = num_chunks - 1 - step

    @pl.when(step == 0)
    def _():
        carry_scr[...] = jnp.zeros_like(carry_scr)

    d_exit = jnp.where(leaving_ref[bi, ci] >= 0, dfinal_ref[...], carry_scr[...])
    state = states_ref[...]
    do = do_ref[...].astype(F32)
    w, qk, kd = w_ref[...], qk_ref[...], kd_ref[...]
    u = u_part_ref[...] - _dot(w, state)
    du = scale * _dot(qk, do, trans_a=True) + _dot(kd, d_exit)
    d_state = (ed_ref[...] * d_exit + scale * _dot(eq_ref[...], do, trans_a=True)
               - _dot(w, du, trans_a=True))
    du_ref[...] = du
    dw_ref[...] = -_dot(du, state, trans_b=True)
    deq_ref[...] = scale * _dot(do, state, trans_b=True)
    dqk_ref[...] = scale * _dot(do, u, trans_b=True)
    dkd_ref[...] = _dot(u, d_exit, trans_b=True)
    ded_ref[...] = jnp.sum(state * d_exit, keepdims=True)
    dinit_ref[...] = d_state  # the block of the chunk's owner: its first chunk writes last
    carry_scr[...] = jnp.where(entering_ref[bi, ci] >= 0, jnp.zeros_like(d_state), d_state)


def _forward_body(u_part, w, eq, qk, ed, kd, state):
    """The forward kernel's arithmetic over every program (pl.estimate_cost): u_part
    [Z, C, V], w, eq, kd [Z, C, K], qk [Z, C, C], ed [Z], state [Z, K, V]."""
    u = u_part - jnp.einsum("zck,zkv->zcv", w, state)
    o = 2.0 * (jnp.einsum("zck,zkv->zcv", eq, state) + jnp.einsum("zcj,zjv->zcv", qk, u))
    return o, ed[:, None, None] * state + jnp.einsum("zck,zcv->zkv", kd, u)


def _backward_body(u_part, w, eq, qk, ed, kd, state, do, d_exit):
    """The backward kernel's arithmetic over every program (pl.estimate_cost): as
    _forward_body's, with do [Z, C, V] and d_exit [Z, K, V]."""
    u = u_part - jnp.einsum("zck,zkv->zcv", w, state)
    du = 2.0 * jnp.einsum("zjc,zjv->zcv", qk, do) + jnp.einsum("zck,zkv->zcv", kd, d_exit)
    d_state = (ed[:, None, None] * d_exit + 2.0 * jnp.einsum("zck,zcv->zkv", eq, do)
               - jnp.einsum("zck,zcv->zkv", w, du))
    dw = -jnp.einsum("zcv,zkv->zck", du, state)
    deq = 2.0 * jnp.einsum("zcv,zkv->zck", do, state)
    dqk = 2.0 * jnp.einsum("zcv,zjv->zcj", do, u)
    dkd = jnp.einsum("zcv,zkv->zck", u, d_exit)
    return d_state, dw, deq, dqk, dkd, state * d_exit


def _estimate(body, terms, inputs, outputs, *extra):
    """cost.estimate of `body` on stand-ins of one program per (row, chunk, head)."""
    u_part, w, _, qk, _, _ = terms
    b, nc, h, chunk, dv = u_part.shape
    z, dk = b * nc * h, w.shape[4]
    rows_v, rows_k = cost.struct((z, chunk, dv), F32), cost.struct((z, chunk, dk), F32)
    state = cost.struct((z, dk, dv), F32)
    stand_ins = (rows_v, rows_k, rows_k, cost.struct((z, chunk, chunk), F32),
                 cost.struct((z,), F32), rows_k, state)
    stand_ins += tuple({"rows_v": rows_v, "state": state}[e] for e in extra)
    return cost.estimate(body, *stand_ins, inputs=inputs, outputs=outputs)


# ----------------------------------------------------------------------------- calls


def _specs(chunk, dk, dv, nc, reverse):
    at = (lambda c: nc - 1 - c) if reverse else (lambda c: c)

    def per_chunk(*tail):
        return _block_spec((None, None, None) + tail,
                           lambda b, h, c, *tables: (b, at(c), h) + (0,) * len(tail))

    state_of_owner = _block_spec(
        (None, None, dk, dv), lambda b, h, c, *tables: (tables[-1][b, at(c)], h, 0, 0))
    return dict(rows_v=per_chunk(chunk, dv), rows_k=per_chunk(chunk, dk),
                square=per_chunk(chunk, chunk), scalar=per_chunk(1, 1),
                state=per_chunk(dk, dv), owner=state_of_owner)


def _scan_forward(terms, init, entering, owner, scale, out_dtype, interpret):
    u_part, w, eq, qk, ed, kd = terms
    b, nc, h, chunk, dv = u_part.shape
    dk = w.shape[4]
    s = _specs(chunk, dk, dv, nc, reverse=False)
    shapes = (sharding.out_struct(u_part.shape, out_dtype, like=u_part),
              sharding.out_struct((b, nc, h, dk, dv), F32, like=u_part),
              sharding.out_struct(init.shape, F32, like=init))
    return pl.pallas_call(
        functools.partial(_forward_kernel, scale=scale),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, h, nc),
            in_specs=[s["rows_v"], s["rows_k"], s["rows_k"], s["square"], s["scalar"],
                      s["rows_k"], s["owner"]],
            out_specs=[s["rows_v"], s["state"], s["owner"]],
            scratch_shapes=[pltpu.VMEM((dk, dv), F32)]),
        out_shape=shapes,
        # init (after the two tables) -> finals: each block of init is read at its
        # sequence's first chunk, the first program to visit that block.
        input_output_aliases={8: 2},
        compiler_params=_params(),
        cost_estimate=_estimate(_forward_body, terms, (entering, owner, *terms, init),
                                shapes),
        interpret=platform.mosaic_tpu_interpret(interpret),
        name="gated_delta_rule_forward_mosaic_tpu",
    )(entering, owner, u_part, w, eq, qk, ed, kd, init)


def _scan_backward(terms, states, do, dfinal, entering, leaving, owner, scale, interpret):
    u_part, w, eq, qk, ed, kd = terms
    b, nc, h, chunk, dv = u_part.shape
    dk = w.shape[4]
    s = _specs(chunk, dk, dv, nc, reverse=True)
    like = lambda t: sharding.out_struct(t.shape, F32, like=t)  # noqa: E731
    shapes = tuple(like(t) for t in terms) + (like(dfinal),)
    cotangents = pl.pallas_call(
        functools.partial(_backward_kernel, scale=scale, num_chunks=nc),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(b, h, nc),
            in_specs=[s["rows_v"], s["rows_k"], s["rows_k"], s["square"], s["scalar"],
                      s["rows_k"], s["state"], s["rows_v"], s["owner"]],
            out_specs=[s["rows_v"], s["rows_k"], s["rows_k"], s["square"], s["scalar"],
                       s["rows_k"], s["owner"]],
            scratch_shapes=[pltpu.VMEM((dk, dv), F32)]),
        out_shape=shapes,
        compiler_params=_params(),
        cost_estimate=_estimate(_backward_body, terms,
                                (entering, leaving, owner, *terms, states, do, dfinal),
                                shapes, "rows_v", "state"),
        interpret=platform.mosaic_tpu_interpret(interpret),
        name="gated_delta_rule_backward_mosaic_tpu",
    )(entering, leaving, owner, u_part, w, eq, qk, ed, kd, states, do, dfinal)
    *dterms, dinit = cotangents
    # A sequence that owns no chunk (empty) passes its initial state through: its block,
    # which no program writes, is its final state's cotangent.
    n = dfinal.shape[0]
    owns = jnp.zeros((n,), bool).at[jnp.where(entering >= 0, entering, n)].set(
        True, mode="drop")
    return (*dterms, jnp.where(owns[:, None, None, None], dinit, dfinal))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _scan(terms, init, entering, leaving, owner, scale, out_dtype, interpret):
    """(o [b, nc, h, C, V], finals [N, h, K, V] fp32) of the chunk terms' state pass."""
    del leaving
    o, _, finals = _scan_forward(terms, init, entering, owner, scale, out_dtype, interpret)
    return o, finals


def _scan_fwd(terms, init, entering, leaving, owner, scale, out_dtype, interpret):
    o, states, finals = _scan_forward(terms, init, entering, owner, scale, out_dtype,
                                      interpret)
    return (o, finals), (terms, states, entering, leaving, owner)


def _scan_bwd(scale, out_dtype, interpret, residuals, cotangents):
    del out_dtype
    terms, states, entering, leaving, owner = residuals
    do, dfinal = cotangents
    *dterms, dinit = _scan_backward(terms, states, do, dfinal.astype(F32), entering,
                                    leaving, owner, scale, interpret)
    return tuple(dterms), dinit, None, None, None


_scan.defvjp(_scan_fwd, _scan_bwd)


def forward(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, chunk_size: int,
            use_qk_l2norm_in_kernel: bool, interpret: bool = False):
    """xla.forward's contract (o [B, T, Hv, V] in v's dtype, final states [N, Hv, K, V]
    fp32; inputs validated, initial_state given), the state pass in the kernels,
    differentiable in q, k, v, g, beta and initial_state."""
    b, length, hv, dv = v.shape
    qf, kf = (expand_heads(t.astype(F32), hv) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    (qf, kf, vf, gf, bf), padded, positions, first, counts = packing.lay_out(
        (qf, kf, v.astype(F32), g.astype(F32), beta.astype(F32)), cu_seqlens, length,
        chunk_size)
    nc = padded // chunk_size
    u_part, w, eq, qk, end_decay, kd = xla.chunk_terms(qf, kf, vf, gf, bf, chunk_size)
    # [b, nc, h, ...]: each (row, chunk, head)'s block spans its last two dims.
    terms = (u_part, w, eq, qk, end_decay[..., None, None], kd)
    entering, leaving = packing.chunk_tables(b, nc, first, counts)
    # Each chunk's owner: the latest sequence start at or before it.
    owner = jnp.maximum(jax.lax.cummax(entering, axis=1), 0)
    o, finals = _scan(terms, initial_state.astype(F32), entering, leaving, owner,
                      float(scale), jnp.dtype(v.dtype), interpret)
    o = jnp.moveaxis(o, 2, 3).reshape(b, padded, hv, dv)
    return packing.steps_of(o, length, positions), finals
