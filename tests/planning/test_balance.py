"""Tests for torchgpipe-style balance lists: ``pl.balance``, ``balance_by_time``, ``balance_by_size``."""

from __future__ import annotations

import pytest

import placement as pl
from tests.planning.helpers import assert_matches_torch, devices_by_op


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt", "unet"])
def test_balance_by_op_places_consecutive_runs(exported, name):
    model, net, args = exported(name)
    n = len(model.ops)
    sizes = [n // 3, n // 3, n - 2 * (n // 3)]
    pl.balance(model, sizes)
    expected = ["cuda:0"] * sizes[0] + ["cuda:1"] * sizes[1] + ["cuda:2"] * sizes[2]
    assert [str(op.device) for op in model.ops] == expected
    assert_matches_torch(model, net, args)


def test_balance_by_module(exported):
    model, net, args = exported("gpt")
    pl.balance(model, [2, 2, 2], by="module", devices=["cuda:1", "cuda:0", "cpu"])
    assert [str(d) for d in pl.module_devices(model).values()] == [
        "cuda:1",
        "cuda:1",
        "cuda:0",
        "cuda:0",
        "cpu",
        "cpu",
    ]
    assert_matches_torch(model, net, args)


def test_balance_errors(exported):
    model, _, _ = exported("mlp")
    before = devices_by_op(model)
    with pytest.raises(pl.PlanError, match="adds up to 4, but the model has 5 ops"):
        pl.balance(model, [2, 2])
    with pytest.raises(pl.PlanError, match="top-level modules"):
        pl.balance(model, [1, 1], by="module")
    with pytest.raises(pl.PlanError, match="non-negative"):
        pl.balance(model, [6, -1])
    with pytest.raises(pl.PlanError, match="2 runs but 1 devices"):
        pl.balance(model, [2, 3], devices=[0])
    with pytest.raises(pl.PlanError, match="by must be"):
        pl.balance(model, [5], by="layer")
    with pytest.raises(pl.PlanError):
        pl.balance(model, [])
    assert devices_by_op(model) == before


def test_balance_by_size_is_positive_and_exact(exported):
    model, _, _ = exported("resnet")
    sizes = pl.balance_by_size(model, 4)
    assert sum(sizes) == len(model.ops) and all(s > 0 for s in sizes)
    costs = pl.profile(model, time=False).costs("size")
    start, worst = 0, 0
    for s in sizes:
        worst = max(worst, sum(costs[start : start + s]))
        start += s
    plan = pl.auto_place(model.copy(), devices=4, cost="size")
    assert worst == plan.bottleneck  # the same exact optimum as the planner


def test_balance_by_time_by_module_then_apply(exported):
    model, net, args = exported("gpt")
    sizes = pl.balance_by_time(model, 2, by="module", repeats=1)
    assert sum(sizes) == len(pl.module_devices(model)) and all(s > 0 for s in sizes)
    pl.balance(model, sizes, by="module")
    assert {str(d) for d in model.devices} == {"cuda:0", "cuda:1"}
    assert_matches_torch(model, net, args)


def test_balance_by_size_param_scale_moves_the_cut(exported):
    model, _, _ = exported("mlp")
    assert sum(pl.balance_by_size(model, 2, param_scale=4.0)) == len(model.ops)
