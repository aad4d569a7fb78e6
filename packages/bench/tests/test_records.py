"""Record schema, validation, uniqueness on the key, JSON lines and CSV files."""

import csv
import dataclasses
import json
import os

import pytest

from pallasite.bench import records
from pallasite.bench.records import Record

# The fields docs/benchmarks.md names, as record attributes.
DESIGN_FIELDS = {"kernel", "implementation", "shape", "dtype", "backend", "device_kind",
                 "device_count", "mesh", "block_sizes", "compile_time", "steady_state_time", "flops",
                 "bytes", "tflops", "tbps", "roofline_fraction", "error_rel_l2",
                 "error_max_abs", "git_sha", "xla_flags", "backend_env", "status"}


def _record(**kw):
    base = dict(kernel="grouped_projection.fwd", implementation="xla", shape="t[m=4]",
                dtype="bfloat16", backend="cpu", device_kind="cpu", device_count=1,
                mesh="", block_sizes="", status="ok", flops=10.0, bytes=20.0)
    base.update(kw)
    return Record(**base)


def test_schema_has_the_design_fields():
    assert DESIGN_FIELDS <= set(records.FIELDS)
    assert set(records.KEY) <= set(records.FIELDS)


def test_validate():
    records.validate(_record())
    with pytest.raises(ValueError, match="status"):
        records.validate(_record(status="fine"))
    with pytest.raises(ValueError, match="device_count"):
        records.validate(_record(device_count="1"))
    records.validate(_record(status="unsupported", flops=0.0, reason="needs a GPU"))


def test_unique_keeps_the_last_per_key():
    a, b = _record(steady_state_time=1.0), _record(steady_state_time=2.0)
    other = _record(implementation="pallas_triton")
    out = records.unique([a, other, b])
    assert len(out) == 2
    assert [r.steady_state_time for r in out if r.implementation == "xla"] == [2.0]
    # Every key field separates records.
    for field, value in [("shape", "u[m=4]"), ("dtype", "float32"), ("backend", "gpu"),
                         ("device_count", 2), ("mesh", "data=2"), ("block_sizes", '{"tm": 64}'),
                         ("kernel", "grouped_projection.fwd_bwd")]:
        assert len(records.unique([a, _record(**{field: value})])) == 2


def test_write_merges_and_replaces(tmp_path):
    folder = str(tmp_path / "results")
    records.write([_record(steady_state_time=1.0), _record(implementation="b")], folder)
    merged = records.write([_record(steady_state_time=3.0)], folder)
    assert len(merged) == 2
    lines = open(os.path.join(folder, records.JSONL)).read().splitlines()
    assert len(lines) == 2
    rows = [json.loads(line) for line in lines]
    assert {r["implementation"] for r in rows} == {"xla", "b"}
    assert [r["steady_state_time"] for r in rows if r["implementation"] == "xla"] == [3.0]
    with open(os.path.join(folder, records.CSV)) as f:
        table = list(csv.DictReader(f))
    assert len(table) == 2 and list(table[0]) == list(records.FIELDS)
    loaded = records.load(folder)
    assert [dataclasses.asdict(r) for r in loaded] == [dataclasses.asdict(r) for r in merged]


def test_environment_fields():
    env = records.environment()
    assert set(env) == {"git_sha", "xla_flags", "backend_env", "timestamp"}
    assert "jax" in json.loads(env["backend_env"])


def test_refusals_are_unsupported_and_raises_are_crashed():
    from pallasite.bench import runner

    refused = ValueError("chunk_ssd: no implementation ran:\n  pallas_triton: one program "
                         "needs 425984 bytes > pallas_triton budget 232448")
    raised = ValueError("chunk_ssd: no implementation ran:\n  pallas_triton: TypeError: bad")
    assert runner._unsupported_message(refused)
    assert not runner._unsupported_message(raised)
    assert runner._unsupported_message(NotImplementedError("x"))
    assert not runner._unsupported_message(RuntimeError("CUDA error"))


def test_table_marks_host_bound_records():
    """A record whose calls took the host as long to issue as to run says so in the table."""
    from pallasite.bench import cli

    bound = _record(timing="device", steady_state_time=1e-3, host_issue_time=0.95e-3)
    free = _record(implementation="torch", timing="device", steady_state_time=1e-3,
                   host_issue_time=0.1e-3)
    cpu = _record(implementation="jax.lax.ragged_dot", timing="host", steady_state_time=1e-3,
                  host_issue_time=0.99e-3)
    lines = cli.table([bound, free, cpu]).splitlines()
    assert lines[2].endswith("device host-bound") and lines[3].endswith("device")
    assert lines[4].endswith("host")  # on a CPU the host runs the work itself


_WRITER = """
import sys
from pallasite.bench import records
folder, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(n):  # one record a write, as the main job writes them
    records.write([records.Record(
        kernel="grouped_projection.fwd", implementation=f"{name}{i}", shape="t[m=4]",
        dtype="bfloat16", backend="cpu", device_kind="cpu", device_count=1, mesh="",
        block_sizes="", status="ok", flops=10.0, bytes=20.0)], folder)
"""


def test_two_processes_writing_one_folder_keep_every_record(tmp_path):
    """Two runs sharing one --results folder: each record of both is kept, in both files."""
    import subprocess
    import sys

    folder, n = str(tmp_path / "results"), 60
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, folder, name, str(n)], env=env,
                              stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    names = {r.implementation for r in records.load(folder)}
    assert names == {f"{w}{i}" for w in "ab" for i in range(n)}
    with open(os.path.join(folder, records.CSV)) as f:
        assert len(list(csv.DictReader(f))) == 2 * n
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]


def test_a_truncated_last_line_is_skipped_naming_file_and_line(tmp_path):
    """A run killed mid-write (or a full disk) leaves half a line: load warns with
    file:line and keeps the rest; the next write keeps its new record and drops the half."""
    folder = str(tmp_path / "results")
    records.write([_record(), _record(implementation="b")], folder)
    path = os.path.join(folder, records.JSONL)
    with open(path, "a") as f:
        f.write('{"kernel": "grouped_projection.fwd", "implem')
    with pytest.warns(UserWarning, match=f"{path}:3: skipped"):
        assert [r.implementation for r in records.load(folder)] == ["xla", "b"]
    with pytest.warns(UserWarning, match=f"{path}:3"):
        merged = records.write([_record(implementation="c")], folder)
    assert [r.implementation for r in merged] == ["xla", "b", "c"]
    assert len(open(path).read().splitlines()) == 3


@pytest.mark.parametrize("line", ["[1, 2]", '{"kernel": "x"}', "null"])
def test_a_line_that_is_not_a_record_is_skipped(tmp_path, line):
    folder = str(tmp_path / "results")
    records.write([_record()], folder)
    with open(os.path.join(folder, records.JSONL), "a") as f:
        f.write(line + "\n")
    with pytest.warns(UserWarning, match=f"{records.JSONL}:2: skipped"):
        assert len(records.load(folder)) == 1


def test_table_keeps_long_notes_whole_and_explains_its_columns():
    """A note too long for the last column goes whole onto the lines below its row, not cut
    to a few characters; a legend says what roof% and rel_l2 are and where the rest is."""
    from pallasite.bench import cli

    reason = ("kernel timings need a GPU/TPU; " * 6).strip()
    text = cli.table([_record(implementation="reference.ssd_chunked", peer=True,
                              status="unsupported", reason=reason),
                      _record(timing="host", steady_state_time=1e-3)])
    lines = text.splitlines()
    assert max(map(len, lines)) <= cli.TABLE_WIDTH
    assert "..." not in text and reason in " ".join(line.strip() for line in lines)
    assert lines[3].startswith("    ") and lines[-1].startswith("Every field")
    legend = " ".join(lines[lines.index(next(x for x in lines if x.startswith("* "))):])
    for words in ("roof%:", "rel_l2:", "docs/benchmarks.md"):
        assert words in legend
