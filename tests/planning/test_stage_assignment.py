"""Tests for Keras-IPU-style stage assignment and ``pl.summary``."""

from __future__ import annotations

import pytest

import placement as pl
from tests.planning.helpers import assert_matches_torch, devices_by_op


def test_stage_assignment_split_on_a_layer_name(exported):
    model, net, args = exported("resnet")
    assignments = pl.get_stage_assignment(model)
    assert [a.op for a in assignments] == [op.name for op in model.ops]
    assert {a.stage for a in assignments} == {0}
    stage = 0
    for a in assignments:
        if a.scope and a.scope.startswith("layer2"):
            stage = 1
        a.stage = stage
    pl.set_stage_assignment(model, assignments)
    got = pl.get_stage_assignment(model)
    assert [a.stage for a in got] == [a.stage for a in assignments]
    assert {a.stage for a in got} == {0, 1}
    assert_matches_torch(model, net, args)


def test_stage_assignment_mapping_and_device_list(exported):
    model, _, _ = exported("mlp")
    names = [op.name for op in model.ops]
    pl.set_stage_assignment(model, {names[-1]: 1, names[-2]: 1}, devices=["cuda:0", "cpu"])
    assert [str(op.device) for op in model.ops] == ["cuda:0", "cuda:0", "cuda:0", "cpu", "cpu"]
    assert [a.stage for a in pl.get_stage_assignment(model, devices=["cuda:0", "cpu"])] == [0, 0, 0, 1, 1]
    with pytest.raises(pl.PlanError, match="devices"):
        pl.get_stage_assignment(model)  # cpu is no default stage


def test_set_stage_assignment_errors_are_transactional(exported):
    model, _, _ = exported("mlp")
    names = [op.name for op in model.ops]
    before = devices_by_op(model)
    with pytest.raises(pl.UnknownOpError, match="nope"):
        pl.set_stage_assignment(model, {names[0]: 1, "nope": 1})
    with pytest.raises(pl.PlanError, match="non-negative"):
        pl.set_stage_assignment(model, {names[0]: -1})
    with pytest.raises(pl.PlanError, match="only 2 devices"):
        pl.set_stage_assignment(model, {names[0]: 2}, devices=[0, 1])
    with pytest.raises(pl.PlanError):
        pl.set_stage_assignment(model, [("op", 1)])
    assert devices_by_op(model) == before


def test_summary_reports_peaks_time_and_copies(exported):
    model, _, _ = exported("gpt")
    plain = pl.summary(model)
    assert plain.rows[0].time_s is None and "-" in str(plain)
    pl.profile(model, repeats=1)
    pl.begin_block(model, "blocks.1", device=1)
    pl.inject_cross_device_copies(model)
    report = pl.summary(model)
    assert [str(r.device) for r in report.rows] == ["cuda:0", "cuda:1"]
    for row in report.rows:
        assert row.peak_activation_bytes > 0 and row.time_s is not None and row.time_s > 0
    assert report.row(0).sent_bytes > 0 and report.row(1).recv_bytes > 0
    text = str(report)
    assert "peak act." in text and "est. time" in text and "ms" in text
    total_time = pl.profile(model, repeats=1).total_time_s
    assert sum(r.time_s for r in report.rows) == pytest.approx(total_time)


def test_summary_print(exported, capsys):
    model, _, _ = exported("mlp")
    pl.summary(model, print_=True)
    assert "cuda:0" in capsys.readouterr().out
