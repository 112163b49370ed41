"""Tiny hand-built ONNX graphs for graph-layer tests."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

import placement as pl


def mlp_graph(layers: int = 3, width: int = 4) -> pl.Model:
    """x -> (Gemm -> Relu) * layers -> y, with named parameters ``fc{i}.weight``."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, width]))
    nodes: list[ir.Node] = []
    inits: list[ir.Value] = []
    rng = np.random.default_rng(0)
    current = x
    for i in range(layers):
        w = ir.Value(
            name=f"fc{i}.weight",
            type=ir.TensorType(ir.DataType.FLOAT),
            shape=ir.Shape([width, width]),
            const_value=ir.tensor(
                rng.standard_normal((width, width)).astype(np.float32), name=f"fc{i}.weight"
            ),
        )
        inits.append(w)
        gemm = ir.Node(
            "", "Gemm", [current, w], attributes=[ir.AttrInt64("transB", 1)], name=f"fc{i}", num_outputs=1
        )
        _name(gemm, f"fc{i}_out", width)
        relu = ir.Node("", "Relu", gemm.outputs, name=f"relu{i}", num_outputs=1)
        _name(relu, f"relu{i}_out", width)
        nodes += [gemm, relu]
        current = relu.outputs[0]
    graph = ir.Graph([x], [current], nodes=nodes, initializers=inits, opset_imports={"": 20}, name="mlp")
    return pl.Model(ir.Model(graph, ir_version=10))


def _name(node: ir.Node, name: str, width: int) -> None:
    out = node.outputs[0]
    out.name = name
    out.type = ir.TensorType(ir.DataType.FLOAT)
    out.shape = ir.Shape([2, width])
