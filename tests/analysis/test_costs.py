"""FLOP rules of ops with subgraphs: ``Loop`` (body times a constant trip count), ``Scan``, ``If``."""

from __future__ import annotations

import math

import onnx_ir as ir
from onnx import TensorProto as T
from onnx import helper as h

from placement.analysis.costs import UNKNOWN_TRIPS, op_flops


class _Static:
    def dims(self, value: ir.Value | None) -> tuple[int, ...] | None:
        shape = None if value is None else value.shape
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return tuple(int(d) for d in shape)

    def numel(self, value: ir.Value | None) -> int:
        dims = self.dims(value)
        return 0 if dims is None else math.prod(dims)

    def out_numel(self, node: ir.Node) -> int:
        return sum(self.numel(v) for v in node.outputs)


def _matmul_body(inputs: list) -> h.GraphProto:
    """A body whose only costly op is a [2, 8] @ [8, 8] MatMul: 2 * 8 * 16 = 256 FLOPs."""
    return h.make_graph(
        [h.make_node("Identity", ["c_in"], ["c_out"]), h.make_node("MatMul", ["s_in", "W"], ["s_out"])],
        "body",
        inputs,
        [h.make_tensor_value_info("c_out", T.BOOL, []), h.make_tensor_value_info("s_out", T.FLOAT, [2, 8])],
    )


def _loop(trip_input: str) -> ir.Node:
    body = _matmul_body(
        [
            h.make_tensor_value_info("i", T.INT64, []),
            h.make_tensor_value_info("c_in", T.BOOL, []),
            h.make_tensor_value_info("s_in", T.FLOAT, [2, 8]),
        ]
    )
    graph = h.make_graph(
        [
            h.make_node("Constant", [], ["five"], value=h.make_tensor("five", T.INT64, [], [5])),
            h.make_node("Loop", [trip_input, "", "s"], ["out"], body=body),
        ],
        "g",
        [h.make_tensor_value_info("s", T.FLOAT, [2, 8]), h.make_tensor_value_info("M", T.INT64, [])],
        [h.make_tensor_value_info("out", T.FLOAT, [2, 8])],
        [h.make_tensor("W", T.FLOAT, [8, 8], [0.0] * 64)],
    )
    model = ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]))
    return next(n for n in model.graph if n.op_type == "Loop")


def test_loop_costs_its_body_times_a_constant_trip_count() -> None:
    body = 256  # the MatMul (Identity costs nothing)
    assert op_flops(_loop("five"), _Static()) == 5 * body
    assert op_flops(_loop("M"), _Static()) == UNKNOWN_TRIPS * body  # a guess, documented


def test_scan_costs_its_body_times_the_scan_length_and_if_its_dearer_branch() -> None:
    step = h.make_graph(
        [h.make_node("MatMul", ["x_t", "W"], ["y_t"])],
        "step",
        [h.make_tensor_value_info("x_t", T.FLOAT, [2, 8])],
        [h.make_tensor_value_info("y_t", T.FLOAT, [2, 8])],
    )
    scan = h.make_node("Scan", ["x"], ["ys"], body=step, num_scan_inputs=1)
    ys = h.make_tensor_value_info("ys", T.FLOAT, [7, 2, 8])
    dear = h.make_graph([scan], "then", [], [ys])  # 7 steps of the MatMul
    cheap = h.make_graph(
        [h.make_node("Neg", ["x"], ["n"])], "else", [], [h.make_tensor_value_info("n", T.FLOAT, [7, 2, 8])]
    )
    graph = h.make_graph(
        [h.make_node("If", ["c"], ["z"], then_branch=dear, else_branch=cheap)],
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, [7, 2, 8]), h.make_tensor_value_info("c", T.BOOL, [])],
        [h.make_tensor_value_info("z", T.FLOAT, [7, 2, 8])],
        [h.make_tensor("W", T.FLOAT, [8, 8], [0.0] * 64)],
    )
    model = ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]))
    (cond,) = list(model.graph)
    (inner_scan,) = list(cond.attributes["then_branch"].as_graph())
    assert op_flops(inner_scan, _Static()) == 7 * 256
    assert op_flops(cond, _Static()) == 7 * 256  # the dearer branch, not the Neg's 112
