"""The pipelined torch executors on two devices with streams, emulated on the CPU
(:mod:`tests.runtime.torch.stream_emulator`): every hand-over is checked for its device and stream
(which stream waited on which event), every read for a wait behind the work that made it
and for ``record_stream`` where it crosses streams, and results equal the unsplit module.

The mutation tests at the end remove one wait or one ``record_stream`` from the executors and
assert that the emulator sees it: it can fail."""

from __future__ import annotations

import pytest
import torch

import placement as pl
from placement.runtime.torch import one_f_one_b, pipelined
from tests.runtime.helpers import (
    no_thread_leak,  # noqa: F401 (an autouse fixture)
    placed_zoo,
)
from tests.runtime.torch.stream_emulator import StreamEmulator, emulate_devices

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
TWO_GPUS = [CUDA0, CUDA1]
ONE_GPU = [CUDA0, CUDA0]  # two logical devices on one GPU: two stage streams on one device
EXECUTORS = ["inline", "threads"]


def _module(devices, *, executor, chunks=2, name="mlp"):
    model, net, args = placed_zoo(name)
    module = pl.to_torch(model, device_map="cpu", chunks=chunks)
    emulate_devices(module, devices)
    module.executor = executor
    return module, net, args


def _last_events(emu, stage_stream):
    return [e for kind, e, s in emu.log if kind == "record" and s is stage_stream]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("devices", [TWO_GPUS, ONE_GPU], ids=["two-gpus", "one-gpu"])
def test_gpipe_inference_hands_outputs_over_on_the_last_stages_device(devices, executor):
    module, net, (x,) = _module(devices, executor=executor)
    with StreamEmulator() as emu, torch.no_grad():
        out = module(emu.place(x.clone(), CUDA0))  # the caller's input on cuda:0
        last = module._pl_stages[-1]
        assert emu.tensor_device(out) == devices[-1]
        caller = emu.current_stream(devices[-1])  # the caller's stream where the outputs live
        joined = [e for s, e in emu.waits(devices[-1]) if s is caller and e.stream is last.stream]
        assert len(joined) == module.chunks  # one wait per micro-batch, behind the last stage's work
        for stage in module._pl_stages[1:]:  # each later stage waited on its own stream and device
            assert any(s is stage.stream for s, _ in emu.waits(stage.device))
        emu.check()
    torch.testing.assert_close(out, net(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("devices", [TWO_GPUS, ONE_GPU], ids=["two-gpus", "one-gpu"])
def test_gpipe_training_forward_and_backward(devices, executor):
    module, net, (x,) = _module(devices, executor=executor, chunks=3)
    with StreamEmulator() as emu:
        xa = emu.place(x.clone(), CUDA0).requires_grad_(True)
        out = module(xa)
        assert emu.tensor_device(out) == devices[-1]
        grads = torch.autograd.grad(out.sin().sum(), [xa, *module.parameters()])
        assert emu.tensor_device(grads[0]) == CUDA0
        [g.sum() for g in grads]  # the caller reads the gradients on its streams
        emu.check()
    xb = x.clone().requires_grad_(True)
    want = torch.autograd.grad(net(xb).sin().sum(), [xb, *net.parameters()])
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("devices", [TWO_GPUS, ONE_GPU], ids=["two-gpus", "one-gpu"])
@pytest.mark.parametrize("defer", [False, True])
def test_one_f_one_b_losses_and_gradients_handed_over(devices, executor, defer):
    module, net, (x,) = _module(devices, executor=executor, chunks=3)
    y = torch.randn(net(x).shape)
    with StreamEmulator() as emu:
        loss = module.train_step(
            emu.place(x.clone(), CUDA0),
            loss_fn=torch.nn.functional.mse_loss,
            targets=(y,),
            defer_weights=defer,
        )
        last = module._pl_stages[-1]
        assert emu.tensor_device(loss) == devices[-1]
        caller = emu.current_stream(devices[-1])
        took = [e for s, e in emu.waits(devices[-1]) if s is caller and e.stream is last.stream]
        assert len(took) >= module.chunks  # each micro-batch's loss, behind the work that made it
        [p.grad.sum() for p in module.parameters()]  # the caller reads the gradients
        emu.check()
    ref = torch.nn.functional.mse_loss(net(x), y)
    want = torch.autograd.grad(ref, list(net.parameters()))
    torch.testing.assert_close(loss, ref.detach(), atol=1e-6, rtol=1e-5)
    for p, g in zip(module.parameters(), want):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_one_f_one_b_losses_from_host_inputs(executor):
    """Inputs on the host: no event comes with them, so only the loss's own hand-over orders
    the caller's read of it after the last stage's work."""
    module, net, (x,) = _module(TWO_GPUS, executor=executor, chunks=2)
    with StreamEmulator() as emu:
        loss = module.train_step(x, loss_fn=lambda out: out.square().mean())
        total = loss * 2  # the caller reads the loss on its own stream
        emu.check()
    torch.testing.assert_close(total, net(x).square().mean().detach() * 2, atol=1e-6, rtol=1e-5)


# --- the emulator can fail ------------------------------------------------------------------


def test_mutation_stage_without_wait_is_a_race(monkeypatch):
    module, _, (x,) = _module(TWO_GPUS, executor="inline")
    calls = []

    def skip_stage_waits(env, device):  # the stages' waits vanish; the join keeps its own
        calls.append(env.pop("__event__", None))

    monkeypatch.setattr(pipelined, "wait_for_stage", skip_stage_waits)
    with StreamEmulator() as emu, torch.no_grad():
        module(emu.place(x.clone(), CUDA0))
        with pytest.raises(AssertionError, match="before any wait"):
            emu.check()
    assert calls


def test_mutation_join_on_the_current_device_is_a_race(monkeypatch):
    """The join waiting on the caller's current device (cuda:0) while the outputs live on
    cuda:1: the concatenation there reads them unordered."""
    module, _, (x,) = _module(TWO_GPUS, executor="inline")
    real = pipelined.wait_for
    monkeypatch.setattr(pipelined, "wait_for", lambda env, *devices: real(env))
    with StreamEmulator() as emu, torch.no_grad():
        module(emu.place(x.clone(), CUDA0))
        with pytest.raises(AssertionError, match="before any wait"):
            emu.check()


def test_mutation_hand_over_without_record_stream_is_seen(monkeypatch):
    module, _, (x,) = _module(ONE_GPU, executor="inline")
    with StreamEmulator() as emu, torch.no_grad():
        monkeypatch.setattr(emu, "record_stream", lambda tensor, stream: None)
        module(emu.place(x.clone(), CUDA0))
        with pytest.raises(AssertionError, match="without record_stream"):
            emu.check()


def test_mutation_join_streams_removed_is_seen_by_the_gradients(monkeypatch):
    """1F1B computes deferred weight gradients on the stage streams after their last
    hand-over: only joining the stage streams orders the caller's ``.grad`` after them."""
    module, net, (x,) = _module(TWO_GPUS, executor="inline", chunks=3)
    monkeypatch.setattr(one_f_one_b, "join_streams", lambda stages: None)
    with StreamEmulator() as emu:
        module.train_step(
            emu.place(x.clone(), CUDA0), loss_fn=lambda out: out.square().mean(), defer_weights=True
        )
        assert module.stats.deferred
        [p.grad.sum() for p in module.parameters()]  # the caller reads the gradients
        with pytest.raises(AssertionError, match="before any wait"):
            emu.check()


def test_emulator_sees_a_read_on_another_device_stream():
    """The emulator's own rule: a kernel runs on its tensors' device's current stream."""
    emu = StreamEmulator()
    with emu:
        side = emu.new_stream(CUDA1)
        with emu.on_stream(CUDA1, side):
            made = emu.place(torch.ones(3), CUDA1) * 2
        event = emu.record_event(side)
        emu.wait_event(emu.current_stream(CUDA0), event)  # the wrong device's stream waits
        made.sum()
        with pytest.raises(AssertionError, match="before any wait"):
            emu.check()
