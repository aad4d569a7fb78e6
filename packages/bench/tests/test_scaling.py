"""Sharded benchmark records (8 forced CPU devices): the scaling suite's cases, their
placement, and records that carry device_count and the mesh; checks run on gathered
copies, so a sharded run is held to the same tolerance as a one-device run."""

import dataclasses

import jax
import pytest

from pallasite.bench import cli, impls, ops, placement, records, runner, suites


def test_scaling_suite_has_one_device_weak_and_tensor_forms():
    cases = suites.suite("scaling", devices=2)
    gp = [c for c in cases if c.op == ops.GP and c.shape_name == "mixtral"
          and c.direction == "fwd_bwd"]
    assert [c.mesh_name for c in gp] == ["", "data=2", "model=2"]
    assert gp[1].d["m"] == 2 * gp[0].d["m"] and gp[2].d == gp[0].d
    ssd = [c for c in cases if c.op == ops.SSD and c.shape_name == "mamba2_b8_l4k"]
    assert ssd[1].d["b"] == 16 and ssd[1].devices == 2
    assert {c.direction for c in cases} == {"fwd_bwd", "fwd"}


def test_placement_specs():
    gp = ops.gp_case("t", 64, 32, 16, 4, mesh=(("data", 2), ("model", 2)))
    assert placement.specs(gp)["x"] == ("data", None)
    assert placement.specs(gp)["kernel"] == (None, None, "model")
    ssd = ops.ssd_case("s", 2, 64, 4, 16, 16, 1, chunk=32)
    ssd = dataclasses.replace(ssd, mesh=(("model", 2),))
    assert placement.specs(ssd)["b"] == (None, None, None, None)  # one group: replicated
    assert placement.specs(ssd)["x"] == (None, None, "model", None)


@pytest.mark.parametrize("op", [ops.GP, ops.SSD])
@pytest.mark.parametrize("mesh", [(("data", 2),), (("model", 2),), (("data", 2), ("model", 4))])
def test_sharded_records(op, mesh, capsys):
    if op == ops.GP:
        case = ops.gp_case("tiny", 96, 64, 128, 4, direction="fwd_bwd", mesh=mesh)
    else:
        case = ops.ssd_case("tiny", 2, 64, 4, 16, 16, 2, chunk=32, direction="fwd_bwd")
        case = dataclasses.replace(case, mesh=mesh)
    ctx = runner.Context({"warmup": 1, "samples": 2, "budget_s": 1.0, "copies": 1})
    xla = next(i for i in impls.IMPLS if i.op == op and i.name == "xla")
    rec = runner.run_one(case, xla, ctx)
    assert rec.status == "ok", rec.reason
    assert rec.device_count == case.devices and rec.mesh == case.mesh_name
    records.validate(rec)
    peer = next(i for i in impls.IMPLS if i.op == op and i.peer and i.framework == "jax")
    assert runner.run_one(case, peer, ctx).status == "unsupported"


def test_scaling_table_reports_efficiency():
    base = dict(kernel="k.fwd_bwd", implementation="xla", dtype="bfloat16", backend="gpu",
                device_kind="d", block_sizes="", status="ok", flops=1.0)
    recs = [records.Record(shape="s[m=4]", device_count=1, mesh="", steady_state_time=1.0,
                           **base),
            records.Record(shape="s[m=8]", device_count=2, mesh="data=2",
                           steady_state_time=1.05, **base),
            records.Record(shape="s[m=4]", device_count=2, mesh="model=2",
                           steady_state_time=0.5, **base)]
    text = cli.scaling_table(recs)
    assert "weak-scaling efficiency 0.952" in text and "speedup 2.000" in text
    assert jax.device_count() >= 2
