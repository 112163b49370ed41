"""The node-level vocabulary of a placed graph: metadata keys and fast node helpers.

Placement state lives in the IR itself (see :mod:`placement.graph.model`): each
node's device in ``metadata_props["placement.device"]``, copies marked
``placement.copy``, module scopes, streamed parameters. This module names those
keys and holds the helpers passes call per node over large graphs (device, copy
test, scope, subgraph reads, a fast node snapshot). It depends on nothing above
:mod:`placement.graph.device`, so every graph module may import it.

Example:
    >>> import onnx_ir as ir
    >>> x = ir.Value(name="x")
    >>> relu = ir.Node("", "Relu", [x], name="relu")
    >>> relu.metadata_props[DEVICE_KEY] = "cuda:1"
    >>> node_device(relu), is_copy_node(relu)
    (Device('cuda:1'), False)
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Iterator

import onnx_ir as ir

from placement.errors import DeviceError, VerificationError
from placement.graph.device import Device

__all__ = [
    "DEVICE_KEY",
    "COPY_KEY",
    "SCOPE_KEY",
    "INPUT_DEVICE_KEY",
    "OUTPUT_DEVICE_KEY",
    "STREAMED_KEY",
    "STREAM_WINDOW_KEY",
    "COLLECTIVE_KEY",
    "TP_KEY",
    "collective_tag",
    "COPY_KINDS",
    "streamed_homes",
    "stream_window",
    "SUBGRAPH_OP_TYPES",
    "subgraphs_of",
    "node_reads",
    "subgraph_initializers",
    "name_of",
    "graph_nodes",
    "node_device",
    "set_node_device",
    "is_copy_node",
    "node_scope",
    "scope_from_torch_name_scopes",
]


DEVICE_KEY = "placement.device"
COPY_KEY = "placement.copy"
SCOPE_KEY = "placement.scope"
INPUT_DEVICE_KEY = "placement.input_device"
OUTPUT_DEVICE_KEY = "placement.output_device"
STREAMED_KEY = "placement.streamed"
STREAM_WINDOW_KEY = "placement.stream_window"
#: A collective of a tensor-parallel split (an all-reduce ``Sum`` or an all-gather ``Concat``
#: over copies): JSON ``{"kind": "all_reduce"|"all_gather", "group": [devices], "id": n}``.
COLLECTIVE_KEY = "placement.collective"
#: What a tensor-parallel op's outputs hold: ``shard`` (a slice of the full value) or
#: ``partial`` (one device's summand of the full value, read only by an all-reduce).
TP_KEY = "placement.tensor_parallel"
#: The values of ``placement.copy``: a copy of an activation or graph input made every run
#: (``dynamic``), of a parameter made once at load time (``static``), or of a parameter that
#: lives in host memory and is copied every run, prefetched ahead of its use (``streamed``).
COPY_KINDS = ("dynamic", "static", "streamed")
_TORCH_SCOPES_KEY = "pkg.torch.onnx.name_scopes"


# --- node-level helpers (fast paths for passes over large graphs) -----------------


def streamed_homes(ir_model: ir.Model) -> dict[str, Device]:
    """Streamed parameter -> the host device it lives on (``{}`` when nothing streams).

    Raises:
        VerificationError: the ``placement.streamed`` annotation is malformed.
    """
    text = ir_model.metadata_props.get(STREAMED_KEY)
    if not text:
        return {}
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise TypeError("not an object")
        return {str(name): Device.parse(spec) for name, spec in raw.items()}
    except (ValueError, TypeError, DeviceError) as err:
        raise VerificationError(f"malformed {STREAMED_KEY} annotation {text[:80]!r}: {err}") from err


def stream_window(ir_model: ir.Model) -> int | None:
    """The prefetch window of streamed parameters in bytes, or None (unset: runtimes double-buffer)."""
    text = ir_model.metadata_props.get(STREAM_WINDOW_KEY)
    if not text:
        return None
    try:
        return max(0, int(text))
    except ValueError as err:
        raise VerificationError(f"malformed {STREAM_WINDOW_KEY} annotation {text!r}") from err


#: Standard ONNX ops with subgraphs (``Loop``/``Scan`` bodies, ``If`` branches, ``SequenceMap``).
SUBGRAPH_OP_TYPES = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def subgraphs_of(node: ir.Node) -> list[tuple[str, ir.Graph]]:
    """``node``'s subgraphs (a ``Loop``/``Scan`` body, ``If`` branches), each with its label:
    the attribute's name, ``"<name>.<i>"`` for a list of graphs.

    Example:
        >>> import onnx_ir as ir
        >>> body = ir.Graph([], [], nodes=[], name="body")
        >>> loop = ir.Node("", "Loop", [], attributes=[ir.AttrGraph("body", body)])
        >>> [label for label, _ in subgraphs_of(loop)]
        ['body']
    """
    graphs: list[tuple[str, ir.Graph]] = []
    for attribute in node.attributes.values():
        if attribute.type == ir.AttributeType.GRAPH:
            graphs.append((attribute.name, attribute.as_graph()))
        elif attribute.type == ir.AttributeType.GRAPHS:
            graphs += [(f"{attribute.name}.{i}", g) for i, g in enumerate(attribute.as_graphs())]
    return graphs


def node_reads(node: ir.Node, graph: ir.Graph | None) -> Iterator[ir.Value]:
    """The values of ``graph`` that ``node`` reads: its inputs, and what its subgraphs (nested
    ones too) read of ``graph`` (outer-scope reads)."""
    for value in node.inputs:
        if value is not None:
            yield value
    for _, sub in subgraphs_of(node):
        for inner in sub.all_nodes():
            for value in inner.inputs:
                if value is not None and value.graph is graph:
                    yield value


def subgraph_initializers(graph: ir.Graph, prefix: str = "") -> Iterator[tuple[str, ir.Value, ir.Graph]]:
    """The initializers of every subgraph under ``graph`` (``Loop``/``Scan`` bodies, ``If``
    branches, nested ones too), each as ``(key, value, its graph)``: the key is
    ``"<op name>/<graph attribute>/<initializer name>"`` (nested: the op path first), the name
    ``Model.update_parameters`` and ``pl.to_torch``'s ``initializer_paths`` give it.

    Example:
        >>> import onnx_ir as ir
        >>> w = ir.Value(name="w", const_value=ir.tensor([1.0]))
        >>> body = ir.Graph([], [], nodes=[], initializers=[w], name="body")
        >>> loop = ir.Node("", "Loop", [], attributes=[ir.AttrGraph("body", body)], name="loop")
        >>> [key for key, _, _ in subgraph_initializers(ir.Graph([], [], nodes=[loop]))]
        ['loop/body/w']
    """
    for node in graph:
        for label, sub in subgraphs_of(node):
            here = f"{prefix}{node.name}/{label}/"
            for name, value in sub.initializers.items():
                yield here + name, value, sub
            yield from subgraph_initializers(sub, here)


#: ``Node.name`` / ``Value.name`` read from onnx_ir's ``_name`` slot, without the property
#: call (see :func:`graph_nodes`; ``tests/graph/test_model.py`` checks the slot exists).
name_of = operator.attrgetter("_name")


def graph_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The nodes of ``graph`` in order, as a list (a snapshot, like ``list(graph)``).

    Walks the links of onnx_ir's node list directly, which skips the per-node
    checks of its safe-mutation iterator (a fifth of a pass's scan on big graphs);
    falls back to ``list(graph)`` if onnx_ir's internals differ from 1.1's.

    Passes over million-op graphs also read a few of onnx_ir's slots directly
    (``Node._inputs``/``_outputs``/``_metadata_props``, ``Value._name``/``_is_initializer``):
    each property call costs about 0.1 us, several per op per scan.
    ``tests/graph/test_model.py`` checks those slots exist. Writing slots is confined to
    :mod:`placement.graph.edit` (bulk node creation, rewiring and insertion for passes).

    Example:
        >>> import onnx_ir as ir
        >>> x = ir.Value(name="x")
        >>> relu = ir.Node("", "Relu", [x], name="relu")
        >>> graph = ir.Graph([x], relu.outputs, nodes=[relu])
        >>> [node.name for node in graph_nodes(graph)]
        ['relu']
    """
    nodes = getattr(graph, "_nodes", None)
    root = getattr(nodes, "_root", None)
    if root is None or getattr(root, "next", None) is None:
        return list(graph)
    out: list[ir.Node] = []
    keep = out.append
    box = root.next
    while box is not root:
        value = box.value
        if value is not None:  # an erased box (removed while iterating elsewhere)
            keep(value)
        box = box.next
    return out


def collective_tag(node: ir.Node) -> dict[str, object] | None:
    """The collective tag of a node (``kind``, ``group``, ``id``), or None for other nodes.

    Raises:
        VerificationError: the tag is malformed.

    Example:
        >>> import onnx_ir as ir
        >>> node = ir.Node("", "Sum", [], name="s")
        >>> tag = '{"kind": "all_reduce", "group": ["cuda:0", "cuda:1"], "id": 0}'
        >>> node.metadata_props[COLLECTIVE_KEY] = tag
        >>> collective_tag(node)["kind"]
        'all_reduce'
    """
    text = node.metadata_props.get(COLLECTIVE_KEY)
    if text is None:
        return None
    try:
        tag = json.loads(text)
        if not isinstance(tag, dict) or tag.get("kind") not in ("all_reduce", "all_gather"):
            raise TypeError("kind is neither all_reduce nor all_gather")
        tag["group"] = [str(Device.parse(d)) for d in tag["group"]]
        tag["id"] = int(tag["id"])
    except (ValueError, TypeError, KeyError, DeviceError) as err:
        raise VerificationError(
            f"op {node.name!r} has a malformed {COLLECTIVE_KEY} tag {text[:80]!r}: {err}"
        ) from err
    return tag


def node_device(node: ir.Node) -> Device:
    """The device of an IR node, read from its metadata (``cuda:0`` if unset)."""
    spec = node.metadata_props.get(DEVICE_KEY)
    return Device.parse(spec) if spec is not None else Device("cuda", 0)


def set_node_device(node: ir.Node, device: Device) -> None:
    """Set the device of an IR node (no validation; see :meth:`Model.set_device`)."""
    node.metadata_props[DEVICE_KEY] = str(device)


def is_copy_node(node: ir.Node) -> bool:
    """True if the node is a cross-device copy made by ``placement``."""
    return COPY_KEY in node.metadata_props


def node_scope(node: ir.Node) -> str | None:
    """The module path that produced a node, or None (root-level or unknown)."""
    props = node.metadata_props
    scope = props.get(SCOPE_KEY)
    if scope is None:
        scopes = props.get(_TORCH_SCOPES_KEY)
        scope = scope_from_torch_name_scopes(scopes) if scopes else None
    return _clean_scope(scope)


def _clean_scope(scope: str | None) -> str | None:
    """A module path without empty components: a file's ``.``, ``..`` or ``.a`` read as
    ``None``, ``None`` and ``a`` (an empty component would make a scope its own parent)."""
    if not scope:
        return None
    return ".".join(part for part in scope.split(".") if part) or None


def scope_from_torch_name_scopes(text: str) -> str | None:
    """Module path from the exporter's ``pkg.torch.onnx.name_scopes`` metadata.

    The exporter stores ``['', 'block', 'block.1', 'linear_1']``: module paths
    from the root down, then the FX node name. The op's module is the last path.
    """
    try:
        scopes = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    if not isinstance(scopes, list) or len(scopes) < 2:
        return None
    return str(scopes[-2]) or None
