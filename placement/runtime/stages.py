"""Cut a placed model into *stages*: same-device segments whose stage graph is acyclic.

A stage is a set of ops that all run on one logical device and that a runtime
executes as one unit (one ONNX Runtime session). Cross-device copies are not
part of any stage: a runtime performs them as *transfers* between stages (see
:class:`Transfer`). Each stage is also a standalone, valid ONNX model
(:attr:`Stage.model`) whose inputs and outputs are the blobs crossing its
boundary, under their original names.

The algorithm (greedy, one pass over the ops in topological order):

1. Walk the non-copy ops in graph (topological) order. An op's *predecessor
   stages* are the stages of the ops that produce its inputs, looking through
   copies (a copy of ``b`` makes the consumer depend on ``b``'s producer).
2. The op joins the current (most recent) stage ``S`` of its device if that
   keeps the stage graph acyclic. Since every predecessor op is already placed
   and the op has no successors yet, joining ``S`` closes a cycle exactly when
   ``S`` already reaches one of the op's predecessor stages ``T != S`` in the
   stage graph (``S -> ... -> T -> op in S``); :func:`networkx.has_path`
   decides it.
3. Otherwise the op opens a new stage, which becomes its device's current one.
   Older stages of the device need not be tried: a stage is only opened when
   the previous current stage reaches one of the opener's predecessors, so
   every older stage of a device reaches every newer one and whatever the
   newer one reaches; if the current stage cannot take an op, none can.
   Hence the result is *pairwise maximal*: merging any two stages of one device
   would close a cycle.
   A collective (an all-reduce or all-gather of a tensor-parallel split, see
   :func:`placement.split_tensor_parallel`) also opens a new stage when it reads a stage that
   does not already reach its device's current stage: joining would make that whole stage
   wait for the other devices' partials, where cutting lets the branches run at once.
4. Stages are numbered in a topological order of the stage graph (ties by
   creation order), which is the order a runtime runs them in.

For a model placed by ``shift_activation_devices`` (a prefix on one device, the
rest on another) this gives one stage per contiguous device segment; for a
random op assignment it gives few stages, never a cyclic stage graph.

Streamed copies (copies of parameters that live in host memory, see
:func:`placement.stream_parameters`) are transfers made every run: the stage reads
the copy's blob as an input, bound on its device (ONNX Runtime's IOBinding).

Static copies (copies of parameters) need no transfer at run time: the stage
that reads the copy's blob carries the parameter itself as an initializer
under the copy's name, so the parameter is copied onto the device exactly once,
when the stage's session loads. Parameters read directly are carried likewise.

*Load-time values* generalise this: a blob computed from parameters and
constants alone (a transposed weight, a scale constant, shape arithmetic) is
the same on every run. A stage that reads one produced elsewhere gets a clone
of the ops that compute it (``Stage.load_time_ops``), which ONNX Runtime folds
into an initializer when the session loads; such blobs make no stage-graph
edges, are never stage outputs and their copies are never run-time transfers.
This keeps weights constant inside each session (so ONNX Runtime can fuse and
pre-pack them) and avoids moving them on every run. Graph outputs are always
produced by their stage. A stage model leaves out its ops whose results only
other stages' clones read (a ``Constant`` weight, a transposed parameter used on
another device), and the weights only they read: the stage does not hold them.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.runtime.stages import partition
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> model.set_device(model.ops[-1].name, 1)
    >>> [(s.index, str(s.device), len(s.ops)) for s in partition(model)]
    [(0, 'cuda:0', 4), (1, 'cuda:1', 1)]
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import networkx as nx
import onnx
import onnx_ir as ir

from placement.analysis.dependence import load_time_values
from placement.analysis.shapes import infer_shapes
from placement.errors import PlacementError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import COLLECTIVE_KEY, COPY_KEY, is_copy_node, node_device, node_reads

__all__ = ["Stage", "Transfer", "Partition", "partition", "split_stages", "stage_graph"]

log = logging.getLogger(__name__)


@dataclass
class Stage:
    """One same-device segment of a placed model, runnable as one ONNX model.

    Attributes:
        index: position in execution order (a topological order of the stage graph).
        device: the logical device all its ops run on.
        ops: names of its ops, in graph order (copies are never part of a stage).
        inputs: blobs it reads from outside (graph inputs, other stages' outputs,
            dynamic copies' outputs), in first-use order; the stage model's inputs.
        outputs: blobs it produces that are read outside it or are graph outputs;
            the stage model's outputs.
        parameters: initializer names the stage model carries. A static copy's
            blob is carried under the copy's name with the parameter's data.
        depends_on: indices of the stages whose outputs it reads (through copies).
        model: the stage as a standalone ``onnx_ir.Model`` (shares tensor data
            with the placed model).
        fingerprint: a hash of what the stage is (device, op names and types,
            boundary blobs, carried parameters); equal fingerprints mean the same
            session can be reused (see :class:`placement.runtime.ort.Runner`).
        load_time_ops: ops of other stages the stage model also contains because
            they compute a load-time value it reads (see the module docstring).
        folded: the logical devices this stage runs, when a runtime folded several
            logical devices sharing one physical device into ``device``
            (:mod:`placement.runtime.ort.fold`); empty otherwise.
    """

    index: int
    device: Device
    ops: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    parameters: tuple[str, ...]
    depends_on: tuple[int, ...]
    model: ir.Model = field(repr=False)
    fingerprint: str = ""
    load_time_ops: tuple[str, ...] = ()
    folded: tuple[Device, ...] = ()

    def to_proto(self) -> onnx.ModelProto:
        """The stage model as an ``onnx.ModelProto``."""
        return ir.serde.serialize_model(self.model)

    def __repr__(self) -> str:
        device = "+".join(map(str, self.folded)) if self.folded else str(self.device)
        return (
            f"Stage({self.index}, {device}, ops={len(self.ops)}, "
            f"inputs={list(self.inputs)}, outputs={list(self.outputs)}, "
            f"depends_on={list(self.depends_on)})"
        )


@dataclass(frozen=True)
class Transfer:
    """A dynamic copy as a runtime performs it: blob ``source`` moved to ``device`` as ``target``.

    Attributes:
        op: the copy op's name.
        source: the blob copied (an activation or a graph input).
        target: the copy's output blob, which consumers on ``device`` read.
        src_device: where ``source`` lives.
        device: the destination device.
    """

    op: str
    source: str
    target: str
    src_device: Device
    device: Device


@dataclass
class Partition:
    """Stages plus what a runtime needs around them.

    Attributes:
        stages: the stages in execution order.
        transfers: the dynamic copies (copies of parameters are folded into stages).
        static_copies: static copy blob -> the parameter it copies.
        inputs: the model's graph inputs, in order.
        outputs: the model's graph outputs, in order.
        input_devices: graph input -> the device it is fed on.
        output_devices: graph output -> the device it is produced on.
        streamed: streamed parameter -> the host device it lives on; its copies are
            transfers made every run (a stage reads the copy as an input).
    """

    stages: list[Stage]
    transfers: list[Transfer]
    static_copies: dict[str, str]
    inputs: list[str]
    outputs: list[str]
    input_devices: dict[str, Device]
    output_devices: dict[str, Device]
    streamed: dict[str, Device] = field(default_factory=dict)


def partition(model: Model) -> list[Stage]:
    """Cut ``model`` into stages: maximal same-device segments with an acyclic stage graph.

    See the module docstring for the algorithm. Copy ops become transfers
    between stages (see :func:`split_stages` for those); every other op is in exactly
    one stage. The model is not modified.

    Args:
        model: a placed model (copies injected or not; a cross-device edge
            without a copy is treated as an implicit transfer).

    Returns:
        The stages in execution order (``stages[i].index == i``).

    Raises:
        PlacementError: a blob is read before it is produced, or a stage
            boundary blob has no type (the message names it).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> [str(s.device) for s in partition(model)]
        ['cuda:0']
    """
    return split_stages(model).stages


def split_stages(model: Model) -> Partition:
    """Like :func:`partition`, also returning transfers and graph input/output devices.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> p = split_stages(pl.from_torch(*mlp.build("tiny")))
        >>> len(p.stages), p.transfers, p.inputs
        (1, [], ['input'])
    """
    graph = model.graph
    consts = load_time_values(graph)
    copies = _scan_copies(model, consts)
    stage_of_node, stage_device, stage_nodes, sg = _assign(copies.compute, copies.root, consts)

    # Execution order: topological order of the stage graph, ties by creation order.
    order = list(nx.lexicographical_topological_sort(sg, key=lambda s: s))
    renumber = {old: new for new, old in enumerate(order)}
    readers = _readers(graph, stage_of_node)
    position = {node: i for i, node in enumerate(graph)}
    stages: list[Stage] = []
    for old in order:
        nodes = stage_nodes[old]
        inputs, params, extra = _boundary(model, nodes, copies.static, consts)
        outputs = _stage_outputs(graph, nodes, consts, readers, old)
        body = sorted(set(nodes) | extra, key=position.__getitem__)
        stage_model = _stage_model(model, body, inputs, outputs, params, renumber[old])
        carried = stage_model.graph.initializers
        stage = Stage(
            index=renumber[old],
            device=stage_device[old],
            ops=tuple(n.name or "" for n in nodes),
            inputs=tuple(v.name or "" for v in inputs),
            outputs=tuple(v.name or "" for v in outputs),
            parameters=tuple(name for name, _ in params if name in carried),
            depends_on=tuple(sorted({renumber[p] for p in sg.predecessors(old)})),
            model=stage_model,
            load_time_ops=tuple(n.name or "" for n in body if n in extra),
        )
        stage.fingerprint = _fingerprint(stage, body, params)
        stages.append(stage)

    log.debug(
        "partitioned %d ops into %d stages (%d transfers, %d static copies)",
        len(copies.compute),
        len(stages),
        len(copies.transfers),
        len(copies.static),
    )
    return Partition(
        stages=stages,
        transfers=copies.transfers,
        static_copies=copies.static,
        inputs=list(model.inputs),
        outputs=list(model.outputs),
        input_devices={name: model.blob_device(model.value(name)) for name in model.inputs},
        output_devices={v.name or "": model.blob_device(v) for v in graph.outputs},
        streamed={name: host for name, host in model.streamed.items() if name in graph.initializers},
    )


def stage_graph(stages: Sequence[Stage]) -> nx.DiGraph:
    """The stage graph: one node per stage index, an edge when one stage reads another's output.

    Node attributes: ``device``, ``ops`` (count).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> model.set_device(model.ops[-1].name, 1)
        >>> sorted(stage_graph(partition(model)).edges)
        [(0, 1)]
    """
    g = nx.DiGraph()
    for stage in stages:
        g.add_node(stage.index, device=stage.device, ops=len(stage.ops))
    for stage in stages:
        for dep in stage.depends_on:
            g.add_edge(dep, stage.index)
    return g


# --- internals -------------------------------------------------------------------------


@dataclass
class _Copies:
    """What the copy ops of a graph mean to the stages (see :func:`_scan_copies`)."""

    root: dict[ir.Value, ir.Value] = field(default_factory=dict)  # copy output -> first source
    static: dict[str, str] = field(default_factory=dict)  # static copy blob -> its parameter
    transfers: list[Transfer] = field(default_factory=list)  # the run-time copies
    compute: list[ir.Node] = field(default_factory=list)  # every other op, in graph order


def _scan_copies(model: Model, consts: set[ir.Value]) -> _Copies:
    """Sort the ops: copies of parameters (static), copies of load-time values
    (rematerialised where read, so neither), run-time transfers, and compute ops."""
    initializers = model.graph.initializers
    found = _Copies()
    for node in model.graph:
        if not (is_copy_node(node) and len(node.inputs) == 1 and len(node.outputs) == 1):
            found.compute.append(node)
            continue
        src = node.inputs[0]
        if src is None:
            raise PlacementError(f"copy {node.name!r} has no input")
        root = found.root.get(src, src)
        out = node.outputs[0]
        found.root[out] = root
        streamed = node.metadata_props.get(COPY_KEY) == "streamed"
        if root.producer() is None and root.name in initializers and not streamed:
            found.static[out.name or ""] = root.name or ""
        elif out not in consts:
            found.transfers.append(
                Transfer(
                    op=node.name or "",
                    source=src.name or "",
                    target=out.name or "",
                    src_device=model.blob_device(src),
                    device=node_device(node),
                )
            )
    return found


def _readers(graph: ir.Graph, stage_of_node: dict[ir.Node, int]) -> dict[ir.Value, set[int]]:
    """Blob -> the stages reading it (``-1`` for a copy, which reads outside every stage)."""
    readers: dict[ir.Value, set[int]] = {}
    for node in graph:
        sid = stage_of_node.get(node, -1)
        for value in node_reads(node, graph):
            readers.setdefault(value, set()).add(sid)
    return readers


def _boundary(
    model: Model, nodes: list[ir.Node], static: dict[str, str], consts: set[ir.Value]
) -> tuple[list[ir.Value], list[tuple[str, ir.Value]], set[ir.Node]]:
    """A stage's inputs (first-use order), the parameters it carries as (name in the
    stage, parameter value), and the load-time ops of other stages it recomputes."""
    graph = model.graph
    initializers = graph.initializers
    graph_inputs = {v.name for v in graph.inputs if v.name not in initializers}
    produced = {v for n in nodes for v in n.outputs}
    inputs: list[ir.Value] = []
    params: list[tuple[str, ir.Value]] = []
    extra: set[ir.Node] = set()
    seen: set[ir.Value] = set()
    pending = deque((node, value) for node in nodes for value in node_reads(node, graph))
    while pending:
        node, value = pending.popleft()
        if value in produced or value in seen:
            continue
        seen.add(value)
        name = value.name or ""
        producer = value.producer()
        if name in initializers and producer is None:
            params.append((name, value))
        elif name in static:
            params.append((name, initializers[static[name]]))
        elif value in consts and producer is not None:
            extra.add(producer)
            pending.extend((producer, v) for v in node_reads(producer, graph))
        elif producer is None and name not in graph_inputs:
            raise PlacementError(
                f"op {node.name!r} reads blob {name!r}, which is neither produced, "
                "a graph input nor a parameter"
            )
        else:
            inputs.append(value)
    return inputs, params, extra


def _stage_outputs(
    graph: ir.Graph,
    nodes: list[ir.Node],
    consts: set[ir.Value],
    readers: dict[ir.Value, set[int]],
    stage: int,
) -> list[ir.Value]:
    """Blobs of the stage that are graph outputs or read outside it (load-time values
    are recomputed by their readers instead)."""
    graph_outputs = set(graph.outputs)
    return [
        v
        for n in nodes
        for v in n.outputs
        if v.name and (v in graph_outputs or (v not in consts and readers.get(v, set()) - {stage}))
    ]


def _assign(
    compute: list[ir.Node], copy_root: dict[ir.Value, ir.Value], consts: set[ir.Value]
) -> tuple[dict[ir.Node, int], dict[int, Device], dict[int, list[ir.Node]], nx.DiGraph]:
    """Greedy stage assignment (module docstring, steps 1-3); load-time values make no edges."""
    stage_of_node: dict[ir.Node, int] = {}
    stage_device: dict[int, Device] = {}
    stage_nodes: dict[int, list[ir.Node]] = {}
    current: dict[Device, int] = {}  # device -> its current (newest) stage
    sg = nx.DiGraph()
    for node in compute:
        device = node_device(node)
        preds: set[int] = set()
        for value in node_reads(node, node.graph):
            root = copy_root.get(value, value)
            producer = root.producer()
            if producer is None or value in consts:
                continue
            sid = stage_of_node.get(producer)
            if sid is None:
                raise PlacementError(
                    f"op {node.name!r} reads blob {value.name!r} before it is produced "
                    "(ops are not in topological order)"
                )
            preds.add(sid)
        chosen = current.get(device)
        late = (  # a collective opens a stage rather than make its device's stage wait for others
            chosen is not None
            and COLLECTIVE_KEY in node.metadata_props
            and any(p != chosen and not nx.has_path(sg, p, chosen) for p in preds)
        )
        if chosen is None or late or any(p != chosen and nx.has_path(sg, chosen, p) for p in preds):
            chosen = len(stage_nodes)
            stage_nodes[chosen] = []
            stage_device[chosen] = device
            current[device] = chosen
            sg.add_node(chosen)
        stage_nodes[chosen].append(node)
        stage_of_node[node] = chosen
        sg.add_edges_from((p, chosen) for p in preds if p != chosen)
    return stage_of_node, stage_device, stage_nodes, sg


def _ensure_type(model: Model, value: ir.Value) -> None:
    """Give a stage input the exporter left untyped its type, from shape inference."""
    if value.type is not None:
        return
    original = model.value(value.name or "")
    if original.type is None:
        infer_shapes(model)
    if original.type is not None:
        value.type, value.shape = original.type, original.shape
    else:
        raise PlacementError(
            f"blob {value.name!r} crosses a stage boundary but has no known type, "
            "and ONNX shape inference cannot find one"
        )


def _stage_model(
    model: Model,
    nodes: list[ir.Node],
    inputs: list[ir.Value],
    outputs: list[ir.Value],
    params: list[tuple[str, ir.Value]],
    index: int,
) -> ir.Model:
    """A standalone ``onnx_ir.Model`` of ``nodes`` (cloned; tensors are shared)."""
    source = model.ir_model
    direct = [v for name, v in params if v.name == name]
    aliased = [(name, v) for name, v in params if v.name != name]
    # Static-copy blobs enter the view as inputs and are turned into initializers after cloning.
    alias_inputs: list[ir.Value] = []
    for name, _ in aliased:
        alias_inputs.append(model.value(name))
    view = ir.GraphView(
        [*inputs, *alias_inputs],
        outputs,
        nodes=nodes,
        initializers=direct,
        opset_imports=dict(source.graph.opset_imports),
        name=f"{source.graph.name or 'graph'}_stage{index}",
    )
    graph = view.clone()
    for (name, param), _ in zip(aliased, alias_inputs):
        value = next(v for v in graph.inputs if v.name == name)
        graph.inputs.remove(value)
        value.const_value = param.const_value
        value.type = param.type
        value.shape = param.shape.copy() if param.shape is not None else None
        graph.register_initializer(value)
    for value in graph.initializers.values():  # ORT wants initializers off the input list
        if value in graph.inputs:
            graph.inputs.remove(value)
    for value in graph.inputs:
        _ensure_type(model, value)
    _lift_large_constants(graph)
    stage_model = ir.Model(
        graph,
        ir_version=source.ir_version,
        producer_name="placement",
        functions=list(source.functions.values()),
    )
    _drop_dead_ops(stage_model)
    return stage_model


def _drop_dead_ops(stage_model: ir.Model) -> None:
    """Remove the ops of a stage model whose results nothing in the stage reads, and the
    initializers left unread.

    A stage keeps its ops whose only readers are other stages' load-time clones (a
    ``Constant`` weight, a transposed parameter read on another device): the stage
    itself needs neither them nor the weights they read, and would otherwise hold
    those weights on its device for nothing.
    """
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(stage_model)


#: ``Constant`` tensors of at least this many elements become stage initializers.
_LIFT_ELEMENTS = 256


def _lift_large_constants(graph: ir.Graph) -> None:
    """Turn large ``Constant`` ops of a stage graph into initializers, so that their
    weights reach ONNX Runtime outside the protobuf like every other weight."""
    from onnx_ir.passes.common import LiftConstantsToInitializersPass

    if any(n.op_type == "Constant" and "value" in n.attributes for n in graph):
        LiftConstantsToInitializersPass(size_limit=_LIFT_ELEMENTS)(ir.Model(graph, ir_version=10))


def _fingerprint(stage: Stage, nodes: list[ir.Node], params: list[tuple[str, ir.Value]]) -> str:
    h = hashlib.sha1(usedforsecurity=False)
    h.update(str(stage.device).encode())
    for node in nodes:
        h.update(f"|{node.name}:{node.domain}:{node.op_type}".encode())
        h.update(",".join(v.name or "" if v is not None else "" for v in node.inputs).encode())
        h.update(b">")
        h.update(",".join(v.name or "" for v in node.outputs).encode())
    h.update(("|in:" + ",".join(stage.inputs)).encode())
    h.update(("|out:" + ",".join(stage.outputs)).encode())
    h.update(("|params:" + ",".join(f"{n}={v.name}" for n, v in params)).encode())
    return h.hexdigest()
