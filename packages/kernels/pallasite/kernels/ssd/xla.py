"""SSD chunked scan in plain JAX: forward, and the backward written by hand.

This is the XLA path every geometry the kernels refuse takes, and the oracle the kernel
backwards are tested against (itself tested against jax.grad of pallasite.reference).

Layout (chunked, the backends' contract): x [b, nc, C, h, p], a [b, nc, C, h] (a = A*dt),
b and c [b, nc, C, g, n], initial_state [b, h, p, n] fp32. Heads are viewed as
(g, h // g) so head i meets group i // (h // g) through einsum broadcasting: B and C are
never copied per head.

Per chunk, with acs the in-chunk cumulative sum of a, L_ij = exp(acs_i - acs_j) for i >= j,
G = C B^T, M = G * L, e = exp(acs), w = exp(acs_last - acs), S the entry state [p, n]:

    y  = M x + e * (C S^T)
    S' = exp(acs_last) S + (w * x)^T B

The backward is the reverse recurrence over chunks: with dS' the cotangent of the state a
chunk leaves with,

    dS = exp(acs_last) dS' + (e * dy)^T C

and every chunk's gradients come from its own matrices, its entry state (saved by the
forward: the only residual besides the inputs) and its dS'. The [C, C] matrices are
recomputed in the backward, never saved.

Segment sums use the masked cumulative sum (segsum below), not acs_i - acs_j: inside one
chunk the two agree to ~eps * |acs_last| in the exponent, and the masked form keeps small
decays between close steps exact where the total decay of the chunk is large. `a = -inf`
is an exact state reset: clamped at ssd.decay.RESET, where every decay through it
underflows to exactly 0. A NaN or inf in x or B stays causal in the forward (the
reference's select-and-poison form, `_intra_chunk`). Every dot
runs at HIGHEST precision in fp32 (on TPU the default would be one bf16 pass).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallasite.kernels.ssd import decay as decay_
from pallasite.reference import ssd as ref

_HI = jax.lax.Precision.HIGHEST
_einsum = functools.partial(jnp.einsum, precision=_HI)


def segsum(a: jax.Array) -> jax.Array:
    """[..., C] -> [..., C, C]: sum_{j < k <= i} a_k below the diagonal, -inf above.

    A masked cumulative sum, so each entry sums only its own steps (no cancellation).
    """
    size = a.shape[-1]
    i = jnp.arange(size)[:, None]
    j = jnp.arange(size)[None, :]
    steps = jnp.where(j < i, jnp.broadcast_to(a[..., :, None], a.shape + (size,)), 0.0)
    # steps[..., k, j] = a_k for k > j; cumsum over k gives sum_{j < k <= i}.
    sums = jnp.cumsum(steps, axis=-2)
    return jnp.where(j <= i, sums, -jnp.inf)


def _grouped(x: jax.Array, groups: int) -> jax.Array:
    """Split the head axis (-2 for x-like, -1 for a-like handled by caller) into (g, h/g)."""
    *lead, h, p = x.shape
    return x.reshape(*lead, groups, h // groups, p)


def _compute_dtype(*arrays):
    """fp32, or fp64 when an operand is fp64 (x64 tests of the algebra)."""
    return jnp.result_type(jnp.float32, *(t.dtype for t in arrays))


def _chunk_terms(x, a, b, c):
    """fp32 views and the per-chunk decays shared by forward and backward.

    Returns xg [b,nc,C,g,r,p], ag [b,nc,g,r,C] (a per head along the chunk), acs,
    L [b,nc,g,r,C,C], e, w [b,nc,g,r,C], last [b,nc,g,r], bf, cf [b,nc,C,g,n].
    """
    groups = b.shape[-2]
    bsz, nc, size, h, _ = x.shape
    f = _compute_dtype(x, a, b, c)
    xg = _grouped(x.astype(f), groups)
    ag = decay_.clamp_resets(a).astype(f).reshape(bsz, nc, size, groups, h // groups)
    ag = jnp.moveaxis(ag, 2, -1)
    acs = jnp.cumsum(ag, axis=-1)
    decay = jnp.exp(segsum(ag))
    last = acs[..., -1]
    e = jnp.exp(acs)
    w = decay[..., -1, :]  # exp(last - acs_j), from the stable segment sums
    return xg, acs, decay, e, w, last, b.astype(f), c.astype(f)


def _intra_chunk(xg, decay, gram):
    """sum_{j<=i} G_ij L_ij x_j per chunk, causal for non-finite x and B: M = G * L is
    masked by a select (0 * NaN above the diagonal would reach earlier rows), x enters
    as its finite part, and rows from a non-finite x on are NaN (pallasite.reference.ssd)."""
    size = decay.shape[-1]
    causal = jnp.tril(jnp.ones((size, size), bool))
    mix = jnp.where(causal, decay * gram[:, :, :, None], 0)
    y = _einsum("bkgrij,bkjgrp->bkigrp", mix, ref.finite_part(xg))
    return ref.poison(y, ref.nonfinite_since(xg, axis=2))


def _entry_states(local, last, initial_state):
    """Scan over chunks: the state each chunk enters with, and the final state.

    local [b,nc,g,r,p,n] is each chunk's own contribution (w * x)^T B, last its total decay.
    """

    def step(state, inputs):
        loc, lst = inputs
        return jnp.exp(lst)[..., None, None] * state + loc, state

    final, entries = jax.lax.scan(
        step, initial_state, (jnp.moveaxis(local, 1, 0), jnp.moveaxis(last, 1, 0))
    )
    return jnp.moveaxis(entries, 0, 1), final


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
    """(y [b,nc,C,h,p] x.dtype, final_state [b,h,p,n] fp32, chunk_states [b,nc,h,p,n] fp32).

    `interpret` and `block_sizes` are accepted for the backend contract and ignored.
    """
    del interpret, block_sizes
    bsz, nc, size, h, p = x.shape
    groups, n = b.shape[-2], b.shape[-1]
    xg, _, decay, e, w, last, bf, cf = _chunk_terms(x, a, b, c)
    s0 = initial_state.astype(xg.dtype).reshape(bsz, groups, h // groups, p, n)
    local = _einsum("bkgrl,bklgrp,bklgn->bkgrpn", w, xg, bf)
    entries, final = _entry_states(local, last, s0)
    y = _intra_chunk(xg, decay, _einsum("bkign,bkjgn->bkgij", cf, bf))
    y = y + _einsum("bkgri,bkign,bkgrpn->bkigrp", e, cf, entries)
    return (
        y.reshape(x.shape).astype(x.dtype),
        final.reshape(bsz, h, p, n),
        entries.reshape(bsz, nc, h, p, n),
    )


def _exit_cotangents(dy_g, e, cf, last, dfinal):
    """Reverse scan: dS' for every chunk (the cotangent of the state it leaves with).

    dS_n = exp(last_n) dS'_n + (e * dy_n)^T C_n, and dS'_{n-1} = dS_n. Returns
    (dS' [b,nc,g,r,p,n], d initial_state [b,g,r,p,n]).
    """
    local = _einsum("bkgri,bkigrp,bkign->bkgrpn", e, dy_g, cf)

    def step(carry, inputs):
        loc, lst = inputs
        return jnp.exp(lst)[..., None, None] * carry + loc, carry

    dinit, exits = jax.lax.scan(
        step, dfinal, (jnp.moveaxis(local, 1, 0), jnp.moveaxis(last, 1, 0)), reverse=True
    )
    return jnp.moveaxis(exits, 0, 1), dinit


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
    del interpret, block_sizes
    bsz, nc, size, h, p = x.shape
    groups, n = b.shape[-2], b.shape[-1]
    r = h // groups
    xg, _, decay, e, w, last, bf, cf = _chunk_terms(x, a, b, c)
    dyg = _grouped(dy.astype(xg.dtype), groups)
    entries = chunk_states.astype(xg.dtype).reshape(bsz, nc, groups, r, p, n)
    dfin = dfinal_state.astype(xg.dtype).reshape(bsz, groups, r, p, n)
    exits, dinit = _exit_cotangents(dyg, e, cf, last, dfin)

    gram = _einsum("bkign,bkjgn->bkgij", cf, bf)
    dm = _einsum("bkigrp,bkjgrp->bkgrij", dyg, xg)  # dy x^T
    dgl = dm * decay  # cotangent of G through M = G * L, per head
    u = _einsum("bkjgn,bkgrpn->bkjgrp", bf, exits)  # B dS'^T
    v = _einsum("bkign,bkgrpn->bkigrp", cf, entries)  # C S^T

    dx = _einsum("bkgrij,bkgij,bkigrp->bkjgrp", decay, gram, dyg)
    dx = dx + jnp.moveaxis(w, -1, 2)[..., None] * u
    dc = _einsum("bkgrij,bkjgn->bkign", dgl, bf)
    dc = dc + _einsum("bkgri,bkigrp,bkgrpn->bkign", e, dyg, entries)
    db = _einsum("bkgrij,bkign->bkjgn", dgl, cf)
    db = db + _einsum("bkgrj,bkjgrp,bkgrpn->bkjgn", w, xg, exits)

    # d acs: L_ij = exp(acs_i - acs_j) gives +P_ij to i and -P_ij to j; e_i = exp(acs_i);
    # w_j = exp(last - acs_j) and exp(last) S give their terms to j and to the last step.
    pmat = dgl * gram[:, :, :, None]
    dacs = pmat.sum(-1) - pmat.sum(-2)
    dacs = dacs + e * _einsum("bkigrp,bkigrp->bkgri", dyg, v)
    wdw = w * _einsum("bkjgrp,bkjgrp->bkgrj", xg, u)
    to_last = wdw.sum(-1) + jnp.exp(last) * _einsum("bkgrpn,bkgrpn->bkgr", exits, entries)
    dacs = (dacs - wdw).at[..., -1].add(to_last)
    da = jnp.flip(jnp.cumsum(jnp.flip(dacs, -1), -1), -1)  # acs_i = sum_{k <= i} a_k
    da = jnp.moveaxis(da, -1, 2).reshape(a.shape)
    da = jnp.where(decay_.reset_mask(a), da, 0.0)  # no gradient through a reset
    return (
        dx.reshape(x.shape).astype(x.dtype),
        da.astype(a.dtype),
        db.astype(b.dtype),
        dc.astype(c.dtype),
        dinit.reshape(bsz, h, p, n),
    )
