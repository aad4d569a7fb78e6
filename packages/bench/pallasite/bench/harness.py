"""Steady-state timing: compile apart from run, warm-up, synchronised samples, rotated inputs.

- Compile time: a JAX function is lowered and compiled ahead (`jit(f).lower(x).compile()`)
  and that is timed alone; a torch peer's first call (Triton's JIT and autotune) stands in.
- Warm-up calls, then `samples` timed samples. Each sample launches `calls` back-to-back
  calls and synchronises the device once (`jax.block_until_ready` / `torch.cuda.synchronize`),
  so launch overhead is amortised where a call is short; `calls` is chosen from the warm-up
  so a sample lasts about `sample_s`. The record keeps the median per-call time and the
  spread (10th and 90th percentiles, minimum) over samples.
- Host issue time: how long the host took to issue a sample's calls, before the
  synchronisation, per call (median over samples). Where it reaches HOST_BOUND of the
  per-call time the device was waiting on the host, not the other way round: the time is
  the dispatch's, an upper bound on the kernel's (`host_bound`). It also shows a host
  that waits for the device inside a call (a data-dependent branch): issue time then
  equals the whole time even on long calls. On the H200 machines of 2026-12-01 one jitted
  call of a grouped projection kernel cost the host 0.2-0.4 ms to issue (a jitted add:
  0.05-0.09 ms), so calls shorter than that read as that. Most of it was the tile table's
  search loop; without it (2026-12-02) a short forward issues in 0.08-0.09 ms.
- Input rotation: call i reads input set i mod R. R copies are drawn (different seeds,
  never zeros) so that together they exceed the last-level cache several times over, so no
  call finds its operands in the L2 left there by the one before (H200: 60 MB of L2).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Timing:
    compile_s: float
    median_s: float | None
    p10_s: float | None
    p90_s: float | None
    min_s: float | None
    samples: int
    calls_per_sample: int
    issue_s: float | None = None  # median per-call time the host spent issuing calls


# A sample whose calls took the host this fraction of their time (or more) to issue was
# bound by the host: the device had nothing queued to run ahead on.
HOST_BOUND = 0.9


def host_bound(issue_s: float | None, median_s: float | None) -> bool:
    """Whether a timing was the host's issue rate rather than the device's (HOST_BOUND)."""
    return bool(issue_s and median_s and issue_s >= HOST_BOUND * median_s)


def rotation_copies(set_bytes: int, cache_bytes: int, budget_bytes: int,
                    factor: float = 3.0, most: int = 32) -> int:
    """How many input sets to rotate through: >= 2, their total >= factor x the cache,
    within `budget_bytes` (never fewer than 1)."""
    want = max(2, math.ceil(factor * cache_bytes / max(set_bytes, 1)))
    fits = max(1, budget_bytes // max(set_bytes, 1))
    return int(min(want, fits, most))


def compile_jax(fn: Callable, example: Any) -> tuple[Callable, float]:
    """Lower and compile `fn` (a jax.jit function) for `example`; (compiled, seconds)."""
    start = time.perf_counter()
    compiled = fn.lower(example).compile()
    return compiled, time.perf_counter() - start


def temp_bytes(compiled) -> int | None:
    """XLA's temporary buffer bytes for one call of a compiled JAX function: activations,
    what a forward keeps for its backward inside one value_and_grad, workspace; its
    arguments and outputs are not counted. None where the backend gives no analysis."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without memory analysis
        return None
    return None if stats is None else int(stats.temp_size_in_bytes)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def steady_state(call: Callable[[Any], Any], input_sets: list, sync: Callable[[Any], None], *,
                 compile_s: float, warmup: int = 3, samples: int = 15, sample_s: float = 0.02,
                 max_calls: int = 64, budget_s: float = 20.0) -> Timing:
    """Time `call` over rotated `input_sets` after `warmup` calls (see module docstring).

    Stops early (with fewer samples, at least 3) once `budget_s` of timed work is spent.
    """
    per_call = None
    for i in range(max(warmup, 1)):
        start = time.perf_counter()
        sync(call(input_sets[i % len(input_sets)]))
        per_call = time.perf_counter() - start
    calls = int(min(max_calls, max(1, round(sample_s / max(per_call, 1e-7)))))
    times: list[float] = []
    issued: list[float] = []
    spent, nxt = 0.0, 0
    for s in range(samples):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = call(input_sets[nxt % len(input_sets)])
            nxt += 1
        issued.append((time.perf_counter() - start) / calls)
        sync(out)
        elapsed = time.perf_counter() - start
        times.append(elapsed / calls)
        spent += elapsed
        if spent > budget_s and s >= 2:
            break
    return Timing(
        compile_s=compile_s,
        median_s=_percentile(times, 0.5),
        p10_s=_percentile(times, 0.1),
        p90_s=_percentile(times, 0.9),
        min_s=min(times),
        samples=len(times),
        calls_per_sample=calls,
        issue_s=_percentile(issued, 0.5),
    )


def jax_sync(out: Any) -> None:
    import jax

    jax.block_until_ready(out)
