"""The pipelined backward never blocks an autograd device thread (``placement/runtime/torch/reentrant.py``).

On a GPU the autograd engine runs backward work on one thread per device, and a
``torch.autograd.grad`` called from another thread queues its GPU work to that thread
and waits. The CPU has no such thread, so these tests build one: a thread started
outside ``threading`` (as the engine's are) that serves a queue, and a
``torch.autograd.grad`` that, like the engine for a device, runs on that thread and
makes callers on other threads queue their call there and wait. ``loss.backward()`` on
that thread through a GPipe module then deadlocks unless the pipelined backward runs
the stages itself; with the fix it finishes, runs every stage's ``autograd.grad`` on
that thread, and gives the unsplit module's gradients.
"""

from __future__ import annotations

import _thread
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import placement as pl
from placement.errors import PipelineError
from placement.models import mlp
from placement.runtime.torch import concurrent
from placement.runtime.torch.reentrant import on_engine_thread, run_in_order

WAIT_S = 60.0  # far more than any run here takes; only a deadlock reaches it


class DeviceThread:
    """A stand-in for the autograd engine's thread of one device: started outside
    ``threading`` (``on_engine_thread()`` is true on it), serving a queue of calls."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        ready = threading.Event()
        box: list[int] = []

        def serve() -> None:
            box.append(threading.get_ident())
            ready.set()
            while (item := self.tasks.get()) is not None:
                fn, out, done = item
                try:
                    out.append((True, fn()))
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    out.append((False, err))
                done.set()

        _thread.start_new_thread(serve, ())
        ready.wait()
        self.ident = box[0]

    def call(self, fn: Callable[[], Any], timeout: float = WAIT_S) -> Any:
        out: list[tuple[bool, Any]] = []
        done = threading.Event()
        self.tasks.put((fn, out, done))
        if not done.wait(timeout):
            raise TimeoutError("the device thread did not take the work: it is blocked (deadlock)")
        ok, value = out[0]
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self.tasks.put(None)


class Bound:
    """The device thread, where the real ``torch.autograd.grad`` calls ran, and how long a
    caller on another thread waits for the device thread to take its call."""

    def __init__(self, thread: DeviceThread) -> None:
        self.thread = thread
        self.ran_on: list[int] = []
        self.wait_s = WAIT_S


@pytest.fixture
def device(monkeypatch):
    """``torch.autograd.grad`` bound to a device thread as the engine binds GPU work: it runs
    there, and callers on other threads queue it there and wait."""
    bound = Bound(DeviceThread())
    real = torch.autograd.grad

    def grad(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == bound.thread.ident:
            bound.ran_on.append(threading.get_ident())
            return real(*args, **kwargs)
        return bound.thread.call(lambda: grad(*args, **kwargs), timeout=bound.wait_s)

    monkeypatch.setattr(torch.autograd, "grad", grad)
    yield bound
    bound.thread.stop()


@functools.cache
def _placed() -> tuple[pl.Model, torch.nn.Module, torch.Tensor]:
    net, (x,) = mlp.build("tiny")
    x = torch.cat([x, x.flip(0)])[:6]
    model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    model.set_device(model.ops[-1].name, 1)
    pl.inject_cross_device_copies(model)
    return model, net, x


def _pipelined(chunks: int = 2):
    model, net, x = _placed()
    module = pl.to_torch(model.copy(), device_map="cpu", chunks=chunks)
    assert len(module.stages) == 2
    return module, net, x


def _reference(net: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    net.zero_grad(set_to_none=True)
    (net(x).square().mean()).backward()
    return {name: p.grad.clone() for name, p in net.named_parameters()}


def _close(module: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = {name: p.grad for name, p in module.named_parameters()}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_the_stand_in_is_an_engine_thread_and_this_one_is_not(device):
    thread = device.thread
    assert not on_engine_thread()
    assert thread.call(on_engine_thread) is True


def test_backward_on_a_device_thread_runs_every_stage_there(device):
    thread, ran_on = device.thread, device.ran_on
    module, net, x = _pipelined(chunks=3)
    want = _reference(net, x)

    def step() -> None:
        module.zero_grad(set_to_none=True)
        module(x).square().mean().backward()

    thread.call(step)
    _close(module, want)
    assert len(ran_on) == 2 * 3 and set(ran_on) == {thread.ident}  # each (stage, micro-batch), there


def test_autograd_grad_on_a_device_thread(device):
    thread, ran_on = device.thread, device.ran_on
    module, net, x = _pipelined()
    want = _reference(net, x)
    names = [n for n, _ in module.named_parameters()]
    xg = x.clone().requires_grad_(True)
    grads = thread.call(lambda: torch.autograd.grad(module(xg).square().mean(), [xg, *module.parameters()]))
    for name, g in zip(names, grads[1:]):
        torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-6)
    xr = x.clone().requires_grad_(True)
    (ref_x,) = torch.autograd.grad(net(xr).square().mean(), [xr])
    torch.testing.assert_close(grads[0], ref_x, rtol=1e-5, atol=1e-6)
    assert set(ran_on) == {thread.ident}


@pytest.mark.parametrize("executor", ["inline", "threads"])
def test_train_step_leaves_the_device_thread_free(device, executor):
    """``train_step`` is called from the user's thread: its autograd work (on the workers, or
    on that thread inline) may go to the device thread, which nothing blocks."""
    thread, ran_on = device.thread, device.ran_on
    module, net, x = _pipelined()
    module.executor = executor
    want = _reference(net, x)
    module.zero_grad(set_to_none=True)
    module.train_step(x, loss_fn=lambda out: out.square().mean())
    _close(module, want)
    assert ran_on and set(ran_on) == {thread.ident}


def test_waiting_on_workers_from_the_device_thread_is_the_deadlock(device, monkeypatch):
    """The hazard is real in this stand-in: with the workers used from the device thread
    (the design before), their autograd work waits for the blocked thread."""
    thread = device.thread
    module, _, x = _pipelined()
    module.executor = "threads"  # the hazard is waiting on worker threads
    monkeypatch.setattr(concurrent, "on_engine_thread", lambda: False)
    device.wait_s = 1.0  # the workers give up instead of waiting forever

    def step() -> None:
        module(x).square().mean().backward()

    with pytest.raises(PipelineError) as caught:
        thread.call(step)
    assert "deadlock" in str(caught.value)


def test_run_in_order_is_the_fill_drain_order_and_names_failures():
    seen: list[tuple[int, int]] = []

    def stage(j: int) -> Callable[[int, Any], Any]:
        def fn(i: int, payload: Any) -> Any:
            seen.append((i, j))
            if (i, j) == (7, 1):
                raise ValueError("boom")
            return payload + [j]

        return fn

    out = run_in_order([stage(0), stage(1)], ["a", "b"], [[], [], []], ids=[5, 4, 3])
    assert out == [[0, 1]] * 3
    assert seen == [(5, 0), (4, 0), (5, 1), (3, 0), (4, 1), (3, 1)]
    with pytest.raises(PipelineError, match="b") as caught:
        run_in_order([stage(0), stage(1)], ["a", "b"], [[]], ids=[7])
    assert isinstance(caught.value.__cause__, ValueError)
