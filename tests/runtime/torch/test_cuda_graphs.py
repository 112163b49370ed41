"""``to_torch(model, cuda_graphs=True)``: segments by physical device, graphs equal to eager on a GPU."""

from __future__ import annotations

import functools

import pytest
import torch

import placement as pl
from placement.runtime.torch.cuda_graphs import segments


@functools.cache
def _placed(name: str, dynamic_batch: bool = False):
    from placement import models

    net, args = models.build(name, "tiny")
    shapes = tuple({0: torch.export.Dim("batch")} for _ in args) if dynamic_batch else None
    model = pl.from_torch(net, args, dynamic_shapes=shapes)
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    return model, net, args


def test_without_a_gpu_it_is_a_named_error():
    model, net, args = _placed("mlp")
    with pytest.raises(pl.CUDAGraphError):
        pl.to_torch(model, device_map="cpu", cuda_graphs=True)
    # chunks > 1: per-stage graphs, skipped with a warning on the CPU (test_stage_graphs.py)


def test_segments_follow_the_physical_devices():
    model, net, args = _placed("gpt")
    one = pl.to_torch(model, device_map="cpu")
    assert set(segments(one).values()) == {0}  # both logical devices on the CPU: one segment
    two = pl.to_torch(model, device_map="cpu")
    two.device_map = {"cuda:0": "cuda:0", "cuda:1": "cpu"}  # as a GPU + CPU split would be mapped
    parts = segments(two)
    assert sorted(set(parts.values())) == [0, 1]
    order = [parts[n] for n in two.graph.nodes if n in parts]
    assert order == sorted(order)  # runs, in graph order


def test_the_split_module_computes_the_forward():
    from placement.runtime.torch.cuda_graphs import CUDAGraphModule

    model, net, args = _placed("gpt")
    module = pl.to_torch(model, device_map="cpu")
    module.device_map = {"cuda:0": "cuda:0", "cuda:1": "cpu"}  # the first segment is wrapped for graphs
    wrapped = CUDAGraphModule(module)
    assert len(wrapped.graphed) == 1
    # gradients enabled and parameters that need them: every segment runs eagerly (no CUDA used)
    torch.testing.assert_close(wrapped(*args), net(*args), rtol=1e-4, atol=1e-4)
    assert wrapped.replays == 0 and wrapped.captures == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gpt", "resnet", "mlp"])
def test_graphs_equal_eager_on_a_gpu(name):
    model, net, args = _placed(name)
    eager = pl.to_torch(model, device_map={0: "cuda:0", 1: "cuda:0"})
    graphed = pl.to_torch(model, device_map={0: "cuda:0", 1: "cuda:0"}, cuda_graphs=True)
    inputs = [a.cuda() for a in args]
    with torch.no_grad():
        want = eager(*inputs)
        first = graphed(*inputs)
        second = graphed(*inputs)
    assert graphed.captures == 1 and graphed.replays == 2
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)  # same kernels, replayed
    torch.testing.assert_close(second, want, rtol=1e-5, atol=1e-5)
    assert first.data_ptr() != second.data_ptr()  # outputs own their memory


@pytest.mark.gpu
def test_a_new_shape_is_captured_again_and_training_runs_eagerly():
    model, net, args = _placed("mlp", dynamic_batch=True)  # a batch of 1 after one of 4
    graphed = pl.to_torch(model, device_map="cuda:0", cuda_graphs=True)
    eager = pl.to_torch(model, device_map="cuda:0")
    x = args[0].cuda()
    with torch.no_grad():
        graphed(x)
        got = graphed(x[:1])
        torch.testing.assert_close(got, eager(x[:1]), rtol=1e-5, atol=1e-5)
    assert graphed.captures == 2
    y = graphed(x)  # gradients enabled: eager, differentiable
    y.sum().backward()
    assert all(p.grad is not None for p in graphed.parameters())
