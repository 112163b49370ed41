"""Keep ONNX Runtime's blocked convolution layout across a stage boundary.

On the CPU, ONNX Runtime runs 2-D convolutions in a blocked memory layout (NCHWc)
and folds a BatchNormalization, a residual Add and a Relu into the convolution
before them. When a stage boundary falls between a Conv and its BatchNormalization
(the exporter's ``conv -> bn`` pair split by a cut), the next stage starts with a
BatchNormalization that has no convolution to fold into: ONNX Runtime runs it in
the plain layout, and with it the Add and Relu it reads, converting the layout back
and forth around them, and the residual block after it pays the same because its
skip connection is now in the plain layout.

:func:`batchnorm_as_conv` rewrites such a BatchNormalization (inference mode,
constant statistics, a 4-D float input read from another stage) into the
equivalent per-channel 1x1 depthwise Conv (``W = scale / sqrt(var + eps)``,
``B = bias - mean * W``), which ONNX Runtime does run in the blocked layout and
fuses the Add and Relu into, as in the single session. Outputs agree to rounding:
the single session folds the same statistics into its convolution the same way.
Only the stage's own session sees the rewrite (the stage model and the placed
model are not modified); the :class:`placement.Runner` applies it to stages on
the CPU.

Example:
    >>> import numpy as np
    >>> import onnx_ir as ir
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> weights = {n: np.ones(2, np.float32) for n in "sbmv"} | {"w": np.ones((2, 2, 1, 1), np.float32)}
    >>> graph = helper.make_graph(
    ...     [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], name="bn"),
    ...      helper.make_node("Conv", ["y", "w"], ["z"], name="conv")],
    ...     "stage",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
    ...     [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
    ...     [numpy_helper.from_array(a, n) for n, a in weights.items()],
    ... )
    >>> proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    >>> stage = ir.serde.deserialize_model(proto)
    >>> [node.op_type for node in batchnorm_as_conv(stage).graph]
    ['Conv', 'Conv']
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

__all__ = ["batchnorm_as_conv"]

log = logging.getLogger(__name__)


def batchnorm_as_conv(model: ir.Model) -> ir.Model:
    """``model`` with each BatchNormalization on a graph input run as a depthwise Conv.

    Returns ``model`` itself when nothing qualifies (see the module docstring),
    otherwise a rewritten clone (weights shared).
    """
    if not any(node.op_type == "Conv" for node in model.graph) or not any(_qualifies(n) for n in model.graph):
        return model  # without convolutions there is no blocked layout to keep
    model = model.clone()
    graph = model.graph
    for node in [n for n in graph if _qualifies(n)]:
        scale, bias, mean, var = (v.const_value.numpy().astype(np.float64) for v in node.inputs[1:])
        attr = node.attributes.get("epsilon")
        eps = 1e-5 if attr is None else float(attr.value)
        k = scale / np.sqrt(var + eps)
        w, b = k.astype(np.float32).reshape(-1, 1, 1, 1), (bias - mean * k).astype(np.float32)
        weight = ir.Value(name=f"{node.name}_dw_weight", const_value=ir.tensor(w))
        shift = ir.Value(name=f"{node.name}_dw_bias", const_value=ir.tensor(b))
        graph.register_initializer(weight)
        graph.register_initializer(shift)
        conv = ir.Node(
            "",
            "Conv",
            [node.inputs[0], weight, shift],
            attributes=[ir.AttrInt64("group", len(k)), ir.AttrInt64s("kernel_shape", [1, 1])],
            name=node.name,
        )
        old = node.outputs[0]
        name = old.name
        ir.convenience.replace_nodes_and_values(graph, node, [node], [conv], [old], [conv.outputs[0]])
        conv.outputs[0].name = name
        conv.outputs[0].shape, conv.outputs[0].type = old.shape, old.type
    log.debug("stage %s: BatchNormalization on stage inputs run as depthwise Conv", graph.name)
    return model


def _qualifies(node: ir.Node) -> bool:
    if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 5:
        return False
    x = node.inputs[0]
    if x is None or not x.is_graph_input() or x.dtype != ir.DataType.FLOAT:
        return False
    if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[1], int):
        return False
    stats = node.inputs[1:]
    if any(v is None or v.const_value is None or v.shape is None or len(v.shape) != 1 for v in stats):
        return False
    mode = node.attributes.get("training_mode")
    if mode is not None and mode.value:
        return False
    if any(out.uses() or out.is_graph_output() for out in node.outputs[1:]):
        return False
    # read by what ONNX Runtime keeps in the blocked layout (else a Conv there only adds conversions)
    uses = node.outputs[0].uses()
    return bool(uses) and all(use.node.op_type in _BLOCKED_READERS for use in uses)


_BLOCKED_READERS = frozenset({"Conv", "Add", "Relu"})
