from __future__ import annotations

import networkx as nx
import pytest

import placement as pl
from tests.graph.builders import mlp_graph


def test_ops_blobs_parameters():
    model = mlp_graph(2)
    assert [op.name for op in model.ops] == ["fc0", "relu0", "fc1", "relu1"]
    op = model.op("fc1")
    assert op.op_type == "Gemm" and op.inputs == ("relu0_out", "fc1.weight") and op.outputs == ("fc1_out",)
    assert op.device == pl.Device("cuda", 0) and not op.is_copy and op.scope is None
    assert model.inputs == ["x"] and model.outputs == ["relu1_out"]
    assert set(model.parameters) == {"fc0.weight", "fc1.weight"}
    assert model.parameters["fc0.weight"].nbytes == 4 * 4 * 4
    assert "relu0_out" in model.blobs and "x" in model.blobs and "fc0.weight" in model.blobs


def test_set_device_and_device_of():
    model = mlp_graph(2)
    model.set_device("fc1", "cuda:1")
    model.set_device("relu1", 1)
    assert model.devices == [pl.Device("cuda", 0), pl.Device("cuda", 1)]
    assert model.device_of("fc1") == pl.Device("cuda", 1)
    assert model.device_of("fc1_out") == pl.Device("cuda", 1)
    # a parameter lives where its first consumer runs
    assert model.device_of("fc1.weight") == pl.Device("cuda", 1)
    assert model.parameters["fc1.weight"].device == pl.Device("cuda", 1)
    assert model.device_of("x") == pl.Device("cuda", 0)


def test_set_device_errors_leave_model_unchanged():
    model = mlp_graph(2)
    before = model.device_state()
    with pytest.raises(pl.UnknownOpError, match="nope"):
        model.set_device("nope", 1)
    with pytest.raises(pl.DeviceError, match="tpu"):
        model.set_device("fc0", "tpu:0")
    with pytest.raises(pl.UnknownBlobError, match="ghost"):
        model.device_of("ghost")
    assert model.device_state() == before


def test_networkx_view_and_copy():
    model = mlp_graph(3)
    g = model.to_networkx()
    assert nx.is_directed_acyclic_graph(g)
    assert list(nx.topological_sort(g))[0] == "fc0"
    assert g.edges["fc0", "relu0"]["blobs"] == ["fc0_out"]
    clone = model.copy()
    clone.set_device("fc0", 3)
    assert model.device_of("fc0") == pl.Device("cuda", 0)
    assert [op.name for op in clone.ops] == [op.name for op in model.ops]


def test_repr_mentions_devices():
    assert "cuda:0" in repr(mlp_graph(1))


def test_graph_nodes_is_the_graph_order_after_edits():
    import onnx_ir as ir

    from placement.graph.nodes import graph_nodes

    model = mlp_graph()
    graph = model.graph
    first, last = graph[0], graph[-1]
    extra = ir.Node("", "Identity", [first.outputs[0]], name="extra")
    graph.insert_after(first, extra)
    graph.remove(last, safe=False)
    assert graph_nodes(graph) == list(graph)
    # passes read these onnx_ir slots directly (see graph_nodes): fail loudly if they move
    assert {"_inputs", "_outputs", "_metadata_props", "_name"} <= set(ir.Node.__slots__)
    assert {"_name", "_shape", "_type", "_is_initializer", "_is_graph_input", "_is_graph_output"} <= set(
        ir.Value.__slots__
    )


def test_a_parameter_read_only_inside_a_subgraph_lives_on_its_ops_device():
    """A weight that only a ``Loop`` body reads belongs where the Loop runs, for the model's
    parameter table and ``device_of`` alike (not on the default device)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "W"], ["h_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [2, 2]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [2, 2]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["h0"], name="relu"),
            helper.make_node("Loop", ["M", "", "h0"], ["h"], name="loop", body=body),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2]),
            helper.make_tensor_value_info("M", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 2])],
        [numpy_helper.from_array(np.eye(2, dtype=np.float32), "W")],
    )
    model = pl.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    model.set_device("loop", 1)
    assert model.parameters["W"].device == model.device_of("W") == pl.Device.parse("cuda:1")
