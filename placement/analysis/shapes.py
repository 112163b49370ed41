"""Types and shapes for blobs the producer of a model left unannotated.

Exporters and hand-made graphs often leave intermediate blobs without a type or shape.
The planner needs their sizes and the runtime needs the types of blobs that cross a stage
boundary; both get them here, from ONNX shape inference
(:func:`placement.graph.inference.infer_types`: onnx_ir's ``ShapeInferencePass``, which hands
the checker a proto with the weights stripped, with sequence and optional types kept whole).

Inference writes what it finds onto the model's values, in place, once per model
structure: it adds facts, never changes what the graph computes.

Example:
    >>> import onnx
    >>> from onnx import TensorProto, helper
    >>> import placement as pl
    >>> g = helper.make_graph(
    ...     [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"])], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
    ...     [helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])])
    >>> model = pl.load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    >>> model.value("a").shape is None
    True
    >>> infer_shapes(model)
    True
    >>> str(model.value("a").shape), model.value("a").dtype.name
    ('[3]', 'FLOAT')
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from placement.graph.inference import infer_types
from placement.graph.model import Model

__all__ = ["infer_shapes"]

log = logging.getLogger(__name__)

_DONE_KEY = "placement.shapes_inferred"


def _structure(ir_model: ir.Model) -> tuple[int, int]:
    graph = ir_model.graph
    return graph.num_nodes(), sum(len(node.outputs) for node in graph)


def infer_shapes(model: Model | ir.Model, *, force: bool = False) -> bool:
    """Annotate the model's values with the types and shapes ONNX shape inference finds.

    Best effort: a model inference cannot handle (custom domains, unsupported opsets) is
    left as it is, with a debug log. Runs once per model structure unless ``force``.

    Args:
        model: a :class:`placement.Model` or an ``onnx_ir.Model``; annotated in place.
        force: run even if this structure was inferred before.

    Returns:
        Whether any value got a new type or shape.
    """
    ir_model = model.ir_model if isinstance(model, Model) else model
    key = _structure(ir_model)
    if not force and ir_model.meta.get(_DONE_KEY) == key:
        return False
    try:
        modified = False
        for _ in range(_ORT_ROUNDS):  # ONNX Runtime's ops have no ONNX inference: their types, then again
            modified = infer_types(ir_model) or modified
            if not _ort_op_types(ir_model):
                break
            modified = True
    except Exception as err:  # inference is best effort; callers report what stays unknown
        log.debug("shape inference failed: %s", err)
        return False
    ir_model.meta[_DONE_KEY] = key
    return modified


#: How often inference and ONNX Runtime's op types alternate (each round types what follows).
_ORT_ROUNDS = 8
#: Element types of ONNX Runtime's type-constraint strings.
_ORT_TYPES = {f"tensor({name})": dtype for name, dtype in (
    ("float", ir.DataType.FLOAT), ("float16", ir.DataType.FLOAT16), ("bfloat16", ir.DataType.BFLOAT16),
    ("double", ir.DataType.DOUBLE), ("int32", ir.DataType.INT32), ("int64", ir.DataType.INT64),
    ("uint8", ir.DataType.UINT8), ("int8", ir.DataType.INT8), ("bool", ir.DataType.BOOL))}  # fmt: skip


def _ort_op_types(ir_model: ir.Model) -> bool:
    """Element types of the outputs of ONNX Runtime's own ops (``com.microsoft``, and default-domain
    ops onnx has no schema for), from ORT's schema: an output takes the type of an input bound to the
    same type variable, or the one type its constraint allows. Returns whether any output got one."""
    from placement.graph.ort_ops import ort_only_node, ort_schema

    imports = ir_model.graph.opset_imports
    typed = False
    for node in ir_model.graph.all_nodes():
        if not any(v.type is None for v in node.outputs if v.name) or not ort_only_node(node, imports):
            continue
        domain = "" if node.domain == "ai.onnx" else node.domain
        schema = ort_schema(node.op_type, domain, imports.get(domain, 1))
        if schema is None:
            continue
        allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
        bound: dict[str, ir.DataType] = {}
        for formal, value in zip(schema.inputs, node.inputs):
            if value is not None and value.dtype is not None:
                bound.setdefault(formal.typeStr, value.dtype)
        for formal, value in zip(schema.outputs, node.outputs):
            if not value.name or value.type is not None:
                continue
            types = allowed.get(formal.typeStr, [formal.typeStr])
            dtype = bound.get(formal.typeStr) or (_ORT_TYPES.get(types[0]) if len(types) == 1 else None)
            if dtype is not None:
                value.type = ir.TensorType(dtype)
                typed = True
    return typed
