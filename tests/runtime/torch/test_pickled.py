"""A module from ``pl.to_torch`` through ``torch.save``/``torch.load``: it still checks its inputs
(``InputError``) and still hands its outputs back where ``outputs_on`` says, on a placed MLP from the
zoo (two logical devices; the other device type is ``emu``, :mod:`tests.runtime.second_device`)."""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch

import placement as pl
from placement.models import mlp
from placement.runtime.torch.pickled import PlacedGraphModule
from tests.runtime.second_device import emu_device, needs_emu

TOL = {"rtol": 1e-5, "atol": 1e-6}


@functools.cache
def _placed():
    """The tiny MLP, its second half on logical device 1."""
    net, (x,) = mlp.build("tiny")
    model = pl.from_torch(net, (x,))
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    return model, net, x


def _round_trip(module: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


def test_loaded_module_computes_the_same_and_keeps_its_attributes():
    model, net, x = _placed()
    module = pl.to_torch(model, device_map="cpu")
    loaded = _round_trip(module)
    assert isinstance(loaded, PlacedGraphModule) and loaded is not module
    torch.testing.assert_close(loaded(x), net(x), **TOL)
    for name in ("outputs_on", "input_names", "output_names", "device_map", "initializer_paths"):
        assert getattr(loaded, name) == getattr(module, name), name
    assert loaded.state_dict().keys() == module.state_dict().keys()
    for key, value in module.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)


@pytest.mark.parametrize("trips", [1, 2])
def test_loaded_module_still_checks_its_inputs(trips):
    model, _, x = _placed()
    loaded = pl.to_torch(model, device_map="cpu")
    for _ in range(trips):
        loaded = _round_trip(loaded)
    name = model.inputs[0]
    with pytest.raises(pl.InputError, match=f"input '{name}' has rank 1, expected 2"):
        loaded(x[0])
    with pytest.raises(pl.InputError, match="has dtype float64, expected float32"):
        loaded(x.double())
    with pytest.raises(pl.InputError, match="positional"):
        loaded(x, x)
    with pytest.raises(pl.InputError, match="rank 1"):
        copy.deepcopy(loaded)(x[0])


@needs_emu
def test_loaded_module_still_moves_its_outputs():
    model, net, x = _placed()
    emu = emu_device()
    loaded = _round_trip(pl.to_torch(model, device_map="cpu"))
    out = loaded(x.to(emu))
    assert loaded.outputs_on == "input" and out.device == emu
    torch.testing.assert_close(out.to("cpu").detach(), net(x).detach(), **TOL)
    again = _round_trip(loaded)(x.to(emu))
    assert again.device == emu
    kept = _round_trip(pl.to_torch(model, device_map="cpu", outputs_on="last"))
    assert kept.outputs_on == "last" and kept(x.to(emu)).device.type == "cpu"


def test_loaded_module_trains():
    """Gradients flow through the rebuilt module to its (shared, loaded) parameters."""
    model, net, x = _placed()
    loaded = _round_trip(pl.to_torch(model, device_map="cpu"))
    loaded(x).square().sum().backward()
    net(x).square().sum().backward()
    want = dict(net.named_parameters())
    got = dict(loaded.named_parameters())
    assert got and set(got) <= set(want)
    for name, p in got.items():
        torch.testing.assert_close(p.grad, want[name].grad, **TOL)
