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


def test_plan_offload_counts_the_cache_where_its_layers_run(llama: pl.Model) -> None:
    opts = {"cost": "flops", "links": "host", "apply": False, "workspace": "64KiB"}
    free = pl.plan_offload(llama.copy(), {0: "1GiB", "cpu": "1GiB"}, **opts)
    assert set(free.modes.values()) == {"resident"} and free.kv_cache_bytes() == (0, 0)
    cache = sum(layer.bytes_for(16, 4096) for layer in kv_layers(llama))
    # the whole model fits on the GPU without its cache, not with it
    budget = free.gpu_bytes + cache // 2
    assert pl.plan_offload(llama.copy(), {0: budget, "cpu": "1GiB"}, **opts).modes == free.modes
    planned = pl.plan_offload(llama.copy(), {0: budget, "cpu": "1GiB"}, kv_cache=(16, 4096), **opts)
    assert planned.fits and planned.kv_cache == (16, 4096)
    on_gpu, on_host = planned.kv_cache_bytes()
    assert on_gpu + on_host == cache and 0 < on_host and on_gpu <= budget
    assert "host" in planned.modes.values()
    assert planned.host_bytes >= on_host and planned.gpu_bytes <= budget
    # nowhere to put it: the host's budget holds the weights only
    tight = {0: budget, "cpu": free.host_bytes + sum(layer.param_bytes for layer in free.layers)}
    assert pl.plan_offload(llama.copy(), tight, **opts).fits
    with pytest.raises(pl.InfeasiblePlacementError, match="no offload plan fits"):
        pl.plan_offload(llama.copy(), tight, kv_cache=(16, 4096), **opts)


def test_auto_place_on_one_gpu_and_the_host_counts_the_cache(llama: pl.Model) -> None:
    model = llama.copy()
    plan = pl.auto_place(model, max_memory={0: "1GiB", "cpu": "1GiB"}, cost="flops", kv_cache=(16, 4096))
    gpu, host = plan.devices
    assert gpu.kv_cache_bytes + host.kv_cache_bytes == sum(
        layer.bytes_for(16, 4096) for layer in kv_layers(llama)
    )
    assert gpu.memory >= gpu.kv_cache_bytes + gpu.param_bytes
