"""Old opsets: a model older than :data:`MIN_OPSET` is converted by ``onnx.version_converter``.

The rules implement the default domain from opset 13 on (Softmax and Split semantics).
:func:`upgraded` converts an older model and carries devices, copy marks and scopes
over by node name; :func:`old_semantics` names the ops whose old meaning the converter
does not carry over, which the lowering refuses instead.

Example:
    >>> import torch
    >>> import placement as pl
    >>> model = pl.from_torch(torch.nn.ReLU(), (torch.randn(2),))
    >>> default_opset(model) >= MIN_OPSET
    True
"""

from __future__ import annotations

import logging
import math

import onnx_ir as ir

from placement.graph.device import Device
from placement.graph.model import DEVICE_KEY, Model
from placement.lowering.values import static_shape

__all__ = ["MIN_OPSET", "default_opset", "old_semantics", "upgraded"]

log = logging.getLogger(__name__)

#: Oldest default-domain opset the rules implement (Softmax / Split semantics); older
#: models are converted to it with ``onnx.version_converter``.
MIN_OPSET = 13


def default_opset(model: Model) -> int | None:
    imports = model.graph.opset_imports
    return imports.get("", imports.get("ai.onnx"))


def upgraded(model: Model, *, device: Device) -> tuple[Model, list[str]]:
    """The model itself, or a copy converted to opset :data:`MIN_OPSET` by ``onnx.version_converter``.

    Node names survive the conversion; devices, copy marks and scopes are copied
    back by name, and a node the converter added takes the device of a neighbour.
    ``device`` is the converted model's default device. Returns the model and the
    problems found (a failed conversion).
    """
    opset = default_opset(model)
    if opset is None or opset >= MIN_OPSET:
        return model, []
    refused = old_semantics(model, opset)
    if refused:
        return model, refused
    import onnx
    from onnx import version_converter

    proto = ir.serde.serialize_model(model.ir_model)
    try:
        converted = version_converter.convert_version(proto, MIN_OPSET)
        onnx.checker.check_model(converted)
    except Exception as err:  # the converter raises plain RuntimeErrors from C++
        reason = " ".join(str(err).split())[:200]
        return model, [f"default-domain opset {opset} could not be converted to {MIN_OPSET}: {reason}"]
    ir_model = ir.serde.deserialize_model(converted)
    ir_model.metadata_props.update(model.ir_model.metadata_props)
    by_name = {node.name: node for node in model.graph if node.name}
    unplaced: list[ir.Node] = []
    for node in ir_model.graph:
        source = by_name.get(node.name or "")
        if source is not None:
            node.metadata_props.update(source.metadata_props)
        else:
            unplaced.append(node)
    for node in unplaced:
        neighbours = [u.node for out in node.outputs for u in out.uses()]
        neighbours += [v.producer() for v in node.inputs if v is not None and v.producer() is not None]
        placed = next((n for n in neighbours if n is not None and DEVICE_KEY in n.metadata_props), None)
        if placed is not None:
            node.metadata_props[DEVICE_KEY] = placed.metadata_props[DEVICE_KEY]
    log.info("converted the model from opset %d to %d for the torch lowering", opset, MIN_OPSET)
    return Model(ir_model, device=device), []


def old_semantics(model: Model, opset: int) -> list[str]:
    """Ops of an old opset whose meaning ``onnx.version_converter`` does not carry over.

    ``Scan`` before opset 9 has a batch axis and ``sequence_lens`` that the converted
    graph drops; ``PRelu`` before opset 7 has no defined broadcast for a slope that is
    neither one value nor the input's shape (ONNX Runtime has no kernel for it either).
    """
    problems: list[str] = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Scan" and opset < 9:
            problems.append(
                f"op {node.name or '?'!r} (Scan, opset {opset}): the batch axis and sequence_lens "
                "of Scan before opset 9 are not lowered"
            )
        elif node.op_type == "PRelu" and opset < 7 and len(node.inputs) > 1:
            x, slope = node.inputs[0], node.inputs[1]
            slope_shape = None
            if slope is not None:
                const = slope.const_value
                slope_shape = tuple(const.shape) if const is not None else static_shape(slope)
            x_shape = static_shape(x) if x is not None else None
            if slope_shape is None or (
                math.prod(slope_shape) != 1 and (x_shape is None or tuple(slope_shape) != tuple(x_shape))
            ):
                problems.append(
                    f"op {node.name or '?'!r} (PRelu, opset {opset}): input 'slope' of shape "
                    f"{slope_shape} has no defined broadcast before opset 7 (one value or the input's shape)"
                )
    return problems
