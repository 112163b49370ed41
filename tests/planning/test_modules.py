"""Tests for module maps: ``pl.module_devices`` and ``pl.assign_modules`` (modelsplit's layer_gpus)."""

from __future__ import annotations

import pytest

import placement as pl
from placement.planning.modules import match_scope
from tests.planning.helpers import assert_matches_torch, devices_by_op


def test_module_devices_expands_numbered_containers(exported):
    model, _, _ = exported("gpt")
    assert list(pl.module_devices(model)) == ["wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head"]
    assert list(pl.module_devices(model, expand_containers=False)) == [
        "wte",
        "wpe",
        "blocks",
        "ln_f",
        "lm_head",
    ]
    fine = pl.module_devices(model, fine_grained=True)
    assert "blocks.0.attn.c_attn" in fine and "blocks.1.mlp.c_proj" in fine
    assert set(map(str, fine.values())) == {"cuda:0"}


def test_module_devices_named_children(exported):
    model, net, _ = exported("unet")
    children = [name for name, _ in net.named_children()]
    assert list(pl.module_devices(model)) == [c for c in children if c in pl.module_devices(model)]
    assert set(pl.module_devices(model)) <= set(children)


def test_match_scope_is_a_path_prefix_and_longest_wins():
    keys = {"blocks", "blocks.0", "blocks.1.mlp"}
    assert match_scope("blocks.0.attn", keys) == "blocks.0"
    assert match_scope("blocks.01.attn", keys) == "blocks"
    assert match_scope("blocks.1.mlp.c_fc", keys) == "blocks.1.mlp"
    assert match_scope("blocks.1.attn", keys) == "blocks"
    assert match_scope("block", keys) is None
    assert match_scope(None, keys) is None


def test_assign_modules_second_half_of_gpt(exported):
    model, net, args = exported("gpt")
    layer_gpus = pl.module_devices(model)
    for key in ["blocks.1", "ln_f", "lm_head"]:
        layer_gpus[key] = 1
    pl.assign_modules(model, layer_gpus)
    for op in model.ops:
        if op.scope and op.scope.split(".")[0] in ("ln_f", "lm_head"):
            assert str(op.device) == "cuda:1"
        if op.scope and op.scope.startswith("blocks.0"):
            assert str(op.device) == "cuda:0"
    # unscoped ops follow their neighbours: the split inside blocks.1's attention is on 1
    unscoped = [op for op in model.ops if op.scope is None]
    assert unscoped
    acts_index = {op.name: i for i, op in enumerate(model.ops)}
    first_block1 = min(
        acts_index[op.name] for op in model.ops if op.scope and op.scope.startswith("blocks.1")
    )
    for op in unscoped:
        expected = "cuda:1" if acts_index[op.name] > first_block1 else "cuda:0"
        assert str(op.device) == expected, op.name
    assert_matches_torch(model, net, args)


def test_assign_modules_longest_key_wins(exported):
    model, _, _ = exported("gpt")
    pl.assign_modules(model, {"blocks": 1, "blocks.1.mlp": 2})
    for op in model.ops:
        if op.scope and op.scope.startswith("blocks.1.mlp"):
            assert str(op.device) == "cuda:2"
        elif op.scope and op.scope.startswith("blocks"):
            assert str(op.device) == "cuda:1"
        elif op.scope in ("wte", "wpe"):
            assert str(op.device) == "cuda:0"


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt", "unet"])
def test_assign_modules_fine_grained_round_robin_keeps_outputs(exported, name):
    model, net, args = exported(name)
    fine = pl.module_devices(model, fine_grained=True)
    for k, key in enumerate(fine):
        fine[key] = k % 3
    pl.assign_modules(model, fine)
    for op in model.ops:
        if op.scope:
            assert op.device == pl.Device.parse(fine[op.scope])
    assert_matches_torch(model, net, args)


def test_assign_modules_unknown_module_lists_known_ones(exported):
    model, _, _ = exported("resnet")
    before = devices_by_op(model)
    with pytest.raises(pl.PlanError, match="layer9") as err:
        pl.assign_modules(model, {"layer1": 1, "layer9": 1})
    assert "layer1" in str(err.value) and "known top-level modules" in str(err.value)
    assert devices_by_op(model) == before


def test_assign_modules_bad_device_names_the_module(exported):
    model, _, _ = exported("mlp")
    before = devices_by_op(model)
    with pytest.raises(pl.DeviceError, match="fc2"):
        pl.assign_modules(model, {"fc1": 1, "fc2": "tpu:0"})
    assert devices_by_op(model) == before
    with pytest.raises(pl.PlanError):
        pl.assign_modules(model, ["fc1"])
    with pytest.raises(pl.PlanError):
        pl.assign_modules(model, {"": 1})


def test_assign_modules_refuses_models_with_copies(exported):
    model, _, _ = exported("mlp")
    pl.assign_modules(model, {"fc3": 1})
    pl.inject_cross_device_copies(model)
    with pytest.raises(pl.PlanError, match="copies"):
        pl.assign_modules(model, {"fc3": 0})
