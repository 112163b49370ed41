"""Rank maps and the split of a lowered model into a chain of rank stages (in one process)."""

from __future__ import annotations

import pytest
import torch

import placement as pl
from placement.distributed import NotAPipelineError, WorldSizeError, rank_groups, split_by_rank
from tests.distributed.test_torch_ranks import place


def _chain(split, args):
    values = args
    for stage in split.stages:
        values = stage(*values)
        values = values if isinstance(values, tuple) else (values,)
    return values


@pytest.mark.parametrize("name", ["gpt", "unet"])
def test_chain_of_stages_equals_the_module(name):
    model, batch = place(name, 3)
    module = pl.to_torch(model, device_map="cpu")
    rows = model.graph.inputs[0].shape[0]
    args = [torch.from_numpy(a[:rows]) for a in batch]
    split = split_by_rank(module, rank_groups(model))
    want = module(*args)
    want = want if isinstance(want, tuple) else (want,)
    for got, ref in zip(_chain(split, args), want):
        torch.testing.assert_close(got, ref)
    # the graph outputs leave from the last rank; skips pass through the middle one
    assert len(split.stages) == 3 and all(split.boundaries)


def test_tied_weight_is_shared_by_first_and_last_rank():
    model, _ = place("gpt", 3)
    split = split_by_rank(pl.to_torch(model, device_map="cpu"), rank_groups(model))
    assert split.shared_parameters == {"lm_head.weight": [0, 2]}


def test_grouped_ranks_and_bad_maps():
    model, _ = place("mlp", 3)
    assert [[str(d) for d in g] for g in rank_groups(model, ranks="cuda:0+cuda:1,cuda:2")] == [
        ["cuda:0", "cuda:1"],
        ["cuda:2"],
    ]
    with pytest.raises(pl.DeviceError, match="cuda:5"):
        rank_groups(model, ranks="cuda:0,cuda:1,cuda:5")
    with pytest.raises(pl.DeviceError, match="no rank to device"):
        rank_groups(model, ranks="cuda:0,cuda:1")
    with pytest.raises(pl.DeviceError, match="ranks 0 and 1"):
        rank_groups(model, ranks="cuda:0,cuda:0+cuda:1,cuda:2")


def test_later_rank_feeding_an_earlier_one_is_refused():
    model, _ = place("mlp", 3)
    module = pl.to_torch(model, device_map="cpu")
    backwards = [[pl.Device("cuda", 2)], [pl.Device("cuda", 1)], [pl.Device("cuda", 0)]]
    with pytest.raises(NotAPipelineError, match="do not form a pipeline"):
        split_by_rank(module, backwards)


def test_world_size_error_names_both_numbers():
    err = WorldSizeError(world_size=3, expected=2, groups=["cuda:0", "cuda:1"])
    assert isinstance(err, pl.PlacementError) and "world size 3" in str(err) and "2 rank(s)" in str(err)
