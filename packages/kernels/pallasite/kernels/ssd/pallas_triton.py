"""Mamba-2 SSD chunked scan on the GPU: Pallas Triton kernels, forward and backward.

Layout (the SSD backend contract): x [b, nc, C, h, p], a [b, nc, C, h] (a = A*dt <= 0),
b and c [b, nc, C, g, n] (head i reads group i // (h // g)), states [b, h, p, n] fp32.
Per chunk, with acs the inclusive cumulative sum of a inside the chunk:

    y_i  = sum_{j<=i} (C_i.B_j) exp(acs_i - acs_j) x_j + exp(acs_i) S C_i
    S'   = exp(acs_last) S + sum_j exp(acs_last - acs_j) x_j B_j^T

Why this shape (issues 8 and 18): one program per (batch, head) looping over chunks starves
an H200 (132 SMs) and overflows shared memory at C = 256. The output and backward kernels
are parallel over (batch, chunk, head or group, row block); the inter-chunk state pass is a
sequential loop per (batch, head, state column block) that forms each chunk's own
contribution where it adds it. The stages:

  forward   1. acs = cumsum(a) per chunk (XLA; [b, nc, C, h] fp32 pairs, a few MB)
            2. _state_scan: per chunk c in order, states[c] = S_c, then
               S_{c+1} = exp(acs_last_c) S_c + x_c^T (B_c * exp(acs_last - acs))
            3. _chunk_output: y rows in blocks of block_m for `heads` heads of one group;
               each C_i B_j^T block is formed once for those heads, and the
               [block_m, block_m] tiles of (C B^T * L) live in registers only.
  backward  1. _state_scan_reverse: per chunk in reverse, G_c = dS_{c+1} (gradient of the
               state a chunk leaves with), <G_c, S_c> for d(acs_last), then
               G_{c-1} = exp(acs_last_c) G_c + dy_c^T (C_c * exp(acs)); dinitial
            2. _bwd_rows_j: dx, dB and the column part of d(acs) (one program per
               (batch, chunk, group, row block), looping over the group's heads so dB sums
               over heads in registers, not through a per-head HBM buffer)
            3. _bwd_rows_i: dC and the row part of d(acs), the same way
            4. da = reverse cumsum of d(acs) inside the chunk (XLA, tiny)

Grid order matters here: Pallas Triton folds all but the last two grid axes into CUDA's x
axis (first axis fastest), and blocks launch in x, y, z order. The output kernel's grid is
(row block, head block, batch, chunk), so one (batch, chunk, head)'s row blocks and a
group's heads run side by side and read their state, x and B/C through L2 rather than
HBM; the state scans put the state column blocks first for the same reason.

Matmul operands are the inputs' dtype (bf16 on the tensor cores) with fp32 accumulation;
fp32 operands multiply at full fp32 precision, not TF32; decays, cumulative sums and
states are fp32. Segment sums come from the double-float cumulative sums of ssd.decay:
(hi_i - hi_j) + (lo_i - lo_j), one more subtraction per tile entry than the plain
difference and no [C, C] masked cumsum. The plain difference of fp32 cumulative sums put y
4.6e-5 (rel L2) from a float64 recurrence under strong decay (a ~ -U(0.5, 2), one step at
-1e4); the pair form is within 5e-7 there, as the XLA path is (docs/ssd.md). `a = -inf`
is an exact state reset (clamped by ssd.decay, so no exponent is ever NaN).

Measured (H200, 2026-12-01, docs/performance.md "issue 18", bf16, C = 256, p = 64,
n = 128, the bench harness with mamba_ssm's Triton kernels in the same process): forward
0.520 / 0.991 / 1.325 ms against mamba_ssm's 1.507 / 1.254 / 1.626 on the three TARGETS
rows, forward+backward 2.108 / 3.824 / 5.614 against 5.730 / 6.027 / 6.298; at p = 128,
8 groups, C = 128 (b4 l8192 h32): 0.965 / 3.844 against 1.066 / 5.749 (commit 2fe3d5d,
entry states in the operand dtype; with fp32 entry states, b8838a6: 0.562 / 1.104 /
1.483 and 2.249 / 4.000 / 5.983). Before this structure (a parallel per-chunk state kernel writing [p, n] fp32
per chunk to HBM, a separate state pass, one head per output program, batch-first grids)
the same inputs took 0.77 / 1.55 / 1.95 and 2.55 / 5.06 / 6.63 ms. Tried and reverted:
C B^T once per (batch, chunk, group) through HBM, shared by all of the group's heads
(forward 2.19 against 1.72 ms on row 3 with two heads per program; 2026-11-30 it was also
1.4x slower in the backward, which reads that tile transposed); four heads per output
program (2.94 against 1.46 ms on row 3); the masked and unmasked causal
blocks split apart in the backward's loops as the forward does (7.80 against 6.04 ms on
row 3: the split loop loses Triton's pipelining).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallasite import tuning
from pallasite.kernels import platform
from pallasite.kernels import sharding
from pallasite.kernels.ssd import costs, decay, predicates, tuning_benchmarks
from pallasite.reference import ssd as ref

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the SSD Triton kernels.

    block_m: rows (and columns) of the [C, C] tile one step handles in the output and
      backward kernels; the causal loop skips the tiles above the diagonal.
    block_t: time steps per matmul step in the state scans' per-chunk contribution.
    block_n: state columns per state-scan program (more programs walk the chunks at once).
    heads: heads per output program, all of one group, sharing each C_i B_j^T block (cut
      to a power of two dividing the heads per group).

    Defaults measured on the H200 (2026-12-01, docs/performance.md "issue 18"), forward /
    forward+backward ms on the TARGETS rows 3, 1, 2: the default 1.458 / 0.570 / 1.105
    forward; one head per program 1.724 / 0.668 / 1.295; block_n 128 1.508 / 0.576 /
    1.122; heads 4 2.94 / 1.31 / 2.52; block_m 128 with 8 warps 2.30 / 1.02 / 2.02. On
    2026-11-30 (then row 1, other kernels): block_m 64 with 8 warps and block_m 32 were
    slower than 64 with 4 warps in both directions.
    """

    block_m: int = 64
    block_t: int = 128
    num_warps: int = 4
    num_stages: int = 2
    block_n: int = 64
    heads: int = 2


DEFAULT_BLOCK_SIZES = BlockSizes()
# Where the default's programs do not fit the device's shared memory (p=64, n=128 needs
# 128 KiB at block_m 64 with two heads per output program, 104 KiB with one; sm86/sm89
# have 99 KiB): 32-row blocks, one head, 56 KiB there. On 2026-11-30 (the kernels of
# then) the H200 measured block_m 32 at 1.24 / 4.48 ms against 64's 0.96 / 2.70 (fwd /
# fwd+bwd, row 1); not measured on sm86/89.
SMALL_SMEM_BLOCK_SIZES = BlockSizes(block_m=predicates.TRITON_MIN_BLOCK_M, heads=1)


# The JAX backends (jax.default_backend()) this kernel runs on; "cpu" through the interpreter.
RUNS_ON = ("gpu", "cuda", "cpu")


def refusal(device: str, dtypes=None) -> str | None:
    """Why this kernel cannot run on JAX backend `device` (None: it can); every dtype
    api.py admits loads (`dtypes` is the Mosaic TPU kernel's concern). api.py asks after
    the geometry rule (predicates.ssd_kernel_reason), which is not the device's."""
    del dtypes
    if device not in RUNS_ON:
        return f"pallas_triton does not run on {device} (runs on {RUNS_ON}, cpu interpreted)"
    return None


def fits(bs: BlockSizes, head_dim: int, state: int, device=None, chunk: int | None = None,
         itemsize: int = 2) -> bool:
    """Whether pallasite may choose `bs` (default, table, cache, candidates): the fit rule
    predicates.triton_block_sizes_reason on `device`'s shared memory (platform's budget);
    chunk: the chunk its blocks are clamped to (None: as given); itemsize: of the matmul
    operands."""
    return predicates.triton_block_sizes_reason(bs, chunk, head_dim, state, device,
                                                itemsize=itemsize) is None


def default_block_sizes(head_dim: int, state: int, device=None, itemsize: int = 2
                        ) -> BlockSizes:
    """The measured default where it fits `device`'s shared memory, else the same with one
    head per output program (fp32 operands on an H200), else 32-row blocks."""
    for bs in (DEFAULT_BLOCK_SIZES, dataclasses.replace(DEFAULT_BLOCK_SIZES, heads=1)):
        if fits(bs, head_dim, state, device, itemsize=itemsize):
            return bs
    return SMALL_SMEM_BLOCK_SIZES


def _itemsize(x, b) -> int:
    """The widest matmul operand's bytes (the kernels' dots take x and B/C as given)."""
    return max(jnp.dtype(x.dtype).itemsize, jnp.dtype(b.dtype).itemsize)


def resolve_block_sizes(block_sizes: BlockSizes | None, chunk: int, *, x=None, b=None,
                        pass_name: str = "forward", interpret: bool = True) -> BlockSizes:
    """The one place block sizes are chosen: the caller's, else pallasite.tuning's tuned
    table / autotune cache entry for this device and shape bucket (x [b, nc, C, h, p] and
    b [b, nc, C, g, n] give the shape), else a bounded autotune of this shape (only when
    the kernels will run compiled, not `interpret`, on a GPU Triton runs on;
    PALLASITE_AUTOTUNE=0 turns it off), else the default; then clamped to the chunk.
    Every config is checked against predicates.triton_block_sizes_reason first: the
    caller's with a ValueError naming it, a table or cache entry passed over.
    `interpret` defaults to True, "do not tune"; forward and backward pass theirs."""
    if block_sizes is not None and x is not None:
        why = predicates.triton_block_sizes_reason(block_sizes, chunk, x.shape[4], b.shape[4],
                                                   caller=True, itemsize=_itemsize(x, b))
        if why is not None:
            raise ValueError(f"block_sizes {block_sizes!r} does not fit chunk={chunk}, "
                             f"head_dim={x.shape[4]}, state={b.shape[4]}: {why}")
    if block_sizes is None and x is not None:
        bsz, nc, c, h, p = x.shape
        width = _itemsize(x, b)
        shape = {"length": nc * c, "heads": h, "head_dim": p, "state": b.shape[4], "chunk": c,
                 "batch": bsz, "groups": b.shape[3]}
        measure = None
        if not interpret and platform.triton_runs():
            make = (tuning_benchmarks.forward_benchmark if pass_name == "forward"
                    else tuning_benchmarks.backward_benchmark)
            dtype = x.dtype  # not x: a tracer of the caller's trace
            measure = lambda: make(sys.modules[__name__], shape, dtype)  # noqa: E731
        block_sizes = tuning.select_block_sizes(
            "ssd", f"pallas_triton:{pass_name}", device_kind=tuning.device_kind(),
            dtypes=(x.dtype,), shape=shape, config_type=BlockSizes,
            default=default_block_sizes(p, shape["state"], itemsize=width), measure=measure,
            fits=lambda bs, dims: fits(bs, dims["head_dim"], dims["state"],
                                       chunk=dims["chunk"], itemsize=width),
        ).config
    bs = block_sizes or DEFAULT_BLOCK_SIZES
    return dataclasses.replace(
        bs, block_m=min(bs.block_m, chunk), block_t=min(bs.block_t, chunk)
    )


# ----------------------------------------------------------------------------- checks


def _pow2(v: int) -> bool:
    return v >= 1 and (v & (v - 1)) == 0


def _check_inputs(x, a, b, c, state, state_name: str) -> None:
    """ValueError naming the argument and its shape, before any kernel is built."""
    if x.ndim != 5:
        raise ValueError(f"x must be [b, nc, C, h, p], got shape {x.shape}")
    bsz, nc, chunk, h, p = x.shape
    if a.shape != (bsz, nc, chunk, h):
        raise ValueError(f"a must be {(bsz, nc, chunk, h)} to match x, got shape {a.shape}")
    for name, arr in (("b", b), ("c", c)):
        if arr.ndim != 5 or arr.shape[:3] != (bsz, nc, chunk):
            raise ValueError(f"{name} must be [b, nc, C, g, n] matching x, got shape {arr.shape}")
    if b.shape != c.shape:
        raise ValueError(f"b and c must have one shape, got b {b.shape} and c {c.shape}")
    g, n = b.shape[3], b.shape[4]
    if h % g:
        raise ValueError(f"heads {h} of x {x.shape} must be a multiple of groups {g} of b")
    if state.shape != (bsz, h, p, n):
        raise ValueError(f"{state_name} must be {(bsz, h, p, n)}, got shape {state.shape}")
    for name, v in (("chunk", chunk), ("head_dim", p), ("state_size", n)):
        if not _pow2(v) or v < 16:
            raise ValueError(
                f"{name} = {v} (x {x.shape}, b {b.shape}) must be a power of 2 >= 16 "
                "for the Triton kernels"
            )


def _dot(a, b, trans_a=False, trans_b=False):
    """plgpu.dot, at full fp32 precision for fp32 operands (Triton would take TF32, a
    1e-3 relative error, for fp32 by default); 16-bit operands are exact products."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == F32 else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _params(bs: BlockSizes, num_stages: int | None = None):
    return plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=num_stages or bs.num_stages)


# Pipeline depth of the backward's two row kernels (None: the block sizes' num_stages, as
# every other kernel). Their column loops run at most C / block_m steps, and a deeper
# pipeline keeps more tiles live: compiled for sm_90 (triton 3.6, 2026-12-07, the first
# target row's heads, block_m 64, 4 warps) rows_j has 315 spill stores at 2 stages and 46
# at 1, rows_i 65 and 8. Not timed yet (tools/sweeps/ssd_pallas_triton_bench.py
# --rows-stages).
BWD_ROWS_NUM_STAGES: int | None = None


# ----------------------------------------------------------------------------- kernels


# The state scans' per-chunk weights w applied to the left operand's rows (x, or dy in
# reverse: the product's A, taken transposed, reaches the tensor cores from registers)
# rather than the right one's (B or C: written back to shared memory as wgmma's B operand,
# each write followed by a proxy fence that waits for the loop's in-flight copies, as in
# the gated delta rule's state pass). Compiled for sm_90 that form has no fence left, but
# it is slower: on an H100 (2026-12-06, the first SSD target row: B 8, L 4096, 32 heads,
# P 64, N 128, chunk 256) the scan took 0.167 ms against 0.122, the reverse scan 0.217
# against 0.184, the forward 0.660 against 0.610 and the forward+backward 2.42 against
# 2.32. Off.
SCAN_WEIGHTS_ON_LEFT = False


def _local_state(u_ref, v_ref, w_ref, ci, block_t):
    """sum_t u[ci, t, :]^T (v[ci, t, :] * w[ci, t]) over chunk ci: [p, bn] fp32. The chunk is
    walked in block_t steps unrolled at trace time, so a scan program has one loop, over
    the chunks, whose loads do not depend on the state it carries."""
    chunk = u_ref.shape[1]
    acc = None
    for t0 in range(0, chunk, block_t):
        t = pl.ds(t0, block_t)
        u, v = u_ref[ci, t, :], v_ref[ci, t, :]
        if SCAN_WEIGHTS_ON_LEFT:
            u = (u.astype(F32) * w_ref[ci, t][:, None]).astype(u.dtype)
        else:
            v = (v.astype(F32) * w_ref[ci, t][:, None]).astype(u.dtype)
        part = _dot(u, v, trans_a=True)
        acc = part if acc is None else acc + part
    return acc


def _state_scan_kernel(x_ref, b_ref, w_ref, decay_ref, init_ref, states_ref, final_ref, *,
                       block_t):
    """One (state column block, head, batch) walks the chunks in order:
    states[c] = S_c, S_{c+1} = decay_c S_c + x_c^T (B_c * w_c)."""
    nc = x_ref.shape[0]

    def step(ci, s):
        states_ref[ci] = s.astype(states_ref.dtype)
        return decay_ref[ci] * s + _local_state(x_ref, b_ref, w_ref, ci, block_t)

    final_ref[...] = jax.lax.fori_loop(0, nc, step, init_ref[...])


def _scan_specs(u, v, bn):
    """BlockSpecs of a (state column block, head, batch) grid over whole sequences (the
    column blocks of one head first, so they read its x through L2): u
    [b, nc, C, h, p] per head, v [b, nc, C, g, n] per group, w [b, nc, C, h], per-chunk
    scalars [b, nc, h], states [b, nc, h, p, n] and one state [b, h, p, n]."""
    bsz, nc, chunk, h, p = u.shape
    hpg = h // v.shape[3]
    return dict(
        u=pl.BlockSpec((None, nc, chunk, None, p), lambda q, k, i: (i, 0, 0, k, 0)),
        v=pl.BlockSpec((None, nc, chunk, None, bn), lambda q, k, i: (i, 0, 0, k // hpg, q)),
        w=pl.BlockSpec((None, nc, chunk, None), lambda q, k, i: (i, 0, 0, k)),
        per_chunk=pl.BlockSpec((None, nc, None), lambda q, k, i: (i, 0, k)),
        states=pl.BlockSpec((None, nc, None, p, bn), lambda q, k, i: (i, 0, k, 0, q)),
        one=pl.BlockSpec((None, None, p, bn), lambda q, k, i: (i, k, 0, q)),
        partial=pl.BlockSpec((None, nc, None, None), lambda q, k, i: (i, 0, k, q)),
    )


def _state_scan(x, b, w, decay, init, bs: BlockSizes, interpret: bool):
    """(states [b, nc, h, p, n] entering each chunk in x.dtype, final [b, h, p, n] fp32),
    carried in fp32, with each chunk's own contribution x_c^T (B_c * w_c) formed where it
    is added (never in HBM). w = exp(acs_last - acs) [b, nc, C, h], decay = exp(acs_last)
    [b, nc, h]. The entry states leave rounded to the matmul operand dtype: every kernel
    that reads them multiplies them in that dtype, so y is the same to the bit and the
    traffic (and the residual) is half of fp32's at bf16."""
    bsz, nc, chunk, h, p = x.shape
    n = b.shape[4]
    bn = min(bs.block_n, n)
    specs = _scan_specs(x, b, bn)
    shapes = (
        sharding.out_struct((bsz, nc, h, p, n), x.dtype, like=x),
        sharding.out_struct((bsz, h, p, n), F32, like=x),
    )
    return pl.pallas_call(
        functools.partial(_state_scan_kernel, block_t=bs.block_t),
        out_shape=shapes,
        grid=(n // bn, h, bsz),
        in_specs=[specs["u"], specs["v"], specs["w"], specs["per_chunk"], specs["one"]],
        out_specs=[specs["states"], specs["one"]],
        compiler_params=_params(bs),
        interpret=interpret,
        cost_estimate=costs.state_scan(bsz * nc * h, chunk, p, n, x.dtype,
                                       inputs=(x, b, w, decay, init), outputs=shapes),
        name="ssd_state_scan",
    )(x, b, w, decay, init.astype(F32))


def _state_scan_reverse_kernel(dy_ref, c_ref, w_ref, decay_ref, states_ref, dfinal_ref,
                               grads_ref, gs_ref, dinit_ref, *, block_t):
    """The chunks in reverse: G_{nc-1} = dfinal; grads[c] = G_c; gs[c] = <G_c, S_c> over this
    column block; G_{c-1} = decay_c G_c + dy_c^T (C_c * w_c)."""
    nc = dy_ref.shape[0]

    def step(k, gr):
        ci = nc - 1 - k
        grads_ref[ci] = gr
        gs_ref[ci] = jnp.sum(jnp.sum(gr * states_ref[ci].astype(F32), axis=1), axis=0)
        return decay_ref[ci] * gr + _local_state(dy_ref, c_ref, w_ref, ci, block_t)

    dinit_ref[...] = jax.lax.fori_loop(0, nc, step, dfinal_ref[...])


def _state_scan_reverse(dy, c, w, decay, states, dfinal, bs: BlockSizes, interpret: bool):
    """(grads [b,nc,h,p,n] = dS leaving each chunk, gs [b,nc,h], dinitial [b,h,p,n]);
    w = exp(acs) [b, nc, C, h], decay = exp(acs_last)."""
    bsz, nc, chunk, h, p = dy.shape
    n = c.shape[4]
    bn = min(bs.block_n, n)
    specs = _scan_specs(dy, c, bn)
    shapes = (
        sharding.out_struct((bsz, nc, h, p, n), F32, like=dy),
        sharding.out_struct((bsz, nc, h, n // bn), F32, like=dy),
        sharding.out_struct((bsz, h, p, n), F32, like=dy),
    )
    grads, gs, dinit = pl.pallas_call(
        functools.partial(_state_scan_reverse_kernel, block_t=bs.block_t),
        out_shape=shapes,
        grid=(n // bn, h, bsz),
        in_specs=[specs["u"], specs["v"], specs["w"], specs["per_chunk"], specs["states"],
                  specs["one"]],
        out_specs=[specs["states"], specs["partial"], specs["one"]],
        compiler_params=_params(bs),
        interpret=interpret,
        cost_estimate=costs.state_scan_reverse(bsz * nc * h, chunk, p, n, dy.dtype,
                                               inputs=(dy, c, w, decay, states, dfinal),
                                               outputs=shapes),
        name="ssd_state_scan_reverse",
    )(dy, c, w, decay, states, dfinal.astype(F32))
    return grads, jnp.sum(gs, axis=3), dinit


def _segment(later, earlier):
    """acs_later - acs_earlier from (hi, lo) pairs broadcast against each other: the
    stable segment sum of ssd.decay (good to eps * |segment|, not eps * |acs|)."""
    return (later[0] - earlier[0]) + (later[1] - earlier[1])


def _causal_decay(acs_rows, acs_cols, row0, col0, bm, bk, *, rows_later: bool,
                  diagonal: bool = True, scale=None):
    """exp(acs_later - acs_earlier) (times `scale`, where given) where the later index >=
    the earlier one, else 0; acs_rows, acs_cols are (hi, lo) pairs of vectors.

    rows_later: the tile's rows are the later time (the output's i), else its columns.
    diagonal: the block straddles the diagonal and needs the mask; False for the blocks
    wholly on the causal side (every entry kept), which skip the index arithmetic.
    scale: a [bm, bk] tile multiplied in before the mask, which then selects: a
    non-finite entry above the diagonal (a NaN in B) gives 0 there, not 0 * NaN."""
    rows = tuple(t[:, None] for t in acs_rows)
    cols = tuple(t[None, :] for t in acs_cols)
    diff = _segment(rows, cols) if rows_later else _segment(cols, rows)
    if not diagonal:
        return jnp.exp(diff) if scale is None else scale * jnp.exp(diff)
    ri = row0 + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 0)
    ci = col0 + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 1)
    keep = ri >= ci if rows_later else ci >= ri
    out = jnp.exp(jnp.where(keep, diff, -jnp.inf))
    return out if scale is None else jnp.where(keep, scale * out, 0.0)


def _chunk_output_kernel(x_ref, b_ref, c_ref, hi_ref, lo_ref, s_ref, *refs, bm, scaled,
                         dt_exponent, skip, gated):
    """y rows [r*bm, (r+1)*bm) of one (batch, chunk) for the block's heads, which share one
    group: each C_i B_j^T block is formed once for them all.

    Mamba-2's options, fused (mamba_scan.fused): x is the raw x and x dt is never
    written; dt_j scales the tile's column j. With `dt_exponent` (dt known >= 0) the
    columns' low cumulative sums arrive as lo - log dt [C, heads], so dt joins the decay's
    exponent at no cost in the loop; with `scaled` (dt of either sign) the kernel reads dt
    [C, heads] and multiplies each head's [bm, bm] tile by it, which with two heads per
    program ran the output kernel at half speed on the H200 (2026-12-04,
    docs/performance.md). `skip` reads D [heads, p] and adds D x_i to the fp32 sums;
    `gated` reads z rows and writes y = sums silu(z), rounded once."""
    refs = list(refs)
    lo_cols_ref = refs.pop(0) if dt_exponent else lo_ref
    dt_ref = refs.pop(0) if scaled else None
    d_ref = refs.pop(0) if skip else None
    z_ref = refs.pop(0) if gated else None
    y_ref = refs.pop(0)
    r = pl.program_id(0)
    heads = x_ref.shape[1]
    i0 = pl.multiple_of(r * bm, bm)
    rows = pl.ds(i0, bm)
    c_i = c_ref[rows, :]
    cd = c_i.dtype
    acs_i = [(hi_ref[rows, hh], lo_ref[rows, hh]) for hh in range(heads)]
    # The state the chunk entered with, read through C: exp(acs_i) C_i S^T.
    accs = tuple(
        _dot(c_i, s_ref[hh].astype(cd), trans_b=True)
        * jnp.exp(acs_i[hh][0] + acs_i[hh][1])[:, None]
        for hh in range(heads)
    )

    def step(k, accs, diagonal=False):
        j0 = pl.multiple_of(k * bm, bm)
        cols = pl.ds(j0, bm)
        cb = _dot(c_i, b_ref[cols, :], trans_b=True)
        out = []
        for hh in range(heads):
            scale = cb * dt_ref[cols, hh][None, :] if scaled else cb
            m = _causal_decay(acs_i[hh], (hi_ref[cols, hh], lo_cols_ref[cols, hh]), i0, j0,
                              bm, bm, rows_later=True, diagonal=diagonal, scale=scale)
            x_j = x_ref[cols, hh, :]
            if not diagonal:  # every x_j is at or before every row's step
                out.append(accs[hh] + _dot(m.astype(cd), x_j))
                continue
            # The diagonal block (cols == rows): x_j's non-finite entries reach the rows
            # from their step on as NaN, not through the product, where the zeros above
            # the diagonal would meet them (pallasite.reference.ssd).
            acc = accs[hh] + _dot(m.astype(cd), ref.finite_part(x_j))
            out.append(ref.poison(acc, ref.nonfinite_since(x_j, axis=0)))
        return tuple(out)

    accs = step(r, jax.lax.fori_loop(0, r, step, accs), diagonal=True)
    for hh in range(heads):
        acc = accs[hh]
        if skip:
            acc = acc + d_ref[hh, :][None, :] * x_ref[rows, hh, :].astype(F32)
        if gated:
            z = z_ref[:, hh, :].astype(F32)
            acc = acc * (z * jax.nn.sigmoid(z))
        y_ref[:, hh, :] = acc.astype(y_ref.dtype)


def output_heads(bs: BlockSizes, heads: int, groups: int) -> int:
    """Heads per output program: bs.heads where it divides the heads of a group, else the
    largest power of two below it that does."""
    hb = bs.heads
    while (heads // groups) % hb:
        hb //= 2
    return hb


def _chunk_output(x, b, c, acs, states, bs: BlockSizes, interpret: bool, *, dt=None,
                  dt_nonnegative=False, D=None, z=None):
    """y [b, nc, C, h, p]; acs is the (hi, lo) pair of in-chunk cumulative sums. With the
    fused options (the kernel's docstring): dt [b, nc, C, h] fp32, D [h, p] fp32, z like
    x."""
    bsz, nc, chunk, h, p = x.shape
    g, n = b.shape[3], b.shape[4]
    hb, bm = output_heads(bs, h, g), bs.block_m
    blocks_per_group = h // g // hb
    out_shape = sharding.out_struct(x.shape, x.dtype, like=x)
    grp = pl.BlockSpec((None, None, chunk, None, n),
                       lambda r, k, i, j: (i, j, 0, k // blocks_per_group, 0))
    acs_spec = pl.BlockSpec((None, None, chunk, hb), lambda r, k, i, j: (i, j, 0, k))
    rows_spec = pl.BlockSpec((None, None, bm, hb, p), lambda r, k, i, j: (i, j, r, k, 0))
    # exp(acs_i - (acs_j - log dt_j)) = exp(acs_i - acs_j) dt_j (log 0 = -inf gives 0)
    lo_cols = None if dt is None or not dt_nonnegative else acs[1] - jnp.log(dt)
    scaled = None if dt is None or dt_nonnegative else dt
    options = [(lo_cols, acs_spec), (scaled, acs_spec),
               (D, pl.BlockSpec((hb, p), lambda r, k, i, j: (k, 0))), (z, rows_spec)]
    extra = [(t, spec) for t, spec in options if t is not None]
    inputs = (x, b, c, *acs, states, *(t for t, _ in extra))
    return pl.pallas_call(
        functools.partial(_chunk_output_kernel, bm=bm, scaled=scaled is not None,
                          dt_exponent=lo_cols is not None, skip=D is not None,
                          gated=z is not None),
        out_shape=out_shape,
        grid=(chunk // bm, h // hb, bsz, nc),
        in_specs=[
            pl.BlockSpec((None, None, chunk, hb, p), lambda r, k, i, j: (i, j, 0, k, 0)),
            grp,
            grp,
            acs_spec,
            acs_spec,
            pl.BlockSpec((None, None, hb, p, n), lambda r, k, i, j: (i, j, k, 0, 0)),
            *(spec for _, spec in extra),
        ],
        out_specs=rows_spec,
        compiler_params=_params(bs),
        interpret=interpret,
        cost_estimate=costs.chunk_output(bsz * nc * h, chunk, bm, p, n, x.dtype,
                                         heads=hb, inputs=inputs, outputs=(out_shape,)),
        name="ssd_chunk_output",
    )(*inputs)


def _bwd_rows_j_kernel(
    x_ref, dy_ref, b_ref, c_ref, hi_ref, lo_ref, g_ref, dx_ref, db_ref, dacs_ref, q_ref, *, bm,
    row_axis
):
    """Rows j of one (batch, chunk, group): dx_j and dacs_j per head, dB_j summed over the
    group's heads.

      dx_j  = sum_{i>=j} (B_j.C_i) L_ij dy_i + exp(acs_last - acs_j) G B_j
      dB_j  = sum_{i>=j} (x_j.dy_i) L_ij C_i + exp(acs_last - acs_j) G^T x_j
      dacs_j gets -sum_{i>=j} P_ij - q_j, q_j = exp(acs_last - acs_j) x_j.(G B_j)
    with L_ij = exp(acs_i - acs_j), P_ij = (dy_i.x_j)(C_i.B_j) L_ij."""
    r = pl.program_id(row_axis)
    chunk, hpg, _ = x_ref.shape
    j0 = pl.multiple_of(r * bm, bm)
    rows = pl.ds(j0, bm)
    b_j = b_ref[rows, :]
    cd = b_j.dtype
    nblocks = chunk // bm

    def head(hh, db_acc):
        x_j = x_ref[rows, hh, :]
        acs_j = (hi_ref[rows, hh], lo_ref[rows, hh])
        decay_out = jnp.exp(_segment((hi_ref[chunk - 1, hh], lo_ref[chunk - 1, hh]),
                                     acs_j))[:, None]
        g = g_ref[hh].astype(cd)
        dx = _dot(b_j, g, trans_b=True) * decay_out
        q = jnp.sum(x_j.astype(F32) * dx, axis=1)
        db_acc = db_acc + _dot(x_j, g) * decay_out

        def step(k, carry):
            dx, db_acc, col = carry
            i0 = pl.multiple_of(k * bm, bm)
            cols = pl.ds(i0, bm)
            c_i = c_ref[cols, :]
            dy_i = dy_ref[cols, hh, :]
            lt = _causal_decay(acs_j, (hi_ref[cols, hh], lo_ref[cols, hh]), j0, i0, bm, bm,
                               rows_later=False)
            mt = _dot(b_j, c_i, trans_b=True)
            dlt = _dot(x_j, dy_i, trans_b=True) * lt
            dx = dx + _dot((mt * lt).astype(cd), dy_i)
            db_acc = db_acc + _dot(dlt.astype(cd), c_i)
            col = col + jnp.sum(dlt * mt, axis=1)
            return dx, db_acc, col

        dx, db_acc, col = jax.lax.fori_loop(
            r, nblocks, step, (dx, db_acc, jnp.zeros((bm,), F32))
        )
        dx_ref[:, hh, :] = dx.astype(dx_ref.dtype)
        dacs_ref[:, hh] = -col - q
        q_ref[:, hh] = q
        return db_acc

    db = jax.lax.fori_loop(0, hpg, head, jnp.zeros(db_ref.shape, F32))
    db_ref[...] = db.astype(db_ref.dtype)


def _bwd_rows_i_kernel(
    x_ref, dy_ref, b_ref, c_ref, hi_ref, lo_ref, s_ref, dc_ref, dacs_ref, *, bm, row_axis
):
    """Rows i of one (batch, chunk, group): dC_i summed over the group's heads, dacs_i per
    head.

      dC_i   = sum_{j<=i} (dy_i.x_j) L_ij B_j + exp(acs_i) S^T dy_i
      dacs_i gets sum_{j<=i} P_ij + exp(acs_i) dy_i.(S C_i)"""
    r = pl.program_id(row_axis)
    hpg = x_ref.shape[1]
    i0 = pl.multiple_of(r * bm, bm)
    rows = pl.ds(i0, bm)
    c_i = c_ref[rows, :]
    cd = c_i.dtype

    def head(hh, dc_acc):
        dy_i = dy_ref[rows, hh, :]
        acs_i = (hi_ref[rows, hh], lo_ref[rows, hh])
        grow = jnp.exp(acs_i[0] + acs_i[1])[:, None]
        s = s_ref[hh].astype(cd)
        dc_acc = dc_acc + _dot(dy_i, s) * grow
        sc = _dot(c_i, s, trans_b=True) * grow
        row = jnp.sum(dy_i.astype(F32) * sc, axis=1)

        def step(k, carry):
            dc_acc, row = carry
            j0 = pl.multiple_of(k * bm, bm)
            cols = pl.ds(j0, bm)
            b_j = b_ref[cols, :]
            lt = _causal_decay(acs_i, (hi_ref[cols, hh], lo_ref[cols, hh]), i0, j0, bm, bm,
                               rows_later=True)
            m = _dot(c_i, b_j, trans_b=True)
            dl = _dot(dy_i, x_ref[cols, hh, :], trans_b=True) * lt
            dc_acc = dc_acc + _dot(dl.astype(cd), b_j)
            return dc_acc, row + jnp.sum(dl * m, axis=1)

        dc_acc, row = jax.lax.fori_loop(0, r + 1, step, (dc_acc, row))
        dacs_ref[:, hh] = row
        return dc_acc

    dc = jax.lax.fori_loop(0, hpg, head, jnp.zeros(dc_ref.shape, F32))
    dc_ref[...] = dc.astype(dc_ref.dtype)


def _group_grid(x, b, bm):
    """The (row block, group, batch, chunk) grid of the backward's row kernels and its
    BlockSpecs. Pallas Triton folds all but the last two grid axes into CUDA's x axis,
    first axis fastest, and blocks launch in x, y, z order. With several groups the row
    blocks and groups go first (x), so the programs of one (batch, chunk) run together and
    share its operands through L2: measured on the H200 (2026-12-01, b4 l8k h64 g8)
    forward+backward 4.07 ms against 4.49 with batch and chunk first. With one group the
    other order was faster (b2 l16k h80: 6.04 against 6.56 ms; b8 l4k h32: 2.26 against
    2.48), so there the row block is the slowest axis. Returns (grid, specs, row axis)."""
    bsz, nc, chunk, h, p = x.shape
    g, n = b.shape[3], b.shape[4]
    hpg = h // g
    rows_first = g > 1
    grid = (chunk // bm, g, bsz, nc) if rows_first else (bsz, nc, g, chunk // bm)

    def spec(shape, index):  # index(r, k, i, j): row block, group, batch, chunk
        if rows_first:
            return pl.BlockSpec(shape, lambda r, k, i, j: index(r, k, i, j))
        return pl.BlockSpec(shape, lambda i, j, k, r: index(r, k, i, j))

    specs = dict(
        heads=spec((None, None, chunk, hpg, p), lambda r, k, i, j: (i, j, 0, k, 0)),
        grp=spec((None, None, chunk, None, n), lambda r, k, i, j: (i, j, 0, k, 0)),
        acs=spec((None, None, chunk, hpg), lambda r, k, i, j: (i, j, 0, k)),
        st=spec((None, None, hpg, p, n), lambda r, k, i, j: (i, j, k, 0, 0)),
        rows_heads=spec((None, None, bm, hpg, p), lambda r, k, i, j: (i, j, r, k, 0)),
        rows_grp=spec((None, None, bm, None, n), lambda r, k, i, j: (i, j, r, k, 0)),
        rows_acs=spec((None, None, bm, hpg), lambda r, k, i, j: (i, j, r, k)),
    )
    return grid, specs, 0 if rows_first else 3


def _bwd_rows_j(x, dy, b, c, acs, grads, bs: BlockSizes, interpret: bool, db_dtype=None):
    bsz, nc, chunk, h, p = x.shape
    bm = bs.block_m
    grid, sp, row_axis = _group_grid(x, b, bm)
    shapes = (
        sharding.out_struct(x.shape, x.dtype, like=x),
        sharding.out_struct(b.shape, db_dtype or b.dtype, like=x),
        sharding.out_struct(acs[0].shape, F32, like=x),
        sharding.out_struct(acs[0].shape, F32, like=x),
    )
    return pl.pallas_call(
        functools.partial(_bwd_rows_j_kernel, bm=bm, row_axis=row_axis),
        out_shape=shapes,
        grid=grid,
        in_specs=[sp["heads"], sp["heads"], sp["grp"], sp["grp"], sp["acs"], sp["acs"], sp["st"]],
        out_specs=[sp["rows_heads"], sp["rows_grp"], sp["rows_acs"], sp["rows_acs"]],
        compiler_params=_params(bs, BWD_ROWS_NUM_STAGES),
        interpret=interpret,
        cost_estimate=costs.bwd_rows_j(bsz * nc * h, chunk, bm, p, b.shape[4], x.dtype,
                                       inputs=(x, dy, b, c, *acs, grads), outputs=shapes),
        name="ssd_bwd_rows_j",
    )(x, dy, b, c, *acs, grads)


def _bwd_rows_i(x, dy, b, c, acs, states, bs: BlockSizes, interpret: bool, dc_dtype=None):
    bsz, nc, chunk, h, p = x.shape
    bm = bs.block_m
    grid, sp, row_axis = _group_grid(x, b, bm)
    shapes = (
        sharding.out_struct(c.shape, dc_dtype or c.dtype, like=x),
        sharding.out_struct(acs[0].shape, F32, like=x),
    )
    return pl.pallas_call(
        functools.partial(_bwd_rows_i_kernel, bm=bm, row_axis=row_axis),
        out_shape=shapes,
        grid=grid,
        in_specs=[sp["heads"], sp["heads"], sp["grp"], sp["grp"], sp["acs"], sp["acs"], sp["st"]],
        out_specs=[sp["rows_grp"], sp["rows_acs"]],
        compiler_params=_params(bs, BWD_ROWS_NUM_STAGES),
        interpret=interpret,
        cost_estimate=costs.bwd_rows_i(bsz * nc * h, chunk, bm, p, b.shape[4], x.dtype,
                                       inputs=(x, dy, b, c, *acs, states), outputs=shapes),
        name="ssd_bwd_rows_i",
    )(x, dy, b, c, *acs, states)


# ----------------------------------------------------------------------------- stages


def _cumsums(a):
    """(acs as a (hi, lo) pair [b, nc, C, h], acs_last [b, nc, h] as a pair): the stable
    in-chunk cumulative sums of ssd.decay, resets clamped."""
    acs = decay.cumsum_pair(a, axis=2)
    return acs, tuple(t[:, :, -1, :] for t in acs)


def _forward_local(x, a, b, c, initial_state, *, bs, interpret):
    return _forward_fused_local(x, None, a, b, c, initial_state, None, None, bs=bs,
                                interpret=interpret)


def _forward_fused_local(x, dt, a, b, c, initial_state, D, z, *, bs, interpret,
                         dt_nonnegative=False):
    """The forward, with Mamba-2's dt, D and z in the kernels where given: dt joins the
    state scan's per-step weight w (a [b, nc, C, h] array) and scales the output tile's
    columns, D and z are the output's epilogue. (y, final, states)."""
    acs, last = _cumsums(a)
    to_last = jnp.exp(_segment(tuple(t[:, :, None, :] for t in last), acs))
    states, final = _state_scan(x, b, to_last if dt is None else to_last * dt,
                                jnp.exp(last[0] + last[1]), initial_state, bs, interpret)
    y = _chunk_output(x, b, c, acs, states, bs, interpret, dt=dt,
                      dt_nonnegative=dt_nonnegative, D=D, z=z)
    return y, final, states


def _backward_local(x, a, b, c, states, dy, dfinal, *, bs, interpret, grad_dtypes=(None, None)):
    acs, last = _cumsums(a)
    exp_last = jnp.exp(last[0] + last[1])
    dy = dy.astype(x.dtype)
    grads, gs, dinit = _state_scan_reverse(dy, c, jnp.exp(acs[0] + acs[1]), exp_last, states,
                                           dfinal, bs, interpret)
    dx, db, dacs_col, q = _bwd_rows_j(x, dy, b, c, acs, grads, bs, interpret, grad_dtypes[0])
    dc, dacs_row = _bwd_rows_i(x, dy, b, c, acs, states, bs, interpret, grad_dtypes[1])
    # acs_last also scales the entering state and every step's term of the leaving state:
    # d(acs_last) += exp(acs_last) <G, S_c> + sum_j q_j.
    dacs = (dacs_row + dacs_col).at[:, :, -1, :].add(jnp.sum(q, axis=2) + exp_last * gs)
    da = jnp.flip(jnp.cumsum(jnp.flip(dacs, axis=2), axis=2), axis=2)
    da = jnp.where(decay.reset_mask(a), da, 0.0)  # no gradient through a reset
    return dx, da.astype(a.dtype), db, dc, dinit


@sharding.local_operands("chunk_ssd")
def forward(
    x: Float[Array, "b nc C h p"],
    a: Float[Array, "b nc C h"],
    b: Float[Array, "b nc C g n"],
    c: Float[Array, "b nc C g n"],
    initial_state: Float[Array, "b h p n"],
    *,
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
) -> tuple[Float[Array, "b nc C h p"], Float[Array, "b h p n"], Float[Array, "b nc h p n"]]:
    """(y in x.dtype, final_state fp32, chunk_states = the state each chunk entered with,
    in x.dtype: the dtype the output and backward kernels multiply it in, see _state_scan).
    b and c are cast to x.dtype (the matmul operand dtype)."""
    _check_inputs(x, a, b, c, initial_state, "initial_state")
    bs = resolve_block_sizes(block_sizes, x.shape[2], x=x, b=b, pass_name="forward",
                             interpret=interpret)
    fn = functools.partial(_forward_local, bs=bs, interpret=interpret)
    args = (x, a, b.astype(x.dtype), c.astype(x.dtype), initial_state.astype(F32))
    return fn(*args)


@sharding.local_operands("mamba_chunk_scan")
def forward_fused(
    x: Float[Array, "b nc C h p"],
    dt: Float[Array, "b nc C h"],
    a: Float[Array, "b nc C h"],
    b: Float[Array, "b nc C g n"],
    c: Float[Array, "b nc C g n"],
    initial_state: Float[Array, "b h p n"],
    D: Float[Array, "h p"] | None = None,
    z: Float[Array, "b nc C h p"] | None = None,
    *,
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
    dt_nonnegative: bool = False,
):
    """The scan of (x dt, a, b, c) plus D x, gated by silu(z): (y in x.dtype, final_state
    fp32, chunk_states in x.dtype). dt [b, nc, C, h] is the processed step (fp32);
    dt_nonnegative promises dt >= 0 everywhere (softplus, or a clamp at 0 or above),
    which lets the output kernel take dt in the decay's exponent; a = A dt with any
    resets; D [h, p] fp32. Not differentiable itself: mamba_chunk_scan takes its
    gradients from the composition around chunk_ssd (mamba_scan.api)."""
    _check_inputs(x, a, b, c, initial_state, "initial_state")
    if dt.shape != a.shape:
        raise ValueError(f"dt must have a's shape {a.shape}, got shape {dt.shape}")
    if D is not None and D.shape != (x.shape[3], x.shape[4]):
        raise ValueError(f"D must be {(x.shape[3], x.shape[4])}, got shape {D.shape}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {x.shape}, got shape {z.shape}")
    bs = resolve_block_sizes(block_sizes, x.shape[2], x=x, b=b, pass_name="forward",
                             interpret=interpret)
    return _forward_fused_local(
        x, dt.astype(F32), a, b.astype(x.dtype), c.astype(x.dtype), initial_state.astype(F32),
        None if D is None else D.astype(F32), z, bs=bs, interpret=interpret,
        dt_nonnegative=dt_nonnegative)


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
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
) -> tuple[
    Float[Array, "b nc C h p"],
    Float[Array, "b nc C h"],
    Float[Array, "b nc C g n"],
    Float[Array, "b nc C g n"],
    Float[Array, "b h p n"],
]:
    """(dx, da, db, dc, dinitial_state) in the primal dtypes (dinitial_state fp32)."""
    _check_inputs(x, a, b, c, dfinal_state, "dfinal_state")
    bsz, nc, _, h, p = x.shape
    n = b.shape[4]
    if chunk_states.shape != (bsz, nc, h, p, n):
        raise ValueError(
            f"chunk_states must be {(bsz, nc, h, p, n)}, got shape {chunk_states.shape}"
        )
    if dy.shape != x.shape:
        raise ValueError(f"dy must have x's shape {x.shape}, got shape {dy.shape}")
    bs = resolve_block_sizes(block_sizes, x.shape[2], x=x, b=b, pass_name="backward",
                             interpret=interpret)
    # dB and dC leave the kernel in b's and c's own dtypes: summed in fp32 in registers
    # over the group's heads, rounded once (fp32 where a caller sums them further).
    fn = functools.partial(_backward_local, bs=bs, interpret=interpret,
                           grad_dtypes=(b.dtype, c.dtype))
    args = (
        x, a, b.astype(x.dtype), c.astype(x.dtype), chunk_states.astype(x.dtype), dy,
        dfinal_state.astype(F32),
    )
    dx, da, db, dc, dinit = fn(*args)
    return dx, da, db.astype(b.dtype), dc.astype(c.dtype), dinit
