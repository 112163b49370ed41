"""ONNX Runtime with streamed weights: the GPU's sessions are cut so that the streamed weights
on the device at any step of a run stay within the plan's window."""

from __future__ import annotations

import numpy as np
import pytest

import placement as pl
from placement.runtime.ort.steps import StageStep, TransferStep


def _streamed_on_device(runner) -> tuple[int, int]:
    """(the most streamed bytes on the device at once over a run's steps, the most one stage is fed)."""
    program = runner.program
    streamed = program.partition.streamed
    sizes: dict[str, int] = {}
    alive: dict[str, int] = {}
    most = fed = 0
    for step in program.steps:
        if isinstance(step, TransferStep) and step.source in streamed:
            value = program.resident[step.source]
            sizes[step.target] = int(np.prod(value.shape())) * 4
            alive[step.target] = sizes[step.target]
        if isinstance(step, StageStep):
            fed = max(fed, sum(sizes.get(key, 0) for _, key in step.bind))
        most = max(most, sum(alive.values()))
        for key in step.free:
            alive.pop(key, None)
    return most, fed


@pytest.mark.parametrize("fold", [None, False])
def test_a_gpu_stage_is_fed_at_most_the_window(tmp_path, fold):
    from placement.models.synthetic import write_matmul_chain

    path = tmp_path / "chain.onnx"
    weights = write_matmul_chain(path, layers=12, width=128, batch=4)
    model = pl.load(path)
    budget = int(weights * 0.6)
    opts = dict(cost="flops", throughput={"cuda": 1e9, "cpu": 1e7}, links=pl.Link(1e9), workspace=0)
    plan = pl.plan_offload(model, {0: budget, "cpu": "1GiB"}, **opts)
    assert "streamed" in plan.modes.values()
    streamed_bytes = sum(layer.param_bytes for layer in plan.layers if plan.modes[layer.name] == "streamed")
    assert streamed_bytes > plan.window  # the case: more streamed than the window holds
    pl.inject_cross_device_copies(model, output_device=0)
    runner = pl.Runner(model, device_map="auto", fold=fold)  # a GPU, or one emulated on the CPU
    most, fed = _streamed_on_device(runner)
    assert 0 < fed <= most <= plan.window, (fed, most, plan.window)
    resident = plan.gpu_bytes - plan.window - plan.activation_bytes
    assert resident + most + plan.activation_bytes <= budget
    x = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
    (got,) = runner.run([x])
    (single,) = pl.run(pl.load(path), [x], device_map="cpu")
    np.testing.assert_allclose(got, single, atol=1e-4, rtol=1e-4)  # fp32 (the Runner's default)


def test_streamed_weights_on_the_host_itself_are_not_cut(tmp_path):
    """Everything on the CPU (the streamed copies are aliases there): one session, as folded."""
    from placement.models.synthetic import write_matmul_chain

    path = tmp_path / "chain.onnx"
    write_matmul_chain(path, layers=6, width=64, batch=2)
    model = pl.load(path)
    pl.stream_parameters(model, [f"w{k}" for k in range(1, 6, 2)], window="20KiB")
    pl.inject_cross_device_copies(model, output_device=0)
    runner = pl.Runner(model, device_map={"cuda:0": "cpu", "cpu": "cpu"})
    assert len(runner.stages) == 1
