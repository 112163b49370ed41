"""Per-device report of a placed model: ops, parameters, activations, copies and traffic.

One :class:`DeviceRow` per device: ops (copies excluded), copies landing there,
parameters homed there and their bytes, activations produced there and their
bytes, activation bytes received and sent through (dynamic) copies, and bytes
replicated there once, at load time: static copies of parameters and copies of
load-time values (see :mod:`placement.analysis.dependence`), which the runtime
rematerialises where they are read instead of moving them per run; and streamed
weights (parameters living on the host, copied every run, see
:func:`placement.stream_parameters`): counted on the host's row as parameters and
bytes streamed out, and on the reading device's row as streamed copies in. Sizes come
from static shapes (``value_nbytes``), symbolic dimensions (a dynamic batch) counted at
the sizes the model was planned at or ``batch=`` (:mod:`placement.planning.dims`); a blob
whose shape or dtype is unknown counts 0 bytes and is listed in ``Summary.unknown_sizes``.

The rendering is data-driven (``Summary.columns``), so later reports can add
columns (estimated time, peak memory) by extending :class:`DeviceRow` and the
column list.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> acts = pl.get_activation_blobs(model)
    >>> _ = pl.shift_activation_devices(model, acts[2:], {0: 1})
    >>> _ = pl.inject_cross_device_copies(model, output_device=0)
    >>> report = pl.summary(model)
    >>> [(str(r.device), r.ops, r.copies, r.recv_bytes, r.sent_bytes) for r in report.rows]
    [('cuda:0', 2, 1, 128, 512), ('cuda:1', 3, 1, 512, 128)]
    >>> "cuda:1" in str(report)
    True
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Mapping
from typing import Any

import onnx_ir as ir

from placement.analysis.dependence import copy_origin, load_time_values
from placement.graph.device import Device
from placement.graph.model import value_nbytes
from placement.graph.nodes import (
    COLLECTIVE_KEY,
    COPY_KEY,
    INPUT_DEVICE_KEY,
    OUTPUT_DEVICE_KEY,
    streamed_homes,
)
from placement.graph.sizes import format_bytes
from placement.passes.activations import activation_values
from placement.passes.base import DeviceReader, ModelLike, as_ir_model
from placement.planning.dims import describe, planned_dims
from placement.planning.profile import add_estimates

__all__ = ["summary", "Summary", "DeviceRow", "Column"]


def _count_collective(row: DeviceRow, node: ir.Node, size: Callable[[ir.Value], int]) -> None:
    """An all-reduce or all-gather on ``row``'s device, and the bytes of the copies it reads."""
    row.collectives += 1
    for value in node.inputs:
        producer = value.producer() if value is not None else None
        if producer is not None and COPY_KEY in producer.metadata_props:
            row.collective_bytes += size(value)


@dataclasses.dataclass
class DeviceRow:
    """Counts and bytes for one device (see the module docstring)."""

    device: Device
    ops: int = 0
    copies: int = 0
    static_copies: int = 0
    params: int = 0
    param_bytes: int = 0
    activations: int = 0
    activation_bytes: int = 0
    recv_bytes: int = 0
    sent_bytes: int = 0
    static_copy_bytes: int = 0
    streamed_copies: int = 0  # copies of weights that live on the host, made every run
    streamed_bytes: int = 0  # bytes they move per run (the host's row: the weights it streams out)
    collectives: int = 0  # tensor-parallel all-reduces / all-gathers computed here
    collective_bytes: int = 0  # bytes they read from other devices per run
    kv_cache_bytes: int = 0  # KV caches of its layers at the batch and length asked for (summary's kv_cache)
    # filled by placement.planning.profile.add_estimates
    peak_activation_bytes: int = 0
    time_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly fields (the device as a string)."""
        data = dataclasses.asdict(self)
        data["device"] = str(self.device)
        return data


@dataclasses.dataclass(frozen=True)
class Column:
    """One rendered column: header, how to read a row, alignment."""

    header: str
    get: Callable[[DeviceRow], str]
    justify: str = "right"


#: Shown where a model has tensor-parallel collectives (before the estimates).
COLLECTIVES_COLUMN = Column(
    "collectives", lambda r: f"{r.collectives} ({format_bytes(r.collective_bytes)})" if r.collectives else "-"
)

DEFAULT_COLUMNS: list[Column] = [
    Column("device", lambda r: str(r.device), "left"),
    Column("ops", lambda r: str(r.ops)),
    Column("params", lambda r: format_bytes(r.param_bytes)),
    Column("activations", lambda r: f"{r.activations} ({format_bytes(r.activation_bytes)})"),
    Column("copies in", lambda r: f"{r.copies} ({r.static_copies} static)"),
    Column("recv", lambda r: format_bytes(r.recv_bytes)),
    Column("sent", lambda r: format_bytes(r.sent_bytes)),
    Column("params copied in", lambda r: format_bytes(r.static_copy_bytes)),
    Column(
        "streamed",
        lambda r: f"{r.streamed_copies} ({format_bytes(r.streamed_bytes)})" if r.streamed_bytes else "-",
    ),
    Column("peak act.", lambda r: format_bytes(r.peak_activation_bytes)),
    Column("est. time", lambda r: f"{r.time_s * 1e3:.3f} ms" if r.time_s is not None else "-"),
]


@dataclasses.dataclass
class Summary:
    """The per-device report; ``rows`` sorted by device."""

    rows: list[DeviceRow]
    unknown_sizes: list[str] = dataclasses.field(default_factory=list)
    input_device: Device | None = None
    output_device: Device | None = None
    dims: dict[str, int] = dataclasses.field(default_factory=dict)
    columns: list[Column] = dataclasses.field(default_factory=lambda: list(DEFAULT_COLUMNS))

    def row(self, device: Any) -> DeviceRow:
        """The row of ``device`` (an empty row if no op runs there)."""
        wanted = Device.parse(device)
        return next((r for r in self.rows if r.device == wanted), DeviceRow(wanted))

    @property
    def total_copies(self) -> int:
        """Copies in the model."""
        return sum(r.copies for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (used by ``placement inspect --json``)."""
        return {
            "devices": [r.to_dict() for r in self.rows],
            "input_device": str(self.input_device) if self.input_device else None,
            "output_device": str(self.output_device) if self.output_device else None,
            "unknown_sizes": list(self.unknown_sizes),
            "dims": dict(self.dims),
        }

    def to_table(self, title: str | None = "placement by device") -> Any:
        """A ``rich.table.Table`` with one row per device (and a footnote on unknown sizes)."""
        from rich.table import Table

        notes = []
        if self.dims:
            notes.append(f"sizes at {describe(self.dims)}")
        if self.input_device is not None or self.output_device is not None:
            notes.append(f"inputs fed on {self.input_device}, outputs gathered on {self.output_device}")
        if self.unknown_sizes:
            shown = ", ".join(self.unknown_sizes[:3])
            more = f" and {len(self.unknown_sizes) - 3} more" if len(self.unknown_sizes) > 3 else ""
            notes.append(f"unknown size (counted as 0): {shown}{more}")
        table = Table(title=title, caption="; ".join(notes) or None)
        for column in self.columns:
            table.add_column(column.header, justify=column.justify)  # type: ignore[arg-type]
        for row in self.rows:
            table.add_row(*(column.get(row) for column in self.columns))
        return table

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=120, color_system=None, force_terminal=False).print(self.to_table())
        return buffer.getvalue().rstrip("\n")


def summary(
    model: ModelLike,
    *,
    print_: bool = False,
    batch: int | Mapping[str, int] | None = None,
    kv_cache: tuple[int, int] | None = None,
) -> Summary:
    """Per-device report of ``model`` (also ``placement inspect``); ``print_=True`` also prints it.

    Per device: ops, parameters, activations, copies and the bytes they move, the
    liveness-based peak activation bytes, and the estimated time from the latest cached
    profile with times (:func:`placement.profile`, ``auto_place(cost="time")``,
    ``balance_by_time``; "-" without one). ``str()`` of the result is the table.

    Args:
        model: a placed :class:`placement.Model` (copies injected or not).
        print_: also print the table to standard output.
        batch: the sizes of symbolic dimensions (a dynamic batch): an int for every one,
            or a mapping symbol -> size; default the sizes the model was planned at, else 1
            (see :mod:`placement.planning.dims`).
        kv_cache: ``(batch, max_length)`` for a model with a KV cache
            (:func:`placement.from_causal_lm`): a "KV cache" column gives the bytes of the
            caches each device holds at that batch and length (a layer's cache lives where
            the op making its ``present`` runs).

    Returns:
        A :class:`Summary`; ``str()`` renders it as a table.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> report = pl.summary(model)
        >>> report.rows[0].ops, report.total_copies
        (5, 0)
        >>> _ = pl.profile(model, repeats=1)
        >>> row = pl.summary(model).rows[0]
        >>> row.peak_activation_bytes > 0, row.time_s > 0
        (True, True)
    """
    ir_model = as_ir_model(model)
    graph = ir_model.graph
    reader = DeviceReader()
    rows: dict[Device, DeviceRow] = {}

    def row(device: Device) -> DeviceRow:
        found = rows.get(device)
        if found is None:
            found = rows[device] = DeviceRow(device)
        return found

    meta = ir_model.metadata_props
    input_device = reader.parse(meta[INPUT_DEVICE_KEY]) if meta.get(INPUT_DEVICE_KEY) else None
    output_device = reader.parse(meta[OUTPUT_DEVICE_KEY]) if meta.get(OUTPUT_DEVICE_KEY) else None
    unknown: dict[str, None] = {}
    dims = planned_dims(ir_model, batch=batch)

    def size(value: ir.Value) -> int:
        nbytes = value_nbytes(value, dims)
        if nbytes is None:
            unknown[value.name or "?"] = None
            return 0
        return int(nbytes)

    fixed = load_time_values(graph)  # rematerialised where read, like static copies
    dev_of: dict[int, Device] = {}
    inits = graph.initializers
    for name, host in streamed_homes(ir_model).items():  # streamed weights live on their host
        if name in inits:
            dev_of[id(inits[name])] = reader.canonical(host)
            row(reader.canonical(host)).params += 1
            row(reader.canonical(host)).param_bytes += size(inits[name])
    first_node: ir.Node | None = None
    for node in graph:
        device = reader.of(node)
        first_node = first_node or node
        current = row(device)
        is_copy = COPY_KEY in node.metadata_props
        for value in node.inputs:
            if value is None or id(value) in dev_of:
                continue
            if value.is_initializer():  # a parameter lives where its first reader runs
                dev_of[id(value)] = device
                current.params += 1
                current.param_bytes += size(value)
            elif value.is_graph_input():
                dev_of[id(value)] = input_device or device
        if is_copy:
            current.copies += 1
            source = node.inputs[0] if node.inputs else None
            if source is not None:
                nbytes = size(source)
                if node.metadata_props.get(COPY_KEY) == "streamed":
                    current.streamed_copies += 1
                    current.streamed_bytes += nbytes
                    host = row(dev_of.get(id(source), device))
                    host.streamed_bytes += nbytes
                elif node.metadata_props.get(COPY_KEY) == "static" or copy_origin(source) in fixed:
                    current.static_copies += 1
                    current.static_copy_bytes += nbytes
                else:
                    current.recv_bytes += nbytes
                    row(dev_of.get(id(source), device)).sent_bytes += nbytes
        else:
            current.ops += 1
        if COLLECTIVE_KEY in node.metadata_props:
            _count_collective(current, node, size)
        for value in node.outputs:
            dev_of[id(value)] = device
    default = reader.of(first_node) if first_node is not None else Device("cuda", 0)
    for value in graph.initializers.values():
        if id(value) not in dev_of:  # unused parameters: the model's default device
            target = row(default)
            target.params += 1
            target.param_bytes += size(value)
    for value in activation_values(graph):
        target = row(dev_of[id(value)])
        target.activations += 1
        target.activation_bytes += size(value)
    result = Summary(
        rows=[rows[d] for d in sorted(rows)],
        unknown_sizes=list(unknown),
        input_device=input_device,
        output_device=output_device,
        dims=dims,
    )
    if any(r.collectives for r in result.rows):
        result.columns.insert(len(result.columns) - 2, COLLECTIVES_COLUMN)
    if kv_cache is not None:
        _add_kv_cache(ir_model, result, kv_cache, reader)
    add_estimates(ir_model, result, dims=dims)
    if print_:
        import sys

        from rich.console import Console

        Console(width=None if sys.stdout.isatty() else 160).print(result.to_table())
    return result


def _add_kv_cache(
    ir_model: ir.Model, result: Summary, kv_cache: tuple[int, int], reader: DeviceReader
) -> None:
    """Fill ``kv_cache_bytes`` per device and add its column."""
    from placement.errors import InputError
    from placement.graph.causal_lm import kv_layers

    try:
        batch, length = (int(v) for v in kv_cache)
    except (TypeError, ValueError) as err:
        raise InputError(f"kv_cache must be (batch, max_length), got {kv_cache!r}") from err
    outputs = {v.name: v for v in ir_model.graph.outputs}
    rows = {r.device: r for r in result.rows}
    for layer in kv_layers(ir_model):
        for name in (layer.present_key, layer.present_value):
            producer = outputs[name].producer()
            if producer is None:
                continue
            device = reader.of(producer)
            row = rows.get(device)
            if row is None:
                row = rows[device] = DeviceRow(device)
                result.rows = sorted([*result.rows, row], key=lambda r: r.device)
            row.kv_cache_bytes += layer.bytes_for(batch, length) // 2
    at = next(i for i, c in enumerate(result.columns) if c.header == "peak act.")
    result.columns.insert(
        at, Column(f"KV cache ({batch}x{length})", lambda r: format_bytes(r.kv_cache_bytes))
    )
