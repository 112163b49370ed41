"""``pl.to_torch``: placed zoo models lowered to torch give the original outputs and gradients."""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

import placement as pl

MODEL_NAMES = ["mlp", "resnet", "gpt", "unet"]
HAS_CUDA = torch.cuda.is_available()
#: Where two logical devices share one physical device in these tests.
SHARED = "cuda:0" if HAS_CUDA else "cpu"
TOL = {"rtol": 1e-4, "atol": 1e-4}


def place(model: pl.Model, how: str, devices: int, *, seed: int = 0, copies: bool = True) -> pl.Model:
    """Place ``model`` on ``devices`` logical GPUs: Caffe2 shift slices or random ops."""
    if how == "shift":
        pl.place_evenly(model, devices, copies=False)
    else:
        rng = random.Random(seed)
        for op in model.ops:
            model.set_device(op.name, rng.randrange(devices))
    if copies:
        pl.inject_cross_device_copies(model)
        pl.verify(model)
    return model


def expected_outputs(net: torch.nn.Module, args: tuple) -> torch.Tensor:
    with torch.no_grad():
        return net(*args)


def run(module: torch.nn.Module, args: tuple) -> torch.Tensor:
    with torch.no_grad():
        return module(*args).cpu()


# --- equality with the original torch module ------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize(("how", "devices"), [("shift", 2), ("shift", 4), ("random", 2), ("random", 4)])
def test_placed_zoo_model_matches_torch(exported, name: str, how: str, devices: int):
    model, net, args = exported(name)
    place(model, how, devices, seed=devices)
    expected = expected_outputs(net, args)
    assert len(model.devices) > 1
    for device_map in ("auto", {d: SHARED for d in model.devices}):
        module = pl.to_torch(model, device_map=device_map)
        torch.testing.assert_close(run(module, args), expected, **TOL)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_cross_device_edges_without_copies(exported, name: str):
    model, net, args = exported(name)
    place(model, "random", 3, seed=7, copies=False)
    module = pl.to_torch(model, device_map={d: SHARED for d in model.devices})
    torch.testing.assert_close(run(module, args), expected_outputs(net, args), **TOL)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_placements_of_gpt(exported, data):
    model, net, args = exported("gpt")
    devices = data.draw(st.lists(st.integers(0, 3), min_size=len(model.ops), max_size=len(model.ops)))
    for op, device in zip(model.ops, devices):
        model.set_device(op.name, device)
    pl.inject_cross_device_copies(model)
    pl.verify(model, check_onnx=False)
    module = pl.to_torch(model, device_map={d: SHARED for d in model.devices})
    torch.testing.assert_close(run(module, args), expected_outputs(net, args), **TOL)


def test_single_device_unplaced_model(exported):
    model, net, args = exported("resnet")
    module = pl.to_torch(model)
    torch.testing.assert_close(run(module, args), expected_outputs(net, args), **TOL)


# --- the module: code, parameters, buffers, calling convention --------------------------------


def test_module_code_and_parameters(exported):
    model, net, args = exported("mlp")
    place(model, "shift", 2)
    module = pl.to_torch(model, device_map="cpu")
    assert isinstance(module, torch.fx.GraphModule)
    code = module.code
    copies = [op.outputs[0] for op in model.ops if op.is_copy]
    assert copies and all(f"{name} = " in code for name in copies)
    assert "non_blocking = True" in code and ".to('cpu'" in code
    names = {name for name, _ in module.named_parameters()}
    assert names == {name for name, _ in net.named_parameters()}
    for name, param in module.named_parameters():
        assert isinstance(param, torch.nn.Parameter) and param.requires_grad
        torch.testing.assert_close(param.detach(), net.get_parameter(name).detach())
    assert module.initializer_paths["fc1.weight"] == "fc1.weight"
    assert module.device_map == {"cuda:0": "cpu", "cuda:1": "cpu"}
    assert module.input_names == model.inputs and module.output_names == model.outputs


def test_batchnorm_statistics_are_buffers_and_shape_arithmetic_is_folded(exported):
    model, _, _ = exported("resnet")
    module = pl.to_torch(model, device_map="cpu")
    params = {name for name, _ in module.named_parameters()}
    buffers = {name for name, _ in module.named_buffers()}
    assert "bn1.running_mean" in buffers and "bn1.running_var" in buffers
    assert "bn1.weight" in params and not any("running" in p for p in params)
    int_constants = [n for n, p in model.parameters.items() if p.dtype == "INT64"]
    assert int_constants and not set(int_constants) & (params | buffers)  # folded and inlined
    assert "reshape(" in module.code  # Reshape with a constant shape, inlined


def test_state_dict_deepcopy_and_pickle(exported):
    import copy
    import io

    model, net, args = exported("gpt")
    place(model, "shift", 2)
    module = pl.to_torch(model, device_map="cpu")
    # the state is the model's initializers; folded constants are rebuilt by lowering
    assert set(module.state_dict()) <= set(model.parameters)
    tied = {"wte.weight"}  # shared with lm_head.weight, which names it in ONNX
    assert set(module.state_dict()) >= {name for name, _ in net.named_parameters()} - tied
    clone = copy.deepcopy(module)
    assert clone.initializer_paths == module.initializer_paths and clone.device_map == module.device_map
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (clone, loaded):
        torch.testing.assert_close(run(other, args), run(module, args), rtol=0, atol=0)


def test_outputs_on_output_device_and_inputs_moved(exported):
    model, net, args = exported("mlp")
    place(model, "shift", 2)
    module = pl.to_torch(model, device_map="cpu")
    out = module(*args)
    assert out.device.type == "cpu"
    assert "input_on_cpu" in module.code or "_on_cpu" in module.code


def test_logical_cpu_output_device(exported):
    model, net, args = exported("resnet")
    place(model, "shift", 2)
    pl.inject_cross_device_copies(model, output_device="cpu")
    assert pl.Device("cpu") in model.devices
    module = pl.to_torch(model, device_map={"cpu": "cpu", 0: SHARED, 1: SHARED})
    out = module(*args)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out.detach(), expected_outputs(net, args), **TOL)


def _two_output_model() -> pl.Model:
    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(4, 8)
            self.a = torch.nn.Linear(8, 2)
            self.b = torch.nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.relu(self.body(x)) * scale
            return self.a(h), self.b(h).softmax(-1)

    torch.manual_seed(0)
    net = TwoHeads().eval()
    args = (torch.randn(5, 4), torch.rand(5, 1))
    return pl.from_torch(net, args), net, args


def test_several_outputs_are_a_tuple_and_inputs_work_by_name():
    model, net, args = _two_output_model()
    model.set_device(model.ops[-1].name, 1)
    pl.inject_cross_device_copies(model)
    module = pl.to_torch(model, device_map={0: SHARED, 1: SHARED})
    out = module(*[a.to(SHARED) for a in args])
    assert isinstance(out, tuple) and len(out) == 2
    for got, want in zip(out, net(*args)):
        torch.testing.assert_close(got.detach().cpu(), want.detach(), **TOL)
    by_name = module(**{name: a for name, a in zip(module.input_names, args)})
    torch.testing.assert_close(by_name[0].detach().cpu(), out[0].detach().cpu())


def _model(nodes, inputs, outputs, initializers=(), opset: int = 21, extra_opsets=()) -> pl.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    opsets = [helper.make_opsetid("", opset), *extra_opsets]
    return pl.load(helper.make_model(graph, opset_imports=opsets))


def _info(name: str, shape, dtype=onnx.TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def test_awkward_initializer_names_are_mapped():
    names = ["weird::name/0", "training", "a", "a.b", "blocks.0.forward"]
    inits = [onnx.numpy_helper.from_array(np.full(2, i + 1, np.float32), n) for i, n in enumerate(names)]
    nodes, prev = [], "x"
    for i, name in enumerate(names):
        nodes.append(helper.make_node("Add", [prev, name], [f"h{i}"], name=f"add{i}"))
        prev = f"h{i}"
    model = _model(nodes, [_info("x", [2])], [_info(prev, [2])], inits)
    module = pl.to_torch(model, device_map="cpu")
    assert module(torch.zeros(2)).tolist() == [15.0, 15.0]
    paths = module.initializer_paths
    assert set(paths) == set(names)
    assert len(set(paths.values())) == len(names)
    for name, path in paths.items():
        assert module.get_parameter(path).detach()[0].item() == names.index(name) + 1
    assert paths["a.b"] == "a.b" or paths["a"] == "a"


# --- errors ---------------------------------------------------------------------------------


def test_unsupported_ops_and_attributes_are_named_in_one_error():
    resize = helper.make_node("Resize", ["x", "", "sc"], ["y"], name="resize_area", mode="area")
    nodes = [
        resize,
        helper.make_node("ImageDecoder", ["y"], ["u"], name="decode_1"),
        helper.make_node("ImageDecoder", ["u"], ["u2"], name="decode_2"),
        helper.make_node("Foo", ["x"], ["f"], name="foo_1", domain="my.domain"),
    ]
    inits = [onnx.numpy_helper.from_array(np.ones(2, np.float32), "sc")]
    model = _model(
        nodes,
        [_info("x", [2, 3])],
        [_info("u2", [2, 3]), _info("f", [2, 3])],
        inits,
        extra_opsets=[helper.make_opsetid("my.domain", 1)],
    )
    with pytest.raises(pl.LoweringError) as info:
        pl.to_torch(model, device_map="cpu")
    message = str(info.value)
    expected = [
        "ImageDecoder", "'decode_1'", "2 ops", "my.domain::Foo", "'foo_1'",
        "Resize: mode='area'", "'resize_area'",
    ]  # fmt: skip
    for part in expected:
        assert part in message


@pytest.mark.parametrize("name", ["resnet", "gpt"])
def test_old_opset_zoo_model_is_converted(name: str):
    """An opset-9 file (TorchScript exporter, as older tools write them) is converted, not refused."""
    import io

    from placement.models import build

    net, args = build(name, "tiny")
    net.eval()
    buffer = io.BytesIO()
    torch.onnx.export(net, args, buffer, dynamo=False, opset_version=9)
    proto = onnx.load_from_string(buffer.getvalue())
    model = pl.load(proto)
    assert model.graph.opset_imports[""] == 9
    model.set_device(model.ops[-1].name, 1)
    module = pl.to_torch(model, device_map="cpu")
    assert model.graph.opset_imports[""] == 9  # the user's model is left as it was
    assert model.ops[-1].device == pl.Device("cuda", 1)
    torch.testing.assert_close(run(module, args), expected_outputs(net, args), **TOL)


def test_unconvertible_old_opset_is_one_error():
    old = _model(
        [
            helper.make_node("Relu", ["x"], ["y"]),
            helper.make_node("MaxRoiPool", ["y", "y"], ["u"], name="roipool", pooled_shape=[1, 1]),
        ],
        [_info("x", [2])],
        [_info("u", [2])],
        opset=11,
    )
    old.graph.opset_imports[""] = 0  # no converter adapters from here
    with pytest.raises(pl.LoweringError, match="opset 0 could not be converted.*MaxRoiPool"):
        pl.to_torch(old, device_map="cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_half_precision_zoo_models(name: str, dtype: torch.dtype):
    from placement.models import build

    net, args = build(name, "tiny")
    net = net.to(dtype).eval()
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    model = pl.from_torch(net, args)
    place(model, "shift", 2)
    module = pl.to_torch(model, device_map="cpu")
    got = run(module, args)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected_outputs(net, args), rtol=2e-2, atol=2e-2)
    assert all(p.dtype == dtype for p in module.parameters())


def test_bad_device_map(exported):
    model, _, _ = exported("mlp")
    place(model, "shift", 2)
    with pytest.raises(pl.DeviceError, match="cuda:5"):
        pl.to_torch(model, device_map={0: "cpu", 1: "cpu", 5: "cpu"})
    with pytest.raises(pl.DeviceError, match="cuda:1"):
        pl.to_torch(model, device_map={0: "cpu"})
    with pytest.raises(TypeError):
        pl.to_torch(object())  # type: ignore[arg-type]


# --- autograd ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_gradients_match_the_original_module(exported, name: str):
    model, net, args = exported(name)
    place(model, "shift", 2)
    module = pl.to_torch(model, device_map={d: SHARED for d in model.devices})
    torch.manual_seed(0)
    weights = torch.randn_like(expected_outputs(net, args))
    net.zero_grad()
    (net(*args) * weights).sum().backward()
    (module(*args).cpu() * weights).sum().backward()
    originals = dict(net.named_parameters(remove_duplicate=False))
    compared = 0
    for onnx_name, path in module.initializer_paths.items():
        if onnx_name not in originals:
            continue
        try:
            param = module.get_parameter(path)
        except AttributeError:  # a buffer
            continue
        torch.testing.assert_close(param.grad.cpu(), originals[onnx_name].grad, rtol=1e-3, atol=1e-4)
        compared += 1
    net.zero_grad()
    assert compared >= len(list(net.parameters())) - 1


def test_training_a_placed_model_across_two_devices(exported):
    model, _, args = exported("mlp")
    place(model, "shift", 2)
    devices_of = {p.name: p.device for p in model.parameters.values()}
    assert len(set(devices_of.values())) == 2
    module = pl.to_torch(model, device_map={d: SHARED for d in model.devices})
    module.train()
    torch.manual_seed(1)
    x = args[0].to(SHARED)
    target = torch.randn_like(module(x))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x), target)
        loss.backward()
        losses.append(loss.item())
        for onnx_name, path in module.initializer_paths.items():
            assert module.get_parameter(path).grad is not None, (onnx_name, devices_of[onnx_name])
        optimizer.step()
    assert losses[-1] < losses[0] * 0.9


def test_training_gpt_updates_tied_weights_once(exported):
    model, _, (idx,) = exported("gpt")
    place(model, "shift", 2)
    module = pl.to_torch(model, device_map={d: SHARED for d in model.devices})
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        logits = module(idx.to(SHARED))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.to(logits.device).flatten())
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    assert losses[-1] < losses[0]


# --- real GPUs ------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_and_cpu_split(exported):
    model, net, args = exported("gpt")
    place(model, "shift", 2)
    module = pl.to_torch(model, device_map={0: "cuda:0", 1: "cpu"})
    devices = {p.device.type for p in module.parameters()}
    assert devices == {"cuda", "cpu"}
    assert ".to('cpu')" in module.code  # GPU -> CPU copies block
    assert ".to('cuda:0', non_blocking = True)" in module.code
    torch.testing.assert_close(run(module, args), expected_outputs(net, args), **TOL)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_auto_map_uses_the_gpu(exported):
    model, net, args = exported("resnet")
    module = pl.to_torch(model)  # one logical device, cuda:0
    assert {p.device.type for p in module.parameters()} == {"cuda"}
    torch.testing.assert_close(run(module, args), expected_outputs(net, args), **TOL)


@pytest.mark.parametrize("slope_shape", [(3,), (1,), (1, 3, 4, 4)])
def test_opset6_prelu_channel_slope_is_refused_at_lowering(slope_shape):
    """PRelu-6 defines no broadcast for a per-channel slope (ONNX Runtime has no PRelu-6 kernel):
    the lowering refuses it, naming the op and the input, instead of broadcasting another way."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 4, 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3, 4, 4])
    slope = onnx.numpy_helper.from_array(np.full(slope_shape, 0.25, np.float32), "slope")
    graph = helper.make_graph(
        [helper.make_node("PRelu", ["x", "slope"], ["y"], name="act")], "g", [x], [y], [slope]
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)])
    proto.ir_version = 7
    if slope_shape == (3,):
        with pytest.raises(pl.LoweringError, match=r"'act' \(PRelu, opset 6\): input 'slope'"):
            pl.to_torch(pl.load(proto), device_map="cpu")
        return
    module = pl.to_torch(pl.load(proto), device_map="cpu")
    x_value = torch.linspace(-1, 1, 48).reshape(1, 3, 4, 4)
    torch.testing.assert_close(module(x_value), torch.where(x_value < 0, 0.25 * x_value, x_value))
