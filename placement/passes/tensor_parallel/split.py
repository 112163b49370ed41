"""The driver of :func:`split_tensor_parallel`: walk, rewrite, prune, commit.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> result = pl.split_tensor_parallel(model, devices=[0, 1])
    >>> result.all_reduces, [str(d) for d in model.devices]
    (1, ['cuda:0', 'cuda:1'])
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import onnx_ir as ir

from placement.analysis.dependence import independent_values
from placement.errors import DeviceError, InputError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import Model
from placement.graph.nodes import DEVICE_KEY, collective_tag, is_copy_node, node_device
from placement.passes.copies import inject_cross_device_copies
from placement.passes.tensor_parallel.rewriter import Rewriter
from placement.passes.tensor_parallel.rules_attention import ATTENTION_RULES
from placement.passes.tensor_parallel.rules_linear import LINEAR_RULES, Policy
from placement.passes.tensor_parallel.rules_shape import SHAPE_RULES

__all__ = ["TensorParallelResult", "split_tensor_parallel"]

log = logging.getLogger(__name__)


@dataclass
class TensorParallelResult:
    """What :func:`split_tensor_parallel` did.

    Attributes:
        devices: the group, in device order.
        split: the original ops split through (column, row, vocab or channel parallel).
        all_reduces: all-reduces made (each is one ``Sum`` per device).
        all_gathers: all-gathers made (each is one ``Concat`` per device).
        shards: sliced parameters made (one initializer per device and slice).
        groups: one group per pipeline stage (a single group: ``[devices]``).
    """

    devices: list[Device]
    groups: list[list[Device]] = field(default_factory=list)
    split: list[str] = field(default_factory=list)
    all_reduces: int = 0
    all_gathers: int = 0
    shards: int = 0

    @property
    def modified(self) -> bool:
        return bool(self.split)


def split_tensor_parallel(
    model: Model,
    devices: Sequence[DeviceLike] | Sequence[Sequence[DeviceLike]] = (0, 1),
    *,
    scopes: Sequence[str] | None = None,
) -> TensorParallelResult:
    """Split ops *through* their weights over a group of devices (tensor parallelism), in place.

    Every op that depends on a graph input runs on each device of ``devices`` (SPMD). Linears
    whose input is whole become column parallel (output columns in whole heads), the next ones
    row parallel (a partial sum per device, then an all-reduce, then the bias); attention
    splits by heads (fused or separate QKV, grouped-query attention with KV heads split or
    replicated); vocabulary-sized embeddings and a tied LM head by rows; convolutions by output
    then input channels, grouped and depthwise ones by whole groups. Collectives are standard
    ONNX over copies: an all-reduce is, on each device, a ``Sum`` of the copied partials in
    device order; an all-gather a ``Concat``. Copies
    are injected (:func:`placement.inject_cross_device_copies`). Graph outputs are whole, on the
    first device.

    Tensor inside pipeline (2D): ``devices`` may be a list of groups, one per pipeline stage
    (``[[0, 1], [2, 3]]``, all of one size). The model is then an already pipelined placement:
    each op runs on a device of exactly one group (its stage: ops on device 2 split over
    ``[2, 3]``), copies already made are dropped and made again. Each stage's ops are split
    over its group with the collectives inside the group. Across a stage boundary, device
    ``k`` of the next group reads from device ``k`` of the previous one only (a replicated
    activation is sent once per receiving device, each from one source; a partial is reduced
    in its own stage first); graph outputs are whole on the first device of the last group
    that makes them.

    Args:
        model: a model whose ops all run on one device, without copies (changed in place);
            with groups, a pipelined placement whose every device lies in one group.
        devices: the group, at least two distinct devices (``[0, 1]``, ``["cuda:0", "cuda:1"]``),
            or a list of such groups (one per pipeline stage, disjoint, one size).
        scopes: module scopes whose weighted ops may be split (``["blocks.0.mlp"]``; a scope
            covers its submodules); None: every op. Ops outside still run on every device.

    Returns:
        A :class:`TensorParallelResult`.

    Raises:
        InputError: the group is malformed, the model is already placed over several devices
            or has copies, or an op cannot be split (e.g. heads that the degree does not
            divide, a computed head count); the model is unchanged.

    Example:
        >>> import numpy as np, placement as pl
        >>> from placement.models import gpt
        >>> net, (idx,) = gpt.build("tiny")
        >>> model = pl.from_torch(net, (idx,))
        >>> result = pl.split_tensor_parallel(model, devices=[0, 1])
        >>> result.all_reduces  # embedding + 2 per block
        5
        >>> out = pl.run(model, {"idx": idx.numpy()})[0]
        >>> bool(np.allclose(out, net(idx).detach().numpy(), rtol=1e-5, atol=1e-5))
        True
    """
    groups = _groups(devices)
    group = groups[0]
    work = model.ir_model.clone()
    if len(groups) == 1 and not _nested(devices):
        _check_model(model)
        stage_of: dict[Device, list[Device]] = {}
    else:
        _strip_copies(work.graph)
        stage_of = _stage_groups(work.graph, groups)
    result = _rewrite(work, group, Policy(list(scopes) if scopes is not None else None), stage_of)
    result.groups = groups
    model.ir_model = work
    model._op_index, model._value_index = {}, {}
    inject_cross_device_copies(model)
    log.info(
        "split_tensor_parallel: %d ops split over %s, %d all-reduces, %d all-gathers",
        len(result.split),
        [str(d) for d in group],
        result.all_reduces,
        result.all_gathers,
    )
    return result


def _nested(devices: object) -> bool:
    return (
        isinstance(devices, Sequence)
        and not isinstance(devices, str)
        and any(isinstance(g, Sequence) and not isinstance(g, str) for g in devices)
    )


def _groups(devices: Sequence[DeviceLike] | Sequence[Sequence[DeviceLike]]) -> list[list[Device]]:
    """One group, or one group per pipeline stage (disjoint, all of one size)."""
    if not _nested(devices):
        return [_group(devices)]  # type: ignore[arg-type]
    groups = [_group(g) for g in devices]  # type: ignore[arg-type]
    flat = [d for g in groups for d in g]
    if len(set(flat)) != len(flat):
        raise InputError(f"device groups must be disjoint, got {[[str(d) for d in g] for g in groups]}")
    if len({len(g) for g in groups}) != 1:
        raise InputError(f"device groups must have one size, got {[[str(d) for d in g] for g in groups]}")
    return groups


def _strip_copies(graph: ir.Graph) -> None:
    """Drop the copies of a placed graph (made again after the split); readers read the source."""
    for node in list(graph):
        if collective_tag(node) is not None:
            raise InputError(f"op {node.name!r} is a collective: the model is split already")
        if not is_copy_node(node):
            continue
        src, out = node.inputs[0], node.outputs[0]
        for user, index in list(out.uses()):
            user.replace_input_with(index, src)
        for i, value in enumerate(graph.outputs):
            if value is out:
                if src.is_graph_input() or src in graph.outputs:
                    raise InputError(f"graph output {out.name!r} is a copy of an input or another output")
                name = out.name
                out.name = None
                src.name = name
                graph.outputs[i] = src
        graph.remove(node, safe=False)
        node.replace_input_with(0, None)


def _stage_groups(graph: ir.Graph, groups: list[list[Device]]) -> dict[Device, list[Device]]:
    """The group of each device the ops run on; an op whose device lies in no group is an error."""
    home = {d: g for g in groups for d in g}
    for node in graph:
        device = node_device(node)
        if device not in home:
            raise InputError(
                f"op {node.name!r} runs on {device}, which lies in none of the groups "
                f"{[[str(d) for d in g] for g in groups]}"
            )
    return home


def _group(devices: Sequence[DeviceLike]) -> list[Device]:
    if isinstance(devices, (str, int)) or not isinstance(devices, Sequence):
        raise InputError(f"devices must be a list of at least two devices, got {devices!r}")
    try:
        group = [Device.parse(d) for d in devices]
    except DeviceError as err:
        raise InputError(f"devices {list(devices)!r}: {err}") from err
    if len(group) < 2 or len(set(group)) != len(group):
        raise InputError(f"devices must be at least two distinct devices, got {[str(d) for d in group]}")
    return group


def _check_model(model: Model) -> None:
    for node in model.graph:
        if is_copy_node(node) or collective_tag(node) is not None:
            raise InputError(
                f"op {node.name!r} is a copy or collective: split a model before placing it "
                "(split_tensor_parallel takes a model on one device)"
            )
    if len(model.devices) > 1:
        raise InputError(
            f"the model runs on {[str(d) for d in model.devices]}: "
            "split_tensor_parallel takes a model on one device"
        )


def _rewrite(
    work: ir.Model, group: list[Device], policy: Policy, stage_of: dict[Device, list[Device]]
) -> TensorParallelResult:
    graph = work.graph
    static = independent_values(graph)
    rw = Rewriter(graph, group, static)
    originals = list(graph)
    for node in originals:
        if node in rw.done:
            continue
        if stage_of:
            rw.use_group(stage_of[node_device(node)])
        if all(out in static for out in node.outputs) and node.outputs:
            node.metadata_props[DEVICE_KEY] = str(rw.devices[0])
            rw.nodes.append(node)
            continue
        if not _apply_rule(rw, node, policy):
            _replicate(rw, node)
    outputs = []
    for value in graph.outputs:
        if rw.is_shared(value):
            outputs.append(value)
            continue
        whole = rw.replicated(value, 0)
        name = value.name
        value.name = None
        whole.name = name
        outputs.append(whole)
    _commit(graph, originals, rw, outputs)
    result = TensorParallelResult(devices=group, split=rw.split)
    kinds: dict[
        tuple[tuple[str, ...], int], str
    ] = {}  # one per collective, even where a device needs no copy of its result
    for node in graph:
        tag = collective_tag(node)
        if tag is not None:
            kinds[(tuple(tag["group"]), tag["id"])] = tag["kind"]
    result.all_reduces = sum(1 for kind in kinds.values() if kind == "all_reduce")
    result.all_gathers = len(kinds) - result.all_reduces
    result.shards = sum(
        1 for init in rw.new_initializers if init.name in graph.initializers and ".tp" in init.name
    )
    if not result.split:
        raise InputError(
            "split_tensor_parallel: no op could be split (no linear, convolution or embedding "
            f"{'in scopes ' + repr(policy.scopes) if policy.scopes is not None else 'found'})"
        )
    return result


def _apply_rule(rw: Rewriter, node: ir.Node, policy: Policy) -> bool:
    attention = ATTENTION_RULES.get((node.domain, node.op_type))
    if attention is not None:
        return attention(rw, node, policy)
    rule = LINEAR_RULES.get(node.op_type)
    if rule is not None and node.domain == "" and rule(rw, node, policy):
        return True
    shape_rule = SHAPE_RULES.get(node.op_type)
    return shape_rule is not None and node.domain == "" and shape_rule(rw, node)


def _replicate(rw: Rewriter, node: ir.Node) -> None:
    """The default: every device runs the op on whole inputs."""
    lays = [rw.layout(None)] * len(node.outputs)
    clones = [rw.clone(node, [rw.replicated(v, d) for v in node.inputs], d, lays) for d in range(rw.t)]
    rw.set_outputs(node, lays, clones)


def _commit(graph: ir.Graph, originals: list[ir.Node], rw: Rewriter, outputs: list[ir.Value]) -> None:
    kept = {id(n) for n in rw.nodes}
    graph.remove(originals, safe=False)
    for node in originals:
        if id(node) not in kept:
            for i in range(len(node.inputs)):
                node.replace_input_with(i, None)
    graph.outputs.clear()
    graph.outputs.extend(outputs)
    for init in rw.new_initializers:
        graph.register_initializer(init)
    graph.extend(rw.nodes)
    _prune(graph)


def _prune(graph: ir.Graph) -> None:
    """Drop ops nothing reads (replicas no device needs) and parameters no op reads."""
    outputs = {id(v) for v in graph.outputs}
    for node in reversed(list(graph)):
        if all(not out.uses() and id(out) not in outputs for out in node.outputs):
            graph.remove(node, safe=False)
            for i in range(len(node.inputs)):
                node.replace_input_with(i, None)
    inputs = {id(v) for v in graph.inputs}
    for name, init in list(graph.initializers.items()):
        if not init.uses() and id(init) not in outputs and id(init) not in inputs:
            del graph.initializers[name]
