"""The gated delta rule's forward state pass on Hopper through Pallas Mosaic GPU (wgmma).

One program per (value column block, value head, row) walks the row's chunks in order, as
the Pallas Triton state pass does (pallas_triton._state_kernel), and gives the same three
arrays: the state entering each chunk and u = U - W S (the backward's residuals and the
output kernel's operands) in the compute dtype, and the final state in fp32. What
differs is the machinery:

- TMA copies W, K and U of the chunks ahead into shared memory (emit_pipeline), and
  stores each chunk's entering state and u from shared memory while the next chunk runs;
- the carried state S [K, block_v] lives in registers in the wgmma accumulator layout.
  Its compute-dtype copy is written to shared memory once a chunk, where it is both the
  residual the TMA stores and the B operand of u's product W S;
- S' = exp(G_last) S + (exp(G_last - G) k)^T u: the decay to the chunk's end weights
  u's rows (the wgmma's B operand, written to shared memory as the compute dtype), and
  the product accumulates onto the decayed state in place (ACC.init).

The per-chunk decays (exp(G_last - G_t) and exp(G_last)) are computed in XLA from the
same compensated cumulative sums the Triton kernels read (ssd.decay.cumsum_pair), laid
out per (row, head, chunk), so each chunk's pair is one contiguous TMA box.

Scope: rows that are one sequence each (no cu_seqlens), keys as given (not normalised in
the kernels), residuals stored, bf16 or fp16 compute, K in {64, 128}, block_v in {32,
64}, chunk 64 (`reason`). The Triton pass covers the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallasite.kernels import sharding

F32 = jnp.float32
CHUNK = 64
KEY_DIMS = (64, 128)
BLOCK_VS = (32, 64)
DTYPES = (jnp.bfloat16, jnp.float16)
# Chunks whose loads are in flight ahead of the one computed (at least 2: k's buffer is
# released a step late).
STAGES = 3


def reason(*, chunk: int, dk: int, block_v: int, dtype, packed: bool,
           l2norm: bool = False) -> str | None:
    """Why this state pass cannot run the problem (None: it can)."""
    if packed:
        return "packed sequences (cu_seqlens) take the Pallas Triton state pass"
    if l2norm:
        return "keys normalised in the kernels take the Pallas Triton state pass"
    if chunk != CHUNK:
        return f"chunk_size={chunk}; the Mosaic GPU state pass takes {CHUNK}"
    if dk not in KEY_DIMS:
        return f"K = {dk} is not one of {KEY_DIMS}"
    if block_v not in BLOCK_VS:
        return f"block_v = {block_v} is not one of {BLOCK_VS}"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
        return f"compute dtype {jnp.dtype(dtype)}: the wgmma pass takes bf16 or fp16"
    return None


def _swizzled(dtype, block_v: int) -> tuple:
    """Shared-memory transforms of every wgmma operand: tiles of (8, block_v's row bytes
    up to 128) swizzled by that width. The state and u's weighted rows are block_v wide
    and N-major, so their swizzle is at most their row's bytes, and a wgmma takes one
    swizzle for both operands: W and k are tiled the same."""
    width = min(block_v * jnp.dtype(dtype).itemsize, 128)
    return (plgpu.TilingTransform((8, width // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(width))


def _accumulate(total, a, b, interpret: bool):
    """total + a @ b by the tensor cores. Compiled, the wgmma accumulates onto total in
    its own registers (an accumulator initialised with it); the interpreter cannot run
    that form (jax 0.11.2), so there the product goes to a fresh accumulator and is added."""
    if not interpret:
        def product(acc):
            plgpu.wgmma(acc, a, b)

        return pl.run_state(product)(plgpu.ACC.init(total))

    def fresh(acc):
        plgpu.wgmma(acc, a, b)
        plgpu.wgmma_wait(0)
        return acc[...]

    return total + pl.run_scoped(fresh, plgpu.ACC(total.shape))


def _decay_row(ref, axis: int):
    """A chunk's row of decays from shared memory in the layout of a wgmma accumulator
    reduced over `axis`, so it broadcasts back along that axis (1: a value per row, 0: a
    value per column)."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(axis), optimized=False)


def chunk_decays(hi, lo):
    """[B, Hv, NC, 2, C] fp32: per (row, head, chunk), exp(G_last - G_t) for each step t
    (row 0) and exp(G_last) (row 1, repeated), from the cumulative sums' pairs [B, NC, C,
    Hv]; the same expressions as the Triton passes' (pallas_triton._segment)."""
    hi_last, lo_last = hi[:, :, -1:], lo[:, :, -1:]
    to_end = jnp.exp((hi_last - hi) + (lo_last - lo))
    across = jnp.broadcast_to(jnp.exp(hi_last + lo_last), to_end.shape)
    return jnp.stack([to_end, across], axis=3).transpose(0, 4, 1, 3, 2)


def state_pass(w, big_u, k, hi, lo, init, block_v: int, *, interpret: bool = False,
               cost_estimate=None):
    """(states [B, NC, Hv, K, V] and u [B, NC, C, Hv, V] in the compute dtype, finals
    [B, Hv, K, V] fp32) from W [B, NC, C, Hv, K], U [B, NC, C, Hv, V], k [B, NC, C, Hk,
    K] (the chunk layout), the cumulative decay pairs [B, NC, C, Hv] and the initial
    states [B, Hv, K, V] fp32: pallas_triton._state_pass for unpacked rows.
    cost_estimate: a function of (inputs, outputs) giving the kernel's pl.CostEstimate
    (the Triton pass's, pallas_triton._state_pass_cost), or None."""
    b, nc, chunk, hv, dk = w.shape
    hk, dv = k.shape[3], big_u.shape[4]
    per_key_head = hv // hk
    bv = block_v
    cd = w.dtype
    nvb = dv // bv
    rows = b * nc * chunk
    w2, k2, u2 = w.reshape(rows, hv * dk), k.reshape(rows, hk * dk), big_u.reshape(rows, hv * dv)
    decays = chunk_decays(hi, lo).reshape(b * hv * nc * 2, chunk)
    init2 = init.reshape(b * hv * dk, dv)
    out_types = (sharding.out_struct((b * nc, hv * dk, dv), cd, like=big_u),
                 sharding.out_struct((rows, hv * dv), cd, like=big_u),
                 sharding.out_struct((b * hv * dk, dv), F32, like=init))

    def body(w_g, k_g, u_g, d_g, init_g, states_g, uo_g, fin_g):
        p = lax.axis_index("p")
        vb, h, i = p % nvb, (p // nvb) % hv, p // (nvb * hv)
        my_rows = pl.ds(i * nc * chunk, nc * chunk)
        cols = pl.ds(h * dv + vb * bv, bv)
        state_rows = pl.ds((i * hv + h) * dk, dk)

        def with_scratch(init_smem, states_s, uo_s, v_s, barrier):
            plgpu.copy_gmem_to_smem(init_g.at[state_rows, pl.ds(vb * bv, bv)], init_smem,
                                    barrier)
            plgpu.barrier_wait(barrier)
            start = plgpu.load(init_smem, layout=plgpu.Layout.WGMMA)

            def step(index, w_s, k_s, u_s, d_s, state):
                c = index[0]
                # The last chunk's stores have read the buffers written again here.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                states_s[...] = state.astype(cd)  # the residual, and W S's B operand
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    states_s, states_g.at[i * nc + c, pl.ds(h * dk, dk), pl.ds(vb * bv, bv)])

                def product(acc):
                    plgpu.wgmma(acc, w_s, states_s)
                    plgpu.wgmma_wait(0)
                    return acc[...]

                u = u_s[...].astype(F32) - pl.run_scoped(product, plgpu.ACC((chunk, bv)))
                uo_s[...] = u.astype(cd)
                to_end = lax.broadcast_in_dim(_decay_row(d_s.at[0], 1), (chunk, bv), [0])
                v_s[...] = (u * to_end).astype(cd)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    uo_s, uo_g.at[pl.ds((i * nc + c) * chunk, chunk), cols])
                across = lax.broadcast_in_dim(_decay_row(d_s.at[1, pl.ds(0, bv)], 0), (dk, bv),
                                              [1])

                return _accumulate(state * across, k_s.T, v_s, interpret)

            operand = functools.partial(plgpu.BlockSpec, transforms=_swizzled(cd, bv))
            final = plgpu.emit_pipeline(
                step,
                grid=(nc,),
                # k's slot is released a step late: the state's update reads it while
                # the next step begins (the next step's first use of the state waits).
                in_specs=[operand((chunk, dk), lambda c: (c, 0)),
                          operand((chunk, dk), lambda c: (c, 0), delay_release=1),
                          operand((chunk, bv), lambda c: (c, 0)),
                          plgpu.BlockSpec((2, chunk), lambda c: (c, 0))],
                max_concurrent_steps=STAGES,
                init_carry=start,
            )(w_g.at[my_rows, pl.ds(h * dk, dk)],
              k_g.at[my_rows, pl.ds((h // per_key_head) * dk, dk)],
              u_g.at[my_rows, cols],
              d_g.at[pl.ds((i * hv + h) * nc * 2, nc * 2)])
            init_smem[...] = final
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(init_smem, fin_g.at[state_rows, pl.ds(vb * bv, bv)])
            plgpu.wait_smem_to_gmem(0)

        block = lambda rows_: plgpu.SMEM((rows_, bv), cd, transforms=_swizzled(cd, bv))  # noqa
        pl.run_scoped(with_scratch, plgpu.SMEM((dk, bv), F32), block(dk), block(chunk),
                      block(chunk), plgpu.Barrier())

    states, u, finals = pl.kernel(
        body,
        out_type=out_types,
        mesh=plgpu.Mesh(grid=(nvb * hv * b,), grid_names=("p",)),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
        cost_estimate=(None if cost_estimate is None
                       else cost_estimate((w2, k2, u2, decays, init2), out_types)),
        name="gated_delta_rule_state_pass_mosaic_gpu",
    )(w2, k2, u2, decays, init2)
    return (states.reshape(b, nc, hv, dk, dv), u.reshape(b, nc, chunk, hv, dv),
            finals.reshape(b, hv, dk, dv))
