"""mamba_chunk_scan's fused forward: dt, D and z inside the Pallas Triton SSD kernels.

    y = (scan(x dt, a, B, C) + D x) silu(z)     ssd.pallas_triton.forward_fused: dt
    scales the output tile's columns (or joins the decay's exponent, dt >= 0) and the
    state scan's per-step weight, D and z are the output kernel's epilogue, so neither
    x dt nor the scan's own y is written.

dt arrives processed (bias, softplus, clamp) and a = A dt with the sequence resets in
it. Under a jit's mesh the forward runs through its planner
(ssd.layouts.fused_forward_planner: batch, heads and chunks split as the scan's). A
sequence split over devices (a jit's axes in runs of whole chunks, or a caller's
shard_map naming sequence_axes) takes chunk_ssd's exchange: each part's final state
from a zero state (of x dt), one all-gather of state-sized arrays, then each part's
fused forward from its entering state (ssd.context_parallel).

This forward is not differentiated. A differentiated call takes the composition's
forward and backward instead (mamba_scan.api, autodiff.values_from): on the H200 the
composition's forward+backward ran 8-10% faster than this forward with a backward of its
own (2026-12-04, docs/performance.md), and this forward is level with the composition's.
"""

from __future__ import annotations

import functools

from pallasite.kernels import autodiff, sharding
from pallasite.kernels.ssd import api as ssd_api
from pallasite.kernels.ssd import context_parallel, layouts

NAME = "pallas_triton"


def eligible(implementation, chunk_size, operands, block_sizes) -> bool:
    """Whether the fused route runs this call: Triton first among the implementations and
    able to run this geometry here, first-order differentiation at most, block sizes (if
    any) Triton's. Every layout is served: batch and heads where they lie, a sequence
    split over devices through the entering-state exchange (as chunk_ssd's)."""
    operands = tuple(t for t in operands if t is not None)
    x, b = operands[0], operands[3]
    names = ssd_api._candidates(implementation, chunk_size, x.shape[3], b.shape[3])
    if names[0] != NAME or x.size == 0 or b.size == 0:
        return False
    if block_sizes is not None and ssd_api._blocks_owner(block_sizes) != NAME:
        return False
    if autodiff.beyond_first_order(*operands) is not None:
        return False
    return ssd_api._refusal(NAME, chunk_size, x.shape[3], b.shape[3]) is None


def scan(x, dt, a, b, c, initial_state, D, z, *, chunk_size, dt_nonnegative=False,
         block_sizes=None, sequence_axes=()):
    """(y [b, l, h, p] in x.dtype, final_state fp32). x, z [b, l, h, p]; dt (processed,
    fp32) and a = A dt (with resets) [b, l, h]; b, c [b, l, g, n]; D [h, p] fp32 or None;
    initial_state [b, h, p, n] fp32. dt_nonnegative: dt >= 0 is known (softplus, or a
    clamp at 0 or above), so the output kernel takes it in the decay's exponent.
    sequence_axes: inside a shard_map, the manual axes the local sequence is split over.
    Under jit a sequence split in runs of whole chunks stays split, any other split is
    gathered (ssd.api._sequence_stays_split, logged). Not differentiable: the caller
    takes gradients elsewhere (module docstring)."""
    length = x.shape[1]
    nc = -(-length // chunk_size)
    split = bool(sequence_axes) or ssd_api._sequence_stays_split(
        x, nc, nc * chunk_size == length)

    def chunked(t):
        return None if t is None else ssd_api.chunked_sequence(t, chunk_size, split)

    interpret = ssd_api._platform(NAME)[1]
    y, final = _run(chunked(x), chunked(dt), chunked(a), chunked(b), chunked(c),
                    initial_state, D, chunked(z), interpret, block_sizes, dt_nonnegative,
                    tuple(sequence_axes))
    return ssd_api._unchunked(y, x, split), final


def _triton():
    return ssd_api._backend(NAME)


def _run(x, dt, a, b, c, init, D, z, interpret, block_sizes, dt_nonnegative, axes):
    """(y, final) through the fused forward's planner; with a caller's sequence `axes`,
    each part from the state the exchange gives it."""
    skip, gated = D is not None, z is not None
    fused = functools.partial(_triton().forward_fused, interpret=interpret,
                              block_sizes=block_sizes, dt_nonnegative=dt_nonnegative)

    def local(x, dt, a, b, c, init, *options):
        options = list(options)
        d_local = options.pop(0) if skip else None
        z_local = options.pop(0) if gated else None
        return fused(x, dt, a, b, c, init, d_local, z_local)

    operands = (x, dt, a, b, c, init) + ((D,) if skip else ()) + ((z,) if gated else ())
    planner = layouts.fused_forward_planner(local, x.shape, b.shape[3], skip=skip,
                                            gated=gated)

    def forward(*operands):
        return sharding.run(planner, operands, rule=layouts.fused_forward_rule(skip, gated),
                            **sharding.backend_options(NAME, interpret))

    if axes:
        forward = context_parallel.split_forward(forward, axes, weighted=True)
    y, final, _ = forward(*operands)
    return y, final
