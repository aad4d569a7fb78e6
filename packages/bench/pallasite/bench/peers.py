"""Peers outside JAX's core: tokamax, torch._grouped_mm, mamba_ssm's Triton SSD and
flash-linear-attention's gated delta rule.

Each is optional: `*_missing` returns why it cannot run (the record says "unsupported" with
that reason) and nothing here is imported until a peer is asked for.

- tokamax (pip wheel, see docs/benchmarks.md): `tokamax.ragged_dot(..., implementation=
  "mosaic")`. tokamax 0.0.17 imports xprof at import time for its own profiler; the wheel
  is carried with the others.
- torch._grouped_mm(x[m,k], w[g,k,n], offs=cumsum(group_sizes)) -> [m,n] bf16.
- torch._scaled_grouped_mm: the same product in e4m3 with rowwise scales (one per row of
  x, one per column of each group's kernel), operands quantized outside the timed call;
  and torch._scaled_mm on one dense [m,k] x [k,n] of the same size, rowwise too: the
  fp8 rate a grouped product of that size could approach on this device.
- mamba_ssm's `mamba_chunk_scan_combined` (Triton) from a source checkout given by
  --mamba-ssm-path, $PALLASITE_PEERS or ./.peers (the folder holding `mamba_ssm/`
  or a `mamba/` checkout). It takes (x, dt, A, B, C) and forms x*dt and A*dt itself;
  pallasite's inputs are x already scaled by dt and a = A*dt, so it gets dt = -a,
  A = -1 per head and x / dt: the same products, one bf16 rounding of x apart.

Inputs cross from JAX to torch by DLPack once per input set, outside the timed region,
and outputs come back the same way so one check serves every implementation.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from pallasite.bench import ops

DEFAULT_PEERS = ".peers"  # relative to where the benchmark was started


def _importable(name: str) -> str | None:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        return f"{name} not importable: {type(e).__name__}: {str(e)[:200]}"
    return None


def tokamax_missing() -> str | None:
    return _importable("tokamax")


def import_tokamax():
    return importlib.import_module("tokamax")


def torch_missing(attr: str) -> str | None:
    why = _importable("torch")
    if why:
        return why
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if not hasattr(torch, attr):
        return f"torch {torch.__version__} has no torch.{attr}"
    return None


def peers_path(explicit: str | None = None) -> str:
    return explicit or os.environ.get("PALLASITE_PEERS") or DEFAULT_PEERS


def _add_mamba_path(explicit: str | None) -> None:
    root = peers_path(explicit)
    for cand in (root, os.path.join(root, "mamba"), os.path.join(root, "mamba_ssm")):
        if os.path.isdir(os.path.join(cand, "mamba_ssm")) and cand not in sys.path:
            sys.path.insert(0, cand)
            return


def mamba_missing(explicit: str | None) -> str | None:
    why = torch_missing("cuda")
    if why:
        return why
    _add_mamba_path(explicit)
    why = _importable("mamba_ssm.ops.triton.ssd_combined")
    if why:
        return f"{why} (looked under {peers_path(explicit)})"
    return None


def fla_missing() -> str | None:
    """Why flash-linear-attention's gated delta rule cannot run (fla-core installed, or
    unpacked under the peers folder)."""
    why = torch_missing("cuda")
    if why:
        return why
    root = peers_path()
    if os.path.isdir(os.path.join(root, "fla")) and root not in sys.path:
        sys.path.insert(0, root)
    return _importable("fla.ops.gated_delta_rule")


# ------------------------------------------------------------------------------- adapters


def _to_torch(x):
    import torch

    return torch.from_dlpack(x)


def _to_jax(t):
    import jax.numpy as jnp

    return jnp.from_dlpack(t.contiguous())


def adapt_torch(name: str, case: ops.Case, inputs: dict) -> dict:
    import torch

    t = {k: _to_torch(v) for k, v in inputs.items()}
    if name == "torch._grouped_mm":
        t["offs"] = torch.cumsum(t["group_sizes"], 0).to(torch.int32)
        return t
    if name in ("torch._scaled_grouped_mm", "torch._scaled_mm.dense"):
        return _rowwise_fp8(t)
    if case.op == ops.MAMBA:  # the same arguments, as torch tensors
        return t
    if case.op == ops.GDR:  # fla takes cu_seqlens as int64
        if "cu_seqlens" in t:
            t["cu_seqlens"] = t["cu_seqlens"].long()
        return t
    # mamba_ssm: dt = -a (> 0), A = -1, x / dt so that x*dt is pallasite's x.
    dt = (-t["a"]).float().clamp_min(1e-30)
    t["mamba_x"] = (t["x"].float() / dt[..., None]).to(t["x"].dtype)
    t["dt"] = dt
    t["A"] = -torch.ones(case.d["h"], device=dt.device, dtype=torch.float32)
    return t


def build_torch(name: str, case: ops.Case, options: dict):
    if name == "torch._grouped_mm":
        return _grouped_mm(case)
    if name == "torch._scaled_grouped_mm":
        return _scaled_grouped_mm
    if name == "torch._scaled_mm.dense":
        return _scaled_mm_dense
    if name == "fla.triton":
        return _fla_gated_delta_rule(case)
    _add_mamba_path(options.get("mamba_ssm_path"))
    return _mamba_layer(case) if case.op == ops.MAMBA else _mamba(case)


def _row_major_ok() -> bool:
    """Whether this torch takes the [g,k,n] operand row-major (a tiny probe call)."""
    import torch

    x = torch.randn(32, 16, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 16, 16, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([16, 32], device="cuda", dtype=torch.int32)
    try:
        torch._grouped_mm(x, w, offs=offs, out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def _grouped_mm(case: ops.Case):
    import torch

    row_major = _row_major_ok()
    copies: dict[int, Any] = {}  # column-major copy per input set where torch wants one

    def weight(w):
        if row_major:
            return w
        if w.data_ptr() not in copies:
            copies[w.data_ptr()] = w.transpose(-2, -1).contiguous().transpose(-2, -1)
        return copies[w.data_ptr()]

    def fwd(t):
        return torch._grouped_mm(t["x"], weight(t["kernel"]), offs=t["offs"],
                                 out_dtype=t["x"].dtype)

    if case.direction == "fwd":
        return lambda t: (_to_jax(fwd(t)),)

    def fwd_bwd(t):
        x = t["x"].detach().requires_grad_(True)
        w = weight(t["kernel"]).detach().requires_grad_(True)
        y = torch._grouped_mm(x, w, offs=t["offs"], out_dtype=x.dtype)
        dx, dw = torch.autograd.grad(y, (x, w), t["dy"])
        return tuple(_to_jax(v) for v in (y.detach(), dx, dw))

    return fwd_bwd


def _rowwise(t, axis: int):
    """(e4m3 values, fp32 scales): one scale per slice along `axis` (amax / 448)."""
    import torch

    amax = t.float().abs().amax(dim=axis, keepdim=True).clamp_min(1e-12)
    scale = amax / 448.0
    return (t.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _rowwise_fp8(t: dict) -> dict:
    """The operands of torch's rowwise fp8 GEMMs: x per row; each group's kernel per
    output column, stored [g, n, k] and passed transposed (the column-major operand
    torch's fp8 kernels take)."""
    import torch

    xq, xs = _rowwise(t["x"], 1)
    w_t = t["kernel"].transpose(-2, -1).contiguous()  # [g, n, k]
    wq, ws = _rowwise(w_t, 2)
    t.update(xq=xq, xs=xs.squeeze(1).contiguous(), wq_t=wq, ws=ws.squeeze(2).contiguous(),
             offs=torch.cumsum(t["group_sizes"], 0).to(torch.int32))
    return t


def _scaled_grouped_mm(t):
    import torch

    y = torch._scaled_grouped_mm(t["xq"], t["wq_t"].transpose(-2, -1), t["xs"], t["ws"],
                                 offs=t["offs"], out_dtype=torch.bfloat16)
    return (_to_jax(y),)


def _scaled_mm_dense(t):
    """One dense [m, k] x [k, n] fp8 GEMM (group 0's kernel for every row). Its output is
    not the grouped product, so it is not compared (impls.Impl.checked)."""
    import torch

    y = torch._scaled_mm(t["xq"], t["wq_t"][0].t(), scale_a=t["xs"][:, None],
                         scale_b=t["ws"][0][None, :], out_dtype=torch.bfloat16)
    return (_to_jax(y),)


def _mamba(case: ops.Case):
    import torch
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    chunk = case.d["chunk"]

    def run(t, grads):
        args = [t["mamba_x"], t["dt"], t["A"], t["b"], t["c"]]
        init = t["initial_state"]
        if grads:
            args = [a.detach().requires_grad_(True) for a in args]
            init = init.detach().requires_grad_(True)
        y, final = mamba_chunk_scan_combined(*args, chunk, initial_states=init,
                                             return_final_states=True)
        if not grads:
            return (_to_jax(y), _to_jax(final))
        torch.autograd.backward((y, final), (t["dy"], t["dfinal"]))
        # Gradients are w.r.t. mamba's (x, dt, A) parametrisation: time them, compare only y.
        return (_to_jax(y.detach()), _to_jax(final.detach()))

    return lambda t: run(t, case.direction == "fwd_bwd")


def _mamba_layer(case: ops.Case):
    """mamba_chunk_scan_combined with a Mamba-2 layer's options (dt_bias, softplus, D, z,
    and seq_idx when packed): its gradients are of the same nine arguments as
    pallasite's, so all are compared."""
    import torch
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    chunk = case.d["chunk"]

    def run(t, grads):
        args = [t[k] for k in ops.MAMBA_ARGS]
        if grads:
            args = [a.detach().requires_grad_(True) for a in args]
        x, dt, A, B, C, D, z, dt_bias, init = args
        y, final = mamba_chunk_scan_combined(
            x, dt, A, B, C, chunk, D=D, z=z, dt_bias=dt_bias, initial_states=init,
            seq_idx=t.get("seq_idx"), dt_softplus=True, return_final_states=True)
        if not grads:
            return (_to_jax(y), _to_jax(final))
        got = torch.autograd.grad((y, final), args, (t["dy"], t["dfinal"]))
        return tuple(_to_jax(v) for v in (y.detach(), final.detach(), *got))

    return lambda t: run(t, case.direction == "fwd_bwd")


def _fla_gated_delta_rule(case: ops.Case):
    """fla's chunk_gated_delta_rule on the same inputs (its layout is pallasite's): o, the
    final states and, for fwd_bwd, the gradients of the same six arguments."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def run(t, grads):
        args = [t[k] for k in ops.DELTA_ARGS]
        if grads:
            args = [a.detach().requires_grad_(True) for a in args]
        q, k, v, g, beta, init = args
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init,
                                          output_final_state=True,
                                          cu_seqlens=t.get("cu_seqlens"))
        if not grads:
            return (_to_jax(o), _to_jax(final))
        got = torch.autograd.grad((o, final), args, (t["do"], t["dfinal"]))
        return tuple(_to_jax(x) for x in (o.detach(), final.detach(), *got))

    return lambda t: run(t, case.direction == "fwd_bwd")


def torch_sync() -> None:
    import torch

    torch.cuda.synchronize()


def release_torch_memory() -> None:
    """Give torch's cached, unused GPU memory back (when torch is loaded and has a GPU):
    JAX and torch share the device in one process, and each keeps what it freed."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def versions() -> dict[str, Any]:
    """Versions of the peer stacks that are importable (for backend_env)."""
    out = {}
    for name in ("torch", "triton", "tokamax"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", "?")
    return out
