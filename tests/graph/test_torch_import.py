from __future__ import annotations

import numpy as np
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
        pl.from_torch(DataDependent(), (torch.randn(2),), exporter="dynamo")
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


# --- exporter fallback ---------------------------------------------------------------------


class _Branchy(torch.nn.Module):
    """torch.export cannot trace a branch on a tensor's value (the dynamo exporter fails);
    the TorchScript exporter traces the branch the example input takes."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(4, 4)
        self.dec = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))

    def forward(self, x):
        h = self.enc(x)
        if h.sum() > 0:
            h = torch.relu(h)
        return self.dec(h) * 2


def test_dynamo_failure_falls_back_to_the_torchscript_exporter(caplog):
    import numpy as np

    from placement.graph.torch_import import EXPORTER_KEY, exporter_of

    torch.manual_seed(0)
    net, x = _Branchy(), torch.randn(2, 4)
    with caplog.at_level("INFO", logger="placement"):
        model = pl.from_torch(net, (x,))
    assert exporter_of(model) == "torchscript" == model.ir_model.metadata_props[EXPORTER_KEY]
    messages = [r.getMessage() for r in caplog.records]
    assert any("dynamo exporter failed on _Branchy" in m and "data-dependent" in m for m in messages)
    assert any("with the torchscript exporter" in m for m in messages)
    assert set(model.parameters) == {name for name, _ in net.named_parameters()}
    assert model.inputs == ["x"]
    scopes = {op.op_type: set() for op in model.ops}
    for op in model.ops:
        scopes[op.op_type].add(op.scope)
    assert scopes["Gemm"] == {"enc", "dec.0", "dec.2"} and scopes["Tanh"] == {"dec.1"}
    with torch.no_grad():
        for probe in (x, x + 0.1):  # inputs that take the traced branch
            want = net(probe).numpy()
            np.testing.assert_allclose(
                pl.run(model, [probe], device_map="cpu")[0], want, rtol=1e-5, atol=1e-6
            )
    saved = pl.load(pl.graph.saving.to_proto(model))
    assert exporter_of(saved) == "torchscript"


def test_an_onnxscript_too_old_for_torch_is_named_with_the_fix(monkeypatch, caplog):
    """torch 2.11's exporter imports onnxscript._framework_apis.torch_2_11 (onnxscript >= 0.6): with an
    older onnxscript every model fell back to TorchScript with an opaque ModuleNotFoundError."""
    from placement.graph import torch_import

    def old_onnxscript(*args, **kwargs):
        missing = "onnxscript._framework_apis.torch_9_99"
        raise ModuleNotFoundError(f"No module named '{missing}'", name=missing)

    monkeypatch.setattr(torch_import, "_export_dynamo", old_onnxscript)
    net, x = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), torch.randn(2, 4)
    with caplog.at_level("WARNING", logger="placement"):
        model = pl.from_torch(net, (x,))
    assert torch_import.exporter_of(model) == "torchscript"
    (warning,) = [r.getMessage() for r in caplog.records if "dynamo exporter failed" in r.getMessage()]
    assert "torch_9_99" in warning and "pip install -U onnxscript" in warning and "torch " in warning
    with pytest.raises(pl.ExportError, match="needs a newer onnxscript"):
        pl.from_torch(net, (x,), exporter="dynamo")
    assert torch_import._version_hint(RuntimeError("data-dependent")) == ""


def test_both_exporters_failing_is_one_error_quoting_both():
    class Both(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                x = x * 2
            return torch.fft.fft(x).real

    with pytest.raises(pl.ExportError) as info:
        pl.from_torch(Both(), (torch.randn(2, 4),))
    text = str(info.value)
    assert "dynamo exporter: " in text and "data-dependent" in text
    assert "TorchScript exporter: " in text and "fft" in text


def test_exporter_choice_is_checked():
    with pytest.raises(pl.ExportError, match="unknown exporter 'onnx'"):
        pl.from_torch(torch.nn.ReLU(), (torch.randn(2),), exporter="onnx")


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt", "unet"])
def test_zoo_through_the_torchscript_exporter(exported, name):
    import numpy as np

    from placement.graph.torch_import import exporter_of

    dynamo_model, net, args = exported(name)
    assert exporter_of(dynamo_model) == "dynamo"
    model = pl.from_torch(net, args, exporter="torchscript")
    assert exporter_of(model) == "torchscript"
    names = {n for n, _ in net.named_parameters(remove_duplicate=False)}
    # every parameter is one initializer under a parameter name (a tied one under either name)
    assert len(set(model.parameters) & names) == len(set(dynamo_model.parameters) & names)
    modules = {n for n, _ in net.named_modules() if n}
    scoped = [op.scope for op in model.ops if op.scope]
    assert scoped and set(scoped) <= modules
    assert {s.split(".")[0] for s in scoped} == {
        s.split(".")[0] for s in (op.scope for op in dynamo_model.ops) if s
    }
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    with torch.no_grad():
        out = net(*args)
    want = [t.numpy() for t in (out if isinstance(out, (tuple, list)) else (out,))]
    for got, ref in zip(pl.run(model, list(args)), want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


class _VarArgs(torch.nn.Module):
    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return args[0] * 2 + args[1]


def test_torchscript_exporter_keeps_dynamic_dims_of_var_positional_inputs():
    # forward(*args): torch.export wants one dynamic_shapes entry for the *args parameter
    args = (torch.randn(4, 3), torch.randn(4, 3))
    batch = torch.export.Dim("batch")
    model = pl.from_torch(
        _VarArgs(), args, dynamic_shapes=(({0: batch}, {0: batch}),), exporter="torchscript"
    )
    assert model.inputs == ["args_0", "args_1"]
    dims = [model.value(name).shape[0] for name in model.inputs]
    assert all(not isinstance(d, int) for d in dims), dims  # symbolic, not the example's 4
    (out,) = pl.run(model, [np.ones((2, 3), np.float32), np.ones((2, 3), np.float32)])
    assert out.shape == (2, 3) and np.all(out == 3)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_bias_less_conv3d_gets_no_malformed_bias(exporter):
    """onnxscript's ``aten_conv3d`` gives a bias-less Conv3d a zero bias of shape [C_out, 2]
    (torchvision's r3d_18); the import drops it, so ONNX Runtime and to_torch both run it."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv3d(3, 4, 3, padding=1, bias=False), torch.nn.ReLU())
    x = torch.randn(1, 3, 4, 5, 5)
    model = pl.from_torch(net, (x,), exporter=exporter)
    (conv,) = [op for op in model.ops if op.op_type == "Conv"]
    biases = [model.value(name) for name in conv.inputs[2:] if name]
    assert all(len(b.shape) == 1 and b.shape[0] == 4 for b in biases), [b.shape for b in biases]
    expected = net(x).detach().numpy()
    placed = pl.place_evenly(model, 2)
    (y,) = pl.run(placed, [x.numpy()], device_map="cpu")
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    lowered = pl.to_torch(placed, device_map="cpu")
    np.testing.assert_allclose(lowered(x).detach().numpy(), expected, rtol=1e-5, atol=1e-5)
