"""Autocast and grad mode reach every stage worker: a bf16 autocast step through a pipelined
module gives the same loss, gradients and outputs bit for bit with worker threads as on the
caller's thread alone, for GPipe (forward, checkpointed backward) and for 1F1B ``train_step``."""

from __future__ import annotations

import pytest
import torch

import placement as pl
from placement.runtime.torch.stage_exec import autocast_like, caller_autocast
from tests.runtime.helpers import no_thread_leak, placed_zoo  # noqa: F401 - fixture

_CAST = {"device_type": "cpu", "dtype": torch.bfloat16}


def _modules(name: str) -> tuple[dict[str, torch.nn.Module], tuple[torch.Tensor, ...]]:
    model, _, args = placed_zoo(name)
    executors = ("threads", "inline")
    return {ex: pl.to_torch(model, device_map="cpu", chunks=2, executor=ex) for ex in executors}, args


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["resnet", "mlp"])
def test_gpipe_under_bf16_autocast_is_the_same_on_threads_and_inline(name):
    modules, args = _modules(name)
    results = {}
    for ex, module in modules.items():
        with torch.autocast(**_CAST):
            out = module(*args)
            loss = out.float().square().mean()
        loss.backward()  # the checkpointed micro-batch recomputes under the forward's autocast
        results[ex] = (out.detach(), loss.detach(), _grads(module))
        assert module.stats.executor == ex
    (out_t, loss_t, grads_t), (out_i, loss_i, grads_i) = results["threads"], results["inline"]
    assert out_t.dtype == out_i.dtype == torch.bfloat16 or name == "resnet"
    assert torch.equal(out_t, out_i) and torch.equal(loss_t, loss_i)
    assert grads_t.keys() == grads_i.keys() and grads_t
    for key, grad in grads_t.items():
        assert torch.equal(grad, grads_i[key]), key
    with torch.no_grad(), torch.autocast(**_CAST):  # inference: worker threads in inference mode
        assert torch.equal(modules["threads"](*args), modules["inline"](*args))


def test_train_step_under_bf16_autocast_is_the_same_on_threads_and_inline():
    modules, args = _modules("resnet")
    losses, grads = {}, {}
    for ex, module in modules.items():
        with torch.autocast(**_CAST):
            losses[ex] = module.train_step(*args, loss_fn=lambda out: out.float().square().mean())
        grads[ex] = _grads(module)
    assert torch.equal(losses["threads"], losses["inline"])
    for key, grad in grads["threads"].items():
        assert torch.equal(grad, grads["inline"][key]), key


def test_autocast_state_is_captured_and_entered_on_another_thread():
    import threading

    with torch.autocast(**_CAST):
        casts = caller_autocast()
    seen = []

    def worker():
        with autocast_like(casts):
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        seen.append(torch.is_autocast_enabled("cpu"))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [(True, torch.bfloat16), False]
