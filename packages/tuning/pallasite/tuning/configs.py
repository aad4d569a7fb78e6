"""Block-size configs as plain data: frozen dataclasses in, JSON-ready dicts out.

The kernels own their config types (frozen dataclasses); tuning never imports them. A
config is stored as the dict of its fields and rebuilt with the caller's `config_type`, so a
table or cache entry written for an older version of a config (a field renamed or removed)
fails to rebuild and is treated as stale instead of being passed to a kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


class StaleConfig(ValueError):
    """A stored config does not rebuild into the current config type."""


def _require_dataclass_type(config_type: type) -> None:
    if not (isinstance(config_type, type) and dataclasses.is_dataclass(config_type)):
        raise TypeError(f"config_type must be a dataclass type, got {config_type!r}")


def _to_json(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"config field value {value!r} is not JSON data (int, float, str, bool, tuple)")


def _from_json(value: Any) -> Any:
    # Frozen dataclasses want hashable fields: JSON lists come back as tuples.
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    """The fields of a dataclass config as a JSON-ready dict (tuples become lists)."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"config must be a dataclass instance, got {type(config).__name__}")
    return {f.name: _to_json(getattr(config, f.name)) for f in dataclasses.fields(config)}


def config_fields(config_type: type) -> tuple[str, ...]:
    """The field names of a config type, in declaration order."""
    _require_dataclass_type(config_type)
    return tuple(f.name for f in dataclasses.fields(config_type))


def config_from_dict(config_type: type, data: Mapping[str, Any]) -> Any:
    """Rebuild a config; StaleConfig when the stored fields no longer fit `config_type`.

    Unknown keys are stale (a field was renamed or removed); missing keys are allowed only
    where the field has a default. The dataclass's own checks (__post_init__) apply.
    """
    _require_dataclass_type(config_type)
    if not isinstance(data, Mapping):
        raise StaleConfig(f"stored config is {type(data).__name__}, not a mapping")
    names = set(config_fields(config_type))
    unknown = sorted(set(data) - names)
    if unknown:
        raise StaleConfig(f"{config_type.__name__} has no field(s) {unknown}")
    try:
        return config_type(**{k: _from_json(v) for k, v in data.items()})
    except (TypeError, ValueError) as err:
        raise StaleConfig(f"{config_type.__name__}(**{dict(data)}) failed: {err}") from err
