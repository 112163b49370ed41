"""Rank maps and the split of a lowered model into a chain of rank stages (in one process)."""

from __future__ import annotations

import pytest
import torch

import placement as pl
from placement.distributed import NotAPipelineError, WorldSizeError, rank_groups, split_by_rank
from tests.distributed.test_torch_ranks import place, place_dynamic


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


def test_shape_values_cross_ranks_as_zero_size_tokens():
    """A dynamic batch's reshape targets are rebuilt on the reading rank from a shape token: no
    integer data crosses, so a stage whose inputs are made from metadata alone (as
    torch.distributed.pipelining makes them: uninitialized memory) still gets the right shapes."""
    model = place_dynamic("gpt", 2)
    module = pl.to_torch(model, device_map="cpu")
    split = split_by_rank(module, rank_groups(model))
    idx = torch.randint(0, 64, (5, 8))  # a batch size the export never saw
    sent = split.stages[0](idx)
    assert any(t.numel() == 0 for t in sent)  # the token
    assert all(t.is_floating_point() or t.numel() == 0 for t in sent), [t.dtype for t in sent]
    torch.testing.assert_close(split.stages[1](*sent), module(idx))
    with torch.no_grad():
        from_metadata = split.stages[1](*[torch.empty_like(t) for t in sent])
    assert from_metadata.shape == (5, 8, 64)


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
