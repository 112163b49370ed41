"""The tensor-parallel collectives of a placed model, one row each, for the report and pictures.

A collective (an all-reduce: a ``Sum`` of the copied partials on each device; an all-gather: a
``Concat`` of the copied shards) is one node per device, tagged with the same id
(:func:`placement.graph.nodes.collective_tag`). :func:`collective_rows` gathers those nodes
into one :class:`CollectiveRow` per collective with the bytes of the value it makes and, per
device, the bytes that device reads from the others through copies (what moves per step).

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> _ = pl.split_tensor_parallel(model, devices=[0, 1])
    >>> [(r.kind, r.nbytes, r.received) for r in collective_rows(model)]
    [('all_reduce', 512, {'cuda:0': 512, 'cuda:1': 512}), ('all_gather', 128, {'cuda:0': 64})]
"""

from __future__ import annotations

import html
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import onnx_ir as ir

from placement.graph.model import Model, value_nbytes
from placement.graph.nodes import collective_tag, is_copy_node, node_device, node_scope
from placement.graph.sizes import format_bytes
from placement.planning.dims import planned_dims

__all__ = ["CollectiveRow", "collective_rows", "collectives_html", "received_bytes"]

log = logging.getLogger(__name__)


@dataclass
class CollectiveRow:
    """One collective.

    Attributes:
        id: its id (the tag's ``id``; all its per-device nodes share it).
        kind: ``"all_reduce"`` or ``"all_gather"``.
        group: the devices of its group (the tag's ``group``).
        scope: the module scope of the op whose result it combines, or None.
        nbytes: bytes of the whole value it makes on each device.
        received: device -> bytes it reads from the other devices through copies per step.
        nodes: its per-device node names.
    """

    id: int
    kind: str
    group: list[str]
    scope: str | None
    nbytes: int
    received: dict[str, int] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)


def received_bytes(node: ir.Node, dims: Mapping[str, int] | None = None) -> int:
    """Bytes a collective node reads from other devices: its inputs that arrive through copies."""
    total = 0
    for value in node.inputs:
        producer = value.producer() if value is not None else None
        if value is not None and producer is not None and is_copy_node(producer):
            total += int(value_nbytes(value, dims) or 0)
    return total


def collective_rows(model: Model, *, dims: Mapping[str, int] | None = None) -> list[CollectiveRow]:
    """One row per collective of ``model``, in graph order (empty for a model without them).

    Symbolic dimensions count at ``dims`` (default
    :func:`placement.planning.dims.planned_dims`).
    """
    sizes = planned_dims(model) if dims is None else dims
    rows: dict[int, CollectiveRow] = {}
    for node in model.graph:
        tag = collective_tag(node)
        if tag is None:
            continue
        key = int(tag["id"])  # type: ignore[call-overload]
        row = rows.get(key)
        if row is None:
            out = node.outputs[0] if node.outputs else None
            row = rows[key] = CollectiveRow(
                id=key,
                kind=str(tag["kind"]),
                group=[str(d) for d in tag.get("group", [])],  # type: ignore[attr-defined]
                scope=node_scope(node),
                nbytes=int(value_nbytes(out, sizes) or 0) if out is not None else 0,
            )
        device = str(node_device(node))
        row.received[device] = row.received.get(device, 0) + received_bytes(node, sizes)
        row.nodes.append(node.name or "")
    return list(rows.values())


def collectives_html(rows: list[CollectiveRow]) -> str:
    """The report's table of collectives (and the bytes each device reads per step), or ``""``."""
    if not rows:
        return ""
    devices = sorted({d for r in rows for d in r.received}, key=lambda d: (len(d), d))
    head = "".join(f"<th class='left'>{h}</th>" for h in ("id", "kind", "module", "group")) + "<th>value</th>"
    head += "".join(f"<th>read by {html.escape(d)}</th>" for d in devices)
    body = []
    for r in rows:
        cells = [str(r.id), html.escape(r.kind), html.escape(r.scope or "-"), html.escape(", ".join(r.group))]
        line = "".join(f'<td class="left">{c}</td>' for c in cells) + f"<td>{format_bytes(r.nbytes)}</td>"
        line += "".join(
            f"<td>{format_bytes(r.received[d]) if d in r.received else '-'}</td>" for d in devices
        )
        body.append(f'<tr class="collective">{line}</tr>')
    totals = "".join(f"<td>{format_bytes(sum(r.received.get(d, 0) for r in rows))}</td>" for d in devices)
    body.append(f'<tr><td class="left" colspan="5"><b>per step</b></td>{totals}</tr>')
    kinds = {k: sum(r.kind == k for r in rows) for k in ("all_reduce", "all_gather")}
    note = (
        f"<p>{kinds['all_reduce']} all-reduces (a <code>Sum</code> of the copied partials on each "
        f"device) and {kinds['all_gather']} all-gathers (a <code>Concat</code> of the copied shards); "
        "each device reads the other devices' parts through copies.</p>"
    )
    return f"{note}<table><tr>{head}</tr>{''.join(body)}</table>"
