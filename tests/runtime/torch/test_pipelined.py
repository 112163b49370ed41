"""Tests for the pipelined torch lowering (``to_torch(chunks=k)``) on the shared schedule: every zoo
model placed on two logical devices gives the unsplit module's outputs and gradients in every
checkpoint mode; traced stages equal untraced ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import placement as pl
from tests.conftest import MODEL_NAMES
from tests.runtime.helpers import no_thread_leak  # noqa: F401 (an autouse fixture)
from tests.runtime.helpers import placed_zoo as _placed

ATOL = 1e-5


# --- torch ------------------------------------------------------------------------------------


def _grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_torch_pipelined_outputs_and_gradients(name):
    model, net, args = _placed(name)
    plain = pl.to_torch(model, device_map="cpu")
    piped = pl.to_torch(model, device_map="cpu", chunks=3, checkpoint="except_last")
    assert len(piped.stages) == 2
    assert [n for n, _ in piped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    piped.load_state_dict(plain.state_dict())
    plain.train()
    piped.train()  # BatchNorm keeps running statistics: splitting the batch changes nothing
    with torch.no_grad():
        torch.testing.assert_close(piped(*args), plain(*args), atol=ATOL, rtol=0)
    (plain(*args).float() ** 2).mean().backward()
    (piped(*args).float() ** 2).mean().backward()
    want, got = _grads(plain), _grads(piped)
    assert want.keys() == got.keys() and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_torch_checkpoint_modes_and_input_grads(checkpoint):
    model, net, (x,) = _placed("mlp")
    plain = pl.to_torch(model, device_map="cpu")
    piped = pl.to_torch(model, device_map="cpu", chunks=2, checkpoint=checkpoint)
    xa = x.clone().requires_grad_(True)
    xb = x.clone().requires_grad_(True)
    loss_a = plain(xa).sin().sum()
    loss_b = piped(xb).sin().sum()
    grads_a = torch.autograd.grad(loss_a, [xa, *plain.parameters()])
    grads_b = torch.autograd.grad(loss_b, [xb, *piped.parameters()])
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_torch_inference_outputs_are_ordinary_tensors():
    """Forward without grad runs the workers in inference mode; what the caller gets is not an
    inference tensor, so it can feed autograd afterwards (a frozen feature extractor)."""
    model, net, (x,) = _placed("mlp")
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    for p in piped.parameters():
        p.requires_grad_(False)
    for _ in range(4):  # past the warm-up: the stages run traced
        with torch.no_grad():
            out = piped(x)
        frozen = piped(x)  # grad mode on, nothing requires grad: the forward-only path too
    assert not out.is_inference() and not frozen.is_inference()
    head = torch.ones(out.shape[-1], requires_grad=True)
    (frozen * head).sum().backward()
    torch.testing.assert_close(head.grad, net(x).detach().sum(0), atol=1e-5, rtol=1e-5)
    out.add_(1)  # in place, outside inference mode


def test_torch_stage_error_propagates():
    model, _, (idx,) = _placed("gpt")
    piped = pl.to_torch(model, device_map="cpu", chunks=3)
    bad = idx.clone()
    bad[4, 0] = 10_000
    with pytest.raises(pl.PipelineError, match="failed on micro-batch 2"):
        piped(bad)
    with pytest.raises(ValueError, match="checkpoint"):
        pl.to_torch(model, device_map="cpu", chunks=2, checkpoint="sometimes")


def test_pipelined_gpt_traced_stages_equal_untraced_for_every_batch():
    model, _, (idx,) = _placed("gpt")
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    plain = pl.to_torch(model, device_map="cpu", chunks=2)
    plain.trace_stages = False
    assert piped.trace_stages and not plain.trace_stages
    with torch.no_grad():
        # micro-batches of 2 + 2, 3 + 2, 2 + 1 and 1: each size is traced on its 3rd call (chunks + 1)
        for batch in (4, 4, 5, 5, 5, 3, 3, 1):
            assert torch.equal(piped(idx[:batch]), plain(idx[:batch]))
    calls = [s.call for s in piped._pl_stages]
    assert all(c.disabled is None for c in calls), [c.disabled for c in calls]
    assert all(c.traced == 3 for c in calls), [c.traced for c in calls]
    assert not any(c.traced for c in (s.call for s in plain._pl_stages))


def test_pipelined_gpt_traced_training_gives_the_same_gradients():
    model, _, (idx,) = _placed("gpt")
    piped = pl.to_torch(model, device_map="cpu", chunks=2, checkpoint="except_last")
    plain = pl.to_torch(model, device_map="cpu", chunks=2, checkpoint="except_last")
    plain.load_state_dict(piped.state_dict())
    plain.trace_stages = False
    for _ in range(3):  # the second step runs traced stages (with grad, and without for checkpointing)
        for module in (piped, plain):
            module.zero_grad(set_to_none=True)
            (module(idx[:4]).float() ** 2).mean().backward()
        want, got = _grads(plain), _grads(piped)
        assert want.keys() == got.keys() and want
        for key in want:
            assert torch.equal(got[key], want[key]), key
    assert all(s.call.traced and s.call.disabled is None for s in piped._pl_stages)


def test_pipelined_traced_stage_error_is_the_modules():
    model, _, (idx,) = _placed("gpt")
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    with torch.no_grad():
        piped(idx[:4])
        piped(idx[:4])
        assert piped._pl_stages[0].call.traced == 1
        bad = idx[:4].clone()
        bad[3, 0] = 10_000  # out of the vocabulary, in micro-batch 1
        with pytest.raises(pl.PipelineError, match=r"stage 0 .* failed on micro-batch 1: IndexError"):
            piped(bad)


def test_train_example_round_trip(tmp_path):
    from examples.train_pipelined import train

    result = train(steps=6, chunks=2, out=tmp_path)
    assert result["last_loss"] < result["first_loss"]
    assert result["max_abs_diff"] < 1e-4
    assert (tmp_path / "trained_placed.onnx").exists()


def test_update_parameters_checks_before_writing():
    model, net, _ = _placed("mlp")
    model = model.copy()
    name = next(iter(model.graph.initializers))
    before = model.graph.initializers[name].const_value.numpy().copy()
    with pytest.raises(pl.PlacementError, match=repr(name)):
        model.update_parameters({name: np.zeros((1, 1), np.float32)})
    with pytest.raises(pl.UnknownBlobError, match="'nope'"):
        model.update_parameters({"nope": np.zeros(1, np.float32)})
    np.testing.assert_array_equal(model.graph.initializers[name].const_value.numpy(), before)
