"""What splitting ops over ``t`` devices costs: each op's share of its FLOPs, and the collectives.

The planner (:mod:`placement.planning.tp_planner`) decides a tensor-parallel degree from two
figures per op of the unsplit graph, both read from the graph that
:func:`placement.split_tensor_parallel` actually makes (on a private copy), so that the cost
model never disagrees with the pass about what is split:

* **compute**: each op's *share*, the FLOPs of the busiest device's copy of the op over the
  FLOPs of the op (``1/t`` for a column- or row-parallel linear, ``1`` for an op every device
  runs whole, such as a layer norm; per-op-type rules of
  :data:`placement.analysis.costs.FLOP_RULES` on each device's shapes). An op's cost at degree
  ``t`` is its unsplit cost (measured time, or FLOPs at the device's speed) times its share.
* **collectives**: every all-reduce and all-gather of the split graph, at the position of the
  op whose result it combines. On each device a collective reads the other devices' parts
  through copies (``t - 1`` of them: an all-reduce reads whole partial sums, an all-gather
  shards); each copy costs ``latency + bytes / bandwidth`` on the link between the two devices
  (the link model :func:`placement.predict` and :func:`placement.auto_place` charge copies on:
  :data:`placement.planning.link_model.PRESETS`), the copies into one device queue behind
  each other, and the collective ends when the busiest device has its parts. Each collective
  then pays a fixed :data:`COLLECTIVE_LATENCY_S`: every device waits for the slowest
  partial and a new stage opens on each device (a session call and a hand-off between
  threads in the ONNX Runtime executor).

At a few tokens per step the bytes are small and the latencies dominate: 2 all-reduces per
transformer block of a few tens of microseconds each outweigh the compute they split. At many
tokens per step the compute split by ``t`` dominates. That is the trade the planner weighs.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.planning.graph_info import GraphInfo
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> split = analyse_split(model, GraphInfo(model), [pl.Device("cuda", 0), pl.Device("cuda", 1)],
    ...                       links=None)
    >>> [round(s, 2) for s in split.shares]  # Gemm, Relu, Gemm: column then row; Relu; Gemm: column
    [0.5, 0.5, 0.49, 1.0, 0.5]
    >>> [c.kind for c in split.collectives]  # after the row-parallel Gemm; the logits
    ['all_reduce', 'all_gather']
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import onnx_ir as ir

from placement.analysis import costs as flop_rules
from placement.analysis.dependence import copy_origin
from placement.errors import InputError
from placement.graph.device import Device
from placement.graph.model import Model, value_nbytes
from placement.graph.nodes import collective_tag, is_copy_node, node_device
from placement.planning.graph_info import GraphInfo
from placement.planning.link_model import Links
from placement.planning.profile import Shapes

__all__ = ["COLLECTIVE_LATENCY_S", "Collective", "SplitCost", "analyse_split", "collective_time_ns"]

log = logging.getLogger(__name__)

#: Fixed seconds per collective, on top of its copies: every device of the group waits for
#: the slowest partial, and in the ONNX Runtime executor the collective opens a new stage on
#: each device (a session call and a hand-off between worker threads). The figure is the
#: executor's measured hand-off per stage call (``benchmarks/pipeline.py --fixed-cost``, the
#: ``"ort"`` entry of :data:`placement.planning.predict.FIXED_COST_S`); NCCL's small-message
#: all-reduce over NVLink takes a few tens of microseconds too.
COLLECTIVE_LATENCY_S = 50e-6


@dataclass(frozen=True)
class Collective:
    """One collective of a split graph, as the planner charges it.

    Attributes:
        id: the collective's id in its tag.
        kind: ``"all_reduce"`` or ``"all_gather"``.
        position: the position (in :class:`GraphInfo` order) of the unsplit op whose result
            it combines.
        nbytes: bytes of the whole value it makes (on every device).
        received: bytes the busiest device reads from the others through copies.
        time_ns: its time: the busiest device's copies in, plus the fixed latency.
        parts: its copies as ``(source rank, destination rank, bytes)`` within the group, so
            that it can be priced on another group of the same size (:meth:`SplitCost.on`).
    """

    id: int
    kind: str
    position: int
    nbytes: int
    received: int
    time_ns: int
    parts: tuple[tuple[int, int, int], ...] = ()


@dataclass
class SplitCost:
    """The cost figures of one split (see the module docstring).

    Attributes:
        devices: the group.
        shares: per op position, the busiest device's share of the op's FLOPs (0..1].
        collectives: the collectives, in graph order.
        param_bytes: per device of the group, the bytes of the parameters it holds.
        split_ops: the unsplit ops split through their weights.
        latency_s: the fixed cost of each collective it was priced with.
    """

    devices: list[Device]
    shares: list[float]
    collectives: list[Collective] = field(default_factory=list)
    param_bytes: list[int] = field(default_factory=list)
    split_ops: list[str] = field(default_factory=list)
    latency_s: float = COLLECTIVE_LATENCY_S

    @property
    def degree(self) -> int:
        """The number of devices of the group."""
        return len(self.devices)

    def on(self, devices: Sequence[Device], links: Links | None) -> SplitCost:
        """The same split with its collectives priced on another group of as many devices
        (another pipeline stage's group: the links inside it may differ).

        Raises:
            InputError: a group of another size.
        """
        if len(devices) != self.degree:
            raise InputError(
                f"a split over {self.degree} devices cannot be priced on {[str(d) for d in devices]}"
            )
        group = list(devices)
        collectives = [
            replace(
                c,
                time_ns=collective_time_ns(
                    [(group[s], group[d], b) for s, d, b in c.parts], links, self.latency_s
                ),
            )
            for c in self.collectives
        ]
        return replace(self, devices=group, collectives=collectives)

    def collective_ns(self, n: int) -> list[int]:
        """Per op position (``n`` of them), the time of the collectives that follow it."""
        result = [0] * n
        for c in self.collectives:
            result[min(c.position, n - 1)] += c.time_ns
        return result

    def received(self, n: int) -> list[int]:
        """Per op position, the bytes its collectives bring into the busiest device."""
        result = [0] * n
        for c in self.collectives:
            result[min(c.position, n - 1)] += c.received
        return result


def collective_time_ns(
    parts: Sequence[tuple[Device, Device, int]], links: Links | None, latency_s: float
) -> int:
    """Nanoseconds of one collective: the copies ``(source, destination, bytes)`` into each
    destination queue behind each other, the busiest destination sets the time, plus
    ``latency_s``.

    Example:
        >>> from placement.planning.link_model import Links
        >>> a, b = Device("cuda", 0), Device("cuda", 1)
        >>> nvlink = Links(default="nvlink")
        >>> collective_time_ns([(a, b, 1500), (b, a, 1500)], nvlink, 50e-6)  # 3 us + 10 ns + 50 us
        53010
    """
    into: dict[Device, int] = {}
    for src, dst, nbytes in parts:
        cost = links.link(src, dst).time_ns(nbytes) if links is not None else 0
        into[dst] = into.get(dst, 0) + cost
    return max(into.values(), default=0) + round(latency_s * 1e9)


def analyse_split(
    model: Model,
    info: GraphInfo,
    devices: Sequence[Device],
    *,
    links: Links | None,
    dims: Mapping[str, int] | None = None,
    latency_s: float = COLLECTIVE_LATENCY_S,
) -> SplitCost:
    """Split a private copy of ``model`` over ``devices`` and read off its cost figures.

    Args:
        model: the unsplit model (not changed; its placement does not matter).
        info: its graph tables (op positions).
        devices: the group, at least two devices.
        links: the link model copies are charged on (None: copies are free).
        dims: sizes of symbolic dimensions (bytes and FLOPs count at them).
        latency_s: the fixed cost of each collective (:data:`COLLECTIVE_LATENCY_S`).

    Raises:
        InputError: the pass cannot split the model over ``devices`` (it names the op).
    """
    from placement.passes.tensor_parallel import split_tensor_parallel

    work = model.copy()
    first = devices[0]
    for node in work.graph:
        if is_copy_node(node):
            raise InputError(f"op {node.name!r} is a copy: plan tensor parallelism before placing")
        work.set_device(node.name or "", first)
    result = split_tensor_parallel(work, devices=list(devices))
    sizes = dict(dims or {})
    shapes = Shapes(bindings=sizes)
    by_name = {node.name: node for node in work.graph}
    shares = []
    for pos, node in enumerate(info.nodes):
        base = flop_rules.op_flops(node, shapes)
        clones = [by_name.get(f"{info.names[pos]}.tp{d}") for d in range(len(devices))]
        if base <= 0 or any(c is None for c in clones):
            shares.append(1.0)
            continue
        busiest = max(flop_rules.op_flops(c, shapes) for c in clones if c is not None)
        shares.append(min(1.0, busiest / base))
    return SplitCost(
        devices=list(devices),
        shares=shares,
        collectives=_collectives(work, info, devices, links, sizes, latency_s),
        param_bytes=_param_bytes(work, devices),
        split_ops=list(result.split),
        latency_s=latency_s,
    )


def _collectives(
    work: Model,
    info: GraphInfo,
    devices: Sequence[Device],
    links: Links | None,
    dims: Mapping[str, int],
    latency_s: float,
) -> list[Collective]:
    """The collectives of a split graph with their bytes and times."""
    groups: dict[int, list[ir.Node]] = {}
    kinds: dict[int, str] = {}
    for node in work.graph:
        tag = collective_tag(node)
        if tag is None:
            continue
        key = int(tag["id"])  # type: ignore[call-overload]
        groups.setdefault(key, []).append(node)
        kinds[key] = str(tag["kind"])
    found = []
    rank = {d: k for k, d in enumerate(devices)}
    for key, nodes in groups.items():
        parts = []
        received: dict[Device, int] = {}
        for node in nodes:
            dst = node_device(node)
            for value in node.inputs:
                producer = value.producer() if value is not None else None
                if value is None or producer is None or not is_copy_node(producer):
                    continue
                nbytes = int(value_nbytes(value, dims) or 0)
                parts.append((work.blob_device(copy_origin(value)), dst, nbytes))
                received[dst] = received.get(dst, 0) + nbytes
        whole = nodes[0].outputs[0] if nodes[0].outputs else None
        found.append(
            Collective(
                id=key,
                kind=kinds[key],
                position=_origin_position(nodes[0], info),
                nbytes=int(value_nbytes(whole, dims) or 0) if whole is not None else 0,
                received=max(received.values(), default=0),
                time_ns=collective_time_ns(parts, links, latency_s),
                parts=tuple((rank[s], rank[d], b) for s, d, b in parts),
            )
        )
    return sorted(found, key=lambda c: (c.position, c.id))


def _origin_position(node: ir.Node, info: GraphInfo) -> int:
    """The latest unsplit op among the producers behind a collective's inputs (a device's copy
    of an op is named ``<op>.tp<d>``), searched upwards through the ops the pass added; else
    (a partial made by added ops from graph inputs alone, as a vocab-parallel lookup) the op
    before the earliest unsplit op reading its result."""
    up = _nearest(node, info, upwards=True)
    if up:
        return max(up)
    down = _nearest(node, info, upwards=False)
    return max(0, min(down) - 1) if down else len(info) - 1


def _nearest(node: ir.Node, info: GraphInfo, *, upwards: bool) -> list[int]:
    """Positions of the nearest unsplit ops (through their copies) above or below ``node``."""
    seen = {id(node)}
    frontier = [node]
    while frontier:
        found: list[int] = []
        following: list[ir.Node] = []
        for current in frontier:
            if upwards:
                neighbours = [v.producer() for v in current.inputs if v is not None]
            else:
                neighbours = [use.node for v in current.outputs for use in v.uses()]
            for other in neighbours:
                if other is None or id(other) in seen:
                    continue
                seen.add(id(other))
                name = other.name or ""
                base, _, suffix = name.rpartition(".tp")
                position = info.position.get(base) if suffix.isdigit() else info.position.get(name)
                if position is not None:
                    found.append(position)
                else:
                    following.append(other)
        if found:
            return found
        frontier = following
    return []


def _param_bytes(work: Model, devices: Sequence[Device]) -> list[int]:
    """Per device of the group, the bytes of the distinct parameters its ops read."""
    held: dict[Device, dict[str, int]] = {d: {} for d in devices}
    for node in work.graph:
        if is_copy_node(node):
            continue
        device = node_device(node)
        for value in node.inputs:
            if value is None:
                continue
            root = copy_origin(value)
            if root.const_value is not None and root.name:
                held.setdefault(device, {})[root.name] = int(root.const_value.nbytes)
    return [sum(held.get(d, {}).values()) for d in devices]
