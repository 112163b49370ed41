"""Cross-device copy injection (Caffe2's ``InjectCrossDeviceCopies``), idempotent.

After ops are placed, every edge whose ends sit on different devices must go
through a copy. The pass brings the graph to exactly that state, whatever copies
it already has:

* one copy per (blob, destination device), never two; every consumer on that
  device reads it, consumers on the blob's own device read the blob;
* a copy is an ``Identity`` op on its destination device, marked ``static`` when
  its source is a parameter (runtimes copy it once at load time), ``streamed``
  when that parameter is streamed (it lives in host memory, see
  :func:`placement.stream_parameters`, and runtimes copy it every run, prefetched),
  or ``dynamic``;
  its output blob is ``<blob>_<type>_<index>`` (``fc3_cuda_1``), made unique
  (``fc3_cuda_1_1``) if the name is taken;
* a copy sits just before the first op that reads it, so it joins that op's
  device segment; a copy only a graph output reads goes at the end;
* a ``Loop``/``Scan`` body or ``If`` branch that reads a blob of the enclosing
  graph (an outer-scope read) reads it on its op's device: through a copy made in
  the enclosing graph, before the op, when the blob lives elsewhere;
* graph inputs are fed on the input device, graph outputs are gathered on the
  output device. Names are kept: a consumer of input ``x`` on another device reads
  ``x_cuda_1``; an output ``y`` produced on ``cuda:1`` but wanted on ``cuda:0``
  becomes ``y_cuda_1`` (the blob as it lives on ``cuda:1``) and a copy produces
  ``y`` on ``cuda:0``;
* copies left over from an earlier injection are repaired: redundant ones (same
  device at both ends, duplicates, unused) are removed and their readers rewired,
  chains are shortened to read the original blob, misplaced ones are moved.

Running it twice changes nothing the second time. A parameter lives where its
first reader (graph order) runs, like everywhere in ``placement``; a graph input
or output passed straight through (not produced by an op) is left as it is.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> acts = pl.get_activation_blobs(model)
    >>> _ = pl.shift_activation_devices(model, acts[2:], {0: 1})
    >>> result = pl.inject_cross_device_copies(model, output_device=0)
    >>> [(op.inputs[0], op.outputs[0], str(op.device)) for op in model.ops if op.is_copy]
    [('relu', 'relu_cuda_1', 'cuda:1'), ('linear_2_cuda_1', 'linear_2', 'cuda:0')]
    >>> pl.verify(model)
    >>> pl.inject_cross_device_copies(model, output_device=0).modified
    False
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import cast

import onnx_ir as ir
from onnx_ir.passes import PassResult

from placement.errors import VerificationError
from placement.graph import edit
from placement.graph.device import Device, DeviceLike
from placement.graph.nodes import (
    COPY_KEY,
    DEVICE_KEY,
    INPUT_DEVICE_KEY,
    OUTPUT_DEVICE_KEY,
    STREAMED_KEY,
    SUBGRAPH_OP_TYPES,
    graph_nodes,
    name_of,
    streamed_homes,
    subgraphs_of,
)
from placement.passes.base import DeviceReader, ModelLike, PlacementPass, run_phases

__all__ = [
    "inject_cross_device_copies",
    "InjectCrossDeviceCopiesPass",
    "CopyResult",
    "copy_kind",
    "COPY_OP_TYPE",
]

log = logging.getLogger(__name__)

_COPY_LIKE = re.compile(r"_(?:cuda|cpu)_\d").search  # what every name made here contains

#: A required copy: (the blob, ``id`` of its interned destination device; hashing ids is cheap).
_Key = tuple[ir.Value, int]

#: The ONNX op type of a copy.
COPY_OP_TYPE = "Identity"


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


def copy_kind(source: ir.Value, *, streamed: bool = False) -> str:
    """``"static"`` for a copy of a parameter (not also a graph input), ``"streamed"`` for one of
    a streamed parameter (``streamed=True``), else ``"dynamic"``."""
    if source.is_initializer() and not source.is_graph_input():
        return "streamed" if streamed else "static"
    return "dynamic"


@dataclasses.dataclass(slots=True)
class _Need:
    """A required copy of ``origin`` to ``device``: where its first reader sits."""

    origin: ir.Value
    device: Device
    first_pos: int = -1  # position of the first reader on ``device``, -1: none (output only)
    first_node: ir.Node | None = None
    output_slot: int = -1  # >= 0 when this copy is graph output number ``output_slot``
    output_name: str = ""
    copy: ir.Value | None = None  # the blob the copy produces, once it exists (set by _apply)


class InjectCrossDeviceCopiesPass(PlacementPass):
    """Insert, repair or remove copies so that every cross-device edge has exactly one.

    Args:
        input_device: device graph inputs are fed on; ``None``: the device of the
            first op that reads a graph input.
        output_device: device graph outputs are gathered on; ``None``: the device of
            the last op (graph order) that produces a graph output.
        debug: run ``verify`` afterwards (default: ``PLACEMENT_DEBUG``).

    ``call`` returns a :class:`CopyResult` and records both devices in the model.
    """

    ensures_verified = True

    def __init__(
        self,
        *,
        input_device: DeviceLike | None = None,
        output_device: DeviceLike | None = None,
        debug: bool | None = None,
        check_onnx: bool = True,
    ) -> None:
        super().__init__(debug=debug, check_onnx=check_onnx)
        self.input_device = Device.parse(input_device) if input_device is not None else None
        self.output_device = Device.parse(output_device) if output_device is not None else None

    def __repr__(self) -> str:
        return (
            f"InjectCrossDeviceCopiesPass(input_device={self.input_device}, "
            f"output_device={self.output_device})"
        )

    def call(self, model: ir.Model) -> CopyResult:
        return _Injection(model, self.input_device, self.output_device).run()


@dataclasses.dataclass
class _Scan:
    """What the read-only scan found (see :meth:`_Injection._scan`)."""

    in_dev: Device
    origin: dict[ir.Value, ir.Value] = dataclasses.field(default_factory=dict)  # copy output -> blob
    dev_of: dict[ir.Value, Device] = dataclasses.field(default_factory=dict)  # blob -> its device
    #: each parameter read, and the position of its first (non-copy) reader, in read order
    params: list[ir.Value] = dataclasses.field(default_factory=list)
    param_pos: list[int] = dataclasses.field(default_factory=list)
    copies: list[tuple[ir.Node, int, ir.Value, Device]] = dataclasses.field(default_factory=list)
    #: reads to look at: (reader, input index, blob read, blob it carries, reader's device or
    #: ``None`` when that is the carried blob's device, reader's position)
    uses: list[tuple[ir.Node, int, ir.Value, ir.Value, Device | None, int]] = dataclasses.field(
        default_factory=list
    )
    #: reads of the graph's blobs from inside subgraphs, as ``uses`` plus the op owning the
    #: subgraph (the reader as far as devices and positions go)
    inner_uses: list[tuple[ir.Node, int, ir.Value, ir.Value, Device | None, int, ir.Node]] = (
        dataclasses.field(default_factory=list)
    )

    def home_positions(self) -> dict[ir.Value, int]:
        """Parameter -> position of its first reader (where the parameter lives)."""
        return dict(zip(self.params, self.param_pos))


@dataclasses.dataclass
class _Decision:
    """What the plan decided (see :meth:`_Injection._plan`); nothing is changed yet."""

    outputs: list[tuple[int, ir.Value, ir.Value, str]]
    protected: set[ir.Node]
    repeated: list[tuple[int, int]]
    out_dev: Device
    needs: dict[_Key, _Need] = dataclasses.field(default_factory=dict)
    keep: dict[_Key, ir.Node] = dataclasses.field(default_factory=dict)
    remove: list[ir.Node] = dataclasses.field(default_factory=list)
    misplaced: list[tuple[ir.Node, _Need]] = dataclasses.field(default_factory=list)
    #: for each of ``_Scan.uses``: the copy its reader must read, ``None``: the blob itself
    readers: list[_Need | None] = dataclasses.field(default_factory=list)
    inner_readers: list[_Need | None] = dataclasses.field(default_factory=list)  # for ``inner_uses``


class _Injection:
    """One run of the pass: a read-only scan and plan, then the mutation."""

    def __init__(self, model: ir.Model, input_device: Device | None, output_device: Device | None) -> None:
        self.model = model
        self.graph = model.graph
        self.reader = DeviceReader()
        self.input_device = self.reader.canonical(input_device) if input_device else None
        self.output_device = self.reader.canonical(output_device) if output_device else None
        self.result = CopyResult(model, False)
        self._value_names: set[str] | None = None
        self._node_names: set[str] | None = None
        self._bases: dict[ir.Value, str] = {}
        #: names seen by the scan while each op was at hand, those containing ``_c`` (every
        #: copy-like name does): every op's, and the outputs' of non-copy ops. Filtering there,
        #: while the string is in cache, spares walking (and freeing) two million cold strings.
        self._op_names: list[str] = []
        self._blob_names: list[str] = []
        self._copy_nodes: list[ir.Node] = []
        self._spelled: dict[Device, tuple[str, str]] = {}  # device -> (annotation, name part)
        #: streamed parameters -> their (interned) host device; they live there, not at their reader
        self.homes: dict[ir.Value, Device] = {}
        if STREAMED_KEY in model.metadata_props:
            inits = model.graph.initializers
            for name, host in streamed_homes(model).items():
                value = inits.get(name)
                if value is None:
                    log.warning("streamed parameter %r is not in the model; ignored", name)
                    continue
                self.homes[value] = self.reader.canonical(host)

    def run(self) -> CopyResult:
        """Scan (read only), plan (read only), then apply: the graph changes in the last step only."""
        (_, _, result), watch = run_phases(
            "inject_cross_device_copies",
            [
                ("scan", lambda done: self._scan()),
                ("plan", lambda done: self._plan(done[0])),
                ("mutate", lambda done: self._apply(*done)),
            ],
        )
        result.seconds = watch.seconds
        if result.modified:
            log.info("inject_cross_device_copies: %s", result)
        else:
            log.debug("inject_cross_device_copies: nothing to do (%d copies)", result.copies)
        return result

    def _scan(self) -> _Scan:
        """One pass over the ops: where every blob lives, which reads cross devices, the copies."""
        graph = self.graph
        inputs_ = {v for v in graph.inputs if not v.is_initializer()}
        scan = _Scan(in_dev=self.input_device or self._default_input_device(inputs_))
        in_dev = scan.in_dev
        origin, dev_of, copies = scan.origin, scan.dev_of, scan.copies
        param, param_pos = scan.params.append, scan.param_pos.append  # two appends: cheaper than a dict
        spec_device: dict[str | None, Device] = {}
        dev_get, origin_get, record = dev_of.get, origin.get, scan.uses.append
        nodes = graph_nodes(graph)
        homes = self.homes
        op_name, blob_name = self._op_names.append, self._blob_names.append
        for pos, node in enumerate(nodes):  # slots read directly: see graph_nodes
            props = node._metadata_props
            spec = props.get(DEVICE_KEY) if props else None
            device = spec_device.get(spec)
            if device is None:
                device = spec_device[spec] = self.reader.of(node)  # raises naming the op
            name = node._name
            if name and "_c" in name:
                op_name(name)
            if props and COPY_KEY in props:
                inputs, outputs = node._inputs, node._outputs
                if len(inputs) != 1 or len(outputs) != 1 or inputs[0] is None:
                    raise VerificationError(f"copy {node.name!r} must have exactly one input and one output")
                source = origin_get(inputs[0], inputs[0])
                if source not in dev_of and source not in inputs_ and not source._is_initializer:
                    self._not_topological(node, source)
                origin[outputs[0]] = source
                copies.append((node, pos, source, device))
                continue
            index = -1
            for value in node._inputs:
                index += 1
                if value is None:
                    continue
                source = origin_get(value, value) if origin else value
                where = dev_get(source)
                if where is device and source is value:
                    continue
                if where is None:  # a graph input or a parameter, read for the first time
                    if source in inputs_:
                        where = in_dev
                    else:  # a parameter lives where its first reader runs (streamed: on its host)
                        if not source._is_initializer:
                            self._not_topological(node, source)
                        where = homes.get(source, device) if homes else device
                        param(source)
                        param_pos(pos)
                    dev_of[source] = where
                    if where is device and source is value:
                        continue
                record((node, index, value, source, device if where is not device else None, pos))
            if node._op_type in SUBGRAPH_OP_TYPES:
                self._scan_subgraphs(scan, node, device, pos, inputs_)
            outputs = node._outputs
            if len(outputs) == 1:
                value = outputs[0]
                dev_of[value] = device
                name = value._name
                if name and "_c" in name:
                    blob_name(name)
            else:
                for value in outputs:
                    dev_of[value] = device
                    name = value._name
                    if name and "_c" in name:
                        blob_name(name)
        self._copy_nodes = [node for node, _, _, _ in copies]
        return scan

    def _scan_subgraphs(
        self, scan: _Scan, node: ir.Node, device: Device, pos: int, inputs_: set[ir.Value]
    ) -> None:
        """Record ``node``'s subgraphs' reads of this graph's blobs, read on ``node``'s device."""
        graph, origin, dev_of = self.graph, scan.origin, scan.dev_of
        for _, sub in subgraphs_of(node):
            for inner in sub.all_nodes():
                for index, value in enumerate(inner.inputs):
                    if value is None or value.graph is not graph:
                        continue
                    source = origin.get(value, value)
                    where = dev_of.get(source)
                    if where is None:  # a graph input, or a parameter read here first: it lives here
                        if source in inputs_:
                            where = scan.in_dev
                        else:
                            if not source.is_initializer():
                                self._not_topological(node, source)
                            where = self.homes.get(source, device)
                            scan.params.append(source)
                            scan.param_pos.append(pos)
                        dev_of[source] = where
                    if where is device and source is value:
                        continue
                    reader_device = device if where is not device else None
                    scan.inner_uses.append((inner, index, value, source, reader_device, pos, node))

    def _plan(self, scan: _Scan) -> _Decision:
        """Which copies are needed, which existing ones to keep, remove or move (read only)."""
        graph, origin, dev_of = self.graph, scan.origin, scan.dev_of
        outputs, protected, repeated = self._plan_outputs(origin)
        self._bases = {source: name for _, _, source, name in outputs}  # copies of y: y_cuda_2
        out_dev = self.output_device or self._default_output_device(outputs) or scan.in_dev
        decision = _Decision(outputs=outputs, protected=protected, repeated=repeated, out_dev=out_dev)
        needs, keep = decision.needs, decision.keep
        reads = decision.readers.append
        for node, _, _, source, device, pos in scan.uses:
            if device is None:  # on the blob's own device (reading it through a copy)
                reads(None)
                continue
            key = (source, id(device))
            need = needs.get(key)
            if need is None:
                needs[key] = need = _Need(source, device, pos, node)
            elif pos < need.first_pos:
                need.first_pos, need.first_node = pos, node
            reads(need)
        # reads inside subgraphs: the same rule, the op owning the subgraph as the reader (a
        # second loop rather than a shared helper: the loop above runs once per read of 1M ops)
        for _, _, _, source, device, pos, owner in scan.inner_uses:
            if device is None:
                decision.inner_readers.append(None)
                continue
            key = (source, id(device))
            need = needs.get(key)
            if need is None:
                needs[key] = need = _Need(source, device, pos, owner)
            elif pos < need.first_pos:
                need.first_pos, need.first_node = pos, owner
            decision.inner_readers.append(need)
        for slot, _, source, name in outputs:
            if dev_of.get(source) is not out_dev:
                need = needs.setdefault((source, id(out_dev)), _Need(source, out_dev))
                need.output_slot, need.output_name = slot, name

        for need in needs.values():  # prefer the copy that already is the graph output
            if need.output_slot >= 0:
                producer = graph.outputs[need.output_slot].producer()
                if producer is not None and COPY_KEY in producer.metadata_props:
                    same = origin.get(producer.outputs[0]) is need.origin
                    if same and self.reader.of(producer) == need.device:
                        keep[(need.origin, id(need.device))] = producer
        kept = set(keep.values())
        home_pos = scan.home_positions() if scan.copies else {}
        for node, pos, source, device in scan.copies:
            if node in protected:
                continue
            key = (source, id(device))
            need = needs.get(key)
            if need is None or (key in keep and node not in kept):
                decision.remove.append(node)
                continue
            keep[key] = node
            early = pos < home_pos.get(source, -1) and source not in self.homes  # streamed: no home op
            if (need.first_pos >= 0 and pos > need.first_pos) or early:
                decision.misplaced.append((node, need))
        return decision

    def _apply(self, scan: _Scan, decision: _Decision) -> CopyResult:
        """Carry out the decision: the only step that changes the graph."""
        graph, dev_of, result = self.graph, scan.dev_of, self.result
        needs, keep = decision.needs, decision.keep
        for node in decision.remove:
            self._set_name(node.outputs[0], None, count=False)  # leaves the graph; frees the name
        self._apply_outputs(decision.outputs, needs, keep, dev_of)
        created = self._new_copies(needs, keep)
        for slot, first in decision.repeated:  # a blob listed twice as a graph output stays so
            if graph.outputs[slot] is not graph.outputs[first]:
                graph.outputs[slot] = graph.outputs[first]
                result.modified = True
        for key, node in keep.items():  # (created copies are linked to their needs already)
            needs[key].copy = node._outputs[0]
        rewired = 0
        rewire = edit.rewire  # replace_input_with, in bulk: see placement.graph.edit
        for (node, index, value, source, _, _), need in zip(scan.uses, decision.readers):
            want = source if need is None else need.copy
            if want is not value:
                rewire(node, index, want)
                rewired += 1
        for (node, index, value, source, _, _, _), need in zip(scan.inner_uses, decision.inner_readers):
            want = source if need is None else need.copy
            if want is not value:
                rewire(node, index, want)
                rewired += 1
        result.rewired += rewired
        for key, node in keep.items():
            source = needs[key].origin
            if node.inputs[0] is not source:
                rewire(node, 0, source)
                result.rewired += 1
            kind = copy_kind(source, streamed=source in self.homes)
            if node.metadata_props.get(COPY_KEY) != kind:
                node.metadata_props[COPY_KEY] = kind
                result.modified = True
        if decision.remove:
            graph.remove(decision.remove, safe=True)
            result.removed = len(decision.remove)
        for node, need in decision.misplaced:
            self._place(node, need)
            result.moved += 1
        self._place_new(created)
        result.added += len(created)
        self._record_io_devices(scan.in_dev, decision.out_dev)

        result.copies = len(keep) + len(created) + len(decision.protected)
        result.modified = result.modified or bool(
            result.added or result.removed or result.rewired or result.renamed or result.moved
        )
        result.input_device, result.output_device = scan.in_dev, decision.out_dev
        return result

    @staticmethod
    def _not_topological(node: ir.Node, source: ir.Value) -> None:
        """A blob read before any op produced it, and not a parameter or graph input."""
        raise VerificationError(
            f"op {node.name!r} reads blob {source.name!r} before it is produced "
            "(ops are not in topological order, or the blob has no producer)"
        )

    def _default_input_device(self, inputs: set[ir.Value]) -> Device:
        """The device of the first non-copy op reading a graph input (directly or via copies)."""
        reaching: set[ir.Value | None] = set(inputs)
        for node in self.graph:
            if COPY_KEY in node.metadata_props:
                if node.inputs and node.inputs[0] in reaching:
                    reaching.update(node.outputs)
                continue
            for value in node.inputs:
                if value in reaching:
                    return self.reader.of(node)
        for node in self.graph:
            if COPY_KEY not in node.metadata_props:
                return self.reader.of(node)
        return self.reader.canonical(Device("cuda", 0))

    def _plan_outputs(
        self, origin: dict[ir.Value, ir.Value]
    ) -> tuple[list[tuple[int, ir.Value, ir.Value, str]], set[ir.Node], list[tuple[int, int]]]:
        """Graph outputs to handle: ``(slot, output value, the blob it is, output name)`` for
        outputs produced by ops, once per blob; the copies passing a graph input or parameter
        straight to an output (left alone); and ``(slot, first slot)`` for a value listed twice."""
        planned: list[tuple[int, ir.Value, ir.Value, str]] = []
        protected: set[ir.Node] = set()
        first_slot: dict[ir.Value, int] = {}
        repeated: list[tuple[int, int]] = []
        for slot, value in enumerate(self.graph.outputs):
            source = origin.get(value, value)
            producer = source.producer()
            if producer is None or producer.graph is not self.graph:
                if value.producer() is not None:
                    protected.add(value.producer())
                continue
            if source in first_slot:  # a second slot for the same blob
                first = first_slot[source]
                if self.graph.outputs[first] is value:
                    repeated.append((slot, first))
                continue
            first_slot[source] = slot
            planned.append((slot, value, source, value.name or ""))
        return planned, protected, repeated

    def _default_output_device(self, outputs: list[tuple[int, ir.Value, ir.Value, str]]) -> Device | None:
        """The device of the last op (graph order) producing a graph output."""
        producers = {source.producer() for _, _, source, _ in outputs}
        if not producers:
            return None
        for node in reversed(self.graph):
            if node in producers:
                return self.reader.of(node)
        return None

    # -- mutation helpers ------------------------------------------------------------------

    def _apply_outputs(
        self,
        outputs: list[tuple[int, ir.Value, ir.Value, str]],
        needs: dict[_Key, _Need],
        keep: dict[_Key, ir.Node],
        dev_of: dict[ir.Value, Device],
    ) -> None:
        """Keep every graph output's name on the output device; rename the blobs behind them.

        A blob produced on the output device is the output itself. Otherwise the blob
        is renamed ``<output>_<type>_<index>`` after the device it lives on and the copy
        to the output device carries the output's name (a copy created later takes it).
        """
        graph = self.graph
        by_slot = {need.output_slot: need for need in needs.values() if need.output_slot >= 0}
        for slot, value, source, name in outputs:
            need = by_slot.get(slot)
            copy = keep.get((need.origin, id(need.device))) if need is not None else None
            if value is not source and value.name is not None and value.producer() is not copy:
                # an old output copy that stays as an internal copy: give it a copy's name
                device = self.reader.of(cast(ir.Node, value.producer()))
                self._set_name(value, self._unique_value(f"{name}_{device.slug}"))
            if need is None:  # produced on the output device: the blob is the output
                if value is not source:
                    graph.outputs[slot] = source
                self._set_name(source, name)
                continue
            want = f"{name}_{dev_of[source].slug}"
            if source.name != want and not _is_numbered(source.name, want):
                self._set_name(source, self._unique_value(want))
            if copy is not None:  # otherwise the copy created next takes the name
                if copy.outputs[0] is not value:
                    graph.outputs[slot] = copy.outputs[0]
                self._set_name(copy.outputs[0], name)

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

    def _new_copies(self, needs: dict[_Key, _Need], keep: dict[_Key, ir.Node]) -> list[tuple[_Need, ir.Node]]:
        """The copies to create (every need no kept copy meets), not yet in the graph.

        Named in ``needs`` order (see the module doc): a copy that is a graph output
        takes the output's name and slot; any other is named after its blob and device.
        One loop with the IR's slots read directly (see ``graph_nodes``) and nodes made
        through :mod:`placement.graph.edit`: a million-op graph makes 250k of them.
        """
        created: list[tuple[_Need, ir.Node]] = []
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

    def _place(self, node: ir.Node, need: _Need) -> None:
        if need.first_node is not None:
            self.graph.insert_before(need.first_node, node)
        elif node.graph is None:
            self.graph.append(node)

    def _place_new(self, created: list[tuple[_Need, ir.Node]]) -> None:
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

    def _record_io_devices(self, in_dev: Device, out_dev: Device) -> None:
        props = self.model.metadata_props
        for key, device in ((INPUT_DEVICE_KEY, in_dev), (OUTPUT_DEVICE_KEY, out_dev)):
            if props.get(key) != str(device):
                props[key] = str(device)
                self.result.modified = True

    # -- names -------------------------------------------------------------------------------

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


def inject_cross_device_copies(
    model: ModelLike,
    *,
    input_device: DeviceLike | None = None,
    output_device: DeviceLike | None = None,
) -> CopyResult:
    """Put exactly one copy on every (blob, destination device) edge; idempotent.

    See :mod:`placement.passes.copies` for the rules (names, graph inputs and
    outputs, static copies, repair of earlier copies).

    Args:
        model: the placed model (changed in place).
        input_device: where graph inputs are fed; ``None``: the device of the first
            op reading a graph input.
        output_device: where graph outputs are gathered; ``None``: the device of the
            last op producing a graph output.

    Returns:
        A :class:`CopyResult` (``.modified``, ``.added``, ``.removed``, ``.copies``, ...).

    Raises:
        DeviceError: an op's device or an argument is malformed (model unchanged).
        VerificationError: a copy op is malformed (model unchanged).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> result = pl.inject_cross_device_copies(model, output_device="cpu")
        >>> model.outputs, [op.name for op in model.ops if op.is_copy]
        (['linear_2'], ['copy_linear_2_cpu_0'])
        >>> str(model.output_device), pl.inject_cross_device_copies(model).modified
        ('cpu', True)
    """
    pass_ = InjectCrossDeviceCopiesPass(input_device=input_device, output_device=output_device)
    return cast(CopyResult, pass_(model))
