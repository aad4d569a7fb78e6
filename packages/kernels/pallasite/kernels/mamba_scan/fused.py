"""mamba_chunk_scan's fused route: dt, D and z inside the Pallas Triton SSD kernels.

    forward   y = (scan(x dt, a, B, C) + D x) silu(z)     ssd.pallas_triton.forward_fused:
              dt scales the output tile's columns and joins the state scan's per-step
              weight, D and z are the output kernel's epilogue, so neither x dt nor the
              scan's own y is written; with z the sums before the gate (y_pre) are kept
              for z's gradient, as mamba_ssm keeps them.
    backward  dy_pre = dy silu(z), dz = dy y_pre silu'(z), dD = sum dy_pre x   (XLA)
              the scan's backward kernels on x dt and dy_pre (ssd.pallas_triton.backward)
              dx = d(x dt) dt + dy_pre D, d(dt) = sum_p d(x dt) x               (XLA)

dt reaches the custom_vjp processed (bias, softplus, clamp) and a = A dt with the
sequence resets already in it: JAX differentiates that elementwise work on [b, l, h]
arrays, the kernels the rest. Under a jit's mesh the forward runs through its planner
(ssd.layouts.fused_forward_planner: batch, heads and chunks split as the scan's) and the
backward through chunk_ssd's. A sequence split over devices (a jit's axes in runs of
whole chunks, or a caller's shard_map naming sequence_axes) takes chunk_ssd's exchange:
each part's final state from a zero state (of x dt), one all-gather of state-sized
arrays, then each part's fused forward from its entering state; the backward mirrors
it in chunk_ssd's backward (ssd.context_parallel). The route serves the Triton
backend wherever it is chosen first (eligible).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallasite.kernels import autodiff, sharding
from pallasite.kernels.ssd import api as ssd_api
from pallasite.kernels.ssd import context_parallel, layouts

NAME = "pallas_triton"
_F32 = jnp.float32


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
    gathered (ssd.api._sequence_stays_split, logged)."""
    length = x.shape[1]
    nc = -(-length // chunk_size)
    split = bool(sequence_axes) or ssd_api._sequence_stays_split(
        x, nc, nc * chunk_size == length)

    def chunked(t):
        return None if t is None else ssd_api.chunked_sequence(t, chunk_size, split)

    interpret = ssd_api._platform(NAME)[1]
    y, final = _scan(chunked(x), chunked(dt), chunked(a), chunked(b), chunked(c),
                     initial_state, D, chunked(z), interpret, block_sizes, dt_nonnegative,
                     tuple(sequence_axes))
    return ssd_api._unchunked(y, x, split), final


def _triton():
    return ssd_api._backend(NAME)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _scan(x, dt, a, b, c, init, D, z, interpret, block_sizes, dt_nonnegative, axes):
    # Not differentiated: the sums before the gate (y_pre) are not written.
    return _run(x, dt, a, b, c, init, D, z, interpret, block_sizes, dt_nonnegative, axes,
                keep_pre=False)[:2]


def _run(x, dt, a, b, c, init, D, z, interpret, block_sizes, dt_nonnegative, axes, *,
         keep_pre):
    """(y, final, y_pre or None, chunk states) through the fused forward's planner; with
    a caller's sequence `axes`, each part from the state the exchange gives it."""
    skip, gated = D is not None, z is not None
    pre = gated and keep_pre
    fused = functools.partial(_triton().forward_fused, interpret=interpret,
                              block_sizes=block_sizes, dt_nonnegative=dt_nonnegative,
                              keep_pre=pre)

    def local(x, dt, a, b, c, init, *options):
        options = list(options)
        d_local = options.pop(0) if skip else None
        z_local = options.pop(0) if gated else None
        y, y_pre, final, states = fused(x, dt, a, b, c, init, d_local, z_local)
        return (y,) + ((y_pre,) if pre else ()) + (final, states)

    operands = (x, dt, a, b, c, init) + ((D,) if skip else ()) + ((z,) if gated else ())
    planner = layouts.fused_forward_planner(local, x.shape, b.shape[3], skip=skip,
                                            gated=gated, pre=pre)

    def forward(*operands):
        return sharding.run(planner, operands,
                            rule=layouts.fused_forward_rule(skip, gated, pre),
                            **sharding.backend_options(NAME, interpret))

    if axes:
        forward = context_parallel.split_forward(forward, axes, weighted=True)
    outs = forward(*operands)
    final, states = outs[-2:]
    return outs[0], final, (outs[1] if pre else None), states


def _forward(x, dt, a, b, c, init, D, z, interpret, block_sizes, dt_nonnegative, axes):
    y, final, y_pre, states = _run(x, dt, a, b, c, init, D, z, interpret, block_sizes,
                                   dt_nonnegative, axes, keep_pre=True)
    return (y, final), (x, dt, a, b, c, init, D, z, y_pre, states)


def _backward(interpret, block_sizes, dt_nonnegative, axes, residuals, cotangents):
    x, dt, a, b, c, init, D, z, y_pre, states = residuals
    dy, dfinal = cotangents
    dz, dy_pre = None, dy.astype(_F32)
    if z is not None:
        zf = z.astype(_F32)
        gate = jax.nn.sigmoid(zf)
        dz = (dy_pre * y_pre.astype(_F32) * gate * (1 + zf * (1 - gate))).astype(z.dtype)
        dy_pre = dy_pre * zf * gate
    # The gated cotangent leaves this pass once, in the kernels' operand dtype, and D's
    # terms take that same array, so dy, z and y_pre are read once (XLA fuses dz beside it).
    dy_pre = dy_pre.astype(x.dtype)
    dtf = dt.astype(_F32)[..., None]
    dxdt, da, db, dc, dinit = ssd_api._backward(
        ssd_api._with_blocks(NAME, block_sizes), (x.astype(_F32) * dtf).astype(x.dtype), a,
        *ssd_api.summed_in_fp32(x, b, c), states, dy_pre, dfinal.astype(_F32), axes)
    dxdt, xf = dxdt.astype(_F32), x.astype(_F32)
    dx = dxdt * dtf
    dD = None
    if D is not None:
        dx = dx + dy_pre.astype(_F32) * D
        dD = jnp.sum(dy_pre.astype(_F32) * xf, axis=(0, 1, 2)).astype(D.dtype)
    ddt = jnp.sum(dxdt * xf, axis=-1)
    # Inside a shard_map, a gradient of an operand that does not vary where its sources
    # do is summed over those axes (fp32, rounded once), as chunk_ssd's are.
    return sharding.cotangents_like((dx, ddt, da, db, dc, dinit, dD, dz),
                                    (x, dt, a, b, c, init, D, z))


_scan.defvjp(_forward, _backward)
