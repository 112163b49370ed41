"""One rank's share of a 2D split (tensor parallelism inside pipeline stages): the lowered module cut.

:func:`placement.split_tensor_parallel` with ``devices=[[0, 1], [2, 3]]`` splits each pipeline
stage over its own group of devices: the collectives of stage ``g`` run over group ``g`` only,
and a value crossing from stage ``g`` to ``g + 1`` goes from device ``k`` of group ``g`` to device
``k`` of group ``g + 1``. As ranks, every device is one rank (rank ``g * t + k`` for ``t``
devices per group), so the ranks form a grid: the ranks of a group issue its collectives
(:func:`~placement.distributed.spmd.split_spmd`'s cut, over the group's process group), and
the ranks with one ``k`` form a pipeline (*chain* ``k``), whose stages pass values on with
``torch.distributed.pipelining``, as :class:`~placement.distributed.DistributedPipeline` does.

:func:`split_grid` cuts chain ``k``'s stage ``g`` out of the lowered module:

* the ops of the rank's device, its group's collectives (each one call on the rank's share)
  and Megatron's f where a replicated value enters a shard's ops, as in ``split_spmd``;
* inputs: the graph inputs (stage 0), else the values stage ``g - 1`` of the chain sends;
  outputs: the values later stages of the chain read (a value stage ``g + 2`` reads from
  stage ``g`` passes through stage ``g + 1``), else (the last stage) the graph outputs on
  the rank that holds them, and on the others the results of collectives they take part in
  without reading them (where their backward starts; see :class:`GridStage`).

A value that a device reads from a device of another chain, or from a later stage, is
refused with :class:`~placement.errors.InputError` naming it.

Example:
    >>> import torch
    >>> import placement as pl
    >>> from placement.models import gpt
    >>> net, (idx,) = gpt.build("tiny")
    >>> model = pl.from_torch(net, (idx,))
    >>> acts = pl.get_activation_blobs(model)
    >>> _ = pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 2})
    >>> _ = pl.inject_cross_device_copies(model)
    >>> _ = pl.split_tensor_parallel(model, devices=[[0, 1], [2, 3]])
    >>> [[str(d) for d in group] for group in grid_groups(model)]
    [['cuda:0', 'cuda:1'], ['cuda:2', 'cuda:3']]
    >>> module = pl.to_torch(model, device_map={str(d): "cpu" for d in model.devices})
    >>> stage = split_grid(module, model, rank=3)  # stage 1 of chain 1 (cuda:3)
    >>> stage.position, stage.index, stage.holds_outputs, len(stage.inputs)
    (1, 1, False, 1)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from placement.distributed.collectives import CollectiveSpec, pick
from placement.distributed.errors import NotAPipelineError
from placement.distributed.ranks import pipeline_devices
from placement.distributed.split import _tokenize_shape_reads, contiguous_grad
from placement.distributed.spmd import _Builder, _Graph, _is_move
from placement.errors import InputError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import collective_tag
from placement.lowering.meta import DEVICE_META, OP_META

__all__ = ["GridStage", "grid_groups", "split_grid", "is_grid"]

log = logging.getLogger(__name__)


@dataclass
class GridStage:
    """One rank's stage of a 2D split.

    Attributes:
        module: a ``GraphModule`` taking the stage's inputs (the graph inputs at stage 0,
            else the previous stage's outputs) and returning a tuple of the values the
            next stage takes, or at the last stage the graph outputs (rank holding them)
            or the *dangling* collective results (the others).
        device: the rank's logical device.
        position: the pipeline stage (the group's index).
        index: the rank's place in its group (its chain).
        collectives: the group's collectives in issue order, as this rank issues them.
        copy_ins: the values passing through Megatron's f.
        holds_outputs: whether this rank computes the graph outputs.
        inputs: the fx names of the values the stage receives (stage 0: the graph inputs).
        outputs: the fx names of the values it sends (empty at the last stage).
        shared_parameters: parameter paths read at several stages of the chain -> those stages.
        issued: collectives called so far, per direction (``forward`` / ``backward``).
    """

    module: fx.GraphModule
    device: Device
    position: int
    index: int
    collectives: list[CollectiveSpec]
    copy_ins: int
    holds_outputs: bool
    inputs: list[str]
    outputs: list[str]
    shared_parameters: dict[str, list[int]] = field(default_factory=dict)
    issued: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})

    @property
    def dangling(self) -> int:
        """How many collective results this rank takes part in without reading them."""
        return sum(spec.dangling for spec in self.collectives)


def _tag_groups(model: Model) -> list[tuple[str, ...]]:
    seen: list[tuple[str, ...]] = []
    for node in model.graph:
        tag = collective_tag(node)
        if tag is not None and tuple(tag["group"]) not in seen:
            seen.append(tuple(tag["group"]))
    return seen


def is_grid(model: Model) -> bool:
    """Whether ``model``'s collectives run over several device groups (a 2D split).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> _ = pl.split_tensor_parallel(model, devices=[0, 1])
        >>> is_grid(model)
        False
    """
    return len(_tag_groups(model)) > 1


def grid_groups(model: Model) -> list[list[Device]]:
    """The device groups of a 2D split, in pipeline order: group ``g``'s device ``k`` is rank ``g * t + k``.

    Raises:
        InputError: the model has no collectives, its groups overlap or differ in
            size, or a device of the model is in no group.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> _ = pl.split_tensor_parallel(model, devices=[0, 1])
        >>> [[str(d) for d in g] for g in grid_groups(model)]
        [['cuda:0', 'cuda:1']]
    """
    tags = _tag_groups(model)
    if not tags:
        raise InputError("the model has no tagged collectives: it is not a tensor-parallel split")
    groups = [[Device.parse(d) for d in group] for group in tags]
    sizes = {len(g) for g in groups}
    flat = [d for g in groups for d in g]
    if len(sizes) != 1 or len(set(flat)) != len(flat):
        raise InputError(
            f"the collectives' device groups {[[str(d) for d in g] for g in groups]} must be "
            "disjoint and of one size to run as a grid of ranks"
        )
    others = sorted(str(d) for d in set(model.devices) - set(flat))
    if others:
        raise InputError(
            f"device(s) {', '.join(others)} take no part in any tensor-parallel group; "
            "ranks run a model whose every device is in one"
        )
    order = pipeline_devices(model)
    return sorted(groups, key=lambda g: min(order.index(d) for d in g))


def split_grid(
    module: fx.GraphModule,
    model: Model,
    *,
    rank: int,
    group: Any = None,
    ordered: bool = False,
    comm_device: torch.device | None = None,
) -> GridStage:
    """Cut the lowered 2D-split ``model`` down to rank ``rank``'s stage (see the module).

    Args:
        module: ``pl.to_torch(model, ...)``, every logical device on this rank's physical one.
        model: the placed model it was lowered from (its collective tags).
        rank: the rank: ``g * t + k`` for device ``k`` of group ``g`` (:func:`grid_groups`).
        group: the process group of the rank's device group (its collectives).
        ordered: all-reduces sum the partials in device order on every rank.
        comm_device: where collective buffers must live (default: where the values are).

    Raises:
        InputError: a value crosses devices outside a collective and outside its chain.
        NotAPipelineError: a stage reads a value of a later stage.
    """
    groups = grid_groups(model)
    t = len(groups[0])
    if not 0 <= rank < t * len(groups):
        raise InputError(f"rank {rank} is out of range for {t * len(groups)} devices")
    position, index = divmod(rank, t)
    module, views = _with_shape_tokens(module)
    info = _Graph(module, model, [[str(d) for d in g] for g in groups], views)
    chain = _Chain(info, [[str(d) for d in g] for g in groups], index)
    shared: dict[str, set[int]] = {}
    mine = None
    for p in range(len(groups)):  # every stage of the chain: the parameters each reads
        builder = _GridBuilder(module, info, chain, p, group if p == position else None)
        builder.ordered, builder.comm_device = ordered, comm_device
        stage = builder.build_stage()
        for path in builder.parameters_read():
            shared.setdefault(path, set()).add(p)
        if p == position:
            mine = (builder, stage)
    assert mine is not None
    builder, stage = mine
    stage.shared_parameters = {k: sorted(v) for k, v in sorted(shared.items()) if len(v) > 1}
    log.info(
        "rank %d (%s, stage %d of chain %d): %d collectives, %d in, %d out",
        rank,
        stage.device,
        position,
        index,
        len(stage.collectives),
        len(stage.inputs),
        len(stage.outputs),
    )
    return stage


def _with_shape_tokens(module: fx.GraphModule) -> tuple[fx.GraphModule, set[fx.Node]]:
    """``module`` whose shape reads of activations read shape tokens (as in
    :func:`~placement.distributed.split.split_by_rank`): a token is computed on its value's
    device and crosses stages in its place; its view and the shape arithmetic after it are
    computed where read, like load-time values."""
    graph, views = _tokenize_shape_reads(module.graph)
    for view in views:
        token = view.args[0]
        token.meta[DEVICE_META] = token.args[0].meta.get(DEVICE_META)
    lowered = fx.GraphModule(module, graph, class_name=type(module).__name__)
    lowered.initializer_paths = dict(getattr(module, "initializer_paths", {}))
    return lowered, views


class _Chain:
    """What crosses the stages of chain ``index``: each boundary's values, in graph order."""

    def __init__(self, info: _Graph, groups: list[list[str]], index: int) -> None:
        self.info, self.groups, self.index = info, groups, index
        self.position = {d: p for p, g in enumerate(groups) for d in g}
        self.chain = {g[index] for g in groups}
        self.output = next(n for n in reversed(info.nodes) if n.op == "output")
        self.last_read: dict[fx.Node, int] = {}
        self.order = {n: i for i, n in enumerate(info.nodes)}
        self._walked: set[tuple[fx.Node, int]] = set()
        seen: set[int] = set()
        for node in info.nodes:
            if node.op in ("placeholder", "output") or node in info.static or _is_move(node):
                continue
            tag = info.tag(node)
            if tag is not None:
                cid = int(tag["id"])
                if cid not in seen:
                    seen.add(cid)
                    here = self.position[str(tag["group"][0])]
                    self._note(pick(node.args, index), here, node)
            elif info.device(node) in self.chain:
                here = self.position[str(info.device(node))]
                for a in node.all_input_nodes:
                    self._note(a, here, node)
        holder = self.holder()
        if holder in self.chain:
            for a in self.output.all_input_nodes:
                self._note(a, len(groups) - 1, self.output)
        self.boundaries = [
            sorted(
                (v for v, last in self.last_read.items() if self.made_at(v) <= b < last),
                key=self.order.__getitem__,
            )
            for b in range(len(groups) - 1)
        ]

    def source(self, node: fx.Node) -> fx.Node:
        while _is_move(node) and node not in self.info.static:
            node = node.args[0]
        return node

    def made_at(self, node: fx.Node) -> int:
        """The stage computing ``node`` (the graph inputs: stage 0's)."""
        if node.op == "placeholder":
            return 0
        return self.position[str(self.info.device(node))]

    def holder(self) -> str | None:
        """The device computing the graph outputs (None: the graph inputs or constants only).

        Raises:
            InputError: they are computed on several devices.
        """
        where = {
            self.info.device(s)
            for a in self.output.all_input_nodes
            if (s := self.source(a)).op != "placeholder" and s not in self.info.static
        }
        if len(where) > 1:
            raise InputError(
                f"the graph outputs are computed on several devices ({sorted(map(str, where))}); "
                "a tensor-parallel model returns them from one"
            )
        return next(iter(where), None)

    def _note(self, a: Any, here: int, reader: fx.Node) -> None:
        if not isinstance(a, fx.Node):
            return
        s = self.source(a)
        if s in self.info.static:  # computed where read, from shape tokens perhaps
            if (s, here) not in self._walked:
                self._walked.add((s, here))
                for b in s.all_input_nodes:
                    self._note(b, here, reader)
            return
        if s.op != "placeholder":
            where = self.info.device(s)
            if where is None or where not in self.position or self.position[where] == here:
                return  # this stage's own value (split_spmd checks the devices within it)
            name = reader.meta.get(OP_META, reader.name)
            if where not in self.chain:
                raise InputError(
                    f"{name!r} on stage {here} of chain {self.index} reads "
                    f"{s.meta.get(OP_META, s.name)!r} from {where}, not from device {self.index} "
                    "of the earlier group: the 2D split is not a grid that ranks can run"
                )
            if self.position[where] > here:
                raise NotAPipelineError(
                    f"{name!r} on stage {here} reads {s.meta.get(OP_META, s.name)!r} from the later "
                    f"stage {self.position[where]} ({where}): the groups do not form a pipeline"
                )
        if self.made_at(s) < here:
            self.last_read[s] = max(self.last_read.get(s, -1), here)


class _GridBuilder(_Builder):
    """Builds stage ``position`` of a chain: :class:`_Builder` with boundary inputs and outputs."""

    def __init__(self, module: fx.GraphModule, info: _Graph, chain: _Chain, position: int, group: Any):
        me = chain.groups[position][chain.index]
        issued = {"forward": 0, "backward": 0}
        super().__init__(module, info, me, chain.index, group, issued)
        self.chain, self.position = chain, position
        self.received: dict[fx.Node, fx.Node] = {}

    def build_stage(self) -> GridStage:
        chain, info = self.chain, self.chain.info
        self.attach()
        last = self.position == len(chain.groups) - 1
        inputs = chain.boundaries[self.position - 1] if self.position else []
        for node in info.nodes:
            if node.op == "placeholder" and not self.position:
                self.env[node] = self.graph.placeholder(node.name)
        for value in inputs:
            placeholder = self.graph.placeholder(value.name)
            self.received[value] = self.graph.call_function(contiguous_grad, (placeholder,))
        for node in info.nodes:
            if node.op not in ("placeholder", "output"):
                self.step(node)
        holds = last and chain.holder() in chain.chain
        dangling = [self.results[s.id] for s in self.specs.values() if s.dangling]
        if dangling and not (last and not holds):
            raise InputError(
                f"{self.me} takes part in collective(s) "
                f"{[s.id for s in self.specs.values() if s.dangling]} without reading their result "
                "outside the last stage's ranks without the outputs: not supported by grid ranks"
            )
        if not last:
            sent = [self._value(v, chain.output) for v in chain.boundaries[self.position]]
            self.graph.output(tuple(self.graph.call_method("contiguous", (v,)) for v in sent))
        elif holds:
            self.graph.output(fx.graph.map_arg(chain.output.args[0], lambda a: self._read(a, chain.output)))
        else:
            self.graph.output(tuple(dangling))
        self.graph.lint()
        module = fx.GraphModule(self.root, self.graph, class_name=f"GridStage{self.position}x{chain.index}")
        return GridStage(
            module,
            Device.parse(self.me),
            self.position,
            chain.index,
            list(self.specs.values()),
            len(self.copy_ins),
            holds,
            [v.name for v in inputs]
            if self.position
            else [n.name for n in info.nodes if n.op == "placeholder"],
            [] if last else [v.name for v in chain.boundaries[self.position]],
            issued=self.issued,
        )

    def parameters_read(self) -> list[str]:
        """The parameter paths this stage's graph reads."""
        out = []
        for node in self.graph.nodes:
            if node.op == "get_attr":
                try:
                    value = self.root.get_parameter(str(node.target))
                except AttributeError:
                    continue
                if isinstance(value, torch.nn.Parameter):
                    out.append(str(node.target))
        return out

    def _value(self, a: fx.Node, reader: fx.Node) -> fx.Node:
        if a in self.received:
            return self.received[a]
        return super()._value(a, reader)

    def _foreign(self, own: fx.Node) -> bool:
        return own not in self.received and super()._foreign(own)
