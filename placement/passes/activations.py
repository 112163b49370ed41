"""Activation discovery: which blobs are activations.

An activation is a blob produced by an op that depends (transitively) on at least
one graph input and is consumed by another op or is a graph output. Parameters,
constants and data-independent arithmetic (shapes computed from constants) are
not activations, and neither are the outputs of cross-device copies (placement
artifacts; dependence flows through them, so what a copy feeds still counts).

Unlike Caffe2, which recognised activations by the ``_grad`` blobs a backward pass
created, this is a data-flow property of the forward graph: one pass over the ops
in topological order, defined once in :mod:`placement.analysis.dependence`.

Ops with subgraphs (``If``, ``Loop``, ``Scan``) are seen through their explicit
inputs only; values their bodies capture from the outer scope are not followed.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> pl.get_activation_blobs(model)
    ['linear', 'relu', 'linear_1', 'relu_1', 'linear_2']
"""

from __future__ import annotations

import onnx_ir as ir

from placement.analysis.dependence import activation_values
from placement.graph.model import Model
from placement.graph.nodes import COPY_KEY, name_of
from placement.passes.base import as_ir_model, no_gc

__all__ = ["get_activation_blobs", "activation_values", "describe_non_activation"]


def get_activation_blobs(model: Model) -> list[str]:
    """Names of the model's activation blobs, in producer (topological) order.

    An activation is produced by an op, depends on a graph input, and is consumed
    by another op or is a graph output. Copy outputs are not activations.

    Args:
        model: a :class:`placement.Model` (an ``onnx_ir.Model`` is accepted too).

    Returns:
        Blob names, each once, in the order their producers run.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> acts = pl.get_activation_blobs(model)
        >>> acts[-1] == model.outputs[0]
        True
    """
    with no_gc():
        values = activation_values(as_ir_model(model).graph)
        names = list(map(name_of, values))
        return [name or "" for name in names] if None in names else names


def describe_non_activation(graph: ir.Graph, value: ir.Value) -> str:
    """Why ``value`` (a blob of ``graph``) is not an activation, for error messages."""
    if value.is_initializer():
        return "a parameter (initializer)"
    if value.is_graph_input():
        return "a graph input, not produced by an op"
    producer = value.producer()
    if producer is None:
        return "not produced by any op"
    if COPY_KEY in producer.metadata_props:
        source = producer.inputs[0] if producer.inputs else None
        name = source.name if source is not None else "?"
        return f"the output of cross-device copy {producer.name!r}; shift its source blob {name!r}"
    if not any(use.node.graph is graph for use in value.uses()) and not value.is_graph_output():
        return f"an output of op {producer.name!r} that no op consumes"
    return f"produced by op {producer.name!r} from parameters/constants only (it depends on no graph input)"
