"""``pl.to_torch(model, outputs_on=...)``: outputs come back on the first tensor input's device
(``"input"``, the default) or stay on the last stage's (``"last"``), for every ``chunks`` and in
``train_step``, with gradients flowing back through the move.

On a CPU-only machine the "other device" is ``emu`` (:mod:`tests.runtime.second_device`), a
device type of its own whose tensors CPU kernels refuse: inputs given there come back there only
if the module moves them. The ``gpu`` tests do the same with a real GPU behind the stages."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import placement as pl
from placement.models import mlp
from placement.runtime.torch import outputs as outputs_module
from tests.runtime.second_device import emu_device, needs_emu

TOL = {"rtol": 1e-5, "atol": 1e-6}


@functools.cache
def _placed():
    """The tiny MLP with a dynamic batch, its second half on logical device 1."""
    net, (x,) = mlp.build("tiny")
    model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    return model, net, torch.cat([x, x.flip(0)])


def _two_outputs():
    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2), torch.nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.relu(self.body(x)) * scale
            return self.a(h), self.b(h)

    torch.manual_seed(0)
    net = TwoHeads().eval()
    args = (torch.randn(5, 4), torch.rand(5, 1))
    model = pl.from_torch(net, args)
    model.set_device(model.ops[-1].name, 1)
    pl.inject_cross_device_copies(model)
    return model, net, args


@pytest.mark.parametrize("bad", ["first", "cpu", None, 0])
def test_outputs_on_is_checked(bad):
    model, _, _ = _placed()
    with pytest.raises(pl.DeviceError, match=f"outputs_on must be 'input' .* or 'last' .*got {bad!r}"):
        pl.to_torch(model, device_map="cpu", outputs_on=bad)


def test_default_is_input_and_the_move_is_applied(monkeypatch):
    """Without a second device: the hook asks where the first input is and moves the outputs
    there (``meta`` stands in for it); ``"last"`` leaves them where the stages made them."""
    model, net, x = _placed()
    module = pl.to_torch(model, device_map="cpu")
    assert module.outputs_on == "input"
    monkeypatch.setattr(outputs_module, "first_tensor_device", lambda args, kwargs=None: torch.device("meta"))
    out = module(x)
    assert out.device.type == "meta" and out.shape == net(x).shape
    kept = pl.to_torch(model, device_map="cpu", outputs_on="last")
    assert kept.outputs_on == "last" and kept(x).device.type == "cpu"


@needs_emu
def test_outputs_come_back_on_the_input_device():
    model, net, x = _placed()
    emu = emu_device()
    module = pl.to_torch(model, device_map="cpu")
    out = module(x.to(emu))
    assert out.device == emu
    torch.testing.assert_close(out.to("cpu").detach(), net(x).detach(), **TOL)
    kept = pl.to_torch(model, device_map="cpu", outputs_on="last")(x.to(emu))
    assert kept.device.type == "cpu"
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.add(out, 1)  # emu tensors really are elsewhere: CPU kernels refuse them


@needs_emu
def test_gradients_flow_back_through_the_move():
    model, net, x = _placed()
    emu = emu_device()
    module = pl.to_torch(model, device_map="cpu")
    leaf = x.clone().requires_grad_()
    out = module(leaf.to(emu))
    assert out.device == emu and out.grad_fn is not None
    seed = torch.randn(out.shape)
    params = dict(module.named_parameters())
    got = torch.autograd.grad(out, [leaf, *params.values()], seed.to(emu))
    ref_leaf = x.clone().requires_grad_()
    ref_params = {name: p for name, p in net.named_parameters() if name in params}
    assert len(ref_params) == len(params)
    want = torch.autograd.grad(net(ref_leaf), [ref_leaf, *(ref_params[n] for n in params)], seed)
    for g, w in zip(got, want):
        assert g.device.type == "cpu"
        torch.testing.assert_close(g, w, **TOL)


@needs_emu
def test_the_first_tensor_input_decides_also_by_keyword():
    model, net, (x, scale) = _two_outputs()
    emu = emu_device()
    module = pl.to_torch(model, device_map="cpu")
    names = module.input_names
    for args, kwargs, where in (
        ((x.to(emu), scale), {}, emu),
        ((x, scale.to(emu)), {}, torch.device("cpu")),
        ((), {names[0]: x.to(emu), names[1]: scale}, emu),
    ):
        out = module(*args, **kwargs)
        assert isinstance(out, tuple) and [o.device for o in out] == [where, where]
        for got, want in zip(out, net(x, scale)):
            torch.testing.assert_close(got.to("cpu").detach(), want.detach(), **TOL)


@needs_emu
def test_deepcopy_keeps_the_move_and_the_input_check():
    model, _, x = _placed()
    emu = emu_device()
    clone = copy.deepcopy(pl.to_torch(model, device_map="cpu"))
    assert clone.outputs_on == "input" and clone(x.to(emu)).device == emu
    with pytest.raises(pl.InputError, match="rank 1"):
        clone(x[0])


@needs_emu
def test_pipelined_forward_and_train_step_on_the_input_device():
    model, net, x = _placed()
    emu = emu_device()
    module = pl.to_torch(model, device_map="cpu", chunks=2)
    with torch.no_grad():
        out = module(x.to(emu))
    assert out.device == emu
    torch.testing.assert_close(out.to("cpu"), net(x).detach(), **TOL)
    trained = module(x.to(emu))  # with gradients: through the pipeline's autograd function
    assert trained.device == emu and trained.requires_grad
    seen: list[torch.device] = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.extend([out.device, target.device])
        return torch.nn.functional.mse_loss(out.to("cpu"), target.to("cpu"))

    target = torch.randn(net(x).shape)
    loss = module.train_step(x.to(emu), loss_fn=loss_fn, targets=(target.to(emu),))
    assert seen and set(seen) == {emu}
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad()
    last = pl.to_torch(model, device_map="cpu", chunks=2, outputs_on="last")
    want = last.train_step(x, loss_fn=torch.nn.functional.mse_loss, targets=(target,))
    torch.testing.assert_close(loss, want, **TOL)
    for name, p in last.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL)


def test_train_step_without_a_second_device_hands_loss_fn_the_outputs_where_the_input_is():
    model, net, x = _placed()
    module = pl.to_torch(model, device_map="cpu", chunks=2)
    devices: list[torch.device] = []
    loss = pl.train_step(module, x, loss_fn=lambda out: devices.append(out.device) or out.square().mean())
    assert devices == [torch.device("cpu")] * 2 and loss.device.type == "cpu"


# --- on a GPU: the stages there, the caller's tensors on the CPU ---------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for torch")
@pytest.mark.parametrize("chunks", [1, 2])
def test_cpu_inputs_give_cpu_outputs_with_stages_on_the_gpu(chunks):
    model, net, x = _placed()
    module = pl.to_torch(model, device_map={0: "cuda:0", 1: "cuda:0"}, chunks=chunks)
    leaf = x.clone().requires_grad_()
    out = module(leaf)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out.detach(), net(x).detach(), rtol=1e-4, atol=1e-5)  # strict fp32
    (grad,) = torch.autograd.grad(out.sum(), [leaf])
    assert grad.device.type == "cpu"
    kept = pl.to_torch(model, device_map={0: "cuda:0", 1: "cuda:0"}, chunks=chunks, outputs_on="last")
    assert kept(x).device.type == "cuda"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for torch")
def test_cuda_graphs_module_returns_outputs_on_the_input_device():
    model, net, x = _placed()
    module = pl.to_torch(model, device_map="cuda:0", cuda_graphs=True)
    with torch.no_grad():
        outs = [module(x) for _ in range(3)]  # captured, then replayed
    assert module.replays >= 1 and all(o.device.type == "cpu" for o in outs)
    torch.testing.assert_close(outs[-1], net(x).detach(), rtol=1e-4, atol=1e-5)
