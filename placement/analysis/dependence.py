"""Data dependence, copy origin and load-time values: one definition of each.

Three questions every layer asks of a placed graph:

* **Does a blob depend on a graph input?** A blob is *independent* when its producer
  reads only parameters, constants and other independent blobs. Activations are the
  dependent op outputs that something consumes (or that are graph outputs); outputs of
  cross-device copies are placement artifacts, not activations, but dependence flows
  through them.
* **Which blob does a copy carry?** :func:`copy_origin` looks through a chain of copies
  to the blob at its start.
* **Which blobs are the same on every run?** *Load-time values* are blobs computed by
  deterministic standard ONNX ops (no subgraphs) from parameters and constants alone: a
  transposed weight, a scale, shape arithmetic. Runtimes rematerialise them where they are
  read (ONNX Runtime folds them into initializers when a session loads), so they never
  cross a device boundary per run and a planner counts them as 0 bytes. Graph outputs are
  always produced by their stage, so they (and the copies that carry them) are excluded.
  Outputs of random ops are never load-time values: every run draws new numbers, so the
  runtime transfers them and the planner counts their bytes.

Ops with subgraphs (``If``, ``Loop``, ``Scan``) are seen through their explicit inputs
for dependence; they never produce load-time values.

Example:
    >>> import placement as pl
    >>> from placement.analysis import activation_values, load_time_values
    >>> from placement.models import gpt
    >>> model = pl.from_torch(*gpt.build("tiny"))
    >>> acts = activation_values(model.graph)
    >>> acts[-1].name == model.outputs[0]
    True
    >>> any(v in load_time_values(model.graph) for v in acts)
    False
"""

from __future__ import annotations

import onnx_ir as ir

from placement.graph.nodes import COPY_KEY, graph_nodes

__all__ = [
    "NONDETERMINISTIC_OPS",
    "activation_values",
    "copy_origin",
    "independent_values",
    "load_time_values",
]

#: Standard ONNX op types whose outputs differ from run to run even when every input is fixed.
NONDETERMINISTIC_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}
)


def copy_origin(value: ir.Value) -> ir.Value:
    """The blob at the start of the chain of cross-device copies that produces ``value``.

    ``value`` itself when its producer is not a copy.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> model.set_device(model.ops[-1].name, 1)
        >>> _ = pl.inject_cross_device_copies(model)
        >>> copy = next(op for op in model.ops if op.is_copy)
        >>> copy_origin(model.value(copy.outputs[0])).name == copy.inputs[0]
        True
    """
    producer = value.producer()
    while producer is not None and COPY_KEY in producer.metadata_props and producer.inputs:
        source = producer.inputs[0]
        if source is None:
            break
        value, producer = source, source.producer()
    return value


def independent_values(graph: ir.Graph) -> set[ir.Value]:
    """Op outputs that depend on no graph input (computed from parameters and constants only).

    Example:
        >>> import placement as pl
        >>> from placement.models import gpt
        >>> model = pl.from_torch(*gpt.build("tiny"))
        >>> sorted(v.name for v in independent_values(model.graph))[:2]  # position embeddings, masks
        ['embedding_1', 'slice_1']
    """
    independent: set[ir.Value] = set()
    is_independent = independent.__contains__
    for node in graph:
        if all(v is None or is_independent(v) or v.is_initializer() for v in node.inputs):
            independent.update(node.outputs)
    return independent


def activation_values(graph: ir.Graph) -> list[ir.Value]:
    """The activation values of ``graph`` in producer (graph) order, without duplicates.

    An activation is an output of a (non-copy) op that depends on a graph input and is
    consumed by another op or is a graph output. One pass over the nodes, values hashed
    by identity; it tracks the few independent blobs rather than the many dependent ones.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> [v.name for v in activation_values(model.graph)]
        ['linear', 'relu', 'linear_1', 'relu_1', 'linear_2']
    """
    independent: set[ir.Value] = set()
    consumed: set[ir.Value] = set()
    candidates: list[ir.Value] = []
    is_independent, consume, extend = independent.__contains__, consumed.add, candidates.extend
    for node in graph_nodes(graph):  # slots read directly: see graph_nodes
        hit = False
        for value in node._inputs:
            if value is not None and not value._is_initializer and not is_independent(value):
                hit = True
                consume(value)
        if not hit:
            independent.update(node._outputs)
        else:
            props = node._metadata_props
            if not props or COPY_KEY not in props:
                extend(node._outputs)
    return [v for v in candidates if v in consumed or v._is_graph_output]


def _has_subgraph(node: ir.Node) -> bool:
    return any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())


def load_time_values(graph: ir.Graph) -> set[ir.Value]:
    """Op outputs that are the same on every run and never cross a device per run.

    See the module docstring: outputs of deterministic standard ONNX ops without subgraphs
    whose inputs are all parameters or load-time values, minus graph outputs, the blobs
    that copies carry to graph outputs, and whatever reads those (they are produced by
    their stage each run). Parameters themselves are not included.

    Example:
        >>> import placement as pl
        >>> from placement.models import gpt
        >>> model = pl.from_torch(*gpt.build("tiny"))
        >>> sorted(v.name for v in load_time_values(model.graph))[:2]
        ['embedding_1', 'slice_1']
    """
    fixed: set[ir.Value] = set(graph.initializers.values())
    for node in graph:
        if node.op_type in NONDETERMINISTIC_OPS or node.domain not in ("", "ai.onnx"):
            continue
        if node.metadata_props.get(COPY_KEY) == "streamed":  # copied every run, on purpose
            continue
        if _has_subgraph(node):
            continue
        if all(v is None or v in fixed for v in node.inputs):
            fixed.update(node.outputs)
    keep = list(graph.outputs)
    while keep:
        value = keep.pop()
        producer = value.producer()
        if value in fixed and producer is not None:
            fixed.discard(value)
            if COPY_KEY in producer.metadata_props and producer.inputs and producer.inputs[0] is not None:
                keep.append(producer.inputs[0])
    # What reads a value left out is not load-time either (a copy of it, an op on that copy).
    for node in graph:
        if node.outputs and node.outputs[0] in fixed:
            if any(v is not None and v not in fixed for v in node.inputs):
                fixed.difference_update(node.outputs)
    return {v for v in fixed if v.producer() is not None}
