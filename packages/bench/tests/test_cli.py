"""The main job end to end on the smallest subset; the plot file; the GPU path."""

import json
import os

import pytest

from pallasite.bench import cli, plot, records, roofline


def _run(tmp_path, *extra):
    folder = str(tmp_path / "results")
    code = cli.main(["--smoke", "--results", folder, "--samples", "3", "--warmup", "1",
                     "--budget-s", "1", *extra])
    return code, folder


def test_cli_smoke(tmp_path, capsys):
    code, folder = _run(tmp_path, "--implementation", "xla", "--implementation", "ragged_dot",
                        "--implementation", "pallas_triton", "--implementation", "tokamax")
    out = capsys.readouterr().out
    assert code == 0
    assert "Kernel timings" in out and "need a GPU" in out
    assert "gp.fwd" in out and "ssd.fwd" in out
    table = out[out.index("kernel  "):out.index("records: ")]
    assert max(len(line) for line in table.splitlines()) <= cli.TABLE_WIDTH
    recs = records.load(folder)
    by = {(r.kernel, r.implementation): r for r in recs}
    assert by[("grouped_projection.fwd", "xla")].status == "ok"
    assert by[("grouped_projection.fwd", "xla")].steady_state_time > 0
    assert by[("grouped_projection.fwd", "xla")].temp_bytes >= 0  # XLA's memory analysis
    assert by[("grouped_projection.fwd", "jax.lax.ragged_dot")].peer
    assert by[("grouped_projection.fwd", "tokamax.mosaic")].status == "unsupported"
    triton = by[("grouped_projection.fwd", "pallas_triton")]
    assert triton.status == "ok" and triton.timing.startswith("parity only")
    assert triton.error_rel_l2 < 2e-2 and triton.steady_state_time is None
    # Records carry the block sizes the compiled function chose; XLA chooses none.
    assert json.loads(triton.block_sizes)["pallas_triton:forward"]["block_m"] > 0
    assert by[("grouped_projection.fwd", "xla")].block_sizes == ""
    assert by[("chunk_ssd.fwd", "xla")].status == "ok"
    for r in recs:
        records.validate(r)
    assert len(recs) == len(records.unique(recs))
    png = os.path.join(folder, "roofline.png")
    assert os.path.getsize(png) > 1000 and open(png, "rb").read(4) == b"\x89PNG"
    # Running again replaces, not duplicates; measured ceilings are kept beside the records.
    _run(tmp_path, "--implementation", "xla", "--op", "grouped_projection",
         "--measure-ceilings")
    again = records.load(folder)
    assert len(again) == len(recs)
    ceilings = json.load(open(os.path.join(folder, "ceilings.json")))
    assert ceilings["source"].startswith("measured") and ceilings["tbps"] > 0


def test_cli_list(capsys):
    assert cli.main(["--suite", "targets", "--list", "--shape", "dsv3",
                     "--direction", "fwd", "--no-peers"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all("dsv3" in line and "fwd" in line for line in lines)
    assert not any("ragged_dot" in line for line in lines)


def test_plot_labels_every_point(tmp_path):
    recs = [records.Record(kernel=f"chunk_ssd.{d}", implementation=i, shape="s[b=1]",
                           dtype="bfloat16", backend="gpu", device_kind="NVIDIA H200",
                           device_count=1, mesh="", block_sizes="", status="ok", peer=i != "xla",
                           flops=1e12, bytes=1e9 * (1 + n), tflops=100.0 + n)
            for n, (d, i) in enumerate([("fwd", "xla"), ("fwd_bwd", "mamba_ssm.triton")])]
    path = plot.roofline_png(recs, roofline.lookup("sm90", "NVIDIA H200"),
                             str(tmp_path / "r.png"))
    assert os.path.getsize(path) > 1000
    assert plot._label(recs[1]) == "mamba_ssm.triton ssd s fwd_bwd"
    assert plot.roofline_png(recs[:0], roofline.cpu_roofline(), str(tmp_path / "n.png")) is None


@pytest.mark.gpu
def test_cli_gpu_times_on_the_device(tmp_path):
    folder = str(tmp_path / "results")
    cli.main(["--quick", "--results", folder, "--op", "grouped_projection", "--direction",
              "fwd", "--implementation", "ragged_dot", "--implementation", "triton"])
    recs = {r.implementation: r for r in records.load(folder)}
    rd = recs["jax.lax.ragged_dot"]
    assert rd.status == "ok" and rd.timing == "device" and rd.tflops > 0
    # the host's issue time per call is recorded beside the device time it bounds
    assert 0 < rd.host_issue_time and rd.steady_state_time > 0
    assert json.loads(rd.backend_env)["jax"]


def test_main_job_without_matplotlib(tmp_path, capsys, monkeypatch):
    """No matplotlib (a plain pip install): the job finishes, says how to get the plot."""
    import builtins

    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    code, _ = _run(tmp_path, "--implementation", "xla", "--op", "grouped_projection")
    out = capsys.readouterr().out
    assert code == 0 and "matplotlib is not installed" in out and "records:" in out


def test_quick_on_a_cpu_says_what_ran(tmp_path, capsys):
    code = cli.main(["--quick", "--implementation", "xla", "--op", "grouped_projection",
                     "--results", str(tmp_path / "r"), "--no-plot", "--warmup", "1",
                     "--samples", "2", "--budget-s", "1"])
    assert code == 0 and "ran the cpu suite instead" in capsys.readouterr().out


def _no_benchmark(*_args, **_kwargs):
    raise AssertionError("a benchmark ran")


def test_an_unwritable_results_folder_fails_before_any_benchmark(tmp_path, capsys,
                                                                  monkeypatch):
    from pallasite.bench import runner

    monkeypatch.setattr(runner, "run_one", _no_benchmark)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code = cli.main(["--smoke", "--implementation", "xla", "--results", str(blocker / "r")])
    err = capsys.readouterr().err
    assert code == 2 and f"--results {str(blocker / 'r')!r}" in err and "not writable" in err


def test_a_truncated_records_file_is_reported_before_any_benchmark(tmp_path, recwarn,
                                                                    monkeypatch):
    """The warning names file:line and comes before the first benchmark; the run goes on
    and its records are kept."""
    from pallasite.bench import runner

    folder = tmp_path / "results"
    folder.mkdir()
    (folder / records.JSONL).write_text('{"kernel": "grouped_projection.fwd", "imp')
    real = runner.run_one
    said = []

    def run_one(*args, **kwargs):
        said.append([str(w.message) for w in recwarn])  # warned before the first benchmark
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_one", run_one)
    code, _ = _run(tmp_path, "--implementation", "xla", "--op", "grouped_projection",
                   "--no-plot")
    assert code == 0
    assert any(f"{folder / records.JSONL}:1: skipped" in m for m in said[0]), said[0]
    assert [r.implementation for r in records.load(str(folder))] == ["xla"]


def test_help_points_to_the_field_docs(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "docs/benchmarks.md" in out and "roof%" in out and "rel_l2" in out


@pytest.mark.parametrize("flag, pattern, known", [
    ("--shape", "olmo3", "olmoe"), ("--implementation", "trition", "pallas_triton")])
def test_a_filter_that_matches_nothing_is_an_error_listing_the_names(tmp_path, capsys, flag,
                                                                     pattern, known):
    folder = tmp_path / "results"
    with pytest.raises(SystemExit) as exit_:
        cli.main([flag, pattern, "--results", str(folder)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{flag} {pattern!r} matches no" in err and known in err
    assert not folder.exists()


def test_filters_that_leave_nothing_to_run_are_an_error(tmp_path, capsys, monkeypatch):
    """Each filter matches something, but no case of the suite has such an implementation."""
    from pallasite.bench import runner

    monkeypatch.setattr(runner, "run_one", _no_benchmark)
    folder = tmp_path / "results"
    code = cli.main(["--smoke", "--op", "chunk_ssd", "--implementation", "ragged_dot",
                     "--results", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and "nothing to run" in err and "reference.ssd_chunked" in err
    assert not folder.exists()


def _fake(impl, peer, status):
    return records.Record(kernel="grouped_projection.fwd_bwd", implementation=impl,
                          shape="quick[m=8]", dtype="bfloat16", backend="gpu",
                          device_kind="NVIDIA H200", device_count=1, mesh="", block_sizes="",
                          status=status, peer=peer, timing="device", flops=1e12, bytes=1e9,
                          steady_state_time=1e-2, tflops=100.0, error_rel_l2=0.5)


def test_a_wrong_peer_is_reported_but_does_not_fail_the_run(tmp_path, capsys, monkeypatch):
    """The exit status speaks for pallasite's own implementations; a peer's wrong result
    is in the records, the table and the count."""
    from pallasite.bench import runner

    monkeypatch.setattr(runner, "run_one", lambda case, impl, ctx: _fake(
        impl.name, impl.peer, "wrong" if impl.name == "jax.lax.ragged_dot" else "ok"))
    code, _ = _run(tmp_path, "--op", "grouped_projection", "--implementation", "xla",
                   "--implementation", "ragged_dot", "--no-plot")
    out = capsys.readouterr().out
    assert code == 0 and "1 wrong (1 of them a peer's)" in out
    monkeypatch.setattr(runner, "run_one", lambda case, impl, ctx: _fake(
        impl.name, impl.peer, "wrong"))
    code, _ = _run(tmp_path, "--op", "grouped_projection", "--implementation", "xla",
                   "--no-plot")
    assert code == 1


def test_wrong_points_are_red_peers_or_not():
    """The plot's title says red is wrong: a wrong peer's point is red, not gray."""
    colours = [plot.colour(_fake(impl, peer, status)) for impl, peer, status in (
        ("xla", False, "ok"), ("xla", False, "wrong"), ("tokamax.mosaic", True, "ok"),
        ("tokamax.mosaic", True, "wrong"))]
    assert colours == ["tab:blue", "tab:red", "tab:gray", "tab:red"]
