"""The streamed-weight engine against the hazards a GPU has and a CPU run hides: the emulator's
device order catches every missing wait, release and ``record_stream`` (mutation tests), and the
defects that showed on the CPU stay fixed (stale prefetch, frozen weights in a backward,
copy/pickle, CUDA graphs, the pinned arena)."""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch

import placement as pl
from placement.models import gpt
from placement.runtime.torch import streaming
from placement.runtime.torch.copy_emulation import EmulatedCopyEngine
from placement.runtime.torch.device_timeline import DeviceTimeline, HazardError
from placement.runtime.torch.streaming import ALIGN, WeightStreamer

ATOL = 1e-5
DMAP = {"cuda:0": "cpu", "cpu": "cpu"}


def _lowered(blocks=("blocks.0",), net=None, device_map=DMAP, exported=None):
    """gpt tiny on logical cuda:0 with ``blocks`` streamed from the host, lowered; (module, net, args).
    ``exported``: the tests' cached export (when ``net`` is not given)."""
    if net is None and exported is not None:
        model, net, args = exported("gpt")
    else:
        if net is None:
            net, args = gpt.build("tiny")
        else:
            args = gpt.build("tiny")[1]
        model = pl.from_torch(net, args)
    pl.stream_parameters(model, list(blocks))
    pl.inject_cross_device_copies(model, output_device=0)
    return pl.to_torch(model, device_map=device_map), net, args


@pytest.fixture
def lowered(exported):
    return _lowered(exported=exported)


# -- the emulator sees device-side order ------------------------------------------------------


def test_the_timeline_orders_by_events_not_by_host_time():
    timeline = DeviceTimeline()
    window = torch.zeros(64, dtype=torch.uint8)
    timeline.write(window[:32], "copy")
    timeline.wait(timeline.record("copy"), "compute")
    timeline.read(window[:32], "compute")
    timeline.write(window[32:], "copy")  # other bytes: no order needed
    with pytest.raises(HazardError, match="still reads"):
        timeline.write(window[:32], "copy")  # a refill the reader's release does not order
    timeline.wait(timeline.record("compute"), "copy")
    timeline.write(window[:32], "copy")  # behind the release: fine
    with pytest.raises(HazardError, match="before its copy's event"):
        timeline.read(window[:16], "compute")


def test_correct_schedules_raise_nothing_and_are_checked(lowered):
    module, net, args = lowered
    streamer = module.weight_streamer
    engine = streamer.use(EmulatedCopyEngine(hold=True))
    try:
        with torch.no_grad():
            outs = [module(*args) for _ in range(3)]
        module(*args).square().mean().backward()  # fresh copies, kept on the compute stream
        del outs
        gc.collect()
        streamer.use(EmulatedCopyEngine(hold=True)).close()  # the old window is freed here
    finally:
        engine.close()  # raises any hazard found
    assert engine.timeline.checked > 4 * len(streamer.sizes)


def _run_with(module, args, hazard):
    """Run ``module`` under the emulator with ``hazard`` (see HAZARDS); raises what it finds."""
    streamer = module.weight_streamer
    engine = streamer.use(EmulatedCopyEngine(hold=True))
    streamer._unsafe = hazard
    try:
        with torch.no_grad():
            module(*args)
            module(*args)
        if hazard == "skip_keep":  # fresh copies: a training forward, freed after the backward
            module(*args).square().mean().backward()
            gc.collect()
        if hazard == "skip_window_keep":  # the end-of-forward prefetch is in flight; drop the window
            streamer.use(EmulatedCopyEngine(hold=True)).close()
            gc.collect()
    finally:
        streamer._unsafe = None
        engine.close()


@pytest.mark.parametrize(
    "hazard, message",
    [
        ("skip_wait", "read before its copy's event"),
        ("skip_release", "a copy into a region a queued kernel still reads"),
        ("skip_keep", "freed while another stream still uses it"),
        ("skip_window_keep", "freed while another stream still uses it"),
    ],
)
def test_each_missing_order_is_a_detected_hazard(lowered, hazard, message):
    """Mutation tests: remove the read's wait for its copy, the refill's wait for the release,
    the fresh copy's record_stream on the compute stream, or the window's on the copy stream,
    and the emulated run fails naming the hazard; with nothing removed it passes."""
    assert set(streaming.HAZARDS) == {"skip_wait", "skip_release", "skip_keep", "skip_window_keep"}
    module, _, args = lowered
    with pytest.raises(HazardError, match=message):
        _run_with(module, args, hazard)
    _run_with(module, args, None)


# -- 1. stale prefetch ---------------------------------------------------------------------


def test_a_weight_changed_in_place_after_its_prefetch_is_copied_again(lowered):
    module, _, args = lowered
    streamer = module.weight_streamer
    engine = streamer.use(EmulatedCopyEngine(latency=0.002, seed=4))
    try:
        with torch.no_grad():
            module(*args)  # leaves the first streamed weights copied ahead
            for param in streamer._sources:
                param.mul_(0.5)  # in place: an optimizer step, load_state_dict's copy_
            got = module(*args)
            again = module(*args)
    finally:
        engine.close()
    torch.testing.assert_close(got, again, atol=0, rtol=0)
    assert streamer.stale > 0
    with torch.no_grad():
        direct = copy.deepcopy(module)(*args)  # a copy runs the direct engine: no prefetch at all
    torch.testing.assert_close(got, direct, atol=ATOL, rtol=0)


# -- 2. frozen streamed weights and a backward -------------------------------------------------


def test_frozen_streamed_weights_train_what_is_not_frozen():
    """LoRA style: the streamed blocks are frozen, their inputs still need gradients; the
    backward works and the trainable weights' gradients equal eager's."""
    net, args = gpt.build("tiny")
    for name, param in net.named_parameters():
        if name.startswith(("blocks.0", "blocks.1")):
            param.requires_grad_(False)
    module, _, _ = _lowered(("blocks.0", "blocks.1"), net=copy.deepcopy(net))
    for param in module.parameters():
        param.requires_grad_(not any(param is src for src in module.weight_streamer._sources))
    streamer = module.weight_streamer
    engine = streamer.use(EmulatedCopyEngine(latency=0.001, seed=5))
    try:
        for _ in range(2):
            module.zero_grad()
            module(*args).square().mean().backward()
    finally:
        engine.close()
    net(*args).square().mean().backward()
    reference = dict(net.named_parameters())
    checked = 0
    params = dict(module.named_parameters())
    for name, path in module.initializer_paths.items():
        param = params.get(path)
        if name in reference and param is not None and param.requires_grad:
            torch.testing.assert_close(param.grad, reference[name].grad, atol=1e-5, rtol=1e-4)
            checked += 1
    assert checked > 2 and streamer.prefetched > 0


# -- 3. deepcopy and pickle ------------------------------------------------------------------


def test_a_module_with_streamed_weights_deep_copies_and_pickles(lowered):
    module, net, args = lowered
    streamer = module.weight_streamer
    engine = streamer.use(EmulatedCopyEngine(latency=0.001))
    try:
        with torch.no_grad():
            expected = module(*args)
            twin = copy.deepcopy(module)
            buffer = io.BytesIO()
            torch.save(module, buffer)
            loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
            again = module(*args)
    finally:
        engine.close()
    torch.testing.assert_close(again, expected, atol=0, rtol=0)
    for other in (twin, loaded):
        copied = other.weight_streamer
        assert copied is not streamer and copied.engine is None and not copied._slots
        own = {id(p) for p in other.parameters()}
        assert all(id(src) in own for src in copied._sources)  # the copy's own parameters
        other_engine = copied.use(EmulatedCopyEngine(latency=0.001))
        try:
            with torch.no_grad():
                got = [other(*args) for _ in range(2)]
        finally:
            other_engine.close()
        for out in got:
            torch.testing.assert_close(out, expected, atol=0, rtol=0)


# -- 7. CUDA graphs --------------------------------------------------------------------------


def test_cuda_graphs_with_streamed_weights_is_a_named_error(exported):
    model, _, _ = exported("gpt")
    pl.stream_parameters(model, ["blocks.0"])
    pl.inject_cross_device_copies(model, output_device=0)
    before = model.copy()
    with pytest.raises(pl.CUDAGraphError, match="streamed weights .*blocks"):
        pl.to_torch(model, device_map=DMAP, cuda_graphs=True)
    assert model.streamed == before.streamed


# -- 8. one pinned arena ---------------------------------------------------------------------


def test_streamed_weights_share_one_host_arena():
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 200, 1)]
    values = [p.detach().clone() for p in params]
    arena = streaming.pin_arena(params, pin=False)  # pinning needs CUDA; the layout is the same
    assert arena.numel() == sum(-(-p.numel() * 4 // ALIGN) * ALIGN for p in params)
    for param, value in zip(params, values):
        assert param.untyped_storage().data_ptr() == arena.data_ptr()
        assert param.data_ptr() % ALIGN == arena.data_ptr() % ALIGN
        assert torch.equal(param.detach(), value)


def test_the_streamer_keeps_no_lock_in_its_pickle():
    streamer = WeightStreamer([("cpu", 16)], window=1024)
    state = streamer.__getstate__()
    assert "_lock" not in state and "engine" not in state


# -- on a GPU --------------------------------------------------------------------------------


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")


@pytest.mark.gpu
def test_weights_unpinned_after_lowering_are_pinned_again(caplog):
    """On a GPU: the streamed weights share one pinned arena; replaced by unpinned tensors (as
    ``.half()`` or ``.to()`` do), they are pinned again at the next forward, with a warning."""
    _needs_cuda()
    module, _, args = _lowered(device_map={"cuda:0": "cuda:0", "cpu": "cpu"})
    sources = module.weight_streamer._sources
    assert all(p.is_pinned() for p in sources)
    assert len({p.untyped_storage().data_ptr() for p in sources}) == 1  # one arena
    cuda_args = [a.cuda() for a in args]
    with torch.no_grad():
        expected = module(*cuda_args)
    for param in sources:
        param.data = param.data.clone()  # unpinned
    with caplog.at_level("WARNING"), torch.no_grad():
        got = module(*cuda_args)
    assert "no longer in pinned host memory" in caplog.text
    assert all(p.is_pinned() for p in sources)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.gpu
def test_training_with_streamed_weights_on_a_gpu_equals_all_on_the_gpu():
    """On a GPU: blocks.0 and blocks.1 streamed, some of them frozen, two training steps;
    gradients equal the whole model's on the GPU (fp32, TF32 off: torch's default)."""
    _needs_cuda()
    net, args = gpt.build("tiny")
    for name, param in net.named_parameters():
        if name.startswith("blocks.0.mlp"):
            param.requires_grad_(False)
    module, _, _ = _lowered(
        ("blocks.0", "blocks.1"), net=copy.deepcopy(net), device_map={"cuda:0": "cuda:0", "cpu": "cpu"}
    )
    params = dict(module.named_parameters())
    for name, path in module.initializer_paths.items():
        if name.startswith("blocks.0.mlp") and path in params:
            params[path].requires_grad_(False)
    cuda_args = [a.cuda() for a in args]
    reference = copy.deepcopy(net).cuda()
    for _ in range(2):
        module.zero_grad()
        reference.zero_grad()
        module(*cuda_args).square().mean().backward()
        reference(*cuda_args).square().mean().backward()
    torch.cuda.synchronize()
    ref = dict(reference.named_parameters())
    checked = 0
    for name, path in module.initializer_paths.items():
        param = params.get(path)
        if param is not None and name in ref and ref[name].grad is not None and param.grad is not None:
            torch.testing.assert_close(param.grad.cuda(), ref[name].grad, atol=1e-5, rtol=1e-4)
            checked += 1
    assert checked > 4
