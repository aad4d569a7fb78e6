"""Cost estimates of the SSD kernels, through pallasite.kernels.cost: one body-equivalent
function per pallas_call, its arithmetic vectorised over the grid.

Z below is the number of (batch, chunk, head) triples, C the chunk, p head_dim, n state.
The Triton kernels walk the causal [C, C] tile of a chunk in bm x bm blocks on and below
the diagonal: T = nb (nb + 1) / 2 blocks for nb = C / bm, so their body-equivalents take a
[Z, T, bm, ...] stack of the blocks one program visits. Their cumulative sums are the
double-float (hi, lo) pairs of ssd.decay: a segment sum is (hi_i - hi_j) + (lo_i - lo_j),
3 flops, and exp(acs) is exp(hi + lo), one flop more than a single sum. The Mosaic TPU kernels hold the
whole [C, C] tile of one (batch, head, chunk) program. The selects that keep non-finite x
and B causal in the forward kernels (a compare and select per element of the diagonal
tile and of x, pallasite.reference.ssd) are not counted: under 1% of the products'
flops at the docs/targets.md widths.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallasite.kernels import cost

F32 = jnp.float32


def _ein(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=F32)


def tiles(chunk: int, bm: int) -> int:
    """Causal bm x bm blocks of a [chunk, chunk] tile (on and below the diagonal)."""
    nb = chunk // bm
    return nb * (nb + 1) // 2


# ------------------------------------------------------------------------------ Triton


def _contribution(u, v, w):
    """A chunk's own state contribution u^T (v * w): 2 C p n + C n flops."""
    return _ein("zcp,zcn->zpn", u, (v * w[..., None]).astype(u.dtype))


def state_scan(z, chunk, p, n, dtype, *, inputs, outputs):
    """Per (batch, chunk, head): the chunk's contribution u^T (v * w) (2 C p n + C n flops)
    and S' = decay S + contribution (2 p n flops)."""
    def body(u, v, w, decay, s):
        return decay[:, None, None] * s + _contribution(u, v, w)

    return cost.estimate(body, cost.struct((z, chunk, p), dtype),
                         cost.struct((z, chunk, n), F32), cost.struct((z, chunk), F32),
                         cost.struct((z,), F32), cost.struct((z, p, n), F32),
                         inputs=inputs, outputs=outputs)


def state_scan_reverse(z, chunk, p, n, dtype, *, inputs, outputs):
    """state_scan's flops plus <G, S> per element (1 flop; the sum is not counted); the
    entry states S are in the operand dtype, G in fp32."""
    def body(u, v, w, decay, g, s):
        return decay[:, None, None] * g + _contribution(u, v, w), g * s.astype(F32)

    return cost.estimate(body, cost.struct((z, chunk, p), dtype),
                         cost.struct((z, chunk, n), F32), cost.struct((z, chunk), F32),
                         cost.struct((z,), F32), cost.struct((z, p, n), F32),
                         cost.struct((z, p, n), dtype), inputs=inputs, outputs=outputs)


def _segment(later, earlier):
    """The kernels' stable segment sum of two (hi, lo) pairs: 3 flops per element."""
    return (later[0] - earlier[0]) + (later[1] - earlier[1])


def _pair(shape):
    return cost.struct(shape, F32), cost.struct(shape, F32)


def chunk_output(z, chunk, bm, p, n, dtype, *, heads=1, inputs, outputs):
    """y = sum over causal blocks of ((C_i B_j^T) * exp(acs_i - acs_j)) x_j, plus
    exp(acs_i) C_i S^T, with each C_i B_j^T block formed once for `heads` heads:
    Z T bm^2 (2n / heads + 2p + 4) + Z C (2 n p + p + 1) flops, Z T bm^2 + Z C exps."""
    t = tiles(chunk, bm)

    def body(c_i, b_j, x_j, acs_i, acs_j, c, s, acs):
        decay = jnp.exp(_segment([v[..., :, None] for v in acs_i],
                                 [v[..., None, :] for v in acs_j]))
        cb = _ein("ztin,ztjn->ztij", c_i, b_j)
        m = (cb[:, None] * decay.reshape(z // heads, heads, *decay.shape[1:])).reshape(decay.shape)
        blocks = _ein("ztij,ztjp->ztip", m.astype(dtype), x_j)
        carried = _ein("zin,zpn->zip", c, s.astype(dtype)) * jnp.exp(acs[0] + acs[1])[..., None]
        return blocks, carried

    blk = lambda w, dt=dtype: cost.struct((z, t, bm, w), dt)  # noqa: E731
    shared = cost.struct((z // heads, t, bm, n), dtype)
    return cost.estimate(body, shared, shared, blk(p), _pair((z, t, bm)), _pair((z, t, bm)),
                         cost.struct((z, chunk, n), dtype), cost.struct((z, p, n), dtype),
                         _pair((z, chunk)), inputs=inputs, outputs=outputs)


def bwd_rows_j(z, chunk, bm, p, n, dtype, *, inputs, outputs):
    """dx_j, dB_j and the column part of d acs: per causal block Z T bm^2 (4n + 4p + 6)
    flops and bm^2 exps; per row Z C (4 n p + 2p + n + 3) flops and one exp."""
    t = tiles(chunk, bm)

    def body(b_j, c_i, x_j, dy_i, acs_j, acs_i, b, x, g, acs, last):
        lt = jnp.exp(_segment([v[..., None, :] for v in acs_i],
                              [v[..., :, None] for v in acs_j]))
        mt = _ein("ztjn,ztin->ztji", b_j, c_i)
        dlt = _ein("ztjp,ztip->ztji", x_j, dy_i) * lt
        dx = _ein("ztji,ztip->ztjp", (mt * lt).astype(dtype), dy_i)
        db = _ein("ztji,ztin->ztjn", dlt.astype(dtype), c_i)
        col = dlt * mt
        out = jnp.exp(_segment([v[:, None] for v in last], acs))[..., None]
        dx0 = _ein("zjn,zpn->zjp", b, g.astype(dtype)) * out
        q = x * dx0
        db0 = _ein("zjp,zpn->zjn", x, g.astype(dtype)) * out
        return dx, db, col, dx0, q, db0

    blk = lambda w: cost.struct((z, t, bm, w), dtype)  # noqa: E731
    row = lambda w, dt=dtype: cost.struct((z, chunk, w), dt)  # noqa: E731
    return cost.estimate(body, blk(n), blk(n), blk(p), blk(p), _pair((z, t, bm)),
                         _pair((z, t, bm)), row(n), row(p, F32),
                         cost.struct((z, p, n), F32), _pair((z, chunk)), _pair((z,)),
                         inputs=inputs, outputs=outputs)


def bwd_rows_i(z, chunk, bm, p, n, dtype, *, inputs, outputs):
    """dC_i and the row part of d acs: per causal block Z T bm^2 (4n + 2p + 5) flops and
    bm^2 exps; per row Z C (4 n p + n + 2p + 1) flops and one exp."""
    t = tiles(chunk, bm)

    def body(c_i, b_j, dy_i, x_j, acs_i, acs_j, c, dy, s, acs):
        lt = jnp.exp(_segment([v[..., :, None] for v in acs_i],
                              [v[..., None, :] for v in acs_j]))
        m = _ein("ztin,ztjn->ztij", c_i, b_j)
        dl = _ein("ztip,ztjp->ztij", dy_i, x_j) * lt
        dc = _ein("ztij,ztjn->ztin", dl.astype(dtype), b_j)
        row = dl * m
        grow = jnp.exp(acs[0] + acs[1])[..., None]
        dc0 = _ein("zip,zpn->zin", dy, s.astype(dtype)) * grow
        sc = _ein("zin,zpn->zip", c, s.astype(dtype)) * grow
        return dc, row, dc0, dy.astype(F32) * sc

    blk = lambda w: cost.struct((z, t, bm, w), dtype)  # noqa: E731
    return cost.estimate(body, blk(n), blk(n), blk(p), blk(p), _pair((z, t, bm)),
                         _pair((z, t, bm)), cost.struct((z, chunk, n), dtype),
                         cost.struct((z, chunk, p), dtype), cost.struct((z, p, n), dtype),
                         _pair((z, chunk)), inputs=inputs, outputs=outputs)


# -------------------------------------------------------------------------- Mosaic TPU


def _decays(hi, lo, hi_last, lo_last):
    """The TPU kernel's decays: L (3 C^2 flops, C^2 exps), e, w, exp(acs_last)."""
    decay = jnp.exp((hi[..., :, None] - hi[..., None, :]) + (lo[..., :, None] - lo[..., None, :]))
    e = jnp.exp(hi + lo)
    w = jnp.exp((hi_last[..., None] - hi) + (lo_last[..., None] - lo))
    return decay, e[..., None], w[..., None], jnp.exp(hi_last + lo_last)[..., None, None]


def _tpu_operands(programs, chunk, p, n):
    f = lambda *shape: cost.struct((programs, *shape), F32)  # noqa: E731
    return f(chunk, p), f(chunk, n), f(chunk, n), f(chunk), f(chunk), f(), f(), f(p, n)


def tpu_forward(programs, chunk, p, n, *, inputs, outputs):
    """One (batch, head, chunk) program in fp32 at HIGHEST: per program
    C^2 (2n + 2p + 4) + C (4 n p + 3p + 4) + 2 p n + 1 flops, C^2 + 2C + 1 exps."""
    def body(x, b, c, hi, lo, hi_last, lo_last, state):
        decay, e, w, total = _decays(hi, lo, hi_last, lo_last)
        mix = _ein("zin,zjn->zij", c, b) * decay
        y = _ein("zij,zjp->zip", mix, x) + e * _ein("zin,zpn->zip", c, state)
        new = total * state + _ein("zcp,zcn->zpn", x * w, b)
        return y, new

    return cost.estimate(body, *_tpu_operands(programs, chunk, p, n), inputs=inputs,
                         outputs=outputs)


def tpu_backward(programs, chunk, p, n, *, inputs, outputs):
    """The reverse of tpu_forward per program (the ones-matmul row sums of d acs
    included); see tests/test_ssd_mosaic_tpu.py for the count."""
    def body(x, b, c, hi, lo, hi_last, lo_last, state, dy, dexit):
        decay, e, w, total = _decays(hi, lo, hi_last, lo_last)
        # as the kernel: an 8-row ones matmul as wide as the summed tile (C, or p)
        rowsum = lambda t: _ein("ak,zik->zai", jnp.ones((8, t.shape[-1]), F32), t)  # noqa: E731
        gram = _ein("zin,zjn->zij", c, b)
        dmix = _ein("zip,zjp->zij", dy, x) * decay
        u = _ein("zjn,zpn->zjp", b, dexit)
        dx = _ein("zij,zip->zjp", gram * decay, dy) + w * u
        dc = _ein("zij,zjn->zin", dmix, b) + e * _ein("zip,zpn->zin", dy, state)
        db = _ein("zij,zin->zjn", dmix, c) + w * _ein("zjp,zpn->zjn", x, dexit)
        pm = dmix * gram
        dacs = rowsum(pm) - rowsum(x * u) + rowsum(dy * _ein("zin,zpn->zip", c, state))
        new = total * dexit + _ein("zip,zin->zpn", dy * e, c)
        return dx, dc, db, dacs, new

    x, b, c, hi, lo, hl, ll, state = _tpu_operands(programs, chunk, p, n)
    return cost.estimate(body, x, b, c, hi, lo, hl, ll, state, x, state, inputs=inputs,
                         outputs=outputs)
