"""Table format, bucket matching, lookup (matched or not) and validation."""

import pytest

from pallasite.tuning.tables import (TableError, load_table, normalize_device_kind,
                                     normalize_dtypes, parse_table, table_to_json, with_entry,
                                     _parse_entry)
from _toy import entry, table

import numpy as np


@pytest.mark.parametrize("m, n, expect", [
    (1, 1, (("m", "small"), ("n", "narrow"))),
    (511, 255, (("m", "small"), ("n", "narrow"))),
    (512, 256, (("m", "big"), ("n", "wide"))),
    (10**9, 4096, (("m", "big"), ("n", "wide"))),
])
def test_bucket_edges_are_inclusive(m, n, expect):
    assert table().bucket_of({"m": m, "n": n}) == expect


def test_shape_outside_buckets_has_no_bucket():
    assert table().bucket_of({"m": 10, "n": 4097}) is None
    assert not table().lookup(implementation="impl", device_kind="Toy Chip", dtypes="bfloat16",
                              shape={"m": 10, "n": 4097}).matched


def test_missing_dim_is_a_caller_error_and_extra_dims_are_ignored():
    with pytest.raises(ValueError, match="lacks dim"):
        table().bucket_of({"m": 10})
    assert table().bucket_of({"m": 10, "n": 10, "g": 3}) == (("m", "small"), ("n", "narrow"))


def test_lookup_matches_device_dtypes_implementation_and_bucket():
    t = table([entry({"block": 128})])
    hit = t.lookup(implementation="impl", device_kind="  toy   CHIP ", dtypes=np.dtype("bfloat16")
                   if hasattr(np, "bfloat16") else "bfloat16", shape={"m": 600, "n": 300})
    assert hit.matched and hit.entry.config == {"block": 128}
    for kw in (dict(implementation="other"), dict(device_kind="Other Chip"),
               dict(dtypes="float32"), dict(shape={"m": 10, "n": 300})):
        args = dict(implementation="impl", device_kind="Toy Chip", dtypes="bfloat16",
                    shape={"m": 600, "n": 300}) | kw
        miss = t.lookup(**args)
        assert not miss.matched and miss.entry is None


def test_normalizers():
    import jax.numpy as jnp
    assert normalize_device_kind("NVIDIA  H200") == normalize_device_kind("nvidia h200")
    assert normalize_dtypes(jnp.bfloat16) == ("bfloat16",)
    assert normalize_dtypes([jnp.float32, "bfloat16"]) == ("float32", "bfloat16")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format=2), "format"),
    (lambda d: d["buckets"]["m"].append(["dup", 100, 200]), "overlap"),
    (lambda d: d["buckets"]["m"].__setitem__(0, ["small", 5, 1]), "bad range"),
    (lambda d: d["entries"].append(entry({"block": 1}, m="huge")), "does not declare"),
    (lambda d: d["entries"].extend([entry({"block": 1}), entry({"block": 2})]), "share"),
    (lambda d: d["entries"].append({"implementation": "impl"}), "malformed"),
    (lambda d: d["candidates"].update(impl=[{}] * 49), "at most"),
])
def test_invalid_tables_are_rejected(mutate, message):
    data = table_to_json(table())
    mutate(data)
    with pytest.raises(TableError, match=message):
        parse_table(data)


def test_json_round_trip_and_replacing_an_entry():
    t = table([entry({"block": 128})])
    assert parse_table(table_to_json(t)) == t
    newer = _parse_entry("toy", t.buckets, entry({"block": 256}))
    t2 = with_entry(t, newer)
    assert len(t2.entries) == 1 and t2.entries[0].config == {"block": 256}


@pytest.mark.parametrize("op, shape", [
    ("grouped_projection", {"m": 32768, "k": 4096, "n": 14336, "g": 8}),
    ("grouped_projection", {"m": 65536, "k": 7168, "n": 2048, "g": 256}),
    ("grouped_projection", {"m": 65536, "k": 2048, "n": 768, "g": 128}),
    ("grouped_projection", {"m": 32768, "k": 2048, "n": 1024, "g": 64}),
    ("ssd", {"length": 4096, "heads": 32, "head_dim": 64, "state": 128, "chunk": 256}),
    ("ssd", {"length": 16384, "heads": 80, "head_dim": 64, "state": 128, "chunk": 256}),
    ("gated_delta_rule", {"batch": 1, "length": 32768, "heads": 32, "key_dim": 128,
                          "value_dim": 128, "chunk": 64}),
    ("gated_delta_rule", {"batch": 8, "length": 4096, "heads": 32, "key_dim": 128,
                          "value_dim": 128, "chunk": 64}),
])
def test_checked_in_tables_parse_and_cover_the_targets(op, shape):
    t = load_table(op)
    assert t is not None and t.op == op
    assert t.bucket_of(shape) is not None
    for e in t.entries:  # entries come from measurements: each says what it was measured on
        assert e.measured, f"{op} entry {e.bucket} has no measurement record"


def test_missing_table_is_none(tmp_path):
    assert load_table("no_such_op", tmp_path) is None
