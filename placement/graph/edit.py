"""Bulk graph edits for passes over million-op graphs: the one module that writes onnx_ir's slots.

onnx_ir's public mutators are exact but pay per call for generality: ``Node.replace_input_with``
rebuilds the input tuple through a generator and calls four methods, ``Graph.insert_before``
goes through three layers of calls per node. Copy injection makes a quarter of a million
such edits on a million-op graph, where those layers were half the pass. The functions
here do the same edits with onnx_ir's own data structures written directly:

* :func:`new_node` is ``ir.Node(domain, op_type, inputs, outputs=(output,), ...)``;
* :func:`copy_shape` is ``ir.Shape(shape)``;
* :func:`rewire` is ``node.replace_input_with(index, value)``;
* :func:`insert_before` is ``graph.insert_before(node, new_nodes)`` for new nodes, and
  :func:`insert_each` the same for many ``(new node, anchor)`` pairs in one call.

They leave the IR exactly as the public methods would (inputs, ``value.uses()`` and its
order, ``node.graph``, the node order, the graph's name registry); ``tests/graph/test_edit.py``
proves it against the public methods. Where an edit is outside the fast path's
assumptions (a node with sharding specs, an unnamed or already placed node), they call the
public method. If onnx_ir's internals differ from what this module was written against
(checked once at import: :data:`FAST`), every call goes through the public methods, and a
test fails so that the difference is noticed.

Nothing else in ``placement`` writes onnx_ir's private slots.

Example:
    >>> import onnx_ir as ir
    >>> x, y = ir.Value(name="x"), ir.Value(name="y")
    >>> relu = ir.Node("", "Relu", [x], name="relu")
    >>> graph = ir.Graph([x, y], relu.outputs, nodes=[relu])
    >>> rewire(relu, 0, y)
    >>> relu.inputs[0].name, len(x.uses()), len(y.uses())
    ('y', 0, 1)
    >>> neg = ir.Node("", "Neg", [y], name="neg")
    >>> insert_before(graph, relu, [neg])
    >>> [node.name for node in graph], neg.graph is graph
    (['neg', 'relu'], True)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any

import onnx_ir as ir
from onnx_ir import _core as _ir_core  # Usage: the key type of Value._uses
from onnx_ir import _graph_containers as _ir_containers  # Attributes: a node's attribute dict

from placement.graph.nodes import name_of

__all__ = ["FAST", "copy_shape", "new_node", "rewire", "insert_before", "insert_each", "internals_supported"]

_Usage = _ir_core.Usage
_new_tuple = tuple.__new__
_new_object = object.__new__

#: Slots of onnx_ir's classes this module reads or writes (onnx_ir 1.1).
#: Node's slots, all of them: new_node fills every one (a new slot means new state to set).
_NODE_SLOTS = {
    "_attributes", "_domain", "_graph", "_inputs", "_metadata", "_metadata_props", "_name",
    "_op_type", "_outputs", "_overload", "_version", "device_configurations", "doc_string",
}  # fmt: skip
_VALUE_SLOTS = {"_uses", "_name", "_producer", "_index"}
_LIST_FIELDS = {"_root", "_length", "_value_ids_to_boxes"}
_BOX_SLOTS = {"prev", "next", "value", "owning_list"}
_AUTHORITY_FIELDS = {"_node_names", "_value_names"}


def _state_of(obj: object) -> set[str]:
    """The attribute names an object holds (slots and ``__dict__``)."""
    names = set(getattr(obj, "__dict__", ()))
    for cls in type(obj).__mro__:
        names.update(slot for slot in getattr(cls, "__slots__", ()) if hasattr(obj, slot))
    return names


def internals_supported() -> bool:
    """True when onnx_ir's private layout is the one this module writes (checked on a tiny graph)."""
    try:
        if not (_NODE_SLOTS == set(ir.Node.__slots__) and _VALUE_SLOTS <= set(ir.Value.__slots__)):
            return False
        attributes = ir.Node("", "Relu", [])._attributes
        if type(attributes) is not _ir_containers.Attributes or list(vars(attributes)) != ["_owner", "data"]:
            return False
        if _state_of(ir.Shape([1, "n"])) != {"_dims", "_denotations", "_frozen"}:
            return False
        x = ir.Value(name="x")
        node = ir.Node("", "Relu", [x], name="relu")
        graph = ir.Graph([x], node.outputs, nodes=[node])
        nodes, authority = graph._nodes, graph._name_authority
        box = nodes._value_ids_to_boxes[id(node)]
        return (
            all(hasattr(nodes, field) for field in _LIST_FIELDS)
            and _BOX_SLOTS == set(type(box).__slots__)
            and not hasattr(box, "__dict__")
            and box.value is node
            and box.owning_list is nodes
            and nodes._root.next is box
            and all(isinstance(getattr(authority, f, None), set) for f in _AUTHORITY_FIELDS)
            and "relu" in authority._node_names
            and dict(x._uses) == {_Usage(node, 0): None}
            and node._inputs == (x,)
            and node._graph is graph
        )
    except Exception:  # any surprise: use the public methods
        return False


#: True when the fast paths are in use (onnx_ir's internals are as expected).
FAST = internals_supported()


def new_node(
    domain: str,
    op_type: str,
    inputs: Sequence[ir.Value | None],
    output: ir.Value,
    *,
    name: str | None,
    metadata_props: dict[str, str] | None,
) -> ir.Node:
    """``ir.Node(domain, op_type, inputs, outputs=(output,), name=..., metadata_props=...)``, faster.

    A node without attributes and one output ``output`` (a value no node produces yet),
    in no graph; every slot filled as the constructor fills it, and the node recorded as
    a use of each input. Copy injection makes a quarter of a million of them per million ops.

    Raises:
        ValueError: ``output`` already has a producer.
    """
    if not FAST or domain == "ai.onnx":
        return ir.Node(domain, op_type, inputs, outputs=(output,), name=name, metadata_props=metadata_props)
    if output._producer is not None:
        raise ValueError(f"output {output.name!r} already has a producer")
    node = _new_object(ir.Node)
    node._name = name
    node._domain = domain
    node._op_type = op_type
    node._inputs = inputs = tuple(inputs)
    output._producer, output._index = node, 0
    node._outputs = (output,)
    node._attributes = attributes = _new_object(_ir_containers.Attributes)  # Attributes((), owner=node):
    attributes._owner, attributes.data = node, {}  # what it and UserDict.__init__ set, in that order
    node._overload = ""
    node._version = None
    node._metadata = None
    node._metadata_props = metadata_props
    node.device_configurations = ()
    node._graph = None
    node.doc_string = None
    for index, value in enumerate(inputs):
        if value is not None:
            value._uses[_new_tuple(_Usage, (node, index))] = None
    return node


def copy_shape(shape: ir.Shape) -> ir.Shape:
    """``ir.Shape(shape)``: a new, unfrozen shape with the same dims and no denotations."""
    if not FAST:
        return ir.Shape(shape)
    dims = shape._dims  # already ints and SymbolicDims: the constructor would keep them as they are
    new = _new_object(ir.Shape)
    new._dims = list(dims)
    new._denotations = [None] * len(dims)
    new._frozen = False
    return new


def rewire(node: ir.Node, index: int, value: ir.Value | None) -> None:
    """``node.replace_input_with(index, value)``, with the slots written directly.

    Input ``index`` of ``node`` becomes ``value``; the old input forgets this use and
    ``value`` records it last in its uses, as the public method does.

    Raises:
        ValueError: ``index`` is out of range.
    """
    if not FAST or node.device_configurations:  # sharding specs: the public method drops them
        node.replace_input_with(index, value)
        return
    inputs = node._inputs
    if index < 0 or index >= len(inputs):
        raise ValueError(f"Index out of range: {index}")
    old = inputs[index]
    changed = list(inputs)
    changed[index] = value
    node._inputs = tuple(changed)
    if old is not None:
        old._uses.pop((node, index))  # Usage is a NamedTuple: equal to the plain tuple
    if value is not None:
        value._uses[_new_tuple(_Usage, (node, index))] = (
            None  # Usage(node, index), without its Python __new__
        )


def insert_before(graph: ir.Graph, node: ir.Node, new_nodes: Sequence[ir.Node]) -> None:
    """``graph.insert_before(node, new_nodes)`` for nodes in no graph, with the slots written directly.

    The new nodes go just before ``node`` in the given order, belong to ``graph`` and
    have their names (and their outputs') registered with the graph, as the public
    method does. When a node is unnamed, has an unnamed output, already belongs to a
    graph or comes twice, the call goes through the public method (which names it, or raises).

    Raises:
        ValueError: ``node`` is not in ``graph``.
    """
    if len({id(new) for new in new_nodes}) != len(new_nodes):
        graph.insert_before(node, new_nodes)  # a node twice: the public method moves it
        return
    insert_each(graph, zip(new_nodes, repeat(node)))


def insert_each(graph: ir.Graph, pairs: Iterable[tuple[ir.Node, ir.Node]]) -> None:
    """``graph.insert_before(anchor, new)`` for each ``(new, anchor)`` pair, in order, in one call.

    Each new node goes just before its anchor, after the nodes inserted before that anchor
    earlier (so the pairs need not be grouped by anchor). Anchors must be nodes of the
    graph that are not among the new nodes. See :func:`insert_before`.
    """
    if not FAST:
        for new, anchor in pairs:
            graph.insert_before(anchor, new)
        return
    nodes: Any = graph._nodes
    boxes = nodes._value_ids_to_boxes
    node_names = graph._name_authority._node_names
    value_names = graph._name_authority._value_names
    link_box = type(nodes._root)
    for new, anchor in pairs:
        box = boxes.get(id(anchor))
        if box is None or box.value is not anchor:
            raise ValueError(f"Value {anchor!r} is not in the list")
        name = new._name
        output_names = list(map(name_of, new._outputs))
        if new._graph is not None or name is None or None in output_names:
            graph.insert_before(anchor, new)  # names it, or raises for a node of another graph
            continue
        node_names.add(name)
        value_names.update(output_names)
        new._graph = graph
        before = box.prev
        new_box = _new_object(link_box)  # _LinkBox(nodes, new), its four slots set once
        new_box.value, new_box.owning_list, new_box.prev, new_box.next = new, nodes, before, box
        before.next = box.prev = new_box
        boxes[id(new)] = new_box
        nodes._length += 1
