"""The bounded autotuner: time a few candidate configs, keep the fastest correct one.

Bounded three ways: at most `max_candidates` configs (the tables' lists hold a few dozen),
a wall-clock `budget_s` checked before each candidate and each timed run (a candidate that
starts inside the budget may finish past it; the rest are recorded as skipped), and a
handful of timed runs per candidate (the median is kept: one slow run from a clock change
or a neighbour's kernel does not decide).

Every candidate leaves a Trial whose status says what happened:
  ok              ran, matched the reference, timed;
  does_not_fit    refused by the kernel's `fits` rule for this shape, never built;
  compile_error   building or the first (compiling) call raised;
  smem_overflow   the same, where the error says the config wants more shared memory
                  (or TPU VMEM) than the chip has: a property of the config, not a bug;
  runtime_error   a later, timed call raised;
  wrong_result    ran, but the output is not within tolerance of the reference;
  skipped_budget  not tried: the time budget was spent.

The kernel side supplies a Benchmark: `build(config)` returns a zero-argument function that
runs the kernel with that config on fixed synthetic inputs of the real shapes and dtypes;
`reference()` gives the expected output on the same inputs. The tuner never sees arrays'
meaning, only pytrees it compares in float64.

Kernels resolve block sizes while being traced (under jit, custom_vjp, shard_map), where
every jax operation is staged into the caller's trace instead of run. The tuner therefore
runs in a worker thread: JAX's trace state is per thread, so there the benchmark's inputs
are built and the candidates compile and run as plain calls. `bench` may be a zero-argument
function returning the Benchmark so that its synthetic inputs are made in that thread too:
made on the tracing thread they would be the caller's tracers. (`jax.ensure_compile_time_eval()`
is no substitute: it also evaluates input-free primitives such as `pl.program_id` while Pallas
traces a kernel body for compilation, "Evaluation rule for 'program_id' not implemented", so
every compiled candidate would fail to build; only the interpreter survives it.)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

OK = "ok"
DOES_NOT_FIT = "does_not_fit"
COMPILE_ERROR = "compile_error"
SMEM_OVERFLOW = "smem_overflow"
RUNTIME_ERROR = "runtime_error"
WRONG_RESULT = "wrong_result"
SKIPPED_BUDGET = "skipped_budget"

DEFAULT_BUDGET_S = 60.0
DEFAULT_MAX_CANDIDATES = 24

# Triton: "out of resource: shared memory, Required: ..."; XLA/Mosaic GPU: "shared memory
# ... exceeds"; Mosaic TPU: "scoped vmem limit" / RESOURCE_EXHAUSTED.
_SMEM_PATTERN = re.compile(r"shared[ _]mem|smem|out of resource|resource_exhausted|vmem", re.I)


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """How to run one config on synthetic inputs, and what it must produce."""

    build: Callable[[Any], Callable[[], Any]]
    reference: Callable[[], Any]
    atol: float = 2e-2
    rtol: float = 2e-2
    warmup: int = 1
    reps: int = 5


@dataclasses.dataclass(frozen=True)
class Trial:
    config: Any
    status: str
    time_s: float | None = None
    error: str | None = None

    def as_json(self, to_dict: Callable[[Any], Mapping[str, Any]]) -> dict[str, Any]:
        return {
            "config": dict(to_dict(self.config)),
            "status": self.status,
            "time_s": self.time_s,
            "error": self.error,
        }


@dataclasses.dataclass(frozen=True)
class TuneResult:
    best: Any | None  # None: no candidate ran correctly
    best_time_s: float | None
    trials: tuple[Trial, ...]
    # Set when the sweep's winner was re-timed against the first candidate (the baseline,
    # the kernel's default in select_block_sizes): both times then come from that re-timing.
    baseline_time_s: float | None = None

    def time_of(self, config: Any) -> float | None:
        """The measured time of `config` if it was tried and ran correctly."""
        return next((t.time_s for t in self.trials if t.config == config and t.status == OK), None)


def classify_build_error(err: BaseException) -> str:
    return SMEM_OVERFLOW if _SMEM_PATTERN.search(f"{type(err).__name__}: {err}") else COMPILE_ERROR


def _short(err: BaseException, limit: int = 400) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def max_error(out: Any, ref: Any) -> tuple[float, float]:
    """(max |out - ref|, max |ref|) over all leaves in float64; NaN anywhere gives inf."""
    outs, refs = jax.tree.leaves(out), jax.tree.leaves(ref)
    if len(outs) != len(refs):
        return float("inf"), 0.0
    err, scale = 0.0, 0.0
    for o, r in zip(outs, refs):
        o = np.asarray(o, dtype=np.float64)
        r = np.asarray(r, dtype=np.float64)
        if o.shape != r.shape or not np.all(np.isfinite(o)):
            return float("inf"), 0.0
        if o.size:
            err = max(err, float(np.max(np.abs(o - r))))
            scale = max(scale, float(np.max(np.abs(r))))
    return err, scale


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def _run_one(config: Any, bench: Benchmark, ref: Any, deadline: float,
             clock: Callable[[], float], built: dict) -> Trial:
    try:
        fn = bench.build(config)
        out = jax.block_until_ready(fn())  # the first call compiles
    except Exception as err:  # noqa: BLE001 - any failure to build is a verdict on the config
        return Trial(config, classify_build_error(err), error=_short(err))
    err, scale = max_error(out, ref)
    if not err <= bench.atol + bench.rtol * scale:
        return Trial(config, WRONG_RESULT, error=f"max abs error {err:.3g} vs reference scale {scale:.3g}")
    built[config] = fn
    times = []
    try:
        for _ in range(bench.warmup):
            jax.block_until_ready(fn())
        for _ in range(max(1, bench.reps)):
            times.append(_time(fn))
            if clock() > deadline:
                break
    except Exception as err:  # noqa: BLE001
        return Trial(config, RUNTIME_ERROR, error=_short(err))
    return Trial(config, OK, time_s=statistics.median(times))


def _trials(configs: list[Any], bench: Benchmark, fits: Callable[[Any], bool] | None,
            budget_s: float, clock: Callable[[], float], built: dict) -> list[Trial]:
    deadline = clock() + budget_s
    trials: list[Trial] = []
    ref = None
    for config in configs:
        if fits is not None and not fits(config):
            trials.append(Trial(config, DOES_NOT_FIT))
            continue
        if clock() > deadline:
            trials.append(Trial(config, SKIPPED_BUDGET))
            continue
        if ref is None:
            ref = jax.block_until_ready(bench.reference())
        trials.append(_run_one(config, bench, ref, deadline, clock, built))
    return trials


def _retime(fns: Sequence[Callable[[], Any]], rounds: int, reps: int) -> list[float]:
    """Median time of each fn over `rounds` interleaved batches of `reps` calls."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            times[i].extend(_time(fn) for _ in range(max(1, reps)))
    return [statistics.median(t) for t in times]


def autotune(
    candidates: Sequence[Any],
    bench: Benchmark | Callable[[], Benchmark],
    *,
    fits: Callable[[Any], bool] | None = None,
    budget_s: float = DEFAULT_BUDGET_S,
    max_candidates: int = DEFAULT_MAX_CANDIDATES,
    clock: Callable[[], float] = time.perf_counter,
    confirm_rounds: int = 3,
) -> TuneResult:
    """Try candidates in order (duplicates dropped) within the budget; fastest correct wins.

    The first candidate is the baseline (select_block_sizes puts the default there). If
    another wins the sweep, the two are re-timed in `confirm_rounds` interleaved batches and
    the baseline is kept unless the winner is still faster: on the H200 the first config a
    sweep times reads slow (qwen3 forward: default 0.99 ms in the sweep, 0.86 ms re-timed
    beside the winner's 0.84), so one median each would over-credit the rest.

    `bench` is a Benchmark or a zero-argument function building one, called in the worker
    thread (see the module doc); an exception from it propagates.
    """
    unique = list(dict.fromkeys(candidates))[:max_candidates]
    built: dict[Any, Callable[[], Any]] = {}
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pallasite-autotune") as pool:
        if not isinstance(bench, Benchmark):
            bench = pool.submit(bench).result()
        trials = pool.submit(_trials, unique, bench, fits, budget_s, clock, built).result()
        ok = [t for t in trials if t.status == OK]
        if not ok:
            return TuneResult(None, None, tuple(trials))
        best = min(ok, key=lambda t: t.time_s)
        baseline = unique[0]
        if confirm_rounds <= 0 or best.config == baseline or baseline not in built:
            return TuneResult(best.config, best.time_s, tuple(trials))
        base_s, best_s = pool.submit(_retime, [built[baseline], built[best.config]],
                                     confirm_rounds, bench.reps).result()
    if base_s <= best_s:
        return TuneResult(baseline, base_s, tuple(trials), baseline_time_s=base_s)
    return TuneResult(best.config, best_s, tuple(trials), baseline_time_s=base_s)
