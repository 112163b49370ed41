"""Tests for ``placement.runtime.calibrate``: plans re-balanced on measured stage sessions."""

from __future__ import annotations

import numpy as np
import pytest

import placement as pl
from placement.runtime.calibrate import calibrate


def test_calibration_never_chooses_worse_than_the_first_plan(exported):
    model, net, args = exported("resnet")
    result = calibrate(model, devices=2, rounds=2, repeats=3, profile_repeats=1, device_map="cpu")
    trials = result.trials
    assert 1 <= len(trials) <= 3 and result.plan is trials[result.chosen].plan
    assert all(len(t.measured_s) == 2 and min(t.measured_s) > 0 for t in trials)
    assert result.bottleneck_s == min(t.bottleneck_s for t in trials) <= trials[0].bottleneck_s
    assigned = [t.plan.assignment for t in trials]
    assert all(a != b for i, a in enumerate(assigned) for b in assigned[i + 1 :])  # distinct plans
    # the chosen plan is applied, and the placed model still computes the module
    assert {op.name: str(op.device) for op in model.ops} == result.plan.assignment
    pl.inject_cross_device_copies(model)
    (y,) = pl.run(model, [a.numpy() for a in args], device_map="cpu")
    np.testing.assert_allclose(y, net(*args).detach().numpy(), rtol=1e-3, atol=1e-4)
    assert "trial 0" in str(result)


def test_calibrate_arguments(exported):
    model, _, _ = exported("mlp")
    with pytest.raises(pl.PlanError, match="rounds"):
        calibrate(model, devices=2, rounds=-1)
    result = calibrate(model, devices=2, rounds=0, repeats=1, device_map="cpu")
    assert len(result.trials) == 1 and result.chosen == 0


@pytest.mark.slow
def test_torch_calibration_times_lowered_stages_and_keeps_the_pipeline_exact():
    import torch

    from placement.models import gpt

    net, args = gpt.build("tiny")
    model = pl.from_torch(net, args, dynamic_shapes=({0: torch.export.Dim("batch")},))
    before = torch.get_num_threads()
    options = dict(rounds=2, repeats=3, profile_repeats=1, device_map="cpu", sample_inputs=args)
    result = calibrate(model, devices=2, runtime="torch", **options)
    assert torch.get_num_threads() == before  # threads=1 only while timing
    assert result.plan.runtime == "torch" and result.plan is result.trials[result.chosen].plan
    assert all(len(t.measured_s) == 2 and min(t.measured_s) > 0 for t in result.trials)
    assert result.bottleneck_s <= result.trials[0].bottleneck_s
    assert {op.name: str(op.device) for op in model.ops} == result.plan.assignment
    pl.inject_cross_device_copies(model)
    batch = torch.cat([args[0]] * 2)
    module = pl.to_torch(model, device_map="cpu", chunks=2)
    with torch.no_grad():
        torch.testing.assert_close(module(batch), net(batch), rtol=1e-4, atol=1e-5)


def test_torch_calibration_for_training(exported):
    model, _, _ = exported("mlp")
    options = dict(rounds=1, repeats=3, device_map="cpu")
    result = calibrate(model, devices=2, runtime="torch", training=True, **options)
    assert result.plan.runtime == "torch"
    # every trial timed per part (a part its plan leaves empty takes no time); the chosen one is applied
    assert all(len(t.measured_s) == 2 and max(t.measured_s) > 0 for t in result.trials)
    assert {op.name: str(op.device) for op in model.ops} == result.plan.assignment


def test_calibrate_rejects_unknown_runtimes_and_training_without_torch(exported):
    model, _, _ = exported("mlp")
    with pytest.raises(pl.PlanError, match="'tvm'"):
        calibrate(model, devices=2, runtime="tvm")
    with pytest.raises(pl.PlanError, match="runtime='torch'"):
        calibrate(model, devices=2, training=True)
    assert len(model.devices) == 1  # untouched


def test_ort_stages_are_timed_as_the_runner_runs_them(exported):
    """The timed sessions are the runner's: the cut between two convolutions stays blocked."""
    import onnxruntime as ort

    from placement.graph.device import Device
    from placement.planning.profile import make_sample_inputs
    from placement.runtime.calibrate import _StageTimer

    model, _, _ = exported("resnet")
    model = pl.place_evenly(model, 2)
    devices = [Device.parse("cuda:0"), Device.parse("cuda:1")]
    timer = _StageTimer(model, devices, make_sample_inputs(model), threads=1, device_map="cpu")
    assert timer.part_of == [0, 1] and pl.Runner(model, device_map="cpu", fold=False).blocked_boundaries
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for run in timer.runs:  # both ends of the blocked boundary: ORT's optimised graphs, loaded as they are
        assert run.func.__self__.exec.session.get_session_options().graph_optimization_level == off
    outputs = [run() for run in timer.runs]
    assert outputs[-1][0].numpy().shape == (2, 10)


def test_a_failed_calibration_leaves_the_placement_as_it_was():
    """The torch lowering has no rule for MaxRoiPool: calibrating for torch fails naming it, and every
    op keeps the device it had (auto_place had already placed the model when timing failed)."""
    import onnx
    from onnx import helper

    def info(name, shape):
        return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)

    weight = onnx.numpy_helper.from_array(np.eye(16, dtype=np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "shape"], ["u"], name="reshape"),
        helper.make_node("MaxRoiPool", ["u", "rois"], ["y"], name="roi", pooled_shape=[2, 2]),
    ]
    shape = onnx.numpy_helper.from_array(np.array([1, 4, 4, 4], dtype=np.int64), "shape")
    rois = onnx.numpy_helper.from_array(np.array([[0, 0, 0, 3, 3]], dtype=np.float32), "rois")
    graph = helper.make_graph(
        nodes, "g", [info("x", [4, 16])], [info("y", [1, 4, 2, 2])], [weight, shape, rois]
    )
    model = pl.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    model.set_device("relu", 1)
    before = {op.name: str(op.device) for op in model.ops}
    with pytest.raises(pl.LoweringError, match="MaxRoiPool"):
        calibrate(model, devices=2, rounds=1, repeats=1, profile_repeats=1, device_map="cpu", runtime="torch")
    assert {op.name: str(op.device) for op in model.ops} == before
