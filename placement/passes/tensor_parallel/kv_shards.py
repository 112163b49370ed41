"""KV caches split on their head axis, kept on their devices for a decode loop.

A model split by :func:`placement.split_tensor_parallel` keeps the KV cache convention at its
graph boundary: each ``past_key_values.{i}.key/value`` input is whole, and each device takes
its heads (a ``Slice`` or ``Gather`` of the head axis, tagged as a shard); each
``present.{i}.key/value`` output is whole, an all-gather (a ``Concat`` of the devices'
shards, in device order) on the first device. A saved split file therefore runs anywhere a
cache graph runs, but a decode loop feeding it would copy each device's heads in and out
of the first device every step: the whole cache crossing devices twice per token.

:func:`local_kv_caches` rewrites a copy of such a graph for decoding (the generation code
calls it on its private copy, never on the caller's model): each split cache becomes one
cache per device, ``past_key_values.{i}.key.tp{d}`` in and ``present.{i}.key.tp{d}`` out,
holding that device's heads, read and written on that device only. The shard takes and
the all-gather are gone, so between steps each device keeps its own heads and a decode step
moves no cache bytes (a ``Shape`` read of the whole past, the past length, reads the
device's shard and puts the whole head count back).

A cache whose split does not match this pattern (its readers are not one head shard per
device, or its present is not the all-gather of the same heads) is left whole. Where the
graph itself reads the gathered present (an attention the shape rules could not keep split,
e.g. GPT-2's key reshaped to ``(batch * heads, ...)``), the all-gather stays for that reader:
each device still keeps its own cache, but its new shard crosses to the others every step.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> local_kv_caches(model, [])  # no cache: nothing to do
    []
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace

import numpy as np
import onnx_ir as ir

from placement.graph.causal_lm import KVLayer
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import COLLECTIVE_KEY, TP_KEY, is_copy_node, node_device, set_node_device

__all__ = ["local_kv_caches", "shard_name"]

log = logging.getLogger(__name__)


def shard_name(name: str, index: int) -> str:
    """The name of device ``index``'s shard of cache value ``name``.

    Example:
        >>> shard_name("past_key_values.0.key", 1)
        'past_key_values.0.key.tp1'
    """
    return f"{name}.tp{index}"


@dataclass
class _Split:
    """One cache tensor split over devices: per device its take, heads and present shard."""

    past: ir.Value
    present: ir.Value
    devices: list[Device]
    takes: list[ir.Node]
    heads: list[tuple[int, ...]]
    shards: list[ir.Value]
    shapes: list[ir.Node]  # Shape reads of the whole past
    gather: list[ir.Node]  # the all-gather's nodes making the present (Concat, maybe Gather)


def local_kv_caches(model: Model, layers: list[KVLayer]) -> list[KVLayer]:
    """Give each device its own cache where a split model gathers it (in place; see the
    module docstring); the cache layers of the rewritten graph (one per device and split
    layer, the others as they were)."""
    found: list[KVLayer] = []
    for layer in layers:
        key = _match(model.graph, layer.past_key, layer.present_key)
        value = _match(model.graph, layer.past_value, layer.present_value)
        if key is None or value is None or key.devices != value.devices or key.heads != value.heads:
            found.append(layer)
            continue
        for split in (key, value):
            _rewrite(model.graph, split)
        for d, heads in enumerate(key.heads):
            found.append(
                replace(
                    layer,
                    past_key=shard_name(layer.past_key, d),
                    past_value=shard_name(layer.past_value, d),
                    present_key=shard_name(layer.present_key, d),
                    present_value=shard_name(layer.present_value, d),
                    kv_heads=len(heads),
                )
            )
        log.info("cache layer %d: one cache of %s heads per device", layer.index, [len(h) for h in key.heads])
    model._op_index, model._value_index = {}, {}
    return found


def _constant(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].as_tensor().numpy()
    return None


def _readers(value: ir.Value) -> list[ir.Node] | None:
    """The non-copy ops reading ``value`` directly or through copies (None: a graph output)."""
    found, pending = [], [value]
    while pending:
        blob = pending.pop()
        if blob.is_graph_output():
            return None
        for node, _ in blob.uses():
            if is_copy_node(node):
                pending.extend(node.outputs)
            elif node not in found:
                found.append(node)
    return found


def _source(value: ir.Value) -> ir.Value:
    """``value`` before the copies that made it."""
    while (producer := value.producer()) is not None and is_copy_node(producer):
        value = producer.inputs[0]
    return value


def _take_heads(node: ir.Node, size: int) -> tuple[int, ...] | None:
    """The head indices a shard take (``Slice`` or ``Gather`` of axis 1) reads, or None."""
    if node.metadata_props.get(TP_KEY) != "shard":
        return None
    if node.op_type == "Gather":
        axis = node.attributes.get("axis")
        index = _constant(node.inputs[1])
        if axis is None or axis.value != 1 or index is None or index.ndim != 1:
            return None
        return tuple(int(i) for i in index)
    stepped = len(node.inputs) > 4 and node.inputs[4] is not None
    if node.op_type != "Slice" or len(node.inputs) < 4 or stepped:
        return None
    starts, ends, axes = (_constant(node.inputs[i]) for i in (1, 2, 3))
    if starts is None or ends is None or axes is None or axes.tolist() != [1]:
        return None
    return tuple(range(int(starts[0]), min(int(ends[0]), size)))


def _match(graph: ir.Graph, past_name: str, present_name: str) -> _Split | None:
    past = next((v for v in graph.inputs if v.name == past_name), None)
    present = next((v for v in graph.outputs if v.name == present_name), None)
    if past is None or present is None or past.shape is None or not isinstance(past.shape[1], int):
        return None
    readers = _readers(past)
    if not readers:
        return None
    size = past.shape[1]
    takes, shapes = {}, []
    for node in readers:
        if node.op_type == "Shape":
            shapes.append(node)
            continue
        heads = _take_heads(node, size)
        device = node_device(node)
        if heads is None or device in takes:
            return None
        takes[device] = (node, heads)
    gather = _gathered(present)
    if gather is None:
        return None
    concat = gather[0]
    shards = [_source(v) for v in concat.inputs if v is not None]
    if any(v.producer() is None for v in shards):
        return None
    devices = [node_device(v.producer()) for v in shards]
    if len(set(devices)) != len(devices) or set(devices) != set(takes):
        return None
    heads = [takes[d][1] for d in devices]
    if not _rebuilds(heads, gather, size):
        return None
    return _Split(past, present, devices, [takes[d][0] for d in devices], heads, shards, shapes, gather)


def _gathered(present: ir.Value) -> list[ir.Node] | None:
    """The all-gather making ``present``: its ``Concat`` on axis 1 (and the ordering ``Gather``)."""
    producer = present.producer()
    nodes = []
    ordering = producer is not None and producer.op_type == "Gather"
    if ordering and COLLECTIVE_KEY not in producer.metadata_props:
        nodes.append(producer)
        producer = producer.inputs[0].producer() if producer.inputs[0] is not None else None
    if producer is None or producer.op_type != "Concat":
        return None
    tag = producer.metadata_props.get(COLLECTIVE_KEY)
    axis = producer.attributes.get("axis")
    if tag is None or json.loads(tag).get("kind") != "all_gather" or axis is None or axis.value != 1:
        return None
    return [producer, *nodes]


def _rebuilds(heads: list[tuple[int, ...]], gather: list[ir.Node], size: int) -> bool:
    """Whether the all-gather of shards holding ``heads`` (in device order) is the whole value."""
    flat = [h for part in heads for h in part]
    if len(gather) == 1:
        return flat == list(range(size))
    order = _constant(gather[1].inputs[1])
    attr = gather[1].attributes.get("axis")
    if order is None or attr is None or attr.value != 1 or order.shape != (size,):
        return False
    return all(0 <= int(i) < len(flat) and flat[int(i)] == j for j, i in enumerate(order))


def _rewrite(graph: ir.Graph, split: _Split) -> None:
    """Replace the whole cache input and output of ``split`` by one per device."""
    past, present = split.past, split.present
    news = []
    for d, (take, heads, shard) in enumerate(zip(split.takes, split.heads, split.shards)):
        shape = list(past.shape)
        shape[1] = len(heads)
        new = ir.Value(name=shard_name(past.name, d), type=past.type, shape=ir.Shape(shape))
        take.outputs[0].replace_all_uses_with(new)
        news.append(new)
        shard.name = shard_name(present.name, d)
    for node in split.shapes:
        device = node_device(node)
        d = split.devices.index(device) if device in split.devices else 0
        node.outputs[0].replace_all_uses_with(_whole_shape(graph, node, news[d], past.shape[1], device))
    _splice(graph.inputs, past, news)
    _splice(graph.outputs, present, split.shards)
    _drop_unused(graph, [*split.gather, *split.takes, *split.shapes])


def _splice(values: list[ir.Value], old: ir.Value, new: list[ir.Value]) -> None:
    """Replace ``old`` in the graph's input or output list by ``new``, in its place."""
    slot = list(values).index(old)
    values.pop(slot)
    for offset, value in enumerate(new):
        values.insert(slot + offset, value)


def _whole_shape(graph: ir.Graph, node: ir.Node, shard: ir.Value, heads: int, device: Device) -> ir.Value:
    """``Shape`` of the whole past from device ``device``'s shard: its head count put back."""
    rank = len(shard.shape)
    base = f"{node.name}.whole"
    mask = np.zeros(rank, bool)
    mask[1] = True
    full = np.zeros(rank, np.int64)
    full[1] = heads
    consts = []
    for suffix, array in (("mask", mask), ("heads", full)):
        value = ir.Value(name=f"{base}.{suffix}", const_value=ir.tensor(array))
        value.shape, value.type = ir.Shape(array.shape), ir.TensorType(ir.DataType.from_numpy(array.dtype))
        graph.register_initializer(value)
        consts.append(value)
    shape = ir.Node("", "Shape", [shard], name=f"{base}.shape", num_outputs=1)
    where = ir.Node("", "Where", [consts[0], consts[1], shape.outputs[0]], name=base, num_outputs=1)
    last = where
    start = node.attributes.get("start")
    end = node.attributes.get("end")
    made = [shape, where]
    if start is not None or end is not None:
        bounds = []
        for suffix, number in (("start", start.value if start else 0), ("end", end.value if end else rank)):
            value = ir.Value(name=f"{base}.{suffix}", const_value=ir.tensor(np.array([number], np.int64)))
            value.shape, value.type = ir.Shape([1]), ir.TensorType(ir.DataType.INT64)
            graph.register_initializer(value)
            bounds.append(value)
        last = ir.Node("", "Slice", [where.outputs[0], *bounds], name=f"{base}.slice", num_outputs=1)
        made.append(last)
    for made_node in made:
        out = made_node.outputs[0]
        out.name, out.type = f"{made_node.name}.out", ir.TensorType(ir.DataType.INT64)
        set_node_device(made_node, device)
    graph.insert_before(node, made)
    last.outputs[0].shape = node.outputs[0].shape
    return last.outputs[0]


def _drop_unused(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove ``nodes`` and the copies feeding them that nothing else reads."""
    pending = list(nodes)
    while pending:
        node = pending.pop(0)
        if node.graph is not graph or any(out.uses() or out.is_graph_output() for out in node.outputs):
            continue
        inputs = [v for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        for value in inputs:
            producer = value.producer()
            if producer is not None and is_copy_node(producer):
                pending.append(producer)
