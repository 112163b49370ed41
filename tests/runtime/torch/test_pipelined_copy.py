"""A pipelined module survives ``copy.deepcopy`` and ``torch.save``/``torch.load``: the copy
computes the same outputs over tensors of its own (its stages rebuilt over them), so EMA and
SWA helpers (``torch.optim.swa_utils.AveragedModel``) work on it."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import placement as pl
from tests.runtime.helpers import no_thread_leak, placed_zoo  # noqa: F401 - fixture


def _pipelined(name: str, executor: str = "threads") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model, _, args = placed_zoo(name)
    return pl.to_torch(model, device_map="cpu", chunks=2, executor=executor), args


def _reloaded(module: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt"])
@pytest.mark.parametrize("how", [copy.deepcopy, _reloaded], ids=["deepcopy", "save_load"])
def test_a_copy_runs_like_the_original_over_its_own_tensors(name, how):
    module, args = _pipelined(name)
    want = module(*args)
    twin = how(module)
    assert type(twin) is type(module)
    assert (twin.chunks, twin.outputs_on) == (module.chunks, module.outputs_on)
    torch.testing.assert_close(twin(*args), want, rtol=0, atol=0)
    mine = {id(p) for p in module.parameters()}
    assert mine.isdisjoint(id(p) for p in twin.parameters())
    with torch.no_grad():  # the copy's stages read the copy's tensors, not the original's
        for p in twin.parameters():
            if p.is_floating_point():
                p.mul_(0.5)
    assert not torch.equal(twin(*args), want)
    torch.testing.assert_close(module(*args), want, rtol=0, atol=0)
    twin(*args).float().square().mean().backward()  # the copy trains (GPipe backward)
    assert all(p.grad is None for p in module.parameters())
    assert any(p.grad is not None for p in twin.parameters())


def test_averaged_model_of_a_pipelined_module():
    module, args = _pipelined("mlp")
    averaged = torch.optim.swa_utils.AveragedModel(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    snapshots = []
    for _ in range(3):
        optimizer.zero_grad()
        module(*args).float().square().mean().backward()
        optimizer.step()
        averaged.update_parameters(module)
        snapshots.append({n: p.detach().clone() for n, p in module.named_parameters()})
    for name, p in averaged.module.named_parameters():
        mean = sum(s[name] for s in snapshots) / len(snapshots)
        torch.testing.assert_close(p, mean, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(dict(averaged.module.named_parameters())[name])
    torch.testing.assert_close(averaged(*args), module(*args), rtol=0, atol=0)
