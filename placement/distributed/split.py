"""Split a lowered placed model into one chain of ``torch.fx`` stage modules, one per rank.

:func:`placement.to_torch` tags every node it emits with its op's logical device
(``node.meta["placement_device"]``). :func:`split_by_rank` cuts the
``GraphModule`` along those tags into one ``GraphModule`` per rank, the way
``torch.fx.passes.split_module`` does, with two differences a pipeline needs:

* **A chain.** A pipeline stage talks to its two neighbours only, so a value
  computed on rank 0 and read on rank 2 is passed through rank 1: every stage
  takes the values live at its left boundary and returns those live at its right
  one (graph inputs enter at rank 0, graph outputs leave from the last rank). A
  placement whose later rank feeds an earlier one is not a chain
  (:class:`~placement.distributed.errors.NotAPipelineError`).
* **Load-time values stay local.** Nodes that depend on parameters and constants
  only (a transposed weight, a static copy of a parameter) are copied into every
  stage that reads them instead of travelling as activations; parameters are
  ``get_attr`` nodes of the stage that uses them, under their original names.
  A parameter read by several ranks (tied weights) is one parameter per rank;
  :attr:`RankSplit.shared_parameters` lists them so a trainer can sum their
  gradients.

* **Shape values stay local too.** A value computed from the *shape* of an
  activation (``Shape``/``Size`` and the integer arithmetic after them: a reshape
  target holding a dynamic batch) never crosses as data. What crosses is a
  zero-size *shape token* of the activation (its shape plus a trailing 0: no bytes
  on the wire), and every rank that reads the shape value recomputes it from the
  token. ``torch.distributed.pipelining`` infers a stage's input metadata from the
  previous stage and builds the later stages' example inputs from that metadata
  alone (uninitialized memory), so an integer tensor sent as data would feed
  those stages garbage shapes; a token's shape *is* its metadata.

Each rank lowers the whole model and keeps its own stage, so all ranks agree on
the boundaries without talking. ``.to(device)`` calls between values of the same
rank are dropped (a rank runs all its devices on one physical device).

Example:
    >>> import torch
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.distributed.ranks import rank_groups
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,))
    >>> model.set_device(model.ops[-1].name, 1)
    >>> module = pl.to_torch(model, device_map="cpu")
    >>> split = split_by_rank(module, rank_groups(model))
    >>> [len(names) for names in split.boundaries]
    [1]
    >>> torch.allclose(split.stages[1](*split.stages[0](x)), module(x))
    True
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from placement.distributed.errors import NotAPipelineError
from placement.graph.device import Device

__all__ = [
    "RankSplit",
    "split_by_rank",
    "contiguous_grad",
    "shape_token",
    "token_view",
    "trains_through_shape_tokens",
    "DEVICE_KEY",
]

log = logging.getLogger(__name__)

#: ``node.meta`` key holding the logical device the lowering emitted the node for.
DEVICE_KEY = "placement_device"


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """``x``, with its gradient made contiguous on the way back.

    A rank sends the gradients of its inputs to the previous rank, and gloo's and
    NCCL's point-to-point ops take contiguous tensors only; the gradient of an input
    read through a transpose is not. Free when ``x`` needs no gradient.

    Example:
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> contiguous_grad(x).t().sum(0).mul(torch.arange(2.0)).sum().backward()
        >>> x.grad.is_contiguous()
        True
    """
    if not x.requires_grad:
        return x
    return _ContiguousGrad.apply(x)


def shape_token(x: torch.Tensor) -> torch.Tensor:
    """A zero-size tensor carrying ``x``'s shape: ``x.shape + (0,)``, no bytes to send.

    Example:
        >>> token = shape_token(torch.ones(3, 5))
        >>> tuple(token.shape), token.numel()
        ((3, 5, 0), 0)
    """
    return x.new_empty((*x.shape, 0))


def trains_through_shape_tokens() -> bool:
    """Whether the installed torch's pipelining can train a stage that receives a shape token.

    Read from the installed ``PipelineStage`` (not from a version number): torch 2.11 marks
    every buffer a stage receives as requiring gradients in training, which an integer token
    (the shape of token ids) cannot, and wants a gradient back for each; later releases leave
    buffers that are not floating point out of the backward.

    Example:
        >>> isinstance(trains_through_shape_tokens(), bool)
        True
    """
    import inspect

    from torch.distributed.pipelining import PipelineStage

    try:
        source = inspect.getsource(PipelineStage)
    except (OSError, TypeError):  # no source shipped: assume the newer behaviour
        return True
    return "r.buffer.requires_grad_(True)" not in source


def token_view(token: torch.Tensor) -> torch.Tensor:
    """A storage-free (meta) tensor with the shape :func:`shape_token` carried: what shape reads read.

    Example:
        >>> tuple(token_view(shape_token(torch.ones(3, 5))).shape)
        (3, 5)
    """
    return torch.empty(token.shape[:-1], dtype=token.dtype, device="meta")


@dataclass
class RankSplit:
    """The stages of every rank and what crosses each boundary.

    Attributes:
        stages: one ``GraphModule`` per rank (only ``stages[rank]`` when built for one rank;
            the others are None). Stage ``r`` takes the values of ``boundaries[r - 1]``
            (rank 0: the graph inputs) and returns those of ``boundaries[r]`` as a tuple
            (the last rank: the graph outputs, one tensor or a tuple).
        boundaries: for each of the ``len(stages) - 1`` boundaries, the fx names of the
            values sent across it.
        node_counts: the number of nodes each rank computes.
        shared_parameters: parameter paths read on several ranks -> those ranks.
    """

    stages: list[fx.GraphModule | None]
    boundaries: list[list[str]]
    node_counts: list[int]
    shared_parameters: dict[str, list[int]] = field(default_factory=dict)


def split_by_rank(
    module: fx.GraphModule, groups: Sequence[Sequence[Device]], *, rank: int | None = None
) -> RankSplit:
    """Cut a ``GraphModule`` from :func:`placement.to_torch` into a chain of rank stages.

    Args:
        module: the lowered placed model (every rank's devices mapped to one physical device).
        groups: the logical devices of each rank, rank 0 first
            (:func:`~placement.distributed.ranks.rank_groups`).
        rank: build only this rank's stage (the analysis still covers all ranks).

    Raises:
        NotAPipelineError: a value flows from a later rank to an earlier one, or a
            node's device belongs to no rank.

    Example:
        >>> import torch
        >>> import placement as pl
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> model = pl.from_torch(net, (torch.randn(2, 4),))
        >>> split = split_by_rank(pl.to_torch(model, device_map="cpu"), [[pl.Device("cuda", 0)]])
        >>> len(split.stages), split.boundaries
        (1, [])
    """
    n_ranks = len(groups)
    rank_of = {str(d): r for r, group in enumerate(groups) for d in group}
    graph, views = _tokenize_shape_reads(module.graph)
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in reversed(nodes) if n.op == "output")

    # 1. which rank computes each input-dependent node (placeholders: -1, before rank 0)
    part: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op == "placeholder":
            part[node] = -1
            continue
        if node.op == "output" or node in views:
            continue  # a token's view is read where it is needed, like a load-time value
        ins = [a for a in node.all_input_nodes if a in part]
        if not ins:
            continue  # depends on parameters and constants only
        tag = node.meta.get(DEVICE_KEY)
        if tag is not None:
            if tag not in rank_of:
                raise NotAPipelineError(f"node {node.name!r} runs on device {tag}, which no rank runs")
            where = rank_of[tag]
        else:
            where = max(0, *(part[a] for a in ins))
        for a in ins:
            if part[a] > where:
                raise NotAPipelineError(
                    f"{node.name!r} on rank {where} ({'+'.join(map(str, groups[where]))}) reads "
                    f"{a.name!r} from the later rank {part[a]} ({'+'.join(map(str, groups[part[a]]))}): "
                    "the ranks do not form a pipeline; group those devices on one rank (ranks=...)"
                )
        part[node] = where

    # 2. each rank's nodes: its own plus the load-time and shape values they read
    members, reads, shared = _members(module, part, output, groups)

    # 3. the values crossing each boundary (graph outputs cross every boundary after their rank)
    last_use: dict[fx.Node, int] = {}
    for node in part:
        uses = [n_ranks - 1 if u.op == "output" else part.get(u, -2) for u in node.users]
        last_use[node] = max(uses + [reads.get(node, -2)])
    boundaries: list[list[fx.Node]] = []
    for b in range(n_ranks - 1):
        live = [n for n in part if part[n] <= b < last_use[n]]
        boundaries.append(sorted(live, key=order.__getitem__))

    stages: list[fx.GraphModule | None] = []
    for r in range(n_ranks):
        if rank is not None and r != rank:
            stages.append(None)
            continue
        inputs = placeholders if r == 0 else boundaries[r - 1]
        outs: list[fx.Node] | None = boundaries[r] if r < n_ranks - 1 else None
        stages.append(_build(module, r, inputs, members[r], order, outs, output))
    return RankSplit(
        stages=stages,
        boundaries=[[n.name for n in b] for b in boundaries],
        node_counts=[sum(1 for n in m if n.op not in ("get_attr",)) for m in members],
        shared_parameters={k: sorted(v) for k, v in sorted(shared.items()) if len(v) > 1},
    )


def _members(
    module: fx.GraphModule, part: dict[fx.Node, int], output: fx.Node, groups: Sequence[Sequence[Device]]
) -> tuple[list[set[fx.Node]], dict[fx.Node, int], dict[str, set[int]]]:
    """Each rank's nodes, the last rank reading each computed node through a load-time or
    shape value (a shape token), and the parameters each rank reads.

    Raises:
        NotAPipelineError: a rank reads a shape token computed on a later rank.
    """
    n_ranks = len(groups)
    members: list[set[fx.Node]] = [set() for _ in range(n_ranks)]
    for node, where in part.items():
        if where >= 0:
            members[where].add(node)
    reads: dict[fx.Node, int] = {}
    shared: dict[str, set[int]] = {}
    for r in range(n_ranks):
        todo = [a for n in members[r] for a in n.all_input_nodes if a not in part]
        if r == n_ranks - 1:
            todo += [a for a in output.all_input_nodes if a not in part]
        while todo:
            node = todo.pop()
            if node in members[r]:
                continue
            members[r].add(node)
            if node.op == "get_attr" and isinstance(_attr(module, str(node.target)), torch.nn.Parameter):
                shared.setdefault(str(node.target), set()).add(r)
            for a in node.all_input_nodes:
                if a not in part:
                    todo.append(a)
                    continue
                if part[a] > r:  # a shape token of a later rank
                    raise NotAPipelineError(
                        f"rank {r} ({'+'.join(map(str, groups[r]))}) reads the shape of {a.args[0]!r}, "
                        f"computed on the later rank {part[a]}: the ranks do not form a pipeline; "
                        "group those devices on one rank (ranks=...)"
                    )
                reads[a] = max(reads.get(a, -2), r)
    return members, reads, shared


def _tokenize_shape_reads(source: fx.Graph) -> tuple[fx.Graph, set[fx.Node]]:
    """A copy of ``source`` whose shape reads of input-dependent values read shape tokens.

    Each ``Shape``/``Size`` of a value computed from the graph inputs reads
    ``token_view(shape_token(value))`` instead (one token per value): the token is computed
    with the value and crosses ranks in its place; the view and everything computed from
    it are recomputed on every rank that reads them. Returns the copy and its views.
    """
    from placement.lowering.ops.shape import shape, size

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(source, env))
    dependent: set[fx.Node] = set()
    views: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "placeholder":
            dependent.add(node)
            continue
        if node.op == "call_function" and node.target in (shape, size) and node.args[0] in dependent:
            data = node.args[0]
            if data not in views:
                with graph.inserting_before(node):
                    token = graph.call_function(shape_token, (data,))
                    views[data] = graph.call_function(token_view, (token,))
            node.args = (views[data], *node.args[1:])
        if any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return graph, set(views.values())


def _is_move(node: fx.Node) -> bool:
    """A ``.to(device)`` the lowering emitted (not a dtype cast)."""
    return (
        node.op == "call_method"
        and node.target == "to"
        and len(node.args) == 2
        and isinstance(node.args[1], str)
    )


def _attr(module: torch.nn.Module, path: str) -> object:
    obj: object = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _build(
    module: fx.GraphModule,
    rank: int,
    inputs: Sequence[fx.Node],
    members: set[fx.Node],
    order: dict[fx.Node, int],
    outs: Sequence[fx.Node] | None,
    output: fx.Node,
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        if rank > 0:  # its gradient goes back to the previous rank
            env[node] = graph.call_function(contiguous_grad, (env[node],))
    for node in sorted(members, key=order.__getitem__):
        if _is_move(node) and not (rank == 0 and node.args[0].op == "placeholder"):
            env[node] = env[node.args[0]]  # a move between devices of this rank: a no-op here
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
    if outs is not None:  # sent to the next rank: point-to-point ops need contiguous tensors
        graph.output(tuple(graph.call_method("contiguous", (env[n],)) for n in outs))
    else:
        graph.output(fx.graph.map_arg(output.args[0], env.__getitem__))
    graph.lint()
    return fx.GraphModule(module, graph, class_name=f"Rank{rank}Stage")
