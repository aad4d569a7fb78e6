"""The on-disk autotune-on-miss cache: one small JSON file per key.

Where: `$PALLASITE_CACHE_DIR` if set, else `$XDG_CACHE_HOME/pallasite/autotune`, else
`~/.cache/pallasite/autotune`. Key: (op, implementation, device kind, dtypes, shape bucket);
the file name is a digest of the key and the file repeats the key, so a digest collision or
a file copied from elsewhere reads as a miss, never as another key's config.

Writes are atomic: the entry goes to a temporary file in the same directory, is flushed to
disk, then `os.replace`d over the final name, so a reader sees the old entry or the new one,
never half of either, however many processes tune the same key at once (last writer wins;
both wrote a valid result). Anything unreadable (truncated, not JSON, another format, a key
that does not match, a config the current config type cannot rebuild) is a miss: the caller
re-tunes and overwrites it. A cache that cannot be written (read-only home) costs only the
re-tuning next time; it never fails the kernel call.

`PALLASITE_AUTOTUNE=0` (or false/off/no) turns autotune-on-miss off; entries already in the
cache are still used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from pallasite.tuning.tables import normalize_device_kind

FORMAT = 1
ENV_CACHE_DIR = "PALLASITE_CACHE_DIR"
ENV_AUTOTUNE = "PALLASITE_AUTOTUNE"
OK = "ok"
NO_VIABLE = "no_viable"


def cache_dir() -> Path:
    """The cache directory (not created until the first write)."""
    override = os.environ.get(ENV_CACHE_DIR)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pallasite" / "autotune"


def autotune_enabled() -> bool:
    """False when PALLASITE_AUTOTUNE is 0/false/off/no; on by default."""
    return os.environ.get(ENV_AUTOTUNE, "1").strip().lower() not in ("0", "false", "off", "no")


@dataclasses.dataclass(frozen=True)
class CacheKey:
    op: str
    implementation: str
    device_kind: str
    dtypes: tuple[str, ...]
    bucket: tuple[tuple[str, str], ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "implementation": self.implementation,
            "device_kind": normalize_device_kind(self.device_kind),
            "dtypes": list(self.dtypes),
            "bucket": [list(p) for p in self.bucket],
        }

    def filename(self) -> str:
        digest = hashlib.sha256(json.dumps(self.as_json(), sort_keys=True).encode()).hexdigest()
        return f"{self.op}.{self.implementation}.{digest[:24]}.json"


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One autotune outcome: the winning config (status ok) or that none ran (no_viable).

    `config_fields` and `candidates_digest` tell a stale entry from a current one: a
    no-viable verdict holds only for the candidate list it was reached on.
    """

    key: CacheKey
    status: str
    config: Mapping[str, Any] | None
    config_fields: tuple[str, ...]
    candidates_digest: str
    trials: tuple[Mapping[str, Any], ...] = ()
    created: float = 0.0


def candidates_digest(candidates: Any) -> str:
    return hashlib.sha256(json.dumps(list(candidates), sort_keys=True, default=str).encode()).hexdigest()[:24]


def read(key: CacheKey, directory: str | os.PathLike | None = None) -> CacheEntry | None:
    """The entry for `key`, or None when missing, corrupt or written for another key/format."""
    path = Path(directory or cache_dir()) / key.filename()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != FORMAT or data.get("key") != key.as_json():
            return None
        status = data["status"]
        if status not in (OK, NO_VIABLE) or (status == OK and not isinstance(data["config"], dict)):
            return None
        return CacheEntry(
            key=key,
            status=status,
            config=data["config"],
            config_fields=tuple(data["config_fields"]),
            candidates_digest=str(data["candidates_digest"]),
            trials=tuple(data.get("trials", ())),
            created=float(data.get("created", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError,
            MemoryError):  # anything unreadable (deeply nested JSON included) is a miss
        return None


def write(entry: CacheEntry, directory: str | os.PathLike | None = None) -> Path | None:
    """Atomically store `entry`; returns its path, or None if the directory is not writable."""
    folder = Path(directory or cache_dir())
    payload = {
        "format": FORMAT,
        "key": entry.key.as_json(),
        "status": entry.status,
        "config": None if entry.config is None else dict(entry.config),
        "config_fields": list(entry.config_fields),
        "candidates_digest": entry.candidates_digest,
        "trials": [dict(t) for t in entry.trials],
        "created": entry.created or time.time(),
    }
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        final = folder / entry.key.filename()
        os.replace(tmp, final)
        return final
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return None
