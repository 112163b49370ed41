"""Shape inference keeps sequence types whole (placement.graph.inference), in from_torch's pipeline too."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, TypeProto, helper

import placement as pl
from placement.graph import torch_import
from placement.graph.inference import infer_types


def _sequence_loop(*, typed_body: bool = True) -> ir.Model:
    """``SequenceEmpty -> Loop`` (the sequence loop-carried, one insert per step) ->
    ``ConcatFromSequence``, as torch's exporter writes a list built in a loop; the values
    outside the body carry no type, as the exporter leaves them, and without ``typed_body``
    neither do the body's sequence input and output (as torch 2.11's exporter writes
    ``as_strided``'s loop)."""

    def seq(name: str, dtype: int, shape: list[int]) -> Any:
        if typed_body:
            return helper.make_tensor_sequence_value_info(name, dtype, shape)
        return helper.make_value_info(name, TypeProto())

    body = helper.make_graph(
        [
            helper.make_node("SequenceInsert", ["seq_in", "x"], ["seq_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            seq("seq_in", TensorProto.FLOAT, [2, 3]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            seq("seq_out", TensorProto.FLOAT, [2, 3]),
        ],
    )
    constant = helper.make_tensor
    graph = helper.make_graph(
        [
            helper.make_node("SequenceEmpty", [], ["one_seq"], dtype=TensorProto.FLOAT, name="n4"),
            helper.make_node("Constant", [], ["trips"], value=constant("trips", TensorProto.INT64, [], [3])),
            helper.make_node("Constant", [], ["go"], value=constant("go", TensorProto.BOOL, [], [True])),
            helper.make_node("Loop", ["trips", "go", "one_seq"], ["seq_final"], body=body, name="loop"),
            helper.make_node("ConcatFromSequence", ["seq_final"], ["y"], axis=0),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 3])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return ir.serde.deserialize_model(proto)


def test_sequence_loop_carried_value_keeps_its_sequence_type():
    model = _sequence_loop()
    assert infer_types(model)
    types = {v.name: v.type for node in model.graph for v in node.outputs}
    assert isinstance(types["one_seq"], ir.SequenceType), types["one_seq"]
    assert isinstance(types["seq_final"], ir.SequenceType), types["seq_final"]
    assert types["y"] == ir.TensorType(ir.DataType.FLOAT)


def test_from_torch_pipeline_gives_onnx_runtime_a_sequence():
    """from_torch's fold-and-infer step, then the ORT runner and the torch lowering."""
    ir_model = _sequence_loop()
    torch_import._fold_shape_arithmetic(ir_model)
    model = pl.load(ir_model)
    assert isinstance(model.value("one_seq").type, ir.SequenceType)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (y,) = pl.run(model, [x], device_map="cpu")
    np.testing.assert_array_equal(y, np.concatenate([x, x, x]))


def test_untyped_loop_body_sequences_become_sequences():
    """The body's loop-carried sequence gets the sequence type, not the tensor type onnx_ir's
    merge would give it (ORT: "Type mismatch. Current=1 Input=4" on the Loop)."""
    ir_model = _sequence_loop(typed_body=False)
    torch_import._fold_shape_arithmetic(ir_model)
    loop = next(node for node in ir_model.graph if node.op_type == "Loop")
    body = loop.attributes["body"].as_graph()
    assert isinstance(body.inputs[2].type, ir.SequenceType), body.inputs[2].type
    assert isinstance(body.outputs[1].type, ir.SequenceType), body.outputs[1].type
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (y,) = pl.run(pl.load(ir_model), [x], device_map="cpu")
    np.testing.assert_array_equal(y, np.concatenate([x, x, x]))
