"""Integer-quantized ops (placement.lowering.ops.quantized) against ONNX Runtime.

Each op is checked on a graph made with ``onnx.helper`` against one ORT session, exactly
for integer outputs (rounding half to even and saturation included: inputs are chosen to
land on ties and past the type's range); then whole quantized models made in the test:
``onnxruntime.quantization.quantize_dynamic`` of zoo models (gpt: MatMulInteger; unet:
ConvInteger) and a ``torch.ao`` statically quantized network exported by the TorchScript
exporter (per-channel QuantizeLinear/DequantizeLinear), each placed on two logical devices
and run with ``pl.run`` and ``pl.to_torch``, compared with plain ORT.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import placement as pl
from placement import models
from placement.lowering.ops import RULES, get_rule

RNG = np.random.default_rng(0)
NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int16): TensorProto.INT16,
    np.dtype(np.uint16): TensorProto.UINT16,
}


def _model(
    op_type: str,
    inputs: dict[str, np.ndarray],
    n_outputs: int = 1,
    *,
    domain: str = "",
    initializers: dict[str, np.ndarray] | None = None,
    out_shape: tuple[int, ...] | None = None,
    **attrs: Any,
) -> onnx.ModelProto:
    initializers = initializers or {}
    names = list(inputs) + list(initializers)
    outs = [f"y{i}" for i in range(n_outputs)]
    node = helper.make_node(op_type, names, outs, name=op_type.lower(), domain=domain, **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(k, NP_TO_ONNX[v.dtype], v.shape) for k, v in inputs.items()],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs],
        [numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    opsets = [helper.make_opsetid("", 21)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    if not domain:  # the output types from ONNX's shape inference
        inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
        inferred.update({v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.output})
        for out in model.graph.output:
            out.type.CopyFrom(inferred[out.name].type)
    else:  # ONNX has no shape inference for other domains: a float output of ``out_shape``
        for out in model.graph.output:
            out.type.CopyFrom(helper.make_tensor_type_proto(TensorProto.FLOAT, out_shape))
    return model


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _torch(model: onnx.ModelProto | pl.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    placed = model if isinstance(model, pl.Model) else pl.load(model)
    module = pl.to_torch(placed, device_map="cpu")
    with torch.no_grad():
        got = module(*[torch.from_numpy(np.array(v)) for v in feeds.values()])
    return [t.numpy() for t in (got if isinstance(got, tuple) else (got,))]


def _same(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Assert ``to_torch`` equals ORT: exactly for integers, to float32 rounding for floats."""
    want = _ort(model, feeds)
    got = _torch(model, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        if w.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * max(1.0, float(np.abs(w).max())))
        else:
            np.testing.assert_array_equal(g, w)
    return want


def _ints(dtype: Any, shape: tuple[int, ...], *, bits: int | None = None) -> np.ndarray:
    """Random integers over ``dtype``'s range (signed ones over ``bits`` bits when given)."""
    info = np.iinfo(dtype)
    low, high = (info.min, info.max) if bits is None else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return RNG.integers(low, high, size=shape, endpoint=True).astype(dtype)


#: ONNX Runtime's uint8 x int8 kernels on AVX2 CPUs without VNNI add pairs of products in
#: saturating int16 (``vpmaddubsw``), so full-range int8 weights can give an inexact ORT result;
#: the lowering is exact. Comparisons with ORT use 7-bit weights there, as ORT's
#: ``reduce_range`` does, where ORT is exact too.
WEIGHT_BITS = 7


# --- single ops ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.uint16])
@pytest.mark.parametrize("scales", ["tensor", "axis", "blocked"])
def test_quantize_linear_rounds_half_to_even_and_saturates(dtype: Any, scales: str) -> None:
    x = np.concatenate([np.arange(-6, 6, 0.5), [1e6, -1e6, 2.5, 3.5]]).astype(np.float32)
    x = np.tile(x, (4, 1))  # [4, 28]: ties (k + 0.5) at unit scale, values far past the range
    if scales == "tensor":
        scale, zero, attrs = np.array(1.0, np.float32), np.array(3, dtype), {}
    elif scales == "axis":
        scale = np.array([1.0, 0.5, 2.0, 0.25], np.float32)
        zero, attrs = np.array([0, 1, 2, 3], dtype), {"axis": 0}
    else:
        scale = np.array([[1.0, 0.5, 2.0, 4.0, 0.25, 1.0, 1.0]] * 4, np.float32)
        zero = np.zeros((4, 7), dtype)
        attrs = {"axis": 1, "block_size": 4}
    model = _model("QuantizeLinear", {"x": x}, initializers={"s": scale, "z": zero}, **attrs)
    (y,) = _same(model, {"x": x})
    if scales == "tensor":
        assert y[0, 1] == np.clip(np.round(-5.5) + 3, np.iinfo(dtype).min, None)  # a tie, to even


@pytest.mark.parametrize("scales", ["tensor", "axis"])
def test_dequantize_linear(scales: str) -> None:
    x = _ints(np.int8, (3, 5))
    if scales == "tensor":
        scale, zero, attrs = np.array(0.1, np.float32), np.array(-3, np.int8), {}
    else:
        scale, zero, attrs = np.array([0.1, 0.2, 0.3], np.float32), np.array([1, 2, 3], np.int8), {"axis": 0}
    _same(_model("DequantizeLinear", {"x": x}, initializers={"s": scale, "z": zero}, **attrs), {"x": x})


@pytest.mark.parametrize(
    "x",
    [
        np.array([[0.0, 1.0, -1.0, 2.55, -0.3]], np.float32),
        np.zeros((2, 3), np.float32),  # max == min: ONNX Runtime's scale of 1
        np.array([[1.0, 2.0, 3.0]], np.float32),  # all positive: the range is widened to 0
        RNG.normal(size=(4, 6)).astype(np.float32),
    ],
)
def test_dynamic_quantize_linear(x: np.ndarray) -> None:
    _same(_model("DynamicQuantizeLinear", {"x": x}, 3), {"x": x})


@pytest.mark.parametrize("a_type", [np.uint8, np.int8])
@pytest.mark.parametrize("b_zero", ["none", "tensor", "column"])
def test_matmul_integer(a_type: Any, b_zero: str) -> None:
    a, b = _ints(a_type, (2, 3, 17)), _ints(np.int8, (17, 5), bits=WEIGHT_BITS)
    inits: dict[str, np.ndarray] = {"b": b, "a_zero": np.array(7, a_type)}
    if b_zero == "tensor":
        inits["b_zero"] = np.array(-2, np.int8)
    elif b_zero == "column":
        inits["b_zero"] = np.arange(-2, 3).astype(np.int8)
    _same(_model("MatMulInteger", {"a": a}, initializers=inits), {"a": a})


def test_conv_integer_pads_with_the_zero_point() -> None:
    x, w = _ints(np.uint8, (1, 2, 6, 6)), _ints(np.int8, (4, 2, 3, 3), bits=WEIGHT_BITS)
    inits = {"w": w, "x_zero": np.array(128, np.uint8), "w_zero": np.array(3, np.int8)}
    model = _model("ConvInteger", {"x": x}, initializers=inits, pads=[1, 1, 1, 1], strides=[2, 1])
    _same(model, {"x": x})


def test_conv_integer_per_channel_zero_point_matches_the_definition() -> None:
    """ONNX Runtime refuses a per-channel ``w_zero_point`` (and onnx 1.17's reference
    implementation too): the definition, in exact integer numpy, is the reference."""
    x, w = _ints(np.uint8, (1, 2, 5, 5)), _ints(np.int8, (3, 2, 3, 3))
    w_zero = np.array([1, -1, 2], np.int8)
    inits = {"w": w, "x_zero": np.array(7, np.uint8), "w_zero": w_zero}
    model = _model("ConvInteger", {"x": x}, initializers=inits, pads=[1, 0, 1, 2])
    shifted = np.pad(x.astype(np.int32) - 7, [(0, 0), (0, 0), (1, 1), (0, 2)])  # pads hold x_zero
    kernels = w.astype(np.int32) - w_zero.astype(np.int32)[:, None, None, None]
    windows = np.lib.stride_tricks.sliding_window_view(shifted, (3, 3), axis=(2, 3))
    want = np.einsum("nchwij,ocij->nohw", windows, kernels)
    assert want.shape == (1, 3, 5, 5)
    np.testing.assert_array_equal(_torch(model, {"x": x})[0], want)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_qlinear_matmul(dtype: Any) -> None:
    a, b = _ints(dtype, (2, 4, 16)), _ints(dtype, (16, 3))
    inits = {
        "a_scale": np.array(0.02, np.float32),
        "a_zero": np.array(3, dtype),
        "b": b,
        "b_scale": np.array(0.01, np.float32),
        "b_zero": np.array(-1 if dtype == np.int8 else 120, dtype),
        "y_scale": np.array(0.3, np.float32),
        "y_zero": np.array(5, dtype),
    }
    _same(_model("QLinearMatMul", {"a": a}, initializers=inits), {"a": a})


@pytest.mark.parametrize("per_channel", [False, True])
def test_qlinear_conv(per_channel: bool) -> None:
    x, w = _ints(np.uint8, (2, 3, 7, 7)), _ints(np.int8, (4, 3, 3, 3), bits=WEIGHT_BITS)
    inits = {
        "x_scale": np.array(0.05, np.float32),
        "x_zero": np.array(100, np.uint8),
        "w": w,
        "w_scale": np.array([0.01, 0.02, 0.005, 0.03], np.float32)
        if per_channel
        else np.array(0.01, np.float32),
        "w_zero": np.zeros(4 if per_channel else (), np.int8),
        "y_scale": np.array(0.05, np.float32),
        "y_zero": np.array(128, np.uint8),
        "bias": RNG.integers(-2000, 2000, size=4).astype(np.int32),
    }
    model = _model("QLinearConv", {"x": x}, initializers=inits, pads=[1, 0, 1, 0], strides=[1, 2])
    (y,) = _same(model, {"x": x})
    assert {0, 255} & set(np.unique(y).tolist()), "the case should saturate somewhere"


def test_com_microsoft_matmul_integer_to_float() -> None:
    a, b = _ints(np.uint8, (3, 8)), _ints(np.int8, (8, 4), bits=WEIGHT_BITS)
    inits = {
        "b": b,
        "a_scale": np.array(0.03, np.float32),
        "b_scale": np.array([0.01, 0.02, 0.03, 0.04], np.float32),
        "a_zero": np.array(128, np.uint8),
        "b_zero": np.array([0, 1, -1, 2], np.int8),
        "bias": RNG.normal(size=4).astype(np.float32),
    }
    model = _model(
        "MatMulIntegerToFloat", {"a": a}, domain="com.microsoft", initializers=inits, out_shape=(3, 4)
    )
    _same(model, {"a": a})
    assert get_rule("MatMulIntegerToFloat", "com.microsoft") is RULES["com.microsoft::MatMulIntegerToFloat"]


def test_com_microsoft_dynamic_quantize_matmul() -> None:
    a, b = RNG.normal(size=(2, 5, 8)).astype(np.float32), _ints(np.int8, (8, 3), bits=WEIGHT_BITS)
    inits = {"b": b, "b_scale": np.array(0.05, np.float32), "b_zero": np.array(0, np.int8)}
    model = _model(
        "DynamicQuantizeMatMul", {"a": a}, domain="com.microsoft", initializers=inits, out_shape=(2, 5, 3)
    )
    _same(model, {"a": a})


# --- quantized models ---------------------------------------------------------------------


def _two_devices(model: pl.Model) -> pl.Model:
    """The model with its second half of activations on logical device 1, copies injected."""
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    assert len(model.devices) == 2
    return model


def _check_placed(path: Path, feeds: dict[str, np.ndarray], *, atol: float) -> None:
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    placed = _two_devices(pl.load(path))
    for got, ref in zip(pl.run(placed, feeds), want):
        np.testing.assert_allclose(got, ref, rtol=0, atol=atol)
    for got, ref in zip(_torch(placed, feeds), want):
        np.testing.assert_allclose(got, ref, rtol=0, atol=atol)


def _quantize_dynamic(tmp_path: Path, name: str, **options: Any) -> tuple[Path, dict[str, np.ndarray]]:
    """ORT's ``quant_pre_process`` (folds the exporter's weight transposes, so MatMuls read
    initializers) then ``quantize_dynamic`` of zoo model ``name``."""
    from onnxruntime.quantization import quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    net, inputs = models.build(name, "tiny")
    model = pl.from_torch(net, inputs)
    source, folded = tmp_path / f"{name}.onnx", tmp_path / f"{name}_folded.onnx"
    target = tmp_path / f"{name}_int8.onnx"
    model.save(source)
    quant_pre_process(str(source), str(folded), skip_symbolic_shape=True)
    quantize_dynamic(folded, target, **options)
    feeds = {value.name: t.numpy() for value, t in zip(onnx.load(target).graph.input, inputs)}
    return target, feeds


@pytest.mark.parametrize("weights", ["uint8", "int8_reduce_range"], ids=["uint8", "int8-reduce-range"])
def test_quantize_dynamic_gpt_places_and_lowers_like_ort(tmp_path: Path, weights: str) -> None:
    from onnxruntime.quantization import QuantType

    options = (
        {"weight_type": QuantType.QUInt8}
        if weights == "uint8"
        else {"weight_type": QuantType.QInt8, "reduce_range": True}
    )
    path, feeds = _quantize_dynamic(tmp_path, "gpt", **options)
    ops = [n.op_type for n in onnx.load(path).graph.node]
    assert ops.count("MatMulInteger") >= 8 and "DynamicQuantizeLinear" in ops
    _check_placed(path, feeds, atol=1e-5)


def test_quantize_dynamic_unet_conv_integer_places_and_lowers_like_ort(tmp_path: Path) -> None:
    from onnxruntime.quantization import QuantType

    path, feeds = _quantize_dynamic(
        tmp_path, "unet", op_types_to_quantize=["Conv"], weight_type=QuantType.QInt8, reduce_range=True
    )
    assert "ConvInteger" in {n.op_type for n in onnx.load(path).graph.node}
    _check_placed(path, feeds, atol=1e-5)


class _StaticQuantNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.relu = torch.nn.ReLU()
        self.fc = torch.nn.Linear(8 * 6 * 6, 10)
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv(self.quant(x)))
        return self.dequant(self.fc(torch.flatten(x, 1)))


def test_torch_ao_static_quantized_export_places_and_lowers_like_ort(tmp_path: Path) -> None:
    """torch.ao's dynamic quantization does not export (neither exporter has
    ``quantized::linear_dynamic``); its static quantization does, as per-channel QDQ."""
    torch.manual_seed(0)
    net = _StaticQuantNet().eval()
    net.qconfig = torch.ao.quantization.get_default_qconfig("fbgemm")
    prepared = torch.ao.quantization.prepare(net)
    for _ in range(4):
        prepared(torch.randn(2, 3, 6, 6))
    quantized = torch.ao.quantization.convert(prepared)
    x = torch.randn(2, 3, 6, 6)
    buffer = io.BytesIO()
    torch.onnx.export(quantized, (x,), buffer, dynamo=False, opset_version=13)
    path = tmp_path / "static_int8.onnx"
    path.write_bytes(buffer.getvalue())
    proto = onnx.load(path)
    per_axis = [
        n
        for n in proto.graph.node
        if n.op_type == "DequantizeLinear" and any(a.name == "axis" for a in n.attribute)
    ]
    assert per_axis, "the export should hold a per-channel DequantizeLinear"
    feeds = {proto.graph.input[0].name: x.numpy()}
    _check_placed(path, feeds, atol=1e-6)
    np.testing.assert_allclose(_torch(pl.load(path), feeds)[0], quantized(x).numpy(), rtol=0, atol=1e-6)
