"""``auto_place(max_memory={0: ..., "cpu": ...})`` uses the GPU: GPT-2-shaped models under tight GPU budgets.

The GPU is emulated (``device_map="cpu"``) and given a stated speed, ``RATES``: a GPU a hundred
times the host. The 6-layer d=1024 GPT is planned at its stated shapes (batch 8 x 256 tokens);
running it at that size takes tens of seconds here, so the numerical check runs the same
network exported for 1 x 16 tokens, placed with the plan's layer modes (layers, their names and
the parameter names do not depend on the input size).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import placement as pl
from placement.models.gpt import GPT, GPTConfig
from placement.planning.graph_info import GraphInfo
from placement.planning.offload import layers_of
from tests.planning.helpers import SMALL_GPT

RATES = {"cuda": 50e12, "cpu": 0.5e12}  # FLOP/s: the stated defaults, given so that plans are reproducible
BIG = GPTConfig(vocab_size=8192, block_size=256, n_layer=6, n_head=16, d_model=1024)
SMALL = SMALL_GPT


def _export(config: GPTConfig, shape: tuple[int, int]) -> tuple[torch.nn.Module, pl.Model]:
    torch.manual_seed(0)
    net = GPT(config).eval()
    idx = torch.randint(0, config.vocab_size, shape)
    return net, pl.from_torch(net, (idx,))


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """The 6-layer d=1024 GPT (321.7 MiB of weights) exported at batch 8 x 256 tokens, saved once,
    and the same network exported at 1 x 16 tokens for the numerical check."""
    net, model = _export(BIG, (8, 256))
    path = tmp_path_factory.mktemp("gpt6") / "gpt6.onnx"
    model.save(path, external_data=True)
    idx = torch.randint(0, BIG.vocab_size, (1, 16))
    short = path.with_name("gpt6_short.onnx")
    pl.from_torch(net, (idx,)).save(short, external_data=True)
    return path, net, short, idx


@pytest.fixture
def small(small_gpt_export):
    """The 4-layer d=256 GPT (20 MiB of weights) at 1 x 32 tokens: the network and a fresh graph."""
    net, path = small_gpt_export
    return net, pl.load(path)


def _layer_devices(model: pl.Model, plan: pl.Plan) -> dict[str, str]:
    """Layer name -> device of its ops, as placed."""
    info = GraphInfo(model)
    zeros = [0] * len(info)
    devices = {op.name: str(op.device) for op in model.ops}
    return {layer.name: devices[info.names[layer.start]] for layer in layers_of(model, info, zeros, zeros)}


def _same_modes(model: pl.Model, plan: pl.Plan) -> None:
    """Place ``model`` (the same network, another input size) as ``plan`` places its layers."""
    info = GraphInfo(model)
    zeros = [0] * len(info)
    layers = layers_of(model, info, zeros, zeros)
    modes = plan.offload["modes"]
    assert [layer.name for layer in layers] == list(modes)
    assignment = {}
    for layer in layers:
        device = "cpu" if modes[layer.name] == "host" else "cuda:0"
        for pos in range(layer.start, layer.end):
            assignment[info.names[pos]] = device
    pl.Plan(assignment, [], "time", "throughput", 0, 0, 0, 0, streamed=plan.streamed).apply(model)


def _assert_runs_equal(model: pl.Model, net: torch.nn.Module, idx: torch.Tensor) -> None:
    pl.inject_cross_device_copies(model, output_device=0)
    pl.verify(model)
    (got,) = pl.Runner(model, device_map="cpu").run({model.inputs[0]: idx.numpy()})
    with torch.no_grad():
        expected = net(idx).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _host_only_ns(model: pl.Model) -> float:
    return sum(pl.profile(model, time=False).costs("flops")) / RATES["cpu"] * 1e9


@pytest.mark.slow
def test_170mib_runs_a_block_on_the_gpu(big):
    """Slow: exports a 321.7 MiB GPT twice (10-40 s on a loaded 2-core machine)."""
    path, net, short, idx = big
    model, run_model = pl.load(path), pl.load(short)
    plan = pl.auto_place(model, max_memory={0: "170MiB", "cpu": "1GiB"}, cost="flops", throughput=RATES)
    modes = plan.offload["modes"]
    gpu_blocks = [name for name, mode in modes.items() if name.startswith("blocks.") and mode != "host"]
    assert gpu_blocks, modes
    assert plan.fits and plan.devices[0].memory <= 170 * 2**20
    assert plan.cost_kind == "time" and plan.devices[0].cost > 0
    assert {str(d) for d in model.devices} == {"cuda:0", "cpu"}
    # a sensible bottleneck: the simulated forward, between all-on-the-GPU and all-on-the-host
    assert plan.lower_bound <= plan.offload["all_gpu_ns"] < plan.bottleneck < _host_only_ns(model)
    assert plan.bottleneck >= plan.devices[0].cost + plan.devices[1].cost
    assert plan.offload["speed_sources"] == {"cuda": "given", "cpu": "given"}
    text = str(plan)
    assert "offload plan" in text and "x all on the GPU" in text and "resident: " in text
    _same_modes(run_model, plan)
    _assert_runs_equal(run_model, net, idx)


@pytest.mark.slow
def test_80mib_plans_without_error_and_says_why_the_gpu_computes_nothing(big):
    """Slow: shares the 321.7 MiB GPT's exports."""
    path, net, short, idx = big
    model, run_model = pl.load(path), pl.load(short)
    plan = pl.auto_place(model, max_memory={0: "80MiB", "cpu": "1GiB"}, cost="flops", throughput=RATES)
    modes = plan.offload["modes"]
    assert plan.fits and plan.devices[0].memory <= 80 * 2**20
    assert all(mode == "host" for name, mode in modes.items() if name.startswith("blocks."))
    # nothing fits: the plan names the smallest layer, the head (its logits 64 MiB at 8 x 256)
    assert (
        "lm_head, needs 104.0 MiB there (32.0 MiB of weights + 72.0 MiB of activations)"
        in plan.offload["note"]
    ), plan.offload
    assert "over its budget of 80.0 MiB" in str(plan)
    assert plan.bottleneck <= _host_only_ns(model) * 1.001
    _same_modes(run_model, plan)
    _assert_runs_equal(run_model, net, idx)


def test_3mib_holds_no_small_gpt_block_and_the_plan_says_so(small):
    """A d=256 block needs 3.0 MiB of weights + 288 KiB of activations (its weights' transposes,
    computed at load time, are weights, not activations): under 3.3 MiB the host computes
    everything."""
    _, model = small
    plan = pl.auto_place(model, max_memory={0: "3MiB", "cpu": "1GiB"}, cost="flops", throughput=RATES)
    assert plan.fits and plan.devices[0].memory <= 3 * 2**20
    assert all(mode == "host" for name, mode in plan.offload["modes"].items() if name.startswith("blocks."))
    assert "needs 3.3 MiB there (3.0 MiB of weights + 288.0 KiB of activations)" in plan.offload["note"]


def test_3_5mib_holds_a_small_gpt_block(small):
    """3.5 MiB holds a block (with its weights' transposes counted as activations it did not)."""
    _, model = small
    plan = pl.auto_place(model, max_memory={0: "3.5MiB", "cpu": "1GiB"}, cost="flops", throughput=RATES)
    modes = plan.offload["modes"]
    assert plan.fits and plan.devices[0].memory <= 3.5 * 2**20 and "note" not in plan.offload
    assert sum(mode == "resident" for name, mode in modes.items() if name.startswith("blocks.")) == 1, modes


def test_5mib_runs_a_small_gpt_block_on_the_gpu(small):
    net, model = small
    plan = pl.auto_place(model, max_memory={0: "5MiB", "cpu": "1GiB"}, cost="flops", throughput=RATES)
    modes = plan.offload["modes"]
    assert any(mode != "host" for name, mode in modes.items() if name.startswith("blocks.")), modes
    assert plan.fits and plan.devices[0].memory <= 5 * 2**20 and "note" not in plan.offload
    assert plan.bottleneck < _host_only_ns(model)
    on_gpu = _layer_devices(model, plan)
    assert all((on_gpu[name] == "cpu") == (mode == "host") for name, mode in modes.items())
    idx = torch.randint(0, SMALL.vocab_size, (1, 32))
    _assert_runs_equal(model, net, idx)


def test_nothing_fits_names_both_budgets_and_the_smallest_layer(small):
    _, model = small
    weights = sum(p.nbytes for p in model.parameters.values())
    with pytest.raises(pl.InfeasiblePlacementError) as err:
        pl.auto_place(model, max_memory={0: "1MiB", "cpu": weights // 2}, cost="flops", throughput=RATES)
    text = str(err.value)
    assert "GPU 1.0 MiB" in text and "every layer on the host needs" in text
    assert "the smallest layer to keep on the GPU" in text
    assert not any(str(op.device) == "cpu" for op in model.ops)  # the model is unchanged


def test_speeds_decide_gpu_or_host(small):
    """A 'GPU' as slow as the host gains nothing from copies: everything stays on the host."""
    _, model = small
    plan = pl.auto_place(
        model, max_memory={0: "5MiB", "cpu": "1GiB"}, cost="flops", throughput={"cuda": 1e9, "cpu": 1e9}
    )
    assert set(plan.offload["modes"].values()) == {"host"}
    assert "copying activations to it costs more than it saves" in plan.offload["note"]


def test_plan_round_trips_with_its_offload_summary(small, tmp_path):
    _, model = small
    plan = pl.auto_place(model, max_memory={0: "5MiB", "cpu": "1GiB"}, cost="flops", throughput=RATES)
    plan.save(tmp_path / "plan.json")
    again = pl.Plan.load(tmp_path / "plan.json")
    assert again == plan and again.offload["modes"] == plan.offload["modes"]
    assert plan.fingerprint == pl.profile(model, time=False).fingerprint


@pytest.mark.slow
def test_cli_places_on_the_gpu_and_prints_the_modes(big, tmp_path, capsys):
    """Slow: plans the 321.7 MiB GPT and saves it placed (about 20 s here)."""
    from placement.cli import main

    path, *_ = big
    target = tmp_path / "placed.onnx"
    argv = ["place", str(path), "--auto", "--max-memory", "0=170MiB,cpu=1GiB", "-o", str(target)]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "offload plan: one forward" in out and "cpu" in out and "(measured)" in out  # the host's speed
    assert "resident: " in out and "blocks." in out.split("resident: ")[1].split("|")[0]
    placed = pl.load(target)
    pl.verify(placed)
    assert {str(d) for d in placed.devices} == {"cuda:0", "cpu"}
