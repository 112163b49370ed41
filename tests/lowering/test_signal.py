"""Signal ops (placement.lowering.ops.signal), Resize and dilated pooling against ONNX Runtime.

A spectrogram front end and an FNet-style token mixer (``DFT`` over two axes), made with
``onnx.helper``, are placed on two logical devices and run with ``pl.run`` and
``pl.to_torch``, compared with one ORT session; ``torch.fft`` exported by the dynamo exporter
lowers too. Resize and dilated AveragePool are swept over their attributes against ORT.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import placement as pl
from placement.lowering.ops.pooling import average_pool
from placement.lowering.ops.sampling import resize

RNG = np.random.default_rng(0)


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _two_devices(model: pl.Model) -> pl.Model:
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    assert len(model.devices) == 2
    return model


def _check_placed(proto: onnx.ModelProto, feeds: dict[str, np.ndarray], *, atol: float) -> None:
    want = _ort(proto, feeds)
    placed = _two_devices(pl.load(proto))
    for got, ref in zip(pl.run(placed, feeds), want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=atol)
    module = pl.to_torch(placed, device_map="cpu")
    with torch.no_grad():
        out = module(*[torch.from_numpy(v) for v in feeds.values()])
    for got, ref in zip(out if isinstance(out, tuple) else (out,), want):
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-4, atol=atol)


def _graph_model(nodes: list, inputs: list, outputs: list, inits: list) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.output}
    for out in model.graph.output:  # output types and shapes from ONNX's shape inference
        out.type.CopyFrom(inferred[out.name].type)
    onnx.checker.check_model(model)
    return model


def test_log_mel_spectrogram_places_and_lowers_like_ort() -> None:
    """STFT with a Hann window -> power -> mel filter bank -> log, on two devices."""
    c = numpy_helper.from_array
    inits = [
        c(np.array(8, np.int64), "step"),
        c(np.array(32, np.int64), "size"),
        c(np.array(10, np.int64), "mels"),
        c(np.array(32, np.int64), "dft"),
        c(np.array(8000, np.int64), "rate"),
        c(np.array(20.0, np.float32), "low"),
        c(np.array(3800.0, np.float32), "high"),
        c(np.array([-1], np.int64), "last"),
        c(np.array(1e-6, np.float32), "eps"),
        c(np.array([0], np.int64), "zero"),
        c(np.array([17], np.int64), "bins"),
        c(np.array([2], np.int64), "axis2"),
    ]
    nodes = [
        helper.make_node("HannWindow", ["size"], ["window"]),
        # two-sided, then the first 17 bins: ONNX's shape inference ignores ``onesided`` (it
        # would give the placed stages 32 bins where ORT computes 17)
        helper.make_node("STFT", ["signal", "step", "window", "size"], ["full"], onesided=0),
        helper.make_node("Slice", ["full", "zero", "bins", "axis2"], ["spec"]),
        helper.make_node("Mul", ["spec", "spec"], ["sq"]),
        helper.make_node("ReduceSum", ["sq", "last"], ["power"], keepdims=0),
        helper.make_node("MelWeightMatrix", ["mels", "dft", "rate", "low", "high"], ["bank"]),
        helper.make_node("MatMul", ["power", "bank"], ["mel"]),
        helper.make_node("Add", ["mel", "eps"], ["mel_eps"]),
        helper.make_node("Log", ["mel_eps"], ["logmel"]),
    ]
    model = _graph_model(
        nodes,
        [helper.make_tensor_value_info("signal", TensorProto.FLOAT, [2, 128, 1])],
        [helper.make_tensor_value_info("logmel", TensorProto.FLOAT, [2, 13, 10])],
        inits,
    )
    _check_placed(model, {"signal": RNG.normal(size=(2, 128, 1)).astype(np.float32)}, atol=1e-3)


def test_fnet_mixing_places_and_lowers_like_ort() -> None:
    """FNet's token mixing: the real part of a DFT over the hidden axis, then the sequence axis."""
    c = numpy_helper.from_array
    nodes = [
        helper.make_node("Unsqueeze", ["x", "minus1"], ["x1"]),
        helper.make_node("DFT", ["x1", "", "axis2"], ["f_hidden"]),
        helper.make_node("DFT", ["f_hidden", "", "axis1"], ["f_both"]),
        helper.make_node("Gather", ["f_both", "zero"], ["real"], axis=-1),
        helper.make_node("Add", ["real", "x"], ["y"]),
    ]
    inits = [
        c(np.array([-1], np.int64), "minus1"),
        c(np.array(2, np.int64), "axis2"),
        c(np.array(1, np.int64), "axis1"),
        c(np.array(0, np.int64), "zero"),
    ]
    model = _graph_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 8])],
        [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)],
        inits,
    )
    _check_placed(model, {"x": RNG.normal(size=(2, 6, 8)).astype(np.float32)}, atol=1e-4)


@pytest.mark.parametrize(("inverse", "onesided"), [(0, 0), (0, 1), (1, 0)])
def test_dft_matches_ort(inverse: int, onesided: int) -> None:
    """Forward, one-sided forward and inverse DFT (ONNX Runtime has no one-sided inverse; the
    node suite's ``test_dft_irfft`` checks that one against ONNX's reference)."""
    x = RNG.normal(size=(3, 10, 2 if inverse else 1)).astype(np.float32)
    nodes = [  # the Neg gives the second device an op
        helper.make_node("DFT", ["x", "n", "axis"], ["d"], inverse=inverse, onesided=onesided),
        helper.make_node("Neg", ["d"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(12, np.int64), "n"),
        numpy_helper.from_array(np.array(1, np.int64), "axis"),
    ]
    model = _graph_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)],
        inits,
    )
    _check_placed(model, {"x": x}, atol=1e-4)


def test_torch_fft_export_lowers() -> None:
    """``torch.fft.rfft`` through the dynamo exporter becomes ``DFT``; the lowering equals eager."""

    class Spectrum(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.fft.rfft(x, dim=-1).abs()

    x = torch.randn(2, 16)
    model = pl.from_torch(Spectrum(), (x,))
    assert "DFT" in {op.op_type for op in model.ops}
    module = pl.to_torch(model, device_map="cpu")
    torch.testing.assert_close(module(x), Spectrum()(x), rtol=1e-5, atol=1e-5)


# --- Resize and dilated pooling, swept against ORT ----------------------------------------------


def _single(op_type: str, x: np.ndarray, inputs: list[str], inits: list, **attrs: object) -> onnx.ModelProto:
    node = helper.make_node(op_type, ["x", *inputs], ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize("mode", ["linear", "cubic", "nearest"])
def test_resize_matches_ort(mode: str) -> None:
    x = RNG.normal(size=(1, 2, 9, 7)).astype(np.float32)
    modes = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric",
             "tf_crop_and_resize"]  # fmt: skip
    checked = 0
    for antialias, ctm, scale in itertools.product([0, 1], modes, [0.4, 0.75, 1.6]):
        if mode == "nearest" and antialias:
            continue
        scales = np.array([1, 1, scale, scale * 0.9], np.float32)
        crop = ctm == "tf_crop_and_resize"
        roi = np.array([0, 0, 0.1, 0.2, 1, 1, 0.8, 0.9] if crop else [], np.float32)
        attrs = dict(mode=mode, antialias=antialias, coordinate_transformation_mode=ctm)
        attrs.update(extrapolation_value=0.5, exclude_outside=1) if crop and mode == "cubic" else None
        inits = [numpy_helper.from_array(roi, "roi"), numpy_helper.from_array(scales, "scales")]
        (want,) = _ort(_single("Resize", x, ["roi", "scales"], inits, **attrs), {"x": x})
        got = resize(torch.from_numpy(x), torch.from_numpy(roi), scales.tolist(), None, **attrs).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str((attrs, scale)))
        checked += 1
    assert checked >= 18


def test_dilated_average_pool_matches_ort() -> None:
    """Dilated windows with floor and ceil output lengths (a ceiled window needing 2+ extra
    elements at the end), asymmetric pads, with and without counting the padding."""
    checked = 0
    for k, s, d, (pb, pe), ceil, count_pad in itertools.product(
        [2, 3], [2, 3], [2, 3], [(0, 0), (1, 0), (0, 2)], [0, 1], [0, 1]
    ):
        if pb >= k or pe >= k:
            continue
        x = RNG.normal(size=(1, 2, 7, 6)).astype(np.float32)
        attrs = dict(kernel_shape=[k, k], strides=[s, s], dilations=[d, 1], pads=[pb, 0, pe, pb],
                     ceil_mode=ceil, count_include_pad=count_pad)  # fmt: skip
        (want,) = _ort(_single("AveragePool", x, [], [], **attrs), {"x": x})
        got = average_pool(torch.from_numpy(x), **attrs).numpy()
        assert got.shape == want.shape, attrs
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(attrs))
        checked += 1
    assert checked >= 60
