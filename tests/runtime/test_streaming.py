"""Streamed weights in both runtimes: outputs equal the unplaced model's (CPU emulation), the
torch streamer's window and prefetch, gradients reaching the host weights; on a GPU: pinned
memory, a side copy stream, and the budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import placement as pl
from placement.runtime.ort.steps import TransferStep
from placement.runtime.torch.copy_emulation import EmulatedCopyEngine, HazardError
from placement.runtime.torch.streaming import ALIGN, WeightStreamer

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
    """Direct copies (the CPU default) and emulated late, out-of-order, poisoned ones give eager's
    outputs, bit for bit the same between the two."""
    model, net, args, result = _streamed_gpt(exported, host_layer=host_layer)
    module = pl.to_torch(model, device_map={"cuda:0": "cpu", "cpu": "cpu"})
    assert "self.weight_streamer(" in module.code
    assert module.code.count("self.weight_release(") == module.code.count("self.weight_streamer(")
    streamer = module.weight_streamer
    assert len(streamer.sizes) == len(result.streamed)
    with torch.no_grad():
        expected = net(*args)
        direct = module(*args)
        engine = streamer.use(EmulatedCopyEngine(latency=0.002, seed=1))
        try:
            got = module(*args)
            again = module(*args)  # second forward: its first weights were prefetched by the first
        finally:
            engine.close()
    torch.testing.assert_close(direct, expected, atol=ATOL, rtol=0)
    assert torch.equal(got, direct) and torch.equal(again, direct)
    assert streamer.prefetched > 0 and streamer.overflow == 0
    assert engine.completed >= 2 * len(streamer.sizes) - 1


def _emulated_run(exported, *, hazard=None, window=None):
    """gpt tiny with blocks.0 streamed, run twice under a holding emulated engine; (outputs, eager)."""
    model, net, args, _ = _streamed_gpt(exported)
    module = pl.to_torch(model, device_map={"cuda:0": "cpu", "cpu": "cpu"})
    streamer = module.weight_streamer
    if window is not None:
        streamer._window = window
    engine = streamer.use(EmulatedCopyEngine(hold=True))
    streamer._unsafe = hazard
    try:
        with torch.no_grad():
            outs = [module(*args) for _ in range(2)]
    finally:
        engine.close()
    return outs, net(*args).detach(), streamer


def test_emulated_copies_held_to_the_last_moment_give_eager_outputs(exported):
    """Copies that complete only when waited for, into a window of twice the largest weight: still exact."""
    outs, expected, streamer = _emulated_run(exported)
    for out in outs:
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    assert streamer.overflow == 0 and streamer.prefetched > 0


@pytest.mark.parametrize("hazard", ["skip_wait", "skip_release"])
def test_a_missing_wait_is_a_detected_hazard(exported, hazard):
    """The proof that the emulation sees the hazards: drop the read's wait for its copy, or the
    refill's wait for the last reader's release, and the run stops with the hazard named (the
    other orders: tests/runtime/test_streaming_hazards.py)."""
    with pytest.raises(HazardError, match="copy"):
        _emulated_run(exported, hazard=hazard)


def test_the_window_holds_what_is_in_use_and_copied_ahead():
    """A window of two weights: handing out one copies the next; the one after waits for a release."""
    weights = [torch.full((4,), float(i)) for i in range(5)]
    streamer = WeightStreamer([("cpu", 16)] * 5, window=2 * ALIGN)
    streamer.bind(weights)
    engine = streamer.use(EmulatedCopyEngine(hold=True))
    streamer.trace = []
    try:
        torch.set_grad_enabled(False)  # with autograd on and no readers known, weights are fresh copies
        assert streamer(weights[0], index=0).tolist() == weights[0].tolist()
        assert streamer.trace == [("copy", 0), ("use", 0), ("copy", 1)]  # 2 waits for 0's release
        streamer.release(0)
        assert streamer.trace[-2:] == [("release", 0), ("copy", 2)]
        assert streamer(weights[1], index=1).tolist() == weights[1].tolist()
        streamer(weights[4], index=4)  # out of order (another micro-batch): outside the window
        assert streamer.overflow == 1
        streamer.drop_prefetched()
        assert all(slot.state != "pending" for slot in streamer._slots.values())
    finally:
        torch.set_grad_enabled(True)
        engine.close()
    assert WeightStreamer([("cpu", 8), ("cpu", 24)]).window == 2 * ALIGN  # unset: double-buffering


def test_emulated_engine_completes_out_of_order_and_poisons_until_done():
    engine = EmulatedCopyEngine(latency=0.01, seed=3)
    cpu = torch.device("cpu")
    try:
        buffer = engine.alloc(cpu, 64 * 4 * 8).view(torch.float32).view(64, 8)
        events = [engine.copy(torch.full((8,), float(i)), buffer[i]) for i in range(64)]
        for event in events:
            engine.wait(event, cpu)
        assert buffer[:, 0].tolist() == [float(i) for i in range(64)]
        assert engine.out_of_order > 0
    finally:
        engine.close()
    held = EmulatedCopyEngine(hold=True)  # completes only when waited for
    try:
        dst = held.alloc(cpu, 32).view(torch.float32)
        event = held.copy(torch.ones(8), dst)
        assert bool(dst.isnan().all()) and not event.query()  # poisoned from the moment it may start
        held.wait(event, cpu)
        assert dst.tolist() == [1.0] * 8
    finally:
        held.close()


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
    assert streamer._cuda is not None and streamer._cuda.streams and streamer.copy_seconds() > 0
    assert streamer.prefetched > 0


@pytest.mark.gpu
def test_streamed_plan_stays_within_the_gpu_budget(tmp_path):
    """On a GPU: a chain of 12 x 4 MiB layers under a budget of 30 MiB plus the workspace measured
    here, planned for batch 8 with a host slow enough that streaming pays (stated: 10 GFLOP/s),
    streams; the peak of allocated GPU memory stays within the plan's GPU bytes, and the peak of
    reserved memory (the allocator's segments) within the budget; outputs equal the host's."""
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    from placement.models.synthetic import write_matmul_chain
    from placement.runtime.torch.streaming import free_workspaces, measure_workspace

    path = tmp_path / "chain.onnx"
    write_matmul_chain(path, layers=12, width=1024, batch=8)
    model = pl.load(path)
    workspace = measure_workspace("cuda:0")  # cuBLAS's, 8 to 32 MiB by GPU and version
    budget = 30 * 2**20 + workspace
    plan = pl.plan_offload(
        model,
        {0: budget, "cpu": "4GiB"},
        cost="flops",
        links=pl.Link(20e9),
        throughput={"cuda": 100e12, "cpu": 1e10},
        batch=8,
        workspace=workspace,
    )
    assert "streamed" in plan.modes.values() and plan.gpu_bytes <= budget, plan
    pl.inject_cross_device_copies(model, output_device=0)
    module = pl.to_torch(model, device_map={"cuda:0": "cuda:0", "cpu": "cpu"})
    x = torch.randn(8, 1024)
    expected = pl.to_torch(pl.load(path), device_map="cpu")(x).detach()
    x = x.cuda()
    free_workspaces()  # made again inside the measured runs, as on a fresh process
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # reserved memory: what the process really holds, rounding included
    base = torch.cuda.memory_allocated()  # what other tests left (and the module's resident weights)
    base_reserved = torch.cuda.memory_reserved()
    resident = sum(p.numel() * p.element_size() for p in module.parameters() if p.is_cuda)
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for _ in range(3):
            got = module(x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base + resident + x.numel() * 4
    assert peak <= plan.gpu_bytes, (peak, plan.gpu_bytes)
    reserved = torch.cuda.max_memory_reserved() - base_reserved + resident + x.numel() * 4
    assert reserved <= budget, (reserved, budget)
    assert module.weight_streamer.overflow == 0
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
    from placement.lowering.meta import UNTRACEABLE_META

    model, _, _, _ = _streamed_gpt(exported)
    module = pl.to_torch(model, device_map={"cuda:0": "cpu", "cpu": "cpu"})
    calls = [n for n in module.graph.nodes if n.op == "call_module" and n.target == "weight_streamer"]
    assert calls and all("streamed weight" in n.meta[UNTRACEABLE_META] for n in calls)


def test_host_layers_compute_in_fp32():
    """An fp16 model with a block on the host: its ops widen to fp32 and narrow back, the GPU
    side stays fp16; the outputs are as close to the fp32 model's as fp16 allows."""
    from placement.models import gpt

    net, args = gpt.build("tiny")
    reference = net(*args).detach()
    half = net.half()
    model = pl.from_torch(half, args)
    for op in model.ops:
        if (op.scope or "").startswith("blocks.1"):
            model.set_device(op.name, "cpu")
    pl.inject_cross_device_copies(model, output_device=0)
    module = pl.to_torch(model, device_map={"cuda:0": "cpu", "cpu": "cpu"})
    code = module.code
    assert "_f32 = " in code and ".float()" in code and "_narrow = " in code
    widened = {n.meta.get("placement_device") for n in module.graph.nodes if n.name.endswith("_f32")}
    assert widened == {"cpu"}  # only host ops widen
    with torch.no_grad():
        got = module(*args)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), reference, atol=2e-2, rtol=2e-2)  # fp16 storage between ops


def test_planned_streams_have_compute_ahead_of_them(tmp_path):
    """A planned chain run under the emulated engine: every streamed weight's copy is issued at
    least one resident layer before its use (the prefetch runs under compute), one streamed
    layer ahead when the window is two deep, and the outputs equal the unplaced chain's."""
    from placement.models.synthetic import write_matmul_chain

    path = tmp_path / "chain.onnx"
    weights = write_matmul_chain(path, layers=12, width=64, batch=4)
    model = pl.load(path)
    # a layer computes in 0.33 ms on the GPU, 33 ms on the host; its copy takes 0.66 ms
    opts = dict(cost="flops", throughput={"cuda": 1e8, "cpu": 1e6}, links=pl.Link(2.5e7))
    plan = pl.plan_offload(model, {0: int(weights * 0.8), "cpu": "1GiB"}, **opts)
    modes = [plan.modes[layer.name] for layer in plan.layers]
    assert "streamed" in modes and plan.depth >= 2, (modes, plan.depth)
    layer_of = {w: k for k, layer in enumerate(plan.layers) for w in layer.weights}
    where = [layer_of[name] for name in plan.streamed_parameters()]
    pl.inject_cross_device_copies(model, output_device=0)
    module = pl.to_torch(model, device_map={"cuda:0": "cpu", "cpu": "cpu"})
    streamer = module.weight_streamer
    assert len(streamer.sizes) == len(where)
    engine = streamer.use(EmulatedCopyEngine(latency=0.001, seed=2))
    x = torch.randn(4, 64)
    try:
        with torch.no_grad():
            first = module(x)
            streamer.trace = []
            second = module(x)
    finally:
        engine.close()
    expected = pl.to_torch(pl.load(path), device_map="cpu")(x).detach()
    assert torch.equal(first, second)
    torch.testing.assert_close(second, expected, atol=1e-5, rtol=0)
    trace = streamer.trace
    n = len(plan.layers)
    for k, layer in enumerate(where):
        use = trace.index(("use", k))
        copies = [i for i, event in enumerate(trace[:use]) if event == ("copy", k)]
        if not copies:  # copied ahead at the end of the first forward
            assert k <= plan.depth  # the window: depth layers and the ring's wrap room
            continue
        trigger = next(event[1] for event in reversed(trace[: copies[-1]]) if event[0] in ("use", "release"))
        start = where[trigger]
        between = [(start + step) % n for step in range(1, (layer - start) % n)]
        assert any(modes[b] == "resident" for b in between), (k, start, layer, modes)
        if k >= 1:
            assert copies[-1] < trace.index(("use", k - 1))  # one streamed layer ahead
