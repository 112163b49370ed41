"""Autocast in pipelined recomputation (:mod:`placement.runtime.torch.pipelined`)."""

from __future__ import annotations

import pytest
import torch

import placement as pl
from tests.runtime.helpers import placed_zoo


def _grads(module: torch.nn.Module, args, backward_autocast: bool) -> dict[str, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    loss = module(*args).float().square().mean()  # the forward in full precision
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=backward_autocast):
        loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backward_autocast", [False, True])
@pytest.mark.parametrize("executor", ["inline", "threads"])
def test_recomputation_runs_under_the_forwards_autocast_state_not_the_backwards(executor, backward_autocast):
    """A checkpointed micro-batch recomputes its forward as it first ran (torch.utils.checkpoint
    restores the forward's autocast state): a full-precision forward is recomputed in full
    precision even when ``backward()`` is called inside an autocast block, so its gradients
    equal those of the same pipeline keeping its activations."""
    model, _, args = placed_zoo("mlp")
    kept = pl.to_torch(model, device_map="cpu", chunks=2, executor=executor, checkpoint="never")
    recomputed = pl.to_torch(model, device_map="cpu", chunks=2, executor=executor, checkpoint="always")
    want = _grads(kept, args, backward_autocast)
    got = _grads(recomputed, args, backward_autocast)
    assert want and want.keys() == got.keys()
    for key, grad in want.items():
        assert torch.equal(grad, got[key]), key
