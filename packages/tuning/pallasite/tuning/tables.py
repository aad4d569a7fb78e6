"""Tuned tables: reviewed, checked-in block sizes keyed by (device kind, dtypes, shape bucket).

One JSON file per operation, `data/<op>.json`:

    {
      "format": 1,
      "op": "grouped_projection",
      "notes": "how and where the entries were measured",
      "buckets": {"m": [["upto_48k", 24577, 49152], ["over_48k", 49153, null], ...], ...},
      "candidates": {"pallas_triton": [{<config fields>}, ...]},
      "entries": [
        {"implementation": "pallas_triton", "device_kind": "NVIDIA H200",
         "dtypes": ["bfloat16"], "bucket": {"m": "upto_48k", ...},
         "config": {<config fields>}, "measured": {...}}
      ]
    }

A bucket is a named, inclusive integer range per dimension (`null` = unbounded above); the
ranges of one dimension may not overlap, so a shape falls in at most one bucket per
dimension. Buckets are coarse on purpose: a tuned config carries over to neighbouring shapes
(a 48k-row MoE batch tunes like a 64k one), and the table stays small enough to review.
`candidates` is the autotuner's search space per implementation (a few dozen at most), kept
beside the table so the kernels' code carries no tuning data. `measured` is free-form
provenance (shape, times, date); lookup ignores it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

FORMAT = 1
DATA_DIR = Path(__file__).resolve().parent / "data"
MAX_CANDIDATES = 48


class TableError(ValueError):
    """A table file that does not follow the format (caught by the table tests)."""


def normalize_device_kind(kind: str) -> str:
    """'NVIDIA  H200' and 'nvidia h200' name the same device: casefold, collapse spaces."""
    return " ".join(str(kind).split()).casefold()


def normalize_dtypes(dtypes: Any) -> tuple[str, ...]:
    """A dtype or sequence of dtypes (numpy/jax types or names) as a tuple of names."""
    if isinstance(dtypes, (str, type, np.dtype)) or not isinstance(dtypes, Iterable):
        dtypes = (dtypes,)
    return tuple(d if isinstance(d, str) else np.dtype(d).name for d in dtypes)


@dataclasses.dataclass(frozen=True)
class Bucket:
    name: str
    lo: int
    hi: int | None  # inclusive; None = unbounded

    def contains(self, value: int) -> bool:
        return value >= self.lo and (self.hi is None or value <= self.hi)


@dataclasses.dataclass(frozen=True)
class Entry:
    implementation: str
    device_kind: str
    dtypes: tuple[str, ...]
    bucket: tuple[tuple[str, str], ...]  # (dim, bucket name) in the table's dim order
    config: Mapping[str, Any]
    measured: Mapping[str, Any]

    def key(self) -> tuple:
        return (self.implementation, normalize_device_kind(self.device_kind), self.dtypes, self.bucket)


@dataclasses.dataclass(frozen=True)
class Lookup:
    """The answer of `Table.lookup`: the entry if one matched, and the shape's bucket."""

    matched: bool
    entry: Entry | None
    bucket: tuple[tuple[str, str], ...] | None  # None: the shape is outside the buckets


@dataclasses.dataclass(frozen=True)
class Table:
    op: str
    buckets: Mapping[str, tuple[Bucket, ...]]  # dim -> buckets, dims in declaration order
    entries: tuple[Entry, ...] = ()
    candidates: Mapping[str, tuple[Mapping[str, Any], ...]] = dataclasses.field(default_factory=dict)
    notes: str = ""

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(self.buckets)

    def bucket_of(self, shape: Mapping[str, int]) -> tuple[tuple[str, str], ...] | None:
        """(dim, bucket name) per declared dim; None if a value falls outside every bucket.

        ValueError if `shape` lacks a declared dim (a caller bug, not a miss); extra dims in
        `shape` are ignored.
        """
        missing = [d for d in self.dims if d not in shape]
        if missing:
            raise ValueError(f"shape {dict(shape)} lacks dim(s) {missing} of the {self.op} table")
        out = []
        for dim, buckets in self.buckets.items():
            value = int(shape[dim])
            name = next((b.name for b in buckets if b.contains(value)), None)
            if name is None:
                return None
            out.append((dim, name))
        return tuple(out)

    def lookup(self, *, implementation: str, device_kind: str, dtypes: Any,
               shape: Mapping[str, int]) -> Lookup:
        """The entry for this key, if any; `matched` says whether one was found."""
        bucket = self.bucket_of(shape)
        if bucket is None:
            return Lookup(False, None, None)
        key = (implementation, normalize_device_kind(device_kind), normalize_dtypes(dtypes), bucket)
        for entry in self.entries:
            if entry.key() == key:
                return Lookup(True, entry, bucket)
        return Lookup(False, None, bucket)

    def candidates_for(self, implementation: str) -> tuple[Mapping[str, Any], ...]:
        return tuple(self.candidates.get(implementation, ()))


def _parse_buckets(op: str, raw: Any) -> dict[str, tuple[Bucket, ...]]:
    if not isinstance(raw, Mapping) or not raw:
        raise TableError(f"{op}: 'buckets' must be a non-empty mapping of dim -> ranges")
    out = {}
    for dim, ranges in raw.items():
        buckets = []
        for item in ranges:
            if not (isinstance(item, (list, tuple)) and len(item) == 3):
                raise TableError(f"{op}: bucket {item!r} of dim {dim!r} is not [name, lo, hi]")
            name, lo, hi = item
            if not isinstance(lo, int) or not (hi is None or isinstance(hi, int)) or (hi is not None and hi < lo):
                raise TableError(f"{op}: bucket {name!r} of dim {dim!r} has a bad range [{lo}, {hi}]")
            buckets.append(Bucket(str(name), lo, hi))
        buckets.sort(key=lambda b: b.lo)
        for a, b in zip(buckets, buckets[1:]):
            if a.hi is None or a.hi >= b.lo:
                raise TableError(f"{op}: buckets {a.name!r} and {b.name!r} of dim {dim!r} overlap")
        names = [b.name for b in buckets]
        if len(set(names)) != len(names):
            raise TableError(f"{op}: dim {dim!r} repeats a bucket name: {names}")
        out[str(dim)] = tuple(buckets)
    return out


def _parse_entry(op: str, buckets: Mapping[str, tuple[Bucket, ...]], raw: Mapping) -> Entry:
    try:
        bucket_raw = raw["bucket"]
        entry = Entry(
            implementation=str(raw["implementation"]),
            device_kind=str(raw["device_kind"]),
            dtypes=normalize_dtypes(tuple(raw["dtypes"])),
            bucket=tuple((dim, str(bucket_raw[dim])) for dim in buckets),
            config=dict(raw["config"]),
            measured=dict(raw.get("measured", {})),
        )
    except (KeyError, TypeError) as err:
        raise TableError(f"{op}: entry {raw!r} is malformed ({err!r})") from err
    extra = sorted(set(bucket_raw) - set(buckets))
    if extra:
        raise TableError(f"{op}: entry bucket names unknown dim(s) {extra}")
    for dim, name in entry.bucket:
        if name not in {b.name for b in buckets[dim]}:
            raise TableError(f"{op}: entry names bucket {name!r} that dim {dim!r} does not declare")
    return entry


def parse_table(data: Mapping[str, Any], *, source: str = "<table>") -> Table:
    """Validate and build a Table from parsed JSON; TableError names what is wrong."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise TableError(f"{source}: not a format-{FORMAT} tuning table")
    op = str(data.get("op", ""))
    if not op:
        raise TableError(f"{source}: no 'op'")
    buckets = _parse_buckets(op, data.get("buckets"))
    entries = tuple(_parse_entry(op, buckets, e) for e in data.get("entries", ()))
    keys = [e.key() for e in entries]
    if len(set(keys)) != len(keys):
        raise TableError(f"{source}: two entries share one (implementation, device, dtypes, bucket)")
    candidates = {}
    for impl, cands in dict(data.get("candidates", {})).items():
        if len(cands) > MAX_CANDIDATES:
            raise TableError(f"{source}: {len(cands)} candidates for {impl} (at most {MAX_CANDIDATES})")
        candidates[str(impl)] = tuple(dict(c) for c in cands)
    return Table(op=op, buckets=buckets, entries=entries, candidates=candidates,
                 notes=str(data.get("notes", "")))


def table_path(op: str, directory: str | os.PathLike | None = None) -> Path:
    return Path(directory or DATA_DIR) / f"{op}.json"


@functools.lru_cache(maxsize=None)
def _load(path: str, mtime_ns: int) -> Table | None:
    del mtime_ns  # part of the memo key only: an edited file is read again
    with open(path, encoding="utf-8") as f:
        return parse_table(json.load(f), source=path)


def load_table(op: str, directory: str | os.PathLike | None = None) -> Table | None:
    """The checked-in table for `op`, or None if there is none. Parsed once per file version."""
    path = table_path(op, directory)
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        return None
    return _load(str(path), mtime)


def table_to_json(table: Table) -> dict[str, Any]:
    """The JSON form of a table (inverse of parse_table), for the autotune tool to write."""
    return {
        "format": FORMAT,
        "op": table.op,
        "notes": table.notes,
        "buckets": {dim: [[b.name, b.lo, b.hi] for b in bs] for dim, bs in table.buckets.items()},
        "candidates": {impl: [dict(c) for c in cs] for impl, cs in table.candidates.items()},
        "entries": [
            {
                "implementation": e.implementation,
                "device_kind": e.device_kind,
                "dtypes": list(e.dtypes),
                "bucket": dict(e.bucket),
                "config": dict(e.config),
                "measured": dict(e.measured),
            }
            for e in table.entries
        ],
    }


def with_entry(table: Table, entry: Entry) -> Table:
    """A copy of `table` where `entry` replaces any entry with the same key."""
    kept = tuple(e for e in table.entries if e.key() != entry.key())
    return dataclasses.replace(table, entries=kept + (entry,))


def exact_bucket(shape: Mapping[str, int], dims: Sequence[str] | None = None) -> tuple[tuple[str, str], ...]:
    """Bucket key for an op without a table (or a shape outside it): the exact values."""
    dims = dims if dims is not None else sorted(shape)
    return tuple((d, f"={int(shape[d])}") for d in dims)
