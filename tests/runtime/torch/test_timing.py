"""Tests for ``placement.runtime.torch.timing``: the lowered stages, each run alone."""

from __future__ import annotations

import pytest
import torch

from placement.errors import LoweringError
from placement.graph.device import Device
from placement.planning.profile import make_sample_inputs
from placement.runtime.calibrate import per_part
from placement.runtime.torch.timing import LoweredStages

DEVICES = [Device.parse("cuda:0"), Device.parse("cuda:1")]


def _thirds(model):
    """Ops split in three runs of devices 0, 1, 0: two stages on part 0, one on part 1."""
    ops = [op.name for op in model.ops]
    third = len(ops) // 3
    for name in ops[third : 2 * third]:
        model.set_device(name, 1)
    return model


def test_stages_map_to_their_parts_and_run_alone(exported):
    model, _, _ = exported("mlp")
    stages = LoweredStages(_thirds(model), DEVICES, make_sample_inputs(model), device_map="cpu")
    assert stages.part_of == [0, 1, 0] and len(stages.runs) == 3
    outputs = [run() for run in stages.runs]
    assert all(isinstance(o, (torch.Tensor, tuple)) for o in outputs)
    assert per_part(stages, [1.0, 2.0, 4.0]) == [5.0, 2.0]


def test_a_training_run_returns_the_stage_gradients_and_accumulates_none(exported):
    model, net, (x,) = exported("mlp")
    stages = LoweredStages(model, DEVICES[:1], {model.inputs[0]: x.numpy()}, device_map="cpu", training=True)
    (run,) = stages.runs
    grads = run()
    leaf = x.detach().clone().requires_grad_(True)
    net(leaf).sum().backward()
    torch.testing.assert_close(grads[0], leaf.grad)  # the input comes first, then the parameters
    assert len(grads) == 1 + sum(1 for _ in net.parameters())
    lowered = stages.runs  # the lowered parameters were read by autograd.grad, never given .grad
    assert all(g is not None for g in grads) and lowered


def test_a_missing_sample_input_is_named(exported):
    model, _, _ = exported("mlp")
    with pytest.raises(LoweringError, match="no sample value for graph input"):
        LoweredStages(model, DEVICES[:1], {}, device_map="cpu")
