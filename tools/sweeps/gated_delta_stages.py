"""The gated delta rule's Pallas Triton kernels stage by stage, beside fla's stages, on one
GPU, in one process: where the forward's and the backward's time goes.

    OUT=folder PYTHONPATH=<the four package roots>:.peers python3 tools/sweeps/gated_delta_stages.py
    python3 tools/sweeps/gated_delta_stages.py --smoke   # tiny shapes, interpreters, no fla
    ... gated_delta_stages.py --only backward --no-fla   # the backward's stages alone
    ... gated_delta_stages.py --flag-forms   # the forms not yet timed (FLAG_FORMS), both ways

Stages (bf16, chunk 64, no cu_seqlens): the XLA prologue (layout and the cumulative decay
pair), prep (the WY solve: U, W), the state pass at each block_v, the output at each
output_block_v, the whole forward, the reverse state pass, the chunk gradients at each
grads_block_v and the whole forward+backward; each kernel also at other warp counts
(`warps` in the records; "default" is the module's own; the first shape only), and the
state passes' loops at other pipeline depths (`num_stages`) and in their other forms
(`state_transposed` and `decay_on_values`, pallas_triton.py flags; `packed_loop`: the
loops packed sequences take, one run of chunks per sequence with bounds read from
tables, here one run per row; the states loaded and stored masked or under a branch as
`io_in_branches` says), first shape only; the prep in one and in two kernels
(`prep_in_two_kernels`, the solve at 2, 4 and 8 warps on the first shape, with its
diagonal blocks inverted in its other form, `solve_diagonal_at_once`, and with the
apply in the solve's kernel or not, `apply_in_solve_kernel`), the chunk gradients with
the solve's in their other forms (through the forward's u or through W, `grads_solve_through_u`,
and W's two orders, `grads_solve_keys_first`, pallas_triton_bwd.py; each with its relative L2
from the default's gradients), and
the forward with each prep form the defaults do not take; the state passes on packed sequences (the first
shape's heads and length in 16 random lengths, and in sequences of one chunk each) as
runs and as one loop (`short_sequences_in_one_loop`). fla (when importable): its
cumsum, intra-chunk (kkt + solve + w/u), state pass (fwd_h) and output (fwd_o), its
whole forward and its forward+backward. Every time is the bench harness's queued
method (calls back to back, one synchronisation per sample,
median). JSON lines to $OUT/gated_delta_stages.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

os.environ.setdefault("PALLASITE_AUTOTUNE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402
from knobs import knobs  # noqa: E402 - tools/sweeps/knobs.py, beside this script
import records  # noqa: E402 - tools/sweeps/records.py, beside this script

from pallasite.bench import harness, peers  # noqa: E402
from pallasite.kernels.gated_delta import packing  # noqa: E402
from pallasite.kernels.gated_delta import pallas_triton as pt  # noqa: E402
from pallasite.kernels.gated_delta import pallas_triton_bwd as ptb  # noqa: E402
from pallasite.kernels.ssd import decay  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
SHAPES = {"qwen3_next": (1, 32768, 16, 32, 128, 128), "delta_b8_t4k": (8, 4096, 32, 32, 128, 128)}
SMOKE = {"tiny": (1, 128, 2, 4, 16, 32)}
WARPS = {"value": None}  # None: each kernel's own num_warps


def _params(num_warps=4, num_stages=1):
    return plgpu.CompilerParams(num_warps=WARPS["value"] or num_warps, num_stages=num_stages)


pt._params = ptb._params = _params  # the sweep's overrides (None keeps the module's)


def emit(rec):
    records.emit(rec, os.environ.get("OUT"), "gated_delta_stages.jsonl")


def ms(fn, *args, sync=harness.jax_sync, samples=10):
    jax.block_until_ready(fn(*args)) if sync is harness.jax_sync else fn(*args)
    t = harness.steady_state(lambda _: fn(*args), [None], sync, compile_s=0.0, warmup=2,
                             samples=samples, budget_s=1.0)
    return t.median_s * 1e3


def inputs(b, t, hk, hv, dk, dv, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (b, t, hk, dk), F32)
    k = jax.random.normal(ks[1], (b, t, hk, dk), F32)
    q = (q / jnp.linalg.norm(q, axis=-1, keepdims=True)).astype(BF16)
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(BF16)
    v = jax.random.normal(ks[2], (b, t, hv, dv), BF16)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, hv), F32) - 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, hv), F32))
    init = jax.random.normal(ks[5], (b, hv, dk, dv), F32) * 0.1
    return q, k, v, g, beta, init


def chunked(q, k, v, g, beta, cu_seqlens, chunk):
    """The kernels' operands as the forward makes them: q, k, v and beta in the chunk
    layout [B, NC, C, ...], G's pair (hi, lo), and the chunk tables (entering, leaving)."""
    b, t = q.shape[:2]
    (q, k, v, g, beta), padded, _, first, counts = packing.lay_out(
        (q, k, v, g, beta), cu_seqlens, t, chunk)
    nc = padded // chunk
    q, k, v, g, beta = (a.reshape(b, nc, chunk, *a.shape[2:]) for a in (q, k, v, g, beta))
    hi, lo = decay.cumsum_pair(g, axis=2)
    return (q, k, v, hi, lo, beta), packing.chunk_tables(b, nc, first, counts)


def pallasite_stages(name, shape, interpret, sweep_warps, only=("forward", "backward")):
    b, t, hk, hv, dk, dv = shape
    chunk = 64
    q, k, v, g, beta, init = inputs(*shape)
    scale = dk ** -0.5
    prologue = jax.jit(lambda *a: chunked(*a, None, chunk)[0])
    lq, lk, lv, hi, lo, lbeta = prologue(q, k, v, g, beta)
    entering, leaving = packing.chunk_tables(b, lq.shape[1], None, None)
    base = dict(op="gated_delta_rule", shape=name, impl="pallasite.pallas_triton")
    # the kernels' own block sizes at this shape: the state passes' other forms run at them
    default_bs = pt._resolve(None, batch=b, length=t, hv=hv, dk=dk, dv=dv, chunk=chunk,
                             dtype=BF16)

    def rec(stage, value, **kw):
        emit(dict(base, stage=stage, ms=round(value, 4), **kw))

    def traced_prep():  # a new function, so the knobs and warps set now are read
        return jax.jit(lambda lk, lv, hi, lo, lb: pt._prep(lk, lv, hi, lo, lb, hv, BF16,
                                                            False, interpret))

    rec("prologue_xla", ms(prologue, q, k, v, g, beta))
    for warps in ((None, 2, 8) if sweep_warps else (None,)) if "forward" in only else ():
        WARPS["value"] = warps
        tag = warps or "default"
        prep = traced_prep()
        big_u, w, _ = prep(lk, lv, hi, lo, lbeta)
        rec("prep", ms(prep, lk, lv, hi, lo, lbeta), warps=tag)
        for bv in (16, 32, 64):
            if bv > dv:
                continue
            bs = pt.BlockSizes(block_v=bv)
            state = jax.jit(functools.partial(pt._state_pass, bs=bs, l2norm=False,
                                              interpret=interpret, packed=False))
            states, u, _ = state(w, big_u, lk, hi, lo, entering, leaving, init)
            rec("state_pass", ms(state, w, big_u, lk, hi, lo, entering, leaving, init),
                warps=tag, block_v=bv)
        if sweep_warps and warps is None:  # the pass's loop pipelined deeper or not at all
            def state_pass_ms(packed=False, **kw):  # traced afresh: knobs read when traced
                state = jax.jit(functools.partial(pt._state_pass, bs=default_bs,
                                                  l2norm=False, interpret=interpret,
                                                  packed=packed))
                rec("state_pass", ms(state, w, big_u, lk, hi, lo, entering, leaving, init),
                    warps=tag, block_v=default_bs.block_v, **kw,
                    **(dict(packed_loop=True) if packed else {}))

            for stages in (s for s in (1, 2, 3, 4) if s != pt.STATE_PASS_STAGES):
                with knobs(pt, STATE_PASS_STAGES=stages):  # the depth shared memory allows
                    state_pass_ms(num_stages=pt.pass_stages(chunk, dk, default_bs.block_v,
                                                            2, key_operands=2))
            with knobs(pt, STATE_TRANSPOSED=not pt.STATE_TRANSPOSED):
                state_pass_ms(state_transposed=pt.STATE_TRANSPOSED)
                with knobs(pt, DECAY_ON_VALUES=not pt.DECAY_ON_VALUES):
                    state_pass_ms(state_transposed=pt.STATE_TRANSPOSED,
                                  decay_on_values=pt.DECAY_ON_VALUES)
            for io in (True, False):  # the loops packed sequences take (runs from tables)
                with knobs(pt, STATE_IO_IN_BRANCHES=io):
                    state_pass_ms(packed=True, io_in_branches=io)
        for bv in (32, 64, 128):
            if bv > dv:
                continue
            bs = pt.BlockSizes(output_block_v=bv)
            out = jax.jit(lambda *a, bs=bs: pt._output(*a, BF16, scale, bs, False, interpret))
            rec("output", ms(out, lq, lk, hi, lo, states, u), warps=tag, output_block_v=bv)
    for warps in (1, 4) if sweep_warps and "forward" in only else ():
        WARPS["value"] = warps  # the prep alone at one and four warps as well
        prep = traced_prep()
        try:
            rec("prep", ms(prep, lk, lv, hi, lo, lbeta), warps=warps)
        except Exception as err:  # noqa: BLE001 - a config that does not compile is a record
            emit(dict(base, stage="prep", warps=warps, error=f"{type(err).__name__}: {err}"[:300]))
    WARPS["value"] = None
    # the prep in two kernels (pt.PREP_IN_TWO_KERNELS), its solve at other warp counts;
    # the one-kernel prep's rows above are under pt.PREP_IN_TWO_KERNELS as set
    for solve_warps in ((2, 4, 8) if sweep_warps else (pt.SOLVE_WARPS,)) if "forward" in only \
            else ():
        with knobs(pt, PREP_IN_TWO_KERNELS=True, SOLVE_WARPS=solve_warps):
            prep = traced_prep()
            rec("prep", ms(prep, lk, lv, hi, lo, lbeta), prep_in_two_kernels=True,
                solve_warps=solve_warps)
    if "forward" in only:
        with knobs(pt, PREP_IN_TWO_KERNELS=False):
            rec("prep", ms(traced_prep(), lk, lv, hi, lo, lbeta), prep_in_two_kernels=False)
        at_once = not pt.SOLVE_DIAGONAL_AT_ONCE  # the solve's other form
        with knobs(pt, PREP_IN_TWO_KERNELS=True, SOLVE_DIAGONAL_AT_ONCE=at_once):
            rec("prep", ms(traced_prep(), lk, lv, hi, lo, lbeta), prep_in_two_kernels=True,
                solve_diagonal_at_once=at_once)
        fused = not pt.APPLY_IN_SOLVE_KERNEL  # the two kernels' bodies in one, or not
        with knobs(pt, PREP_IN_TWO_KERNELS=True, APPLY_IN_SOLVE_KERNEL=fused):
            rec("prep", ms(traced_prep(), lk, lv, hi, lo, lbeta), prep_in_two_kernels=True,
                apply_in_solve_kernel=fused)
        loaded = not pt.SOLVE_ROWS_LOADED  # the substitution's rows loaded, or picked
        with knobs(pt, PREP_IN_TWO_KERNELS=True, SOLVE_ROWS_LOADED=loaded):
            rec("prep", ms(traced_prep(), lk, lv, hi, lo, lbeta), prep_in_two_kernels=True,
                solve_rows_loaded=loaded)

    def fwd(q, k, v, g, beta, init):
        return pt.forward(q, k, v, g, beta, scale=scale, initial_state=init, cu_seqlens=None,
                          chunk_size=chunk, use_qk_l2norm_in_kernel=False, interpret=interpret)

    if "forward" in only:
        rec("forward", ms(jax.jit(fwd), q, k, v, g, beta, init))
        other = not pt.PREP_IN_TWO_KERNELS  # the other prep; a new function, traced afresh
        with knobs(pt, PREP_IN_TWO_KERNELS=other):
            rec("forward", ms(jax.jit(lambda *a: fwd(*a)), q, k, v, g, beta, init),
                prep_in_two_kernels=other)
        at_once = not pt.SOLVE_DIAGONAL_AT_ONCE
        with knobs(pt, PREP_IN_TWO_KERNELS=True, SOLVE_DIAGONAL_AT_ONCE=at_once):
            rec("forward", ms(jax.jit(lambda *a: fwd(*a)), q, k, v, g, beta, init),
                solve_diagonal_at_once=at_once)
        fused = not pt.APPLY_IN_SOLVE_KERNEL
        with knobs(pt, PREP_IN_TWO_KERNELS=True, APPLY_IN_SOLVE_KERNEL=fused):
            rec("forward", ms(jax.jit(lambda *a: fwd(*a)), q, k, v, g, beta, init),
                apply_in_solve_kernel=fused)
        loaded = not pt.SOLVE_ROWS_LOADED
        with knobs(pt, PREP_IN_TWO_KERNELS=True, SOLVE_ROWS_LOADED=loaded):
            rec("forward", ms(jax.jit(lambda *a: fwd(*a)), q, k, v, g, beta, init),
                solve_rows_loaded=loaded)
    if "backward" not in only:
        return
    do = jax.random.normal(jax.random.key(9), v.shape, BF16)
    dfinal = jax.random.normal(jax.random.key(10), init.shape, F32)

    def loss(*args):
        o, final = fwd(*args)
        return jnp.vdot(o.astype(F32), do.astype(F32)) + jnp.vdot(final, dfinal)

    rec("forward_backward", ms(jax.jit(jax.grad(loss, argnums=range(6))), q, k, v, g, beta,
                               init))
    saved = jax.jit(lambda *a: pt._kernels(*a, None, scale=scale, chunk_size=chunk,
                                           l2norm=False, interpret=interpret, block_sizes=None,
                                           residuals=True)[2])(q, k, v, g, beta, init)
    ldo = do.reshape(lv.shape)
    for warps in (None, 4) if sweep_warps else (None,):
        WARPS["value"] = warps
        tag = warps or "default"
        for bv in (b for b in (16, 32, 64) if b <= dv):
            rev = jax.jit(lambda *a, bv=bv: ptb._reverse_pass(*a, hv, scale, bv, interpret,
                                                               packed=False))
            d_exit, du, _ = rev(lq, lk, saved["w"], hi, lo, ldo, entering, leaving, dfinal)
            rec("reverse_pass", ms(rev, lq, lk, saved["w"], hi, lo, ldo, entering, leaving,
                                   dfinal), warps=tag, block_v=bv)
        if sweep_warps and warps is None:  # the other IO form, other pipeline depths
            bv = default_bs.block_v
            forms = [dict(packed=True, io=io) for io in (True, False)] + [
                dict(packed=False, io=pt.STATE_IO_IN_BRANCHES, STATE_PASS_STAGES=s)
                for s in (2, 3, 4) if s != pt.STATE_PASS_STAGES]
            for form in forms:
                packed, io = form.pop("packed"), form.pop("io")
                with knobs(pt, STATE_IO_IN_BRANCHES=io, **form):
                    rev = jax.jit(lambda *a: ptb._reverse_pass(*a, hv, scale, bv, interpret,
                                                               packed=packed))
                    rec("reverse_pass", ms(rev, lq, lk, saved["w"], hi, lo, ldo, entering,
                                           leaving, dfinal),
                        warps=tag, block_v=bv, num_stages=pt.pass_stages(
                            chunk, dk, bv, 2, key_operands=3),
                        **(dict(packed_loop=True, io_in_branches=io) if packed else {}))
        for bv in (b for b in (32, 64, 128) if b <= dv):
            grads = jax.jit(lambda *a, bv=bv: ptb._chunk_grads(*a, scale, bv, interpret))
            args = (lq, lk, lv, hi, lo, lbeta, saved["inv"], saved["w"], saved["states"],
                    saved["u"], du, ldo, d_exit)
            rec("chunk_grads", ms(grads, *args), warps=tag, grads_block_v=bv,
                grads_solve_through_u=ptb.GRADS_SOLVE_THROUGH_U,
                grads_solve_keys_first=ptb.GRADS_SOLVE_KEYS_FIRST)
        if sweep_warps and warps is None:  # the solve gradients' other forms
            bv = default_bs.grads_block_v
            want = jax.jit(lambda *a: ptb._chunk_grads(*a, scale, bv, interpret))(*args)
            forms = [(u, first) for u in (True, False) for first in (True, False)
                     if (u, first) != (ptb.GRADS_SOLVE_THROUGH_U, ptb.GRADS_SOLVE_KEYS_FIRST)
                     and not (u and first != ptb.GRADS_SOLVE_KEYS_FIRST)]
            for through_u, keys_first in forms:
                with knobs(ptb, GRADS_SOLVE_THROUGH_U=through_u,
                           GRADS_SOLVE_KEYS_FIRST=keys_first):
                    grads = jax.jit(lambda *a: ptb._chunk_grads(*a, scale, bv, interpret))
                    got = grads(*args)
                    rec("chunk_grads", ms(grads, *args), warps=tag, grads_block_v=bv,
                        grads_solve_through_u=through_u, grads_solve_keys_first=keys_first,
                        rel_l2_vs_default=[float(jnp.linalg.norm(g - w_) / jnp.linalg.norm(w_))
                                           for g, w_ in zip(got, want)])
    WARPS["value"] = None


def fla_stages(name, shape):
    import torch
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    b, t, hk, hv, dk, dv = shape
    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(b, t, hk, dk, device=dev), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(b, t, hk, dk, device=dev), dim=-1).bfloat16()
    v = torch.randn(b, t, hv, dv, device=dev).bfloat16()
    g = -torch.nn.functional.softplus(torch.randn(b, t, hv, device=dev) - 2.0)
    beta = torch.sigmoid(torch.randn(b, t, hv, device=dev))
    init = torch.randn(b, hv, dk, dv, device=dev) * 0.1
    sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    base = dict(op="gated_delta_rule", shape=name, impl="fla.triton")

    def rec(stage, fn):
        fn()
        torch.cuda.synchronize()
        emit(dict(base, stage=stage, ms=round(ms(lambda: fn(), sync=sync), 4)))

    with torch.no_grad():
        gc = chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2)
        rec("cumsum", lambda: chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2))
        w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, chunk_size=64)
        rec("intra (kkt+solve+w/u)",
            lambda: chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, chunk_size=64))
        h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gc, initial_state=init,
                                                   output_final_state=True, chunk_size=64)
        rec("fwd_h (state pass)",
            lambda: chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gc, initial_state=init,
                                                 output_final_state=True, chunk_size=64))
        rec("fwd_o (output)", lambda: chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=gc,
                                                  scale=dk ** -0.5, chunk_size=64))
        rec("forward", lambda: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init,
                                                      output_final_state=True))
    inputs = [a.detach().requires_grad_() for a in (q, k, v, g, beta, init)]
    do = torch.randn(b, t, hv, dv, device=dev).bfloat16()
    dfinal = torch.randn(b, hv, dk, dv, device=dev)

    def forward_backward():
        o, final = chunk_gated_delta_rule(*inputs[:5], initial_state=inputs[5],
                                          output_final_state=True)
        torch.autograd.backward((o, final), (do, dfinal))

    rec("forward_backward", forward_backward)


def fused_output_forms(name, shape, interpret, with_fla):
    """The forward with its output formed in the state pass's loop (pt.FUSED_OUTPUT) or
    by the output kernel: the whole forward at the fused pass's warp counts and block_v,
    and the forward+backward (the residuals' forward keeps the states and u) at the
    default block_v; o's and the finals' largest difference from the unfused forward's;
    and, with_fla, fla's forward in the same process."""
    b, t, hk, hv, dk, dv = shape
    chunk = 64
    q, k, v, g, beta, init = inputs(*shape)
    scale = dk ** -0.5
    base = dict(op="gated_delta_rule", shape=name, impl="pallasite.pallas_triton")
    do = jax.random.normal(jax.random.key(9), v.shape, BF16)
    dfinal = jax.random.normal(jax.random.key(10), init.shape, F32)

    def traced(block_v):  # new functions, so the knobs set now are read when traced
        def fwd(q, k, v, g, beta, init):
            return pt.forward(q, k, v, g, beta, scale=scale, initial_state=init,
                              cu_seqlens=None, chunk_size=chunk, use_qk_l2norm_in_kernel=False,
                              interpret=interpret,
                              block_sizes=None if block_v is None else dict(block_v=block_v))

        def loss(*args):
            o, final = fwd(*args)
            return jnp.vdot(o.astype(F32), do.astype(F32)) + jnp.vdot(final, dfinal)

        return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=range(6)))

    args = (q, k, v, g, beta, init)
    fwd, grad = traced(None)
    want = fwd(*args)
    emit(dict(base, stage="forward", fused_output=False, ms=round(ms(fwd, *args), 4)))
    emit(dict(base, stage="forward_backward", fused_output=False,
              ms=round(ms(grad, *args), 4)))
    forms = [(4, None), (8, None)] + [(8, bv) for bv in (32, 64) if bv <= dv]
    for warps, block_v in forms:
        with knobs(pt, FUSED_OUTPUT=True, STATE_OUTPUT_WARPS=warps):
            fwd, grad = traced(block_v)
            try:
                got = fwd(*args)
                diff = [float(jnp.max(jnp.abs(a.astype(F32) - c.astype(F32))))
                        for a, c in zip(got, want)]
                rec = dict(base, fused_output=True, warps=warps, block_v=block_v or "default")
                emit(dict(rec, stage="forward", ms=round(ms(fwd, *args), 4),
                          max_abs_diff_vs_unfused=diff))
                if block_v is None:
                    emit(dict(rec, stage="forward_backward", ms=round(ms(grad, *args), 4)))
            except Exception as err:  # noqa: BLE001 - a form that does not compile is a record
                emit(dict(base, fused_output=True, warps=warps, block_v=block_v or "default",
                          error=f"{type(err).__name__}: {err}"[:300]))
    if with_fla:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        tq, tk, tv, tg, tb, ti = (torch.from_dlpack(a) for a in args)
        run = lambda: chunk_gated_delta_rule(tq, tk, tv, tg, tb, initial_state=ti,  # noqa
                                             output_final_state=True)
        with torch.no_grad():
            run()
            torch.cuda.synchronize()
            emit(dict(base, impl="fla.triton", stage="forward", ms=round(ms(
                lambda: run(), sync=lambda _: torch.cuda.synchronize()), 4)))
        peers.release_torch_memory()


def mosaic_state_passes(name, shape, interpret):
    """The forward state pass on Mosaic GPU (gated_delta/pallas_mosaic_gpu.py) beside the
    Pallas Triton one, on the same operands: each at block_v 32 and 64, the Mosaic GPU
    pass at 2, 3 and 4 pipeline stages; its states, u and finals' largest difference from
    the Triton pass's at the same block_v."""
    from pallasite.kernels.gated_delta import pallas_mosaic_gpu as pm

    b, t, hk, hv, dk, dv = shape
    chunk = 64
    q, k, v, g, beta, init = inputs(*shape)
    lq, lk, lv, hi, lo, lbeta = jax.jit(lambda *a: chunked(*a, None, chunk)[0])(q, k, v, g, beta)
    entering, leaving = packing.chunk_tables(b, lq.shape[1], None, None)
    big_u, w, _ = jax.jit(lambda *a: pt._prep(*a, hv, BF16, False, interpret))(
        lk, lv, hi, lo, lbeta)
    base = dict(op="gated_delta_rule", shape=name, stage="state_pass")
    for bv in (32, 64):
        why = pm.reason(chunk=chunk, dk=dk, block_v=bv, dtype=BF16, packed=False)
        if bv > dv or why:
            emit(dict(base, impl="pallasite.pallas_mosaic_gpu", block_v=bv,
                      skipped=why or "block_v > V"))
            continue
        triton = jax.jit(functools.partial(pt._state_pass, bs=pt.BlockSizes(block_v=bv),
                                           l2norm=False, interpret=interpret, packed=False))
        args = (w, big_u, lk, hi, lo, entering, leaving, init)
        want = triton(*args)
        emit(dict(base, impl="pallasite.pallas_triton", block_v=bv,
                  ms=round(ms(triton, *args), 4)))
        for stages in (2, 3, 4):
            with knobs(pm, STAGES=stages):
                mosaic = jax.jit(lambda *a, bv=bv: pm.state_pass(*a, bv, interpret=interpret))
                try:
                    got = mosaic(w, big_u, lk, hi, lo, init)
                    diff = [float(jnp.max(jnp.abs(x.astype(F32) - y.astype(F32))))
                            for x, y in zip(got, want)]
                    emit(dict(base, impl="pallasite.pallas_mosaic_gpu", block_v=bv,
                              stages=stages, ms=round(ms(mosaic, w, big_u, lk, hi, lo, init), 4),
                              max_abs_diff_vs_triton=diff))
                except Exception as err:  # noqa: BLE001 - a form that fails is a record
                    emit(dict(base, impl="pallasite.pallas_mosaic_gpu", block_v=bv,
                              stages=stages, error=f"{type(err).__name__}: {err}"[:400]))
    # The whole forward (default block sizes) with its state pass on either backend.
    results = {}
    for on in (False, True):
        with knobs(pt, MOSAIC_GPU_STATE_PASS=on):
            fwd = jax.jit(lambda *a: pt.forward(
                *a[:5], scale=dk ** -0.5, initial_state=a[5], cu_seqlens=None,
                chunk_size=chunk, use_qk_l2norm_in_kernel=False, interpret=interpret))
            results[on] = fwd(q, k, v, g, beta, init)
            rec = dict(op="gated_delta_rule", shape=name, stage="forward",
                       mosaic_gpu_state_pass=on, ms=round(ms(fwd, q, k, v, g, beta, init), 4))
        if on:
            rec["max_abs_diff_vs_triton"] = [
                float(jnp.max(jnp.abs(x.astype(F32) - y.astype(F32))))
                for x, y in zip(results[True], results[False])]
        emit(rec)


# Kernel forms built without a GPU, each timed both ways by --flag-forms: (module, flag,
# what it changes: "forward" or "backward").
FLAG_FORMS = ((pt, "SOLVE_ROWS_LOADED", "forward"), (ptb, "DG_SPANS_IN_BF16_PIECES", "backward"))


def flag_forms(name, shape, interpret):
    """Each FLAG_FORMS flag off and on: the stage it changes (the prep; the chunk
    gradients) and the whole forward or forward+backward, with the relative L2 of the on
    form's outputs from the off form's."""
    b, t, hk, hv, dk, dv = shape
    chunk, scale = 64, dk ** -0.5
    q, k, v, g, beta, init = inputs(*shape)
    args = (q, k, v, g, beta, init)
    lq, lk, lv, hi, lo, lbeta = jax.jit(lambda *a: chunked(*a, None, chunk)[0])(q, k, v, g, beta)
    do = jax.random.normal(jax.random.key(9), v.shape, BF16)
    dfinal = jax.random.normal(jax.random.key(10), init.shape, F32)
    bs = pt._resolve(None, batch=b, length=t, hv=hv, dk=dk, dv=dv, chunk=chunk,
                     dtype=BF16)

    def fwd(*a):
        return pt.forward(*a[:5], scale=scale, initial_state=a[5], cu_seqlens=None,
                          chunk_size=chunk, use_qk_l2norm_in_kernel=False, interpret=interpret)

    def loss(*a):
        o, final = fwd(*a)
        return jnp.vdot(o.astype(F32), do.astype(F32)) + jnp.vdot(final, dfinal)

    def grads_inputs():
        """The chunk gradients' operands: the forward's residuals and the reverse pass's
        outputs, which no backward flag here changes."""
        saved = jax.jit(lambda *a: pt._kernels(
            *a, None, scale=scale, chunk_size=chunk, l2norm=False, interpret=interpret,
            block_sizes=None, residuals=True)[2])(*args)
        ldo = do.reshape(lv.shape)
        d_exit, du, _ = jax.jit(lambda *a: ptb._reverse_pass(
            *a, hv, scale, bs.block_v, interpret, packed=False))(
            lq, lk, saved["w"], hi, lo, ldo,
            *packing.chunk_tables(b, lq.shape[1], None, None), dfinal)
        return (lq, lk, lv, hi, lo, lbeta, saved["inv"], saved["w"], saved["states"],
                saved["u"], du, ldo, d_exit)

    for module, flag, side in FLAG_FORMS:
        operands = (lk, lv, hi, lo, lbeta) if side == "forward" else grads_inputs()
        results = {}
        for on in (False, True):
            with knobs(module, **{flag: on}):  # traced afresh: the flag read when traced
                if side == "forward":
                    stage = jax.jit(lambda *a: pt._prep(*a, hv, BF16, False, interpret))
                    passes = (("prep", stage, operands),
                              ("forward", jax.jit(lambda *a: fwd(*a)), args))
                else:
                    stage = jax.jit(lambda *a: ptb._chunk_grads(*a, scale, bs.grads_block_v,
                                                                 interpret))
                    passes = (("chunk_grads", stage, operands),
                              ("forward_backward",
                               jax.jit(lambda *a: jax.grad(loss, argnums=range(6))(*a)), args))
                for what, fn, fn_args in passes:
                    got = fn(*fn_args)
                    rec = dict(op="gated_delta_rule", shape=name, stage=what, **{flag.lower(): on})
                    if on:
                        rec["rel_l2_vs_off"] = [
                            float(jnp.linalg.norm((x - y).astype(F32))
                                  / jnp.maximum(jnp.linalg.norm(y.astype(F32)), 1e-30))
                            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(results[what]))]
                    results[what] = got
                    emit(dict(rec, ms=round(ms(fn, *fn_args), 4)))


def packed_state_passes(shape, interpret):
    """The state passes on packed sequences (cu_seqlens) of the first shape's heads and
    length: 16 random lengths and sequences of one chunk each, walked as one run per
    sequence or, SHORT_SEQUENCES_IN_ONE_LOOP, as one loop over the row."""
    (q, k, v, g, beta), chunk, scale, bs = _packed_setup(shape, interpret)
    hv = v.shape[2]
    for name, cu, n, init in _packed_cases(shape, chunk):
        (lq, lk, lv, hi, lo, lbeta), (entering, leaving) = chunked(q, k, v, g, beta, cu,
                                                                   chunk)
        nc = lq.shape[1]
        big_u, w, _ = jax.jit(lambda *a: pt._prep(*a, hv, BF16, False, interpret))(
            lk, lv, hi, lo, lbeta)
        do = jax.random.normal(jax.random.key(9), lv.shape, BF16)
        for one_loop in (False, True):
            with knobs(pt, SHORT_SEQUENCES_IN_ONE_LOOP=one_loop, SHORT_SEQUENCE_CHUNKS=nc + 1):
                state = jax.jit(functools.partial(pt._state_pass, bs=bs, l2norm=False,
                                                  interpret=interpret, packed=True))
                rev = jax.jit(lambda *a: ptb._reverse_pass(*a, hv, scale, bs.block_v,
                                                           interpret, packed=True))
                for stage, fn, args in (
                        ("state_pass", state, (w, big_u, lk, hi, lo, entering, leaving, init)),
                        ("reverse_pass", rev, (lq, lk, w, hi, lo, do, entering, leaving,
                                               init))):
                    emit(dict(op="gated_delta_rule", shape=name, sequences=n, stage=stage,
                              impl="pallasite.pallas_triton", ms=round(ms(fn, *args), 4),
                              block_v=bs.block_v, short_sequences_in_one_loop=one_loop))


def packed_forwards(shape, interpret, with_fla):
    """The forward on the packed cases of packed_state_passes: whole, with q, k, v read
    and o written in the packed row (PACKED_ROWS_IN_PLACE) or through the chunk layout's
    gathers, its in-place stages (the XLA prologue: g and beta laid out, G's pair, the
    chunk tables; prep, state pass, output), and fla's packed forward (cu_seqlens)."""
    (q, k, v, g, beta), chunk, scale, bs = _packed_setup(shape, interpret)
    t, hv = v.shape[1:3]
    for name, cu, n, init in _packed_cases(shape, chunk):
        base = dict(op="gated_delta_rule", shape=name, sequences=n,
                    impl="pallasite.pallas_triton")
        outs = {}
        for in_place in (True, False):
            with knobs(pt, PACKED_ROWS_IN_PLACE=in_place):
                fwd = jax.jit(functools.partial(
                    pt.forward, scale=scale, chunk_size=chunk, use_qk_l2norm_in_kernel=False,
                    interpret=interpret))
                run = lambda *a: fwd(*a[:5], initial_state=a[5], cu_seqlens=a[6])  # noqa
                args = (q, k, v, g, beta, init, cu)
                outs[in_place] = run(*args)
                emit(dict(base, stage="forward", packed_rows_in_place=in_place,
                          ms=round(ms(run, *args), 4)))
        diff = [float(jnp.max(jnp.abs(a.astype(F32) - c.astype(F32))))
                for a, c in zip(outs[True], outs[False])]
        emit(dict(base, stage="forward", max_abs_diff_in_place_vs_laid_out=diff))

        def prologue(g, beta, cu):
            (g, beta), padded, _, first, counts = packing.lay_out((g, beta), cu, t, chunk)
            nc = padded // chunk
            g, beta = (a.reshape(1, nc, chunk, hv) for a in (g, beta))
            hi, lo = decay.cumsum_pair(g, axis=2)
            return (hi, lo, beta, packing.chunk_tables(1, nc, first, counts),
                    packing.chunk_rows(cu, first, counts, nc, chunk))

        prologue = jax.jit(prologue)
        hi, lo, lbeta, (entering, leaving), rows = prologue(g, beta, cu)
        prep = jax.jit(lambda *a: pt._prep(*a[:5], hv, BF16, False, interpret, rows=a[5]))
        big_u, w, _ = prep(k, v, hi, lo, lbeta, rows)
        state = jax.jit(lambda *a: pt._state_pass(*a[:8], bs, False, interpret, packed=True,
                                                  rows=a[8]))
        states, u, _ = state(w, big_u, k, hi, lo, entering, leaving, init, rows)
        out = jax.jit(lambda *a: pt._output(*a[:6], BF16, scale, bs, False, interpret,
                                            rows=a[6]))
        for stage, fn, args in (
                ("prologue", prologue, (g, beta, cu)),
                ("prep", prep, (k, v, hi, lo, lbeta, rows)),
                ("state_pass", state, (w, big_u, k, hi, lo, entering, leaving, init, rows)),
                ("output", out, (q, k, hi, lo, states, u, rows))):
            emit(dict(base, stage=stage, packed_rows_in_place=True, ms=round(ms(fn, *args), 4)))
        if with_fla:
            _fla_packed_forward(name, (q, k, v, g, beta, init), cu)


def _fla_packed_forward(name, arrays, cu):
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, g, beta, init = (torch.from_dlpack(a) for a in arrays)
    cu = torch.from_dlpack(cu).long()
    fn = lambda: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init,  # noqa: E731
                                        output_final_state=True, cu_seqlens=cu)
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        emit(dict(op="gated_delta_rule", shape=name, sequences=int(cu.numel()) - 1,
                  impl="fla.triton", stage="forward",
                  ms=round(ms(fn, sync=lambda _: torch.cuda.synchronize()), 4)))


def _packed_setup(shape, interpret):
    """The packed sweeps' one row of the shape's heads and length: ((q, k, v, g, beta),
    chunk, scale, the kernels' block sizes)."""
    _, t, hk, hv, dk, dv = shape
    chunk = 16 if interpret else 64
    bs = pt._resolve(None, batch=1, length=t, hv=hv, dk=dk, dv=dv, chunk=chunk, dtype=BF16)
    return inputs(1, t, hk, hv, dk, dv)[:5], chunk, dk ** -0.5, bs


def _packed_cases(shape, chunk):
    """(name, cu_seqlens, sequences, initial states) of 16 random lengths summing to T,
    and of T / chunk sequences of one chunk each."""
    _, t, _, hv, dk, dv = shape
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, t), 15, replace=False))
    cases = {"packed16": np.diff(np.concatenate([[0], cuts, [t]])),
             "packed_one_chunk": np.full(t // chunk, chunk)}
    for name, lengths in cases.items():
        n = len(lengths)
        init = jax.random.normal(jax.random.key(3), (n, hv, dk, dv), F32) * 0.1
        yield name, jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32), n, init


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--only", action="append", choices=("forward", "backward"),
                        help="these passes' stages alone (repeatable; default both)")
    parser.add_argument("--no-fla", action="store_true", help="leave fla's stages out")
    parser.add_argument("--packed", action="store_true",
                        help="the packed forwards alone (packed_forwards), first shape")
    parser.add_argument("--fused-output", action="store_true",
                        help="the forward's output in the state pass or not "
                             "(fused_output_forms), both shapes")
    parser.add_argument("--mosaic-state", action="store_true",
                        help="the Mosaic GPU state pass beside the Triton one "
                             "(mosaic_state_passes), both shapes")
    parser.add_argument("--flag-forms", action="store_true",
                        help="each FLAG_FORMS flag both ways: its stage and its whole pass "
                             "(flag_forms), both shapes")
    args = parser.parse_args(argv)
    shapes = SMOKE if args.smoke else SHAPES
    if args.flag_forms:
        for name, shape in shapes.items():
            flag_forms(name, shape, args.smoke)
        return 0
    if args.mosaic_state:
        for name, shape in ({"tiny": (1, 128, 1, 2, 64, 64)} if args.smoke
                             else shapes).items():
            mosaic_state_passes(name, shape, args.smoke)
        return 0
    if args.fused_output:
        with_fla = not (args.smoke or args.no_fla) and peers.fla_missing() is None
        for name, shape in shapes.items():
            fused_output_forms(name, shape, args.smoke, with_fla)
        return 0
    if args.packed:
        with_fla = not (args.smoke or args.no_fla) and peers.fla_missing() is None
        packed_forwards(next(iter(shapes.values())), args.smoke, with_fla)
        return 0
    for i, (name, shape) in enumerate(shapes.items()):
        pallasite_stages(name, shape, interpret=args.smoke, sweep_warps=i == 0,
                         only=tuple(args.only or ("forward", "backward")))
        if i == 0:
            packed_state_passes(shape, interpret=args.smoke)
        if not (args.smoke or args.no_fla):
            why = peers.fla_missing()
            if why is None:
                try:
                    fla_stages(name, shape)
                except Exception as err:  # noqa: BLE001 - a peer's failure is reported
                    emit(dict(op="gated_delta_rule", shape=name, impl="fla.triton",
                              error=f"{type(err).__name__}: {err}"[:300]))
                peers.release_torch_memory()
            else:
                emit(dict(op="gated_delta_rule", shape=name, impl="fla.triton", missing=why))
    return 0


if __name__ == "__main__":
    sys.exit(main())
