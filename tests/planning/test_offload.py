"""The offload planner: one GPU plus host memory, streaming or host compute chosen from a link model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import placement as pl
from placement.models.synthetic import write_matmul_chain
from placement.planning.offload import Layer, _choose, simulate

RATES = {"cuda": 1e10, "cpu": 1e8}  # FLOP/s: a GPU 100x faster than the host
FAST, SLOW = pl.Link(1e12), pl.Link(1e7)  # slow: a layer's weights take 1.6 ms, its activations 0.1 ms


@pytest.fixture(scope="module")
def chain_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("chain") / "chain.onnx"
    write_matmul_chain(path, layers=12, width=64, batch=4)
    return path


def _weights(model: pl.Model) -> int:
    return sum(p.nbytes for p in model.parameters.values())


def _plan(model, budget, link, **kw):
    return pl.plan_offload(
        model, {0: budget, "cpu": "1GiB"}, cost="flops", links=link, throughput=RATES, **kw
    )


def test_fast_link_streams_interleaved_within_budget(chain_path):
    model = pl.load(chain_path)
    budget = int(_weights(model) * 0.8)
    plan = _plan(model, budget, FAST)
    modes = [plan.modes[layer.name] for layer in plan.layers]
    assert len(plan.layers) == 12 and plan.fits and plan.gpu_bytes <= budget
    assert "streamed" in modes and "host" not in modes
    assert all(not (a == b == "streamed") for a, b in zip(modes, modes[1:])), modes  # interleaved
    assert set(model.streamed) == set(plan.streamed_parameters())
    # the window counts in the budget: depth streamed layers (in use and ahead) + the ring's wrap
    layer_bytes = max(layer.param_bytes for layer in plan.layers)
    assert plan.window == plan.depth * layer_bytes + layer_bytes and plan.depth >= 1
    resident = sum(layer.param_bytes for layer, m in zip(plan.layers, modes) if m == "resident")
    assert plan.gpu_bytes == resident + plan.window + plan.activation_bytes + plan.workspace_bytes


def test_slow_link_computes_on_the_host(chain_path):
    model = pl.load(chain_path)
    plan = _plan(model, int(_weights(model) * 0.7), SLOW)
    modes = [plan.modes[layer.name] for layer in plan.layers]
    assert "host" in modes and "streamed" not in modes and plan.fits
    assert not model.streamed
    assert {str(d) for d in model.devices} == {"cuda:0", "cpu"}


@pytest.mark.parametrize("link", [FAST, SLOW], ids=["fast", "slow"])
def test_offloaded_chain_runs_equal_in_both_runtimes(chain_path, link):
    reference = pl.load(chain_path)
    model = pl.load(chain_path)
    _plan(model, int(_weights(model) * 0.7), link)
    pl.inject_cross_device_copies(model, output_device=0)
    pl.verify(model)
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    (expected,) = pl.run(reference, [x], device_map="cpu")
    dmap = {"cuda:0": "cpu", "cpu": "cpu"}
    (got,) = pl.run(model, [x], device_map=dmap)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    module = pl.to_torch(model, device_map=dmap)
    with torch.no_grad():
        np.testing.assert_allclose(module(torch.from_numpy(x)).numpy(), expected, atol=1e-5)


def test_gpt_slow_link_takes_blocks_to_the_host(exported):
    model, net, args = exported("gpt")
    budget = int(_weights(model) * 0.6)
    plan = _plan(model, budget, SLOW)
    assert plan.fits and "host" in plan.modes.values()
    pl.inject_cross_device_copies(model, output_device=0)
    (got,) = pl.run(model, [a.numpy() for a in args], device_map={"cuda:0": "cpu", "cpu": "cpu"})
    np.testing.assert_allclose(got, net(*args).detach().numpy(), atol=1e-4)


def test_auto_place_takes_accelerate_spelling(exported):
    model, _, _ = exported("gpt")
    budget = int(_weights(model) * 0.6)
    plan = pl.auto_place(model, max_memory={0: budget, "cpu": "48GiB"}, cost="flops")
    assert [d.device for d in plan.devices] == ["cuda:0", "cpu"]
    assert plan.fits and plan.devices[1].ops > 0
    assert pl.Plan.from_json(plan.to_json()) == plan
    # the same with the explicit spelling, and offload=False keeps the contiguous split
    again, _, _ = exported("gpt")
    assert pl.auto_place(again, max_memory={"cuda:0": budget, "cpu": "48GiB"}, cost="flops").fits
    split, _, _ = exported("gpt")
    contiguous = pl.auto_place(split, max_memory={0: budget, "cpu": "48GiB"}, cost="flops", offload=False)
    assert not contiguous.streamed


def test_plan_apply_restores_streaming(exported):
    model, _, _ = exported("gpt")
    plan = pl.Plan(
        assignment={op.name: "cuda:0" for op in model.ops},
        devices=[],
        cost_kind="flops",
        objective="throughput",
        bottleneck=0,
        lower_bound=0,
        total_cost=0,
        transfer_bytes=0,
        streamed={"blocks.0.mlp.c_fc.bias": "cpu"},
        stream_window=1024,
    )
    plan.apply(model)
    assert model.streamed == {"blocks.0.mlp.c_fc.bias": pl.Device("cpu")}


def test_infeasible_budget_names_the_need(chain_path):
    model = pl.load(chain_path)
    # the host holds every weight: everything runs there, however small the GPU's budget
    assert set(_plan(model, 1024, FAST, apply=False).modes.values()) == {"host"}
    with pytest.raises(pl.InfeasiblePlacementError, match="every layer on the host needs 192.0 KiB"):
        pl.plan_offload(model, {0: 1024, "cpu": "64KiB"}, cost="flops", links=FAST, throughput=RATES)
    assert not model.streamed and model.devices == [pl.Device("cuda", 0)]


def test_bad_budgets_are_plan_errors(chain_path):
    model = pl.load(chain_path)
    with pytest.raises(pl.PlanError, match="one GPU"):
        pl.plan_offload(model, {0: "1MiB", 1: "1MiB"})
    with pytest.raises(pl.PlanError, match="budget"):
        pl.plan_offload(model, {0: None, "cpu": "1MiB"})


def _layer(k: int, weight: int, gpu_ns: int, host_ns: int) -> Layer:
    return Layer(f"l{k}", k, k + 1, [f"w{k}"], weight, gpu_ns, host_ns, 1000, 1000, {f"w{k}": weight})


def test_simulation_consecutive_streamed_layers_stall():
    """Copies hide behind the compute between prefetch and use: interleaving beats a block."""
    layers = [_layer(k, 10**6, 10**6, 10**8) for k in range(8)]
    link = pl.Link(5e8)  # a layer's copy (2 ms) takes twice a layer's compute (1 ms)
    spread = ["resident", "streamed"] * 4
    block = ["resident"] * 4 + ["streamed"] * 4
    assert simulate(layers, spread, link) < simulate(layers, block, link)
    assert simulate(layers, spread, link) <= simulate(layers, ["resident"] * 8, link) + 10**6


def test_choice_follows_the_link():
    layers = [_layer(k, 10**6, 10**6, 5 * 10**6) for k in range(10)]
    budget = 7 * 10**6
    fast, _, _ = _choose(layers, (budget, None), 0, 0, pl.Link(1e13), pl.Link(1e13))
    slow, _, _ = _choose(layers, (budget, None), 0, 0, pl.Link(1e8), pl.Link(1e8))
    assert "streamed" in fast and "host" not in fast
    assert "host" in slow and "streamed" not in slow


def test_a_deeper_window_hides_more_when_the_budget_allows():
    """Streamed layers 1 in 2, copies as long as two layers' compute: a window one layer deep
    stalls, two deep hides the copies under the resident layers."""
    layers = [_layer(k, 10**6, 10**6, 10**8) for k in range(8)]
    link = pl.Link(5e8)  # a copy (2 ms) = two layers' compute
    spread = ["resident", "streamed"] * 4
    assert simulate(layers, spread, link, depth=2) < simulate(layers, spread, link, depth=1)


def test_tied_weights_are_one_resident_parameter_and_layers_take_module_names(exported):
    """gpt's LM head is tied to the embedding: the layer ``lm_head`` owns ``lm_head.weight``,
    the embedding layer reads it too; it is never streamed and counts once on the GPU."""
    model, _, _ = exported("gpt")
    budget = int(_weights(model) * 0.6)
    plan = _plan(model, budget, FAST, batch=2)
    names = [layer.name for layer in plan.layers]
    assert names[0] == "wte" and "lm_head" in names
    assert not any(name.startswith("_") for name in names)
    head = plan.layers[names.index("lm_head")]
    assert head.params == ["lm_head.weight"] and "lm_head.weight" in head.shared
    assert "lm_head.weight" in plan.layers[0].shared
    assert "lm_head.weight" not in plan.streamed_parameters() and "lm_head.weight" not in model.streamed


def test_the_budget_counts_activations_at_the_planned_batch(chain_path):
    """A dynamic batch: the activations counted grow with ``batch=`` (or the sample inputs)."""
    import onnx_ir as ir

    small = pl.load(chain_path)
    x = small.graph.inputs[0]
    x.shape = ir.Shape(["batch", 64])  # the chain, made dynamic in its batch
    big = small.copy()
    one = _plan(small, "1GiB", FAST, batch=1, apply=False)
    many = _plan(big, "1GiB", FAST, batch=512, apply=False)
    assert one.bindings == {"batch": 1} and many.bindings == {"batch": 512}
    assert many.activation_bytes >= 512 * 64 * 4 > one.activation_bytes > 0
    fed = _plan(pl.load(chain_path), "1GiB", FAST, sample_inputs=np.zeros((4, 64), np.float32), apply=False)
    assert fed.activation_bytes > 0 and fed.workspace_bytes > 0
    with pytest.raises(pl.PlanError, match="batch"):
        _plan(small, "1GiB", FAST, batch=0, apply=False)
