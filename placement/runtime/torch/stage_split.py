"""Cutting a lowered module into its pipeline stages, and how each stage runs (traced or not).

:func:`split_stages` cuts the ``GraphModule`` of ``pl.to_torch`` into one submodule per
stage of :func:`placement.runtime.stages.partition` (``torch.fx.passes.split_module``),
each a :class:`~.stage_exec.TorchStage`; :func:`traced_stage` wraps a stage's code as a
:class:`~.traced.TracedStage`, untraced when it holds a nondeterministic op
(:func:`nondeterministic_ops`) or control flow that depends on tensor values. The
pipelined module (:mod:`.pipelined`) and the per-stage timing (:mod:`.timing`) both
start here.

Example:
    >>> import torch
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,))
    >>> model.set_device(model.ops[-1].name, 1)
    >>> module = pl.to_torch(model, device_map="cpu")
    >>> stages, inputs, outputs = split_stages(module, stage_of_ops(model))
    >>> len(stages), len(inputs), len(outputs)
    (2, 1, 1)
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from placement.analysis import NONDETERMINISTIC_OPS
from placement.errors import LoweringError
from placement.graph.model import Model
from placement.graph.nodes import subgraphs_of
from placement.lowering.meta import OP_META, UNTRACEABLE_META
from placement.lowering.ops.training import mode_op_names
from placement.runtime.stages import partition
from placement.runtime.torch.stage_exec import TorchStage
from placement.runtime.torch.traced import TracedStage

__all__ = ["nondeterministic_ops", "split_stages", "stage_of_ops", "traced_stage"]


def nondeterministic_ops(model: Model) -> set[str]:
    """Names of the ops whose results differ from run to run: random ops, and ops whose
    subgraphs hold one (an ``If`` inlined when lowering puts its branch's ops under its own
    name). A stage holding one is never traced.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> nondeterministic_ops(pl.from_torch(*mlp.build("tiny")))
        set()
    """
    names = mode_op_names(model)  # Dropout, BatchNorm of a training export: random, stateful
    for op in model.ops:
        if op.op_type in NONDETERMINISTIC_OPS or any(
            inner.op_type in NONDETERMINISTIC_OPS
            for _, graph in subgraphs_of(op.node)
            for inner in graph.all_nodes()
        ):
            names.add(op.name)
    return names


def stage_of_ops(model: Model) -> dict[str, int]:
    """Each op's stage in :func:`placement.runtime.stages.partition` of ``model``."""
    stage_of: dict[str, int] = {}
    for stage in partition(model):
        for op in stage.ops:
            stage_of[op] = stage.index
    return stage_of


def split_stages(
    module: fx.GraphModule, stage_of_op: Mapping[str, int], *, own_input_moves: bool = False
) -> tuple[list[TorchStage], list[str], list[str]]:
    """Cut ``module`` into per-stage submodules with ``split_module``: the stages in order and
    the environment keys of the graph inputs and outputs.

    A graph input's move to its device runs in the first stage that reads it, and later
    stages read the moved value from there. ``own_input_moves``: every stage reading it moves
    it itself instead, so that stages reading only graph inputs (the first layer's branches
    of a tensor-parallel split) do not wait for each other (on the host a move to the host is
    free; :mod:`.concurrent`)."""
    graph = module.graph
    assigned: dict[fx.Node, int] = {}
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    for node in nodes:
        op = node.meta.get(OP_META)
        if op is not None and op in stage_of_op:
            assigned[node] = stage_of_op[op]

    def users_stage(node: fx.Node, seen: set[fx.Node]) -> int | None:
        found = []
        for user in node.users:
            if user.op == "output" or user in seen:
                continue
            if user in assigned:
                found.append(assigned[user])
            else:
                seen.add(user)
                s = users_stage(user, seen)
                if s is not None:
                    found.append(s)
        return min(found) if found else None

    # Nodes no stage op produced (input moves, copies between stages, output moves): a node
    # feeding stages runs in the first stage that reads it; one feeding only the output runs
    # with its producer.
    for node in nodes:
        if node in assigned:
            continue
        stage = users_stage(node, set())
        if stage is None:
            producers = [assigned[a] for a in node.all_input_nodes if a in assigned]
            stage = max(producers) if producers else 0
        assigned[node] = stage
    # Keep the numbering dense and in order.
    parts = sorted(set(assigned.values()))
    order = {s: k for k, s in enumerate(parts)}
    staged, assigned = _in_stage_order(module, assigned)
    if own_input_moves:
        _own_input_moves(staged, assigned)
    split = split_module(staged, module, lambda node: order[assigned[node]], keep_original_order=True)
    stages: list[TorchStage] = []
    by_call: dict[str, TorchStage] = {}
    attrs: dict[str, Any] = {}
    inputs: list[str] = []
    for node in split.graph.nodes:
        if node.op == "placeholder":
            inputs.append(node.name)
        elif node.op == "call_module":
            sub = getattr(split, node.target)
            args = []
            for a in node.args:
                if not isinstance(a, fx.Node):
                    raise LoweringError(f"stage {node.target} reads a non-tensor argument {a!r}")
                args.append(a.name)
            dense = int(str(node.target).rsplit("_", 1)[1])  # split_module names them submod_<partition>
            stage = TorchStage(len(stages), sub, args, [], _device_of(sub), part=parts[dense])
            stage.consts = {a: attrs[a] for a in args if a in attrs}
            stages.append(stage)
            by_call[node.name] = stage
            if not any(u.op == "call_function" and u.target is operator.getitem for u in node.users):
                stage.outs.append((node.name, None))
        elif node.op == "call_function" and node.target is operator.getitem:
            source = node.args[0]
            assert isinstance(source, fx.Node)
            by_call[source.name].outs.append((node.name, int(node.args[1])))  # type: ignore[arg-type]
        elif node.op == "get_attr":
            attrs[node.name] = _attribute(split, str(node.target))
        elif node.op == "output":
            split.meta["placement_outputs"] = node.args[0]
        else:
            raise LoweringError(f"cannot pipeline: unexpected node {node.format_node()} between stages")
    result = split.meta.pop("placement_outputs")
    keys = []
    for item in result if isinstance(result, (tuple, list)) else [result]:
        if not isinstance(item, fx.Node):
            raise LoweringError(f"cannot pipeline a graph output that is not a tensor ({item!r})")
        keys.append(item.name)
    return stages, inputs, keys


def _in_stage_order(
    module: fx.GraphModule, assigned: Mapping[fx.Node, int]
) -> tuple[fx.GraphModule, dict[fx.Node, int]]:
    """A copy of ``module``'s graph (sharing its parameters) whose nodes run stage by stage, each
    stage's nodes in their order, with the stages of the copy's nodes.

    ``split_module(keep_original_order=True)`` emits the stages in the order the graph first
    touches them; in the lowered graph a stage can be touched before a stage it reads from (a
    cache's ``Shape`` on the device of its layer, read by the mask of every layer before it),
    and the split then reads a value not made yet. The stages are numbered in topological
    order and no node reads a later stage, so this order is a topological one too.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    ordered = [n for n in module.graph.nodes if n.op in ("placeholder", "get_attr")]
    ordered += sorted((n for n in module.graph.nodes if n in assigned), key=lambda n: assigned[n])
    ordered += [n for n in module.graph.nodes if n.op == "output"]
    for node in ordered:
        env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(module, graph), {env[n]: stage for n, stage in assigned.items()}


def _own_input_moves(staged: fx.GraphModule, assigned: dict[fx.Node, int]) -> None:
    """Give every stage reading a graph input's move (a node of no op that reads placeholders
    only) a copy of its own, placed before that stage's first reader."""
    order = {node: n for n, node in enumerate(staged.graph.nodes)}
    for node in list(staged.graph.nodes):
        if (
            node not in assigned
            or node.meta.get(OP_META) is not None
            or not node.all_input_nodes
            or any(a.op != "placeholder" for a in node.all_input_nodes)
        ):
            continue
        readers: dict[int, list[fx.Node]] = {}
        for user in node.users:
            if user in assigned and assigned[user] != assigned[node]:
                readers.setdefault(assigned[user], []).append(user)
        for stage, users in readers.items():
            with staged.graph.inserting_before(min(users, key=order.__getitem__)):
                mine = staged.graph.node_copy(node, lambda n: n)
            assigned[mine] = stage
            for user in users:
                user.replace_input_with(node, mine)
    staged.recompile()


def traced_stage(stage: TorchStage, *, warmup: int, untraceable: Collection[str]) -> TracedStage:
    """``stage.module`` as a :class:`TracedStage`, never traced when it holds an op of
    ``untraceable`` (the model's nondeterministic ops) or a node the lowering marked
    :data:`~placement.lowering.meta.UNTRACEABLE_META` (an ``If`` or ``Loop``
    whose branch or trip count depends on tensor values: a trace would freeze one)."""
    # the stage's own nodes: a placeholder carries the meta of the op that made the value it
    # stands for (a random op of an earlier stage), which says nothing about this stage's code
    nodes = [n for n in stage.module.graph.nodes if n.op not in ("placeholder", "output")]
    random = sorted({n.meta.get(OP_META) for n in nodes} & set(untraceable))
    reasons = [f"nondeterministic op(s) {', '.join(random)}"] if random else []
    reasons += sorted({n.meta[UNTRACEABLE_META] for n in nodes if UNTRACEABLE_META in n.meta})
    return TracedStage(
        stage.module,
        fixed=[n for n, a in enumerate(stage.args) if a in stage.consts],
        warmup=warmup,
        grad=True,
        untraceable="; ".join(reasons) or None,
    )


def _attribute(module: torch.nn.Module, path: str) -> Any:
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _device_of(module: torch.nn.Module) -> torch.device:
    for node in module.graph.nodes:  # type: ignore[union-attr]
        if node.op == "call_method" and node.target == "to" and len(node.args) > 1:
            return torch.device(node.args[1])
    return torch.device("cpu")
