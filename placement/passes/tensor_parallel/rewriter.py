"""The rewriter: per-device values of a tensor-parallel graph, and the nodes that make them.

A :class:`Rewriter` walks the original graph once, in order. Every op that depends on a graph
input becomes one op per device of the group (SPMD, as Megatron runs it); ops computed from
parameters and constants alone stay as they are (runtimes fold them where they are read). Each
original value has a :class:`~placement.passes.tensor_parallel.layouts.Layout` and, per device,
the value that device holds. The rules (:mod:`.rules`) read layouts and ask for values *as* a
layout: :meth:`Rewriter.replicated` inserts the collective that makes a value whole (an
all-reduce of partials, an all-gather of shards), :meth:`Rewriter.as_shard` slices a whole
value (a sliced initializer, or a ``Gather`` of an activation's own indices).

Example:
    >>> from placement.passes.tensor_parallel.layouts import block_parts
    >>> block_parts(6, 3)
    ((0, 1), (2, 3), (4, 5))
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from placement.errors import InputError
from placement.graph.device import Device
from placement.graph.nodes import COLLECTIVE_KEY, DEVICE_KEY, SCOPE_KEY, TP_KEY, node_scope
from placement.passes.tensor_parallel.layouts import PARTIAL, REPLICATED, Layout, contiguous

__all__ = ["Rewriter", "static_int", "dims"]

log = logging.getLogger(__name__)


def dims(value: ir.Value) -> list[int | None] | None:
    """The value's dims (None for a symbolic one), or None when its rank is unknown."""
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


def static_int(value: ir.Value | None) -> np.ndarray | None:
    """The constant contents of a value (an initializer or a ``Constant`` output), or None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain == "":
        attr = producer.attributes.get("value")
        if attr is not None:
            return attr.as_tensor().numpy()
        for key in ("value_int", "value_ints", "value_float", "value_floats"):
            attr = producer.attributes.get(key)
            if attr is not None:
                return np.array(attr.value)
    return None


class Rewriter:
    """Per-device values, the new node list, sliced initializers and collectives."""

    def __init__(self, graph: ir.Graph, devices: Sequence[Device], static: set[ir.Value]) -> None:
        self.graph = graph
        self.devices = list(devices)
        self.t = len(self.devices)
        self.static = static  # outputs of ops that read no graph input (left as they are)
        self.layouts: dict[ir.Value, Layout] = {}
        self.locals: dict[ir.Value, list[ir.Value]] = {}
        self.nodes: list[ir.Node] = []
        self.new_initializers: list[ir.Value] = []
        self._names: set[str] = set(self._taken_names())
        self._shards: dict[tuple[int, int, tuple[int, ...], int], ir.Value] = {}
        self._whole: dict[ir.Value, list[ir.Value]] = {}
        self._slices: dict[tuple[int, int, tuple[int, ...], str], ir.Value] = {}
        self.collectives = 0
        self.split: list[str] = []  # original ops split through their weights
        self.group = [str(d) for d in self.devices]
        self.homes: dict[ir.Value, list[Device]] = {}  # the group that holds each local value
        self.done: set[ir.Node] = set()  # original ops a rule already rewrote with an earlier one

    def use_group(self, devices: Sequence[Device]) -> None:
        """Emit the next ops on ``devices`` (a pipeline stage's group; same size as the first)."""
        if len(devices) != self.t:
            raise InputError(
                f"groups must have one size, got {[str(d) for d in devices]} beside {self.group}"
            )
        self.devices = list(devices)
        self.group = [str(d) for d in self.devices]

    # -- names -----------------------------------------------------------------------------

    def _taken_names(self) -> list[str]:
        names = [v.name for v in self.graph.inputs if v.name] + list(self.graph.initializers)
        for node in self.graph:
            names += [v.name for v in node.outputs if v.name]
            names.append(node.name or "")
        return names

    def fresh(self, hint: str) -> str:
        """A blob/op name not yet taken, from ``hint``."""
        name, k = hint, 1
        while name in self._names:
            name, k = f"{hint}_{k}", k + 1
        self._names.add(name)
        return name

    # -- layouts and values ------------------------------------------------------------

    def layout(self, value: ir.Value | None) -> Layout:
        """The layout of an original value (parameters, constants and graph inputs: replicated)."""
        if value is None:
            return REPLICATED
        return self.layouts.get(value, REPLICATED)

    def is_shared(self, value: ir.Value) -> bool:
        """Whether every device reads the value itself (an input, parameter or constant)."""
        return value not in self.locals

    def local(self, value: ir.Value | None, d: int) -> ir.Value | None:
        """What device ``d`` holds of ``value``, whatever its layout."""
        if value is None:
            return None
        per = self.locals.get(value)
        return value if per is None else per[d]

    def define(self, value: ir.Value, layout: Layout, per_device: list[ir.Value]) -> None:
        """Record the layout of an original value and what each device holds of it."""
        self.layouts[value] = layout
        self.locals[value] = per_device
        self.homes[value] = self.devices

    def replicated(self, value: ir.Value | None, d: int) -> ir.Value | None:
        """``value`` whole on device ``d``: partials are all-reduced, shards all-gathered."""
        if value is None:
            return None
        layout = self.layout(value)
        if layout.kind == "R":
            return self.local(value, d)
        whole = self._whole.get(value)
        if whole is None:
            here = self.devices
            self.use_group(self.homes.get(value, here))  # a collective runs where its parts are
            try:
                whole = self._all_reduce(value) if layout.kind == "P" else self._all_gather(value, layout)
            finally:
                self.use_group(here)
            self._whole[value] = whole
        return whole[d]

    def as_shard(self, value: ir.Value, layout: Layout, d: int) -> ir.Value:
        """Device ``d``'s part of ``value`` under the shard ``layout`` (same axis numbering as
        ``value``): itself when it is sharded so already, a subset of its indices, or a slice
        of the whole value (a sliced parameter, or a ``Gather`` of an activation)."""
        have = self.layout(value)
        want = layout.parts[d]
        if have.kind == "S" and have.axis == layout.axis:
            mine = have.parts[d]
            if mine == want:
                return self.local(value, d)
            if set(want) <= set(mine):
                return self._take(self.local(value, d), layout.axis, tuple(mine.index(i) for i in want), d)
        source = self.replicated(value, d)
        if source.const_value is not None:
            return self.param_shard(source, layout.axis, want, d)
        return self._take(source, layout.axis, want, d)

    # -- parameters ----------------------------------------------------------------------

    def param_shard(self, param: ir.Value, axis: int, index: tuple[int, ...], d: int) -> ir.Value:
        """An initializer holding ``param``'s elements ``index`` along ``axis`` (one per
        distinct slice: tied uses of a parameter share their shards)."""
        key = (id(param), axis, index, 0)
        found = self._shards.get(key)
        if found is not None:
            return found
        data = param.const_value.numpy()
        picked = data.take(np.asarray(index, dtype=np.int64), axis=axis)
        if contiguous_range(index):
            picked = np.ascontiguousarray(picked)
        name = self.fresh(f"{param.name}.tp{d}")
        shard = ir.Value(
            name=name, shape=ir.Shape(picked.shape), type=param.type, const_value=ir.tensor(picked, name=name)
        )
        self.new_initializers.append(shard)
        self._shards[key] = shard
        return shard

    def constant(self, array: np.ndarray, hint: str) -> ir.Value:
        """A new initializer holding ``array``."""
        name = self.fresh(hint)
        value = ir.Value(
            name=name,
            shape=ir.Shape(array.shape),
            type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
            const_value=ir.tensor(array, name=name),
        )
        self.new_initializers.append(value)
        return value

    # -- nodes -----------------------------------------------------------------------------

    def emit(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        d: int,
        *,
        hint: str,
        attributes: Sequence[ir.Attr] | dict[str, ir.Attr] = (),
        num_outputs: int = 1,
        domain: str = "",
        meta: dict[str, str] | None = None,
        role: str | None = None,
        name: str | None = None,
    ) -> ir.Node:
        """Append a node on device ``d``; its outputs are named from ``hint``."""
        props = dict(meta or {})
        props[DEVICE_KEY] = str(self.devices[d])
        if role is not None:
            props[TP_KEY] = role
        else:
            props.pop(TP_KEY, None)
        node = ir.Node(
            domain,
            op_type,
            list(inputs),
            attributes=attributes,
            num_outputs=num_outputs,
            name=self.fresh(name or f"{hint}.node"),
            metadata_props=props,
        )
        for i, out in enumerate(node.outputs):
            out.name = self.fresh(hint if num_outputs == 1 else f"{hint}.{i}")
        self.nodes.append(node)
        return node

    def clone(
        self,
        node: ir.Node,
        inputs: Sequence[ir.Value | None],
        d: int,
        layouts: Sequence[Layout],
        *,
        attributes: dict[str, ir.Attr] | None = None,
    ) -> ir.Node:
        """Device ``d``'s copy of ``node`` reading ``inputs``; its outputs get the types and
        shapes of the originals under ``layouts`` (a shard is smaller along its axis)."""
        for attr in node.attributes.values():
            if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                raise InputError(
                    f"op {node.name!r} ({node.op_type}) has a subgraph: it cannot be split or replicated"
                )
        attrs = dict(node.attributes) if attributes is None else attributes
        role = (
            "partial"
            if any(lay.kind == "P" for lay in layouts)
            else ("shard" if any(lay.kind == "S" for lay in layouts) else None)
        )
        meta = {k: v for k, v in node.metadata_props.items() if k not in (COLLECTIVE_KEY,)}
        new = self.emit(
            node.op_type,
            inputs,
            d,
            hint=f"{node.name}.tp{d}.out",
            attributes=list(attrs.values()),
            num_outputs=len(node.outputs),
            domain=node.domain,
            meta=meta,
            role=role,
            name=f"{node.name}.tp{d}",
        )
        for out, orig, lay in zip(new.outputs, node.outputs, layouts):
            out.name = self.fresh(f"{orig.name}.tp{d}")
            out.type = orig.type
            out.shape = local_shape(orig, lay, d)
        return new

    def set_outputs(self, node: ir.Node, layouts: Sequence[Layout], clones: Sequence[ir.Node]) -> None:
        """Record what each device holds of ``node``'s outputs after ``clones``."""
        for i, (out, lay) in enumerate(zip(node.outputs, layouts)):
            self.define(out, lay, [c.outputs[i] for c in clones])

    # -- collectives ---------------------------------------------------------------------

    def _tag(self, kind: str, value: ir.Value) -> dict[str, str]:
        """The collective's tag, and the module scope of the op whose result it combines."""
        tag = {COLLECTIVE_KEY: json.dumps({"kind": kind, "group": self.group, "id": self.collectives})}
        producer = self.local(value, 0).producer()
        scope = node_scope(producer) if producer is not None else None
        if scope:
            tag[SCOPE_KEY] = scope
        return tag

    def _all_reduce(self, value: ir.Value) -> list[ir.Value]:
        """On each device, a ``Sum`` of every device's partial in device order."""
        partials = [self.local(value, d) for d in range(self.t)]
        meta = self._tag("all_reduce", value)
        self.collectives += 1
        out = []
        for d in range(self.t):
            node = self.emit("Sum", partials, d, hint=f"{value.name}.allreduce.tp{d}", meta=meta)
            node.outputs[0].type, node.outputs[0].shape = value.type, value.shape
            out.append(node.outputs[0])
        return out

    def _all_gather(self, value: ir.Value, layout: Layout) -> list[ir.Value]:
        """On each device, a ``Concat`` of every device's shard in device order (and a
        ``Gather`` putting the elements in order where shards are not consecutive ranges)."""
        shards = [self.local(value, d) for d in range(self.t)]
        meta = self._tag("all_gather", value)
        self.collectives += 1
        flat = [i for part in layout.parts for i in part]
        order = (
            None
            if contiguous(layout.parts, layout.size)
            else np.array([flat.index(i) for i in range(layout.size)], dtype=np.int64)
        )
        if order is not None and set(flat) != set(range(layout.size)):
            raise InputError(f"blob {value.name!r}: its shards do not cover it")
        indices = None if order is None else self.constant(order, f"{value.name}.gather_order")
        out = []
        for d in range(self.t):
            node = self.emit(
                "Concat",
                shards,
                d,
                hint=f"{value.name}.allgather.tp{d}",
                meta=meta,
                attributes=[ir.AttrInt64("axis", layout.axis)],
            )
            whole = node.outputs[0]
            whole.type, whole.shape = value.type, value.shape
            if indices is not None:
                node = self.emit(
                    "Gather",
                    [whole, indices],
                    d,
                    hint=f"{value.name}.ordered.tp{d}",
                    attributes=[ir.AttrInt64("axis", layout.axis)],
                )
                node.outputs[0].type, node.outputs[0].shape = value.type, value.shape
            out.append(node.outputs[0])
        return out

    def reduce_partials(self, partials: list[ir.Value], like: ir.Value) -> list[ir.Value]:
        """All-reduce per-device partials (not an original value's) into whole values."""
        key = ir.Value(name=self.fresh(f"{like.name}.partial"), type=like.type, shape=like.shape)
        self.define(key, PARTIAL, partials)
        return [self.replicated(key, d) for d in range(self.t)]

    def _take(self, source: ir.Value, axis: int, index: tuple[int, ...], d: int) -> ir.Value:
        """``source``'s elements ``index`` along ``axis`` on device ``d`` (``Slice`` for a range)."""
        key = (id(source), axis, index, str(self.devices[d]))
        found = self._slices.get(key)
        if found is not None:
            return found
        hint = f"{source.name}.part"
        if contiguous_range(index):
            starts = self.constant(np.array([index[0]], np.int64), f"{hint}.start")
            ends = self.constant(np.array([index[-1] + 1], np.int64), f"{hint}.end")
            axes = self.constant(np.array([axis], np.int64), f"{hint}.axis")
            node = self.emit("Slice", [source, starts, ends, axes], d, hint=hint, role="shard")
        else:
            idx = self.constant(np.array(index, np.int64), f"{hint}.index")
            node = self.emit(
                "Gather", [source, idx], d, hint=hint, role="shard", attributes=[ir.AttrInt64("axis", axis)]
            )
        out = node.outputs[0]
        out.type = source.type
        if source.shape is not None:
            shape = list(source.shape)
            shape[axis] = len(index)
            out.shape = ir.Shape(shape)
        self._slices[key] = out
        return out


def contiguous_range(index: Sequence[int]) -> bool:
    """Whether ``index`` is ``a, a+1, ..., b``."""
    return bool(index) and list(index) == list(range(index[0], index[0] + len(index)))


def local_shape(value: ir.Value, layout: Layout, d: int) -> ir.Shape | None:
    """The shape device ``d`` holds of ``value`` under ``layout``."""
    if value.shape is None:
        return None
    shape = list(value.shape)
    if layout.kind == "S" and layout.axis < len(shape):
        shape[layout.axis] = len(layout.parts[d])
    return ir.Shape(shape)


def attr_value(node: ir.Node, name: str, default: Any) -> Any:
    """An attribute's value, or ``default``."""
    attr = node.attributes.get(name)
    return default if attr is None else attr.value
