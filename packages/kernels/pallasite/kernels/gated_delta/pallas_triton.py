"""The chunked gated delta rule through Pallas Triton (CUDA GPUs from sm80): xla.py's WY
form (its docstring has the math) in three kernels on the chunk-aligned layout.

Layout: the steps padded (or, with cu_seqlens, laid out by packing.py) to L = NC * C and
split into chunks: q, k [B, NC, C, Hk, K] (value head h reads key head h // (Hv / Hk)
through the BlockSpecs: q and k are never expanded), v [B, NC, C, Hv, V], the in-chunk
cumulative log decay G as a double-float pair (ssd.decay.cumsum_pair: a tiny XLA pass;
G_t - G_j is then good to eps * |G_t - G_j|, as the masked segment sums of xla.py are,
not to eps * |G_t|, which under strong decay is a 1e-4 error of every decay) and beta,
[B, NC, C, Hv] fp32. Matmul operands are the compute dtype (q's, k's and v's common one:
bf16 on the tensor cores) with fp32 accumulation; fp32 operands multiply at full fp32
precision, not TF32. Decays, the triangular solve and the carried state are fp32.

  1. prep, one program per (value head, chunk, row): A = strictly-lower(beta_t
     exp(G_t - G_j) k_t.k_j) in 16 x 16 blocks (the exponent masked before exp above the
     diagonal, so no exp of a positive sum); (I + A)^-1 from its diagonal blocks
     (forward substitution, 16 rows) merged block row by block row; then U = (I +
     A)^-1 (beta V) and W = (I + A)^-1 (beta exp(G) K), stored in the compute dtype. With
     PREP_IN_TWO_KERNELS, two kernels instead: the solve (K K^T as one [C, C] product, T
     stored in fp32) and the apply (W and U as whole-chunk products).
  2. state pass, one program per (block of value columns, value head, row), walking the
     chunks in order with the fp32 state [K, block_v]: it stores the state each chunk
     enters with, u = U - W S (stored) and S <- exp(G_last) S + (exp(G_last - G) K)^T u.
     It walks one run of chunks per sequence (packing.sequence_runs: a row without
     cu_seqlens is one run; with them, each packed sequence's chunks, then the padding
     chunks from zero), loading the run's initial state before its chunk loop and
     storing its final state after it. The finals buffer is the initial states'
     (aliased), so a sequence that owns no chunk (empty) returns its initial state.
  3. output, one program per (block of value columns, value head, chunk, row):
     o = scale (exp(G) Q S_enter + (D o Q K^T) u), D the masked decay with its diagonal.
     With FUSED_OUTPUT, the state pass forms o itself in its chunk loop from the state
     and u it holds (one kernel fewer; without residuals it stores neither).

q and k are L2-normalised in each kernel that reads them when asked
(use_qk_l2norm_in_kernel), in fp32 before the cast to the compute dtype.

The backward is two more kernels (pallas_triton_bwd.py: a reverse state pass and the
chunk gradients) behind a jax.custom_vjp, on the forward's residuals: the layout's
inputs, G's pair, W, the entry states, u and, stored by the prep only then, T = (I +
A)^-1 in fp32. Each pass runs through sharding.run (layouts.pass_planners): under Auto
axes a custom_partitioning keeps the rows and heads the compiler gave the operands
local, residuals included, and a T it split in whole chunks of unpacked rows (each
part from the entering state an exchange gives it, context_parallel.py); elsewhere it
is a plain call on the arrays as given.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallasite import tuning
from pallasite.kernels import cost, platform, sharding
from pallasite.kernels.gated_delta import context_parallel, packing, pallas_mosaic_gpu
from pallasite.kernels.ssd import decay
from pallasite.reference.gated_delta_rule import L2NORM_EPS

F32 = jnp.float32
SUB = 16  # rows of the triangular solve's blocks: Triton's smallest dot
CHUNK_SIZES = (16, 32, 64)  # the prep kernel unrolls C / 16 block rows
MIN_DIM, MAX_DIM = 16, 256  # K and V: powers of two (Triton's tiles), registers above
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
BLOCK_SIZE_KEYS = ("block_v", "output_block_v", "grads_block_v")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_v: value columns per state-pass program (more programs walk the chunks side
    by side; the pass is a sequential loop of small dots, latency-bound); None picks the
    widest of 64, 32, 16 that still gives STATE_PROGRAMS programs. output_block_v: value
    columns per output program (Q K^T is formed once per program, so wide blocks form it
    fewer times). grads_block_v: value columns per program of the backward's
    chunk-gradient kernel (its dq, dk, dbeta and dg are sums over the blocks; wider
    blocks recompute Q K^T, K K^T and W fewer times). All powers of two from 16, cut to
    V; the backward's reverse state pass takes block_v.

    The defaults are the H200's best of a sweep (tools/sweeps/gated_delta_stages.py,
    2026-12-03, bf16, K = V = 128, docs/performance.md): at (B 1, T 32768, Hv 32) the
    state pass took 1.43 / 1.34 / 1.73 ms at block_v 16 / 32 / 64 and at (B 8, T 4096,
    Hv 32) 1.37 / 0.91 / 0.69; the output 1.06 / 0.77 / 0.52 ms at output_block_v 32 /
    64 / 128; the chunk gradients (two kernels since 4c65601) 20.0 / 10.2 / 8.1 ms at
    grads_block_v 32 / 64 / 128."""

    block_v: int | None = None
    output_block_v: int = 128
    grads_block_v: int = 128


# The state passes' programs wanted before block_v narrows: about one per SM of an H200.
STATE_PROGRAMS = 128


def block_sizes_reason(block_sizes) -> str | None:
    """Why `block_sizes` is not a valid block-size dict (None: it is, or is None)."""
    if block_sizes is None:
        return None
    if not isinstance(block_sizes, dict):
        return f"must be None or a dict with keys from {BLOCK_SIZE_KEYS}"
    unknown = sorted(set(block_sizes) - set(BLOCK_SIZE_KEYS))
    if unknown:
        return f"unknown keys {unknown}; known: {BLOCK_SIZE_KEYS}"
    for key, value in block_sizes.items():
        if (isinstance(value, bool) or not isinstance(value, int) or value < MIN_DIM
                or value & (value - 1)):
            return f"{key}={value!r} is not a power of two >= {MIN_DIM}"
    return None


def geometry_reason(dk: int, dv: int, chunk_size: int, dtypes) -> str | None:
    """Why the kernels cannot run this problem (None: they can)."""
    for name, value in (("K (q's and k's last dim)", dk), ("V (v's last dim)", dv)):
        if value < MIN_DIM or value > MAX_DIM or value & (value - 1):
            return f"{name} = {value} is not a power of two in [{MIN_DIM}, {MAX_DIM}]"
    if chunk_size not in CHUNK_SIZES:
        return f"chunk_size={chunk_size} is not one of {CHUNK_SIZES}"
    for name, dtype in dtypes.items():
        if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
            return f"{name} has dtype {jnp.dtype(dtype)}; the kernels take bf16, fp16 or fp32"
    return None


def default_block_v(batch: int, hv: int, dv: int) -> int:
    """The widest state-pass block (64, 32 or 16 columns) that gives the state passes
    STATE_PROGRAMS programs, else 16."""
    for bv in (64, 32):
        if -(-dv // bv) * hv * batch >= STATE_PROGRAMS:
            return min(bv, dv)
    return min(16, dv)


def as_block_dict(bs: BlockSizes) -> dict:
    """`bs` as the block_sizes dict the kernels take (None fields left out)."""
    return {k: v for k, v in dataclasses.asdict(bs).items() if v is not None}


def _fits(bs: BlockSizes) -> bool:
    """Whether a stored config (a table or cache entry) is valid block sizes."""
    return block_sizes_reason(as_block_dict(bs)) is None


def _resolve(block_sizes, *, batch: int, length: int, hv: int, dk: int, dv: int,
             chunk: int, dtype) -> BlockSizes:
    """The one place block sizes are chosen, for the forward and the backward alike: the
    caller's dict (any key given), else pallasite.tuning's table entry for this device,
    compute dtype and shape bucket, else BlockSizes' defaults; block_v None becomes
    default_block_v's pick, and every block is cut to V. No autotune on a miss: the
    table's entries come from the offline autotuner (`bench.autotune --op
    gated_delta_rule`)."""
    if block_sizes:
        bs = BlockSizes(**block_sizes)
    else:
        shape = {"batch": batch, "length": length, "heads": hv, "key_dim": dk,
                 "value_dim": dv, "chunk": chunk}
        bs = tuning.select_block_sizes(
            "gated_delta_rule", "pallas_triton", device_kind=tuning.device_kind(),
            dtypes=(dtype,), shape=shape, config_type=BlockSizes, default=BlockSizes(),
            fits=lambda config, dims: _fits(config)).config
    block_v = default_block_v(batch, hv, dv) if bs.block_v is None else bs.block_v
    return BlockSizes(block_v=min(block_v, dv), output_block_v=min(bs.output_block_v, dv),
                      grads_block_v=min(bs.grads_block_v, dv))


# ----------------------------------------------------------------------------- helpers


def _dot(a, b, trans_a=False, trans_b=False):
    """plgpu.dot, fp32 accumulation; fp32 operands at full fp32 precision (Triton would
    take TF32, a 1e-3 relative error, for fp32 by default)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == F32 else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _normed(x, l2norm: bool):
    """Rows of x in fp32, L2-normalised where asked (the reference's l2norm)."""
    x = x.astype(F32)
    if l2norm:
        x = x * jax.lax.rsqrt(jnp.sum(x * x, axis=1) + L2NORM_EPS)[:, None]
    return x


def _slot(index):
    """A table entry as a ref index: clipped at 0, in JAX's default int type (the
    interpreter's index arithmetic mixes it with that type's zeros under x64)."""
    return jnp.maximum(index, 0).astype(jax.dtypes.canonicalize_dtype(jnp.int64))


def _iota(n, m, axis):
    return jax.lax.broadcasted_iota(jnp.int32, (n, m), axis)


def _segment(hi_t, lo_t, hi_j, lo_j):
    """G_t - G_j from the double-float pairs (broadcast against each other)."""
    return (hi_t - hi_j) + (lo_t - lo_j)


def _masked_decay(hi_t, lo_t, hi_j, lo_j, keep):
    """exp(G_t - G_j) where `keep`, else 0; the exponent is masked first, so the
    (positive) sums above the diagonal never reach exp."""
    seg = _segment(hi_t[:, None], lo_t[:, None], hi_j[None, :], lo_j[None, :])
    return jnp.exp(jnp.where(keep, seg, -jnp.inf))


def _load_where(ref, index, otherwise, in_branch: bool):
    """ref[index] in fp32 where the table entry `index` is >= 0, else `otherwise`: under a
    branch, or by a masked load (the state passes' forms, STATE_IO_IN_BRANCHES)."""
    if in_branch:
        return jax.lax.cond(index >= 0, lambda: ref[_slot(index)].astype(F32),
                            lambda: otherwise)
    loaded = plgpu.load(ref.at[_slot(index)], mask=jnp.full(otherwise.shape, index >= 0),
                        other=0.0)
    return jnp.where(index >= 0, loaded.astype(F32), otherwise)


def _store_where(ref, index, value, in_branch: bool):
    """ref[index] = value where the table entry `index` is >= 0, as _load_where."""
    value = value.astype(ref.dtype)
    if in_branch:
        @pl.when(index >= 0)
        def _():
            ref[_slot(index)] = value
    else:
        plgpu.store(ref.at[_slot(index)], value, mask=jnp.full(value.shape, index >= 0))


class _PackedChunk:
    """One chunk's rows of q, k, v or o where packed sequences lie in the row itself
    (PACKED_ROWS_IN_PLACE), read and written as a kernel reads its block of the chunk
    layout: `ref` is the row [T, D], the chunk its rows start .. start + C, those from
    `count` on masked (the next sequence's, or past the row's end): read as zeros (the
    layout's zero steps), never written. Indexed as the block refs are: [...] or [rows,
    :] with rows a pl.ds within the chunk."""

    def __init__(self, ref, start, count, chunk: int):
        self.ref, self.start, self.count = ref, start, count
        self.shape, self.dtype = (chunk, ref.shape[1]), ref.dtype

    def _at(self, index):
        rows = index[0] if isinstance(index, tuple) else index
        first, size = (0, self.shape[0]) if rows is Ellipsis else (rows.start, rows.size)
        steps = first + jax.lax.broadcasted_iota(jnp.int32, (size, self.shape[1]), 0)
        start = (self.start + first).astype(jax.dtypes.canonicalize_dtype(jnp.int64))
        return self.ref.at[pl.ds(start, size), :], steps < self.count

    def __getitem__(self, index):
        rows, mask = self._at(index)
        return plgpu.load(rows, mask=mask, other=0)

    def __setitem__(self, index, value):
        rows, mask = self._at(index)
        plgpu.store(rows, value, mask=mask)


def _in_packed_rows(kernel, chunk_axis: int, chunk: int, in_place: tuple[int, ...]):
    """`kernel` taking its refs at positions `in_place` (q, k, v, o) as _PackedChunks of
    the program's chunk (program_id(chunk_axis)): its form for PACKED_ROWS_IN_PLACE,
    taking chunk_rows' start and count tables as its first two refs."""
    def packed_kernel(start_ref, count_ref, *refs, **kwargs):
        c = pl.program_id(chunk_axis)
        refs = list(refs)
        for i in in_place:
            refs[i] = _PackedChunk(refs[i], start_ref[c], count_ref[c], chunk)
        kernel(*refs, **kwargs)

    return packed_kernel


def _params(num_warps=4, num_stages=1):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ------------------------------------------------------------------------------ prep


def _unit_lower_inverse(a_t):
    """(I + a)^-1 for strictly lower [..., n, n] fp32 a, given its transpose a_t (a batch
    of them at once where a_t has leading axes: one row step serves all). Row r of a is
    column r of a_t, picked out with a masked sum along the columns: Triton cannot index
    registers dynamically, and a sum along the rows of a would leave a_r in the other
    layout of the two, a trip through shared memory at every row."""
    last = a_t.ndim - 1
    return _unit_lower_inverse_of_rows(
        lambda r, cols: jnp.sum(jnp.where(cols == r, a_t, 0.0), axis=last), a_t.shape)


def _unit_lower_inverse_of_rows(row_of, shape):
    """(I + a)^-1 [..., n, n] fp32 for a batch of strictly lower a of `shape`, given
    row_of(r, cols): row r of each a [..., n] (zero from column r on; cols is the column
    index of `shape`). Forward substitution, one row at a time: row r of the inverse is
    e_r - sum_{j<r} a_rj row_j."""
    n, last = shape[-1], len(shape) - 1
    rows = jax.lax.broadcasted_iota(jnp.int32, shape, last - 1)
    cols = jax.lax.broadcasted_iota(jnp.int32, shape, last)
    eye = jnp.where(rows == cols, 1.0, 0.0).astype(F32)
    inv = eye
    for r in range(1, n):
        a_r = row_of(r, cols)
        row = eye - jnp.expand_dims(jnp.sum(a_r[..., None] * inv, axis=last - 1), last - 1)
        inv = jnp.where(rows == r, row, inv)
    return inv


def _block_inverse(diagonal_inverse, below, nb: int):
    """T = (I + A)^-1 as its lower SUB x SUB blocks {(i, j): [SUB, SUB] fp32}, by block
    forward substitution: T_ii = (I + A_ii)^-1 (diagonal_inverse(i)), and for j < i
    T_ij = -T_ii sum_{j<=m<i} A_im T_mj, with below(i, j) = A_ij for j < i."""
    inv = {}
    for i in range(nb):
        inv[i, i] = diagonal_inverse(i)
        a_row = [below(i, m) for m in range(i)]
        for j in range(i):
            acc = _dot(a_row[j], inv[j, j])
            for m in range(j + 1, i):
                acc = acc + _dot(a_row[m], inv[m, j])
            inv[i, j] = -_dot(inv[i, i], acc)
    return inv


def _inverse_blocks(k_ref, hi_ref, lo_ref, beta_ref, cd, l2norm: bool):
    """T's lower blocks (_block_inverse) of one (value head, chunk, row), A =
    strictly-lower(beta_t exp(G_t - G_j) k_t.k_j) formed block by block from 16-row key
    products. Key blocks are loaded where used, not held: held (with the apply's
    operands), they spilled registers."""
    nb = k_ref.shape[0] // SUB
    rows = [pl.ds(i * SUB, SUB) for i in range(nb)]
    keys = lambda j: _normed(k_ref[rows[j], :], l2norm).astype(cd)  # noqa: E731
    hi = [hi_ref[r] for r in rows]
    lo = [lo_ref[r] for r in rows]
    beta = [beta_ref[r] for r in rows]
    upper = _iota(SUB, SUB, 0) < _iota(SUB, SUB, 1)

    def diagonal_t(i):  # [j, t] = A[t, j] for t > j, built as such
        kk = _dot(keys(i), keys(i), trans_b=True)  # symmetric
        seg = _segment(hi[i][None, :], lo[i][None, :], hi[i][:, None], lo[i][:, None])
        decay = jnp.exp(jnp.where(upper, seg, -jnp.inf))
        return jnp.where(upper, beta[i][None, :] * decay * kk, 0.0)

    def below(i, j):
        kk = _dot(keys(i), keys(j), trans_b=True)
        return beta[i][:, None] * jnp.exp(_segment(hi[i][:, None], lo[i][:, None],
                                                   hi[j][None, :], lo[j][None, :])) * kk

    return _block_inverse(lambda i: _unit_lower_inverse(diagonal_t(i)), below, nb)


def _store_blocks(out_ref, inv):
    """The [C, C] T from its lower blocks, zeros above them, in out_ref's dtype."""
    nb = out_ref.shape[0] // SUB
    for i in range(nb):
        for j in range(nb):
            block = inv[i, j] if j <= i else jnp.zeros((SUB, SUB), F32)
            out_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = block.astype(out_ref.dtype)


def _scaled_rhs(k, v, hi, lo, beta, l2norm: bool, cd):
    """The solve's right-hand sides: (beta V, beta exp(G) K) in the compute dtype, for
    rows k [n, K], v [n, V], hi, lo, beta [n]."""
    values = (beta[:, None] * v.astype(F32)).astype(cd)
    keys = ((beta * jnp.exp(hi + lo))[:, None] * _normed(k, l2norm)).astype(cd)
    return values, keys


def _prep_kernel(k_ref, v_ref, hi_ref, lo_ref, beta_ref, w_ref, u_ref, *inv_ref,
                 l2norm: bool):
    """U and W of one (value head, chunk, row) in one kernel: the solve in SUB x SUB
    blocks, applied block by block (16-row products); with inv_ref (the backward's
    residual), T = (I + A)^-1 [C, C] in fp32 too."""
    cd = w_ref.dtype
    inv = _inverse_blocks(k_ref, hi_ref, lo_ref, beta_ref, cd, l2norm)
    if inv_ref:
        _store_blocks(inv_ref[0], inv)
    rows = [pl.ds(i * SUB, SUB) for i in range(k_ref.shape[0] // SUB)]

    def rhs(j):  # loaded where used, as the keys
        r = rows[j]
        return _scaled_rhs(k_ref[r, :], v_ref[r, :], hi_ref[r], lo_ref[r], beta_ref[r],
                           l2norm, cd)

    for i, r in enumerate(rows):
        u = w = 0.0
        for j in range(i + 1):
            values, keys = rhs(j)
            u = u + _dot(inv[i, j].astype(cd), values)
            w = w + _dot(inv[i, j].astype(cd), keys)
        u_ref[r, :] = u.astype(u_ref.dtype)
        w_ref[r, :] = w.astype(w_ref.dtype)


def _solve_kernel(k_ref, hi_ref, lo_ref, beta_ref, t_ref, *, l2norm: bool, interpret: bool):
    """T = (I + A)^-1 [C, C] fp32 of one (value head, chunk, row): the two-kernel prep's
    first. K K^T is one [C, K] x [K, C] product; A's blocks reach the substitution
    through t_ref, which holds M = A + A^T first (its upper blocks' transposes are the
    diagonal's, in the layout the row picks want), then T. The barriers order the
    program's threads' stores and loads of t_ref; the interpreter runs them in order."""
    chunk = k_ref.shape[0]
    nb = chunk // SUB
    keys = _normed(k_ref[...], l2norm).astype(k_ref.dtype)  # k is in the compute dtype
    hi, lo, beta = hi_ref[...], lo_ref[...], beta_ref[...]
    rows, cols = _iota(chunk, chunk, 0), _iota(chunk, chunk, 1)
    lower = rows > cols
    seg = _segment(hi[:, None], lo[:, None], hi[None, :], lo[None, :])
    seg = jnp.where(lower, seg, jnp.where(rows == cols, -jnp.inf, -seg))  # <= 0: G falls
    weight = jnp.where(lower, beta[:, None], beta[None, :])
    t_ref[...] = weight * jnp.exp(seg) * _dot(keys, keys, trans_b=True)
    if not interpret:
        plgpu.debug_barrier()
    block = lambda i, j: t_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)]  # noqa: E731
    # A's blocks below the diagonal, loaded where each form has loaded them (the
    # block-by-block form after its diagonal blocks: the order its GPU tests ran in)
    below = lambda: {(i, j): block(i, j) for i in range(nb) for j in range(i)}  # noqa
    if SOLVE_DIAGONAL_AT_ONCE:
        a_below = below()
        # The nb diagonal blocks as one [nb, SUB, SUB] gather of M's, inverted together
        # (SUB - 1 row steps in all, not per block), the inverses stored over them.
        at = lambda axis: jax.lax.broadcasted_iota(jnp.int32, (nb, SUB, SUB), axis)  # noqa
        first, row, col = at(0) * SUB, at(1), at(2)
        # Every thread's loads of M's diagonal blocks come before the barrier, its stores
        # of their inverses after it (the register form inverts after it: its loads are
        # done by then).
        if SOLVE_ROWS_LOADED:  # row r of every block of A (M's lower part): [nb, SUB]
            start, j = _iota(nb, SUB, 0) * SUB, _iota(nb, SUB, 1)
            row_of = lambda r, _: jnp.where(j < r, t_ref[start + r, start + j], 0.0)  # noqa
            inverse = _unit_lower_inverse_of_rows(row_of, (nb, SUB, SUB))
            # Stored transposed, as the rows are loaded: Triton then lays the sums' axis
            # out within a warp (the loads and the store both run along it).
            diagonal = (first + col, first + row)
            within = lambda i, axis: i * SUB + _iota(SUB, SUB, axis)  # noqa: E731
            diagonal_inverse = lambda i: t_ref[within(i, 1), within(i, 0)]  # noqa: E731
        else:
            diagonal = (first + row, first + col)
            diagonal_t = jnp.where(row < col, t_ref[diagonal], 0.0)
            diagonal_inverse = lambda i: block(i, i)  # noqa: E731
        if not interpret:
            plgpu.debug_barrier()
        t_ref[diagonal] = inverse if SOLVE_ROWS_LOADED else _unit_lower_inverse(diagonal_t)
        if not interpret:
            plgpu.debug_barrier()
    else:
        upper = _iota(SUB, SUB, 0) < _iota(SUB, SUB, 1)
        diagonal_t = [jnp.where(upper, block(i, i), 0.0) for i in range(nb)]
        a_below = below()
        if not interpret:
            plgpu.debug_barrier()
        diagonal_inverse = lambda i: _unit_lower_inverse(diagonal_t[i])  # noqa: E731
    _store_blocks(t_ref, _block_inverse(diagonal_inverse, lambda i, j: a_below[i, j], nb))


def _apply_kernel(k_ref, v_ref, hi_ref, lo_ref, beta_ref, t_ref, w_ref, u_ref, *,
                  l2norm: bool):
    """W = T (beta exp(G) K) and U = T (beta V) of one (value head, chunk, row) as whole
    [C, C] x [C, K | V] products (the two-kernel prep's second)."""
    cd = w_ref.dtype
    t = t_ref[...].astype(cd)
    values, keys = _scaled_rhs(k_ref[...], v_ref[...], hi_ref[...], lo_ref[...],
                               beta_ref[...], l2norm, cd)
    u_ref[...] = _dot(t, values).astype(u_ref.dtype)
    w_ref[...] = _dot(t, keys).astype(w_ref.dtype)


def _solve_apply_kernel(k_ref, v_ref, hi_ref, lo_ref, beta_ref, t_ref, w_ref, u_ref, *,
                        l2norm: bool, interpret: bool):
    """The two-kernel prep's solve and apply in one program (APPLY_IN_SOLVE_KERNEL): T
    stored as the solve stores it, then read back, from the cache, for the apply's
    whole-chunk products; one launch, and k and the gates loaded by one program."""
    _solve_kernel(k_ref, hi_ref, lo_ref, beta_ref, t_ref, l2norm=l2norm, interpret=interpret)
    if not interpret:
        plgpu.debug_barrier()  # every thread's stores of T before any thread's loads
    _apply_kernel(k_ref, v_ref, hi_ref, lo_ref, beta_ref, t_ref, w_ref, u_ref, l2norm=l2norm)


def _pick_blocks(t, idx, nb):
    """Row blocks idx of t [Z, C, ...] stacked: [Z, len(idx), SUB, ...]."""
    blocks = t.reshape(t.shape[0], nb, SUB, *t.shape[2:])
    return jnp.stack([blocks[:, i] for i in idx], 1)


def _block_inverse_body(diagonal, nb):
    """_block_inverse's arithmetic over [Z, nb, SUB, SUB] diagonal blocks (stand-ins of
    the right shapes): the substitution (S - 1 rows of a product and a subtraction per
    entry); the merges (M1 = nb (nb - 1) (nb + 1) / 6 products A_im T_mj and M2 = nb (nb
    - 1) / 2 closing ones, S^3 each, M1 - M2 block sums and M2 negations)."""
    z = diagonal.shape[0]
    inv = diagonal
    for _ in range(SUB - 1):
        inv = inv - diagonal * inv
    m1 = nb * (nb - 1) * (nb + 1) // 6
    m2 = nb * (nb - 1) // 2
    square = jnp.broadcast_to(inv[:, :1], (z, m1 + m2, SUB, SUB))
    merged = jnp.einsum("zpst,zptu->zpsu", square, square)
    return inv, merged[:, :m1 - m2] + merged[:, m2:m1], -merged[:, m1:]


def _prep_body(k, v, hi, lo, beta, *, nb):
    """The one-kernel prep's arithmetic vectorised over its programs (for
    pl.estimate_cost; stand-in blocks of the right shapes where the kernel's are many
    small ones): k [Z, C, K], v [Z, C, V], hi, lo and beta [Z, C]. The P = nb (nb + 1) /
    2 lower blocks of A (a dot, a 3-flop segment, an exp and two products per entry);
    _block_inverse_body; the scalings of V and K; the P block products into U and into W
    and their P - nb block sums."""
    z = k.shape[0]
    lower = [(i, j) for i in range(nb) for j in range(i + 1)]
    rows, cols = [i for i, _ in lower], [j for _, j in lower]
    kk = jnp.einsum("zpsk,zptk->zpst", _pick_blocks(k, rows, nb), _pick_blocks(k, cols, nb))
    seg = ((_pick_blocks(hi, rows, nb)[..., :, None] - _pick_blocks(hi, cols, nb)[..., None, :])
           + (_pick_blocks(lo, rows, nb)[..., :, None] - _pick_blocks(lo, cols, nb)[..., None, :]))
    a = _pick_blocks(beta, rows, nb)[..., None] * jnp.exp(seg) * kk
    inv = _block_inverse_body(a[:, :nb], nb)
    values = beta[..., None] * v
    keys = (beta * jnp.exp(hi + lo))[..., None] * k
    t = jnp.broadcast_to(inv[0][:, :1], (z, len(lower), SUB, SUB))
    out = []
    for rhs in (values, keys):
        prods = jnp.einsum("zpst,zptn->zpsn", t, _pick_blocks(rhs, cols, nb))
        out.append(prods[:, nb:] + prods[:, :len(lower) - nb])
    return inv, out


def _solve_body(k, hi, lo, beta, *, nb):
    """The two-kernel prep's solve vectorised (as _prep_body): K K^T whole [C, C], its
    segment (3 flops), exp and two products per entry; _block_inverse_body."""
    z = k.shape[0]
    seg = (hi[..., :, None] - hi[..., None, :]) + (lo[..., :, None] - lo[..., None, :])
    a = beta[..., None] * jnp.exp(seg) * jnp.einsum("zsk,ztk->zst", k, k)
    diagonal = a[:, :nb * SUB, :SUB].reshape(z, nb, SUB, SUB)
    return a, _block_inverse_body(diagonal, nb)


def _apply_body(t, k, v, hi, lo, beta):
    """The two-kernel prep's apply vectorised: t [Z, C, C], k [Z, C, K], v [Z, C, V],
    hi, lo and beta [Z, C]; beta V and beta exp(G) K, then their products with T."""
    values = beta[..., None] * v
    keys = (beta * jnp.exp(hi + lo))[..., None] * k
    return jnp.einsum("zst,ztn->zsn", t, values), jnp.einsum("zst,ztn->zsn", t, keys)


def _solve_apply_body(k, v, hi, lo, beta, *, nb):
    """_solve_body then _apply_body on its T (the fused form's arithmetic)."""
    t, inverse = _solve_body(k, hi, lo, beta, nb=nb)
    return t, inverse, _apply_body(t, k, v, hi, lo, beta)


# Two forms of the prep, timed against each other by tools/sweeps/gated_delta_stages.py:
# one kernel (the solve's blocks applied block by block, 16-row products), or two (the
# solve storing T, then W and U as whole [C, C] x [C, K | V] products). Two: on an H200
# (2026-12-06, B 1, T 32768, Hv 32) the prep takes 1.13 ms against one kernel's 1.96.
PREP_IN_TWO_KERNELS = True
# The solve's diagonal blocks inverted together, one [nb, SUB, SUB] substitution (SUB - 1
# serial row steps in all), rather than block by block (nb (SUB - 1) steps, each a pair of
# cross-thread sums); the same arithmetic per element (equal to rounding in the interpreter).
# Compiled for sm_90 (triton 3.6) it takes the solve from 210 barriers, 540 shuffles and
# 168 registers to 77, 172 and 146, no spills; on an H100 (2026-12-06, B 1, T 32768, Hv
# 32) the prep from 1.23 to 1.11 ms and the forward from 2.79 to 2.65.
SOLVE_DIAGONAL_AT_ONCE = True
# The at-once substitution's rows of A loaded from the solve's buffer (M, where A's blocks
# already are; an L1 hit) rather than picked out of registers by a masked cross-thread
# sum, and the diagonal inverses stored transposed, so that Triton lays each row step's
# one remaining sum out within a warp (no shared memory, no barrier). Compiled for sm_90
# (triton 3.6, 2026-12-07, Qwen3-Next's heads, bf16) the fused solve and apply goes from
# 97 barriers and 172 shuffles to 60 and 60 (250 and 254 registers, no spill). Off until
# timed (tools/sweeps/gated_delta_stages.py --flag-forms times it both ways).
SOLVE_ROWS_LOADED = False
# Warps of the two-kernel form's solve: at 4 ptxas (sm_90) gives it 168 registers and no
# spills; at 1 and 2 it spills (its [C, C] products), at 8 it replicates more small work.
SOLVE_WARPS = 4
# The two-kernel form's apply run inside the solve's program, on the T it has just stored
# (read back from the cache, not from HBM by a second kernel): the apply's reads of T and
# k and one launch saved, the two bodies' registers not live at once. Compiled for sm_90
# (triton 3.6, 2026-12-06, Qwen3-Next's heads, bf16, chunk 64) it takes 250 registers,
# no spills, 96 barriers (the two kernels 146 and 134 registers, 77 and 11 barriers). On
# an H100 (2026-12-06, K = V = 128, Hv 32, bf16) the prep took 1.011 ms against 1.085 at
# B 1, T 32768 and 1.041 against 1.126 at B 8, T 4096; the forward 2.465 against 2.551
# and 2.376 against 2.455.
APPLY_IN_SOLVE_KERNEL = True


def prep_kernel_count() -> int:
    """How many kernels the prep launches under the flags above: 1 or 2."""
    return 2 if PREP_IN_TWO_KERNELS and not APPLY_IN_SOLVE_KERNEL else 1


def forward_kernel_count() -> int:
    """How many kernels the forward launches: the prep's, then the state pass and the
    output kernel, or the state pass with the output in its loop (FUSED_OUTPUT)."""
    return prep_kernel_count() + (1 if FUSED_OUTPUT else 2)


def _prep(k, v, hi, lo, beta, hv, cd, l2norm, interpret, store_inverse=False, rows=None):
    """(U [B, NC, C, Hv, V], W [B, NC, C, Hv, K]) in the compute dtype, and with
    store_inverse T = (I + A)^-1 [B, NC, Hv, C, C] fp32 (else None). k and v are in the
    chunk layout, or with `rows` (packing.chunk_rows' tables) the packed rows [1, T, H,
    D] themselves, read in place."""
    b, nc, chunk, _ = hi.shape
    hk, dk = k.shape[-2:]
    dv = v.shape[-1]
    per_key_head = hv // hk
    gate = pl.BlockSpec((None, None, chunk, None), lambda h, c, i: (i, c, 0, h))
    key_spec = pl.BlockSpec((None, None, chunk, None, dk),
                            lambda h, c, i: (i, c, 0, h // per_key_head, 0))
    value_spec = pl.BlockSpec((None, None, chunk, None, dv), lambda h, c, i: (i, c, 0, h, 0))
    key_in, value_in = key_spec, value_spec
    if rows is not None:
        length = k.shape[1]
        key_in = pl.BlockSpec((None, length, None, dk),
                              lambda h, c, i: (i, 0, h // per_key_head, 0))
        value_in = pl.BlockSpec((None, length, None, dv), lambda h, c, i: (i, 0, h, 0))
    inverse_spec = pl.BlockSpec((None, None, None, chunk, chunk), lambda h, c, i: (i, c, h, 0, 0))
    shapes = (sharding.out_struct((b, nc, chunk, hv, dk), cd, like=v),
              sharding.out_struct((b, nc, chunk, hv, dv), cd, like=v))
    out_specs = [
        pl.BlockSpec((None, None, chunk, None, dk), lambda h, c, i: (i, c, 0, h, 0)),
        value_spec,
    ]
    inverse_shape = sharding.out_struct((b, nc, hv, chunk, chunk), F32, like=v)
    nb = chunk // SUB
    z = b * nc * hv
    row = cost.struct((z, chunk), F32)
    keys_z, values_z = cost.struct((z, chunk, dk), F32), cost.struct((z, chunk, dv), F32)
    grid = (hv, nc, b)

    def call(kernel, in_place, in_specs, args, **kwargs):  # in_place: k's, v's refs
        if rows is not None:
            kernel = _in_packed_rows(kernel, 1, chunk, in_place)
            table = pl.BlockSpec((None, nc), lambda h, c, i: (i, 0))
            in_specs, args = [table, table] + in_specs, tuple(rows) + args
        return pl.pallas_call(kernel, in_specs=in_specs, grid=grid, interpret=interpret,
                              **kwargs)(*args)

    if PREP_IN_TWO_KERNELS and APPLY_IN_SOLVE_KERNEL:
        inv, w, big_u = call(
            functools.partial(_solve_apply_kernel, l2norm=l2norm, interpret=bool(interpret)),
            (0, 1), [key_in, value_in, gate, gate, gate], (k, v, hi, lo, beta),
            out_shape=(inverse_shape,) + shapes,
            out_specs=[inverse_spec] + out_specs,
            compiler_params=_params(num_warps=SOLVE_WARPS),
            cost_estimate=cost.estimate(functools.partial(_solve_apply_body, nb=nb), keys_z,
                                        values_z, row, row, row, inputs=(k, v, hi, lo, beta),
                                        outputs=(inverse_shape,) + shapes),
            name="gated_delta_rule_solve_apply",
        )
        return big_u, w, (inv if store_inverse else None)
    if PREP_IN_TWO_KERNELS:
        inv = call(
            functools.partial(_solve_kernel, l2norm=l2norm, interpret=bool(interpret)),
            (0,), [key_in, gate, gate, gate], (k, hi, lo, beta),
            out_shape=inverse_shape,
            out_specs=inverse_spec,
            compiler_params=_params(num_warps=SOLVE_WARPS),
            cost_estimate=cost.estimate(functools.partial(_solve_body, nb=nb), keys_z, row,
                                        row, row, inputs=(k, hi, lo, beta),
                                        outputs=(inverse_shape,)),
            name="gated_delta_rule_solve",
        )
        w, big_u = call(
            functools.partial(_apply_kernel, l2norm=l2norm),
            (0, 1), [key_in, value_in, gate, gate, gate, inverse_spec],
            (k, v, hi, lo, beta, inv),
            out_shape=shapes,
            out_specs=out_specs,
            compiler_params=_params(num_warps=4),
            cost_estimate=cost.estimate(_apply_body, cost.struct((z, chunk, chunk), F32),
                                        keys_z, values_z, row, row, row,
                                        inputs=(k, v, hi, lo, beta, inv), outputs=shapes),
            name="gated_delta_rule_apply",
        )
        return big_u, w, (inv if store_inverse else None)
    if store_inverse:
        shapes += (inverse_shape,)
        out_specs.append(inverse_spec)
    # Two warps for K, V <= 128: 1.63 against 1.90 ms at four and 3.42 at eight (H200,
    # B 1, T 32768, Hv 32, 2026-12-03).
    warps = 8 if max(dk, dv) > 128 else 2
    w, big_u, *inv = call(
        functools.partial(_prep_kernel, l2norm=l2norm),
        (0, 1), [key_in, value_in, gate, gate, gate], (k, v, hi, lo, beta),
        out_shape=shapes,
        out_specs=out_specs,
        compiler_params=_params(num_warps=warps),
        cost_estimate=cost.estimate(functools.partial(_prep_body, nb=nb), keys_z, values_z,
                                    row, row, row, inputs=(k, v, hi, lo, beta),
                                    outputs=shapes),
        name="gated_delta_rule_prep",
    )
    return big_u, w, (inv[0] if inv else None)


# ------------------------------------------------------------------------ state pass


# Two forms of the state passes, timed against each other by
# tools/sweeps/gated_delta_stages.py. STATE_IO_IN_BRANCHES: a packed run's initial state
# loaded and final state stored under a branch (the padding chunks' run does neither),
# not by a masked [K, block_v] load and store (the reverse pass follows the same flag).
# While that IO sat inside the chunk loop, at every chunk, the branches took the state
# pass from 1.35 to 1.14 ms and the reverse pass from 2.15 to 1.73 (an H200, 2026-12-06,
# B 1, T 32768, Hv 32, two pipeline stages); once per run it is not timed apart.
# DECAY_ON_VALUES: the decay to the chunk's end applied to u's [C, block_v] rather than
# to the keys' [C, K]. Slower at the same shape (1.52 ms then; 0.90 against 0.77 on an
# H100 with the IO outside the loop), although its loop is 416 instructions against 729
# (the keys go to the tensor cores straight from shared memory): it puts a multiply on
# the chunk-to-chunk dependency chain (u -> decayed u -> the state's product), where
# the keys' decay is off it.
STATE_IO_IN_BRANCHES = True
DECAY_ON_VALUES = False
# The forward state pass carrying the state's transpose [block_v, K] where block_v <= 32:
# u^T = U^T - S^T W^T and S'^T = exp(G_last) S^T + (exp(G_last - G) u)^T K take the carry
# (and u^T) as the products' A operands from registers, and Triton runs them as mma.sync
# (block_v rows are fewer than a warpgroup's 64). Carried as [K, block_v], the carry and
# u are written to shared memory every chunk as wgmma's B operands, each write followed
# by a proxy fence that (Nsight Compute, H100) waits for the loop's in-flight loads and
# stores: the fences and the warpgroup arrives behind them held 16% of the pass's stall
# samples, with the decay on the values 39%. Transposed, the loop has no fence (and the
# decay sits on the values). On an H100 (2026-12-06, Hv 32, K = V = 128, bf16): B 1, T
# 32768 0.727-0.750 ms against 0.776-0.789 at block_v 32 and 1.19 against 1.41 at 16;
# B 8, T 4096 0.787 against 0.802 at 32, 1.02 against 1.11 at 16; at 64 (wgmma, no
# fence, but 255 registers and spills) 1.06 against 1.01 and 0.634 against 0.634, so not
# there. The reverse pass transposed the same way spilled (94 stores) and took 2.88 ms
# against 1.36: it keeps its form.
STATE_TRANSPOSED = True
STATE_TRANSPOSED_MAX_BLOCK_V = 32
# Software-pipeline depth of the state passes' chunk loops (forward and reverse), the
# most pass_stages gives: at the same shape the masked state pass takes 2.34, 1.35, 1.00
# and 1.06 ms at 1 to 4 stages; with the branches, 0.90 ms at 3 and the reverse pass
# 1.42 (an H100, 2026-12-06).
STATE_PASS_STAGES = 3
# Packed sequences walked as one loop over the row with the states loaded and stored at
# each chunk (the tables' form before the runs), where they are short: fewer than
# SHORT_SEQUENCE_CHUNKS chunks each on average. Each run pays a pipeline fill and two
# conversions of the state (about 0.9 us on an H100) where the one loop pays about 0.125
# us a chunk for converting its state: at 512 sequences of one chunk the runs took 3.93
# ms against the loop's 3.47, at 16 of about 32 chunks 0.89 against 0.96 (B 1, T 32768,
# Hv 32, 2026-12-06), a crossover near 7. Timed again with SHORT_SEQUENCE_CHUNKS raised to
# take every packing (an H100, 2026-12-06): at one chunk per sequence the loop took 3.84 /
# 4.42 ms (state / reverse pass) against the runs' 3.88 / 4.89; at 16 sequences 1.16 /
# 1.49 against 0.88 / 1.39, which the threshold leaves to the runs.
SHORT_SEQUENCES_IN_ONE_LOOP = True
SHORT_SEQUENCE_CHUNKS = 7


def pass_runs(entering, leaving, num_sequences: int, packed: bool):
    """The state passes' runs (packing.sequence_runs) and the per-chunk tables their chunk
    loops read: () for runs that load and store states around their loops, (entering,
    leaving) where short packed sequences take one loop over the row instead
    (SHORT_SEQUENCES_IN_ONE_LOOP), the states loaded and stored inside it."""
    b, num_chunks = entering.shape
    if (packed and SHORT_SEQUENCES_IN_ONE_LOOP
            and num_chunks < SHORT_SEQUENCE_CHUNKS * num_sequences):
        whole_row = (jnp.zeros((b, 1), jnp.int32), jnp.full((b, 1), num_chunks, jnp.int32),
                     jnp.full((b, 1), -1, jnp.int32))
        return whole_row, (entering, leaving)
    return packing.sequence_runs(entering, leaving, num_sequences, packed), ()


def pass_stages(chunk: int, dk: int, bv: int, itemsize: int, key_operands: int) -> int:
    """The state passes' pipeline depth: STATE_PASS_STAGES, or fewer where the buffers
    would not fit the device's shared memory (platform.triton_shared_memory_budget).

    Each stage buffers one chunk's loads: `key_operands` [C, K] blocks (w and k forward;
    q, k and w in reverse), a [C, block_v] one and the fp32 decay pair. Triton holds
    about `stages` such buffers in 16-bit dtypes and one fewer (plus a [C, K + block_v]
    fp32 scratch) in fp32, and the reverse pass another [C, K + block_v] fp32 scratch.
    The model is an upper bound on all 102 (dtype, K, block_v, pass, stages) kernels
    compiled for sm_90 with triton 3.6 (tools/sweeps/triton_resources.py, 2026-12-06):
    at 3 stages the fp32 passes asked for up to 250 KB of the H100's 227 KiB."""
    stage = chunk * ((key_operands * dk + bv) * itemsize + 2 * 4)
    scratch = chunk * (dk + bv) * 4 if key_operands == 3 else chunk * bv * 2
    if itemsize >= 4:
        scratch += chunk * (dk + bv) * 4
    budget = platform.triton_shared_memory_budget()
    for stages in range(STATE_PASS_STAGES, 1, -1):
        held = stages if itemsize < 4 else stages - 1
        if held * stage + scratch <= budget:
            return stages
    return 1


def _state_kernel(w_ref, big_u_ref, k_ref, hi_ref, lo_ref, start_ref, count_ref, seq_ref,
                  *refs, l2norm: bool, packed: bool, per_chunk_io: bool, io_in_branches: bool,
                  decay_on_values: bool, transposed: bool, rows_in_place: bool,
                  residuals: bool = True, scale: float | None = None):
    """One (value column block, value head, row) walks its chunks in order, one run of
    chunks per sequence (packing.sequence_runs): the run's initial state is loaded before
    its chunk loop and its final state stored after it, so the loop carries the state in
    the tensor cores' layout alone (a state loaded inside the loop yields it in the load's
    layout, and Triton converts it through shared memory both ways every chunk).
    Unpacked, the row is one run over every chunk, a loop of static bounds. per_chunk_io
    (pass_runs): one run over the row, the per-chunk tables (refs' first two) saying
    where in the loop a sequence's initial state is loaded and its final state stored.
    transposed (STATE_TRANSPOSED): the runs' loops carry the state's transpose (per-chunk
    IO keeps the plain carry). rows_in_place: k (and q, o) are the packed row [T, D]
    itself, refs' first two packing.chunk_rows' tables. residuals: the entry states and u
    are stored (outputs before o and the finals). scale (FUSED_OUTPUT): the chunk's
    output o = scale (exp(G) Q S + (D o Q K^T) u) formed in the loop from the state and
    u it holds, q the ref after the tables, o the output before the finals."""
    refs = list(refs)
    take = lambda n: [refs.pop(0) for _ in range(n)]  # noqa: E731
    row_start_ref, row_count_ref = take(2) if rows_in_place else (None, None)
    enter_ref, leave_ref = take(2) if per_chunk_io else (None, None)
    with_output = scale is not None
    (q_ref,) = take(1) if with_output else (None,)
    (finals_ref,) = take(1)  # the finals' buffer, aliased to the last output
    states_ref, u_ref = take(2) if residuals else (None, None)
    (o_ref,) = take(1) if with_output else (None,)
    nc, chunk, dk = w_ref.shape
    bv = big_u_ref.shape[2]
    cd = w_ref.dtype

    def chunk_of(ref, c, span):
        """Chunk c of ref: its block of the layout (span None), or in place, at the rows
        the per-chunk tables give (span "tables": the one loop over a packed row) or, in
        a run's loop, span (first row, first chunk, end row): rows affine in c, so the
        loop's software pipeline prefetches them as it does the layout's. Read from the
        tables inside the loop, they were not prefetched (compiled for sm_90: 58 cp.async
        against 78), and that pass took 1.32 ms at 16 sequences in T 32768 (an H100,
        2026-12-06), where the laid-out one had taken 0.88-0.89 in an earlier run."""
        if not rows_in_place:
            return ref.at[c]
        if span == "tables":
            start, count = row_start_ref[c], row_count_ref[c]
        else:
            first_row, first_chunk, end_row = span
            start = first_row + (c - first_chunk) * chunk
            count = end_row - start
        return _PackedChunk(ref, start, count, chunk)

    def keys_of(c, span):
        return _normed(chunk_of(k_ref, c, span)[...], l2norm)

    def queries_of(c, span):  # in the compute dtype where not normalised (no fp32 copy)
        q = chunk_of(q_ref, c, span)[...]
        return _normed(q, l2norm).astype(cd) if l2norm else q

    def store_output(c, span, o):
        chunk_of(o_ref, c, span)[...] = o.astype(o_ref.dtype)

    def to_end(c, hi, lo):  # ([C] exp(G_last - G) of chunk c's steps, G_last's pair)
        hi_last, lo_last = hi_ref[c, chunk - 1], lo_ref[c, chunk - 1]
        return jnp.exp(_segment(hi_last, lo_last, hi, lo)), hi_last, lo_last

    def output(c, span, q, keys, hi, lo, state, u, transposed_):
        """Chunk c's o = scale (exp(G) Q S + P u) (P: _causal_scores), from the entry
        state and u (their transposes where transposed_: o^T = scale (S^T (exp(G) Q)^T
        + u^T P^T), the carries as the products' A operands)."""
        scores = _causal_scores(q, keys, hi, lo)
        grown = jnp.exp(hi + lo)  # exp(G_t) scales row t of Q S after the product
        if transposed_:
            o_t = (_dot(state.astype(cd), q, trans_b=True) * grown[None, :]
                   + _dot(u.astype(cd), scores, trans_b=True))
            store_output(c, span, (scale * o_t).T)
        else:
            store_output(c, span, scale * (_dot(q, state.astype(cd)) * grown[:, None]
                                           + _dot(scores, u.astype(cd))))

    def step(c, state, span):
        if per_chunk_io:
            state = _load_where(finals_ref, enter_ref[c], state, io_in_branches)
        if residuals:
            states_ref[c] = state.astype(states_ref.dtype)
        u = big_u_ref[c].astype(F32) - _dot(w_ref[c], state.astype(cd))
        if residuals:
            u_ref[c] = u.astype(cd)
        hi, lo = hi_ref[c], lo_ref[c]
        decay, hi_last, lo_last = to_end(c, hi, lo)
        decay = decay[:, None]
        keys = keys_of(c, span)
        if with_output:
            output(c, span, queries_of(c, span), keys.astype(cd),
                   hi, lo, state, u, False)
        if decay_on_values:
            keys, values = keys.astype(cd), (decay * u).astype(cd)
        else:
            keys, values = (keys * decay).astype(cd), u.astype(cd)
        state = jnp.exp(hi_last + lo_last) * state + _dot(keys, values, trans_a=True)
        if per_chunk_io:
            _store_where(finals_ref, leave_ref[c], state, io_in_branches)
        return state

    def step_transposed(c, state_t, span):
        if residuals:
            states_ref[c] = state_t.T.astype(states_ref.dtype)
        u_t = big_u_ref[c].astype(F32).T - _dot(state_t.astype(cd), w_ref[c], trans_b=True)
        if residuals:
            u_ref[c] = u_t.T.astype(cd)
        hi, lo = hi_ref[c], lo_ref[c]
        decay, hi_last, lo_last = to_end(c, hi, lo)
        values_t = (u_t * decay[None, :]).astype(cd)
        keys = keys_of(c, span).astype(cd)
        if with_output:
            output(c, span, queries_of(c, span), keys, hi, lo,
                   state_t, u_t, True)
        return jnp.exp(hi_last + lo_last) * state_t + _dot(values_t, keys)

    def loop(lo_, hi_, init, span=None):
        if transposed and not per_chunk_io:
            body = lambda c, s: step_transposed(c, s, span)  # noqa: E731
            return jax.lax.fori_loop(lo_, hi_, body, init.T).T
        return jax.lax.fori_loop(lo_, hi_, lambda c, s: step(c, s, span), init)

    if not packed:
        seq = seq_ref[0]
        finals_ref[_slot(seq)] = loop(0, nc, finals_ref[_slot(seq)].astype(F32))
        return

    def run(r, _):
        seq, start, count = seq_ref[r], start_ref[r], count_ref[r]
        span = None
        if rows_in_place and per_chunk_io:
            span = "tables"
        elif rows_in_place:  # the run's rows: from its first chunk's to its last's end
            first = jnp.minimum(start, nc - 1)
            last = jnp.clip(start + count - 1, 0, nc - 1)
            span = (row_start_ref[first], start, row_start_ref[last] + row_count_ref[last])
        init = _load_where(finals_ref, seq, jnp.zeros((dk, bv), F32), io_in_branches)
        final = loop(start, start + count, init, span)
        _store_where(finals_ref, seq, final, io_in_branches)

    jax.lax.fori_loop(0, seq_ref.shape[0], run, None)


def _state_body(w, big_u, k, hi, lo, state):
    """The state pass's arithmetic over every (row, chunk, head) (pl.estimate_cost): w,
    k [Z, C, K], big_u [Z, C, V], hi, lo [Z, C], state [Z, K, V]: u = U - W S, the decays
    to the chunk's end (segment, exp) and across it, and the new state."""
    u = big_u - jnp.einsum("zck,zkv->zcv", w, state)
    to_end = jnp.exp((hi[:, -1:] - hi) + (lo[:, -1:] - lo))
    keys = k * to_end[..., None]
    across = jnp.exp(hi[:, -1] + lo[:, -1])
    return across[:, None, None] * state + jnp.einsum("zck,zcv->zkv", keys, u)


def _state_output_body(w, big_u, k, hi, lo, state, q, *, columns):
    """The state pass with the output in its loop (FUSED_OUTPUT), for pl.estimate_cost:
    _state_body's arithmetic and _output_body's (big_u standing in for u)."""
    return _state_body(w, big_u, k, hi, lo, state), _output_body(q, k, hi, lo, state, big_u,
                                                                 columns=columns)


def _state_pass_cost(w, big_u, inputs, outputs, columns=None):
    """pl.CostEstimate of a forward state pass (either backend's) over W and U's chunks:
    _state_body's flops, with the output's (_state_output_body, at `columns` value
    blocks) where the pass forms o, and the bytes of `inputs` and `outputs`."""
    b, nc, chunk, hv, dk = w.shape
    dv = big_u.shape[4]
    z = b * nc * hv
    keys_z, row_z = cost.struct((z, chunk, dk), F32), cost.struct((z, chunk), F32)
    operands_z = [keys_z, cost.struct((z, chunk, dv), F32), keys_z, row_z, row_z,
                  cost.struct((z, dk, dv), F32)]
    body = _state_body
    if columns is not None:
        body = functools.partial(_state_output_body, columns=columns)
        operands_z.append(keys_z)
    return cost.estimate(body, *operands_z, inputs=inputs, outputs=outputs)


def _state_pass(w, big_u, k, hi, lo, entering, leaving, init, bs: BlockSizes, l2norm,
                interpret, *, packed: bool, rows=None, residuals: bool = True, output=None):
    """(states [B, NC, Hv, K, V] entering each chunk in the compute dtype, u [B, NC, C,
    Hv, V] in the compute dtype, finals [N, Hv, K, V] fp32), states and u None where
    not `residuals`. packed: the chunk tables come from cu_seqlens (else each row is one
    sequence); packing.sequence_runs turns them into the kernel's runs. k is in the chunk
    layout, or with `rows` (packing.chunk_rows' tables) the packed row [1, T, Hk, K]
    itself, read in place. output (FUSED_OUTPUT): (q, scale, dtype), q as k is given,
    and the pass returns o as well, as _output does (a fourth item)."""
    b, nc, chunk, hv, dk = w.shape
    hk = k.shape[-2]
    dv = big_u.shape[4]
    per_key_head = hv // hk
    bv = bs.block_v
    cd = w.dtype
    n = init.shape[0]
    runs, tables = pass_runs(entering, leaving, n, packed)
    rows = tuple(rows or ())
    shapes = []
    if residuals:
        shapes += [sharding.out_struct((b, nc, hv, dk, dv), cd, like=big_u),
                   sharding.out_struct(big_u.shape, cd, like=big_u)]
    if output is not None:
        q, scale, out_dtype = output
        o_shape = (b, q.shape[1], hv, dv) if rows else big_u.shape
        shapes.append(sharding.out_struct(o_shape, out_dtype, like=big_u))
    shapes.append(sharding.out_struct(init.shape, F32, like=init))
    inputs = (w, big_u, k, hi, lo, *runs, *rows, *tables, init)
    if output is not None:
        inputs += (q,)
    estimate = _state_pass_cost(w, big_u, inputs, tuple(shapes),
                                columns=None if output is None else dv // bv)
    keys = pl.BlockSpec((None, nc, chunk, None, dk),
                        lambda vb, h, i: (i, 0, 0, h // per_key_head, 0))
    columns = pl.BlockSpec((None, nc, chunk, None, bv), lambda vb, h, i: (i, 0, 0, h, vb))
    o_spec = columns
    if rows:
        keys = pl.BlockSpec((None, k.shape[1], None, dk),
                            lambda vb, h, i: (i, 0, h // per_key_head, 0))
        o_spec = pl.BlockSpec((None, k.shape[1], None, bv), lambda vb, h, i: (i, 0, h, vb))
    per_head = pl.BlockSpec((None, nc, chunk, None), lambda vb, h, i: (i, 0, 0, h))
    table = pl.BlockSpec((None, runs[0].shape[1]), lambda vb, h, i: (i, 0))
    per_chunk = pl.BlockSpec((None, nc), lambda vb, h, i: (i, 0))
    finals = pl.BlockSpec((n, None, dk, bv), lambda vb, h, i: (0, h, 0, vb))
    in_specs = [pl.BlockSpec((None, nc, chunk, None, dk), lambda vb, h, i: (i, 0, 0, h, 0)),
                columns, keys, per_head, per_head, table, table, table,
                *[per_chunk] * (len(rows) + len(tables))]
    out_specs = []
    if residuals:
        out_specs += [pl.BlockSpec((None, nc, None, dk, bv), lambda vb, h, i: (i, 0, h, 0, vb)),
                      columns]
    args = [w, big_u, k, hi, lo, *runs, *rows, *tables]
    if output is not None:
        in_specs.append(keys)
        out_specs.append(o_spec)
        args.append(q)
    in_specs.append(finals)
    out_specs.append(finals)
    args.append(init)
    outs = pl.pallas_call(
        functools.partial(_state_kernel, l2norm=l2norm, packed=packed,
                          per_chunk_io=bool(tables),
                          io_in_branches=STATE_IO_IN_BRANCHES,
                          decay_on_values=DECAY_ON_VALUES,
                          transposed=STATE_TRANSPOSED and bv <= STATE_TRANSPOSED_MAX_BLOCK_V,
                          rows_in_place=bool(rows), residuals=residuals,
                          scale=None if output is None else float(scale)),
        out_shape=tuple(shapes),
        grid=(dv // bv, hv, b),
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases={len(args) - 1: len(shapes) - 1},
        compiler_params=_params(
            num_warps=4 if output is None else STATE_OUTPUT_WARPS,
            num_stages=pass_stages(chunk, dk, bv, max(w.dtype.itemsize, k.dtype.itemsize),
                                   key_operands=2 if output is None else 3)),
        interpret=interpret,
        cost_estimate=estimate,
        name="gated_delta_rule_state_pass" if output is None
        else "gated_delta_rule_state_output_pass",
    )(*args)
    states, u = outs[:2] if residuals else (None, None)
    if output is None:
        return states, u, outs[-1]
    return states, u, outs[-1], outs[-2]


# ---------------------------------------------------------------------------- output


def _causal_scores(q, keys, hi, lo):
    """P = D o Q K^T [C, C] in the keys' (compute) dtype, D the masked decay exp(G_t -
    G_j) for t >= j: the output's in-chunk weights of u. q [C, K] (fp32 or the compute
    dtype), keys [C, K]."""
    chunk = q.shape[0]
    causal = _iota(chunk, chunk, 0) >= _iota(chunk, chunk, 1)
    qk = _dot(q.astype(keys.dtype), keys, trans_b=True) * _masked_decay(hi, lo, hi, lo, causal)
    return jnp.where(causal, qk, 0.0).astype(keys.dtype)


def _output_kernel(q_ref, k_ref, hi_ref, lo_ref, s_ref, u_ref, o_ref, *, scale: float,
                   l2norm: bool):
    """o for one (value column block, value head, chunk, row)."""
    cd = u_ref.dtype
    hi, lo = hi_ref[...], lo_ref[...]
    q = _normed(q_ref[...], l2norm)
    keys = _normed(k_ref[...], l2norm).astype(cd)
    o = _dot((q * jnp.exp(hi + lo)[:, None]).astype(cd), s_ref[...])
    o = o + _dot(_causal_scores(q, keys, hi, lo), u_ref[...])
    o_ref[...] = (scale * o).astype(o_ref.dtype)


def _output_body(q, k, hi, lo, state, u, *, columns):
    """The output kernel's arithmetic over every (row, chunk, head) (pl.estimate_cost):
    q, k [Z, C, K], hi, lo [Z, C], state [Z, K, V], u [Z, C, V]; Q K^T and its masked
    decay are formed once per block of value columns (`columns` blocks)."""
    z, chunk, _ = q.shape
    eq = q * jnp.exp(hi + lo)[..., None]
    o = jnp.einsum("zck,zkv->zcv", eq, state)
    rep = lambda t: jnp.broadcast_to(t[:, None], (z, columns) + t.shape[1:])  # noqa: E731
    hi_r, lo_r = rep(hi), rep(lo)
    seg = (hi_r[..., :, None] - hi_r[..., None, :]) + (lo_r[..., :, None] - lo_r[..., None, :])
    p = jnp.einsum("zbck,zbjk->zbcj", rep(q), rep(k)) * jnp.exp(seg)
    inner = jnp.einsum("zcj,zjv->zcv", p[:, 0], u)
    return 2.0 * (o + inner)


def _output(q, k, hi, lo, states, u, dtype, scale, bs: BlockSizes, l2norm, interpret,
            rows=None):
    """o [B, NC, C, Hv, V] in the chunk layout; with `rows` (packing.chunk_rows' tables)
    q and k are the packed rows [1, T, Hk, K] themselves, read in place, and o [1, T, Hv,
    V] is written in place, each step by the chunk that holds it."""
    b, nc, chunk, _ = hi.shape
    hk, dk = q.shape[-2:]
    hv, dv = u.shape[3:]
    per_key_head = hv // hk
    bv = bs.output_block_v
    shape = sharding.out_struct(u.shape, dtype, like=u)
    if rows is not None:
        shape = sharding.out_struct((b, q.shape[1], hv, dv), dtype, like=u)
    z = b * nc * hv
    estimate = cost.estimate(
        functools.partial(_output_body, columns=dv // bv), cost.struct((z, chunk, dk), F32),
        cost.struct((z, chunk, dk), F32), cost.struct((z, chunk), F32),
        cost.struct((z, chunk), F32), cost.struct((z, dk, dv), F32),
        cost.struct((z, chunk, dv), F32),
        inputs=(q, k, hi, lo, states, u), outputs=(shape,))
    key = pl.BlockSpec((None, None, chunk, None, dk),
                       lambda vb, h, c, i: (i, c, 0, h // per_key_head, 0))
    gate = pl.BlockSpec((None, None, chunk, None), lambda vb, h, c, i: (i, c, 0, h))
    columns = pl.BlockSpec((None, None, chunk, None, bv), lambda vb, h, c, i: (i, c, 0, h, vb))
    kernel = functools.partial(_output_kernel, scale=float(scale), l2norm=l2norm)
    in_specs = [key, key, gate, gate,
                pl.BlockSpec((None, None, None, dk, bv), lambda vb, h, c, i: (i, c, h, 0, vb)),
                columns]
    out_spec, args = columns, (q, k, hi, lo, states, u)
    if rows is not None:
        length = q.shape[1]
        key = pl.BlockSpec((None, length, None, dk),
                           lambda vb, h, c, i: (i, 0, h // per_key_head, 0))
        out_spec = pl.BlockSpec((None, length, None, bv), lambda vb, h, c, i: (i, 0, h, vb))
        table = pl.BlockSpec((None, nc), lambda vb, h, c, i: (i, 0))
        kernel = _in_packed_rows(kernel, 2, chunk, (0, 1, 6))  # q, k, o
        in_specs = [table, table, key, key] + in_specs[2:]
        args = tuple(rows) + args
    return pl.pallas_call(
        kernel,
        out_shape=shape,
        grid=(dv // bv, hv, nc, b),
        in_specs=in_specs,
        out_specs=out_spec,
        compiler_params=_params(num_warps=4, num_stages=1),
        interpret=interpret,
        cost_estimate=estimate,
        name="gated_delta_rule_output",
    )(*args)


# --------------------------------------------------------------------------- forward


# Packed sequences' q, k and v read by the forward's kernels where they lie in the row,
# and o written there (packing.chunk_rows: each chunk's first row and step count, the
# rest masked), rather than gathered into the chunk layout and o gathered back. The
# small g and beta are still laid out (G's in-chunk sums run there). The backward's
# kernels read the layout, so a forward that keeps residuals lays q, k and v out. On an
# H100 (2026-12-06, B 1, T 32768, Hv 32, K = V = 128, bf16) the forward took 3.29 ms
# against the gathers' 3.42 with 16 sequences and 7.47 against 8.44 with 512 of one
# chunk each; those runs' state pass read the keys from the tables inside its loop,
# unpipelined (keys_of in _state_kernel has the fix, not timed yet).
PACKED_ROWS_IN_PLACE = True
# The output formed inside the state pass's chunk loop (one kernel, "state_output_pass"),
# from the entry state and u it holds, rather than by the output kernel from the states
# and u the pass stores: a forward without residuals then writes neither (at B 1, T 32768,
# Hv 32, K = V = 128, bf16: 0.54 GB of states and 0.27 GB of u written and read back)
# and launches one kernel fewer; with residuals it still stores them for the backward.
# The loop does more per chunk (Q K^T, with one copy per block of value columns, and two
# more products) off the chain the state carries from chunk to chunk. Slower on an H200
# (2026-12-06, bf16, K = V = 128; forward / forward+backward, ms): at B 1, T 32768, Hv 32
# (block_v 32, transposed carry) 3.08 / 10.64 against the two kernels' 2.35 / 9.05; at
# B 8, T 4096 (block_v 64) 2.06 / 8.88 against 2.15 / 8.47. Its warps (8: fewer spills,
# 20 against 139 for sm_90, but slower still) are STATE_OUTPUT_WARPS.
FUSED_OUTPUT = False
STATE_OUTPUT_WARPS = 4


def part_transition(w, k, hi, lo, entering, leaving, block_v: int, l2norm, interpret):
    """M [B, Hv, K, K] fp32: the linear map a part of a sequence split over devices
    applies to its entering state (S_out = M S_in + F): the state pass with U = 0 (so u
    = -W S) from the identity, over K value columns (context_parallel.py)."""
    b, _, _, hv, dk = w.shape
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=F32), (b, hv, dk, dk))
    bs = BlockSizes(block_v=min(block_v, dk))
    return _state_pass(w, jnp.zeros(w.shape, w.dtype), k, hi, lo, entering, leaving, eye,
                       bs, l2norm, interpret, packed=False, residuals=False)[2]


# The forward's state pass on Mosaic GPU (pallas_mosaic_gpu.py: TMA-pipelined chunk loads,
# the state carried in wgmma registers) where it takes the problem and the device is
# Hopper (or the interpreter runs): unpacked rows, keys not normalised in the kernels,
# bf16 or fp16, chunk 64, K 64 or 128. Off until timed against the Triton pass.
MOSAIC_GPU_STATE_PASS = False


def _mosaic_gpu_state_pass(chunk, dk, block_v, dtype, packed, l2norm, interpret) -> bool:
    """Whether the forward's state pass runs on Mosaic GPU (MOSAIC_GPU_STATE_PASS)."""
    return (MOSAIC_GPU_STATE_PASS and (bool(interpret) or platform.mosaic_gpu_runs())
            and pallas_mosaic_gpu.reason(chunk=chunk, dk=dk, block_v=block_v, dtype=dtype,
                                         packed=packed, l2norm=l2norm) is None)


def _entering_state(w, big_u, k, hi, lo, entering, leaving, init, bs, l2norm, interpret,
                    sequence_axes):
    """(this part's entering state, the whole sequence's final state) [B, Hv, K, V] fp32,
    for a part of a sequence split over `sequence_axes` (context_parallel.py): its final
    state from zero (F) and its transition (M) by the state pass, then one exchange."""
    from_zero = _state_pass(w, big_u, k, hi, lo, entering, leaving, jnp.zeros_like(init),
                            bs, l2norm, interpret, packed=False, residuals=False)[2]
    transition = part_transition(w, k, hi, lo, entering, leaving, bs.block_v, l2norm,
                                 interpret)
    return context_parallel.entering_states(transition, from_zero, init, sequence_axes)


def _kernels(q, k, v, g, beta, init, cu_seqlens, *, scale, chunk_size, l2norm, interpret,
             block_sizes, residuals=False, sequence_axes=()):
    """(o [B, T, Hv, V] in v's dtype, finals [N, Hv, K, V] fp32) through the kernels; with
    `residuals`, also the backward's (a dict: the layout's inputs, T, W, states, u, the
    chunk tables and the layout's positions). sequence_axes: T is one part of the rows'
    sequence, split over these axes in whole chunks (no cu_seqlens; the passes of a
    sequence laid out over Auto axes, layouts.pass_planners): the part runs from the
    entering state the exchange gives it, and finals are the whole sequence's."""
    b, length, hv, dv = v.shape
    hk, dk = q.shape[2:]
    cd = jnp.result_type(q.dtype, k.dtype, v.dtype)
    q, k, v = (t.astype(cd) for t in (q, k, v))
    g, beta = g.astype(F32), beta.astype(F32)
    # Packed q, k and v read where they lie where no residual needs them laid out.
    in_place = cu_seqlens is not None and PACKED_ROWS_IN_PLACE and not residuals
    laid_out = (g, beta) if in_place else (q, k, v, g, beta)
    laid_out, padded, positions, first, counts = packing.lay_out(
        laid_out, cu_seqlens, length, chunk_size)
    nc = padded // chunk_size
    entering, leaving = packing.chunk_tables(b, nc, first, counts)
    split = lambda t: t.reshape(b, nc, chunk_size, *t.shape[2:])  # noqa: E731
    rows = None
    if in_place:
        g, beta = (split(t) for t in laid_out)
        rows = packing.chunk_rows(cu_seqlens, first, counts, nc, chunk_size)
    else:
        q, k, v, g, beta = (split(t) for t in laid_out)
    hi, lo = decay.cumsum_pair(g, axis=2)
    bs = _resolve(block_sizes, batch=b, length=length, hv=hv, dk=dk, dv=dv, chunk=chunk_size,
                  dtype=cd)
    big_u, w, inv = _prep(k, v, hi, lo, beta, hv, cd, l2norm, interpret,
                          store_inverse=residuals, rows=rows)
    init = init.astype(F32)
    whole_final = None
    if sequence_axes:
        init, whole_final = _entering_state(w, big_u, k, hi, lo, entering, leaving, init,
                                            bs, l2norm, interpret, sequence_axes)
    packed = cu_seqlens is not None
    if FUSED_OUTPUT:
        states, u, finals, o = _state_pass(
            w, big_u, k, hi, lo, entering, leaving, init, bs, l2norm, interpret,
            packed=packed, rows=rows, residuals=residuals, output=(q, scale, v.dtype))
    else:
        if _mosaic_gpu_state_pass(chunk_size, dk, bs.block_v, cd, packed, l2norm, interpret):
            states, u, finals = pallas_mosaic_gpu.state_pass(
                w, big_u, k, hi, lo, init, bs.block_v, interpret=bool(interpret),
                cost_estimate=functools.partial(_state_pass_cost, w, big_u))
        else:
            states, u, finals = _state_pass(w, big_u, k, hi, lo, entering, leaving, init, bs,
                                            l2norm, interpret, packed=packed, rows=rows)
        o = _output(q, k, hi, lo, states, u, v.dtype, scale, bs, l2norm, interpret,
                    rows=rows)
    if sequence_axes:
        finals = whole_final
    if not in_place:
        o = packing.steps_of(o.reshape(b, padded, hv, dv), length, positions)
    if not residuals:
        return o, finals
    saved = dict(q=q, k=k, v=v, hi=hi, lo=lo, beta=beta, inv=inv, w=w, states=states, u=u,
                 entering=entering, leaving=leaving, positions=positions)
    return o, finals, saved


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    chunk_size: int
    l2norm: bool
    interpret: bool
    block_sizes: tuple  # sorted (key, value) pairs of the block-size dict


def _config_kwargs(config: _Config) -> dict:
    return dict(scale=config.scale, chunk_size=config.chunk_size, l2norm=config.l2norm,
                interpret=config.interpret, block_sizes=dict(config.block_sizes))


# Each pass runs through sharding.run (layouts.pass_planners): under Auto axes a
# custom_partitioning keeps the operands' rows and heads local, and T where the compiler
# split it in whole chunks of unpacked rows (the pass then takes sequence_axes);
# elsewhere the arrays are local already and it is a plain call.
def _passes(config: _Config, *, batch_size, length, key_heads, value_heads, packed: bool,
            residuals: bool = True):
    """(residual names, (forward, backward) planners, their rules, sharding.run's
    options) for these shapes; the forward returns the residuals when `residuals`."""
    from pallasite.kernels.gated_delta import layouts, pallas_triton_bwd  # they import this

    names = layouts.residual_names(packed)
    kwargs = _config_kwargs(config)

    def forward(q, k, v, g, beta, init, *cu, sequence_axes=()):
        out = _kernels(q, k, v, g, beta, init, cu[0] if cu else None, residuals=residuals,
                       sequence_axes=sequence_axes, **kwargs)
        return out[:2] + (tuple(out[2][n] for n in names) if residuals else ())

    def backward(*operands, sequence_axes=()):
        saved, (do, dfinal) = dict(zip(names, operands)), operands[len(names):]
        bs = _resolve(dict(config.block_sizes), batch=do.shape[0], length=do.shape[1],
                      hv=do.shape[2], dk=saved["q"].shape[4], dv=do.shape[3],
                      chunk=config.chunk_size, dtype=saved["w"].dtype)
        return pallas_triton_bwd.backward(
            saved, do, dfinal, scale=config.scale, length=do.shape[1], l2norm=config.l2norm,
            block_v=bs.block_v, grads_block_v=bs.grads_block_v, interpret=config.interpret,
            sequence_axes=sequence_axes)

    planners = layouts.pass_planners(forward, backward, batch_size=batch_size,
                                     key_heads=key_heads, value_heads=value_heads,
                                     packed=packed, residuals=residuals, length=length,
                                     chunk=config.chunk_size)
    chunk = config.chunk_size
    *rules, sizes = layouts.pass_rules(
        packed, residuals, (length // chunk, chunk) if length % chunk == 0 else None)
    # The Mosaic GPU interpreter (MOSAIC_GPU_STATE_PASS) cannot lower inside a
    # custom_partitioning; compiled, both backends can.
    backend = "pallas_mosaic_gpu" if MOSAIC_GPU_STATE_PASS else "pallas_triton"
    options = dict(sharding.backend_options(backend, config.interpret), factor_sizes=sizes)
    return names, planners, tuple(rules), options


def _forward_pass(config, q, k, v, g, beta, init, cu_seqlens, residuals: bool):
    """(o, finals[, residuals dict]) of the kernels, over sharding.run."""
    packed = cu_seqlens is not None
    names, (plan, _), (rule, _), options = _passes(
        config, batch_size=q.shape[0], length=q.shape[1], key_heads=q.shape[2],
        value_heads=v.shape[2], packed=packed, residuals=residuals)
    args = (q, k, v, g, beta, init) + ((cu_seqlens,) if packed else ())
    o, finals, *saved = sharding.run(plan, args, rule=rule, **options)
    return (o, finals) + ((dict(zip(names, saved)),) if residuals else ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _chunked(q, k, v, g, beta, init, cu_seqlens, config: _Config):
    return _forward_pass(config, q, k, v, g, beta, init, cu_seqlens, residuals=False)


def _chunked_fwd(q, k, v, g, beta, init, cu_seqlens, config):
    o, finals, saved = _forward_pass(config, q, k, v, g, beta, init, cu_seqlens,
                                     residuals=True)
    # The inputs' dtypes, for the gradients, as zero scalars (residuals are arrays).
    dtypes = tuple(jnp.zeros((), t.dtype) for t in (q, k, v, g, beta, init))
    return (o, finals), (saved, dtypes)


def _chunked_bwd(config, residuals, cotangents):
    """The backward kernels (pallas_triton_bwd.py) on the forward's residuals."""
    saved, dtypes = residuals
    do, dfinal = cotangents
    (b, _, _, hk, _), hv = saved["q"].shape, saved["v"].shape[3]
    names, (_, plan), (_, rule), options = _passes(
        config, batch_size=b, length=do.shape[1], key_heads=hk, value_heads=hv,
        packed="positions" in saved)
    args = tuple(saved[n] for n in names) + (do, dfinal.astype(F32))
    grads = sharding.run(plan, args, rule=rule, **options)
    return tuple(gr.astype(d.dtype) for gr, d in zip(grads, dtypes)) + (None,)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def forward(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, chunk_size: int,
            use_qk_l2norm_in_kernel: bool, interpret: bool = False, block_sizes=None):
    """xla.forward's contract (o [B, T, Hv, V] in v's dtype, final states [N, Hv, K, V]
    fp32; inputs validated, initial_state given) through the kernels, differentiable in
    q, k, v, g, beta and initial_state. block_sizes: None or a dict (BlockSizes' fields)."""
    config = _Config(float(scale), int(chunk_size), bool(use_qk_l2norm_in_kernel),
                     bool(interpret), tuple(sorted((block_sizes or {}).items())))
    return _chunked(q, k, v, g, beta, initial_state, cu_seqlens, config)
