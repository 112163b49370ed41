"""Tests for ``placement.planning.plan``: applying, JSON and atomic files."""

from __future__ import annotations

import json

import pytest

import placement as pl
from tests.planning.helpers import devices_by_op


def test_plan_json_roundtrip_and_apply(exported, tmp_path):
    model, _, _ = exported("unet")
    plan = pl.auto_place(model, devices=["cuda:0", "cuda:1", "cpu"], cost="size")
    text = plan.to_json()
    assert json.loads(text)["cost_kind"] == "size"
    again = pl.Plan.from_json(text)
    assert again == plan
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = pl.Plan.load(path)
    fresh, _, _ = exported("unet")
    loaded.apply(fresh)
    assert devices_by_op(fresh) == devices_by_op(model)
    assert "bottleneck" in str(plan) and "cuda:1" in str(plan)


def test_plan_apply_rejects_other_models(exported):
    model, _, _ = exported("mlp")
    plan = pl.auto_place(model, devices=2, cost="size")
    other, _, _ = exported("resnet")
    before = devices_by_op(other)
    with pytest.raises(pl.UnknownOpError):
        plan.apply(other)
    assert devices_by_op(other) == before
    with pytest.raises(pl.PlanError):
        pl.Plan.from_json("[1, 2]")
    with pytest.raises(pl.PlanError):
        pl.Plan.from_json('{"assignment": {}}')


def test_plan_save_is_atomic_and_every_failure_is_a_plan_error(exported, tmp_path, monkeypatch):
    model, _, _ = exported("mlp")
    plan = pl.auto_place(model, devices=2, cost="size")
    path = tmp_path / "plan.json"
    plan.save(path)
    before = path.read_bytes()

    def boom(self, **kwargs):
        raise ValueError("cannot serialise")

    monkeypatch.setattr(pl.Plan, "to_json", boom)
    with pytest.raises(pl.PlanError, match="cannot serialise"):
        plan.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    with pytest.raises(pl.PlanError, match="plan.json"):
        plan.save(tmp_path / "missing" / "plan.json")
    with pytest.raises(pl.PlanError, match="not a regular file"):
        plan.save("/dev/null")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    with pytest.raises(pl.PlanError, match="not UTF-8"):
        pl.Plan.load(binary)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"devices": 3}')
    with pytest.raises(pl.PlanError, match="wrong.json"):
        pl.Plan.load(wrong)
    with pytest.raises(pl.PlanError, match="cannot read plan"):
        pl.Plan.load(tmp_path)  # a folder
