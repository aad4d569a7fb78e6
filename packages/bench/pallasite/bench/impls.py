"""The implementations a case runs through: pallasite's backends and the peers beside them.

Each `Impl` says where it runs (`unavailable` gives the reason where it cannot, which the
record keeps as status "unsupported") and builds a function from an input set (the dict of
ops.make_inputs) to the tuple of outputs the checks compare:
grouped_projection fwd (y,), fwd_bwd (y, dx, dkernel); chunk_ssd fwd (y, final_state),
fwd_bwd (y, final_state, dx, da, db, dc, dinitial_state); mamba_chunk_scan fwd (y,
final_state), fwd_bwd (y, final_state, then the gradients of ops.MAMBA_ARGS in order);
grouped_mlp fwd (y,), fwd_bwd (y, dx, dgate_up, ddown); gated_delta_rule fwd (o,
final_state), fwd_bwd (o, final_state, then the gradients of ops.DELTA_ARGS in order).

pallasite's kernels are imported lazily, so a backend that has not landed, or a peer that is
not installed, becomes an "unsupported" record and the CLI still runs. On a CPU the Pallas
kernels run through the interpreters (parity only: interpreter time says nothing about a
GPU); the XLA paths and jax.lax.ragged_dot are timed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pallasite.bench import ops, peers

_INTERPRETABLE = ("pallas_triton", "pallas_mosaic_tpu", "pallas_mosaic_gpu")


_WIDE = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    op: str
    peer: bool  # a reference point, not pallasite's own code
    framework: str = "jax"  # "jax" (jitted, compiled ahead) or "torch"
    dtypes: tuple[str, ...] = _WIDE  # the case dtypes it runs ("fp8": the fp8 recipe)
    directions: tuple[str, ...] = ops.DIRECTIONS
    # False: its outputs are not the case's product (a ceiling measured beside it), so
    # they are not compared (the record says so).
    checked: bool = True


# "<backend>.quantized": the fp8 forward of operands quantized beforehand (BlockScaled,
# made outside the timed call), the product alone, as the fp8 peers are timed.
QUANTIZED = ".quantized"
# "<backend>.fused": grouped_mlp(fuse_activation=True) on the backend: the gate-up through
# its fused kernel (act(gate) * up in the epilogue, the pre-activation recomputed in the
# backward), then the down product on the same backend.
FUSED = ".fused"

IMPLS: tuple[Impl, ...] = (
    Impl("pallas_mosaic_gpu", ops.GP, False, dtypes=_WIDE + (ops.FP8,)),
    Impl("pallas_triton", ops.GP, False, dtypes=_WIDE + (ops.FP8,)),
    Impl("pallas_mosaic_tpu", ops.GP, False),
    Impl("xla", ops.GP, False, dtypes=_WIDE + (ops.FP8,)),
    Impl("pallas_mosaic_gpu" + QUANTIZED, ops.GP, False, dtypes=(ops.FP8,), directions=("fwd",)),
    Impl("pallas_triton" + QUANTIZED, ops.GP, False, dtypes=(ops.FP8,), directions=("fwd",)),
    Impl("jax.lax.ragged_dot", ops.GP, True),
    Impl("tokamax.mosaic", ops.GP, True),
    Impl("torch._grouped_mm", ops.GP, True, "torch"),
    # torch's fp8 grouped GEMM (rowwise scales, pre-quantized operands) and its dense fp8
    # GEMM of the same m, k, n (the ceiling a grouped product can approach).
    Impl("torch._scaled_grouped_mm", ops.GP, True, "torch", dtypes=(ops.FP8,),
         directions=("fwd",)),
    Impl("torch._scaled_mm.dense", ops.GP, True, "torch", dtypes=(ops.FP8,),
         directions=("fwd",), checked=False),
    Impl("pallas_triton", ops.SSD, False),
    Impl("pallas_mosaic_tpu", ops.SSD, False),
    Impl("xla", ops.SSD, False),
    Impl("reference.ssd_chunked", ops.SSD, True),
    Impl("mamba_ssm.triton", ops.SSD, True, "torch"),
    Impl("pallas_triton", ops.MAMBA, False),
    Impl("pallas_mosaic_tpu", ops.MAMBA, False),
    Impl("xla", ops.MAMBA, False),
    Impl("mamba_ssm.triton", ops.MAMBA, True, "torch"),
    Impl("pallas_mosaic_gpu", ops.GMLP, False, dtypes=_WIDE + (ops.FP8,)),
    Impl("pallas_triton", ops.GMLP, False, dtypes=_WIDE + (ops.FP8,)),
    Impl("xla", ops.GMLP, False, dtypes=_WIDE + (ops.FP8,)),
    # in fp8 cases: h quantized in the gate-up kernel's epilogue (grouped_mlp's fp8 route,
    # its fused kernels on the backend named)
    Impl("pallas_mosaic_gpu" + FUSED, ops.GMLP, False, dtypes=("bfloat16", "float16", ops.FP8)),
    Impl("pallas_triton" + FUSED, ops.GMLP, False, dtypes=_WIDE + (ops.FP8,)),
    # The baseline grouped_mlp is measured against: the gate-up product rounded to bf16
    # ([m, 2f] written and read back), the SwiGLU in XLA, the down product: three
    # grouped_projection-era steps, on pallasite's default backends.
    Impl("unfused", ops.GMLP, True),
    Impl("pallas_triton", ops.GDR, False),
    Impl("pallas_mosaic_tpu", ops.GDR, False),
    Impl("xla", ops.GDR, False),
    Impl("fla.triton", ops.GDR, True, "torch"),  # flash-linear-attention (fla-core)
)


@dataclasses.dataclass(frozen=True)
class Platform:
    backend: str  # jax.default_backend(): "cpu", "gpu", "tpu"
    triton: bool
    mosaic_gpu: bool

    @property
    def interpret(self) -> bool:
        return self.backend == "cpu"


def current_platform() -> Platform:
    import jax

    from pallasite.kernels import platform

    return Platform(jax.default_backend(), platform.triton_runs(), platform.mosaic_gpu_runs())


def unavailable(impl: Impl, plat: Platform, options: dict) -> str | None:
    """Why `impl` cannot run here, or None."""
    name = impl.name
    name = name.removesuffix(QUANTIZED).removesuffix(FUSED)
    if name == "pallas_mosaic_gpu" and not (plat.mosaic_gpu or plat.interpret):
        return "Mosaic GPU needs a Hopper GPU (sm90)"
    if name == "pallas_triton" and not (plat.triton or plat.interpret):
        return "Pallas Triton needs a CUDA GPU from sm80"
    if name == "pallas_mosaic_tpu" and plat.backend not in ("tpu", "cpu"):
        return "Mosaic TPU needs a TPU (or the CPU interpreter)"
    if impl.framework == "torch" and plat.backend != "gpu":
        return f"{name} needs a CUDA GPU (torch/triton)"
    if name == "tokamax.mosaic":
        if plat.backend == "cpu":
            return "tokamax's mosaic ragged_dot needs a GPU or TPU"
        return peers.tokamax_missing()
    if name in ("torch._grouped_mm", "torch._scaled_grouped_mm"):
        return peers.torch_missing(name.removeprefix("torch."))
    if name == "torch._scaled_mm.dense":
        return peers.torch_missing("_scaled_mm")
    if name == "mamba_ssm.triton":
        return peers.mamba_missing(options.get("mamba_ssm_path"))
    if name == "fla.triton":
        return peers.fla_missing()
    return None


def parity_only(impl: Impl, plat: Platform) -> bool:
    """Interpreter runs: checked for parity, not timed."""
    return (plat.interpret
            and impl.name.removesuffix(QUANTIZED).removesuffix(FUSED) in _INTERPRETABLE)


# --------------------------------------------------------------------- grouped_projection


def _gp_forward(impl: Impl, plat: Platform, dtype, block_sizes, recipe=None) -> Callable:
    import jax

    if impl.name == "jax.lax.ragged_dot":
        return lambda x, w, gs: jax.lax.ragged_dot(x, w, gs, preferred_element_type=dtype)
    if impl.name == "tokamax.mosaic":
        tokamax = peers.import_tokamax()
        return lambda x, w, gs: tokamax.ragged_dot(
            x, w, gs, preferred_element_type=dtype, implementation="mosaic")
    from pallasite import kernels

    return lambda x, w, gs: kernels.grouped_projection(
        x, w, gs, dtype, plat.interpret, implementation=impl.name, block_sizes=block_sizes,
        recipe=recipe)


def _gp_quantized(impl: Impl, plat: Platform, block_sizes) -> Callable:
    """The fp8 forward of the input set's pre-quantized operands (ops.make_inputs)."""
    from pallasite import kernels

    def run(i):
        x = kernels.BlockScaled(i["x_values"], i["x_scales"], (1, 128))
        w = kernels.BlockScaled(i["kernel_values"], i["kernel_scales"], (1, 128, 128))
        return (kernels.grouped_projection(
            x, w, i["group_sizes"], ops._dtype("bfloat16"), plat.interpret,
            implementation=impl.name.removesuffix(QUANTIZED), block_sizes=block_sizes),)

    return run


def build_grouped_projection(impl, case, plat, block_sizes=None) -> Callable:
    import jax

    if impl.name.endswith(QUANTIZED):
        return jax.jit(_gp_quantized(impl, plat, block_sizes))
    fp8 = case.dtype == ops.FP8
    dtype = ops._dtype("bfloat16" if fp8 else case.dtype)
    fwd = _gp_forward(impl, plat, dtype, block_sizes, "fp8" if fp8 else None)
    if case.direction == "fwd":
        return jax.jit(lambda i: (fwd(i["x"], i["kernel"], i["group_sizes"]),))

    def fwd_bwd(i):
        y, vjp = jax.vjp(lambda x, w: fwd(x, w, i["group_sizes"]), i["x"], i["kernel"])
        return (y, *vjp(i["dy"]))

    return jax.jit(fwd_bwd)


# ------------------------------------------------------------------------------ chunk_ssd


def _chunked(t, chunk):
    """[b, l, ...] -> [b, l/chunk, chunk, ...] (the kernels' layout)."""
    return t.reshape(t.shape[0], t.shape[1] // chunk, chunk, *t.shape[2:])


def _flat(t):
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:])


def _ssd_backend(impl, chunk, block_sizes) -> Callable:
    """The backend module's forward/backward in the chunked layout, interpreted on CPU.

    chunk_ssd has no interpreter switch, so parity on CPU calls the backend contract
    (forward -> chunk_states -> backward) directly.
    """
    import importlib

    mod = importlib.import_module(f"pallasite.kernels.ssd.{impl.name}")
    interp = True
    if impl.name == "pallas_mosaic_tpu":
        from jax.experimental.pallas import tpu as pltpu

        interp = pltpu.InterpretParams()

    def run(i, with_grads):
        xs, as_, bs, cs = (_chunked(i[k], chunk) for k in ("x", "a", "b", "c"))
        y, final, states = mod.forward(xs, as_, bs, cs, i["initial_state"], interpret=interp,
                                       block_sizes=block_sizes)
        if not with_grads:
            return _flat(y), final
        grads = mod.backward(xs, as_, bs, cs, states, _chunked(i["dy"], chunk), i["dfinal"],
                             interpret=interp, block_sizes=block_sizes)
        dx, da, db, dc, dinit = grads
        return (_flat(y), final, _flat(dx), _flat(da), _flat(db), _flat(dc), dinit)

    return run


def _ssd_forward(impl, plat, chunk, block_sizes) -> Callable:
    if impl.name == "reference.ssd_chunked":
        from pallasite.reference import ssd as ref_ssd

        return lambda x, a, b, c, s: ref_ssd.ssd_chunked(
            x, a, b, c, chunk_size=chunk, initial_state=s)
    from pallasite import kernels

    return lambda x, a, b, c, s: kernels.chunk_ssd(
        x, a, b, c, chunk_size=chunk, initial_state=s, implementation=impl.name,
        block_sizes=block_sizes)


def build_ssd(impl, case, plat, block_sizes=None) -> Callable:
    import jax

    chunk = case.d["chunk"]
    if parity_only(impl, plat):
        run = _ssd_backend(impl, chunk, block_sizes)
        return jax.jit(lambda i: run(i, case.direction == "fwd_bwd"))
    fwd = _ssd_forward(impl, plat, chunk, block_sizes)
    names = ("x", "a", "b", "c", "initial_state")
    if case.direction == "fwd":
        return jax.jit(lambda i: tuple(fwd(*(i[k] for k in names))))

    def fwd_bwd(i):
        (y, final), vjp = jax.vjp(fwd, *(i[k] for k in names))
        return (y, final, *vjp((i["dy"], i["dfinal"])))

    return jax.jit(fwd_bwd)


def ssd_grads_reference(case: ops.Case, inputs: dict) -> tuple | None:
    """Gradients of the XLA implementation with every input in fp32 (None if it is absent)."""
    import jax
    import jax.numpy as jnp

    try:
        from pallasite import kernels

        chunk_ssd = kernels.chunk_ssd
    except (ImportError, AttributeError):
        return None
    names = ("x", "a", "b", "c", "initial_state")
    args = [inputs[k].astype(jnp.float32) for k in names]

    def fn(x, a, b, c, s):
        return chunk_ssd(x, a, b, c, chunk_size=case.d["chunk"], initial_state=s,
                         implementation="xla")

    _, vjp = jax.vjp(fn, *args)
    return vjp((inputs["dy"].astype(jnp.float32), inputs["dfinal"]))


# ----------------------------------------------------------------------- mamba_chunk_scan


def _mamba_forward(name: str, chunk: int, block_sizes) -> Callable:
    """(x, dt, A, B, C, D, z, dt_bias, initial_state, seq_idx) -> (y, final_state): the
    options a Mamba-2 layer turns on. The Pallas backends interpret on a CPU (chunk_ssd's
    own choice there), so one path serves parity and timing."""
    from pallasite import kernels

    def fwd(x, dt, A, B, C, D, z, dt_bias, initial_state, seq_idx):
        return kernels.mamba_chunk_scan(
            x, dt, A, B, C, chunk, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
            initial_states=initial_state, seq_idx=seq_idx, return_final_states=True,
            implementation=name, block_sizes=block_sizes)

    return fwd


def _scan_call(fwd, direction: str, arrays: tuple[str, ...], extra: str,
               cotangents: tuple[str, str]) -> Callable:
    """A scan with a final state, jitted for the case's direction: fwd(*arrays, extra)
    -> (out, final), where `extra` is an input that is not differentiated (seq_idx,
    cu_seqlens; absent: None); fwd_bwd returns (out, final, *gradients of `arrays`) at
    the input set's `cotangents` of (out, final)."""
    import jax

    if direction == "fwd":
        return jax.jit(lambda i: tuple(fwd(*(i[k] for k in arrays), i.get(extra))))

    def fwd_bwd(i):
        (out, final), vjp = jax.vjp(lambda *t: fwd(*t, i.get(extra)),
                                    *(i[k] for k in arrays))
        return (out, final, *vjp(tuple(i[k] for k in cotangents)))

    return jax.jit(fwd_bwd)


def _xla_grads(build, case: ops.Case, inputs: dict) -> tuple | None:
    """The gradients (outputs[2:]) of `build`'s XLA implementation with every floating
    input in fp32; None where pallasite's kernels do not import."""
    import jax.numpy as jnp

    try:
        run = build(None, case, None, name="xla")
    except (ImportError, AttributeError):
        return None
    wide = {k: (v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v)
            for k, v in inputs.items()}
    return run(wide)[2:]


def build_mamba(impl, case, plat, block_sizes=None, name=None) -> Callable:
    fwd = _mamba_forward(name or impl.name, case.d["chunk"], block_sizes)
    return _scan_call(fwd, case.direction, ops.MAMBA_ARGS, "seq_idx", ("dy", "dfinal"))


def mamba_grads_reference(case: ops.Case, inputs: dict) -> tuple | None:
    """The nine gradients of the XLA implementation with every input in fp32."""
    return _xla_grads(build_mamba, case, inputs)


# ---------------------------------------------------------------------------- grouped_mlp


def _mlp_forward(impl, plat, dtype, block_sizes, recipe=None) -> Callable:
    from pallasite import kernels

    if impl.name == "unfused":
        def unfused(x, gate_up, down, gs):
            import jax

            pre = kernels.grouped_projection(x, gate_up, gs, dtype, plat.interpret)
            f = down.shape[1]
            h = (jax.nn.silu(pre[:, :f].astype("float32")) * pre[:, f:]).astype(dtype)
            return kernels.grouped_projection(h, down, gs, dtype, plat.interpret)
        return unfused
    if impl.name.endswith(FUSED):
        return lambda x, gate_up, down, gs: kernels.grouped_mlp(
            x, gate_up, down, gs, dtype, plat.interpret,
            implementation=impl.name.removesuffix(FUSED), fuse_activation=True,
            recipe=recipe)
    return lambda x, gate_up, down, gs: kernels.grouped_mlp(
        x, gate_up, down, gs, dtype, plat.interpret, implementation=impl.name,
        block_sizes=block_sizes, recipe=recipe)


def build_grouped_mlp(impl, case, plat, block_sizes=None) -> Callable:
    import jax

    fp8 = case.dtype == ops.FP8  # recipe="fp8": bf16 operands and outputs
    fwd = _mlp_forward(impl, plat, ops._dtype("bfloat16" if fp8 else case.dtype), block_sizes,
                       "fp8" if fp8 else None)
    if case.direction == "fwd":
        return jax.jit(lambda i: (fwd(i["x"], i["gate_up"], i["down"], i["group_sizes"]),))

    def fwd_bwd(i):
        y, vjp = jax.vjp(lambda *t: fwd(*t, i["group_sizes"]), i["x"], i["gate_up"],
                         i["down"])
        return (y, *vjp(i["dy"]))

    return jax.jit(fwd_bwd)


# ------------------------------------------------------------------------ gated delta rule


def build_gated_delta_rule(impl, case, plat, block_sizes=None, name=None) -> Callable:
    from pallasite import kernels

    def fwd(q, k, v, g, beta, initial_state, cu_seqlens):
        return kernels.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
            cu_seqlens=cu_seqlens, chunk_size=case.d["chunk"],
            implementation=name or impl.name, block_sizes=block_sizes)

    return _scan_call(fwd, case.direction, ops.DELTA_ARGS, "cu_seqlens", ("do", "dfinal"))


def delta_grads_reference(case: ops.Case, inputs: dict) -> tuple | None:
    """The six gradients of the XLA form with every float input in fp32."""
    return _xla_grads(build_gated_delta_rule, case, inputs)


# --------------------------------------------------------------------------------- build


# Which block-size class `--block-sizes` (a JSON dict) builds for each kernel.
_BLOCK_SIZES = {
    (ops.GP, "pallas_triton"): ("pallasite.kernels.grouped_matmul.config", "TritonBlockSizes"),
    (ops.GP, "pallas_mosaic_tpu"): ("pallasite.kernels.grouped_matmul.config",
                                    "MosaicTpuBlockSizes"),
    (ops.GP, "pallas_mosaic_gpu"): ("pallasite.kernels.grouped_matmul.pallas_mosaic_gpu",
                                    "MosaicGpuBlockSizes"),
    (ops.SSD, "pallas_triton"): ("pallasite.kernels.ssd.pallas_triton", "BlockSizes"),
    (ops.SSD, "pallas_mosaic_tpu"): ("pallasite.kernels.ssd.pallas_mosaic_tpu", "BlockSizes"),
    (ops.MAMBA, "pallas_triton"): ("pallasite.kernels.ssd.pallas_triton", "BlockSizes"),
    (ops.MAMBA, "pallas_mosaic_tpu"): ("pallasite.kernels.ssd.pallas_mosaic_tpu",
                                       "BlockSizes"),
}


def block_sizes_for(impl: Impl, raw: dict | None) -> Any:
    """`raw` (field -> value) as the kernel's block-size class; None stays None (the
    kernel's tuned table or default). An implementation without block sizes cannot honour
    them, so it is reported unsupported rather than timed under a config it ignores."""
    import importlib

    if raw is None:
        return None
    if (impl.op, impl.name) == (ops.GDR, "pallas_triton"):
        return dict(raw)  # the op takes a plain dict and checks it by name
    where = _BLOCK_SIZES.get((impl.op, impl.name))
    if where is None:
        raise NotImplementedError(f"{impl.name} takes no block sizes (--block-sizes)")
    from pallasite.tuning import config_from_dict
    from pallasite.tuning.configs import StaleConfig

    try:
        return config_from_dict(getattr(importlib.import_module(where[0]), where[1]), raw)
    except StaleConfig as err:
        raise ValueError(f"--block-sizes {raw} does not fit {impl.name}: {err}") from err


def build(impl: Impl, case: ops.Case, plat: Platform, options: dict) -> Callable[[dict], Any]:
    """A function from one input set to the outputs tuple (jitted for JAX impls).

    Torch peers take the same dict (their `adapt` converts it once per set, outside the
    timed region) and return JAX arrays through DLPack, so one check serves all.
    """
    block_sizes = block_sizes_for(impl, options.get("block_sizes"))
    if impl.framework == "torch":
        return peers.build_torch(impl.name, case, options)
    if case.op == ops.GP:
        return build_grouped_projection(impl, case, plat, block_sizes)
    if case.op == ops.MAMBA:
        return build_mamba(impl, case, plat, block_sizes)
    if case.op == ops.GMLP:
        return build_grouped_mlp(impl, case, plat, block_sizes)
    if case.op == ops.GDR:
        return build_gated_delta_rule(impl, case, plat, block_sizes)
    return build_ssd(impl, case, plat, block_sizes)


def adapt(impl: Impl, case: ops.Case, inputs: dict, options: dict) -> Any:
    """The input set in the form `build`'s function takes (torch tensors for torch peers)."""
    if impl.framework == "torch":
        return peers.adapt_torch(impl.name, case, inputs)
    return inputs


def select(op: str, patterns: list[str] | None, dtype: str | None = None,
           direction: str | None = None) -> list[Impl]:
    """The op's implementations whose name contains any of `patterns` (all if none), of
    those that run `dtype` cases in `direction` (any, where None)."""
    chosen = [i for i in IMPLS if i.op == op and (dtype is None or dtype in i.dtypes)
              and (direction is None or direction in i.directions)]
    if patterns:
        chosen = [i for i in chosen if any(p in i.name for p in patterns)]
    return chosen
