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


def test_type_errors():
    with pytest.raises(TypeError):
        config_to_dict({"block_m": 1})
    with pytest.raises(TypeError):
        config_from_dict(dict, {})
    with pytest.raises(TypeError, match="JSON"):
        config_to_dict(Tiles(name=object()))
