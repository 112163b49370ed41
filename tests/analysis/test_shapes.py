"""Types of blobs left unannotated, including the outputs of ONNX Runtime's own ops."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
from onnx import TensorProto, helper

import placement as pl
from placement.analysis.shapes import infer_shapes

GENAI = Path(__file__).resolve().parents[1] / "genai_files"


def test_outputs_of_ort_ops_get_their_types_from_ort_schemas():
    model = pl.load(GENAI / "llama_int4" / "model.onnx")
    for value in (
        v for op in model.ops for v in op.node.outputs if v.name not in {o.name for o in model.graph.outputs}
    ):
        value.type = None
    infer_shapes(model, force=True)
    kinds = {
        "MatMulNBits",
        "GroupQueryAttention",
        "SkipSimplifiedLayerNormalization",
        "SimplifiedLayerNormalization",
    }
    typed = [v for op in model.ops if op.op_type in kinds for v in op.node.outputs if v.name]
    assert typed and all(v.dtype == ir.DataType.FLOAT for v in typed), [(v.name, v.dtype) for v in typed]
    # and what follows them is typed again by ONNX's inference (the Mul after the Sigmoid of an MLP)
    muls = [op.node.outputs[0] for op in model.ops if op.op_type == "Mul"]
    assert muls and all(v.dtype == ir.DataType.FLOAT for v in muls)


def test_an_op_no_one_knows_stays_untyped():
    node = helper.make_node("Mystery", ["x"], ["y"], name="m", domain="example.custom")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])  # fmt: skip
    neg = helper.make_node("Neg", ["y"], ["z"], name="neg")
    graph.node.append(neg)
    graph.output[0].name = "z"
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("example.custom", 1)]
    model = pl.load(helper.make_model(graph, opset_imports=opsets, ir_version=10))
    infer_shapes(model)
    assert model.value("y").type is None
