"""The on-disk cache: round trip, corrupt files, concurrent writers, atomic replacement."""

import json
import multiprocessing

import pytest

from pallasite.tuning import cache, select_block_sizes
from _toy import DEFAULT, SHAPE, Cfg, bench, fits, table

KEY = cache.CacheKey("toy", "impl", "Toy Chip", ("bfloat16",), (("m", "big"), ("n", "wide")))


def _entry(block=128, status=cache.OK):
    return cache.CacheEntry(key=KEY, status=status,
                            config=None if status == cache.NO_VIABLE else {"block": block, "warps": 4},
                            config_fields=("block", "warps"), candidates_digest="d",
                            trials=({"config": {"block": block}, "status": "ok", "time_s": 1e-3, "error": None},))


@pytest.fixture(autouse=True)
def _autotune_on(monkeypatch):
    monkeypatch.setenv(cache.ENV_AUTOTUNE, "1")  # the root conftest turns it off for tests


def test_round_trip(tmp_path):
    path = cache.write(_entry(), tmp_path)
    assert path.parent == tmp_path and path.name.startswith("toy.impl.")
    back = cache.read(KEY, tmp_path)
    assert back.config == {"block": 128, "warps": 4} and back.status == cache.OK
    assert back.trials[0]["time_s"] == 1e-3 and back.created > 0
    nv = cache.write(_entry(status=cache.NO_VIABLE), tmp_path)
    assert nv == path and cache.read(KEY, tmp_path).status == cache.NO_VIABLE
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_device_kind_spelling_does_not_split_the_key(tmp_path):
    cache.write(_entry(), tmp_path)
    other = cache.CacheKey("toy", "impl", "toy  chip", ("bfloat16",), KEY.bucket)
    assert cache.read(other, tmp_path) is not None


@pytest.mark.parametrize("damage", [
    lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]),  # truncated
    lambda p: p.write_bytes(b"\x00\xff garbage"),
    lambda p: p.write_text(json.dumps(json.loads(p.read_text()) | {"format": 99})),
    lambda p: p.write_text(json.dumps(json.loads(p.read_text()) | {"key": {"op": "other"}})),
    lambda p: p.write_text(json.dumps(json.loads(p.read_text()) | {"status": "maybe"})),
    lambda p: p.write_text(json.dumps(json.loads(p.read_text()) | {"config": [1, 2]})),
    lambda p: p.write_text("[]"),
])
def test_corrupt_or_foreign_entries_read_as_misses_and_are_retuned(tmp_path, monkeypatch, damage):
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path))
    path = cache.write(_entry(), tmp_path)
    damage(path)
    assert cache.read(KEY, tmp_path) is None
    sel = select_block_sizes("toy", "impl", device_kind="Toy Chip", dtypes="bfloat16", shape=SHAPE,
                             config_type=Cfg, default=DEFAULT, fits=fits, table=table(),
                             measure=bench(times={DEFAULT: 0.002}))
    assert sel.source == "autotune"
    assert cache.read(KEY, tmp_path).config == {"block": sel.config.block, "warps": sel.config.warps}


def test_stale_config_fields_are_retuned(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path))
    cache.write(cache.CacheEntry(key=KEY, status=cache.OK, config={"block": 128, "lanes": 2},
                                 config_fields=("block", "lanes"), candidates_digest="d"), tmp_path)
    sel = select_block_sizes("toy", "impl", device_kind="Toy Chip", dtypes="bfloat16", shape=SHAPE,
                             config_type=Cfg, default=DEFAULT, fits=fits, table=table(), measure=bench())
    assert sel.source == "autotune"


def test_unwritable_directory_returns_none(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("")
    assert cache.write(_entry(), blocker / "sub") is None


def _writer(directory, block, rounds):
    for _ in range(rounds):
        assert cache.write(_entry(block=block), directory) is not None


def _reader(directory, rounds, bad):
    seen = 0
    for _ in range(rounds):
        e = cache.read(KEY, directory)
        if e is not None:
            seen += 1
            if e.config["block"] not in (16, 32, 64, 128):
                bad.value += 1
    return seen


def test_concurrent_writers_never_leave_a_torn_file(tmp_path):
    # spawn, not fork: JAX is multithreaded, and real writers are separate processes anyway.
    ctx = multiprocessing.get_context("spawn")
    bad = ctx.Value("i", 0)
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), b, 40)) for b in (16, 32, 64, 128)]
    reader = ctx.Process(target=_reader, args=(str(tmp_path), 200, bad))
    for p in writers + [reader]:
        p.start()
    for p in writers + [reader]:
        p.join(60)
        assert p.exitcode == 0
    assert bad.value == 0
    final = cache.read(KEY, tmp_path)
    assert final is not None and final.config["block"] in (16, 32, 64, 128)
    assert [p.name for p in tmp_path.iterdir()] == [KEY.filename()]  # no temp files left


def test_autotune_switch_values(monkeypatch):
    for value, on in (("0", False), ("false", False), ("OFF", False), ("no", False),
                      ("1", True), ("yes", True), ("", True)):
        monkeypatch.setenv(cache.ENV_AUTOTUNE, value)
        assert cache.autotune_enabled() is on
    monkeypatch.delenv(cache.ENV_AUTOTUNE)
    assert cache.autotune_enabled()
