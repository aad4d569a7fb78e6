"""Benchmark records: the fields of docs/benchmarks.md, JSON lines and CSV, one per key.

A record is unique on KEY = (kernel, implementation, shape, dtype, backend, device_kind,
device_count, mesh, block_sizes): writing a record replaces the one with the same key already in
the results folder (the newest measurement wins), and every other record is kept, so runs on
several machines or of several suites accumulate in one place. Writers take the folder's
lock file in turn, so runs writing into one folder at the same time lose nothing.

status: "ok" (ran, within tolerance), "wrong" (ran, outside parity.tolerance of its dtype),
"unsupported" (cannot run here: missing backend, peer or device; `reason` says which),
"crashed" (raised while compiling or running; `reason` holds the exception).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import fcntl
import io
import json
import os
import subprocess
import time
import warnings
from collections.abc import Iterable

STATUSES = ("ok", "wrong", "unsupported", "crashed")
KEY = ("kernel", "implementation", "shape", "dtype", "backend", "device_kind", "device_count",
       "mesh", "block_sizes")
JSONL = "records.jsonl"
CSV = "records.csv"
LOCK = "records.lock"  # held while a writer merges into the folder's records


@dataclasses.dataclass
class Record:
    kernel: str  # "<op>.<direction>", e.g. "grouped_projection.fwd_bwd"
    implementation: str
    shape: str  # "<name>[dim=size,...]"
    dtype: str
    backend: str  # jax.default_backend()
    device_kind: str
    device_count: int  # devices the measurement used
    mesh: str  # "data=2" style: the mesh axes the inputs were sharded over; "" one device
    block_sizes: str  # JSON of the block sizes used: the caller's, else {impl: config} chosen
    status: str
    reason: str = ""
    peer: bool = False
    timing: str = ""  # "device" | "host" (CPU) | "parity only (interpreter)" | ""
    compile_time: float | None = None  # seconds
    temp_bytes: int | None = None  # XLA's temporary buffers of one call (JAX implementations)
    steady_state_time: float | None = None  # seconds, median per call
    time_p10: float | None = None
    time_p90: float | None = None
    time_min: float | None = None
    samples: int | None = None
    calls_per_sample: int | None = None
    host_issue_time: float | None = None  # seconds per call the host took to issue calls
    input_copies: int | None = None
    flops: float = 0.0
    bytes: float = 0.0
    tflops: float | None = None  # flops / steady_state_time / 1e12
    tbps: float | None = None  # bytes / steady_state_time / 1e12
    bound: str = ""  # "compute" | "memory"
    roofline_fraction: float | None = None  # attainable time / steady_state_time
    roofline: str = ""  # which ceilings (datasheet entry or "measured")
    error_max_abs: float | None = None
    error_mean_abs: float | None = None
    error_rel_l2: float | None = None
    error_reference: str = ""
    git_sha: str = ""
    xla_flags: str = ""
    backend_env: str = ""  # JSON: jax, jaxlib, python, torch/triton/tokamax when loaded
    timestamp: str = ""

    def key(self) -> tuple:
        return tuple(getattr(self, k) for k in KEY)


FIELDS = tuple(f.name for f in dataclasses.fields(Record))


def validate(record: Record) -> None:
    """Raise ValueError if `record` breaks the schema (status, types of the key)."""
    if record.status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}; got {record.status!r}")
    for name in KEY:
        value = getattr(record, name)
        want = int if name == "device_count" else str
        if not isinstance(value, want):
            raise ValueError(f"{name} must be {want.__name__}; got {value!r}")
    if record.status in ("ok", "wrong") and record.flops <= 0:
        raise ValueError(f"a measured record needs its flops; got {record.flops!r}")


def unique(records: Iterable[Record]) -> list[Record]:
    """One record per KEY, the last one given winning, in first-seen order."""
    by_key: dict[tuple, Record] = {}
    for record in records:
        by_key.pop(record.key(), None)
        by_key[record.key()] = record
    return list(by_key.values())


def load(folder: str) -> list[Record]:
    """The folder's records. A line that is not a whole record (the half line a killed run
    or a full disk leaves) is skipped with a warning naming file:line: the next write
    drops it and keeps everything else."""
    path = os.path.join(folder, JSONL)
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_parse(line))
            except (ValueError, TypeError) as err:
                warnings.warn(f"{path}:{number}: skipped, not a whole record ({err})",
                              stacklevel=2)
    return out


def _parse(line: str) -> Record:
    data = json.loads(line)
    if not isinstance(data, dict):
        raise TypeError(f"a JSON {type(data).__name__}, not an object")
    data.setdefault("mesh", "")  # records from before sharded runs
    return Record(**{k: v for k, v in data.items() if k in FIELDS})


def prepare(folder: str) -> list[Record]:
    """Make `folder`, prove it writable (its lock file) and read its records, so that a
    folder that cannot be written or holds a damaged line is reported before a run starts
    rather than after its first benchmark. OSError where it cannot be written."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, LOCK), "a"):
        pass
    return load(folder)


def write(records: Iterable[Record], folder: str) -> list[Record]:
    """Merge `records` into the folder's records (same key: replaced) and rewrite both files.

    The read, merge and rewrite happen under the folder's lock (LOCK), so runs sharing one
    folder (two benchmarks at once) each keep every record of the other. Writes go to a
    temporary file then rename, so an interrupted run leaves the old files. Returns every
    record now in the folder.
    """
    os.makedirs(folder, exist_ok=True)
    with _locked(folder):
        merged = unique([*load(folder), *records])
        _atomic(os.path.join(folder, JSONL),
                "".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in merged))
        table = io.StringIO()
        writer = csv.DictWriter(table, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in merged)
        _atomic(os.path.join(folder, CSV), table.getvalue())
    return merged


@contextlib.contextmanager
def _locked(folder: str):
    """Hold an exclusive lock on `<folder>/records.lock` (waiting for other writers)."""
    with open(os.path.join(folder, LOCK), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"  # one writer at a time (the lock), so one temporary name is enough
    with open(tmp, "w", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- environment


def git_sha() -> str:
    """HEAD of the checkout the code came from (with "-dirty" for uncommitted changes to
    tracked files). Under `bazel run` the code sits in the runfiles tree, outside any
    checkout: Bazel names the workspace in BUILD_WORKSPACE_DIRECTORY. "" where none is."""
    root = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.path.dirname(
        os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        sha = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10)
        return sha + ("-dirty" if dirty.stdout.strip() else "") if sha else ""
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("PALLASITE_GIT_SHA", "")


def environment() -> dict[str, str]:
    """git_sha, xla_flags and backend_env shared by every record of one run."""
    import platform as py_platform

    import jax
    import jaxlib

    from pallasite.bench import peers

    env = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
           "python": py_platform.python_version(), **peers.versions()}
    for name in ("CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                 "XLA_PYTHON_CLIENT_PREALLOCATE", "LIBTPU_INIT_ARGS", "PALLASITE_AUTOTUNE"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return {
        "git_sha": os.environ.get("PALLASITE_GIT_SHA") or git_sha(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "backend_env": json.dumps(env, sort_keys=True),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
