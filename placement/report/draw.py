"""Pictures of a placed model: the operator graph coloured by device, through Graphviz.

:func:`draw` turns a :class:`placement.Model` into a Graphviz graph and renders it
with the ``dot`` program (SVG, PNG or PDF, chosen by the file suffix):

* one box per op, filled with its device's colour (:func:`device_colour`; the same
  colour for the same device in every picture and in the HTML report);
* cross-device copies are not boxes but **edges**: a bold dashed red edge from the
  op that produced the blob to the op that reads its copy, labelled with the blob
  and its size. They are the stage boundaries: every such edge crosses from one
  stage to the next. In a model without injected copies the same edges mark
  every cross-device edge. Copies of parameters (static, done once at load time)
  move nothing per step and are listed in the tooltip of the op reading them;
  values computed from parameters alone (a transposed weight) are recomputed where
  they are read, at load time: their cross-device edges are dotted, without bytes;
  an op reading *streamed* weights (parameters that live on the host and are copied
  every run, see :func:`placement.stream_parameters`) has a thick blue border
  (:data:`STREAMED_COLOUR`), a "streamed" line in its label and the weights in its
  tooltip; the legend counts streamed copies and their bytes per step;
* module scopes (``blocks.0.attn``) become nested clusters;
* graph inputs and outputs are ellipses; a legend (the graph's label) gives each
  device's colour, op count and stages.

Big graphs are collapsed (``collapse="auto"``: more than ``max_nodes`` ops) to one
box per module scope and device, at the deepest scope level that still gives at
most ``max_nodes`` boxes, so a 2,000-op model stays readable; copy edges between
boxes carry the summed bytes of the distinct blobs crossing.

Without ``dot`` (Graphviz is not installed) the DOT source is written next to the
requested file (``placed.dot``) and :attr:`Drawing.note` says how to render it.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> acts = pl.get_activation_blobs(model)
    >>> _ = pl.shift_activation_devices(model, acts[2:], {0: 1})
    >>> _ = pl.inject_cross_device_copies(model)
    >>> drawing = pl.draw(model, None)          # no file: just the DOT source
    >>> drawing.ops, drawing.copy_edges, drawing.collapsed
    (5, 1, False)
    >>> device_colour("cuda:1") in drawing.dot
    True
"""

from __future__ import annotations

import dataclasses
import html
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import onnx_ir as ir

from placement.errors import ModelSaveError, PlacementError
from placement.graph.atomic import write_file
from placement.graph.device import Device, DeviceLike
from placement.graph.model import Model, value_nbytes
from placement.graph.nodes import COPY_KEY, is_copy_node, node_device, node_scope
from placement.graph.sizes import format_bytes

__all__ = [
    "draw",
    "Drawing",
    "device_colour",
    "scope_of",
    "DEVICE_PALETTE",
    "CPU_COLOUR",
    "FORMATS",
    "STREAMED_COLOUR",
]

log = logging.getLogger(__name__)

#: Fill colours of ``cuda:0``, ``cuda:1``, ... (Tableau 10, colour-blind friendly); cycles after 10.
DEVICE_PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#b07aa1",
    "#76b7b2",
    "#edc948",
    "#ff9da7",
    "#9c755f",
    "#8cd17d",
    "#a0cbe8",
)
#: Fill colour of ``cpu`` ops.
CPU_COLOUR = "#bab0ac"
#: Colour of copy (cut) edges.
COPY_EDGE_COLOUR = "#d62728"
#: Border of an op that reads weights streamed from the host every run.
STREAMED_COLOUR = "#1f4fd6"
#: Picture formats by file suffix; ``dot``/``gv`` write the DOT source only.
FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf", ".dot": "dot", ".gv": "dot"}

_ROOT = ""
_RANK = {"load": 0, "io": 1, "data": 1, "copy": 2}  # which edge wins when two join the same boxes


def device_colour(device: DeviceLike) -> str:
    """The fill colour of a device in pictures and charts: ``cuda:k`` -> ``DEVICE_PALETTE[k % 10]``.

    Example:
        >>> device_colour(0), device_colour("cuda:1"), device_colour("cpu")
        ('#4e79a7', '#f28e2b', '#bab0ac')
    """
    parsed = Device.parse(device)
    if parsed.type == "cpu":
        return CPU_COLOUR
    return DEVICE_PALETTE[(parsed.index or 0) % len(DEVICE_PALETTE)]


@dataclasses.dataclass
class Drawing:
    """What :func:`draw` made.

    Attributes:
        dot: the DOT source.
        path: the file written (the ``.dot`` file when ``dot`` was missing), or None.
        format: ``"svg"``, ``"png"``, ``"pdf"`` or ``"dot"`` (what ``path`` holds).
        rendered: True when Graphviz rendered the picture.
        collapsed: True when ops were grouped into one box per module scope and device.
        boxes: boxes drawn (ops, or groups when collapsed), inputs/outputs excluded.
        ops: ops drawn (copies excluded: they are edges).
        copy_edges: copy (cut) edges drawn.
        ops_per_device: ops per device string.
        note: a line for the user (e.g. how to render the DOT file), or None.
    """

    dot: str
    path: Path | None
    format: str
    rendered: bool
    collapsed: bool
    boxes: int
    ops: int
    copy_edges: int
    ops_per_device: dict[str, int]
    note: str | None = None


@dataclasses.dataclass
class _Edge:
    kind: str  # "data", "copy" (a cut between devices) or "io"
    blobs: dict[str, int]  # blob -> bytes (0 when unknown)


def draw(
    model: Model,
    path: str | os.PathLike[str] | None,
    *,
    collapse: bool | str = "auto",
    max_nodes: int = 120,
    title: str | None = None,
    stages: bool = True,
) -> Drawing:
    """Draw ``model``'s operator graph coloured by device (see the module docstring).

    Args:
        model: a :class:`placement.Model`, placed or not, copies injected or not. Not modified.
        path: the file to write; its suffix picks the format (``.svg``, ``.png``, ``.pdf``,
            ``.dot``). None writes nothing and returns the DOT source.
        collapse: ``"auto"`` (collapse when the model has more than ``max_nodes`` ops),
            True (always one box per module scope and device) or False (one box per op).
        max_nodes: most boxes a collapsed picture may have (and the ``"auto"`` threshold).
        title: the picture's title (default: the model's op and device counts).
        stages: name each device's stages in the legend (cuts the model into stages as
            the ONNX Runtime executor does; skipped when that fails).

    Returns:
        A :class:`Drawing`. Without Graphviz's ``dot`` the DOT source goes to
        ``path.with_suffix(".dot")`` and ``Drawing.note`` says how to render it.

    Raises:
        ModelSaveError: unknown suffix, or the file cannot be written (nothing is
            left half-written).
        PlanError: ``collapse`` or ``max_nodes`` is malformed.

    Example:
        >>> import placement as pl
        >>> from placement.models import gpt
        >>> model = pl.from_torch(*gpt.build("tiny"))
        >>> d = pl.draw(model, None, collapse=True, max_nodes=10)
        >>> d.collapsed, d.boxes <= 10, d.ops == len(model.ops)
        (True, True, True)
    """
    from placement.errors import PlanError

    if collapse not in (True, False, "auto"):
        raise PlanError(f"collapse must be True, False or 'auto', got {collapse!r}")
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise PlanError(f"max_nodes must be a positive integer, got {max_nodes!r}")
    target = Path(path) if path is not None else None
    fmt = "dot"
    if target is not None:
        fmt = FORMATS.get(target.suffix.lower(), "")
        if not fmt:
            raise ModelSaveError(
                f"cannot draw to {str(target)!r}: unknown picture format {target.suffix!r}; "
                f"use one of {', '.join(FORMATS)}"
            )
        if not target.parent.is_dir():
            raise ModelSaveError(
                f"cannot draw to {str(target)!r}: folder {str(target.parent)!r} does not exist"
            )

    builder = _Builder(model)
    n_ops = len(builder.ops)
    collapsed = collapse is True or (collapse == "auto" and n_ops > max_nodes)
    stage_names = _stage_names(model) if stages else {}
    dot = builder.dot(collapsed=collapsed, max_nodes=max_nodes, title=title, stages=stage_names)
    drawing = Drawing(
        dot=dot,
        path=None,
        format="dot",
        rendered=False,
        collapsed=collapsed,
        boxes=builder.boxes,
        ops=n_ops,
        copy_edges=builder.copy_edges,
        ops_per_device={str(d): n for d, n in sorted(builder.per_device.items())},
    )
    if target is None:
        return drawing
    if fmt == "dot":
        write_file(target, dot.encode())
        drawing.path, drawing.format = target, "dot"
        return drawing
    data = _render(dot, fmt)
    if data is None:
        dot_path = target.with_suffix(".dot")
        write_file(dot_path, dot.encode())
        drawing.path, drawing.format = dot_path, "dot"
        drawing.note = (
            f"Graphviz 'dot' was not found, so the graph went to {dot_path} (DOT source); install "
            f"Graphviz (Debian: apt-get install graphviz; or bash scripts/setup.sh as root) and run "
            f"dot -T{fmt} {dot_path} -o {target}"
        )
        log.warning("%s", drawing.note)
        return drawing
    write_file(target, data)
    drawing.path, drawing.format, drawing.rendered = target, fmt, True
    log.info("drew %d ops (%d boxes) to %s", n_ops, builder.boxes, target)
    return drawing


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


def dot_available() -> bool:
    """True if Graphviz's ``dot`` program is on ``PATH``."""
    return shutil.which("dot") is not None


def render_svg(dot: str) -> str | None:
    """Render DOT source to SVG text with ``dot``; None when ``dot`` is missing."""
    data = _render(dot, "svg")
    return data.decode("utf-8") if data is not None else None


def _render(dot: str, fmt: str) -> bytes | None:
    import graphviz

    if not dot_available():
        return None
    try:
        return graphviz.Source(dot).pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        return None
    except graphviz.CalledProcessError as err:  # a dot crash on our source is a bug worth naming
        stderr = (err.stderr or b"").decode(errors="replace").strip().splitlines()
        raise PlacementError(f"Graphviz dot failed: {stderr[-1] if stderr else err}") from err


def _stage_names(model: Model) -> dict[str, int]:
    """Op name -> stage index, as the ONNX Runtime executor cuts the model ({} on failure)."""
    from placement.runtime.stages import partition

    try:
        found = partition(model)
    except PlacementError as err:
        log.info("no stages in the picture: %s", err)
        return {}
    return {op: stage.index for stage in found for op in stage.ops}


class _Builder:
    """Reads the graph once: ops, their devices and scopes, and the edges between them."""

    def __init__(self, model: Model) -> None:
        graph = model.graph
        self.model = model
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
                self._add(src, me, "copy" if cut else "data", root.name or "?", int(value_nbytes(root) or 0))
        for i, value in enumerate(self.model.graph.outputs):
            src, _, crossed, _ = self._source(value)
            if src is not None:
                root, _ = self._root(value)
                self._add(
                    src,
                    f"out{i}",
                    "copy" if crossed else "io",
                    root.name or "?",
                    int(value_nbytes(root) or 0),
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
            keys: dict[tuple[str, Device], str] = {}
            trial: dict[int, tuple[str, Device, str]] = {}
            for n in self.ops:
                scope = ".".join(scopes[id(n)].split(".")[:depth]) if scopes[id(n)] else ""
                dev = self.device[id(n)]
                box = keys.setdefault((scope, dev), f"g{len(keys)}")
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
        streamed = [n for n in self.model.graph if n.metadata_props.get(COPY_KEY) == "streamed"]
        if streamed:
            nbytes = sum(int(value_nbytes(n.inputs[0]) or 0) for n in streamed if n.inputs and n.inputs[0])
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
