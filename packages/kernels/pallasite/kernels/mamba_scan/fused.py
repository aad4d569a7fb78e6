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
(ssd.layouts.fused_forward_planner: batch and heads split as the scan's) and the
backward through chunk_ssd's. The route serves the Triton backend, chosen first, on
local operands (a shard_map's included) or a jit's axes that do not split the sequence
(_unsplit_sequence); a sequence over devices takes chunk_ssd with the elementwise work
around it (api.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallasite.kernels import autodiff, sharding
from pallasite.kernels.ssd import api as ssd_api
from pallasite.kernels.ssd import layouts

NAME = "pallas_triton"
_F32 = jnp.float32


def eligible(implementation, chunk_size, operands, block_sizes, sequence_axes) -> bool:
    """Whether the fused route runs this call: Triton first among the implementations and
    able to run this geometry here, a layout it serves (_unsplit_sequence), first-order
    differentiation at most, no sequence_axes, block sizes (if any) Triton's."""
    operands = tuple(t for t in operands if t is not None)
    x, b = operands[0], operands[3]
    names = ssd_api._candidates(implementation, chunk_size, x.shape[3], b.shape[3])
    if names[0] != NAME or sequence_axes or x.size == 0 or b.size == 0:
        return False
    if block_sizes is not None and ssd_api._blocks_owner(block_sizes) != NAME:
        return False
    if not _unsplit_sequence(x, chunk_size, sharding.context_mesh(operands)):
        return False
    if autodiff.beyond_first_order(*operands) is not None:
        return False
    return ssd_api._refusal(NAME, chunk_size, x.shape[3], b.shape[3]) is None


def _unsplit_sequence(x, chunk_size, mesh) -> bool:
    """Whether the route's layouts serve this mesh: none, a shard_map's (sequence_axes
    were refused before), or a jit's axes that do not split the sequence. Explicit axes:
    x's own. Auto axes: where chunk_ssd would keep a split sequence split (whole chunks
    dividing over the mesh, ssd.api), its route runs instead, since the partitioner may
    split it."""
    if mesh.empty or all(size == 1 for size in mesh.axis_sizes) or mesh.manual_axes:
        return True  # inside a shard_map each device holds whole sequences
    if mesh.explicit_axes:
        return not sharding.explicit_dims(x)[1]
    length = x.shape[1]
    return length % chunk_size != 0 or (length // chunk_size) % math.prod(mesh.axis_sizes) != 0


def scan(x, dt, a, b, c, initial_state, D, z, *, chunk_size, dt_nonnegative=False,
         block_sizes=None):
    """(y [b, l, h, p] in x.dtype, final_state fp32). x, z [b, l, h, p]; dt (processed,
    fp32) and a = A dt (with resets) [b, l, h]; b, c [b, l, g, n]; D [h, p] fp32 or None;
    initial_state [b, h, p, n] fp32. dt_nonnegative: dt >= 0 is known (softplus, or a
    clamp at 0 or above), so the output kernel takes it in the decay's exponent."""
    bsz, length, h, p = x.shape
    nc = -(-length // chunk_size)
    padded = nc * chunk_size

    def chunked(t):
        return None if t is None else ssd_api._pad(t, length, padded).reshape(
            bsz, nc, chunk_size, *t.shape[2:])

    interpret = ssd_api._platform(NAME)[1]
    y, final = _scan(chunked(x), chunked(dt), chunked(a), chunked(b), chunked(c),
                     initial_state, D, chunked(z), interpret, block_sizes, dt_nonnegative)
    return y.reshape(bsz, padded, h, p)[:, :length], final


def _triton():
    return ssd_api._backend(NAME)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _scan(x, dt, a, b, c, init, D, z, interpret, block_sizes, dt_nonnegative):
    # Not differentiated: the sums before the gate (y_pre) are not written.
    return _run(x, dt, a, b, c, init, D, z, interpret, block_sizes, dt_nonnegative,
                keep_pre=False)[:2]


def _run(x, dt, a, b, c, init, D, z, interpret, block_sizes, dt_nonnegative, *, keep_pre):
    """(y, final, y_pre or None, chunk states) through the fused forward's planner."""
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
    outs = sharding.run(planner, operands,
                        rule=layouts.fused_forward_rule(skip, gated, pre),
                        **sharding.backend_options(NAME, interpret))
    final, states = outs[-2:]
    return outs[0], final, (outs[1] if pre else None), states


def _forward(x, dt, a, b, c, init, D, z, interpret, block_sizes, dt_nonnegative):
    y, final, y_pre, states = _run(x, dt, a, b, c, init, D, z, interpret, block_sizes,
                                   dt_nonnegative, keep_pre=True)
    return (y, final), (x, dt, a, b, c, init, D, z, y_pre, states)


def _backward(interpret, block_sizes, dt_nonnegative, residuals, cotangents):
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
        *ssd_api.summed_in_fp32(x, b, c), states, dy_pre, dfinal.astype(_F32))
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
