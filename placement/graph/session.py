"""An ONNX Runtime session over a model whose weights bypass the protobuf.

Every session this package builds (stage sessions, the profiler's, the fusion
probe's) goes through :func:`ort_session`, so they all hand weights to ONNX
Runtime the same way: :func:`placement.graph.weights.split_weights` writes the
graph with its large weights as stubs, and each weight is supplied as an
``OrtValue`` over the model's own array through
``SessionOptions.add_external_initializers``.

Example:
    >>> import onnxruntime as ort
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> session = ort_session(model, ort.SessionOptions(), ["CPUExecutionProvider"])
    >>> [o.name for o in session.get_outputs()]
    ['linear_2']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from placement.graph.model import Model
from placement.graph.weights import split_weights

if TYPE_CHECKING:
    import onnxruntime as ort

__all__ = ["ort_session"]


def ort_session(
    model: Model | ir.Model, options: ort.SessionOptions, providers: list[Any]
) -> ort.InferenceSession:
    """An ``InferenceSession`` of ``model`` whose weights bypass the protobuf.

    The proto holds only the graph (so no 2 GB limit); each large weight is handed
    to ONNX Runtime as an ``OrtValue`` over the model's own array (memory-mapped
    for a model loaded lazily), which the session copies onto its device once.
    Only weights the graph reads are handed over (see
    :func:`~placement.graph.weights.split_weights`). ``options`` gets the weights
    added; ONNX Runtime's errors propagate unchanged.

    Example:
        >>> import onnxruntime as ort
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> session = ort_session(model, ort.SessionOptions(), ["CPUExecutionProvider"])
        >>> [i.name for i in session.get_inputs()]
        ['input']
    """
    import onnxruntime as ort

    proto, weights = split_weights(model)
    values = [ort.OrtValue.ortvalue_from_numpy(array) for array in weights.values()]
    if values:
        options.add_external_initializers(list(weights), values)
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=providers)
    session._placement_weights = values  # the session may read them for as long as it lives
    return session
