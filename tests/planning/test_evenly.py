"""Tests for ``pl.place_evenly``: equal runs of activations per device."""

from __future__ import annotations

import pytest

import placement as pl


def test_place_evenly_splits_activations_into_equal_runs(exported):
    model, _, _ = exported("gpt")
    acts = pl.get_activation_blobs(model)
    pl.place_evenly(model, 3)
    pl.verify(model)
    devices = [str(model.device_of(a)) for a in acts]
    assert devices == sorted(devices)  # one contiguous run per device, in order
    counts = [devices.count(f"cuda:{k}") for k in range(3)]
    assert max(counts) - min(counts) <= 2, counts


@pytest.mark.parametrize("devices", [0, -1, 1.5, True, "2"])
def test_place_evenly_rejects_bad_device_counts(exported, devices):
    model, _, _ = exported("mlp")
    before = model.device_state()
    with pytest.raises(pl.PlanError, match="positive int"):
        pl.place_evenly(model, devices)
    assert model.device_state() == before


def test_place_evenly_refuses_a_split_model(exported):
    model, _, _ = exported("mlp")
    model.set_device(model.ops[-1].name, 1)
    with pytest.raises(pl.PlanError, match="one device"):
        pl.place_evenly(model, 2)
