"""The torch lowering on a GPU: ``pl.to_torch`` plain and pipelined (``chunks``), the GPipe
backward (``loss.backward()`` and ``torch.autograd.grad``) under a deadline, and ``train_step``,
on logical devices sharing one GPU and on GPU + CPU maps. Gradients equal the unsplit
module's on the CPU in strict fp32 (``tests/conftest.py`` turns TF32 off)."""

from __future__ import annotations

import functools

import pytest
import torch

import placement as pl
from placement.runtime.precision import FP32_TOLERANCE, torch_uses_tf32
from placement.runtime.torch import concurrent
from tests.conftest import MODEL_NAMES
from tests.gpu import finishes_within, needs_torch_cuda

pytestmark = [pytest.mark.gpu, needs_torch_cuda]

MAPS = {
    "shared GPU": {0: "cuda:0", 1: "cuda:0"},
    "GPU then CPU": {0: "cuda:0", 1: "cpu"},
    "CPU then GPU": {0: "cpu", 1: "cuda:0"},
}
DEADLINE_S = 120.0
GRAD_RTOL, GRAD_ATOL = 1e-3, 1e-4  # strict fp32 on two devices' kernels, summed over micro-batches


@functools.cache
def _placed(name: str, batch: int = 8):
    """``name`` (tiny) exported with a dynamic batch, its activations split over 2 devices,
    and a batch of ``batch`` rows."""
    from placement import models

    net, args = models.build(name, "tiny")
    dim = torch.export.Dim("batch")
    model = pl.from_torch(net, args, dynamic_shapes=tuple({0: dim} for _ in args))
    pl.place_evenly(model, 2)
    reps = -(-batch // args[0].shape[0])
    big = tuple(torch.cat([a] * reps)[:batch] for a in args)
    return model, net, big


def _loss(out) -> torch.Tensor:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return sum(o.float().square().mean() for o in outs if o.is_floating_point())


def _reference_grads(model: pl.Model, args: tuple, state: dict) -> dict[str, torch.Tensor]:
    """The unsplit lowered module on the CPU (equal to the original module's, see the CPU tests)."""
    plain = pl.to_torch(model.copy(), device_map="cpu")
    plain.load_state_dict({k: v.cpu() for k, v in state.items()})
    _loss(plain(*args)).backward()
    return {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}


def _same_grads(module: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(got[name].cpu(), want[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def test_the_suite_runs_torch_without_tf32():
    assert not torch_uses_tf32()


@pytest.mark.parametrize("where", MAPS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_to_torch_on_cuda_equals_eager(exported, name, where):
    model, net, args = exported(name)
    pl.place_evenly(model, 2)
    module = pl.to_torch(model, device_map=MAPS[where])
    assert any(str(p).startswith("cuda") for p in module.device_map.values())
    with torch.no_grad():
        got, want = module(*args), net(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g.cpu(), w, rtol=FP32_TOLERANCE.rtol, atol=FP32_TOLERANCE.atol)


@pytest.mark.parametrize("where", MAPS)
def test_pipelined_forward_on_cuda(where):
    model, net, args = _placed("gpt")
    piped = pl.to_torch(model.copy(), device_map=MAPS[where], chunks=4)
    with torch.no_grad():
        got, want = piped(*args), net(*args)
    torch.testing.assert_close(got.cpu(), want, rtol=FP32_TOLERANCE.rtol, atol=FP32_TOLERANCE.atol)


@pytest.mark.parametrize("checkpoint", ["except_last", "always", "never"])
@pytest.mark.parametrize("where", MAPS)
def test_gpipe_loss_backward_on_cuda_finishes_with_the_unsplit_gradients(where, checkpoint):
    """The deadlock this guards against: the engine's GPU thread runs the pipelined backward."""
    model, _, args = _placed("gpt")
    piped = pl.to_torch(model.copy(), device_map=MAPS[where], chunks=4, checkpoint=checkpoint)
    want = _reference_grads(model, args, piped.state_dict())
    finishes_within(DEADLINE_S, lambda: _loss(piped(*args)).backward())
    _same_grads(piped, want)


@pytest.mark.parametrize("where", MAPS)
def test_gpipe_autograd_grad_on_cuda(where):
    model, _, args = _placed("gpt")
    piped = pl.to_torch(model.copy(), device_map=MAPS[where], chunks=4)
    want = _reference_grads(model, args, piped.state_dict())
    names = [n for n, p in piped.named_parameters() if n in want]
    params = [p for n, p in piped.named_parameters() if n in want]
    grads = finishes_within(DEADLINE_S, lambda: torch.autograd.grad(_loss(piped(*args)), params))
    for name, g in zip(names, grads):
        torch.testing.assert_close(g.cpu(), want[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


@pytest.mark.parametrize("where", MAPS)
def test_train_step_on_cuda(where):
    model, _, args = _placed("gpt")
    piped = pl.to_torch(model.copy(), device_map=MAPS[where], chunks=4)
    want = _reference_grads(model, args, piped.state_dict())
    # the mean over equal micro-batches of each one's mean: the unsplit loss
    step = functools.partial(piped.train_step, *args, loss_fn=lambda out: out.float().square().mean())
    loss = finishes_within(DEADLINE_S, step)
    assert torch.isfinite(loss)
    _same_grads(piped, want)


@pytest.mark.parametrize(("where", "inline"), [("shared GPU", True), ("GPU then CPU", False)])
def test_backward_runs_inline_exactly_on_the_engines_gpu_thread(monkeypatch, where, inline):
    """Output on the GPU: the engine calls the pipelined backward on its GPU thread, which runs
    every stage itself. Output on the CPU: the caller's thread, and the stages on the workers
    (``executor="threads"``: the inline executor would call ``run_in_order`` everywhere)."""
    calls: list[bool] = []
    real = concurrent.run_in_order

    def spy(*a, **k):
        calls.append(concurrent.on_engine_thread())
        return real(*a, **k)

    monkeypatch.setattr(concurrent, "run_in_order", spy)
    model, _, args = _placed("mlp")
    piped = pl.to_torch(model.copy(), device_map=MAPS[where], chunks=2, executor="threads")
    finishes_within(DEADLINE_S, lambda: _loss(piped(*args)).backward())
    assert calls == ([True] if inline else [])
