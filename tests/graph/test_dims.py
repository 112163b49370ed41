"""Dimensions written as ``-1`` (off the ONNX spec) are read as dynamic, as ONNX Runtime reads them."""

from __future__ import annotations

import os
import tempfile
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

import placement as pl
from placement.graph.dims import dynamic_negative_dims

F = 3


def negative_model(*, loop: bool = True) -> onnx.ModelProto:
    """``y = tanh(tanh(x @ w + ones_like(x @ w))) @ w`` over ``x: [-1, 3]``; ``-1`` also in a
    value_info and in the shapes of the ``Loop`` body that applies the tanh twice (without
    ``loop``, no tanh). The ones come from ``Shape`` -> ``ConstantOfShape``, a shape the torch
    lowering folds."""
    w = numpy_helper.from_array(np.linspace(-1, 1, F * F, dtype=np.float32).reshape(F, F), "w")
    body = oh.make_graph(
        [
            oh.make_node("Identity", ["cond"], ["cond_out"]),
            oh.make_node("Tanh", ["carried"], ["next"]),
        ],
        "body",
        [
            oh.make_tensor_value_info("i", TensorProto.INT64, []),
            oh.make_tensor_value_info("cond", TensorProto.BOOL, []),
            oh.make_tensor_value_info("carried", TensorProto.FLOAT, [-1, F]),
        ],
        [
            oh.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            oh.make_tensor_value_info("next", TensorProto.FLOAT, [-1, F]),
        ],
    )
    nodes = [
        oh.make_node("MatMul", ["x", "w"], ["h"], name="mm0"),
        oh.make_node("Shape", ["h"], ["s"], name="shape"),
        oh.make_node(
            "ConstantOfShape",
            ["s"],
            ["ones"],
            name="ones",
            value=numpy_helper.from_array(np.array([1.0], np.float32)),
        ),
        oh.make_node("Add", ["h", "ones"], ["a"], name="add"),
        oh.make_node("Loop", ["trips", "", "a"], ["t"], name="loop", body=body),
        oh.make_node("MatMul", ["t", "w"], ["y"], name="mm1"),
    ]
    if not loop:  # ONNX's shape inference cannot tell the Loop keeps the batch: micro-batches need that
        nodes[-2:] = [oh.make_node("MatMul", ["a", "w"], ["y"], name="mm1")]
    graph = oh.make_graph(
        nodes,
        "negative",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [-1, F])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [-1, F])],
        initializer=[w, numpy_helper.from_array(np.array(2, np.int64), "trips")],
        value_info=[oh.make_tensor_value_info("h", TensorProto.FLOAT, [-1, F])],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=10)


def plain_ort(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]


def load_quietly(proto: onnx.ModelProto) -> pl.Model:
    with pytest.warns(UserWarning, match="off the ONNX spec"):
        return pl.load(proto)


def test_load_warns_once_naming_each_negative_dimension():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = pl.load(negative_model())
    messages = [str(w.message) for w in caught if "off the ONNX spec" in str(w.message)]
    assert len(messages) == 1
    assert "'x' dimension 0 = -1" in messages[0] and "'y' dimension 0 = -1" in messages[0]
    assert "'h' dimension 0 = -1" in messages[0] and "'carried' dimension 0 = -1" in messages[0]
    assert caught[0].filename == __file__  # points at the caller, not inside the library
    (x,) = model.graph.inputs
    assert isinstance(x.shape[0], ir.SymbolicDim) and x.shape[0].value == "x_dim0" and x.shape[1] == F
    body = model.graph.node("loop").attributes["body"].as_graph()
    assert all(
        not isinstance(d, int) or d >= 0
        for v in [*body.inputs, *body.outputs, *model.graph.outputs]
        if v.shape is not None
        for d in v.shape
    )
    # the rewritten model is on the spec: saved and loaded again, no warning
    path = os.path.join(tempfile.mkdtemp(), "m.onnx")
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = pl.load(path)
    assert str(again.graph.inputs[0].shape) == str(x.shape)


def test_models_on_the_spec_are_untouched_and_warn_nothing():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", 3]))
    relu = ir.Node("", "Relu", [x], name="relu", num_outputs=1)
    relu.outputs[0].name = "y"
    graph = ir.Graph([x], relu.outputs, nodes=[relu], opset_imports={"": 20})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dynamic_negative_dims(ir.Model(graph, ir_version=10)) == []
    assert str(x.shape) == "[batch,3]"


def test_new_symbols_do_not_clash_with_the_models_own():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([-1, "x_dim0"]))
    graph = ir.Graph([x], [x], nodes=[], opset_imports={"": 20})
    with pytest.warns(UserWarning, match="'x' dimension 0"):
        assert dynamic_negative_dims(ir.Model(graph, ir_version=10)) == [("x", 0)]
    assert [d.value for d in x.shape] == ["x_dim0_2", "x_dim0"]


@pytest.mark.parametrize("batch", [1, 5])
def test_runner_and_to_torch_take_any_size(batch: int):
    proto = negative_model()
    x = np.random.default_rng(batch).standard_normal((batch, F)).astype(np.float32)
    expected = plain_ort(proto, x)
    model = load_quietly(proto)
    model.set_device("loop", 1)
    model.set_device("mm1", 1)
    np.testing.assert_allclose(pl.run(model, {"x": x})[0], expected, rtol=1e-5, atol=1e-6)
    module = pl.to_torch(model, device_map="cpu")
    got = module(torch.from_numpy(x))
    got = got[0] if isinstance(got, (tuple, list)) else got
    np.testing.assert_allclose(got.detach().numpy(), expected, rtol=1e-5, atol=1e-6)


def test_planners_and_micro_batches():
    proto = negative_model(loop=False)
    x = np.random.default_rng(0).standard_normal((4, F)).astype(np.float32)
    expected = plain_ort(proto, x)
    model = load_quietly(proto)
    pl.auto_place(model, devices=2, cost="flops")
    np.testing.assert_allclose(pl.run(model, {"x": x})[0], expected, rtol=1e-5, atol=1e-6)
    timed = load_quietly(proto)
    # without a sample the dynamic size is timed at its planned size (1 here)
    pl.auto_place(load_quietly(proto), devices=2, cost="time", repeats=1)
    pl.auto_place(timed, devices=2, cost="time", sample_inputs={"x": x}, repeats=1)
    runner = pl.Runner(timed, chunks=2)
    np.testing.assert_allclose(runner.run({"x": x})[0], expected, rtol=1e-5, atol=1e-6)
