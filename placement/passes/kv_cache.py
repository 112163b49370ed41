"""KV caches in the passes: state that stays on the device of the layer that reads it.

A graph with a KV cache (``past_key_values.{i}.key/value`` inputs, ``present.{i}.key/value``
outputs; see :mod:`placement.graph.kv_names`) keeps each layer's cache on one device:

* :func:`placement.inject_cross_device_copies` feeds a past input on the device of its
  readers and leaves a present output on the device that produced it (never copied to the
  input or output device);
* :func:`settle_kv_caches` (run by :func:`placement.inject_cross_device_copies` first, so
  any placement, a planner's or a random one, gets it) moves the op producing a present
  output to the device of the attention that reads it, and the shape reads of a past input
  (``Shape``/``Size``: the past length) to the device of the op reading its data, so the
  whole cache is read on one device;
* :func:`placement.shift_activation_devices` moves the op producing a present output with
  the attention that reads it (:func:`keep_caches_with_readers`), so the only blobs of a
  layer's cache that may cross devices are the new tokens' keys and values.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> keep_caches_with_readers(model.graph, [], {}, {})  # no cache: the moves are unchanged
    []
"""

from __future__ import annotations

import onnx_ir as ir

from placement.graph.device import Device
from placement.graph.kv_names import is_cache_input, is_cache_output
from placement.graph.nodes import COPY_KEY, DEVICE_KEY, node_device, set_node_device

__all__ = ["keep_caches_with_readers", "settle_kv_caches"]

_SHAPE_READS = frozenset({"Shape", "Size"})


def _readers(value: ir.Value, graph: ir.Graph) -> list[ir.Node]:
    """The non-copy ops of ``graph`` reading ``value``, directly or through copies of it."""
    found: list[ir.Node] = []
    pending = [value]
    while pending:
        blob = pending.pop()
        for use in blob.uses():
            node = use.node
            if node.graph is not graph:
                continue
            if COPY_KEY in node.metadata_props:
                pending.extend(node.outputs)
            elif node not in found:
                found.append(node)
    return found


def settle_kv_caches(model: ir.Model) -> int:
    """Put each layer's whole KV cache on one device (in place); the number of ops moved.

    The op producing a ``present.{i}.key/value`` output moves to the device of its first
    reader; the ``Shape``/``Size`` ops reading a ``past_key_values.{i}.key/value`` input move
    to the device of the first op reading its data. A graph without a cache is unchanged.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> settle_kv_caches(pl.from_torch(*mlp.build("tiny")).ir_model)
        0
    """
    graph = model.graph
    pasts = [v for v in graph.inputs if is_cache_input(v.name)]
    presents = [v for v in graph.outputs if is_cache_output(v.name)]
    if not pasts and not presents:
        return 0
    moved = 0
    for present in presents:
        producer = present.producer()
        if producer is None or COPY_KEY in producer.metadata_props:
            continue
        readers = _readers(present, graph)
        if readers and node_device(readers[0]) != node_device(producer):
            set_node_device(producer, node_device(readers[0]))
            moved += 1
    for past in pasts:
        readers = _readers(past, graph)
        data = [node for node in readers if node.op_type not in _SHAPE_READS]
        if not data:
            continue
        home = node_device(data[0])
        for node in readers:
            if node.op_type in _SHAPE_READS and node_device(node) != home:
                set_node_device(node, home)
                moved += 1
    return moved


def keep_caches_with_readers(
    graph: ir.Graph,
    moves: list[tuple[ir.Node, str | None]],
    device_of: dict[str | None, Device],
    target_of: dict[str | None, Device | None],
) -> list[tuple[ir.Node, str | None]]:
    """A KV cache is state: the op producing a ``present.{i}.key/value`` output ends where its
    first reader (the attention reading the cache) ends, so the whole cache never crosses a
    device; only the new tokens' keys and values may. The op moves with its reader, or stays
    when the reader stays (within the shift's rule: from a source to its target or not at all)."""
    producers = [
        out.producer() for out in graph.outputs if is_cache_output(out.name) and out.producer() is not None
    ]
    if not producers:
        return moves
    moving = {node: spec for node, spec in moves}

    def final(node: ir.Node) -> Device | None:
        spec = node.metadata_props.get(DEVICE_KEY)
        if node in moving:
            return target_of.get(spec)
        return device_of.get(spec)

    for producer in producers:
        if producer is None or COPY_KEY in producer.metadata_props:
            continue
        readers = [
            use.node
            for value in producer.outputs
            for use in value.uses()
            if use.node.graph is graph and COPY_KEY not in use.node.metadata_props
        ]
        if not readers:
            continue
        spec = producer.metadata_props.get(DEVICE_KEY)
        want, now = final(readers[0]), final(producer)
        if want is None or want == now:
            continue
        if producer in moving and want == device_of.get(spec):
            del moving[producer]  # the reader stays: so does the cache
        elif producer not in moving and want == target_of.get(spec):
            moving[producer] = spec  # the reader moves: the cache follows
    return list(moving.items())
