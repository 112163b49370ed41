from __future__ import annotations

import onnx_ir as ir
import pytest

import placement as pl
from tests.graph.builders import mlp_graph


def test_single_device_model_verifies():
    pl.verify(mlp_graph(3))


def test_cross_device_edge_without_copy_names_the_op():
    model = mlp_graph(2)
    model.set_device("relu1", 1)
    with pytest.raises(pl.VerificationError, match="relu1"):
        pl.verify(model)


def test_out_of_order_ops_are_reported():
    model = mlp_graph(2)
    graph = model.graph
    relu0 = model.op("relu0").node
    graph.remove(relu0)
    graph.append(relu0)
    with pytest.raises(pl.VerificationError, match="fc1"):
        pl.verify(model, check_onnx=False)


def test_redundant_copy_is_reported():
    model = mlp_graph(1)
    relu = model.op("relu0").node
    copy = ir.Node(
        "",
        "Identity",
        relu.outputs,
        name="copy",
        num_outputs=1,
        metadata_props={"placement.copy": "dynamic", "placement.device": "cuda:0"},
    )
    copy.outputs[0].name = "relu0_out_cuda_0"
    copy.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    model.graph.append(copy)
    with pytest.raises(pl.VerificationError, match="redundant"):
        pl.verify(model)


def test_invalid_onnx_is_reported():
    model = mlp_graph(1)
    model.op("relu0").node.op_type = "NoSuchOp"
    with pytest.raises(pl.VerificationError, match="not valid ONNX"):
        pl.verify(model)
