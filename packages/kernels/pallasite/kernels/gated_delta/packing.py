"""The chunk-aligned layout of packed sequences, shared by the chunked forms.

With cu_seqlens, N sequences packed into one row of T steps are laid out so that each
starts on a chunk of its own: sequence s's steps go to positions first[s] * C + (0, 1,
...), zeros between. The padded length is a static bound (T + N (C - 1) rounded up to
the chunk), so cu_seqlens may be traced. Zero steps (k = v = q = 0, g = 0, beta = 0) keep
the state and write nothing, so a chunk past a sequence's end, or past the last one,
changes nothing. Per chunk, `chunk_owners` says whose initial state it enters with and
whose final state it leaves with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def packed_positions(cu_seqlens, length: int, chunk: int):
    """(positions [T] of each step in the chunk-aligned layout, padded length, the first
    chunk of each sequence [N], its chunk count [N])."""
    ends = cu_seqlens.astype(jnp.int32)
    lengths = ends[1:] - ends[:-1]
    counts = (lengths + chunk - 1) // chunk
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts)[:-1]])
    steps = jnp.arange(length, dtype=jnp.int32)
    seq = sorted_index(ends[1:], steps, "right")
    seq = jnp.clip(seq, 0, lengths.shape[0] - 1)
    positions = first[seq] * chunk + steps - ends[seq]
    n = lengths.shape[0]
    padded = -(-(length + n * (chunk - 1)) // chunk) * chunk
    return positions, padded, first, counts


def lay_out(arrays, cu_seqlens, length: int, chunk: int):
    """[B, T, ...] arrays in the chunk layout: padded to whole chunks, or with cu_seqlens
    each sequence from a chunk of its own. (arrays, padded length, positions, first,
    counts); the last three are None without cu_seqlens."""
    if cu_seqlens is None:
        padded = -(-length // chunk) * chunk
        positions = first = counts = None
    else:
        positions, padded, first, counts = packed_positions(cu_seqlens, length, chunk)
    arrays = tuple(in_layout(t, length, padded, positions) for t in arrays)
    return arrays, padded, positions, first, counts


def in_layout(t, length: int, padded: int, positions):
    """One [B, T, ...] array in the layout `lay_out` chose (positions None: padded)."""
    if positions is None:
        return jnp.pad(t, [(0, 0), (0, padded - length)] + [(0, 0)] * (t.ndim - 2))
    return to_layout(t, positions, padded)


def steps_of(t, length: int, positions):
    """[B, padded, ...] in the chunk layout -> [B, T, ...]: the steps back in order
    (in_layout's inverse)."""
    return t[:, :length] if positions is None else t[:, positions]


def to_layout(t, positions, padded: int):
    """[1, T, ...] -> [1, padded, ...]: each step at its position, zeros between."""
    return permute_rows(t, sources(positions, padded), positions)


def sources(positions, padded: int):
    """[padded] int32: the step at each position of the chunk layout, -1 at padding (the
    inverse of `positions`, found by searching them: they rise with the step)."""
    if positions.shape[0] == 0:
        return jnp.full((padded,), -1, jnp.int32)
    at = jnp.arange(padded, dtype=jnp.int32)
    step = sorted_index(positions, at, "left")
    hit = positions[jnp.minimum(step, positions.shape[0] - 1)] == at
    return jnp.where(hit, step, -1)


def sorted_index(rising, values, side: str):
    """jnp.searchsorted as int32, its binary search unrolled into one XLA computation: the
    default form is a loop whose steps the host issues one by one (the grouped
    projection's tile table was host-bound on it, docs/performance.md)."""
    return jnp.searchsorted(rising, values, side=side, method="scan_unrolled").astype(
        jnp.int32)


def _take_rows(t, index):
    """t[:, index] along axis 1, zero rows where index is -1 (all of them where t has no
    rows: a packed row of length 0)."""
    if t.shape[1] == 0:
        return jnp.zeros(t.shape[:1] + index.shape + t.shape[2:], t.dtype)
    rows = jnp.take(t, jnp.maximum(index, 0), axis=1, mode="clip")
    keep = (index >= 0).reshape((1, -1) + (1,) * (t.ndim - 2))
    return jnp.where(keep, rows, jnp.zeros((), t.dtype))


@jax.custom_vjp
def permute_rows(t, index, inverse):
    """t[:, index] (zero rows where index is -1), where `index` maps the output's rows one
    to one onto all of t's rows and `inverse` is its inverse (inverse[index[p]] = p):
    the steps into the chunk layout as a gather, and its cotangent gathered back through
    `inverse`. The indexed update it replaces (and autodiff's transpose of a gather) is
    a scatter, which XLA ran at a fraction of its gathers' bandwidth: with 16 packed
    sequences (H100, 2026-12-06, B 1, T 32768, Hv 32) the forward took 5.75 ms against
    2.43 unpacked. (steps_of stays a plain gather: the Pallas backward gathers its
    cotangents itself, and a custom VJP there keeps an unused output's kernel alive.)"""
    return _take_rows(t, index)


def _permute_rows_fwd(t, index, inverse):
    return _take_rows(t, index), inverse


def _permute_rows_bwd(inverse, cotangent):
    return _take_rows(cotangent, inverse), None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def chunk_rows(cu_seqlens, first, counts, num_chunks: int, chunk: int):
    """(start, count) [1, num_chunks] int32: where each chunk of the layout lies in the
    packed row itself (start: its first step's row) and how many of its C steps are its
    sequence's (the rest are the layout's zero steps; 0 for the chunks past the last
    sequence). Kernels that read q, k and v where they lie, and write o there, take
    these rather than the layout's copies (pallas_triton.PACKED_ROWS_IN_PLACE)."""
    ends = cu_seqlens.astype(jnp.int32)
    lengths = ends[1:] - ends[:-1]
    chunks = jnp.arange(num_chunks, dtype=jnp.int32)
    seq = sorted_index(first + counts, chunks, "right")
    owned = seq < lengths.shape[0]
    seq = jnp.minimum(seq, lengths.shape[0] - 1)
    into = (chunks - first[seq]) * chunk  # steps of the sequence before this chunk
    start = jnp.where(owned, ends[seq] + into, 0)
    count = jnp.where(owned, jnp.clip(lengths[seq] - into, 0, chunk), 0)
    return start[None], count[None]


def chunk_tables(batch: int, num_chunks: int, first, counts):
    """(entering, leaving) [batch, num_chunks] int32 for the kernels: the sequence whose
    initial state a chunk enters with and whose final state its exit is, else -1. Without
    packing (first None) each row is one sequence, its first and last chunk; with it
    (batch 1), chunk_owners'."""
    if first is None:
        chunks = jnp.arange(num_chunks, dtype=jnp.int32)[None, :]
        rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
        return jnp.where(chunks == 0, rows, -1), jnp.where(chunks == num_chunks - 1, rows, -1)
    return tuple(t[None] for t in chunk_owners(first, counts, num_chunks))


def chunk_owners(first, counts, num_chunks: int):
    """(entering, leaving) [num_chunks] int32: the sequence whose first chunk (it enters
    with that sequence's initial state) or last chunk (its exit is that sequence's final
    state) each chunk is, else -1. Empty sequences own no chunk."""
    chunks = jnp.arange(num_chunks, dtype=jnp.int32)

    def owner(chunk_of_seq):
        hit = (chunks[:, None] == chunk_of_seq[None, :]) & (counts[None, :] > 0)
        return jnp.where(hit.any(1), jnp.argmax(hit, axis=1), -1).astype(jnp.int32)

    return owner(first), owner(first + counts - 1)


def sequence_runs(entering, leaving, num_sequences: int, packed: bool):
    """(start, count, sequence) [B, S] int32 from chunk_tables' (entering, leaving): the
    runs of chunks the Pallas Triton state passes walk, each from one sequence's initial
    state, loaded before its chunk loop, to its final state, stored after it (sequence -1:
    from zero, nothing loaded or stored). Unpacked, S = 1: each row is the sequence
    `entering[:, 0]`, chunk 0 to its last. Packed (B = 1, the layout packed_positions
    gives: sequence s owns the consecutive chunks first[s] .. first[s] + counts[s] - 1,
    in order, from chunk 0), S = N + 1: sequence s over its chunks (count 0 where it owns
    none: its final state is its initial state), then the chunks after the last sequence
    (zero steps) from zero."""
    b, num_chunks = entering.shape
    if not packed:
        return (jnp.zeros((b, 1), jnp.int32), jnp.full((b, 1), num_chunks, jnp.int32),
                entering[:, :1].astype(jnp.int32))
    rows = jnp.arange(b)[:, None]
    chunks = jnp.broadcast_to(jnp.arange(num_chunks, dtype=jnp.int32), (b, num_chunks))

    def chunk_of(table):  # [B, N]: the chunk where the table names each sequence, else -1
        named = jnp.where(table >= 0, table, num_sequences)  # -1 entries: dropped
        return jnp.full((b, num_sequences), -1, jnp.int32).at[rows, named].set(
            chunks, mode="drop")

    first, last = chunk_of(entering), chunk_of(leaving)
    owns = first >= 0
    start = jnp.where(owns, first, 0)
    count = jnp.where(owns, last + 1 - first, 0)
    end = jnp.max(jnp.where(owns, start + count, 0), axis=1, keepdims=True)
    seqs = jnp.arange(num_sequences, dtype=jnp.int32)
    return (jnp.concatenate([start, end], axis=1),
            jnp.concatenate([count, num_chunks - end], axis=1),
            jnp.concatenate([jnp.where(owns, seqs[None, :], -1),
                             jnp.full((b, 1), -1, jnp.int32)], axis=1))
