"""A placement plan: per device its ops' cost, memory and copies, with a table, JSON and files.

:class:`Plan` is what :func:`placement.auto_place` returns: the assignment of every op to a
device, the bottleneck and its lower bound, one :class:`DevicePlan` row per device (cost,
parameter and activation bytes, budget, bytes copied in and out), and what streams from the
host. It applies itself to a model, prints as a rich table, and round-trips through JSON
(``save``/``load`` write and read a file atomically).

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> plan = pl.auto_place(model, devices=2, cost="flops")
    >>> Plan.from_json(plan.to_json()) == plan
    True
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from placement.errors import InputError, PlanError, UnknownOpError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import STREAM_WINDOW_KEY, STREAMED_KEY, set_node_device
from placement.graph.sizes import format_bytes
from placement.planning.dims import describe, store_dims
from placement.planning.frontend import check_no_copies, transaction
from placement.planning.profile import fingerprint

__all__ = ["Plan", "DevicePlan", "format_cost", "offload_title", "offload_caption", "tp_headline"]

log = logging.getLogger(__name__)


def format_cost(value: float, kind: str) -> str:
    """A cost of ``kind`` (``time`` in ns, ``size`` in bytes, ``flops``) for people: ``1.500 ms``."""
    if kind == "time":
        return f"{value / 1e6:.3f} ms"
    if kind == "size":
        return format_bytes(value)
    return f"{value / 1e6:.2f} MFLOP"


@dataclass
class DevicePlan:
    """Predicted figures of one device under a plan.

    Attributes:
        device: the device (string).
        ops: number of ops.
        first_op / last_op: the part's first and last op (None if empty).
        cost: summed op cost (ns, bytes or FLOPs, per ``Plan.cost_kind``).
        param_bytes: parameters it holds (shared ones count on every device reading them).
        activation_bytes: liveness-based peak of its activations.
        budget: its memory budget in bytes, or None.
        bytes_in / bytes_out: bytes copied in and out per step.
        transfer_time: nanoseconds to copy its inputs in per step under the link model
            (0 without one).
        cut_cost: nanoseconds its cuts cost it (fusions lost at a cut; 0 without).
        kv_cache_bytes: KV caches of its attention layers at the planned batch and length
            (``auto_place(kv_cache=(batch, max_length))``; 0 without).
        degree: the tensor-parallel degree of its stage (1: the stage is this device alone).
        collective_time: nanoseconds its stage's all-reduces and all-gathers take per step
            (``auto_place(tensor_parallel=...)``; 0 without).
        collective_bytes: bytes those collectives copy into this device per step.
    """

    device: str
    ops: int
    first_op: str | None
    last_op: str | None
    cost: int
    param_bytes: int
    activation_bytes: int
    budget: int | None
    bytes_in: int
    bytes_out: int
    transfer_time: int = 0
    cut_cost: int = 0
    kv_cache_bytes: int = 0
    degree: int = 1
    collective_time: int = 0
    collective_bytes: int = 0

    @property
    def stage_cost(self) -> int:
        """What the planner minimises the largest of: op costs, transfers in, cut costs, collectives."""
        return self.cost + self.transfer_time + self.cut_cost + self.collective_time

    @property
    def memory(self) -> int:
        """Parameters, KV caches and peak activations."""
        return self.param_bytes + self.kv_cache_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        """True if the device's memory stays within its budget."""
        return self.budget is None or self.memory <= self.budget


@dataclass
class Plan:
    """A placement plan: the device of every op plus its predicted cost and memory.

    Plans can be applied (:meth:`apply`), printed (``str(plan)`` is a table), saved
    (:meth:`save`, :meth:`to_json`) and loaded (:meth:`load`, :meth:`from_json`).

    Attributes:
        assignment: op name -> device string, in graph order.
        devices: per-device predictions (:class:`DevicePlan`), in part order.
        cost_kind: ``"time"`` (ns), ``"size"`` (bytes) or ``"flops"``.
        objective: ``"throughput"`` or ``"latency"``.
        bottleneck: the largest per-device :attr:`DevicePlan.stage_cost`.
        lower_bound: ``max(ceil(total / N), largest op)``, no plan can beat it.
        total_cost: sum of all op costs.
        transfer_bytes: bytes copied between devices per step.
        cut_bytes: per boundary between consecutive used devices, bytes of the
            distinct blobs crossing it.
        fingerprint: structure fingerprint of the model planned for.
        overhead: per step, the summed transfer times and cut costs (ns; 0 without a
            link model or cut costs): what the latency objective minimises.
        links: the link model planned with (see :meth:`Links.to_dict`), or None.
        runtime: the executor the op times were taken for (``auto_place(runtime=...)``):
            ``"ort"`` or ``"torch"``.
        streamed: parameters that live on the host and stream to the GPU that reads
            them (parameter -> host device; see :func:`placement.plan_offload`).
        stream_window: bytes of streamed weights copied ahead of use, or None.
        offload: for a plan of one GPU plus the host (see
            :mod:`placement.planning.auto_offload`), each layer's mode (``modes``: layer
            -> ``resident``/``streamed``/``host``), the prefetch ``window``, the device
            speeds (``speeds``, FLOP/s per device type, and ``speed_sources``: given,
            measured or default), ``all_gpu_ns`` and ``copy_ns``; None otherwise.
        dims: the sizes the symbolic dimensions of the graph inputs were planned at
            (``{"batch": 8}``; see :func:`placement.planning.dims.planned_dims`): the
            activation and copy bytes are those of this binding. Applying the plan stores
            it on the model, so summaries, pictures and reports count the same sizes.
    """

    assignment: dict[str, str]
    devices: list[DevicePlan]
    cost_kind: str
    objective: str
    bottleneck: int
    lower_bound: int
    total_cost: int
    transfer_bytes: int
    cut_bytes: list[int] = field(default_factory=list)
    fingerprint: str = ""
    overhead: int = 0
    links: dict[str, Any] | None = None
    runtime: str = "ort"
    streamed: dict[str, str] = field(default_factory=dict)
    stream_window: int | None = None
    offload: dict[str, Any] | None = None
    dims: dict[str, int] = field(default_factory=dict)
    tensor_parallel: list[int] = field(default_factory=list)
    groups: list[list[str]] = field(default_factory=list)
    collective_time: int = 0
    collectives: int = 0
    tp_choices: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """``bottleneck / lower_bound`` (1.0 is provably optimal)."""
        return self.bottleneck / self.lower_bound if self.lower_bound else 1.0

    @property
    def fits(self) -> bool:
        """True if every device stays within its budget."""
        return all(d.fits for d in self.devices)

    def device_of(self, op: str) -> Device:
        """The device the plan gives ``op``."""
        try:
            return Device.parse(self.assignment[op])
        except KeyError:
            raise UnknownOpError(f"the plan has no op {op!r}") from None

    def apply(self, model: Model) -> None:
        """Place ``model``'s ops as planned, in place (transactional).

        A plan with tensor-parallel stages splits the model over their groups
        (:func:`placement.split_tensor_parallel`, which also injects the copies): one group,
        a plain split; one group per pipeline stage (tensor inside pipeline, 2D), each stage's
        ops first placed on its group's first device, then split over its group.

        Raises:
            UnknownOpError: the plan names an op the model lacks.
            PlanError: the model has ops the plan does not cover, or copies.
            InputError: the plan has split and unsplit stages or groups of different sizes
                (:func:`placement.split_tensor_parallel` takes groups of one size), or the
                split fails (the model is unchanged).
        """
        split = [g for g in self.groups if len(g) > 1]
        if split and (len(split) != len(self.groups) or len({len(g) for g in split}) != 1):
            raise InputError(
                f"the plan's stage groups {self.groups} are not all of one size: "
                "split_tensor_parallel takes groups of one size (per-stage degrees are not supported)"
            )
        check_no_copies(model, "Plan.apply")
        names = {node.name for node in model.graph}
        for op in self.assignment:
            if op not in names:
                raise UnknownOpError(f"the plan places op {op!r}, which is not in the model")
        missing = [n for n in names if n not in self.assignment]
        if missing:
            raise PlanError(f"the plan does not cover op {missing[0]!r} ({len(missing)} ops missing)")
        if self.fingerprint and fingerprint(model) != self.fingerprint:
            log.warning("applying a plan made for a different model structure")
        parsed = {op: Device.parse(dev) for op, dev in self.assignment.items()}
        with transaction(model):
            for node in model.graph:
                set_node_device(node, parsed[node.name or ""])
            if split:
                from placement.passes.tensor_parallel import split_tensor_parallel

                split_tensor_parallel(model, devices=split[0] if len(split) == 1 else split)
        store_dims(model, self.dims)
        if self.streamed:  # the plan keeps these weights on the host (see plan_offload)
            props = model.ir_model.metadata_props
            props[STREAMED_KEY] = json.dumps(self.streamed)
            if self.stream_window is not None:
                props[STREAM_WINDOW_KEY] = str(self.stream_window)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    def to_json(self, *, indent: int | None = 1) -> str:
        """The plan as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output.

        Raises:
            PlanError: the data is not a plan.
        """
        try:
            fields = dict(data)
            fields["devices"] = [DevicePlan(**d) for d in fields["devices"]]
            fields["assignment"] = {str(k): str(v) for k, v in fields["assignment"].items()}
            for dev in fields["assignment"].values():
                Device.parse(dev)
            return cls(**fields)
        except (TypeError, KeyError, AttributeError, ValueError) as err:
            raise PlanError(f"not a placement plan: {err}") from err

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Rebuild a plan from :meth:`to_json` text."""
        try:
            data = json.loads(text)
        except ValueError as err:
            raise PlanError(f"plan JSON does not parse: {err}") from err
        if not isinstance(data, dict):
            raise PlanError("plan JSON must be an object")
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON, atomically: a failure leaves an existing file as it was.

        Raises:
            PlanError: the file cannot be written (the message names it).
        """
        from placement.graph.atomic import write_atomic

        try:
            write_atomic(path, self.to_json().encode("utf-8"), what="plan")
        except (OSError, TypeError, ValueError) as err:
            raise PlanError(f"cannot save plan to {str(path)!r}: {err}") from err

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan written by :meth:`save`.

        Raises:
            PlanError: the file is missing or not a plan.
        """
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as err:
            raise PlanError(f"cannot read plan {str(path)!r}: {err}") from err
        except UnicodeDecodeError as err:
            raise PlanError(f"{str(path)!r} is not a placement plan (not UTF-8 text: {err.reason})") from err
        try:
            return cls.from_json(text)
        except PlanError as err:
            raise PlanError(f"{str(path)!r}: {err}") from err

    def to_table(self) -> Any:
        """A ``rich.table.Table`` with one row per device."""
        from rich.table import Table

        if self.offload is not None:
            title, caption = offload_title(self), offload_caption(self.offload)
        else:
            title, caption = (
                (
                    f"plan ({self.objective}, cost={self.cost_kind}): bottleneck "
                    f"{format_cost(self.bottleneck, self.cost_kind)} = {self.ratio:.3f} x lower bound, "
                    f"{format_bytes(self.transfer_bytes)} copied per step"
                ),
                None,
            )
        if self.dims:
            title += f" (sizes at {describe(self.dims)})"
        tp = bool(self.tensor_parallel)
        if tp:
            title += "; " + tp_headline(self)
        table = Table(title=title, caption=caption)
        for col in (
            "device",
            "ops",
            "first op",
            "last op",
            "cost",
            "params",
            "peak act.",
            "budget",
            "in",
            "out",
            *(("transfers", "cut cost") if self.links is not None or self.overhead else ()),
            *(("TP", "collectives") if tp else ()),
        ):
            table.add_column(col, justify="left" if col in ("device", "first op", "last op") else "right")
        for d in self.devices:
            table.add_row(
                d.device,
                str(d.ops),
                d.first_op or "-",
                d.last_op or "-",
                format_cost(d.cost, self.cost_kind),
                format_bytes(d.param_bytes),
                format_bytes(d.activation_bytes),
                format_bytes(d.budget) if d.budget is not None else "-",
                format_bytes(d.bytes_in),
                format_bytes(d.bytes_out),
                *(
                    (format_cost(d.transfer_time, "time"), format_cost(d.cut_cost, "time"))
                    if self.links is not None or self.overhead
                    else ()
                ),
                *(
                    (
                        str(d.degree),
                        f"{format_cost(d.collective_time, 'time')} ({format_bytes(d.collective_bytes)})",
                    )
                    if tp
                    else ()
                ),
            )
        return table

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
        console.print(self.to_table())
        text = console.export_text()
        console.file.close()
        return text.rstrip("\n")


def tp_headline(plan: Plan) -> str:
    """What a plan says about tensor parallelism: the degree per stage, the degrees weighed
    with ``tensor_parallel="auto"``, the stages' device groups and the collectives' time.

    Example:
        >>> plan = Plan({}, [], "time", "latency", 0, 0, 0, 0, tensor_parallel=[2, 2],
        ...             groups=[["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]], collective_time=250_000,
        ...             collectives=5, tp_choices={"1": 900_000, "2": 600_000})
        >>> tp_headline(plan)  # doctest: +NORMALIZE_WHITESPACE
        'tensor parallel 2 (chosen from 1: 0.900 ms, 2: 0.600 ms), stage groups cuda:0,cuda:1 | cuda:2,cuda:3,
        5 collectives 0.250 ms per step'
    """
    degrees = sorted(set(plan.tensor_parallel))
    text = "tensor parallel " + (
        str(degrees[0]) if len(degrees) == 1 else "/".join(map(str, plan.tensor_parallel))
    )
    if plan.tp_choices:
        weighed = ", ".join(f"{k}: {format_cost(v, 'time')}" for k, v in plan.tp_choices.items())
        text += f" (chosen from {weighed})"
    if plan.groups:
        text += ", stage groups " + " | ".join(",".join(g) for g in plan.groups)
    return text + f", {plan.collectives} collectives {format_cost(plan.collective_time, 'time')} per step"


def offload_title(plan: Plan) -> str:
    """The headline of a one-GPU-plus-host plan: predicted forward, against all on the GPU, layer modes.

    Example:
        >>> plan = Plan({}, [], "time", "throughput", 2_000_000, 1_000_000, 0, 4096,
        ...             offload={"modes": {"a": "resident", "b": "host"}, "window": 0,
        ...                      "speeds": {"cuda": 5e13, "cpu": 5e11},
        ...                      "speed_sources": {"cuda": "default", "cpu": "measured"}})
        >>> print(offload_title(plan))  # doctest: +NORMALIZE_WHITESPACE
        offload plan: one forward 2.000 ms predicted = 2.0 x all on the GPU without a budget (1.000 ms);
        1 resident, 0 streamed, 1 host layers; window 0 B; 4.0 KiB copied per step;
        speeds cuda 50 TFLOP/s (default), cpu 0.5 TFLOP/s (measured)
    """
    info = plan.offload or {}
    modes = list(info.get("modes", {}).values())
    counts = ", ".join(f"{modes.count(m)} {m}" for m in ("resident", "streamed", "host"))
    speeds = info.get("speeds") or {}
    sources = info.get("speed_sources") or {}
    rates = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s ({sources.get(k, 'given')})" for k, v in speeds.items())
    return (
        f"offload plan: one forward {format_cost(plan.bottleneck, 'time')} predicted = {plan.ratio:.1f} x "
        f"all on the GPU without a budget ({format_cost(plan.lower_bound, 'time')}); {counts} layers; "
        f"window {format_bytes(info.get('window', 0))}; {format_bytes(plan.transfer_bytes)} copied per step"
        + (f"; speeds {rates}" if rates else "")
    )


def offload_caption(info: Mapping[str, Any]) -> str:
    """Which layers are resident, streamed and on the host, runs of consecutive layers shortened.

    Example:
        >>> print(offload_caption({"modes": {"wte": "host", "h.0": "resident", "h.1": "resident",
        ...                                  "h.2": "resident", "h.3": "host"}}))
        resident: h.0 .. h.2 | streamed: - | host: wte, h.3
    """
    modes = info.get("modes", {})
    names = list(modes)
    parts = []
    for mode in ("resident", "streamed", "host"):
        runs: list[list[str]] = []
        for k, name in enumerate(names):
            if modes[name] != mode:
                continue
            if runs and k > 0 and names[k - 1] == runs[-1][-1]:
                runs[-1].append(name)
            else:
                runs.append([name])
        text = ", ".join(
            r[0] if len(r) == 1 else f"{r[0]} .. {r[-1]}" if len(r) > 2 else f"{r[0]}, {r[1]}" for r in runs
        )
        parts.append(f"{mode}: {text or '-'}")
    note = info.get("note")
    return " | ".join(parts) + (f"\n{note}" if note else "")
