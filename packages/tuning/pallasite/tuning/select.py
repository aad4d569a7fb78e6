"""The one entry point kernels call to choose block sizes.

    sel = select_block_sizes("grouped_projection", "pallas_triton",
                             device_kind=..., dtypes=(x.dtype,), shape={"m": m, ...},
                             config_type=BlockSizes, default=DEFAULT, caller=block_sizes,
                             fits=lambda cfg: ...)
    sel.config, sel.source   # source: caller | table | cache | autotune | default

Order (docs/tuning.md), first that applies wins:
  1. `caller`: the block sizes the user passed, unchanged (the kernel checks them against
     its fit rule before calling here, and refuses one that does not fit by name);
  2. the checked-in table entry for (implementation, device kind, dtypes, shape bucket),
     if it rebuilds into `config_type` and `fits` the shape;
  3. the on-disk cache entry for the same key, under the same conditions; a cached
     "no viable candidate" skips step 4;
  4. a bounded autotune (ON_MISS_BUDGET_S, ON_MISS_MAX_CANDIDATES), only when the caller
     gave a `measure` (a Benchmark or a zero-argument function returning one, built only on
     a miss, in the tuner's worker thread) and PALLASITE_AUTOTUNE is not 0; the default is
     always the first candidate, so a tuned config is never one the tuner measured slower
     than the default; the outcome (winner or no-viable) is cached. Any exception while
     building or running the benchmark is logged as a warning and gives the default (and is
     not retried for that key in this process): tuning never fails the kernel call;
  5. `default`.
With no table entry, no cache entry and no `measure`, the result is `default`. The GPU
kernels pass a `measure` only when they will run compiled on a GPU they support, never in
interpret mode or for a caller's config (docs/tuning.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Any, Callable, Mapping, Sequence

from pallasite.tuning import autotune as _autotune
from pallasite.tuning import cache as _cache
from pallasite.tuning.configs import StaleConfig, config_fields, config_from_dict, config_to_dict
from pallasite.tuning.tables import Table, exact_bucket, load_table, normalize_dtypes

log = logging.getLogger(__name__)

CALLER = "caller"
TABLE = "table"
CACHE = "cache"
AUTOTUNE = "autotune"
DEFAULT = "default"

_UNSET: Any = object()
# The on-miss bound: a user's first call waits for this, unlike the offline
# `bazel run //packages/bench:autotune`, which takes every table candidate and a longer
# budget. The budget is checked before each candidate (one that starts in time may finish
# past it; its first call compiles). Read at call time, so tests can lower them.
ON_MISS_BUDGET_S = 10.0
ON_MISS_MAX_CANDIDATES = 8
# Autotune results whose cache write failed (unwritable directory): kept for this process
# so a kernel traced many times is tuned once.
_memo: dict[_cache.CacheKey, Any] = {}
# Keys whose benchmark raised in this process (why): not retried on every trace. Not written
# to disk: the cause (memory in use, a driver hiccup) may be gone in the next process.
_failed: dict[_cache.CacheKey, str] = {}


@dataclasses.dataclass(frozen=True)
class Selection:
    config: Any
    source: str  # caller | table | cache | autotune | default
    detail: str = ""  # why an earlier source was passed over, for logs and tests
    tune: _autotune.TuneResult | None = None  # present when source came from a fresh autotune


def _usable(config_type: type, data: Mapping[str, Any], fits: Callable | None,
            shape: Mapping[str, int]) -> tuple[Any, str]:
    """(config, "") if `data` rebuilds and fits the shape, else (None, reason), logged:
    a stored entry passed over is re-tuned where tuning runs."""
    try:
        config = config_from_dict(config_type, data)
    except (StaleConfig, RecursionError) as err:
        why = f"stale: {type(err).__name__}: {err}"[:400]
    else:
        if fits is None or fits(config, shape):
            return config, ""
        why = f"does not fit shape {dict(shape)}: {data}"
    log.warning("tuning: %s entry passed over (%s)", config_type.__name__, why)
    return None, why


def _candidate_configs(config_type: type, default: Any, candidates: Sequence[Any],
                       table: Table | None, implementation: str) -> list[Any]:
    raw = list(candidates) or (list(table.candidates_for(implementation)) if table else [])
    out = [default]
    for c in raw:
        if isinstance(c, Mapping):
            try:
                c = config_from_dict(config_type, c)
            except StaleConfig as err:
                log.warning("tuning: dropping candidate %s: %s", c, err)
                continue
        out.append(c)
    return list(dict.fromkeys(out))


_recorders = threading.local()


@contextlib.contextmanager
def recording():
    """Collect the (op, implementation, Selection) of every choice made on this thread in
    the block: the block sizes a function traced there actually uses (the benchmark
    records carry them). The tuner's own candidate runs, on its worker thread, are not
    collected."""
    used: list[tuple[str, str, Selection]] = []
    outer = getattr(_recorders, "active", ())
    _recorders.active = outer + (used,)
    try:
        yield used
    finally:
        _recorders.active = outer


def select_block_sizes(op: str, implementation: str, **kwargs) -> Selection:
    """Block sizes for one kernel call, and which source they came from (see module doc
    and `_select`); noted by every `recording()` active on this thread."""
    selection = _select(op, implementation, **kwargs)
    for used in getattr(_recorders, "active", ()):
        used.append((op, implementation, selection))
    return selection


def _select(
    op: str,
    implementation: str,
    *,
    device_kind: str,
    dtypes: Any,
    shape: Mapping[str, int],
    config_type: type,
    default: Any,
    caller: Any = None,
    fits: Callable[[Any, Mapping[str, int]], bool] | None = None,
    candidates: Sequence[Any] = (),
    measure: Any = None,
    table: Any = _UNSET,
    cache_directory: Any = None,
    budget_s: float | None = None,
    max_candidates: int | None = None,
) -> Selection:
    """Block sizes for one kernel call, and which source they came from (see module doc).

    `fits(config, shape)` is the kernel's rule for whether a config can run on this shape;
    `candidates` (configs or field dicts) defaults to the table's list for the
    implementation; `table` defaults to the checked-in table for `op` (tests pass their own);
    `budget_s` and `max_candidates` default to the on-miss bound above.
    """
    if caller is not None:
        return Selection(caller, CALLER)
    table = load_table(op) if table is _UNSET else table
    dtypes = normalize_dtypes(dtypes)
    notes: list[str] = []

    config, bucket = _from_table(table, implementation, device_kind, dtypes, shape, config_type, fits, notes)
    if config is not None:
        return Selection(config, TABLE)
    key = _cache.CacheKey(op, implementation, device_kind, dtypes, bucket)
    cands = _candidate_configs(config_type, default, candidates, table, implementation)
    digest = _cache.candidates_digest([config_to_dict(c) for c in cands])
    if key in _memo:
        return Selection(_memo[key], CACHE, "in-process memo")
    entry = _cache.read(key, cache_directory)
    if entry is not None and entry.config_fields == config_fields(config_type):
        if entry.status == _cache.OK:
            config, why = _usable(config_type, entry.config, fits, shape)
            if config is not None:
                return Selection(config, CACHE, "; ".join(notes))
            notes.append(f"cache entry passed over ({why})")
        elif entry.candidates_digest == digest:
            notes.append("cached: no viable candidate")
            return Selection(default, DEFAULT, "; ".join(notes))

    if measure is None:
        return Selection(default, DEFAULT, "; ".join(notes))
    if not _cache.autotune_enabled():
        notes.append(f"autotune off ({_cache.ENV_AUTOTUNE}=0)")
        return Selection(default, DEFAULT, "; ".join(notes))
    if key in _failed:
        notes.append(f"autotune failed earlier in this process ({_failed[key]})")
        return Selection(default, DEFAULT, "; ".join(notes))
    try:
        result = _autotune.autotune(
            cands, measure, fits=None if fits is None else (lambda c: fits(c, shape)),
            budget_s=ON_MISS_BUDGET_S if budget_s is None else budget_s,
            max_candidates=ON_MISS_MAX_CANDIDATES if max_candidates is None else max_candidates)
        _store(key, result, config_fields(config_type), digest, cache_directory)
    except Exception as err:  # noqa: BLE001 - tuning must never fail the kernel call
        why = f"{type(err).__name__}: {err}"[:400]
        log.warning("tuning: autotune of %s/%s %s failed, using the default %s: %s",
                    op, implementation, dict(shape), default, why)
        _failed[key] = why
        notes.append(f"autotune failed ({why})")
        return Selection(default, DEFAULT, "; ".join(notes))
    if result.best is not None:
        return Selection(result.best, AUTOTUNE, "; ".join(notes), tune=result)
    notes.append("autotune: no viable candidate")
    return Selection(default, DEFAULT, "; ".join(notes), tune=result)


def _from_table(table: Table | None, implementation: str, device_kind: str, dtypes: tuple[str, ...],
                shape: Mapping[str, int], config_type: type, fits: Callable | None,
                notes: list[str]) -> tuple[Any, tuple[tuple[str, str], ...]]:
    """(the table's usable config or None, the shape's bucket: the table's, else exact sizes)."""
    if table is None:
        return None, exact_bucket(shape)
    found = table.lookup(implementation=implementation, device_kind=device_kind, dtypes=dtypes, shape=shape)
    bucket = found.bucket if found.bucket is not None else exact_bucket(shape, table.dims)
    if not found.matched:
        return None, bucket
    config, why = _usable(config_type, found.entry.config, fits, shape)
    if config is None:
        notes.append(f"table entry passed over ({why})")
    return config, bucket


def _store(key: _cache.CacheKey, result: _autotune.TuneResult, fields: tuple[str, ...],
           digest: str, directory: Any) -> None:
    entry = _cache.CacheEntry(
        key=key,
        status=_cache.OK if result.best is not None else _cache.NO_VIABLE,
        config=None if result.best is None else config_to_dict(result.best),
        config_fields=fields,
        candidates_digest=digest,
        trials=tuple(t.as_json(config_to_dict) for t in result.trials),
    )
    if _cache.write(entry, directory) is None:
        log.warning("tuning: cache %s not writable; keeping %s in memory", directory or _cache.cache_dir(), key)
        if result.best is not None:
            _memo[key] = result.best


def device_kind() -> str:
    """The default device's kind string ('NVIDIA H200', 'TPU v6 lite', 'cpu'), the tables' key.

    Tables key on the exact kind, not the generation: an H100 and an H200 are both sm90
    but differ 1.4x in memory bandwidth, which moves the best tile for memory-bound shapes.
    """
    import jax

    return jax.devices()[0].device_kind
