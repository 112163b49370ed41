"""Cutting a lowered module into stages when the graph touches a stage before one it reads from.

A cache's past length (a ``Shape`` on the device of its layer) is read by ops of an earlier
device: the graph's order meets the reading stage first. ``split_stages`` hands
``split_module`` the nodes stage by stage, so ``to_torch(chunks=k)`` splits such graphs.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

import placement as pl
from placement.runtime.torch.stage_split import split_stages, stage_of_ops


def _reads_a_stage_it_meets_later() -> pl.Model:
    """``relu(x)`` on device 0, ``ReduceSum(y)`` on device 1, their sum on device 0, in that order."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", 3]))
    y = ir.Value(name="y", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", 4]))
    axes = ir.Value(name="axes", const_value=ir.tensor(np.array([1], np.int64)))
    axes.shape, axes.type = ir.Shape([1]), ir.TensorType(ir.DataType.INT64)
    relu = ir.Node("", "Relu", [x], name="relu", num_outputs=1)
    total = ir.Node("", "ReduceSum", [y, axes], name="total", num_outputs=1)
    add = ir.Node("", "Add", [relu.outputs[0], total.outputs[0]], name="add", num_outputs=1)
    for node, name in ((relu, "r"), (total, "t"), (add, "out")):
        node.outputs[0].name = name
    graph = ir.Graph([x, y], [add.outputs[0]], nodes=[relu, total, add], opset_imports={"": 21})
    graph.register_initializer(axes)
    model = pl.load(ir.Model(graph, ir_version=10))
    model.set_device("total", 1)
    pl.inject_cross_device_copies(model)
    return model


def test_a_stage_met_before_the_stage_it_reads_is_split_in_topological_order() -> None:
    model = _reads_a_stage_it_meets_later()
    stage_of = stage_of_ops(model)
    assert stage_of["total"] < stage_of["relu"]  # the graph meets the later stage first
    module = pl.to_torch(model, device_map="cpu")
    before = [node.name for node in module.graph.nodes]
    stages, inputs, outputs = split_stages(module, stage_of)
    assert [node.name for node in module.graph.nodes] == before  # the lowered module is not reordered
    assert [stage.part for stage in stages] == sorted(stage.part for stage in stages)
    assert inputs == ["x", "y"] and len(outputs) == 1
    x, y = torch.randn(4, 3), torch.randn(4, 4)
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    torch.testing.assert_close(piped(x, y), module(x, y))
    torch.testing.assert_close(module(x, y), x.relu() + y.sum(1, keepdim=True))


def test_a_stage_met_before_the_stage_it_reads_trains_to_equal_gradients() -> None:
    """Pipelined training of the reordered split: the inputs' gradients equal the lowered
    module's (unsplit), micro-batch by micro-batch summed."""
    model = _reads_a_stage_it_meets_later()
    module = pl.to_torch(model, device_map="cpu")
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    x, y = torch.randn(4, 3), torch.randn(4, 4)
    grads = []
    for net in (module, piped):
        xa, ya = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
        out = net(xa, ya)
        grads.append(torch.autograd.grad(out.sin().sum(), [xa, ya]))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want)
