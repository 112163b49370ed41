"""Tests for ``pl.measure_links``: copies timed between (emulated) devices, fitted links."""

from __future__ import annotations

import pytest

import placement as pl


def test_measure_links_times_both_directions_and_feeds_the_planner(exported):
    links = pl.measure_links(["cuda:0", "cuda:1"], device_map="cpu", sizes=(1 << 10, 1 << 20), repeats=3)
    forward, backward = links.link("cuda:0", "cuda:1"), links.link("cuda:1", "cuda:0")
    assert set(links.pairs) == {
        (pl.Device("cuda", 0), pl.Device("cuda", 1)),
        (pl.Device("cuda", 1), pl.Device("cuda", 0)),
    }
    for link in (forward, backward):
        assert link.bandwidth > 0 and link.latency >= 0
    model, _, _ = exported("mlp")
    plan = pl.auto_place(model, devices=2, repeats=2, links=links, fusion=False)
    assert plan.links is not None and plan.links["pairs"]
    moved = [d for d in plan.devices if d.bytes_in]
    assert all(d.transfer_time > 0 for d in moved)


def test_measure_links_rejects_bad_arguments():
    with pytest.raises(pl.PlanError, match="two devices"):
        pl.measure_links(["cuda:0"], device_map="cpu")
    with pytest.raises(pl.PlanError, match="increasing"):
        pl.measure_links(["cuda:0", "cuda:1"], device_map="cpu", sizes=(4096, 1024))
