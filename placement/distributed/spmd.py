"""One rank's share of a tensor-parallel model: the lowered module cut SPMD style.

A model split by :func:`placement.split_tensor_parallel` runs every op that depends on a
graph input once per device of its group; devices meet only in collectives (``Sum`` /
``Concat`` of copies, tagged ``placement.collective``). :func:`split_spmd` keeps, out of the
lowered module (:func:`placement.to_torch`), the ops of one rank's device:

* each collective becomes one :class:`~placement.distributed.collectives.Collective` call on
  the rank's own partial or shard (found through the copy that fed the emulated ``Sum`` /
  ``Concat``), issued where the first device's ``Sum`` / ``Concat`` of it stood, so that
  every rank issues the collectives in one order; a rank whose own result the split pruned
  still takes part (its result is *dangling*: :class:`SpmdStage` returns it, so that a
  backward can start there);
* copies of graph inputs read the rank's own inputs (every rank gets them all), and
  load-time values (parameters, transposed weights, constants) are computed where they are
  read, as in :func:`~placement.distributed.split.split_by_rank`;
* a value that is the same on every rank (*replicated*: graph inputs, collective results and
  what is computed from them and from replicated parameters) entering an op whose result
  differs per rank (*local*: it reads a shard) passes through one
  :class:`~placement.distributed.collectives.CopyIn` (Megatron's f), whose backward
  all-reduces the gradient. Which load-time values are local is read from the graph: those
  that not every device of the group reads (a shard, a device's own constant).

Any other value crossing devices (one device reads what another computed, outside a
collective) is not SPMD: :class:`~placement.errors.PlacementError` names it.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> _ = pl.split_tensor_parallel(model, devices=[0, 1])
    >>> module = pl.to_torch(model, device_map="cpu")
    >>> stage = split_spmd(module, model, rank=1)
    >>> [(c.kind, c.dangling) for c in stage.collectives]
    [('all_reduce', False), ('all_gather', True)]
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from placement.distributed.collectives import Collective, CollectiveSpec, CopyIn, pick
from placement.errors import PlacementError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import TP_KEY, collective_tag, is_copy_node, node_device
from placement.lowering.meta import DEVICE_META, OP_META

__all__ = ["SpmdStage", "split_spmd", "spmd_devices", "is_tensor_parallel"]

log = logging.getLogger(__name__)


@dataclass
class SpmdStage:
    """One rank's module and what it issues.

    Attributes:
        module: a ``GraphModule`` taking the graph inputs and returning
            ``(outputs, dangling)``: the graph outputs (a tuple, empty on ranks that do not
            hold them) and the results of collectives this rank takes part in but does not
            read (where a backward starts).
        device: the rank's logical device.
        collectives: the rank's collectives in issue order.
        copy_ins: the values passing through Megatron's f.
        holds_outputs: whether this rank computes the graph outputs.
        issued: collectives called so far, per direction (``forward`` / ``backward``).
    """

    module: fx.GraphModule
    device: Device
    collectives: list[CollectiveSpec]
    copy_ins: int
    holds_outputs: bool
    issued: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})


def is_tensor_parallel(model: Model) -> bool:
    """Whether ``model`` holds tagged collectives (a :func:`placement.split_tensor_parallel` result).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> is_tensor_parallel(pl.from_torch(*mlp.build("tiny")))
        False
    """
    return any(collective_tag(node) is not None for node in model.graph)


def spmd_devices(model: Model) -> list[Device]:
    """The devices of a tensor-parallel model's collectives, in group order: one rank each.

    Raises:
        PlacementError: the collectives are over different groups (a split inside the
            stages of a pipeline), which ranks do not run yet.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> _ = pl.split_tensor_parallel(model, devices=[0, 1])
        >>> [str(d) for d in spmd_devices(model)]
        ['cuda:0', 'cuda:1']
    """
    groups = {tuple(tag["group"]) for n in model.graph if (tag := collective_tag(n)) is not None}
    if len(groups) != 1:
        raise PlacementError(
            f"the model's collectives run over {len(groups)} device groups "
            f"({sorted(groups)}): a split inside pipeline stages runs as "
            "placement.distributed.DistributedTensorPipeline (one rank per device)"
        )
    devices = [Device.parse(d) for d in next(iter(groups))]
    others = sorted(str(d) for d in set(model.devices) - set(devices))
    if others:
        raise PlacementError(
            f"device(s) {', '.join(others)} take no part in the tensor-parallel group "
            f"{[str(d) for d in devices]}; ranks run a model split over all its devices"
        )
    return devices


def split_spmd(
    module: fx.GraphModule,
    model: Model,
    *,
    rank: int,
    group: Any = None,
    ordered: bool = False,
    comm_device: torch.device | None = None,
) -> SpmdStage:
    """Cut the lowered tensor-parallel ``model`` down to rank ``rank``'s device (see the module).

    Args:
        module: ``pl.to_torch(model, ...)``, every logical device on this rank's physical one.
        model: the placed model it was lowered from (its collective tags).
        rank: the rank, the index of its device in the collectives' group.
        group: the process group the collectives run over (default: the world).
        ordered: all-reduces sum the partials in device order on every rank (an all-gather
            and a local sum): bitwise the emulated split at any degree, not only at two.
        comm_device: where collective buffers must live (the host under gloo for a rank
            computing on a GPU); default: where the values are.

    Raises:
        PlacementError: a value crosses devices outside a collective, or the collectives
            are over several groups.
    """
    devices = spmd_devices(model)
    if not 0 <= rank < len(devices):
        raise PlacementError(f"rank {rank} is out of range for {len(devices)} tensor-parallel devices")
    me = str(devices[rank])
    info = _Graph(module, model, [[str(d) for d in devices]])
    issued = {"forward": 0, "backward": 0}
    builder = _Builder(module, info, me, rank, group, issued)
    builder.ordered, builder.comm_device = ordered, comm_device
    graph, specs, copy_ins, holds = builder.build()
    stage_module = fx.GraphModule(builder.root, graph, class_name=f"TensorRank{rank}")
    log.info(
        "rank %d (%s): %d collectives (%d dangling), %d copy-ins",
        rank,
        me,
        len(specs),
        sum(s.dangling for s in specs),
        copy_ins,
    )
    return SpmdStage(stage_module, devices[rank], specs, copy_ins, holds, issued)


def _is_move(node: fx.Node) -> bool:
    return (
        node.op == "call_method"
        and node.target == "to"
        and len(node.args) == 2
        and isinstance(node.args[1], str)
    )


class _Graph:
    """Facts about the lowered graph: static (load-time) nodes, each node's device, which
    values are local (differ per device), and each collective's readers. ``views`` (shape
    tokens' views) and what is computed from them only count as static too."""

    def __init__(
        self, module: fx.GraphModule, model: Model, groups: list[list[str]], views: Collection[fx.Node] = ()
    ) -> None:
        self.groups = groups
        #: each device's tensor-parallel group (a 2D split has one per pipeline stage)
        self.group_of = {d: g for g in groups for d in g}
        self.nodes = list(module.graph.nodes)
        self.tags: dict[str, dict[str, Any]] = {}
        self.roles: dict[str, str] = {}
        self.shapes: dict[str, list[Any]] = {}
        readers: dict[int, set[str]] = {}
        for node in model.graph:
            tag = collective_tag(node)
            role = node.metadata_props.get(TP_KEY)
            if role:
                self.roles[node.name or ""] = role
            if tag is None:
                continue
            self.tags[node.name or ""] = tag
            readers.setdefault(int(tag["id"]), set()).add(str(node_device(node)))
            if tag["kind"] == "all_gather":
                axis = node.attributes["axis"].value
                self.shapes[node.name or ""] = [
                    (v.shape[axis] if v is not None and v.shape is not None else None) for v in node.inputs
                ]
        groups_of = {int(tag["id"]): list(tag["group"]) for tag in self.tags.values()}
        self.readers = {k: sorted(groups_of[k].index(d) for d in v) for k, v in readers.items()}
        self.static: set[fx.Node] = set()
        for node in self.nodes:
            if (
                node.op == "get_attr"
                or node in views
                or (
                    node.op in ("call_function", "call_method", "call_module")
                    and all(a in self.static for a in node.all_input_nodes)
                )
            ):
                self.static.add(node)
        self.local = self._locality(module, model)

    def device(self, node: fx.Node) -> str | None:
        return node.meta.get(DEVICE_META)

    def tag(self, node: fx.Node) -> dict[str, Any] | None:
        return self.tags.get(node.meta.get(OP_META, ""))

    def _locality(self, module: fx.GraphModule, model: Model) -> set[fx.Node]:
        """The fx nodes whose values differ per device: see :func:`local_ops`."""
        ops, inits = local_ops(model, self.groups)
        paths = {path for name, path in getattr(module, "initializer_paths", {}).items() if name in inits}
        local: set[fx.Node] = set()
        for node in self.nodes:
            if node.op in ("placeholder", "output") or self.tag(node) is not None:
                continue  # inputs and collective results are replicated
            if node.op == "get_attr":
                if str(node.target) in paths or node.meta.get(OP_META) in ops:
                    local.add(node)
            elif _is_move(node):
                if node.args[0] in local:
                    local.add(node)
            elif node.meta.get(OP_META) in ops or any(a in local for a in node.all_input_nodes):
                local.add(node)
        return local


def local_ops(model: Model, devices: Sequence[str] | Sequence[Sequence[str]]) -> tuple[set[str], set[str]]:
    """The ops and initializers of a tensor-parallel ``model`` whose values differ per device.

    ``devices`` is the group, or one group per pipeline stage (a 2D split). An initializer
    (or a constant) is *local* when some devices of a group read it and others do not,
    seen through copies and the load-time ops on it (a shard, a device's own index range);
    an op is local when it is tagged shard or partial or reads a local value, except a
    collective, whose result is the same everywhere; a copy is what it copies.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> _ = pl.split_tensor_parallel(model, devices=[0, 1])
        >>> ops, inits = local_ops(model, ["cuda:0", "cuda:1"])
        >>> sorted(inits)[:2], "node_relu.tp0" in ops
        (['fc1.bias.tp0', 'fc1.bias.tp1'], True)
    """
    from placement.analysis.dependence import independent_values

    graph = model.graph
    static = independent_values(graph)
    if all(isinstance(d, str) for d in devices):  # one group, given as its devices
        groups = [{str(d) for d in devices}]
    else:
        groups = [{str(d) for d in group} for group in devices]

    def partial(seen: set[str] | None) -> bool:
        return seen is not None and any(g & seen and not g <= seen for g in groups)

    readers: dict[int, set[str]] = {}  # id(value) -> devices reading it (through load-time ops)
    for node in reversed(list(graph)):
        where = str(node_device(node))
        for value in node.inputs:
            if value is None:
                continue
            seen = readers.setdefault(id(value), set())
            seen.add(where)
            if all(out in static for out in node.outputs):
                for out in node.outputs:
                    seen |= readers.get(id(out), set())
    local_values: set[int] = set()
    inits: set[str] = set()
    for name, value in graph.initializers.items():
        if partial(readers.get(id(value))):
            local_values.add(id(value))
            inits.add(name)
    ops: set[str] = set()
    for node in graph:
        if collective_tag(node) is not None:
            continue
        ins = [v for v in node.inputs if v is not None]
        if not ins and node.outputs and partial(readers.get(id(node.outputs[0]))):
            hit = True  # a constant that only some devices read
        elif is_copy_node(node):
            hit = bool(ins) and id(ins[0]) in local_values
        else:
            hit = node.metadata_props.get(TP_KEY) in ("shard", "partial") or any(
                id(v) in local_values for v in ins
            )
        if hit:
            ops.add(node.name or "")
            local_values.update(id(out) for out in node.outputs)
    return ops, inits


class _Builder:
    """Builds one rank's graph from the whole lowered graph."""

    def __init__(
        self, module: fx.GraphModule, info: _Graph, me: str, rank: int, group: Any, issued: dict[str, int]
    ) -> None:
        self.module, self.info, self.me, self.rank = module, info, me, rank
        self.group, self.issued = group, issued
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.root = torch.nn.Module()
        self.copy_ins: dict[fx.Node, fx.Node] = {}
        self.results: dict[int, fx.Node] = {}
        self.specs: dict[int, CollectiveSpec] = {}
        self.ordered = False
        self.comm_device: torch.device | None = None

    def attach(self) -> None:
        """Give the rank's module every parameter and buffer (those it reads are kept)."""
        for name, value in self.module.named_parameters():
            _set_attr(self.root, name, value)
        for name, value in self.module.named_buffers():
            _set_attr(self.root, name, value)

    def build(self) -> tuple[fx.Graph, list[CollectiveSpec], int, bool]:
        info = self.info
        self.attach()
        output = None
        for node in info.nodes:
            if node.op == "placeholder":
                self.env[node] = self.graph.placeholder(node.name)
            elif node.op == "output":
                output = node
            else:
                self.step(node)
        assert output is not None
        holds = self._holds_outputs(output)
        outs = fx.graph.map_arg(output.args[0], lambda a: self._read(a, output)) if holds else ()
        if holds and not isinstance(outs, tuple):
            outs = (outs,)
        dangling = tuple(self.results[s.id] for s in self.specs.values() if s.dangling)
        self.graph.output((outs, dangling))
        self.graph.lint()
        specs = list(self.specs.values())
        return self.graph, specs, len(self.copy_ins), holds

    def step(self, node: fx.Node) -> None:
        """Copy a computed node of the whole graph into this rank's, if it runs here."""
        info = self.info
        if node in info.static or _is_move(node):
            return  # computed where read
        if info.tag(node) is not None:
            self._collective(node)
        elif info.device(node) == self.me:
            self.env[node] = self.graph.node_copy(node, lambda a, n=node: self._read(a, n))

    def _holds_outputs(self, output: fx.Node) -> bool:
        where = {self._home(a) for a in output.all_input_nodes}
        where.discard(None)
        if len(where) > 1:
            raise PlacementError(
                f"the graph outputs are computed on several devices ({sorted(where)}); "
                "a tensor-parallel model returns them from one"
            )
        return not where or self.me in where

    def _home(self, node: fx.Node) -> str | None:
        """Where a value is computed: None for inputs and load-time values (every rank)."""
        while _is_move(node) and node not in self.info.static:
            node = node.args[0]
        if node.op == "placeholder" or node in self.info.static:
            return None
        return self.info.device(node)

    def _read(self, a: fx.Node, reader: fx.Node) -> fx.Node:
        """``a`` as read by ``reader`` on this rank (through Megatron's f where it must)."""
        value = self._value(a, reader)
        if reader in self.info.local and reader.op != "output" and self._replicated(a):
            value = self._copy_in(a, value)  # a replicated parameter too: its gradient is summed
        return value

    def _replicated(self, a: fx.Node) -> bool:
        source = a
        while _is_move(source) and source not in self.info.static:
            source = source.args[0]
        return source not in self.info.local

    def _copy_in(self, a: fx.Node, value: fx.Node) -> fx.Node:
        found = self.copy_ins.get(a)
        if found is None:
            name = f"copy_in_{len(self.copy_ins)}"
            self.root.add_module(
                name, CopyIn(group=self.group, issued=self.issued, comm_device=self.comm_device)
            )
            found = self.graph.call_module(name, (value,))
            self.copy_ins[a] = found
        return found

    def _value(self, a: fx.Node, reader: fx.Node) -> fx.Node:
        if a in self.env:
            return self.env[a]
        if a in self.info.static:
            self.env[a] = self.graph.node_copy(a, lambda b: self._value(b, a))
            return self.env[a]
        if _is_move(a):  # a copy between devices: inputs and this rank's values are here already
            return self._value(a.args[0], reader)
        if self.info.device(a) != self.me:
            raise PlacementError(
                f"{reader.meta.get(OP_META, reader.name)!r} on {self.me} reads "
                f"{a.meta.get(OP_META, a.name)!r} from {self.info.device(a)} outside a collective: "
                "the model is not a tensor-parallel (SPMD) split that ranks can run"
            )
        raise PlacementError(f"{a.name!r} is read before it is computed on {self.me}")

    def _collective(self, node: fx.Node) -> None:
        info = self.info
        tag = info.tag(node)
        assert tag is not None
        cid = int(tag["id"])
        if list(tag["group"]) != info.group_of.get(self.me):
            return  # another pipeline stage's collective (a 2D split)
        if cid not in self.results:
            own = pick(node.args, self.rank)
            while _is_move(own) and own not in info.static:
                own = own.args[0]
            if self._foreign(own):
                raise PlacementError(
                    f"collective #{cid} ({node.meta.get(OP_META)}): input {self.rank} comes from "
                    f"{info.device(own)}, not from {self.me}"
                )
            spec = self._spec(node, tag, cid)
            spec.exclusive = (
                own.op == "call_function" and own not in info.static and _only_collectives(own, info)
            )
            name = f"{tag['kind']}_{cid}"
            self.root.add_module(
                name,
                Collective(
                    spec,
                    group=self.group,
                    issued=self.issued,
                    ordered=self.ordered,
                    comm_device=self.comm_device,
                ),
            )
            self.results[cid] = self.graph.call_module(name, (self._value(own, node),))
            self.specs[cid] = spec
        if info.device(node) == self.me:
            self.specs[cid].dangling = False
            self.env[node] = self.results[cid]

    def _foreign(self, own: fx.Node) -> bool:
        """Whether a collective's input for this rank is computed on another device."""
        info = self.info
        return info.device(own) != self.me and own.op != "placeholder" and own not in info.static

    def _spec(self, node: fx.Node, tag: dict[str, Any], cid: int) -> CollectiveSpec:
        readers = self.info.readers.get(cid, [])
        spec = CollectiveSpec(
            kind=str(tag["kind"]),
            id=cid,
            index=self.rank,
            size=len(tag["group"]),
            readers=readers,
            dangling=self.rank not in readers,
        )
        if spec.kind == "all_gather":
            spec.axis = int(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
            sizes = self.info.shapes.get(node.meta.get(OP_META, ""), [])
            if sizes and all(isinstance(s, int) for s in sizes):
                spec.sizes = [int(s) for s in sizes]
        return spec


def _only_collectives(node: fx.Node, info: _Graph) -> bool:
    """Whether ``node`` is read only by collectives (directly or through copies)."""
    for user in node.users:
        if _is_move(user):
            if not _only_collectives(user, info):
                return False
        elif info.tag(user) is None:
            return False
    return True


def _set_attr(root: torch.nn.Module, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    obj = root
    for part in parents:
        if not hasattr(obj, part):
            obj.add_module(part, torch.nn.Module())
        obj = getattr(obj, part)
    if isinstance(value, torch.nn.Parameter):
        obj.register_parameter(leaf, value)
    else:
        obj.register_buffer(leaf, value)


def collective_counts(specs: Sequence[CollectiveSpec]) -> dict[str, int]:
    """``{"all_reduce": n, "all_gather": m}`` of a rank's collectives.

    Example:
        >>> collective_counts([CollectiveSpec("all_reduce", 0, 0, 2)])
        {'all_reduce': 1, 'all_gather': 0}
    """
    return {kind: sum(s.kind == kind for s in specs) for kind in ("all_reduce", "all_gather")}
