"""Streamed weights in both runtimes: outputs equal the unplaced model's (CPU emulation), the
torch streamer's window and prefetch, gradients reaching the host weights; on a GPU: pinned
memory, a side copy stream, and the budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import placement as pl
from placement.runtime.lowering.streaming import WeightStreamer
from placement.runtime.ort.steps import TransferStep

ATOL = 1e-5


def _streamed_gpt(exported, *, host_layer: bool = False):
    """gpt tiny on logical cuda:0 with blocks.0 streamed from the host (blocks.1 on the host)."""
    model, net, args = exported("gpt")
    if host_layer:
        for op in model.ops:
            if (op.scope or "").startswith("blocks.1"):
                model.set_device(op.name, "cpu")
    result = pl.stream_parameters(model, ["blocks.0"])
    pl.inject_cross_device_copies(model, output_device=0)
    pl.verify(model)
    return model, net, args, result


@pytest.mark.parametrize("host_layer", [False, True])
def test_torch_lowering_streams_and_matches(exported, host_layer):
    model, net, args, result = _streamed_gpt(exported, host_layer=host_layer)
    module = pl.to_torch(model, device_map={"cuda:0": "cpu", "cpu": "cpu"})
    assert "self.weight_streamer(" in module.code
    streamer = module.weight_streamer
    assert len(streamer.sizes) == len(result.streamed)
    with torch.no_grad():
        expected = net(*args)
        got = module(*args)
        again = module(*args)  # second forward: its first weights were prefetched by the first
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(again, expected, atol=ATOL, rtol=0)
    assert streamer.copies >= 2 * len(streamer.sizes) - 1
    assert streamer.prefetched > 0


def test_gradients_reach_the_host_weights(exported):
    model, net, args, result = _streamed_gpt(exported)
    module = pl.to_torch(model, device_map={"cuda:0": "cpu", "cpu": "cpu"})
    module(*args).square().mean().backward()
    net.zero_grad()
    net(*args).square().mean().backward()
    reference = dict(net.named_parameters())
    path = module.initializer_paths
    checked = 0
    for name in result.streamed:
        if name in reference and name in path:
            grad = module.get_parameter(path[name]).grad
            torch.testing.assert_close(grad, reference[name].grad, atol=1e-5, rtol=1e-4)
            checked += 1
    assert checked > 0


def test_streamer_window_bounds_what_is_copied_ahead():
    weights = [torch.full((4,), float(i)) for i in range(5)]
    streamer = WeightStreamer([("cpu", 16)] * 5, window=32)  # two weights ahead
    streamer.bind(weights)
    assert streamer(weights[0], index=0) is weights[0]
    assert sorted(streamer._pending) == [1, 2] and streamer._in_flight == 32
    streamer(weights[1], index=1)
    assert sorted(streamer._pending) == [2, 3]
    streamer(weights[4], index=4)  # out of order (another micro-batch): copied now, then wraps round
    assert streamer._in_flight <= streamer.window
    assert sorted(streamer._pending) == [2, 3]
    streamer.drop_prefetched()
    assert not streamer._pending and streamer._in_flight == 0
    assert WeightStreamer([("cpu", 8), ("cpu", 24)]).window == 24  # unset: double-buffering


def test_ort_streams_weights_as_stage_inputs(exported):
    model, net, args, result = _streamed_gpt(exported, host_layer=True)
    arrays = [a.numpy() for a in args]
    runner = pl.Runner(model, device_map={"cuda:0": "cpu", "cpu": "cpu"}, fold=False)
    (got,) = runner.run(arrays)
    np.testing.assert_allclose(got, net(*args).detach().numpy(), atol=1e-4)
    program = runner.program
    assert set(program.resident) == set(result.streamed)
    moved = {step.source for step in program.steps if isinstance(step, TransferStep)}
    assert set(result.streamed) <= moved  # each streamed weight is a per-run transfer
    gpu_stage = next(s for s in program.partition.stages if s.device == pl.Device("cuda", 0))
    assert any(
        name.endswith("_cuda_0") and name.split("_cuda_0")[0] in result.streamed for name in gpu_stage.inputs
    )
    # the unplaced graph in one session agrees
    (single,) = pl.run(exported("gpt")[0], arrays, device_map="cpu")
    np.testing.assert_allclose(got, single, atol=1e-5)


@pytest.mark.parametrize("runtime", ["ort", "torch"])
def test_gpu_and_host_stages_pipeline_with_chunks(runtime):
    """A {cuda:0, cpu} placement with chunks: one worker per stage, outputs as unsplit."""
    from placement.models import gpt

    net, args = gpt.build("tiny")
    model = pl.from_torch(net, args, dynamic_shapes=({0: torch.export.Dim("batch")},))
    for op in model.ops:
        if (op.scope or "").startswith("blocks.1"):
            model.set_device(op.name, "cpu")
    pl.stream_parameters(model, ["blocks.0"])
    pl.inject_cross_device_copies(model, output_device=0)
    batch = tuple(torch.cat([a, a.flip(0), a]) for a in args)
    expected = net(*batch).detach()
    dmap = {"cuda:0": "cpu", "cpu": "cpu"}
    if runtime == "ort":
        runner = pl.Runner(model, device_map=dmap, chunks=3)
        devices = [str(s.device) for s in runner.stages]
        assert devices[0] == devices[-1] == "cuda:0" and "cpu" in devices
        (got,) = runner.run([a.numpy() for a in batch])
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-4)
    else:
        module = pl.to_torch(model, device_map=dmap, chunks=3)
        with torch.no_grad():
            got = module(*batch)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_streamed_weights_on_a_gpu(exported):
    """On a GPU: streamed weights pinned on the host, copied on a side stream, outputs as eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    model, net, args, result = _streamed_gpt(exported)
    module = pl.to_torch(model, device_map={"cuda:0": "cuda:0", "cpu": "cpu"})
    path = module.initializer_paths
    for name in result.streamed:
        param = module.get_parameter(path[name])
        assert param.device.type == "cpu" and param.is_pinned()
    streamer = module.weight_streamer
    streamer.timing = True
    with torch.no_grad():
        got = module(*[a.cuda() for a in args])
        got = module(*[a.cuda() for a in args])
    torch.cuda.synchronize()
    expected = net(*args).detach()
    # TF32 off by default for matmuls in torch; fp32 on both sides
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    assert streamer._streams and streamer.copy_seconds() > 0
    assert streamer.prefetched > 0


@pytest.mark.gpu
def test_streamed_plan_stays_within_the_gpu_budget(tmp_path):
    """On a GPU: a chain of 12 x 4 MiB layers under a 30 MiB budget streams, and the peak of
    allocated GPU memory stays within the plan's GPU bytes; outputs equal the host's."""
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    from placement.models.synthetic import write_matmul_chain

    path = tmp_path / "chain.onnx"
    write_matmul_chain(path, layers=12, width=1024, batch=8)
    model = pl.load(path)
    plan = pl.plan_offload(model, {0: 30 * 2**20, "cpu": "4GiB"}, cost="flops", links=pl.Link(20e9))
    assert "streamed" in plan.modes.values()
    pl.inject_cross_device_copies(model, output_device=0)
    module = pl.to_torch(model, device_map={"cuda:0": "cuda:0", "cpu": "cpu"})
    x = torch.randn(8, 1024)
    expected = pl.to_torch(pl.load(path), device_map="cpu")(x).detach()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for _ in range(3):
            got = module(x.cuda())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    assert peak <= plan.gpu_bytes + 2**20, (peak, plan.gpu_bytes)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)  # fp32, TF32 off by default


@pytest.mark.gpu
def test_ort_streams_weights_on_a_gpu(exported):
    """ONNX Runtime's CUDA provider: streamed weights bound as device inputs every run."""
    from placement.runtime.device_map import cuda_device_count

    if cuda_device_count("ort") == 0:
        pytest.skip("needs onnxruntime's CUDAExecutionProvider and a GPU")
    model, net, args, result = _streamed_gpt(exported, host_layer=True)
    runner = pl.Runner(model, device_map={"cuda:0": "cuda:0", "cpu": "cpu"})
    (got,) = runner.run([a.numpy() for a in args])
    (again,) = runner.run([a.numpy() for a in args])
    expected = net(*args).detach().numpy()
    np.testing.assert_allclose(got, expected, atol=1e-3)  # ORT CUDA may use TF32: a looser bound
    np.testing.assert_allclose(again, got, atol=0)
    assert set(runner.program.resident) == set(result.streamed)


def test_pipelined_stages_with_streamed_weights_are_not_traced(exported):
    """A trace would freeze a prefetched weight: stages reading streamed weights stay fx."""
    from placement.runtime.lowering.meta import UNTRACEABLE_META

    model, _, _, _ = _streamed_gpt(exported)
    module = pl.to_torch(model, device_map={"cuda:0": "cpu", "cpu": "cpu"})
    calls = [n for n in module.graph.nodes if n.op == "call_module" and n.target == "weight_streamer"]
    assert calls and all("streamed weight" in n.meta[UNTRACEABLE_META] for n in calls)
