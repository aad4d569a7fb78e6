"""The chunked gated delta rule's backward through Pallas Triton: three kernels on the
forward's chunk-aligned layout, from the forward's residuals (the layout's q, k, v, G,
beta; per chunk the solve's inverse T = (I + A)^-1, W, the entry state S and u).

Per chunk, with P = D o Q K^T (D with its diagonal), Kd = exp(G_last - G) K and the
chunk's exit cotangent dS' (the next chunk's entry cotangent, plus a sequence's final
state's where the chunk is its last):

    du  = scale P^T do + Kd dS'
    dS  = exp(G_last) dS' + scale (exp(G) Q)^T do - W^T du        (u = U - W S)

  1. reverse state pass, one program per (block of value columns, value head, row),
     walking the chunks backwards with the fp32 dS [K, block_v]: it stores each
     chunk's dS' and du (in the compute dtype), and a sequence's first chunk's dS as
     its initial state's cotangent (into the final states' cotangents' buffer, aliased:
     an empty sequence's passes through). The carry restarts from zero where a chunk
     enters with an initial state.
  2. chunk gradients, two kernels (through the output and exit state; through the
     solve), one program per (block of value columns, value head, chunk, row):
     dQ = exp(G) scale do S^T + (D o scale do u^T) K; dK from P, from Kd (u dS'^T) and
     from the solve: with dU = du and dW = -du S^T, dRv = T^T dU and dRk = T^T dW =
     -dRv S^T are the cotangents of beta V and beta exp(G) K, and dA = -(dRv U^T + dRk
     W^T) = -dRv u^T (d(I + A)^-1 = -T dA T; u = U - W S, the forward's), strictly
     lower, reaches k_t . k_j, beta and G through A_tj
     = beta_t D_tj k_t . k_j. dV = beta dRv. The decay's cotangent dG gathers every
     exp(G) factor's (the entry-state term, the segments of P and A, exp(G) K, Kd,
     exp(G_last) S), and dg_s takes each over the g it spans (G is the in-chunk
     cumulative sum of g): exp(G_t)'s from t >= s, exp(G_last - G_j)'s from j < s,
     exp(G_t - G_j)'s from j < s <= t, exp(G_last)'s from all, so no large sums
     cancel. dq, dk, dbeta and dg are sums over V: each value block writes its share
     and XLA adds them.

dq and dk come out per value head (fp32) and are summed over a key head's value heads in
XLA; with use_qk_l2norm_in_kernel the kernels take the normalised q and k and the norm's
backward is XLA's VJP of it around them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallasite.kernels import cost, sharding
from pallasite.kernels.gated_delta import context_parallel, packing
from pallasite.kernels.gated_delta import pallas_triton as forward_kernels
from pallasite.kernels.gated_delta.pallas_triton import (
    F32, _dot, _iota, _load_where, _masked_decay, _params, _segment, _slot, _store_where)
from pallasite.reference.gated_delta_rule import L2NORM_EPS


def _cast_dot(cd):
    """_dot on operands cast to the compute dtype (fp32 accumulation)."""
    return lambda a, b, **kw: _dot(a.astype(cd), b.astype(cd), **kw)


# ---------------------------------------------------------------- reverse state pass


def _reverse_kernel(q_ref, k_ref, w_ref, hi_ref, lo_ref, do_ref, start_ref, count_ref,
                    seq_ref, *refs, scale: float, packed: bool, per_chunk_io: bool,
                    io_in_branches: bool):
    """One (value column block, value head, row) walks its chunks backwards, one run of
    chunks per sequence as the forward state pass does: the run's final-state cotangent
    is loaded before its chunk loop and its initial state's stored after it (under a
    branch with io_in_branches: pallas_triton.STATE_IO_IN_BRANCHES, else masked). With
    per_chunk_io (pallas_triton.pass_runs), one run over the row and the per-chunk tables
    (refs' first two) inside it: a sequence's final-state cotangent added at its last
    chunk, its initial state's stored at its first, where the carry restarts from zero."""
    enter_ref, leave_ref = refs[:2] if per_chunk_io else (None, None)
    dfinal_ref, dexit_ref, du_ref, _ = refs[-4:]  # the last: dfinal_ref's buffer (aliased)
    nc, chunk, dk = q_ref.shape
    bv = do_ref.shape[2]
    cd = w_ref.dtype
    mm = _cast_dot(cd)
    causal = _iota(chunk, chunk, 0) >= _iota(chunk, chunk, 1)

    def chunk_step(c, d_exit):
        if per_chunk_io:
            d_exit += _load_where(dfinal_ref, leave_ref[c], jnp.zeros_like(d_exit),
                                  io_in_branches)
        dexit_ref[c] = d_exit.astype(dexit_ref.dtype)
        hi, lo = hi_ref[c], lo_ref[c]
        hi_last, lo_last = hi_ref[c, chunk - 1], lo_ref[c, chunk - 1]
        q, k, do = q_ref[c], k_ref[c], do_ref[c]
        p = jnp.where(causal, _dot(q, k, trans_b=True)
                      * _masked_decay(hi, lo, hi, lo, causal), 0.0)
        to_end = jnp.exp(_segment(hi_last, lo_last, hi, lo))
        du = scale * mm(p, do, trans_a=True) + to_end[:, None] * mm(k, d_exit)
        du_ref[c] = du.astype(du_ref.dtype)
        grown_do = jnp.exp(hi + lo)[:, None] * do.astype(F32)  # exp(G) on do's rows
        d_enter = (jnp.exp(hi_last + lo_last) * d_exit + scale * mm(q, grown_do, trans_a=True)
                   - mm(w_ref[c], du, trans_a=True))
        if not per_chunk_io:
            return d_enter
        enter = enter_ref[c]
        _store_where(dfinal_ref, enter, d_enter, io_in_branches)
        return jnp.where(enter >= 0, 0.0, d_enter)

    if not packed:
        seq = seq_ref[0]
        dfinal_ref[_slot(seq)] = jax.lax.fori_loop(
            0, nc, lambda i, d: chunk_step(nc - 1 - i, d), dfinal_ref[_slot(seq)].astype(F32))
        return

    def run(r, _):
        seq, last = seq_ref[r], start_ref[r] + count_ref[r] - 1
        d_final = _load_where(dfinal_ref, seq, jnp.zeros((dk, bv), F32), io_in_branches)
        d_init = jax.lax.fori_loop(0, count_ref[r], lambda i, d: chunk_step(last - i, d),
                                   d_final)
        _store_where(dfinal_ref, seq, d_init, io_in_branches)

    jax.lax.fori_loop(0, seq_ref.shape[0], run, None)


def _reverse_body(q, k, w, hi, lo, do, d_exit, *, columns):
    """The reverse pass's arithmetic over every (row, chunk, head) (pl.estimate_cost): q,
    k, w [Z, C, K], hi, lo [Z, C], do [Z, C, V], d_exit [Z, K, V]; P (Q K^T, its segment,
    exp and product) formed once per block of value columns (`columns` blocks)."""
    z, chunk, _ = q.shape
    rep = lambda t: jnp.broadcast_to(t[:, None], (z, columns) + t.shape[1:])  # noqa: E731
    hi_r, lo_r = rep(hi), rep(lo)
    seg = (hi_r[..., :, None] - hi_r[..., None, :]) + (lo_r[..., :, None] - lo_r[..., None, :])
    p = (jnp.einsum("zbck,zbjk->zbcj", rep(q), rep(k)) * jnp.exp(seg))[:, 0]
    to_end = jnp.exp((hi[:, -1:] - hi) + (lo[:, -1:] - lo))
    du = (2.0 * jnp.einsum("zcj,zcv->zjv", p, do)
          + to_end[..., None] * jnp.einsum("zck,zkv->zcv", k, d_exit))
    grown_do = jnp.exp(hi + lo)[..., None] * do
    across = jnp.exp(hi[:, -1] + lo[:, -1])
    return (across[:, None, None] * d_exit + 2.0 * jnp.einsum("zck,zcv->zkv", q, grown_do)
            - jnp.einsum("zck,zcv->zkv", w, du))


def _reverse_pass(q, k, w, hi, lo, do, entering, leaving, dfinal, hv, scale, block_v,
                  interpret, *, packed: bool):
    """(dS' [B, NC, Hv, K, V] leaving each chunk and du [B, NC, C, Hv, V], both in the
    compute dtype (the chunk-gradient kernel's dots take them so), the initial states'
    cotangents [N, Hv, K, V] fp32). packed as pallas_triton._state_pass's."""
    b, nc, chunk, hk, dk = q.shape
    dv = do.shape[4]
    per_key_head = hv // hk
    bv = block_v
    n = dfinal.shape[0]
    runs, tables = forward_kernels.pass_runs(entering, leaving, n, packed)
    cd = w.dtype
    shapes = (sharding.out_struct((b, nc, hv, dk, dv), cd, like=do),
              sharding.out_struct(do.shape, cd, like=do),
              sharding.out_struct(dfinal.shape, F32, like=dfinal))
    z = b * nc * hv
    keys = cost.struct((z, chunk, dk), F32)
    row = cost.struct((z, chunk), F32)
    estimate = cost.estimate(
        functools.partial(_reverse_body, columns=dv // bv), keys, keys, keys, row, row,
        cost.struct((z, chunk, dv), F32), cost.struct((z, dk, dv), F32),
        inputs=(q, k, w, hi, lo, do, *runs, *tables, dfinal), outputs=shapes)
    key = pl.BlockSpec((None, nc, chunk, None, dk),
                       lambda vb, h, i: (i, 0, 0, h // per_key_head, 0))
    per_head = pl.BlockSpec((None, nc, chunk, None), lambda vb, h, i: (i, 0, 0, h))
    table = pl.BlockSpec((None, runs[0].shape[1]), lambda vb, h, i: (i, 0))
    per_chunk = pl.BlockSpec((None, nc), lambda vb, h, i: (i, 0))
    finals = pl.BlockSpec((n, None, dk, bv), lambda vb, h, i: (0, h, 0, vb))
    columns = pl.BlockSpec((None, nc, chunk, None, bv), lambda vb, h, i: (i, 0, 0, h, vb))
    return pl.pallas_call(
        functools.partial(_reverse_kernel, scale=float(scale), packed=packed,
                          per_chunk_io=bool(tables),
                          io_in_branches=forward_kernels.STATE_IO_IN_BRANCHES),
        out_shape=shapes,
        grid=(dv // bv, hv, b),
        in_specs=[
            key, key,
            pl.BlockSpec((None, nc, chunk, None, dk), lambda vb, h, i: (i, 0, 0, h, 0)),
            per_head, per_head, columns, table, table, table, *[per_chunk] * len(tables),
            finals,
        ],
        out_specs=[
            pl.BlockSpec((None, nc, None, dk, bv), lambda vb, h, i: (i, 0, h, 0, vb)),
            columns,
            finals,
        ],
        input_output_aliases={9 + len(tables): 2},
        compiler_params=_params(num_warps=4, num_stages=forward_kernels.pass_stages(
            chunk, dk, bv, max(a.dtype.itemsize for a in (q, k, w, do)), key_operands=3)),
        interpret=interpret,
        cost_estimate=estimate,
        name="gated_delta_rule_reverse_state_pass",
    )(q, k, w, hi, lo, do, *runs, *tables, dfinal)


# ------------------------------------------------------------------ chunk gradients
#
# Two kernels per (value column block, value head, chunk, row), each with about half the
# live registers of one kernel doing both, which spilled: 17.5 ms against 8.1 ms for the
# two at Qwen3-Next's shape on an H200 (2026-12-03). Every gradient they share (dk, dg)
# is a sum of the two kernels' terms: the second takes the first's shares and adds its
# own in place (aliased), so XLA adds nothing.


# _dg_of's reverse cumulative sum of `pairs` over t (a [C, C] product with a triangle of
# ones) on the tensor cores, `pairs` split into three bf16 pieces, rather than at fp32
# precision on the CUDA cores (C^3 fused multiply-adds, the operands through shared
# memory). Compiled for sm_90 (triton 3.6, 2026-12-07, Qwen3-Next's heads, bf16,
# grads_block_v 128, 8 warps) the two chunk-gradient kernels go from 3520 and 4096 SASS
# instructions (1348 and 1234 FFMA) to 2792 and 3088 (354 and 242), the second's 88
# spill stores to none (the first's 0 to 2), barriers 32 and 48 to 42 and 58. A running
# sum along the rows (jnp.cumsum) instead took 55 and 74 barriers and 254 and 165
# shuffles. Off until timed.
DG_SPANS_IN_BF16_PIECES = False


def _dg_of(at_step, spanned, end_terms, pairs):
    """dg_s of one chunk from its factors' cotangents: each exp(G) factor over the g it
    spans, with no difference of cumulative sums (which would cancel): `at_step` (on
    exp(G_t)) from t >= s, `spanned` (on exp(G_last - G_j)) from j < s, `pairs` [t, j] (on
    exp(G_t - G_j)) from j < s <= t (a reverse cumulative sum over t as a dot, then
    j < s), and `end_terms` (on exp(G_last)) from every s; None: no such factor."""
    chunk = at_step.shape[0]
    rows, cols = _iota(chunk, chunk, 0), _iota(chunk, chunk, 1)
    if DG_SPANS_IN_BF16_PIECES:
        # The ones are exact in bf16 and pairs splits into three bf16 pieces (24 bits,
        # fp32's significand), so three tensor-core products summing in fp32 give it.
        after = jnp.where(cols >= rows, 1.0, 0.0).astype(jnp.bfloat16)
        spans, rest = 0.0, pairs
        for _ in range(3):
            piece = rest.astype(jnp.bfloat16)
            spans, rest = spans + _dot(after, piece), rest - piece.astype(F32)
    else:
        after = jnp.where(cols >= rows, 1.0, 0.0).astype(F32)
        spans = _dot(after, pairs)  # [s, j]: the sum over t >= s
    inner = jnp.where(cols < rows, spans if spanned is None else spanned[None, :] + spans, 0.0)
    out = jnp.sum(jnp.where(cols >= rows, at_step[None, :], 0.0), axis=1) + jnp.sum(inner, axis=1)
    return out if end_terms is None else out + end_terms


def _grads_state_kernel(q_ref, k_ref, hi_ref, lo_ref, s_ref, u_ref, do_ref, dexit_ref,
                        dq_ref, dk_ref, dg_ref, *, scale: float):
    """The gradients through the output and the chunk's exit state:
    o = scale (exp(G) Q S + (D o Q K^T) u) and S' = exp(G_last) S + (exp(G_last - G) K)^T u;
    dq whole, and the first terms of dk and dg (this value-column block's shares)."""
    chunk = q_ref.shape[0]
    cd = u_ref.dtype
    mm = _cast_dot(cd)
    causal = _iota(chunk, chunk, 0) >= _iota(chunk, chunk, 1)
    hi, lo = hi_ref[...], lo_ref[...]
    hi_last, lo_last = hi_ref[chunk - 1], lo_ref[chunk - 1]
    q, k = q_ref[...], k_ref[...]
    do, state = do_ref[...], s_ref[...]
    d_inter = scale * jnp.exp(hi + lo)[:, None] * mm(do, state, trans_b=True)
    dp = jnp.where(causal, scale * mm(do, u_ref[...], trans_b=True)
                   * _masked_decay(hi, lo, hi, lo, causal), 0.0)
    dq_ref[...] = d_inter + mm(dp, k)
    through_p = dp * mm(q, k, trans_b=True)  # on D_tj = exp(g_(j+1) + ... + g_t)
    at_step = jnp.sum(q.astype(F32) * d_inter, axis=1)  # on exp(G_t) = exp(g_0 + ... + g_t)
    d_exit = dexit_ref[...]
    d_kd = (mm(u_ref[...], d_exit, trans_b=True)
            * jnp.exp(_segment(hi_last, lo_last, hi, lo))[:, None])
    dk_ref[...] = mm(dp, q, trans_a=True) + d_kd
    through_kd = jnp.sum(d_kd * k.astype(F32), axis=1)  # on exp(g_(j+1) + ... + g_last)
    through_end = (jnp.exp(hi_last + lo_last)  # on exp(G_last): every g
                   * jnp.sum(jnp.sum(d_exit.astype(F32) * state.astype(F32), axis=1)))
    dg_ref[...] = _dg_of(at_step, through_kd, through_end, through_p)


# The solve's gradients in the order that keeps the fewest [C, K] and [C, block_v] fp32
# tiles live (GRADS_SOLVE_KEYS_FIRST): dRk first, its share of dk added at once and dA's
# dRk W^T part formed, so dRk is dead before dRv is formed. In the former order dRv and
# dRk were live together through dA. Compiled for sm_90 (triton 3.6, Qwen3-Next's heads,
# bf16, 8 warps) the kernel's register spills fall from 167 stores / 249 loads to 144 /
# 174; on an H100 (2026-12-06, B 1, T 32768, Hv 32) the chunk gradients (both kernels)
# took 6.63 ms against 8.06, the same gradients to 4e-8.
GRADS_SOLVE_KEYS_FIRST = True
# The solve's gradients through the forward's u (GRADS_SOLVE_THROUGH_U, which takes
# precedence over the orders above): dRk = T^T dW = -(T^T du) S^T = -dRv S^T, and dA =
# -T^T dT T^T = -dRv (T (beta V) - T (beta exp(G) K) S)^T = -dRv u^T, u being the
# forward's residual. Three products a program (dRv, dRk, dA) where the orders above
# take six (du S^T, T^T of it, T^T du, dRk W^T, T (beta V) and dRv of it), and neither
# W nor T (beta V) is read or formed.
GRADS_SOLVE_THROUGH_U = True


def _grads_solve_kernel(k_ref, v_ref, hi_ref, lo_ref, beta_ref, t_ref, w_or_u_ref, s_ref,
                        du_ref, dk_in_ref, dg_in_ref, dv_ref, dbeta_ref, dk_ref, dg_ref, *,
                        keys_first: bool, through_u: bool = False):
    """The gradients through the solve (through_u: GRADS_SOLVE_THROUGH_U's form, else
    keys_first: GRADS_SOLVE_KEYS_FIRST's order):
    u = U - W S, U = T (beta V), W = T (beta exp(G) K), T = (I + A)^-1, A_tj = beta_t D_tj k_t . k_j (strictly lower). dv, dbeta (this
    block's share), and dk and dg added to the first kernel's shares (aliased).
    w_or_u_ref: the forward's u (through_u) or W (the orders), residuals, not formed
    again; K and V are loaded where used and dv is stored as soon as it is whole: held,
    the [C, K] and [C, block_v] fp32 tiles spilled registers."""
    del dk_in_ref, dg_in_ref  # the same buffers as dk_ref, dg_ref
    chunk = k_ref.shape[0]
    cd = du_ref.dtype
    mm = _cast_dot(cd)
    strict = _iota(chunk, chunk, 0) > _iota(chunk, chunk, 1)
    hi, lo, beta = hi_ref[...], lo_ref[...], beta_ref[...]
    keys = lambda: k_ref[...].astype(F32)  # noqa: E731
    values = lambda: v_ref[...].astype(F32)  # noqa: E731
    inv, du = t_ref[...], du_ref[...]
    grow = jnp.exp(hi + lo)
    # dRv and dRk: the cotangents of beta V and of beta exp(G) K.
    d_rk_of = lambda: -mm(inv, mm(du, s_ref[...], trans_b=True), trans_a=True)  # noqa: E731
    d_rv_of = lambda: mm(inv, du, trans_a=True)  # noqa: E731
    if through_u:
        d_rv = d_rv_of()
        dv_ref[...] = beta[:, None] * d_rv
        dbeta = jnp.sum(d_rv * values(), axis=1)
        d_rk = -mm(d_rv, s_ref[...], trans_b=True)  # T^T dW, dW = -du S^T
        along_keys = grow * jnp.sum(d_rk * keys(), axis=1)  # dRk . exp(G) k
        at_step, dbeta = beta * along_keys, dbeta + along_keys
        dk_ref[...] += (beta * grow)[:, None] * d_rk
        da = -mm(d_rv, w_or_u_ref[...], trans_b=True)  # d(I + A)^-1 = -T dA T
    elif keys_first:
        d_rk = d_rk_of()
        along_keys = grow * jnp.sum(d_rk * keys(), axis=1)  # dRk . exp(G) k
        at_step, dbeta = beta * along_keys, along_keys
        dk_ref[...] += (beta * grow)[:, None] * d_rk
        da = mm(d_rk, w_or_u_ref[...], trans_b=True)
        d_rv = d_rv_of()
        dv_ref[...] = beta[:, None] * d_rv
        dbeta = dbeta + jnp.sum(d_rv * values(), axis=1)
        da = -(da + mm(d_rv, mm(inv, beta[:, None] * values()), trans_b=True))
    else:
        d_rv = d_rv_of()
        dv_ref[...] = beta[:, None] * d_rv
        d_rk = d_rk_of()
        # Shared, dRk . exp(G) k and dRk . k spilled more at sm_90 (1048 against 672
        # stack bytes), so the row sum is formed twice.
        dbeta = (jnp.sum(d_rv * values(), axis=1)
                 + jnp.sum(d_rk * grow[:, None] * keys(), axis=1))
        at_step = (beta * grow) * jnp.sum(d_rk * keys(), axis=1)
        da = -(mm(d_rv, mm(inv, beta[:, None] * values()), trans_b=True)
               + mm(d_rk, w_or_u_ref[...], trans_b=True))  # d(I + A)^-1 = -T dA T
    da = jnp.where(strict, da * _masked_decay(hi, lo, hi, lo, strict), 0.0)
    through_a = da * mm(keys(), keys(), trans_b=True)  # dA_tj D_tj k_t . k_j
    dbeta_ref[...] = dbeta + jnp.sum(through_a, axis=1)
    dg_ref[...] += _dg_of(at_step, None, None, beta[:, None] * through_a)
    da = beta[:, None] * da
    if keys_first or through_u:
        dk_ref[...] += mm(da, keys()) + mm(da, keys(), trans_a=True)
    else:
        dk_ref[...] += ((beta * grow)[:, None] * d_rk + mm(da, keys())
                        + mm(da, keys(), trans_a=True))


def _dg_body(at_step, spanned, end_terms, pairs):
    """_dg_of over [Z, C] rows (pl.estimate_cost)."""
    spans = jnp.einsum("zst,ztj->zsj", jnp.ones_like(pairs), pairs)
    out = at_step + spans.sum(2)
    out = out if end_terms is None else out + end_terms
    return out if spanned is None else out + spanned


def _grads_state_body(q, k, hi, lo, state, u, do, d_exit):
    """The first chunk-gradient kernel's arithmetic over every (row, chunk, head)
    (pl.estimate_cost): q, k [Z, C, K], hi, lo [Z, C], state, d_exit [Z, K, V], u, do
    [Z, C, V]."""
    mat = lambda a, b: jnp.einsum("zij,zjk->zik", a, b)  # noqa: E731
    tr = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    seg = (hi[..., :, None] - hi[..., None, :]) + (lo[..., :, None] - lo[..., None, :])
    d_inter = 2.0 * jnp.exp(hi + lo)[..., None] * mat(do, tr(state))
    dp = 2.0 * mat(do, tr(u)) * jnp.exp(seg)
    dq = d_inter + mat(dp, k)
    through_p = dp * mat(q, tr(k))
    at_step = (q * d_inter).sum(2)
    d_kd = mat(u, tr(d_exit)) * jnp.exp((hi[:, -1:] - hi) + (lo[:, -1:] - lo))[..., None]
    dk = mat(tr(dp), q) + d_kd
    through_kd = (d_kd * k).sum(2)
    through_end = jnp.exp(hi[:, -1] + lo[:, -1]) * (d_exit * state).sum((1, 2))
    return dq, dk, _dg_body(at_step, through_kd, through_end[:, None], through_p)


def _grads_solve_body(k, v, hi, lo, beta, inv, w_or_u, state, du, dk_in, dg_in, *,
                      through_u: bool):
    """The second chunk-gradient kernel's arithmetic over every (row, chunk, head)
    (pl.estimate_cost): k [Z, C, K], v, du [Z, C, V], hi, lo, beta [Z, C], inv [Z, C, C],
    w_or_u the forward's u [Z, C, V] (through_u: GRADS_SOLVE_THROUGH_U's form) or W [Z,
    C, K], state [Z, K, V]; dk_in [Z, C, K] and dg_in [Z, C], the first kernel's
    shares."""
    mat = lambda a, b: jnp.einsum("zij,zjk->zik", a, b)  # noqa: E731
    tr = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    seg = (hi[..., :, None] - hi[..., None, :]) + (lo[..., :, None] - lo[..., None, :])
    grow = jnp.exp(hi + lo)
    d_rv = mat(tr(inv), du)
    if through_u:
        d_rk = -mat(d_rv, tr(state))
        da = -mat(d_rv, tr(w_or_u))
    else:
        d_rk = -mat(tr(inv), mat(du, tr(state)))
        da = -(mat(d_rv, tr(mat(inv, beta[..., None] * v))) + mat(d_rk, tr(w_or_u)))
    dv = beta[..., None] * d_rv
    dbeta = (d_rv * v).sum(2) + (d_rk * grow[..., None] * k).sum(2)
    at_step = (beta * grow) * (d_rk * k).sum(2)
    da = da * jnp.exp(seg)
    through_a = da * mat(k, tr(k))
    dbeta = dbeta + through_a.sum(2)
    da = beta[..., None] * da
    dk = dk_in + (beta * grow)[..., None] * d_rk + mat(da, k) + mat(tr(da), k)
    return dv, dbeta, dk, dg_in + _dg_body(at_step, None, None, beta[..., None] * through_a)


def _chunk_grads(q, k, v, hi, lo, beta, inv, w, states, u, du, do, d_exit, scale, block_v,
                 interpret):
    """(dq, dk [B, NC, C, Hv, K], dv [B, NC, C, Hv, V], dbeta, dg [B, NC, C, Hv]), fp32;
    the value-column blocks' shares summed here."""
    b, nc, chunk, hk, dk = q.shape
    hv, dv = v.shape[3:]
    per_key_head = hv // hk
    bv = block_v
    nvb = dv // bv
    key_shares = sharding.out_struct((nvb, b, nc, chunk, hv, dk), F32, like=v)
    gate_shares = sharding.out_struct((nvb,) + beta.shape, F32, like=beta)
    z = b * nc * hv * nvb
    keys, values = cost.struct((z, chunk, dk), F32), cost.struct((z, chunk, bv), F32)
    row, square = cost.struct((z, chunk), F32), cost.struct((z, dk, bv), F32)
    key = pl.BlockSpec((None, None, chunk, None, dk),
                       lambda vb, h, c, i: (i, c, 0, h // per_key_head, 0))
    key_out = pl.BlockSpec((None, None, None, chunk, None, dk),
                           lambda vb, h, c, i: (vb, i, c, 0, h, 0))
    value = pl.BlockSpec((None, None, chunk, None, bv), lambda vb, h, c, i: (i, c, 0, h, vb))
    gate = pl.BlockSpec((None, None, chunk, None), lambda vb, h, c, i: (i, c, 0, h))
    gate_out = pl.BlockSpec((None, None, None, chunk, None),
                            lambda vb, h, c, i: (vb, i, c, 0, h))
    square_spec = pl.BlockSpec((None, None, None, dk, bv),
                               lambda vb, h, c, i: (i, c, h, 0, vb))
    warps = 8 if max(dk, bv) > 64 else 4
    grid = (nvb, hv, nc, b)
    shapes = (key_shares, key_shares, gate_shares)
    dq, dk_, dg = pl.pallas_call(
        functools.partial(_grads_state_kernel, scale=float(scale)),
        out_shape=shapes,
        grid=grid,
        in_specs=[key, key, gate, gate, square_spec, value, value, square_spec],
        out_specs=[key_out, key_out, gate_out],
        compiler_params=_params(num_warps=warps),
        interpret=interpret,
        cost_estimate=cost.estimate(
            _grads_state_body, keys, keys, row, row, square, values, values, square,
            inputs=(q, k, hi, lo, states, u, do, d_exit), outputs=shapes),
        name="gated_delta_rule_chunk_grads_state",
    )(q, k, hi, lo, states, u, do, d_exit)
    shapes = (sharding.out_struct(v.shape, F32, like=v), gate_shares, key_shares, gate_shares)
    through_u = GRADS_SOLVE_THROUGH_U
    # The forward's u (a [C, block_v] block) or W (a [C, K] block): what the form reads.
    w_or_u, w_or_u_spec, w_or_u_z = (
        (u, value, values) if through_u else
        (w, pl.BlockSpec((None, None, chunk, None, dk), lambda vb, h, c, i: (i, c, 0, h, 0)),
         keys))
    dv_, dbeta, dk_, dg = pl.pallas_call(
        functools.partial(_grads_solve_kernel, keys_first=GRADS_SOLVE_KEYS_FIRST,
                          through_u=through_u),
        out_shape=shapes,
        grid=grid,
        in_specs=[key, value, gate, gate, gate,
                  pl.BlockSpec((None, None, None, chunk, chunk),
                               lambda vb, h, c, i: (i, c, h, 0, 0)),
                  w_or_u_spec, square_spec, value, key_out, gate_out],
        out_specs=[value, gate_out, key_out, gate_out],
        input_output_aliases={9: 2, 10: 3},
        compiler_params=_params(num_warps=warps),
        interpret=interpret,
        cost_estimate=cost.estimate(
            functools.partial(_grads_solve_body, through_u=through_u), keys, values, row,
            row, row, cost.struct((z, chunk, chunk), F32),
            w_or_u_z, square, values, keys, row,
            inputs=(k, v, hi, lo, beta, inv, w_or_u, states, du, dk_, dg), outputs=shapes),
        name="gated_delta_rule_chunk_grads_solve",
    )(k, v, hi, lo, beta, inv, w_or_u, states, du, dk_, dg)
    return dq.sum(0), dk_.sum(0), dv_, dbeta.sum(0), dg.sum(0)


# ---------------------------------------------------------------------------- backward


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def backward(residuals, do, dfinal, *, scale, length: int, l2norm: bool, block_v: int,
             grads_block_v: int, interpret: bool, sequence_axes=()):
    """(dq, dk [B, T, Hk, K], dv [B, T, Hv, V], dg, dbeta [B, T, Hv], d initial_state
    [N, Hv, K, V]), fp32, from the forward's residuals (pallas_triton._kernels) and the
    cotangents of o [B, T, Hv, V] and of the final states [N, Hv, K, V].
    sequence_axes: the residuals are one part's of a sequence split over these axes
    (pallas_triton._kernels'), dfinal the whole sequence's final state's cotangent: the
    part's own final-state cotangent comes from one exchange (context_parallel.py), and
    d initial_state is the whole sequence's."""
    r = residuals
    q, k, v = r["q"], r["k"], r["v"]
    b, nc, chunk, hk, _ = q.shape
    hv, dv = v.shape[3:]
    padded = nc * chunk
    cd = r["w"].dtype
    if l2norm:  # the kernels take normalised q and k; the norm's backward is XLA's
        (q, k), pull_norm = jax.vjp(lambda a, c: (_l2norm(a), _l2norm(c)),
                                    q.astype(F32), k.astype(F32))
        q, k = q.astype(cd), k.astype(cd)
    positions = r.get("positions")  # packed sequences only
    do = packing.in_layout(do.astype(cd), length, padded, positions)
    do = do.reshape(b, nc, chunk, hv, dv)
    reverse = functools.partial(_reverse_pass, q, k, r["w"], r["hi"], r["lo"], do,
                                r["entering"], r["leaving"], hv=hv, scale=scale,
                                block_v=block_v, interpret=interpret,
                                packed=positions is not None)
    dfinal = dfinal.astype(F32)
    if sequence_axes:
        # G: the cotangent this part's outputs give its entering state (no final-state
        # cotangent); M: the part's transition; then the chain backwards over the parts.
        from_outputs = reverse(jnp.zeros_like(dfinal))[2]
        transition = forward_kernels.part_transition(r["w"], k, r["hi"], r["lo"],
                                                     r["entering"], r["leaving"], block_v,
                                                     False, interpret)
        dfinal, whole_dinit = context_parallel.exiting_cotangents(
            transition, from_outputs, dfinal, sequence_axes)
    d_exit, du, dinit = reverse(dfinal)
    if sequence_axes:
        dinit = whole_dinit
    dq, dk, dv_, dbeta, dg = _chunk_grads(q, k, v, r["hi"], r["lo"], r["beta"], r["inv"],
                                          r["w"], r["states"], r["u"], du, do, d_exit, scale,
                                          grads_block_v, interpret)
    group = lambda t: t.reshape(*t.shape[:3], hk, hv // hk, t.shape[4]).sum(4)  # noqa: E731
    dq, dk = group(dq), group(dk)
    if l2norm:
        dq, dk = pull_norm((dq, dk))
    unsplit = lambda t: t.reshape(b, padded, *t.shape[3:])  # noqa: E731
    grads = [packing.steps_of(unsplit(t), length, positions) for t in (dq, dk, dv_, dg, dbeta)]
    return (*grads, dinit)
