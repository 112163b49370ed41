"""Shift activations between devices by label propagation (Caffe2's ``ShiftActivationDevices``).

``shifts`` maps source devices to target devices; several pairs apply
simultaneously, so chains (``{0: 1, 1: 2}``) and swaps (``{0: 1, 1: 0}``) are well
defined. Only ops currently on a source device move. Labels, in graph order:

* every activation produced on a source device is labelled: with its source's
  target if it is listed in ``activations``, else with the device it is on;
* an op on a source device takes, in this order: the target of a listed output
  activation; else the label of its first output activation; else the label of
  its first labelled input activation; else the label of any labelled blob it
  reads; else it stays. Only labels naming its own device or its source's target
  count, so an op moves from a source to that source's target or not at all;
* blobs the op touches that carry no label yet (parameters, data-independent
  temporaries) take its device.

Copies made by :func:`inject_cross_device_copies` never move (a copy's device is
its destination) and are transparent to labels: an op reading a copy sees the
copied blob. Re-run :func:`inject_cross_device_copies` after shifting; it repairs
the copies.

Compared with Caffe2: device types count (``"cpu"``, ``"cuda:1"``), unknown names
and non-activations are errors instead of being ignored silently, source and
target sets may overlap, and the shift is transactional (on any error the model
is unchanged). Listed activations that are not on a source device stay where they
are (logged), so one list can be reused across several shifts.

Example:
    >>> import placement as pl
    >>> from models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> acts = pl.get_activation_blobs(model)
    >>> result = pl.shift_activation_devices(model, acts[len(acts) // 2:], {0: 1})
    >>> result.total, [str(op.device) for op in model.ops]
    (3, ['cuda:0', 'cuda:0', 'cuda:1', 'cuda:1', 'cuda:1'])
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import cast

import onnx_ir as ir
from onnx_ir.passes import PassResult

from placement.errors import DeviceError, NotAnActivationError, PlanError, UnknownBlobError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import COPY_KEY, DEVICE_KEY
from placement.passes.activations import activation_values, describe_non_activation
from placement.passes.base import DeviceReader, ModelLike, PlacementPass

__all__ = ["shift_activation_devices", "ShiftActivationDevicesPass", "ShiftResult", "parse_shifts"]

log = logging.getLogger(__name__)

_MAX_NAMED = 5  # offenders quoted in one error message


@dataclasses.dataclass
class ShiftResult(PassResult):
    """What a shift did: ``moved[(source, target)]`` = number of ops moved."""

    moved: dict[tuple[Device, Device], int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        """Ops moved in all."""
        return sum(self.moved.values())

    def __str__(self) -> str:
        if not self.moved:
            return "no op moved"
        return ", ".join(f"{n} ops {s} -> {t}" for (s, t), n in sorted(self.moved.items()))


def parse_shifts(shifts: Mapping[DeviceLike, DeviceLike]) -> dict[Device, Device]:
    """Parse a ``{source: target}`` mapping of device-likes into ``Device`` pairs.

    Raises:
        DeviceError: a device is malformed, or two keys name the same device.
        PlanError: ``shifts`` is not a mapping.
    """
    if not isinstance(shifts, Mapping):
        raise PlanError(f"shifts must map source devices to target devices, got {type(shifts).__name__}")
    parsed: dict[Device, Device] = {}
    for key, value in shifts.items():
        source, target = Device.parse(key), Device.parse(value)
        if source in parsed:
            raise DeviceError(f"device {source} appears twice in shifts (as {key!r} and another spelling)")
        parsed[source] = target
    return parsed


class ShiftActivationDevicesPass(PlacementPass):
    """Move the ops of the listed activations from source to target devices (see module doc).

    Args:
        activations: activation blob names (usually a slice of ``get_activation_blobs``).
        shifts: ``{source: target}``; ints are GPU ids, strings ``"cuda:1"``/``"cpu"``.
        debug: check the structural invariants afterwards (default: ``PLACEMENT_DEBUG``).

    ``call`` returns a :class:`ShiftResult`. It leaves cross-device edges without
    copies, so ``ensures_verified`` is False: run copy injection next.
    """

    ensures_verified = False

    def __init__(
        self,
        activations: Iterable[str] | str,
        shifts: Mapping[DeviceLike, DeviceLike],
        *,
        debug: bool | None = None,
        check_onnx: bool = True,
    ) -> None:
        super().__init__(debug=debug, check_onnx=check_onnx)
        names = [activations] if isinstance(activations, str) else list(activations)
        for name in names:
            if not isinstance(name, str):
                raise UnknownBlobError(f"activation names are strings, got {name!r}")
        self.activations = names
        self.shifts = parse_shifts(shifts)

    def call(self, model: ir.Model) -> ShiftResult:
        graph = model.graph
        reader = DeviceReader()
        sources = {reader.canonical(s): reader.canonical(t) for s, t in self.shifts.items()}

        # -- validate (read only) ------------------------------------------------------
        acts = activation_values(graph)
        act_ids = {id(v) for v in acts}
        shifted = _resolve_names(graph, acts, self.activations)
        nodes = list(graph)
        devices = [reader.of(node) for node in nodes]
        in_use = set(devices)
        for source in sources:
            if source not in in_use:
                known = ", ".join(str(d) for d in sorted(in_use)) or "none"
                raise DeviceError(
                    f"shift source device {source} is not used by any op (model devices: {known})"
                )

        # -- label propagation (read only) --------------------------------------------
        origin: dict[int, ir.Value] = {}  # copy output -> copied blob
        labels: dict[int, Device] = {}
        moves: list[tuple[ir.Node, Device, Device]] = []
        listed_elsewhere = 0
        for node, device in zip(nodes, devices):
            if COPY_KEY in node.metadata_props:
                source_value = node.inputs[0] if node.inputs else None
                if source_value is not None:
                    origin[id(node.outputs[0])] = origin.get(id(source_value), source_value)
                continue
            target = sources.get(device)
            if target is None:
                for out in node.outputs:
                    if id(out) in shifted:
                        listed_elsewhere += 1
                continue
            new, outputs = None, node.outputs
            for out in outputs:  # rule 1: output activations, a listed one first
                if id(out) in act_ids:
                    if id(out) in shifted:
                        new = target
                        break
                    if new is None:
                        new = device
            inputs = [origin.get(id(v), v) for v in node.inputs if v is not None]
            if new is None:  # rule 2: labelled input activations (labels it may take)
                new = next(
                    (
                        labels[id(v)]
                        for v in inputs
                        if id(v) in act_ids and labels.get(id(v)) in (device, target)
                    ),
                    None,
                )
            if new is None:  # rule 3: any labelled blob
                new = next((labels[id(v)] for v in inputs if labels.get(id(v)) in (device, target)), device)
            for v in inputs:  # parameters and temporaries; activations carry their own label
                if id(v) not in act_ids:
                    labels.setdefault(id(v), new)
            for out in outputs:
                if id(out) in act_ids:
                    labels[id(out)] = target if id(out) in shifted else device
                else:
                    labels.setdefault(id(out), new)
            if new is not device:
                moves.append((node, device, new))

        # -- apply (all or nothing) ----------------------------------------------------
        done: list[tuple[ir.Node, str | None]] = []
        try:
            for node, _, new in moves:
                props = node.metadata_props
                done.append((node, props.get(DEVICE_KEY)))
                props[DEVICE_KEY] = str(new)
        except BaseException:
            for node, spec in done:
                if spec is None:
                    node.metadata_props.pop(DEVICE_KEY, None)
                else:
                    node.metadata_props[DEVICE_KEY] = spec
            raise
        moved = dict(Counter((old, new) for _, old, new in moves))
        pairs = ", ".join(f"{s}->{t}" for s, t in sources.items())
        if moved:
            log.info(
                "shift {%s}: moved %s",
                pairs,
                ", ".join(f"{n} ops {s} -> {t}" for (s, t), n in sorted(moved.items())),
            )
        else:
            log.info("shift {%s}: no op moved", pairs)
        if listed_elsewhere:
            log.info("shift: %d listed activations are not on a source device and stay", listed_elsewhere)
        if log.isEnabledFor(logging.DEBUG):
            for node, old, new in moves:
                log.debug("  %s (%s): %s -> %s", node.name, node.op_type, old, new)
        return ShiftResult(model, bool(moves), moved)

    def __repr__(self) -> str:
        pairs = ", ".join(f"{s}: {t}" for s, t in self.shifts.items())
        return f"ShiftActivationDevicesPass({len(self.activations)} activations, {{{pairs}}})"


def _resolve_names(graph: ir.Graph, acts: list[ir.Value], names: list[str]) -> set[int]:
    """Ids of the named activations; raise naming unknown names or non-activations."""
    by_name = {v.name: v for v in acts}
    ids: set[int] = set()
    missing: list[str] = []
    for name in names:
        value = by_name.get(name)
        if value is None:
            missing.append(name)
        else:
            ids.add(id(value))
    if missing:
        _raise_for(graph, missing)
    return ids


def _raise_for(graph: ir.Graph, missing: list[str]) -> None:
    index: dict[str, ir.Value] = {v.name: v for v in graph.inputs if v.name}
    index.update(graph.initializers)
    for node in graph:
        for value in node.outputs:
            if value.name:
                index[value.name] = value
    unknown = [name for name in dict.fromkeys(missing) if name not in index]
    if unknown:
        more = f" (and {len(unknown) - 1} more: {unknown[1:_MAX_NAMED]})" if len(unknown) > 1 else ""
        raise UnknownBlobError(f"cannot shift unknown blob {unknown[0]!r}: no such blob in the model{more}")
    name = missing[0]
    reason = describe_non_activation(graph, index[name])
    others = [n for n in dict.fromkeys(missing) if n != name]
    more = f" (and {len(others)} more: {others[:_MAX_NAMED - 1]})" if others else ""
    raise NotAnActivationError(f"cannot shift blob {name!r}: it is not an activation but {reason}{more}")


def shift_activation_devices(
    model: ModelLike,
    activations: Iterable[str] | str,
    shifts: Mapping[DeviceLike, DeviceLike],
) -> ShiftResult:
    """Move the ops handling ``activations`` from each source device to its target, in place.

    Caffe2's ``ShiftActivationDevices``: label propagation over the ops in graph
    order (see :mod:`placement.passes.shift`). All pairs in ``shifts`` apply at
    once, so ``{0: 1, 1: 0}`` swaps two devices' listed activations. Copies are
    not touched; call :func:`placement.inject_cross_device_copies` afterwards.

    Args:
        model: the placed model (changed in place).
        activations: names from :func:`placement.get_activation_blobs`.
        shifts: ``{source: target}`` with ints (GPU ids), ``"cuda:N"``/``"cpu"`` or ``Device``s.
            Sources must be devices some op uses; targets may be new.

    Returns:
        A :class:`ShiftResult` (``.modified``, ``.moved`` per device pair, ``.total``).

    Raises:
        UnknownBlobError: a name is not a blob of the model.
        NotAnActivationError: a name is a parameter, input, copy output or constant.
        DeviceError: a device is malformed or a source device has no ops.
        In every case the model is unchanged.

    Example:
        >>> import placement as pl
        >>> from models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> acts = pl.get_activation_blobs(model)
        >>> _ = pl.shift_activation_devices(model, acts[3:], {"cuda:0": "cpu"})
        >>> [str(d) for d in model.devices]
        ['cpu', 'cuda:0']
    """
    return cast(ShiftResult, ShiftActivationDevicesPass(activations, shifts)(model))
