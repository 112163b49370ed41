"""Weights for ONNX Runtime sessions: a small proto plus the large weights as arrays.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> proto, weights = split_weights(pl.from_torch(*mlp.build("tiny")), threshold=0)
    >>> sorted(weights) == sorted(t.name for t in proto.graph.initializer)
    True
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir

from placement.graph.model import Model
from placement.graph.saving import _EXTERNAL_THRESHOLD, MAX_IR_VERSION, _weight_slots, to_proto

__all__ = ["split_weights", "SUPPLIED_LOCATION"]

log = logging.getLogger(__name__)

#: The location that marks a weight supplied to ONNX Runtime outside the protobuf.
SUPPLIED_LOCATION = "placement-supplied-weight"


def split_weights(
    model: Model | ir.Model, *, threshold: int = _EXTERNAL_THRESHOLD
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Serialise a model with its large weights left out, for ONNX Runtime.

    Every main-graph initializer of ``threshold`` bytes or more (in a dtype numpy
    and ONNX Runtime share) is written to the proto as an external-data stub at
    :data:`SUPPLIED_LOCATION` and returned as an array instead: memory-mapped for
    a model loaded lazily, the model's own array otherwise (never a copy). Give
    them to the session with ``SessionOptions.add_external_initializers``; the
    proto stays small, so a model of any size loads. A :class:`Model` gets its
    placement annotations as in :func:`to_proto`. Initializers that nothing reads
    (not an op, in the graph or a subgraph, nor a graph input or output) are left
    out, as ONNX Runtime would drop them before taking the supplied weights. The
    model is not modified. Every other tensor still on disk (under ``threshold``,
    in subgraphs or ``Constant`` ops) is read into the proto: ONNX Runtime would
    resolve a relative data-file reference against the working directory, not the
    model's folder.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> proto, weights = split_weights(pl.from_torch(*mlp.build("tiny")).ir_model, threshold=0)
        >>> len(weights) == len(proto.graph.initializer)
        True
        >>> all(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
        True
    """
    clone = (model.ir_model if isinstance(model, Model) else model).clone()
    _drop_unread_initializers(clone.graph)
    weights: dict[str, np.ndarray] = {}
    for name, value in clone.graph.initializers.items():
        tensor = value.const_value
        if tensor is None or tensor.nbytes < threshold:
            continue
        try:
            array = tensor.numpy()
        except Exception as err:  # noqa: BLE001 (a tensor type numpy cannot hold: leave it inline)
            log.debug("weight %s stays in the proto: %s", name, err)
            continue
        if array.dtype.kind not in "fiub" or not array.dtype.isnative:
            continue
        weights[name] = np.ascontiguousarray(array)
        value.const_value = ir.ExternalTensor(
            SUPPLIED_LOCATION, 0, int(tensor.nbytes), tensor.dtype, shape=tensor.shape, name=name
        )
    _inline_external(clone)
    if isinstance(model, Model):
        return to_proto(Model(clone)), weights
    proto = ir.serde.serialize_model(clone)
    proto.ir_version = min(proto.ir_version, MAX_IR_VERSION)
    return proto, weights


def _drop_unread_initializers(graph: ir.Graph) -> None:
    """Remove the initializers of ``graph`` that no op (in it or a subgraph) reads and that
    are neither graph inputs nor outputs.

    ONNX Runtime removes them itself when it loads a graph, *before* it takes the
    weights handed to ``add_external_initializers``; a supplied weight whose
    initializer is gone fails the session ("Failed to find existing initializer").
    """
    keep = set(graph.inputs) | set(graph.outputs)
    for name, value in list(graph.initializers.items()):
        if value not in keep and not value.uses():
            log.debug("initializer %s is read by no op: left out of the session", name)
            del graph.initializers[name]


def _inline_external(model: ir.Model) -> None:
    """Read every tensor still stored in a data file (small ones, tensors of subgraphs and
    ``Constant`` ops, dtypes numpy lacks) into memory, so that no relative data-file
    reference reaches ONNX Runtime: it would resolve it against the working directory,
    not the model's folder. Stubs at :data:`SUPPLIED_LOCATION` stay."""
    for get, put in _weight_slots(model):
        tensor = get()
        if isinstance(tensor, ir.ExternalTensor) and tensor.location != SUPPLIED_LOCATION:
            put(ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name))
