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
  temporaries) take its device;
* an op on a source device that computes from parameters and constants alone (a
  weight transpose, a mask built by ``ConstantOfShape``) then follows its readers:
  when every op reading its results ends on the source's target, it moves there
  too (its result is a load-time value: keeping it behind would make runtimes copy
  a parameter-derived value per run instead of holding the parameter where it is read).

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
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> acts = pl.get_activation_blobs(model)
    >>> result = pl.shift_activation_devices(model, acts[len(acts) // 2:], {0: 1})
    >>> result.total, [str(op.device) for op in model.ops]
    (3, ['cuda:0', 'cuda:0', 'cuda:1', 'cuda:1', 'cuda:1'])
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import compress, repeat
from typing import Any, cast

import onnx_ir as ir
from onnx_ir.passes import PassResult

from placement.errors import DeviceError, NotAnActivationError, PlanError, UnknownBlobError
from placement.graph.device import Device, DeviceLike
from placement.graph.nodes import COPY_KEY, DEVICE_KEY, graph_nodes, name_of
from placement.passes.activations import describe_non_activation
from placement.passes.base import DeviceReader, ModelLike, PlacementPass, run_phases
from placement.passes.kv_cache import keep_caches_with_readers

__all__ = ["shift_activation_devices", "ShiftActivationDevicesPass", "ShiftResult", "parse_shifts"]

log = logging.getLogger(__name__)

_MAX_NAMED = 5  # offenders quoted in one error message
_UNSEEN = object()
_SPEC = operator.itemgetter(1)  # of a _Move


@dataclasses.dataclass
class ShiftResult(PassResult):
    """What a shift did: ``moved[(source, target)]`` = number of ops moved."""

    moved: dict[tuple[Device, Device], int] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # per phase

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
        if isinstance(activations, str):
            names = [activations]
        else:
            try:
                names = list(activations)
            except TypeError:
                raise UnknownBlobError(
                    f"activations must be a list of activation blob names, got {activations!r}"
                ) from None
        if not all(map(isinstance, names, repeat(str))):  # checked in C; then find the offender
            bad = next(name for name in names if not isinstance(name, str))
            raise UnknownBlobError(f"activation names are strings, got {bad!r}")
        self.activations = names
        self.shifts = parse_shifts(shifts)

    def call(self, model: ir.Model) -> ShiftResult:
        return _Shift(model, self.activations, self.shifts).run()

    def __repr__(self) -> str:
        pairs = ", ".join(f"{s}: {t}" for s, t in self.shifts.items())
        return f"ShiftActivationDevicesPass({len(self.activations)} activations, {{{pairs}}})"


#: An op to move and its device annotation before the move (a key of ``_Scan.target_of``).
_Move = tuple[ir.Node, "str | None"]


@dataclasses.dataclass
class _Scan:
    """What the read-only scan found (see :meth:`_Shift._scan`).

    Dependence follows :mod:`placement.analysis.dependence` (``activation_values``) step by
    step, fused with reading devices and copies so that the graph is walked once.
    """

    device_of: dict[str | None, Device] = dataclasses.field(default_factory=dict)  # annotation -> device
    #: annotation -> the target of its device, ``None`` when its device is not a source
    target_of: dict[str | None, Device | None] = dataclasses.field(default_factory=dict)
    candidates: list[ir.Value] = dataclasses.field(default_factory=list)  # dependent outputs of non-copies
    owners: list[ir.Node] = dataclasses.field(default_factory=list)  # the op of each candidate
    owner_specs: list[str | None] = dataclasses.field(default_factory=list)  # its device annotation
    origin: dict[ir.Value, ir.Value] = dataclasses.field(default_factory=dict)  # copy output -> blob
    acts: list[ir.Value] = dataclasses.field(default_factory=list)  # activations, producer order
    #: ops on source devices that read no activation or write nothing (rules 2-3 decide them)
    unfed: int = 0
    loners: list[ir.Node] = dataclasses.field(default_factory=list)  # such ops computing from parameters
    several_outputs: bool = False  # some candidate's op has several outputs (owners repeat)


@dataclasses.dataclass
class _Plan:
    """What the shift will do (see :meth:`_Shift._plan`); nothing is changed yet."""

    moves: list[_Move]
    listed_elsewhere: int  # listed activations not on a source device (they stay)


class _Shift:
    """One run of the pass: a read-only scan, validation and plan, then the mutation."""

    def __init__(self, model: ir.Model, activations: list[str], shifts: dict[Device, Device]) -> None:
        self.model = model
        self.graph = model.graph
        self.names = activations
        self.reader = DeviceReader()
        self.sources = {self.reader.canonical(s): self.reader.canonical(t) for s, t in shifts.items()}

    def run(self) -> ShiftResult:
        """Scan, validate and plan (read only), then apply: the graph changes in the last step only."""
        (scan, _, plan, moved), watch = run_phases(
            "shift",
            [
                ("scan", lambda done: self._scan()),
                ("validate", lambda done: self._validate(done[0])),
                ("propagate", lambda done: self._plan(*done)),
                ("apply", lambda done: self._apply(done[0], done[2].moves)),
            ],
        )
        self._log(scan, plan, moved)
        return ShiftResult(self.model, bool(plan.moves), moved, watch.seconds)

    def _scan(self) -> _Scan:
        """One pass over the ops: devices, copies, dependence and activations."""
        scan = _Scan()
        device_of, target_of, sources, reader = scan.device_of, scan.target_of, self.sources, self.reader
        candidates, owners, owner_specs, origin = scan.candidates, scan.owners, scan.owner_specs, scan.origin
        independent: set[ir.Value] = set()  # outputs of ops reading no graph input (see activations)
        consumed: set[ir.Value] = set()
        unfed = 0
        loners = scan.loners
        is_independent, consume = independent.__contains__, consumed.add
        target_get = target_of.get
        for node in graph_nodes(self.graph):  # slots read directly: see graph_nodes
            props = node._metadata_props
            spec = props.get(DEVICE_KEY) if props else None
            target = target_get(spec, _UNSEEN)
            if target is _UNSEEN:
                device = reader.of(node)  # raises DeviceError naming the op
                device_of[spec] = device
                target = target_of[spec] = sources.get(device)
            hit = False
            for value in node._inputs:
                if value is not None and not value._is_initializer and not is_independent(value):
                    hit = True
                    consume(value)
            outputs = node._outputs
            if not hit:
                independent.update(outputs)
            if props and COPY_KEY in props:
                inputs = node._inputs
                if inputs and inputs[0] is not None:
                    origin[outputs[0]] = origin.get(inputs[0], inputs[0])
                continue
            if hit and outputs:
                candidates.extend(outputs)
                if len(outputs) == 1:
                    owners.append(node)
                    owner_specs.append(spec)
                else:
                    owners.extend([node] * len(outputs))
                    owner_specs.extend([spec] * len(outputs))
                    scan.several_outputs = True
            elif target is not None:
                unfed += 1
                if not hit and outputs:
                    loners.append(node)
        scan.unfed = unfed
        scan.acts = [v for v in candidates if v in consumed or v._is_graph_output]
        return scan

    def _validate(self, scan: _Scan) -> _Listed:
        """The listed activations; raise naming unknown blobs, non-activations or unused sources."""
        shifted = _resolve_names(self.graph, scan.acts, self.names)
        in_use = set(scan.device_of.values())
        for source in self.sources:
            if source not in in_use:
                known = ", ".join(str(d) for d in sorted(in_use)) or "none"
                raise DeviceError(
                    f"shift source device {source} is not used by any op (model devices: {known})"
                )
        return shifted

    def _plan(self, scan: _Scan, listed: _Listed) -> _Plan:
        """Label propagation over the ops on source devices (read only): which ops move."""
        device_of, target_of, candidates, acts = scan.device_of, scan.target_of, scan.candidates, scan.acts
        dead_outputs = len(acts) < len(candidates)
        act_set = set(acts) if scan.unfed or dead_outputs else set()
        if scan.unfed or (dead_outputs and _has_op_without_activations(candidates, act_set, target_of)):
            # some op on a source device has no output activation: rules 2-3 read labels
            shifted = set(listed.values)
            moves, seen = _propagate(self.graph, scan.origin, act_set, shifted, device_of, target_of)
        else:  # fast path: rule 1 decides every op: the producers of listed activations move
            moves, seen = _listed_producers(scan, listed.over(scan))
        if scan.loners:
            moves = _follow_readers(self.graph, scan.loners, moves, device_of, target_of)
        moves = keep_caches_with_readers(self.graph, moves, device_of, target_of)
        return _Plan(moves, len(listed.values) - seen)

    @staticmethod
    def _apply(scan: _Scan, moves: list[_Move]) -> dict[tuple[Device, Device], int]:
        """Re-annotate the moving ops, all or nothing; returns ops moved per device pair."""
        device_of, target_of = scan.device_of, scan.target_of
        spelled = {spec: str(target) for spec, target in target_of.items() if target is not None}
        done = 0
        try:
            for node, spec in moves:
                props = node._metadata_props  # slot read directly: see graph_nodes
                if props is None:
                    props = node.metadata_props
                props[DEVICE_KEY] = spelled[spec]
                done += 1
        except BaseException:
            for node, spec in moves[:done]:
                if spec is None:
                    node.metadata_props.pop(DEVICE_KEY, None)
                else:
                    node.metadata_props[DEVICE_KEY] = spec
            raise
        moved: dict[tuple[Device, Device], int] = {}
        for spec, count in Counter(map(_SPEC, moves)).items():
            pair = (device_of[spec], cast(Device, target_of[spec]))
            moved[pair] = moved.get(pair, 0) + count
        return moved

    def _log(self, scan: _Scan, plan: _Plan, moved: dict[tuple[Device, Device], int]) -> None:
        pairs = ", ".join(f"{s}->{t}" for s, t in self.sources.items())
        if moved:
            log.info(
                "shift {%s}: moved %s",
                pairs,
                ", ".join(f"{n} ops {s} -> {t}" for (s, t), n in sorted(moved.items())),
            )
        else:
            log.info("shift {%s}: no op moved", pairs)
        if plan.listed_elsewhere:
            log.info(
                "shift: %d listed activations are not on a source device and stay", plan.listed_elsewhere
            )
        if log.isEnabledFor(logging.DEBUG):
            for node, spec in plan.moves:
                log.debug(
                    "  %s (%s): %s -> %s", node.name, node.op_type, scan.device_of[spec], scan.target_of[spec]
                )


def _listed_producers(scan: _Scan, listed: list[bool]) -> tuple[list[_Move], int]:
    """Rule 1 alone: the ops producing listed activations on a source device move.

    Returns the moves (each op once, graph order) and how many listed activations sit on a
    source device. ``listed`` flags the candidates that are listed. The per-candidate work
    runs in C (``map``/``compress``): half a million listed activations are common.
    """
    device_of, target_of, specs = scan.device_of, scan.target_of, scan.owner_specs
    on_source = {spec for spec, target in target_of.items() if target is not None}
    moving = {spec for spec in on_source if target_of[spec] is not device_of[spec]}
    if on_source.issuperset(device_of):  # every op is on a source device
        seen = sum(listed)
    else:
        seen = sum(compress(map(on_source.__contains__, specs), listed))
    if not moving:
        return [], seen
    moves = compress(zip(scan.owners, specs), map(operator.and_, listed, map(moving.__contains__, specs)))
    if scan.several_outputs:
        return list(dict(moves).items()), seen  # an op with several listed outputs moves once
    return list(moves), seen


def _propagate(
    graph: ir.Graph,
    origin: dict[ir.Value, ir.Value],
    acts: set[ir.Value],
    shifted: set[ir.Value],
    device_of: dict[str | None, Device],
    target_of: dict[str | None, Device | None],
) -> tuple[list[tuple[ir.Node, str | None]], int]:
    """Label propagation with all rules; returns the moves and the listed activations seen."""
    is_act, is_shifted = acts.__contains__, shifted.__contains__
    labels: dict[ir.Value, Device] = {}
    moves: list[tuple[ir.Node, str | None]] = []
    seen = 0
    for node in graph:
        props = node.metadata_props
        spec = props.get(DEVICE_KEY)
        if COPY_KEY in props or target_of[spec] is None:
            continue
        device, target = device_of[spec], cast(Device, target_of[spec])
        inputs: Sequence[ir.Value | None] = node.inputs
        outputs = node.outputs
        new = None
        for out in outputs:  # rule 1: output activations, a listed one first
            if is_act(out):
                if is_shifted(out):
                    new = target
                    seen += 1
                elif new is None:
                    new = device
        if origin:
            inputs = [origin.get(v, v) for v in inputs]  # type: ignore[arg-type]
        if new is None:
            new = _follow(inputs, labels, is_act, device, target)
        for value in inputs:  # parameters and temporaries take the op's device
            if value is not None and not is_act(value) and value not in labels:
                labels[value] = new
        for out in outputs:
            if is_act(out):
                labels[out] = target if is_shifted(out) else device
            elif out not in labels:
                labels[out] = new
        if new is not device:
            moves.append((node, spec))
    return moves, seen


def _follow_readers(
    graph: ir.Graph,
    loners: list[ir.Node],
    moves: list[tuple[ir.Node, str | None]],
    device_of: dict[str | None, Device],
    target_of: dict[str | None, Device | None],
) -> list[tuple[ir.Node, str | None]]:
    """Ops computing from parameters alone move to their source's target when all readers do."""
    new_device: dict[ir.Node, Device] = {node: cast(Device, target_of[spec]) for node, spec in moves}
    extra: list[tuple[ir.Node, str | None]] = []
    for node in reversed(loners):  # readers first, so chains of such ops follow together
        spec = node.metadata_props.get(DEVICE_KEY)
        target = cast(Device, target_of[spec])
        if target == device_of[spec] or new_device.get(node) is target:
            continue
        ends: set[Device] = set()
        for out in node.outputs:
            if out.is_graph_output():
                ends.add(device_of[spec])
            for use in out.uses():
                reader = use.node
                if reader.graph is not graph:
                    ends.add(device_of[spec])
                    continue
                found = new_device.get(reader)
                if found is None:
                    rspec = reader.metadata_props.get(DEVICE_KEY)
                    found = device_of.get(rspec)
                    if found is None:
                        found = Device.parse(rspec) if rspec is not None else Device("cuda", 0)
                ends.add(found)
        if ends == {target}:
            new_device[node] = target
            extra.append((node, spec))
    return moves + extra if extra else moves


def _has_op_without_activations(
    candidates: list[ir.Value], acts: set[ir.Value], target_of: dict[str | None, Device | None]
) -> bool:
    """True if an op on a source device has outputs of which none is an activation."""
    for value in candidates:
        if value in acts:
            continue
        producer = cast(ir.Node, value.producer())  # an op with a dead output: any activation?
        if target_of.get(producer.metadata_props.get(DEVICE_KEY)) is not None:
            if not any(out in acts for out in producer.outputs):
                return True
    return False


def _follow(
    inputs: Sequence[ir.Value | None],
    labels: dict[ir.Value, Device],
    is_act: Callable[[Any], bool],
    device: Device,
    target: Device,
) -> Device:
    """Rules 2 and 3 for an op without output activations: follow a labelled input."""
    allowed = (device, target)
    for value in inputs:  # rule 2: a labelled input activation
        if is_act(value) and labels.get(value) in allowed:  # type: ignore[arg-type]
            return labels[value]  # type: ignore[index]
    for value in inputs:  # rule 3: any labelled blob
        if value is not None and labels.get(value) in allowed:
            return labels[value]
    return device


@dataclasses.dataclass
class _Listed:
    """The listed activations: ``values`` (distinct, producer order) and, when the names were
    in producer order, ``flags``: for each activation of the scan, whether it is listed."""

    values: list[ir.Value]
    flags: list[bool] | None = None

    def over(self, scan: _Scan) -> list[bool]:
        """For each candidate of ``scan``, whether it is listed."""
        if self.flags is not None and len(scan.acts) == len(scan.candidates):
            return self.flags  # every candidate is an activation: the flags line up
        return list(map(set(self.values).__contains__, scan.candidates))


def _resolve_names(graph: ir.Graph, acts: list[ir.Value], names: list[str]) -> _Listed:
    """The named activations; raise naming unknown names or non-activations."""
    if not names:
        return _Listed([], [False] * len(acts))
    flags = _merge(acts, names)
    if flags is not None:  # names in producer order (a slice of get_activation_blobs)
        return _Listed(list(compress(acts, flags)), flags)
    # any order, duplicates, or bad names
    names_set = set(names)
    found = list(compress(acts, map(names_set.__contains__, map(name_of, acts))))
    if len(found) < len(names_set):
        have = {v.name for v in found}
        _raise_for(graph, [name for name in names if name not in have])
    return _Listed(found)


def _merge(acts: list[ir.Value], names: list[str]) -> list[bool] | None:
    """Which activations are named, if ``names`` lists activations in producer order; else None.

    A merge of two ordered lists: no hashing, and names compare by identity first (they
    are usually the very strings ``get_activation_blobs`` returned).
    """
    flags: list[bool] = []
    flag = flags.append
    count, total, wanted = 0, len(names), names[0]
    for value in acts:
        name = value._name  # slot read directly: see graph_nodes
        if name is wanted or name == wanted:
            flag(True)
            count += 1
            if count == total:
                flags.extend(repeat(False, len(acts) - len(flags)))
                return flags
            wanted = names[count]
        else:
            flag(False)
    return None


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
    more = f" (and {len(others)} more: {others[: _MAX_NAMED - 1]})" if others else ""
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
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> acts = pl.get_activation_blobs(model)
        >>> _ = pl.shift_activation_devices(model, acts[3:], {"cuda:0": "cpu"})
        >>> [str(d) for d in model.devices]
        ['cpu', 'cuda:0']
    """
    return cast(ShiftResult, ShiftActivationDevicesPass(activations, shifts)(model))
