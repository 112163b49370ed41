"""``ort_session``: sessions whose weights bypass the protobuf, handing over only what the graph reads."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

import placement as pl
from placement.graph.session import ort_session
from placement.graph.weights import SUPPLIED_LOCATION, split_weights

N = 64  # 16 KiB weights: over the threshold, so they are supplied outside the protobuf


def _model(*, unread_is_input: bool = False) -> pl.Model:
    rng = np.random.default_rng(0)
    w, unread, inner = (rng.standard_normal((N, N)).astype(np.float32) for _ in range(3))
    then_graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w"], ["t"])],  # reads the main graph's w from inside the If
        "then",
        [],
        [oh.make_tensor_value_info("t", TensorProto.FLOAT, [2, N])],
    )
    else_graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "inner"], ["e"])],
        "else",
        [],
        [oh.make_tensor_value_info("e", TensorProto.FLOAT, [2, N])],
        initializer=[numpy_helper.from_array(inner, "inner")],
    )
    nodes = [
        oh.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
        oh.make_node("Greater", ["s", "zero"], ["c"], name="greater"),
        oh.make_node("If", ["c"], ["y"], then_branch=then_graph, else_branch=else_graph, name="if"),
    ]
    inputs = [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, N])]
    if unread_is_input:
        inputs.append(oh.make_tensor_value_info("unread", TensorProto.FLOAT, [N, N]))
    graph = oh.make_graph(
        nodes,
        "g",
        inputs,
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, N])],
        initializer=[
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(unread, "unread"),
            numpy_helper.from_array(np.array(0, np.float32), "zero"),
        ],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(proto)
    return pl.load(proto, initializers_as_inputs=unread_is_input)


def test_unread_weights_are_not_supplied_and_subgraph_reads_count():
    model = _model()
    proto, weights = split_weights(model)
    assert set(weights) == {"w"}  # the If's then-branch reads it; "unread" is read by nothing
    assert [t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL] == ["w"]
    assert proto.graph.initializer[0].external_data[0].value == SUPPLIED_LOCATION
    assert "unread" in model.graph.initializers  # the model itself is not modified
    session = ort_session(model, ort.SessionOptions(), ["CPUExecutionProvider"])
    w = model.graph.initializers["w"].const_value.numpy()
    inner = model.graph.node("if").attributes["else_branch"].as_graph().initializers["inner"]
    for sign in (1, -1):
        x = np.full((2, N), sign, np.float32)
        expected = x @ (w if sign > 0 else inner.const_value.numpy())
        np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-4)


def test_an_unread_weight_that_is_a_graph_input_stays_overridable():
    model = _model(unread_is_input=True)
    _, weights = split_weights(model)
    assert set(weights) == {"w", "unread"}
    session = ort_session(model, ort.SessionOptions(), ["CPUExecutionProvider"])
    assert [i.name for i in session.get_overridable_initializers()] == ["unread"]
    x = np.ones((2, N), np.float32)
    np.testing.assert_allclose(
        session.run(None, {"x": x})[0],
        x @ model.graph.initializers["w"].const_value.numpy(),
        rtol=1e-5,
        atol=1e-4,
    )
