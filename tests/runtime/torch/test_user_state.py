"""What a trained lowered module hands back is the user's own state: exporter-made constants
(the zero bias of a ``bias=False`` convolution, folded ``val_N`` values) are non-persistent
buffers, never trainable parameters, so the original net loads the trained state strictly."""

from __future__ import annotations

import pytest
import torch

import placement as pl
from placement.graph.torch_import import exporter_constants


def _conv_net(dims: int) -> tuple[torch.nn.Module, torch.Tensor]:
    conv = torch.nn.Conv2d if dims == 2 else torch.nn.Conv3d
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        conv(3, 8, 3, bias=False),
        torch.nn.ReLU(),
        conv(8, 8, 3, padding=1, bias=False),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.LazyLinear(4),
    )
    x = torch.randn(4, 3, *([6] * dims))
    net(x)  # materialize the lazy layer
    return net, x


def _placed(net: torch.nn.Module, x: torch.Tensor) -> pl.Model:
    model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    return model


@pytest.mark.parametrize("dims", [2, 3])  # 3: torchvision's video nets (r3d_18), bias-less Conv3d
@pytest.mark.parametrize("chunks", [1, 2])
def test_bias_free_convs_train_only_the_users_parameters(chunks, dims):
    net, x = _conv_net(dims)
    model = _placed(net, x)
    if dims == 2:
        assert exporter_constants(model), "the exporter adds zero biases for bias=False convs"
    module = pl.to_torch(model, device_map="cpu", chunks=chunks)
    want = sorted(name for name, _ in net.named_parameters())
    assert sorted(name for name, _ in module.named_parameters()) == want
    assert sorted(module.state_dict()) == sorted(net.state_dict())
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.05, weight_decay=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        module(x).square().mean().backward()
        optimizer.step()
    trained = module(x).detach()
    net.load_state_dict(module.state_dict(), strict=True)
    torch.testing.assert_close(net(x), trained, atol=1e-5, rtol=1e-5)
    assert sorted(model.update_parameters(module)) == want
    placed = torch.from_numpy(pl.run(model, {"input": x.numpy()})[0])
    torch.testing.assert_close(placed, trained, atol=1e-5, rtol=1e-5)


def test_a_model_file_keeps_its_initializers_trainable(tmp_path):
    net, x = _conv_net(2)
    model = _placed(net, x)
    path = tmp_path / "net.onnx"
    model.save(path)
    loaded = pl.load(path)
    assert exporter_constants(loaded) == exporter_constants(model)  # the annotation survives a save
    model.ir_model.metadata_props.pop("placement.constants")
    plain = pl.to_torch(model, device_map="cpu")  # an ONNX file from elsewhere: every float weight trains
    assert set(exporter_constants(model)) == set()
    assert len(list(plain.parameters())) == len(list(net.parameters())) + 2
