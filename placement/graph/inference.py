"""ONNX shape inference onto an ``onnx_ir`` model, sequences and optionals kept whole.

onnx_ir's ``ShapeInferencePass`` hands the checker a proto with the weights stripped (no copy
of the weights, fine above protobuf's 2 GiB limit) and merges what it infers through
``value.dtype``, which turns an untyped value inferred as ``seq(tensor(float))`` into
``tensor(float)``: a ``SequenceEmpty`` feeding a ``Loop`` (torch's exporter writes one for
lists built in a loop) then fails in ONNX Runtime ("Type (tensor(float)) of output arg ...
does not match expected type (seq(tensor(float)))"). :func:`infer_types` writes the
non-tensor types whole first, so the pass keeps them. ``from_torch`` and
:func:`placement.analysis.shapes.infer_shapes` both infer through it.

Example:
    >>> import onnx_ir as ir
    >>> from onnx import TensorProto, helper
    >>> g = helper.make_graph(
    ...     [helper.make_node("SequenceEmpty", [], ["s"], dtype=TensorProto.FLOAT),
    ...      helper.make_node("SequenceLength", ["s"], ["n"])], "g", [],
    ...     [helper.make_tensor_value_info("n", TensorProto.INT64, [])])
    >>> model = ir.serde.deserialize_model(helper.make_model(g))
    >>> infer_types(model)
    True
    >>> str(model.graph.node(0).outputs[0].type)
    'Sequence(Tensor(FLOAT))'
"""

from __future__ import annotations

import logging

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

__all__ = ["infer_types"]

log = logging.getLogger(__name__)

#: Op-type prefixes of ops that produce or read sequences and optionals.
_NON_TENSOR_OPS = ("Sequence", "SplitToSequence", "ConcatFromSequence", "Optional", "Loop", "If", "Scan")


def infer_types(ir_model: ir.Model, *, strict: bool = False) -> bool:
    """Annotate ``ir_model``'s values, in place, with the types and shapes ONNX infers.

    Args:
        ir_model: the model; its values gain types and shapes, nothing else changes.
        strict: ONNX's ``check_type`` and ``strict_mode`` (an inconsistent graph raises).

    Returns:
        Whether any value got a new type or shape.

    Raises:
        Exception: what ONNX shape inference raises, where ``strict`` asks for it; callers
        that treat inference as best effort catch it.
    """
    onnx_ir_log = logging.getLogger("onnx_ir.passes.common.shape_inference")
    level = onnx_ir_log.level
    onnx_ir_log.setLevel(logging.ERROR)  # "value not found" notes for values inference skips
    try:
        typed = _non_tensor_types(ir_model)
        result = ShapeInferencePass(check_type=strict, strict_mode=strict, data_prop=True)(ir_model)
    finally:
        onnx_ir_log.setLevel(level)
    return typed or bool(result.modified)


def _non_tensor_types(ir_model: ir.Model) -> bool:
    """Give sequence and optional values their full types (before onnx_ir's pass).

    Graphs that have such values (rare: sequence and optional ops) are first inferred on a
    serialised copy, and the non-tensor types are written whole, in the main graph and in every
    subgraph (a ``Loop`` body's inputs and outputs carry the loop's sequences); the pass then
    keeps them (their element type already matches). Returns whether a value got a new type.
    """
    graph = ir_model.graph
    if not any(node.op_type.startswith(_NON_TENSOR_OPS) for node in graph.all_nodes()):
        return False
    import onnx

    try:
        proto = onnx.shape_inference.infer_shapes(ir.serde.serialize_model(ir_model), data_prop=True)
    except Exception as err:  # best effort: the pass below still runs
        log.debug("shape inference of non-tensor types failed: %s", err)
        return False
    inferred_model = ir.serde.deserialize_model(proto)
    changed = False
    # every graph, subgraphs included: the pass also merges into a Loop's body, whose inputs
    # and outputs carry the loop's sequences
    for original, inferred in zip(ir_model.graphs(), inferred_model.graphs()):
        values = ir.convenience.create_value_mapping(original)
        for name, found in ir.convenience.create_value_mapping(inferred).items():
            value = values.get(name)
            if value is None or found.type is None or isinstance(found.type, ir.TensorType):
                continue
            if value.type != found.type:
                value.type = found.type
                value.shape = None
                changed = True
    return changed
