"""Block-size configs as plain data: frozen dataclasses in, JSON-ready dicts out.

The kernels own their config types (frozen dataclasses); tuning never imports them. A
config is stored as the dict of its fields and rebuilt with the caller's `config_type`, so a
table or cache entry written for an older version of a config (a field renamed or removed)
fails to rebuild and is treated as stale instead of being passed to a kernel. So does one
whose field holds a value of another type than the field declares: JSON's `8.0` passes a
kernel's range checks (`>= 1`, a power of two) and then breaks its index arithmetic, so an
int field takes only an int, a bool field only a bool.
"""

from __future__ import annotations

import dataclasses
import types
import typing
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


def _is_a(value: Any, hint: Any) -> bool:
    """Whether a stored value (JSON lists already tuples) is of the declared type `hint`.

    bool is not an int here, nor an int a bool; an int is a float. Hints JSON cannot hold
    (typing.Any, object) take anything, and the dataclass's own checks still apply.
    """
    if hint is Any or hint is object:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is_a(value, h) for h in typing.get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        return isinstance(value, (int, hint)) and not isinstance(value, bool)
    if hint is tuple or typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_is_a(v, args[0]) for v in value)
        return not args or (len(args) == len(value) and all(map(_is_a, value, args)))
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _check_types(config_type: type, data: Mapping[str, Any]) -> None:
    """StaleConfig naming the first field whose stored value is not of its declared type."""
    hints = typing.get_type_hints(config_type)
    for name, value in data.items():
        if not _is_a(value, hints.get(name, Any)):
            raise StaleConfig(f"{config_type.__name__}.{name} is declared "
                              f"{_type_name(hints[name])}; got {value!r}")


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)


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

    Unknown keys are stale (a field was renamed or removed), and so is a value of another
    type than its field's annotation (`_is_a`); missing keys are allowed only where the
    field has a default. The dataclass's own checks (__post_init__) apply.
    """
    _require_dataclass_type(config_type)
    if not isinstance(data, Mapping):
        raise StaleConfig(f"stored config is {type(data).__name__}, not a mapping")
    names = set(config_fields(config_type))
    unknown = sorted(set(data) - names)
    if unknown:
        raise StaleConfig(f"{config_type.__name__} has no field(s) {unknown}")
    values = {k: _from_json(v) for k, v in data.items()}
    _check_types(config_type, values)
    try:
        return config_type(**values)
    except (TypeError, ValueError) as err:
        raise StaleConfig(f"{config_type.__name__}(**{dict(data)}) failed: {err}") from err
