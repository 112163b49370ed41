"""Real training mode: a model exported with ``training=True`` lowers to a module whose Dropout is
live and whose BatchNorm uses batch statistics and updates its running buffers in train mode,
and which computes what the eval-mode graph does after ``module.eval()``.

Micro-batched BatchNorm (``to_torch(chunks=k)``) follows GPipe's rule: each micro-batch is
normalised with its own statistics, and the running buffers are updated once per micro-batch,
in micro-batch order, exactly as the unsplit module run on the micro-batches one after another.
A checkpointed micro-batch recomputes its forward with the same Dropout masks and without
updating the buffers again. An eval-mode export warns once when its module is trained."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import placement as pl
from tests.runtime.helpers import no_thread_leak  # noqa: F401 - fixture

_BATCH = {0: torch.export.Dim("batch")}


def _cnn(dropout: float = 0.0) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8, momentum=0.3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
    ]
    if dropout:
        layers.append(torch.nn.Dropout(dropout))
    layers.append(torch.nn.Linear(8 * 6 * 6, 5))
    net = torch.nn.Sequential(*layers)
    with torch.no_grad():  # running statistics away from their defaults
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return net, torch.randn(8, 3, 6, 6) * 2 + 0.5


def _export(net: torch.nn.Module, x: torch.Tensor, *, split: bool = True) -> pl.Model:
    model = pl.from_torch(net, (x,), dynamic_shapes=(_BATCH,), training=True)
    assert net.training, "the module's own mode is restored"
    if split:
        acts = pl.get_activation_blobs(model)
        pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
        pl.inject_cross_device_copies(model)
    return model


def _running(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items() if "running" in k or "num_batches" in k}


def test_batchnorm_trains_on_batch_statistics_and_its_buffers_reach_the_graph():
    net, x = _cnn()
    model = _export(net, x)
    module = pl.to_torch(model, device_map="cpu")
    reference = _running(net)
    assert _running(module).keys() == reference.keys()
    out = module(x)
    want = net(x)  # train mode: batch statistics, buffers updated
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert _running(module)["1.num_batches_tracked"].item() == 1
    for key, value in _running(module).items():
        assert not torch.equal(value, reference[key]), f"{key} never updated"
        torch.testing.assert_close(value, net.state_dict()[key], atol=1e-6, rtol=1e-5)
    out.square().mean().backward()
    want.square().mean().backward()
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, net.get_parameter(name).grad, atol=1e-5, rtol=1e-4)
    module.eval()
    net.eval()
    torch.testing.assert_close(module(x), net(x), atol=1e-5, rtol=1e-5)
    written = model.update_parameters(module)
    assert {k for k in written if "running" in k} == {k for k in reference if "running" in k}
    assert sorted(module.state_dict()) == sorted(net.state_dict())
    net.load_state_dict(module.state_dict(), strict=True)  # counters included
    placed = torch.from_numpy(pl.run(model, {"input": x.numpy()})[0])  # ORT: eval mode
    torch.testing.assert_close(placed, net(x), atol=1e-4, rtol=1e-4)


def test_dropout_is_live_in_train_mode_and_off_in_eval_mode():
    torch.manual_seed(1)
    layers = [torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(64, 4)]
    net = torch.nn.Sequential(*layers)
    x = torch.randn(512, 16)
    model = _export(net, x[:8], split=False)
    module = pl.to_torch(model, device_map="cpu")
    a, b = module(x), module(x)
    assert not torch.equal(a, b), "two train-mode forwards differ"
    net.eval()
    want = net(x)
    draws = torch.stack([module(x).detach() for _ in range(200)])
    torch.testing.assert_close(draws.mean(0).mean(0), want.mean(0), atol=0.05, rtol=0.05)  # E[mask]/(1-p) = 1
    module.eval()
    torch.testing.assert_close(module(x), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(module(x), module(x))
    served = [pl.run(model, {"input": x.numpy()}, device_map="cpu")[0] for _ in range(2)]  # ORT: inference
    np.testing.assert_array_equal(served[0], served[1])
    np.testing.assert_allclose(served[0], want.detach().numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("executor", ["threads", "inline"])
def test_microbatched_batchnorm_is_per_microbatch_like_gpipe(checkpoint, executor):
    net, x = _cnn()
    model = _export(net, x)
    module = pl.to_torch(model, device_map="cpu", chunks=2, checkpoint=checkpoint, executor=executor)
    out = module(x)
    # The rule: each micro-batch normalised with its own statistics, buffers updated per micro-batch.
    want = torch.cat([net(part) for part in x.chunk(2)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    out.square().mean().backward()  # "always": both micro-batches recompute, buffers untouched
    want.square().mean().backward()
    state = net.state_dict()
    for key, value in _running(module).items():
        torch.testing.assert_close(value, state[key], atol=1e-6, rtol=1e-5)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, net.get_parameter(name).grad, atol=1e-5, rtol=1e-4)
    assert module.stats.total_recomputed == (0 if checkpoint == "never" else 2 * 2)  # 2 stages


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_checkpointed_dropout_recomputes_the_same_masks(checkpoint):
    """The gradients equal those of the unsplit module fed the masks the forward drew (read back
    from the outputs' zeros): a recomputation with other masks would not match."""
    torch.manual_seed(2)
    layers = [torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Dropout(0.5)]
    net = torch.nn.Sequential(*layers)
    x = torch.randn(8, 16)
    module = pl.to_torch(_export(net, x), device_map="cpu", chunks=2, checkpoint=checkpoint)
    out = module(x)
    out.sum().backward()
    assert module.stats.total_recomputed == (4 if checkpoint == "always" else 0)
    mask = (out.detach() != 0).float() / 0.5
    assert 0.3 < float((mask == 0).float().mean()) < 0.7
    (net[:3](x) * mask).sum().backward()
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, net.get_parameter(name).grad, atol=1e-5, rtol=1e-4)


def test_training_with_train_step_updates_running_buffers_once_per_microbatch():
    net, x = _cnn()
    module = pl.to_torch(_export(net, x), device_map="cpu", chunks=2)
    module.train_step(x, loss_fn=lambda out: out.square().mean())
    for part in x.chunk(2):
        net(part)
    state = net.state_dict()
    for key, value in _running(module).items():
        torch.testing.assert_close(value, state[key], atol=1e-6, rtol=1e-5)


def test_an_eval_mode_export_warns_once_when_trained():
    net, x = _cnn(dropout=0.1)
    model = pl.from_torch(net, (x,), dynamic_shapes=(_BATCH,))
    for chunks in (1, 2):
        module = pl.to_torch(model, device_map="cpu", chunks=chunks)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                module(x)  # inference: no warning
            module.eval()
            module(x)  # eval mode: no warning
            module.train()
            module(x).sum().backward()
            module(x).sum().backward()
        messages = [str(w.message) for w in caught if "eval mode" in str(w.message)]
        assert len(messages) == 1, messages
        assert "BatchNorm2d" in messages[0] and "Dropout" in messages[0] and "training=True" in messages[0]
    trained = pl.to_torch(_export(net, x), device_map="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trained(x).sum().backward()  # a training export: nothing to warn about
