"""Making copies: their nodes, names and places in the graph (a part of copy injection).

A copy's output blob is ``<blob>_<type>_<index>`` (``fc3_cuda_1``), made unique
(``fc3_cuda_1_1``) when the name is taken, and its node ``copy_<blob name>``; a copy that a
graph output reads takes that output's name. Every name made here contains
``_<type>_<index>``, so only names containing such a part can collide, which keeps the
sets of taken names small on big graphs. New copies go just before their first reader, in
bulk (:mod:`placement.graph.edit`); copies only a graph output reads go at the end.

Example:
    >>> COPY_OP_TYPE, bool(_COPY_LIKE("fc3_cuda_1")), _is_numbered("fc3_cuda_1_2", "fc3_cuda_1")
    ('Identity', True, True)
"""

from __future__ import annotations

import dataclasses
import re

import onnx_ir as ir
from onnx_ir.passes import PassResult

from placement.graph import edit
from placement.graph.device import Device
from placement.graph.nodes import COPY_KEY, DEVICE_KEY, name_of

__all__ = ["COPY_OP_TYPE", "CopyKey", "CopyMaker", "CopyNeed", "CopyResult"]

#: The ONNX op type of a copy.
COPY_OP_TYPE = "Identity"

_COPY_LIKE = re.compile(r"_(?:cuda|cpu)_\d").search  # what every name made here contains


#: A required copy: (the blob, ``id`` of its interned destination device; hashing ids is cheap).
CopyKey = tuple[ir.Value, int]


@dataclasses.dataclass
class CopyResult(PassResult):
    """What an injection did, and the model's copies afterwards."""

    added: int = 0
    removed: int = 0
    rewired: int = 0
    renamed: int = 0
    moved: int = 0
    copies: int = 0
    input_device: Device | None = None
    output_device: Device | None = None
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # per phase

    def __str__(self) -> str:
        return (
            f"{self.copies} copies ({self.added} added, {self.removed} removed, "
            f"{self.moved} moved), {self.rewired} inputs rewired, {self.renamed} blobs renamed; "
            f"inputs on {self.input_device}, outputs on {self.output_device}"
        )


@dataclasses.dataclass(slots=True)
class CopyNeed:
    """A required copy of ``origin`` to ``device``: where its first reader sits."""

    origin: ir.Value
    device: Device
    first_pos: int = -1  # position of the first reader on ``device``, -1: none (output only)
    first_node: ir.Node | None = None
    output_slot: int = -1  # >= 0 when this copy is graph output number ``output_slot``
    output_name: str = ""
    copy: ir.Value | None = None  # the blob the copy produces, once it exists (set by _apply)


class CopyMaker:
    """The copy-making half of an injection run (mixed into its engine).

    Needs the engine's ``graph``, ``result``, ``homes`` and the names its scan collected
    (``_op_names``, ``_blob_names``, ``_copy_nodes``; ``_value_names``/``_node_names``
    start as None and are built on first use).
    """

    graph: ir.Graph
    result: CopyResult
    homes: dict[ir.Value, Device]
    _value_names: set[str] | None
    _node_names: set[str] | None
    _bases: dict[ir.Value, str]
    _op_names: list[str]
    _blob_names: list[str]
    _copy_nodes: list[ir.Node]
    _spelled: dict[Device, tuple[str, str]]

    def _set_name(self, value: ir.Value, name: str | None, *, count: bool = True) -> None:
        """Rename a blob, keeping the set of taken names current."""
        if value.name == name:
            return
        names = self._names()  # the names as scanned, then every rename
        if value.name:
            names.discard(value.name)
        if name:
            names.add(name)
        value.name = name
        if count:
            self.result.renamed += 1

    def _new_copies(
        self, needs: dict[CopyKey, CopyNeed], keep: dict[CopyKey, ir.Node]
    ) -> list[tuple[CopyNeed, ir.Node]]:
        """The copies to create (every need no kept copy meets), not yet in the graph.

        Named in ``needs`` order (see the module doc): a copy that is a graph output
        takes the output's name and slot; any other is named after its blob and device.
        One loop with the IR's slots read directly (see ``graph_nodes``) and nodes made
        through :mod:`placement.graph.edit`: a million-op graph makes 250k of them.
        """
        created: list[tuple[CopyNeed, ir.Node]] = []
        add = created.append
        graph, bases, spelled = self.graph, self._bases, self._spelled
        names = self._names()
        node_names = self._node_names
        if node_names is None:
            node_names = self._node_names = set(filter(_COPY_LIKE, self._op_names))
        new_node, copy_shape, Value = edit.new_node, edit.copy_shape, ir.Value
        for key, need in needs.items():
            if key in keep:
                continue
            source, device = need.origin, need.device
            pair = spelled.get(device)
            if pair is None:
                pair = spelled[device] = (str(device), device.slug)
            if need.output_slot >= 0:
                name = need.output_name
                names.add(name)
                node_name = f"copy_{name}" if _COPY_LIKE(name) else f"copy_{name}_{pair[1]}"
            else:
                name = f"{bases.get(source) or source._name or 'blob'}_{pair[1]}"
                if name in names:
                    name = self._unique_value(name)
                else:
                    names.add(name)
                node_name = f"copy_{name}"  # the name ends in _<slug>(_<k>): copy-like already
            if node_name in node_names:
                node_name = self._unique_node(node_name)
            else:
                node_names.add(node_name)
            shape = source._shape
            out = Value(name=name, type=source._type, shape=copy_shape(shape) if shape is not None else None)
            static = source._is_initializer and not source._is_graph_input  # copy_kind, inlined
            kind = ("streamed" if source in self.homes else "static") if static else "dynamic"
            need.copy = out
            node = new_node(  # ir.Node(...), faster: see placement.graph.edit
                "",
                COPY_OP_TYPE,
                (source,),
                out,
                name=node_name,
                metadata_props={DEVICE_KEY: pair[0], COPY_KEY: kind},
            )
            if need.output_slot >= 0:
                graph.outputs[need.output_slot] = out
            add((need, node))
        return created

    def _place(self, node: ir.Node, need: CopyNeed) -> None:
        if need.first_node is not None:
            self.graph.insert_before(need.first_node, node)
        elif node.graph is None:
            self.graph.append(node)

    def _place_new(self, created: list[tuple[CopyNeed, ir.Node]]) -> None:
        """Insert new copies, each just before its first reader, in order; output-only ones last.

        The same order as placing them one by one: copies placed before the same op
        earlier stay ahead of later ones, and copies only graph outputs read are appended.
        """
        inserts: list[tuple[ir.Node, ir.Node]] = []
        last: list[ir.Node] = []
        for need, node in created:
            first = need.first_node
            if first is None:
                last.append(node)
            else:
                inserts.append((node, first))
        edit.insert_each(self.graph, inserts)  # graph.insert_before, in bulk
        if last:
            self.graph.extend(last)

    def _names(self) -> set[str]:
        """The blob names a copy's name could collide with (built on first use).

        Every name this pass makes ends in ``_<type>_<index>`` (optionally ``_<k>``),
        so only existing names containing such a part can collide; filtering in C
        keeps the set small on big graphs.
        """
        if self._value_names is None:
            graph = self.graph
            names = set(filter(_COPY_LIKE, self._blob_names))  # non-copy ops'
            names.update(filter(_COPY_LIKE, filter(None, map(name_of, graph.inputs))))
            names.update(filter(_COPY_LIKE, filter(None, graph.initializers)))
            names.update(filter(_COPY_LIKE, filter(None, (n.outputs[0].name for n in self._copy_nodes))))
            self._value_names = names
        return self._value_names

    def _unique_value(self, base: str) -> str:
        names = self._names()
        name, k = base, 0
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.add(name)
        return name

    def _unique_node(self, base: str) -> str:
        if self._node_names is None:
            self._node_names = set(filter(_COPY_LIKE, self._op_names))
        name, k = base, 0
        while name in self._node_names:
            k += 1
            name = f"{base}_{k}"
        self._node_names.add(name)
        return name


def _is_numbered(name: str | None, base: str) -> bool:
    """True for ``base_<k>``: the unique spelling of ``base`` chosen when it was taken."""
    return bool(name) and re.fullmatch(re.escape(base) + r"_\d+", name or "") is not None
