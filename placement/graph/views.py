"""networkx views of a model, for graph algorithms (cuts, reachability, partitions).

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> g = pl.graph.op_graph(model)
    >>> import networkx as nx
    >>> nx.is_directed_acyclic_graph(g)
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import networkx as nx

from placement.graph.nodes import is_copy_node, node_device, node_scope

if TYPE_CHECKING:
    from placement.graph.placed import PlacedModel

__all__ = ["op_graph"]


def op_graph(model: PlacedModel) -> nx.DiGraph:
    """A ``DiGraph`` with one node per op and an edge producer -> consumer.

    Node attributes: ``op_type``, ``device`` (a ``Device``), ``scope``, ``is_copy``,
    ``index`` (graph position). Edge attribute ``blobs``: the blob names carried.
    """
    graph = nx.DiGraph()
    for index, node in enumerate(model.graph):
        graph.add_node(
            node.name,
            op_type=node.op_type,
            device=node_device(node),
            scope=node_scope(node),
            is_copy=is_copy_node(node),
            index=index,
        )
    for node in model.graph:
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is None:
                continue
            if graph.has_edge(producer.name, node.name):
                graph.edges[producer.name, node.name]["blobs"].append(value.name)
            else:
                graph.add_edge(producer.name, node.name, blobs=[value.name])
    return graph
