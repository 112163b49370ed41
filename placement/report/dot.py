"""The Graphviz DOT source of a placed model: boxes, module clusters, copy edges, the legend.

:class:`DotBuilder` reads a model once (ops, the blobs between them, which crossings are
copies, load-time values or streamed weights) and writes DOT, either one box per op in
nested module-scope clusters or, collapsed, one box per module scope and device
(:func:`placement.report.draw.draw` chooses and renders). :func:`scope_of` is the module
scope an op is drawn in.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> builder = DotBuilder(pl.from_torch(*mlp.build("tiny")))
    >>> dot = builder.dot(collapsed=False, max_nodes=50, title=None, stages={})
    >>> dot.startswith("digraph")
    True
"""

from __future__ import annotations

import dataclasses
import html
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import onnx_ir as ir

from placement.graph.device import Device
from placement.graph.model import Model, value_nbytes
from placement.graph.nodes import COPY_KEY, collective_tag, is_copy_node, node_device, node_scope
from placement.graph.sizes import format_bytes
from placement.planning.dims import planned_dims
from placement.report.collectives import received_bytes
from placement.report.colours import COLLECTIVE_COLOUR, COPY_EDGE_COLOUR, STREAMED_COLOUR, device_colour

__all__ = ["DotBuilder", "scope_of"]

log = logging.getLogger(__name__)


_ROOT = ""


_RANK = {"load": 0, "io": 1, "data": 1, "copy": 2}  # which edge wins when two join the same boxes


@dataclasses.dataclass
class _Edge:
    kind: str  # "data", "copy" (a cut between devices) or "io"
    blobs: dict[str, int]  # blob -> bytes (0 when unknown)


def scope_of(node: ir.Node) -> str | None:
    """The module path of an op: its recorded scope, else one read from a path-like op name.

    ``placement`` and the dynamo exporter record scopes in metadata
    (:func:`placement.graph.nodes.node_scope`); the TorchScript exporter
    (``dynamo=False``) and tools following it name ops ``/layer1/layer1.0/conv1/Conv``,
    which reads as ``layer1.0.conv1``.

    Example:
        >>> import onnx_ir as ir
        >>> scope_of(ir.Node("", "Conv", [], name="/layer2/layer2.0/downsample/downsample.0/Conv"))
        'layer2.0.downsample.0'
        >>> scope_of(ir.Node("", "Relu", [], name="relu_3")) is None
        True
    """
    recorded = node_scope(node)
    if recorded is not None:
        return recorded
    name = node.name or ""
    if not name.startswith("/") or name.count("/") < 2:
        return None
    parts: list[str] = []
    for component in name.strip("/").split("/")[:-1]:
        if not component:
            continue
        if parts and component.startswith(parts[-1] + "."):  # "layer1" then "layer1.0"
            parts.append(component[len(parts[-1]) + 1 :])
        else:
            parts.append(component)
    return ".".join(p for part in parts for p in part.split(".") if p) or None


class DotBuilder:
    """Reads the graph once: ops, their devices and scopes, and the edges between them."""

    def __init__(self, model: Model, *, dims: Mapping[str, int] | None = None) -> None:
        graph = model.graph
        self.model = model
        #: the sizes symbolic dimensions count at (:func:`placement.planning.dims.planned_dims`)
        self.dims = dict(dims) if dims is not None else planned_dims(model)
        self.ops: list[ir.Node] = [n for n in graph if not is_copy_node(n)]
        self.index = {id(n): i for i, n in enumerate(self.ops)}
        self.device = {id(n): node_device(n) for n in self.ops}
        self.per_device: dict[Device, int] = {}
        for node in self.ops:
            dev = self.device[id(node)]
            self.per_device[dev] = self.per_device.get(dev, 0) + 1
        self.static: dict[int, list[str]] = {}  # op -> parameters copied in at load time
        self.streamed: dict[int, list[str]] = {}  # op -> streamed parameters it reads
        self.edges: dict[tuple[str, str], _Edge] = {}
        self.input_ids = {v.name: f"in{i}" for i, v in enumerate(model.graph.inputs) if v.name}
        self.inputs = [v for v in graph.inputs if v.name and v.name not in graph.initializers]
        self.boxes = 0
        self.copy_edges = 0
        from placement.analysis.dependence import load_time_values

        self.fixed = load_time_values(graph)
        self._read_edges()

    def _root(self, value: ir.Value) -> tuple[ir.Value, bool]:
        """The value a chain of copies starts from, and whether a copy was crossed."""
        crossed = False
        producer = value.producer()
        while producer is not None and is_copy_node(producer) and producer.inputs and producer.inputs[0]:
            crossed = True
            value = producer.inputs[0]
            producer = value.producer()
        return value, crossed

    def _source(self, value: ir.Value) -> tuple[str | None, Device | None, bool, bool]:
        """(node key, device, crossed a copy, is a parameter) of where ``value`` comes from."""
        root, crossed = self._root(value)
        producer = root.producer()
        if producer is not None:
            return f"op{self.index[id(producer)]}", self.device[id(producer)], crossed, False
        if root.is_initializer() or root.const_value is not None:
            return None, None, crossed, True
        key = self.input_ids.get(root.name or "")
        return key, self.model.input_device, crossed, False

    def _add(self, src: str, dst: str, kind: str, blob: str, nbytes: int) -> None:
        edge = self.edges.get((src, dst))
        if edge is None or _RANK[kind] > _RANK[edge.kind]:
            edge = self.edges[(src, dst)] = _Edge(kind, {})
        elif _RANK[kind] < _RANK[edge.kind]:
            return
        edge.blobs[blob] = nbytes

    def _read_edges(self) -> None:
        for node in self.ops:
            me = f"op{self.index[id(node)]}"
            my_device = self.device[id(node)]
            for value in node.inputs:
                if value is None:
                    continue
                src, src_device, crossed, is_param = self._source(value)
                root, _ = self._root(value)
                if is_param:
                    producer = value.producer()
                    if producer is not None and producer.metadata_props.get(COPY_KEY) == "streamed":
                        self.streamed.setdefault(id(node), []).append(root.name or "?")
                    elif crossed:
                        self.static.setdefault(id(node), []).append(root.name or "?")
                    continue
                if src is None:
                    continue
                cut = crossed or (src_device is not None and src_device != my_device and src.startswith("op"))
                if cut and root in self.fixed:  # a load-time value: recomputed where read, never moved
                    self.static.setdefault(id(node), []).append(root.name or "?")
                    self._add(src, me, "load", root.name or "?", 0)
                    continue
                nbytes = int(value_nbytes(root, self.dims) or 0)
                self._add(src, me, "copy" if cut else "data", root.name or "?", nbytes)
        for i, value in enumerate(self.model.graph.outputs):
            src, _, crossed, _ = self._source(value)
            if src is not None:
                root, _ = self._root(value)
                self._add(
                    src,
                    f"out{i}",
                    "copy" if crossed else "io",
                    root.name or "?",
                    int(value_nbytes(root, self.dims) or 0),
                )

    # -- DOT ------------------------------------------------------------------------

    def dot(self, *, collapsed: bool, max_nodes: int, title: str | None, stages: dict[str, int]) -> str:
        import graphviz

        g = graphviz.Digraph("placement", format="svg")
        g.attr(rankdir="TB", fontname="Helvetica", fontsize="12", labelloc="t", newrank="true")
        g.attr("node", shape="box", style="rounded,filled", fontname="Helvetica", fontsize="10")
        g.attr("edge", fontname="Helvetica", fontsize="9", color="#555555", arrowsize="0.6")
        groups = self._groups(collapsed, max_nodes)
        box_of: dict[str, str] = {}  # op key -> box key
        boxes: dict[str, dict[str, Any]] = {}
        for node in self.ops:
            key = f"op{self.index[id(node)]}"
            group = groups[id(node)]
            box = group[2]
            box_of[key] = box
            info = boxes.setdefault(
                box, {"scope": group[0], "device": group[1], "nodes": [], "name": group[3]}
            )
            info["nodes"].append(node)
        self.boxes = len(boxes)

        tree: dict[str, list[str]] = {}  # scope -> its boxes
        for box, info in boxes.items():
            tree.setdefault(info["scope"], []).append(box)
        self._emit_tree(g, tree, boxes, collapsed, stages)

        for value in self.inputs:
            key = self.input_ids[value.name or ""]
            g.node(key, label=_label(value.name or "", _shape_text(value)), shape="ellipse", style="", id=key)
            box_of[key] = key
        for i, value in enumerate(self.model.graph.outputs):
            g.node(f"out{i}", label=_label(value.name or "", _shape_text(value)), shape="ellipse", style="")
            box_of[f"out{i}"] = f"out{i}"

        merged: dict[tuple[str, str], _Edge] = {}
        for (src, dst), edge in self.edges.items():
            a, b = box_of.get(src), box_of.get(dst)
            if a is None or b is None or a == b:
                continue
            found = merged.get((a, b))
            if found is None:
                merged[(a, b)] = _Edge(edge.kind, dict(edge.blobs))
            elif _RANK[edge.kind] > _RANK[found.kind]:  # a copy edge keeps only copied blobs
                merged[(a, b)] = _Edge(edge.kind, dict(edge.blobs))
            elif edge.kind == found.kind:
                found.blobs.update(edge.blobs)
        for (a, b), edge in merged.items():
            if edge.kind == "copy":
                self.copy_edges += 1
                names = list(edge.blobs)
                what = names[0] if len(names) == 1 else f"{len(names)} blobs"
                g.edge(
                    a,
                    b,
                    label=f"{what}\n{format_bytes(sum(edge.blobs.values()))}",
                    color=COPY_EDGE_COLOUR,
                    fontcolor=COPY_EDGE_COLOUR,
                    style="dashed,bold",
                    penwidth="2",
                    tooltip="copy: " + ", ".join(names[:20]),
                    **{"class": "copy"},
                )
            elif edge.kind == "load":
                g.edge(a, b, style="dotted", tooltip="load-time value: " + ", ".join(list(edge.blobs)[:20]))
            else:
                g.edge(a, b)
        g.attr(label=self._legend(title, stages), labeljust="l")
        return g.source

    def _emit_tree(
        self,
        g: Any,
        tree: dict[str, list[str]],
        boxes: dict[str, dict[str, Any]],
        collapsed: bool,
        stages: dict[str, int],
    ) -> None:
        children: dict[str, set[str]] = {}
        for scope in tree:
            parts = scope.split(".") if scope else []
            for depth in range(len(parts)):
                parent = ".".join(parts[:depth])
                children.setdefault(parent, set()).add(".".join(parts[: depth + 1]))

        def emit(sub: Any, scope: str) -> None:
            for box in tree.get(scope, []):
                self._emit_box(sub, box, boxes[box], collapsed, stages)
            for child in sorted(children.get(scope, ()), key=_natural):
                with sub.subgraph(name=f"cluster_{_safe(child)}") as cluster:
                    cluster.attr(
                        label=child.rsplit(".", 1)[-1] if "." in child else child,
                        tooltip=child,
                        style="rounded,dashed",
                        color="#999999",
                        fontcolor="#555555",
                        fontsize="10",
                    )
                    emit(cluster, child)

        emit(g, _ROOT)

    def _emit_box(
        self, g: Any, box: str, info: dict[str, Any], collapsed: bool, stages: dict[str, int]
    ) -> None:
        device: Device = info["device"]
        nodes: list[ir.Node] = info["nodes"]
        colour = device_colour(device)
        cls = f"op dev_{device.type}_{device.index if device.index is not None else 0}"
        stage_ids = sorted({stages[n.name] for n in nodes if n.name in stages})
        stage_text = f" stage {','.join(map(str, stage_ids))}" if stage_ids else ""
        if all(collective_tag(n) is not None for n in nodes):
            self._emit_collective(
                g, box, nodes, device, cls, stage_text, title=info["name"] if collapsed else None
            )
            return
        if collapsed:
            scope = info["name"] or "(top level)"
            types: dict[str, int] = {}
            for n in nodes:
                types[n.op_type] = types.get(n.op_type, 0) + 1
            top = ", ".join(f"{t} x{c}" for t, c in sorted(types.items(), key=lambda kv: -kv[1])[:4])
            streamed = [p for n in nodes for p in self.streamed.get(id(n), ())]
            count = f"{len(nodes)} op{'s' if len(nodes) > 1 else ''} on {device}"
            g.node(
                box,
                label=_label(scope, count + (f"; {len(streamed)} weights streamed" if streamed else "")),
                fillcolor=colour,
                tooltip=f"{scope} on {device}{stage_text}: {top}"
                + (
                    "; weights streamed from the host every run: " + ", ".join(streamed[:10])
                    if streamed
                    else ""
                ),
                id=box,
                **{"class": cls + (" streamed" if streamed else "")},
                **_streamed_style(bool(streamed)),
            )
            return
        node = nodes[0]
        static = self.static.get(id(node))
        streamed = self.streamed.get(id(node))
        tip = f"{node.name} ({node.op_type}) on {device}{stage_text}"
        if static:
            tip += "; parameters copied in at load time: " + ", ".join(static[:10])
        if streamed:
            tip += "; weights streamed from the host every run: " + ", ".join(streamed[:10])
        g.node(
            box,
            label=_label(node.op_type, _short(node.name or "") + ("\nstreamed" if streamed else "")),
            fillcolor=colour,
            tooltip=tip,
            id=box,
            **{"class": cls + (" streamed" if streamed else "")},
            **_streamed_style(bool(streamed)),
        )

    def _emit_collective(
        self,
        g: Any,
        box: str,
        nodes: list[ir.Node],
        device: Device,
        cls: str,
        stage_text: str,
        *,
        title: str | None,
    ) -> None:
        """A collective (or, collapsed, a scope's collectives on one device): a hexagon with a thick
        border, labelled with the kind and the bytes of the value it makes."""
        kinds: dict[str, int] = {}
        for n in nodes:
            kind = str((collective_tag(n) or {}).get("kind", "collective"))
            kinds[kind] = kinds.get(kind, 0) + 1
        nbytes = sum(int(value_nbytes(n.outputs[0], self.dims) or 0) for n in nodes if n.outputs)
        read = sum(received_bytes(n, self.dims) for n in nodes)
        what = ", ".join(k if c == 1 else f"{c} x {k}" for k, c in kinds.items()).replace("_", "-")
        ids = sorted({str((collective_tag(n) or {}).get("id")) for n in nodes})
        g.node(
            box,
            label=_label(*((title,) if title else ()), what, format_bytes(nbytes)),
            shape="hexagon",
            style="filled,bold",
            fillcolor=device_colour(device),
            color=COLLECTIVE_COLOUR,
            penwidth="2.5",
            tooltip=f"{what} on {device}{stage_text} (id {', '.join(ids[:10])}): "
            f"{format_bytes(nbytes)} made, {format_bytes(read)} read from other devices per step",
            id=box,
            **{"class": cls + " collective"},
        )

    def _groups(self, collapsed: bool, max_nodes: int) -> dict[int, tuple[str, Device, str, str]]:
        """Op -> (scope of its cluster, device, box key, box title)."""
        scopes = {id(n): scope_of(n) or "" for n in self.ops}
        if not collapsed:
            return {
                id(n): (scopes[id(n)], self.device[id(n)], f"op{self.index[id(n)]}", "") for n in self.ops
            }
        deepest = max((len(s.split(".")) for s in scopes.values() if s), default=0)
        best: dict[int, tuple[str, Device, str]] = {}
        for depth in range(0, deepest + 1):
            keys: dict[tuple[str, Device, bool], str] = {}
            trial: dict[int, tuple[str, Device, str]] = {}
            for n in self.ops:
                scope = ".".join(scopes[id(n)].split(".")[:depth]) if scopes[id(n)] else ""
                dev = self.device[id(n)]
                box = keys.setdefault((scope, dev, collective_tag(n) is not None), f"g{len(keys)}")
                trial[id(n)] = (scope, dev, box)
            if best and len(keys) > max_nodes:
                break
            best = trial
        # a box's cluster is its scope's parent: the box stands for the scope itself
        return {k: (_parent(scope), dev, box, scope) for k, (scope, dev, box) in best.items()}

    def _legend(self, title: str | None, stages: dict[str, int]) -> str:
        n_copies = sum(1 for n in self.model.graph if is_copy_node(n))
        static = sum(
            1
            for n in self.model.graph
            if is_copy_node(n)
            and (
                n.metadata_props.get(COPY_KEY) == "static"
                or (n.inputs and n.inputs[0] is not None and self._root(n.inputs[0])[0] in self.fixed)
            )
        )
        head = title or f"{len(self.ops)} ops on {len(self.per_device)} device(s), {n_copies} copies"
        rows = [f'<TR><TD COLSPAN="3" ALIGN="LEFT"><B>{html.escape(head)}</B></TD></TR>']
        for device in sorted(self.per_device):
            ids = sorted(
                {stages[n.name] for n in self.ops if self.device[id(n)] == device and n.name in stages}
            )
            where = f"stage {', '.join(map(str, ids))}" if ids else ""
            rows.append(
                f'<TR><TD BGCOLOR="{device_colour(device)}" WIDTH="24"> </TD>'
                f'<TD ALIGN="LEFT">{html.escape(str(device))}: {self.per_device[device]} ops</TD>'
                f'<TD ALIGN="LEFT">{html.escape(where)}</TD></TR>'
            )
        rows.append(
            f'<TR><TD COLSPAN="3" ALIGN="LEFT"><FONT COLOR="{COPY_EDGE_COLOUR}">- - -&gt;</FONT> '
            f"copy between devices (blob, bytes per step); dotted: load-time values; "
            f"copies done once at load time: {static}</TD></TR>"
        )
        collectives = [n for n in self.ops if collective_tag(n) is not None]
        if collectives:
            ids = {str((collective_tag(n) or {}).get("id")) for n in collectives}
            rows.append(
                f'<TR><TD COLSPAN="3" ALIGN="LEFT"><FONT COLOR="{COLLECTIVE_COLOUR}"><B>hexagon</B></FONT>: '
                f"tensor-parallel collective (kind, bytes of its value): {len(ids)} collectives, "
                f"{len(collectives)} nodes</TD></TR>"
            )
        streamed = [n for n in self.model.graph if n.metadata_props.get(COPY_KEY) == "streamed"]
        if streamed:
            sources = [n.inputs[0] for n in streamed if n.inputs and n.inputs[0] is not None]
            nbytes = sum(int(value_nbytes(v, self.dims) or 0) for v in sources)
            rows.append(
                f'<TR><TD COLSPAN="3" ALIGN="LEFT">'
                f'<FONT COLOR="{STREAMED_COLOUR}"><B>thick border</B></FONT>: '
                f"reads weights streamed from the host every run: {len(streamed)} copies, "
                f"{html.escape(format_bytes(nbytes))} per step</TD></TR>"
            )
        return '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="2">' + "".join(rows) + "</TABLE>>"


def _streamed_style(streamed: bool) -> dict[str, str]:
    """Graphviz attributes of a box whose op reads streamed weights."""
    return {"color": STREAMED_COLOUR, "penwidth": "3"} if streamed else {}


def _parent(scope: str) -> str:
    return scope.rsplit(".", 1)[0] if "." in scope else _ROOT


def _natural(text: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in text.split(".")]


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def _short(name: str, limit: int = 28) -> str:
    return name if len(name) <= limit else "..." + name[-(limit - 3) :]


def _label(*lines: str) -> str:
    return "\n".join(line for line in lines if line)


def _shape_text(value: ir.Value) -> str:
    shape = value.shape
    dims: Iterable[Any] = shape if shape is not None else ()
    dtype = value.dtype.name.lower() if value.dtype is not None else ""
    return f"{dtype}[{','.join(str(d) for d in dims)}]" if shape is not None else dtype
