"""``com.microsoft::DynamicQuantizeLSTM`` (placement.lowering.ops.quantized_recurrent) against
ONNX Runtime, on tiny graphs made with ``onnx.helper``: int8 and uint8 weights, per-tensor and
per-column scales, forward, reverse and bidirectional, with biases, initial states and
peepholes; and a small stack (quantized LSTM then a float MatMul) placed on two devices."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import placement as pl
from placement.errors import LoweringError
from placement.lowering.ops.quantized_recurrent import dynamic_quantize_lstm

SEQ, BATCH, INPUT, HIDDEN = 5, 2, 3, 4


def _qlstm_model(
    direction: str, *, signed: bool, per_column: bool, extras: bool, rng: np.random.Generator
) -> onnx.ModelProto:
    dirs = 2 if direction == "bidirectional" else 1
    wtype = np.int8 if signed else np.uint8
    low, high = (-127, 128) if signed else (0, 256)
    scale_shape = (dirs, 4 * HIDDEN) if per_column else (dirs,)
    zero = np.zeros(scale_shape, wtype) if signed else np.full(scale_shape, 128, wtype)
    inits = {
        "W": rng.integers(low, high, (dirs, INPUT, 4 * HIDDEN)).astype(wtype),
        "R": rng.integers(low, high, (dirs, HIDDEN, 4 * HIDDEN)).astype(wtype),
        "B": rng.standard_normal((dirs, 8 * HIDDEN)).astype(np.float32) * 0.1 if extras else None,
        "initial_h": rng.standard_normal((dirs, BATCH, HIDDEN)).astype(np.float32) if extras else None,
        "initial_c": rng.standard_normal((dirs, BATCH, HIDDEN)).astype(np.float32) if extras else None,
        "P": rng.standard_normal((dirs, 3 * HIDDEN)).astype(np.float32) * 0.1 if extras else None,
        "W_scale": rng.uniform(0.005, 0.02, scale_shape).astype(np.float32),
        "W_zero_point": zero,
        "R_scale": rng.uniform(0.005, 0.02, scale_shape).astype(np.float32),
        "R_zero_point": zero.copy(),
    }
    order = [
        "W",
        "R",
        "B",
        "",
        "initial_h",
        "initial_c",
        "P",
        "W_scale",
        "W_zero_point",
        "R_scale",
        "R_zero_point",
    ]
    names = ["X"] + [n if n and inits[n] is not None else "" for n in order]
    node = helper.make_node(
        "DynamicQuantizeLSTM",
        names,
        ["Y", "Y_h", "Y_c"],
        domain="com.microsoft",
        direction=direction,
        hidden_size=HIDDEN,
    )
    graph = helper.make_graph(
        [node],
        "qlstm",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [SEQ, BATCH, INPUT])],
        [
            helper.make_tensor_value_info("Y", TensorProto.FLOAT, [SEQ, dirs, BATCH, HIDDEN]),
            helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, [dirs, BATCH, HIDDEN]),
            helper.make_tensor_value_info("Y_c", TensorProto.FLOAT, [dirs, BATCH, HIDDEN]),
        ],
        [numpy_helper.from_array(v, k) for k, v in inits.items() if v is not None],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize(
    "signed, per_column, extras", [(True, False, False), (False, True, True), (True, True, True)]
)
def test_dynamic_quantize_lstm_matches_ort(
    direction: str, signed: bool, per_column: bool, extras: bool
) -> None:
    rng = np.random.default_rng(7)
    model = _qlstm_model(direction, signed=signed, per_column=per_column, extras=extras, rng=rng)
    feeds = {"X": rng.standard_normal((SEQ, BATCH, INPUT)).astype(np.float32)}
    want = _ort(model, feeds)
    module = pl.to_torch(pl.load(model))
    got = module(torch.from_numpy(feeds["X"]))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.detach().numpy(), w, rtol=0, atol=2e-5)


def test_dynamic_quantize_lstm_placed_on_two_devices() -> None:
    """Quantized LSTM feeding a float MatMul, split over two logical devices."""
    rng = np.random.default_rng(3)
    model = _qlstm_model("bidirectional", signed=True, per_column=False, extras=True, rng=rng)
    graph = model.graph
    proj = rng.standard_normal((HIDDEN, 3)).astype(np.float32)
    graph.initializer.append(numpy_helper.from_array(proj, "proj"))
    graph.node.append(helper.make_node("MatMul", ["Y", "proj"], ["Z"]))
    graph.output.append(helper.make_tensor_value_info("Z", TensorProto.FLOAT, [SEQ, 2, BATCH, 3]))
    feeds = {"X": rng.standard_normal((SEQ, BATCH, INPUT)).astype(np.float32)}
    want = _ort(model, feeds)
    placed = pl.load(model)
    acts = pl.get_activation_blobs(placed)
    pl.shift_activation_devices(placed, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(placed)
    got = pl.to_torch(placed)(torch.from_numpy(feeds["X"]))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.detach().numpy(), w, rtol=0, atol=2e-5)


def test_dynamic_quantize_lstm_refuses_sequence_lens() -> None:
    x = torch.zeros(2, 1, 2)
    w = torch.zeros(1, 2, 8, dtype=torch.int8)
    r = torch.zeros(1, 2, 8, dtype=torch.int8)
    scale, zero = torch.tensor([0.1]), torch.tensor([0], dtype=torch.int8)
    with pytest.raises(LoweringError, match="sequence_lens"):
        dynamic_quantize_lstm(x, w, r, None, torch.tensor([2]), None, None, None, scale, zero, scale, zero)
