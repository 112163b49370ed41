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
from collections.abc import Iterable

import numpy as np
import onnx
import onnx_ir as ir

__all__ = ["NCHWC_DOMAIN", "batchnorm_as_conv", "blocked_inputs", "blocked_outputs", "keep_blocked"]

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


# --- blocked boundaries ----------------------------------------------------------------------

#: The domain of ONNX Runtime's blocked-layout kernels (CPU execution provider).
NCHWC_DOMAIN = "com.microsoft.nchwc"


def blocked_outputs(proto: onnx.ModelProto) -> dict[str, str]:
    """Graph outputs of an ONNX Runtime-optimised stage that leave the blocked layout at the end.

    Returns ``{output: blocked tensor}`` for every graph output produced by a
    ``ReorderOutput`` back to NCHW (not channels-last) from a blocked tensor.

    Example:
        >>> from onnx import helper
        >>> node = helper.make_node("ReorderOutput", ["b"], ["y"], domain=NCHWC_DOMAIN, channels=8)
        >>> graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", 1, None)])
        >>> blocked_outputs(helper.make_model(graph))
        {'y': 'b'}
    """
    graph = proto.graph
    outputs = {o.name for o in graph.output}
    found: dict[str, str] = {}
    for node in graph.node:
        if _is_reorder(node, "ReorderOutput") and node.output[0] in outputs:
            found[node.output[0]] = node.input[0]
    return found


def blocked_inputs(proto: onnx.ModelProto) -> set[str]:
    """Graph inputs of an ONNX Runtime-optimised stage that go straight into the blocked layout.

    An input qualifies when every node reading it is a ``ReorderInput`` from NCHW
    (not channels-last) and it is not also a graph output.

    Example:
        >>> from onnx import helper
        >>> node = helper.make_node("ReorderInput", ["x"], ["b"], domain=NCHWC_DOMAIN)
        >>> graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, None)], [])
        >>> blocked_inputs(helper.make_model(graph))
        {'x'}
    """
    graph = proto.graph
    names = {i.name for i in graph.input} - {o.name for o in graph.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            if name in names:
                readers.setdefault(name, []).append(node)
    return {
        name
        for name, nodes in readers.items()
        if all(_is_reorder(n, "ReorderInput") and n.input[0] == name for n in nodes)
    }


def keep_blocked(proto: onnx.ModelProto, outputs: Iterable[str], inputs: Iterable[str]) -> onnx.ModelProto:
    """A copy of an optimised stage whose ``outputs`` stay blocked and whose ``inputs`` arrive blocked.

    The ``ReorderOutput`` before each output and the ``ReorderInput`` after each
    input are removed, and their tensors renamed to the boundary's name, so the
    stage before a boundary hands over the blocked tensor and the stage after it
    reads it as it is: no conversion out of the blocked layout and back in. The
    boundary's channel dimension becomes unknown (blocked tensors pad it to the
    block size). Only for stages built on the same machine with the same ONNX
    Runtime (the block size is the CPU's).

    Example:
        >>> from onnx import helper
        >>> nodes = [helper.make_node("ReorderInput", ["x"], ["b"], domain=NCHWC_DOMAIN),
        ...          helper.make_node("Relu", ["b"], ["c"]),
        ...          helper.make_node("ReorderOutput", ["c"], ["y"], domain=NCHWC_DOMAIN, channels=8)]
        >>> info = lambda n: helper.make_tensor_value_info(n, 1, [1, 8, 2, 2])
        >>> proto = helper.make_model(helper.make_graph(nodes, "g", [info("x")], [info("y")]))
        >>> kept = keep_blocked(proto, ["y"], ["x"])
        >>> [(n.op_type, list(n.input), list(n.output)) for n in kept.graph.node]
        [('Relu', ['x'], ['y'])]
    """
    proto_copy = onnx.ModelProto()
    proto_copy.CopyFrom(proto)
    graph = proto_copy.graph
    outputs, inputs = set(outputs), set(inputs)
    rename: dict[str, str] = {}
    keep: list[onnx.NodeProto] = []
    for node in graph.node:
        if _is_reorder(node, "ReorderOutput") and node.output[0] in outputs:
            rename[node.input[0]] = node.output[0]
        elif _is_reorder(node, "ReorderInput") and node.input[0] in inputs:
            rename[node.output[0]] = node.input[0]
        else:
            keep.append(node)
    del graph.node[:]
    for node in keep:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = rename.get(name, name)
        graph.node.append(node)
    for info in [*graph.output, *graph.input]:
        if info.name in outputs | inputs:
            dims = info.type.tensor_type.shape.dim
            if len(dims) > 1:
                dims[1].Clear()
    stale = set(rename)  # value infos of the removed tensors
    kept_info = [v for v in graph.value_info if v.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    return proto_copy


def _is_reorder(node: onnx.NodeProto, op_type: str) -> bool:
    if node.op_type != op_type or node.domain != NCHWC_DOMAIN or not node.input or not node.output:
        return False
    return all(a.name != "channels_last" or a.i == 0 for a in node.attribute)
