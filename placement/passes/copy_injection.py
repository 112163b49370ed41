"""The engine of copy injection: one read-only scan, a plan, then the graph edit.

:class:`~placement.passes.copy_making.CopyResult` is what :func:`placement.inject_cross_device_copies`
returns; the
rules it enforces are described in :mod:`placement.passes.copies`. A run scans every op
once (where every blob lives, which reads cross devices, the copies already there), plans
the copies (which to keep, move, drop or make, their names and devices) without touching
the graph, then applies the plan, so an error before the last phase leaves the model as it
was. Copy names are ``<blob>_<type>_<index>``, made unique when taken.

Example:
    >>> import onnx_ir as ir
    >>> copy_kind(ir.Value(name="x"))  # an activation or graph input: copied every run
    'dynamic'
"""

from __future__ import annotations

import dataclasses
import logging
from typing import cast

import onnx_ir as ir

from placement.errors import VerificationError
from placement.graph import edit
from placement.graph.device import Device
from placement.graph.kv_names import is_cache_input, is_cache_output
from placement.graph.nodes import (
    COPY_KEY,
    DEVICE_KEY,
    INPUT_DEVICE_KEY,
    OUTPUT_DEVICE_KEY,
    STREAMED_KEY,
    SUBGRAPH_OP_TYPES,
    graph_nodes,
    streamed_homes,
    subgraphs_of,
)
from placement.passes.base import DeviceReader, run_phases
from placement.passes.copy_making import CopyKey, CopyMaker, CopyNeed, CopyResult, _is_numbered

__all__ = ["CopyInjection", "CopyResult", "copy_kind"]

log = logging.getLogger(__name__)


def copy_kind(source: ir.Value, *, streamed: bool = False) -> str:
    """``"static"`` for a copy of a parameter (not also a graph input), ``"streamed"`` for one of
    a streamed parameter (``streamed=True``), else ``"dynamic"``."""
    if source.is_initializer() and not source.is_graph_input():
        return "streamed" if streamed else "static"
    return "dynamic"


@dataclasses.dataclass
class _Scan:
    """What the read-only scan found (see :meth:`CopyInjection._scan`)."""

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
    """What the plan decided (see :meth:`CopyInjection._plan`); nothing is changed yet."""

    outputs: list[tuple[int, ir.Value, ir.Value, str]]
    protected: set[ir.Node]
    repeated: list[tuple[int, int]]
    out_dev: Device
    needs: dict[CopyKey, CopyNeed] = dataclasses.field(default_factory=dict)
    keep: dict[CopyKey, ir.Node] = dataclasses.field(default_factory=dict)
    remove: list[ir.Node] = dataclasses.field(default_factory=list)
    misplaced: list[tuple[ir.Node, CopyNeed]] = dataclasses.field(default_factory=list)
    #: for each of ``_Scan.uses``: the copy its reader must read, ``None``: the blob itself
    readers: list[CopyNeed | None] = dataclasses.field(default_factory=list)
    inner_readers: list[CopyNeed | None] = dataclasses.field(default_factory=list)  # for ``inner_uses``


class CopyInjection(CopyMaker):
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
                    if source in inputs_:  # a KV cache is fed where it is read (state, not data)
                        where = device if is_cache_input(source._name) else in_dev
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
                            where = device if is_cache_input(source.name) else scan.in_dev
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
                needs[key] = need = CopyNeed(source, device, pos, node)
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
                needs[key] = need = CopyNeed(source, device, pos, owner)
            elif pos < need.first_pos:
                need.first_pos, need.first_node = pos, owner
            decision.inner_readers.append(need)
        for slot, _, source, name in outputs:  # a KV cache output stays where it is made
            if dev_of.get(source) is not out_dev and not is_cache_output(name):
                need = needs.setdefault((source, id(out_dev)), CopyNeed(source, out_dev))
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
        producers = {source.producer() for _, _, source, name in outputs if not is_cache_output(name)}
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
        needs: dict[CopyKey, CopyNeed],
        keep: dict[CopyKey, ir.Node],
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

    def _record_io_devices(self, in_dev: Device, out_dev: Device) -> None:
        props = self.model.metadata_props
        for key, device in ((INPUT_DEVICE_KEY, in_dev), (OUTPUT_DEVICE_KEY, out_dev)):
            if props.get(key) != str(device):
                props[key] = str(device)
                self.result.modified = True

    # -- names -------------------------------------------------------------------------------
