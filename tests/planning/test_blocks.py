"""Tests for ``pl.begin_block`` (poptorch's BeginBlock)."""

from __future__ import annotations

import pytest

import placement as pl
from placement.planning.blocks import blocks
from tests.planning.helpers import assert_matches_torch, devices_by_op


def _first(model, prefix):
    return next(i for i, op in enumerate(model.ops) if op.scope and (op.scope + ".").startswith(prefix + "."))


def test_begin_block_moves_module_and_everything_after(exported):
    model, net, args = exported("resnet")
    pl.begin_block(model, "layer2", device=1)
    start = _first(model, "layer2")
    assert start > 0
    for i, op in enumerate(model.ops):
        assert str(op.device) == ("cuda:1" if i >= start else "cuda:0"), op.name
    assert_matches_torch(model, net, args)


def test_begin_block_calls_compose_in_any_order(exported):
    a, net, args = exported("gpt")
    pl.begin_block(a, "blocks.0", device=1)
    pl.begin_block(a, "blocks.1", device=2)
    pl.begin_block(a, "ln_f", device=3)
    b, _, _ = exported("gpt")
    pl.begin_block(b, "ln_f", device=3)
    pl.begin_block(b, "blocks.0", device=1)
    pl.begin_block(b, "blocks.1", device=2)
    assert devices_by_op(a) == devices_by_op(b)
    assert [str(d) for d in pl.module_devices(a).values()] == [
        "cuda:0",
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:3",
        "cuda:3",
    ]
    assert [m for m, _ in blocks(b)] == ["blocks.0", "blocks.1", "ln_f"]
    assert_matches_torch(a, net, args)


def test_begin_block_again_moves_the_same_block(exported):
    model, _, _ = exported("gpt")
    pl.begin_block(model, "blocks.1", device=1)
    pl.begin_block(model, "blocks.1", device=2)
    assert {str(op.device) for op in model.ops[_first(model, "blocks.1") :]} == {"cuda:2"}
    assert blocks(model) == [("blocks.1", pl.Device("cuda", 2))]


def test_stale_blocks_are_forgotten(exported):
    model, _, _ = exported("gpt")
    pl.begin_block(model, "blocks.1", device=1)
    pl.assign_modules(model, {"blocks.1": 0})  # another front-end overwrote the block start
    assert blocks(model) == []
    pl.begin_block(model, "blocks.0", device=2)
    assert {str(op.device) for op in model.ops[_first(model, "blocks.0") :]} == {"cuda:2"}


def test_blocks_survive_save_and_load(exported, tmp_path):
    model, _, _ = exported("mlp")
    pl.begin_block(model, "fc3", device=1)
    path = tmp_path / "m.onnx"
    model.save(path)
    loaded = pl.load(path)
    assert blocks(loaded) == [("fc3", pl.Device("cuda", 1))]
    pl.begin_block(loaded, "fc2", device=2)  # runs up to the recorded fc3 block
    assert [str(op.device) for op in loaded.ops] == ["cuda:0", "cuda:0", "cuda:2", "cuda:2", "cuda:1"]


def test_begin_block_errors_leave_model_unchanged(exported):
    model, _, _ = exported("resnet")
    before = devices_by_op(model)
    with pytest.raises(pl.PlanError, match="layer9") as err:
        pl.begin_block(model, "layer9", device=1)
    assert "layer1" in str(err.value)
    with pytest.raises(pl.DeviceError):
        pl.begin_block(model, "layer1", device="tpu")
    with pytest.raises(pl.PlanError):
        pl.begin_block(model, "", device=1)
    assert devices_by_op(model) == before
