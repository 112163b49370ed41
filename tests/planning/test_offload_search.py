"""The offload mode search: GPU activations of the GPU's ops, local search under both budgets, the error."""

from __future__ import annotations

import pytest

import placement as pl
from placement.planning.graph_info import GraphInfo
from placement.planning.offload import Layer, layers_of, simulate
from placement.planning.offload_search import gpu_activations, infeasible_message, search_modes

FAST = pl.Link(1e12)


def _layer(k: int, weight: int, gpu_ns: int, host_ns: int, act: int = 1000) -> Layer:
    return Layer(f"l{k}", k, k + 1, [f"w{k}"], weight, gpu_ns, host_ns, act, act, {f"w{k}": weight})


def _memory(layers, acts):
    def memory(modes):
        gpu = sum(layer.param_bytes for layer, m in zip(layers, modes) if m == "resident")
        streamed = [layer.param_bytes for layer, m in zip(layers, modes) if m == "streamed"]
        window = max(streamed, default=0)
        gpu += window * min(2, len(streamed))
        gpu += max((a for a, m in zip(acts, modes) if m != "host"), default=0)
        return gpu, sum(layer.param_bytes for layer, m in zip(layers, modes) if m != "resident"), window

    return memory


def test_the_search_keeps_the_layer_that_fits_on_the_gpu():
    """A large layer with large activations cannot stay; the small one with more compute can,
    wherever the spread guess would have put it."""
    layers = [_layer(0, 100, 10, 10_000), _layer(1, 10, 10, 50_000), _layer(2, 100, 10, 10_000)]
    acts = [500, 20, 500]
    memory = _memory(layers, acts)
    modes, t = search_modes(layers, (100, None), memory, lambda m: simulate(layers, m, FAST))
    assert modes == ["host", "resident", "host"]
    assert t == simulate(layers, modes, FAST) < simulate(layers, ["host"] * 3, FAST)


def test_the_search_never_returns_a_plan_over_budget():
    layers = [_layer(k, 100 + k, 10, 1000 * (k + 1)) for k in range(6)]
    memory = _memory(layers, [50] * 6)
    for budget in (0, 120, 250, 400, 700):
        modes, _ = search_modes(layers, (budget, None), memory, lambda m: simulate(layers, m, FAST))
        assert memory(modes)[0] <= budget or all(m == "host" for m in modes)


def test_nothing_fits_names_the_budgets_and_the_smallest_layer():
    layers = [_layer(0, 100, 10, 1000), _layer(1, 40, 10, 1000)]
    memory = _memory(layers, [0, 0])
    with pytest.raises(pl.InfeasiblePlacementError) as err:
        search_modes(layers, (10, 50), memory, lambda m: simulate(layers, m, FAST))
    assert str(err.value) == infeasible_message(layers, (10, 50), memory)
    assert "GPU 10 B, host 50 B" in str(err.value) and "l1, needs 40 B" in str(err.value)


def test_gpu_activations_count_only_the_gpus_ops(exported):
    model, _, _ = exported("gpt")
    info = GraphInfo(model)
    zeros = [0] * len(info)
    layers = layers_of(model, info, zeros, zeros)
    peak = gpu_activations(info, layers)
    everything = ["resident"] * len(layers)
    assert peak(["host"] * len(layers)) == 0
    assert peak(everything) == info.segment_peak_activation(0, len(info))
    names = [layer.name for layer in layers]
    one_block = ["resident" if name == "blocks.0" else "host" for name in names]
    assert 0 < peak(one_block) <= peak(everything)
    head_on_host = ["host" if name == "lm_head" else "resident" for name in names]
    assert peak(head_on_host) <= peak(everything)


def test_a_streamed_weights_transpose_counts_as_an_activation_of_its_layer(exported):
    """Resident: the exporter's transpose of a weight is folded at load time (not an activation).
    Streamed: the weight arrives every step, so its transpose is made every step on the GPU."""
    model, _, _ = exported("gpt")
    info = GraphInfo(model)
    zeros = [0] * len(info)
    layers = layers_of(model, info, zeros, zeros)
    peak = gpu_activations(info, layers)
    names = [layer.name for layer in layers]
    block = layers[names.index("blocks.0")]
    transposed = [
        b
        for pos in range(block.start, block.end)
        if info.nodes[pos].op_type == "Transpose" and info.op_fixed[pos]
        for b in info.op_outputs[pos]
    ]
    assert transposed and all(info.step_bytes[b] == 0 for b in transposed)
    resident = ["resident" if name == "blocks.0" else "host" for name in names]
    streamed = ["streamed" if name == "blocks.0" else "host" for name in names]
    assert peak(streamed) > peak(resident)
    assert peak(streamed) - peak(resident) <= sum(info.blob_bytes[b] for b in transposed)
    assert peak(streamed) >= max(info.blob_bytes[b] for b in transposed)
