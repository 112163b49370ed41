from __future__ import annotations

import pytest
import torch

import placement as pl


def test_module_is_unchanged_and_names_kept():
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)
    )
    net.train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    model = pl.from_torch(net, (torch.randn(3, 4),), device="cuda:2")
    assert net.training and all(m.training for m in net.modules())
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key])
    assert {"0.weight", "0.bias"} <= set(model.parameters)
    assert model.devices == [pl.Device("cuda", 2)]
    assert {op.scope for op in model.ops} >= {"0", "3"}


def test_scopes_from_gpt(exported):
    model, net, _ = exported("gpt")
    scopes = {op.scope for op in model.ops if op.scope}
    assert any(s.startswith("blocks.0") for s in scopes)
    top = {name for name, _ in net.named_children()}
    assert {s.split(".")[0] for s in scopes} <= top


def test_export_failure_is_a_placement_error():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    with pytest.raises(pl.ExportError, match="DataDependent") as err:
        pl.from_torch(DataDependent(), (torch.randn(2),))
    assert "pl.load" in str(err.value)
    assert "\x1b[" not in str(err.value)


def test_not_a_module():
    with pytest.raises(pl.ExportError, match="nn.Module"):
        pl.from_torch(lambda x: x, (torch.randn(2),))


@pytest.mark.parametrize("name", ["resnet", "gpt", "unet"])
def test_parameter_names_are_the_module_names(name, exported):
    model, net, _ = exported(name)
    owned = {n for n, _ in net.named_parameters(remove_duplicate=False)}
    owned |= {n for n, _ in net.named_buffers(remove_duplicate=False)}
    params = set(model.parameters)
    # parameters keep their module names; only small folded constants get new (val_*) names
    assert {p for p in params if not p.startswith("val_")} <= owned | {"arange"}
    # nothing trainable was folded away: each module parameter tensor is in the graph once
    tensors = {id(p): n for n, p in net.named_parameters()}
    graph_tensors = {
        id(net.get_parameter(n)) for n in params if n in dict(net.named_parameters(remove_duplicate=False))
    }
    assert graph_tensors == set(tensors)


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt", "unet"])
def test_every_blob_has_a_static_size(name, exported):
    from placement.graph.model import value_nbytes

    model, _, _ = exported(name)
    unknown = [v.name for node in model.graph for v in node.outputs if value_nbytes(v) is None]
    assert unknown == []
