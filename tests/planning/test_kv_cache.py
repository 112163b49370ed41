"""KV caches in memory planning and reports: ``auto_place(kv_cache=...)`` and ``summary(kv_cache=...)``."""

from __future__ import annotations

import pytest

import placement as pl
from placement.graph.causal_lm import kv_layers
from tests.generation.conftest import build_llama

# one worker builds the module-scoped export once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("planning_kv_cache")


@pytest.fixture(scope="module")
def llama() -> pl.Model:
    import torch

    return pl.from_causal_lm(build_llama(layers=4), torch.tensor([[1, 2, 3]]))


def test_summary_shows_kv_bytes_per_device(llama: pl.Model) -> None:
    model = llama.copy()
    pl.auto_place(model, devices=2, cost="flops")
    pl.inject_cross_device_copies(model)
    report = pl.summary(model, kv_cache=(8, 100))
    layers = kv_layers(model)
    total = sum(layer.bytes_for(8, 100) for layer in layers)
    assert sum(row.kv_cache_bytes for row in report.rows) == total
    assert all(row.kv_cache_bytes > 0 for row in report.rows)  # layers on both devices
    assert "KV cache (8x100)" in [column.header for column in report.columns]
    assert "KV cache" not in str(pl.summary(model))
    assert "KV" in str(report)


def test_auto_place_counts_the_cache_in_the_budget(llama: pl.Model) -> None:
    model = llama.copy()
    free = pl.auto_place(model.copy(), devices=2, cost="flops")
    per_layer = kv_layers(model)[0].bytes_for(16, 4096)
    planned = pl.auto_place(model, devices=2, cost="flops", kv_cache=(16, 4096))
    assert sum(d.kv_cache_bytes for d in planned.devices) == 4 * per_layer
    assert all(d.kv_cache_bytes == 0 for d in free.devices)
    assert all(d.memory >= d.kv_cache_bytes + d.param_bytes for d in planned.devices)
    # a budget that holds the weights but not the cache at this batch and length
    budget = max(d.memory for d in free.devices) + per_layer // 2
    pl.auto_place(model.copy(), max_memory={0: budget, 1: budget}, cost="flops")
    with pytest.raises(pl.InfeasiblePlacementError):
        pl.auto_place(model.copy(), max_memory={0: budget, 1: budget}, cost="flops", kv_cache=(16, 4096))


def test_bad_kv_cache_is_refused(llama: pl.Model) -> None:
    with pytest.raises(pl.PlanError, match="kv_cache"):
        pl.auto_place(llama.copy(), devices=2, cost="flops", kv_cache=(0, 10))
    mlp = pl.from_torch(*pl.models.mlp.build("tiny"))
    with pytest.raises(pl.PlanError, match="KV cache"):
        pl.auto_place(mlp, devices=2, cost="flops", kv_cache=(1, 10))
