"""One self-contained HTML page about a placed model (no network: images are inline).

:func:`write_report` writes:

* the per-device table of :func:`placement.report.summary.summary` (ops, parameters,
  activations, copies, bytes sent and received, peak activations, estimated time);
* bar charts (matplotlib, embedded as PNG ``data:`` images) of time and memory per
  device, memory against each device's budget when a plan has budgets;
* the bytes copied per step between each pair of devices (every cut);
* the tensor-parallel collectives (:mod:`placement.report.collectives`): each all-reduce and
  all-gather with its module, group, the bytes of its value and the bytes each device reads;
* with a :class:`placement.Plan`: the planner's bottleneck against its lower bound
  (no placement can beat the bound) and its per-device predictions;
* the graph picture of :func:`placement.report.draw.draw` as inline SVG (or the DOT
  source with a note when Graphviz is missing).

Example:
    >>> import tempfile, pathlib
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> plan = pl.auto_place(model, devices=2, cost="size")
    >>> _ = pl.inject_cross_device_copies(model)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "report.html"
    >>> page = pl.write_report(model, path, plan=plan)
    >>> text = path.read_text()
    >>> "cuda:1" in text and "data:image/png;base64," in text and "lower bound" in text
    True
"""

from __future__ import annotations

import base64
import html
import io
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from placement.errors import ModelSaveError
from placement.graph.atomic import write_file
from placement.graph.device import Device
from placement.graph.model import Model, value_nbytes
from placement.graph.nodes import COPY_KEY, node_device
from placement.graph.sizes import format_bytes
from placement.planning.dims import describe, planned_dims, stored_dims
from placement.report.collectives import CollectiveRow, collective_rows, collectives_html
from placement.report.colours import device_colour
from placement.report.draw import Drawing, draw
from placement.report.summary import Summary, summary

__all__ = ["write_report", "Report", "copy_traffic"]

log = logging.getLogger(__name__)

_STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
table { border-collapse: collapse; margin: .5em 0 1em; }
th, td { padding: .25em .7em; border-bottom: 1px solid #eee; text-align: right; }
th { background: #f4f4f4; } td.left, th.left { text-align: left; }
.swatch { display: inline-block; width: .9em; height: .9em; margin-right: .4em; vertical-align: middle; }
.note { color: #666; font-size: .9em; } .bad { color: #d62728; font-weight: bold; }
.graph svg { max-width: 100%; height: auto; } img { max-width: 100%; }
"""


@dataclass
class Report:
    """What :func:`write_report` wrote.

    Attributes:
        path: the HTML file.
        summary: the per-device table.
        drawing: the graph picture (its ``note`` says when Graphviz was missing).
        traffic: bytes copied per step, by (source device, target device).
        collectives: the tensor-parallel collectives (empty without them).
    """

    path: Path
    summary: Summary
    drawing: Drawing
    traffic: dict[tuple[str, str], int]
    collectives: list[CollectiveRow] = field(default_factory=list)


def copy_traffic(model: Model, *, dims: Mapping[str, int] | None = None) -> dict[tuple[str, str], int]:
    """Bytes the model's dynamic copies move per step, by (source device, target device).

    Symbolic dimensions count at ``dims`` (default :func:`placement.planning.dims.planned_dims`).

    Copies of parameters and of load-time values (computed from parameters alone) move
    nothing per step: runtimes place or recompute them once, at load time.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> acts = pl.get_activation_blobs(model)
        >>> _ = pl.shift_activation_devices(model, acts[2:], {0: 1})
        >>> _ = pl.inject_cross_device_copies(model, output_device=0)
        >>> copy_traffic(model)
        {('cuda:0', 'cuda:1'): 512, ('cuda:1', 'cuda:0'): 128}
    """
    from placement.analysis.dependence import copy_origin, load_time_values

    fixed = load_time_values(model.graph)  # rematerialised where read, never moved per step
    sizes = planned_dims(model) if dims is None else dims
    traffic: dict[tuple[str, str], int] = {}
    for node in model.graph:
        kind = node.metadata_props.get(COPY_KEY)
        if kind is None or kind == "static" or not node.inputs or node.inputs[0] is None:
            continue
        source = node.inputs[0]
        if copy_origin(source) in fixed:
            continue
        key = (str(model.blob_device(source)), str(node_device(node)))
        traffic[key] = traffic.get(key, 0) + int(value_nbytes(source, sizes) or 0)
    return dict(sorted(traffic.items()))


def write_report(
    model: Model,
    path: str | os.PathLike[str],
    *,
    plan: Any = None,
    title: str | None = None,
    collapse: bool | str = "auto",
    max_nodes: int = 120,
    batch: int | Mapping[str, int] | None = None,
) -> Report:
    """Write the HTML report of ``model`` to ``path`` (see the module docstring).

    Args:
        model: a placed :class:`placement.Model` (not modified).
        path: the ``.html`` file to write (atomically: a failure leaves any old file).
        plan: the :class:`placement.Plan` that placed the model, for the planner section
            and the memory budgets; None leaves them out.
        title: the page title (default: the model's op and device counts).
        collapse, max_nodes: passed to :func:`placement.report.draw.draw`.
        batch: the sizes of symbolic dimensions (a dynamic batch): an int for every one,
            or a mapping symbol -> size; default ``plan.dims``, else the sizes the model
            was planned at, else 1 (see :mod:`placement.planning.dims`).

    Returns:
        A :class:`Report`.

    Raises:
        ModelSaveError: the file cannot be written.
    """
    target = Path(path)
    if not target.parent.is_dir():
        raise ModelSaveError(f"cannot write {str(target)!r}: folder {str(target.parent)!r} does not exist")
    if batch is None and plan is not None and getattr(plan, "dims", None):
        batch = dict(plan.dims)
    dims = planned_dims(model, batch=batch)
    report = summary(model, batch=dims)
    drawing = draw(model, None, collapse=collapse, max_nodes=max_nodes, batch=dims)
    traffic = copy_traffic(model, dims=dims)
    from placement.report.draw import render_svg

    svg = render_svg(drawing.dot)
    if svg is None:
        drawing.note = "Graphviz 'dot' was not found: the graph is shown as DOT source (install graphviz)."
    heading = title or f"Placement report: {len(model.ops)} ops on {len(model.devices)} device(s)"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(heading)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(heading)}</h1>",
        f'<p class="note">{html.escape(repr(model))}</p>',
        "<h2>Per device</h2>",
        *([f'<p class="note">sizes at {html.escape(describe(dims))}</p>'] if dims else []),
        _summary_table(report),
        "<h2>Time and memory per device</h2>",
        _img(_time_memory_chart(report, plan), "time and memory per device"),
        "<h2>Bytes copied per step, per cut</h2>",
        _traffic_section(traffic),
    ]
    collectives = collective_rows(model, dims=dims)
    if collectives:
        parts += ["<h2>Tensor-parallel collectives</h2>", collectives_html(collectives)]
    streamed = _streamed_section(model)
    if streamed:
        parts += ["<h2>Weights streamed from the host</h2>", streamed]
    if plan is not None:
        parts += ["<h2>Planner: choice against the lower bound</h2>", _plan_section(plan)]
    parts += ["<h2>Graph</h2>"]
    if svg is not None:
        parts.append(f'<div class="graph">{_strip_prolog(svg)}</div>')
    else:
        parts.append(f'<p class="bad">{html.escape(drawing.note or "")}</p>')
        parts.append(f"<pre>{html.escape(drawing.dot)}</pre>")
    parts.append("</body></html>")
    write_file(target, "\n".join(parts).encode("utf-8"))
    log.info("wrote the report to %s", target)
    return Report(path=target, summary=report, drawing=drawing, traffic=traffic, collectives=collectives)


# --- sections ---------------------------------------------------------------------


def _device_cell(device: Device) -> str:
    return f'<td class="left">{_swatch(device)}{html.escape(str(device))}</td>'


def _streamed_section(model: Model) -> str:
    """The streamed copies (weights living on the host, copied every run), or ``""``."""
    rows = []
    total = 0
    for node in model.graph:
        if node.metadata_props.get(COPY_KEY) != "streamed" or not node.inputs or node.inputs[0] is None:
            continue
        source = node.inputs[0]
        nbytes = int(value_nbytes(source, stored_dims(model)) or 0)
        total += nbytes
        rows.append(
            f'<tr><td class="left">{html.escape(source.name or "?")}</td>'
            + _device_cell(model.blob_device(source))
            + _device_cell(node_device(node))
            + f"<td>{format_bytes(nbytes)}</td></tr>"
        )
    if not rows:
        return ""
    from placement.graph.nodes import stream_window

    window = stream_window(model.ir_model)
    head = (
        "".join(f"<th class='left'>{h}</th>" for h in ("parameter", "lives on", "read on")) + "<th>bytes</th>"
    )
    head = f"<tr>{head}</tr>"
    note = (
        f"<p>{len(rows)} weights, {format_bytes(total)} copied every run on a side stream, prefetched "
        "within a window of "
        + (format_bytes(window) if window is not None else "one weight ahead (double-buffering)")
        + ".</p>"
    )
    return f"{note}<table>{head}{''.join(rows)}</table>"


def _swatch(device: str | Device) -> str:
    return f'<span class="swatch" style="background:{device_colour(device)}"></span>'


def _summary_table(report: Summary) -> str:
    head = "".join(
        f'<th class="{"left" if c.justify == "left" else ""}">{html.escape(c.header)}</th>'
        for c in report.columns
    )
    rows = []
    for row in report.rows:
        cells = []
        for i, column in enumerate(report.columns):
            text = html.escape(column.get(row))
            if i == 0:
                cells.append(f'<td class="left">{_swatch(row.device)}{text}</td>')
            else:
                cells.append(f'<td class="{"left" if column.justify == "left" else ""}">{text}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    notes = []
    if report.input_device is not None:
        notes.append(f"inputs fed on {report.input_device}, outputs gathered on {report.output_device}")
    if report.unknown_sizes:
        notes.append(f"{len(report.unknown_sizes)} blobs of unknown size counted as 0")
    note = f'<p class="note">{html.escape("; ".join(notes))}</p>' if notes else ""
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>{note}"


def _traffic_section(traffic: dict[tuple[str, str], int]) -> str:
    if not traffic:
        return '<p class="note">No copies move data per step (one device, or copies not injected).</p>'
    rows = "".join(
        f'<tr><td class="left">{_swatch(src)}{html.escape(src)}</td>'
        f'<td class="left">{_swatch(dst)}{html.escape(dst)}</td><td>{format_bytes(n)}</td></tr>'
        for (src, dst), n in traffic.items()
    )
    table = f'<table><tr><th class="left">from</th><th class="left">to</th><th>bytes</th></tr>{rows}</table>'
    return table + _img(_traffic_chart(traffic), "bytes copied per cut")


def _plan_section(plan: Any) -> str:
    from placement.planning.plan import format_cost

    kind = plan.cost_kind
    verdict = "optimal (equals the bound)" if plan.bottleneck <= plan.lower_bound else f"{plan.ratio:.3f} x"
    lines = [
        f"<p>Objective <b>{html.escape(plan.objective)}</b>, cost <b>{html.escape(kind)}</b>: bottleneck "
        f"<b>{format_cost(plan.bottleneck, kind)}</b> against the lower bound "
        f"<b>{format_cost(plan.lower_bound, kind)}</b> ({verdict}); total "
        f"{format_cost(plan.total_cost, kind)}; {format_bytes(plan.transfer_bytes)} copied per step "
        f"(cuts: {', '.join(format_bytes(b) for b in plan.cut_bytes) or 'none'}).</p>"
    ]
    if getattr(plan, "tensor_parallel", None):
        from placement.planning.plan import tp_headline

        lines.append(
            f"<p>{html.escape(tp_headline(plan).capitalize())}; stages: {html.escape(str(plan.groups))}.</p>"
        )
    if not plan.fits:
        lines.append('<p class="bad">Some device exceeds its memory budget.</p>')
    head = "".join(
        f"<th>{h}</th>"
        for h in ("device", "ops", "first op", "last op", "cost", "memory", "budget", "in", "out")
    )
    rows = []
    for d in plan.devices:
        over = d.budget is not None and d.memory > d.budget
        rows.append(
            f'<tr><td class="left">{_swatch(d.device)}{html.escape(d.device)}</td><td>{d.ops}</td>'
            f'<td class="left">{html.escape(d.first_op or "-")}</td>'
            f'<td class="left">{html.escape(d.last_op or "-")}</td>'
            f"<td>{format_cost(d.cost, kind)}</td>"
            f'<td class="{"bad" if over else ""}">{format_bytes(d.memory)}</td>'
            f"<td>{format_bytes(d.budget) if d.budget is not None else '-'}</td>"
            f"<td>{format_bytes(d.bytes_in)}</td><td>{format_bytes(d.bytes_out)}</td></tr>"
        )
    lines.append(f"<table><tr>{head}</tr>{''.join(rows)}</table>")
    lines.append(_img(_plan_chart(plan), "planner bottleneck against the lower bound"))
    return "\n".join(lines)


# --- charts -------------------------------------------------------------------------


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _img(data: bytes, alt: str) -> str:
    encoded = base64.b64encode(data).decode("ascii")
    return f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}"></p>'


def _time_memory_chart(report: Summary, plan: Any) -> bytes:
    names = [str(r.device) for r in report.rows]
    colours = [device_colour(r.device) for r in report.rows]
    fig = _figure(10, 3.6)
    left, right = fig.subplots(1, 2)
    plan_by_device = {d.device: d for d in plan.devices} if plan is not None else {}
    if plan is not None:
        scale, unit = _cost_unit(plan.cost_kind)
        values = [plan_by_device[n].cost / scale if n in plan_by_device else 0.0 for n in names]
        left.set_ylabel(f"planned {plan.cost_kind} per step ({unit})")
        left.axhline(plan.lower_bound / scale, color="#333333", linestyle="--", label="lower bound")
        left.legend(loc="lower right", fontsize=8)
    elif all(r.time_s is not None for r in report.rows):
        values = [(r.time_s or 0.0) * 1e3 for r in report.rows]
        left.set_ylabel("estimated time per step (ms)")
    else:
        values = [float(r.ops) for r in report.rows]
        left.set_ylabel("ops (no time profile)")
    left.bar(names, values, color=colours)
    left.set_title("time (or cost) per device")
    params = [float(r.param_bytes + r.static_copy_bytes) / 2**20 for r in report.rows]
    acts = [float(r.peak_activation_bytes) / 2**20 for r in report.rows]
    right.bar(names, params, color=colours, label="parameters")
    right.bar(names, acts, bottom=params, color=colours, alpha=0.45, hatch="//", label="peak activations")
    budgets = [plan_by_device[n].budget if n in plan_by_device else None for n in names]
    for i, budget in enumerate(budgets):
        if budget is not None:
            right.hlines(budget / 2**20, i - 0.4, i + 0.4, colors="#d62728", linewidth=2.5)
    if any(b is not None for b in budgets):
        right.plot([], [], color="#d62728", linewidth=2.5, label="budget")
    right.set_ylabel("MiB")
    right.set_title("memory per device")
    right.legend(loc="lower right", fontsize=8)
    return _png(fig)


def _traffic_chart(traffic: dict[tuple[str, str], int]) -> bytes:
    fig = _figure(max(4.0, 1.2 * len(traffic) + 2), 2.8)
    ax = fig.subplots()
    labels = [f"{s} -> {d}" for s, d in traffic]
    ax.bar(labels, [n / 1024 for n in traffic.values()], color=[device_colour(d) for _, d in traffic])
    ax.set_ylabel("KiB per step")
    ax.set_title("bytes copied per cut")
    return _png(fig)


def _plan_chart(plan: Any) -> bytes:
    fig = _figure(6, 2.6)
    ax = fig.subplots()
    scale, unit = _cost_unit(plan.cost_kind)
    names = ["lower bound", "planner bottleneck"] + [d.device for d in plan.devices]
    values = [plan.lower_bound / scale, plan.bottleneck / scale] + [d.cost / scale for d in plan.devices]
    colours: Sequence[str] = ["#cccccc", "#333333"] + [device_colour(d.device) for d in plan.devices]
    ax.barh(names, values, color=colours)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(f"cost per device against the bound ({plan.cost_kind})")
    return _png(fig)


def _cost_unit(kind: str) -> tuple[float, str]:
    return {"time": (1e6, "ms"), "size": (2**20, "MiB"), "flops": (1e6, "MFLOP")}.get(kind, (1.0, kind))


def _strip_prolog(svg: str) -> str:
    """Inline SVG: drop the XML declaration, DOCTYPE and comments (no external references)."""
    svg = re.sub(r"<\?xml[^>]*\?>", "", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>", "", svg, flags=re.S)
    return re.sub(r"<!--.*?-->", "", svg, flags=re.S).strip()
