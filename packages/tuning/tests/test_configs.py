"""Configs as data: dataclass <-> dict, and stale stored configs refused."""

import dataclasses

import pytest

from pallasite.tuning.configs import StaleConfig, config_fields, config_from_dict, config_to_dict


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_m: int = 128
    stages: tuple = (2, 3)
    name: str = "x"

    def __post_init__(self):
        if self.block_m % 16:
            raise ValueError("block_m % 16")


def test_round_trip_turns_lists_back_into_tuples():
    t = Tiles(64, (1, 2, 3))
    d = config_to_dict(t)
    assert d == {"block_m": 64, "stages": [1, 2, 3], "name": "x"}
    back = config_from_dict(Tiles, d)
    assert back == t and hash(back) == hash(t)
    assert config_fields(Tiles) == ("block_m", "stages", "name")


def test_missing_fields_take_defaults_and_unknown_or_invalid_are_stale():
    assert config_from_dict(Tiles, {"block_m": 32}) == Tiles(32)
    with pytest.raises(StaleConfig, match="no field"):
        config_from_dict(Tiles, {"block_m": 32, "warps": 4})
    with pytest.raises(StaleConfig, match="failed"):
        config_from_dict(Tiles, {"block_m": 33})
    with pytest.raises(StaleConfig):
        config_from_dict(Tiles, [1, 2])


@dataclasses.dataclass(frozen=True)
class Typed:
    """Annotated as the kernels' configs are: ints, a bool, an optional int."""

    block_m: int = 128
    fast: bool = False
    strip: int | None = None
    scale: float = 1.0
    sizes: tuple[int, ...] = (1, 2)


@pytest.mark.parametrize("data", [
    {"block_m": 8.0}, {"block_m": 1.5}, {"block_m": "128"}, {"block_m": True},
    {"block_m": None}, {"fast": 1}, {"fast": "true"}, {"strip": 64.0},
    {"scale": "1"}, {"scale": False}, {"sizes": [1, 2.0]}, {"sizes": 3},
], ids=str)
def test_a_field_of_the_wrong_type_is_stale(data):
    """A float where an int is declared (8.0 passes `>= 1` and `% 16` checks, then fails
    inside a kernel's index arithmetic) is refused by its annotated type, by name."""
    (name,) = data
    with pytest.raises(StaleConfig, match=f"Typed.{name} is declared .*; got"):
        config_from_dict(Typed, data)


def test_fields_of_the_right_type_rebuild():
    got = config_from_dict(Typed, {"block_m": 64, "fast": True, "strip": 32, "scale": 2,
                                   "sizes": [4]})
    assert got == Typed(64, True, 32, 2, (4,))
    assert config_from_dict(Typed, {"strip": None}) == Typed()


def test_type_errors():
    with pytest.raises(TypeError):
        config_to_dict({"block_m": 1})
    with pytest.raises(TypeError):
        config_from_dict(dict, {})
    with pytest.raises(TypeError, match="JSON"):
        config_to_dict(Tiles(name=object()))
