"""Run one (case, implementation): build, compile, time, check, and make its record."""

from __future__ import annotations

import gc
import json
import re
import traceback

from pallasite.bench import harness, impls, ops, peers, placement, roofline
from pallasite.bench.records import Record

# Exceptions that mean "this implementation does not do this here", not "it broke".
_UNSUPPORTED = (NotImplementedError, ImportError, ModuleNotFoundError)


# chunk_ssd's refusal of a geometry: "no implementation ran:\n  <name>: <predicate reason>";
# a backend that raised shows "<name>: SomeError: ..." there instead, and stays "crashed".
_REFUSED = re.compile(r"no implementation ran:\n\s*[\w.]+: (?![A-Z]\w*(Error|Exception)\b)")


def _unsupported_message(exc: BaseException) -> bool:
    text = str(exc)
    lower = text.lower()
    return (isinstance(exc, _UNSUPPORTED) or "not supported" in lower
            or "unsupported" in lower or bool(_REFUSED.search(text)))


class Context:
    """What every record of a run shares: device, roofline, environment, options."""

    def __init__(self, options: dict, roof: roofline.Roofline | None = None):
        import jax

        self.options = options
        self.platform = impls.current_platform()
        self.device = jax.devices()[0]
        self.roof = roof or roofline.for_device(self.device)
        from pallasite.bench import records

        self.env = records.environment()
        self._inputs: dict[ops.Case, list] = {}
        self.grads: dict[ops.Case, tuple | None] = {}

    def base(self, case: ops.Case, impl: impls.Impl, status: str, used: str = "",
             **kw) -> Record:
        """`used`: the block sizes the compiled function chose (`used_block_sizes`); the
        caller's `--block-sizes` where given, since those are what ran."""
        block_sizes = self.options.get("block_sizes")
        return Record(
            kernel=case.kernel, implementation=impl.name, shape=case.shape, dtype=case.dtype,
            backend=self.platform.backend, device_kind=self.device.device_kind,
            device_count=case.devices, mesh=case.mesh_name,
            block_sizes=json.dumps(block_sizes) if block_sizes else used,
            status=status, peer=impl.peer, flops=case.flops, bytes=case.bytes,
            roofline=self.roof.name, **self.env, **{"bound": self._bound(case), **kw})

    def _bound(self, case: ops.Case) -> str:
        return roofline.classify(case.flops, case.bytes, case.dtype, self.roof).bound

    def inputs(self, case: ops.Case) -> list[dict]:
        """The rotated input sets of `case` (made once per case, shared by every impl)."""
        if case not in self._inputs:
            self._inputs.clear()  # one case's sets at a time: the full shapes are GBs
            first = ops.make_inputs(case, seed=0)
            budget = self.options.get("input_budget_bytes") or (
                256 << 20 if self.platform.backend == "cpu" else 16 << 30)
            copies = harness.rotation_copies(ops.input_bytes(first), self.roof.l2_bytes, budget)
            if self.options.get("copies"):
                copies = int(self.options["copies"])
            self._inputs[case] = [placement.place(case, s) for s in [first] + [
                ops.make_inputs(case, seed=s) for s in range(1, copies)]]
        return self._inputs[case]


def used_block_sizes(selections) -> str:
    """JSON {implementation: config fields} of the block sizes a traced function chose
    (pallasite.tuning.recording), "" where it chose none (XLA paths, peers)."""
    from pallasite.tuning import config_to_dict

    used = {impl: dict(config_to_dict(sel.config)) for _, impl, sel in selections}
    return json.dumps(used, sort_keys=True) if used else ""


def _check(case, impl, ctx, inputs, outputs) -> ops.Error:
    if not impl.checked:
        nan = float("nan")
        return ops.Error(nan, nan, nan, nan, "not compared: a ceiling, not this product", True)
    if case.mesh:  # the checks index and slice: on whole copies, on one device
        inputs, outputs = placement.gathered(inputs), placement.gathered(outputs)
    if case.op == ops.GP:
        return ops.check_grouped_projection(case, inputs, outputs)
    if case.op == ops.GMLP:
        return ops.check_grouped_mlp(case, inputs, outputs)
    if case.op in (ops.MAMBA, ops.GDR):  # every implementation differentiates the same
        grads = None                       # arguments, peers included
        if case.direction == "fwd_bwd":
            if case not in ctx.grads:
                ctx.grads.clear()
                reference = (impls.mamba_grads_reference if case.op == ops.MAMBA
                             else impls.delta_grads_reference)
                ctx.grads[case] = reference(case, inputs)
            grads = ctx.grads[case]
        check = ops.check_mamba if case.op == ops.MAMBA else ops.check_gated_delta_rule
        return check(case, inputs, outputs, grads)
    grads = None
    if case.direction == "fwd_bwd" and impl.framework == "jax":
        if case not in ctx.grads:  # one fp32 XLA backward per case, shared by its impls
            ctx.grads.clear()
            ctx.grads[case] = impls.ssd_grads_reference(case, inputs)
        grads = ctx.grads[case]
    return ops.check_ssd(case, inputs, outputs, grads)


def _mesh_refusal(case: ops.Case, impl: impls.Impl) -> str | None:
    """Why a sharded case does not run `impl` here, or None."""
    import jax

    if not case.mesh:
        return None
    if impl.peer:
        return "peers are timed on one device"
    if case.devices > jax.device_count():
        return f"needs {case.devices} devices ({case.mesh_name}); {jax.device_count()} here"
    return None


def run_one(case: ops.Case, impl: impls.Impl, ctx: Context) -> Record:
    """The record of `impl` on `case`: unsupported, crashed, wrong or ok (see records.py)."""
    why = impls.unavailable(impl, ctx.platform, ctx.options) or _mesh_refusal(case, impl)
    if why:
        return ctx.base(case, impl, "unsupported", reason=why)
    try:
        return _measure(case, impl, ctx)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a record
        status = "unsupported" if _unsupported_message(exc) else "crashed"
        reason = f"{type(exc).__name__}: {str(exc)[:400]}"
        if ctx.options.get("verbose"):
            traceback.print_exc()
        return ctx.base(case, impl, status, reason=reason)
    finally:
        _release_memory()


def _release_memory() -> None:
    """Drop what the finished implementation left on the device: its outputs and
    compiled function (garbage once collected) and torch's cache. Without this a long
    run of full-size cases ran out of memory on an H200 (torch's cache and JAX's pool
    together held 127 GiB by the fifth fp8 case)."""
    gc.collect()
    peers.release_torch_memory()


def _measure(case, impl, ctx) -> Record:
    sets = ctx.inputs(case)
    fn = impls.build(impl, case, ctx.platform, ctx.options)
    adapted = [impls.adapt(impl, case, s, ctx.options) for s in sets]
    kw_used: dict = {}
    if impl.framework == "torch":
        sync = lambda _out: peers.torch_sync()  # noqa: E731
        import time

        start = time.perf_counter()
        outputs = fn(adapted[0])
        sync(outputs)
        call, compile_s = fn, time.perf_counter() - start
    else:
        from pallasite import tuning

        sync = harness.jax_sync
        with tuning.recording() as selections:
            call, compile_s = harness.compile_jax(fn, adapted[0])
        kw_used["used"] = used_block_sizes(selections)
        kw_used["temp_bytes"] = harness.temp_bytes(call)
        outputs = call(adapted[0])
        sync(outputs)
    error = _check(case, impl, ctx, sets[0], outputs)
    kw = dict(compile_time=compile_s, input_copies=len(sets), error_max_abs=error.max_abs,
              error_mean_abs=error.mean_abs, error_rel_l2=error.rel_l2,
              error_reference=error.reference, **kw_used)
    status = "ok" if error.ok else "wrong"
    if impls.parity_only(impl, ctx.platform):
        return ctx.base(case, impl, status, timing="parity only (interpreter)",
                        reason="kernel timings need a GPU/TPU", **kw)
    o = ctx.options
    t = harness.steady_state(call, adapted, sync, compile_s=compile_s,
                             warmup=o.get("warmup", 3), samples=o.get("samples", 15),
                             budget_s=o.get("budget_s", 20.0))
    cls = roofline.classify(case.flops, case.bytes, case.dtype, ctx.roof, t.median_s)
    return ctx.base(
        case, impl, status, timing="host" if ctx.platform.backend == "cpu" else "device",
        steady_state_time=t.median_s, time_p10=t.p10_s, time_p90=t.p90_s, time_min=t.min_s,
        samples=t.samples, calls_per_sample=t.calls_per_sample, host_issue_time=t.issue_s,
        tflops=case.flops / t.median_s / 1e12, tbps=case.bytes / t.median_s / 1e12,
        bound=cls.bound, roofline_fraction=cls.fraction, **kw)
