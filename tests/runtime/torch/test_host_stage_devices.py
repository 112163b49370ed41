"""A pipeline whose last stage runs on the host after a GPU stage, emulated on the CPU
(:mod:`tests.runtime.torch.stream_emulator`): the host stage reads its GPU input (the copy to
the host runs on this thread's current stream of the input's device) and, in training, copies
the input's gradient back (:func:`placement.runtime.torch.stage_exec.signal`)."""

from __future__ import annotations

import pytest
import torch

import placement as pl
from tests.runtime.helpers import (
    no_thread_leak,  # noqa: F401 (an autouse fixture)
    placed_zoo,
)
from tests.runtime.torch.stream_emulator import StreamEmulator, emulate_devices

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
HOST = torch.device("cpu")


def _module(devices, *, executor, chunks=2):
    model, net, args = placed_zoo("mlp")
    module = pl.to_torch(model, device_map="cpu", chunks=chunks)
    emulate_devices(module, devices)
    module.executor = executor
    return module, net, args


@pytest.mark.parametrize("executor", ["inline", "threads"])
def test_gpu_then_host_training_on_the_current_device(executor):
    """GPU stage on cuda:0 (the threads' current device), host stage after it: forward and
    backward hand-overs are ordered, gradients equal the unsplit module."""
    module, net, (x,) = _module([CUDA0, HOST], executor=executor, chunks=2)
    with StreamEmulator() as emu:
        xa = emu.place(x.clone(), CUDA0).requires_grad_(True)
        out = module(xa)
        grads = torch.autograd.grad(out.sin().sum(), [xa, *module.parameters()])
        [g.sum() for g in grads]
        emu.check()
    xb = x.clone().requires_grad_(True)
    want = torch.autograd.grad(net(xb).sin().sum(), [xb, *net.parameters()])
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="a host stage's wait_for(env) waits on the current device's stream (cuda:0) only: its "
    "read of a GPU input on cuda:1 (the copy to the host, on cuda:1's current stream) is not "
    "ordered after the cuda:1 stage that made it",
)
def test_host_stage_after_a_stage_on_another_gpu_than_the_current_one():
    module, net, (x,) = _module([CUDA1, HOST], executor="inline", chunks=2)
    with StreamEmulator() as emu, torch.no_grad():
        out = module(emu.place(x.clone(), CUDA1))
        emu.check()
    torch.testing.assert_close(out, net(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("executor", ["inline", "threads"])
@pytest.mark.parametrize("defer", [False, True])
def test_gpu_then_host_one_f_one_b(executor, defer):
    """1F1B over a GPU stage and a host stage: the input gradient the host stage copies back
    to the GPU is waited for before the GPU stage reads it; gradients equal the unsplit module."""
    module, net, (x,) = _module([CUDA0, HOST], executor=executor, chunks=2)
    with StreamEmulator() as emu:
        loss = module.train_step(
            emu.place(x.clone(), CUDA0), loss_fn=lambda out: out.square().mean(), defer_weights=defer
        )
        [p.grad.sum() for p in module.parameters()]
        emu.check()
    torch.testing.assert_close(loss.detach(), net(x).square().mean().detach(), atol=1e-6, rtol=1e-5)
    net.zero_grad()
    net(x).square().mean().backward()
    for got, want in zip(module.parameters(), net.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-4)
