"""The release of a streamed weight after its last reader: ``self.weight_release(linear_3, index=7)``.

:func:`insert_releases` follows each streamed copy (``self.weight_streamer(w, index=k)``)
through its readers to the last one in the graph order, looking through readers whose
output may share the weight's memory (a ``Transpose``, ``Reshape``, ``Slice``... of the
weight, or an intermediate node of one op), and puts a call of :class:`StreamRelease`
right after it. At run time the release records an event on the compute stream behind
that reader, and the window's region of weight ``k`` is refilled only after it
(:class:`~.streaming.WeightStreamer`).

Example:
    >>> import placement as pl
    >>> from placement.models import gpt
    >>> model = pl.from_torch(*gpt.build("tiny"))
    >>> _ = pl.stream_parameters(model, ["blocks.0.mlp"])
    >>> _ = pl.inject_cross_device_copies(model)
    >>> module = pl.to_torch(model, device_map="cpu")
    >>> code = module.code
    >>> code.count("self.weight_streamer(") == code.count("self.weight_release(") > 0
    True
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from placement.lowering.meta import DEVICE_META, OP_META, UNTRACEABLE_META

__all__ = ["StreamRelease", "RELEASE_NAME", "insert_releases", "insert_readers", "ALIASING_OPS"]

#: The attribute of a lowered module holding the release calls' module.
RELEASE_NAME = "weight_release"
#: ONNX op types whose torch lowering may return a view of its input (the weight's memory).
ALIASING_OPS = frozenset(
    {"Identity", "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Split", "Expand"}
    | {"Cast"}
)

#: Tensor methods that may return a view of (or the very) tensor they are called on.
VIEW_METHODS = frozenset(
    {"to", "t", "transpose", "permute", "view", "reshape", "expand", "unsqueeze", "squeeze", "flatten"}
    | {"contiguous", "narrow", "view_as", "expand_as", "split", "chunk", "unbind", "type", "detach"}
    | {"float", "half", "bfloat16", "__getitem__", "as_strided", "unflatten", "movedim", "mT"}
)


class StreamRelease(torch.nn.Module):
    """Calls :meth:`WeightStreamer.release` of its streamer; impure, so dead-code elimination keeps it."""

    _is_impure = True

    def __init__(self, streamer: torch.nn.Module) -> None:
        super().__init__()
        self._streamer = [streamer]  # not a submodule: the streamer is registered once, on the root

    def forward(self, after: Any, index: int) -> None:
        """Release weight ``index``; ``after`` (the last reader's output) orders the call."""
        self._streamer[0].release(index)


def _may_alias(node: fx.Node, op_types: Mapping[str, str]) -> bool:
    """Whether ``node``'s output may share memory with its inputs."""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target is operator.getitem or (node.op == "call_method" and node.target in VIEW_METHODS):
        return True
    op = node.meta.get(OP_META)
    if op is None or op_types.get(op) in ALIASING_OPS:
        return True
    return any(user.meta.get(OP_META) == op for user in node.users)  # inside one op's lowering


def _aliases(copy: fx.Node, op_types: Mapping[str, str]) -> tuple[set[fx.Node], set[fx.Node]]:
    """The nodes that may hold ``copy``'s memory (it included), and every node reading one of them."""
    aliases, readers, stack = {copy}, set(), [copy]
    while stack:
        for user in stack.pop().users:
            if user.op == "output" or user in readers:
                continue
            readers.add(user)
            if _may_alias(user, op_types):
                aliases.add(user)
                stack.append(user)
    return aliases, readers


def insert_readers(module: fx.GraphModule, streamer_path: str, op_types: Mapping[str, str]) -> int:
    """Give each streamed copy the other inputs of the ops reading it: ``self.weight_streamer(w,
    index=k, readers=(x,))``, so that with autograd on the streamer knows whether autograd will
    save the weight (see :meth:`~.streaming.WeightStreamer.forward`).

    A reader's input computed after the copy is not known there: that copy gets no
    ``readers`` (the streamer then assumes the weight is saved). Another streamed copy among
    the inputs is named by its source parameter (whose ``requires_grad`` is the copy's).
    Returns how many copies got their readers."""
    graph = module.graph
    order = {node: k for k, node in enumerate(graph.nodes)}
    copies = [n for n in graph.nodes if n.op == "call_module" and n.target == streamer_path]
    sources = {copy: copy.args[0] for copy in copies}
    given = 0
    for copy in copies:
        aliases, readers = _aliases(copy, op_types)
        inputs: dict[fx.Node, None] = {}
        for reader in readers:
            for node in reader.all_input_nodes:
                if node not in aliases and node not in readers:
                    inputs[sources.get(node, node)] = None
        known = True
        for node in inputs:
            if not isinstance(node, fx.Node):
                continue
            if node.op == "get_attr" and order[node] > order[copy]:
                copy.prepend(node)  # a parameter: read it earlier
            elif order[node] > order[copy]:
                known = False
        if known:
            copy.kwargs = {**copy.kwargs, "readers": tuple(inputs)}
            given += 1
    graph.lint()
    module.recompile()
    return given


def _last_reader(copy: fx.Node, order: Mapping[fx.Node, int], op_types: Mapping[str, str]) -> fx.Node:
    """The last node in graph order that reads ``copy`` or a value that may alias it."""
    last, stack, seen = copy, [copy], {copy}
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen or user.op == "output":
                continue
            seen.add(user)
            if order[user] > order[last]:
                last = user
            if _may_alias(user, op_types):
                stack.append(user)
    return last


def insert_releases(
    module: fx.GraphModule, streamer_path: str, op_types: Mapping[str, str]
) -> StreamRelease | None:
    """After the last reader of each streamed copy, a call releasing it (see the module doc).

    ``op_types``: ONNX op name -> op type. Returns the release module (registered on
    ``module``), or None when nothing streams. A copy that is a graph output, or whose
    reader feeds it to the output as a view, is never released (it falls out of the window).
    """
    streamer = module.get_submodule(streamer_path) if streamer_path else None
    if streamer is None:
        return None
    release = StreamRelease(streamer)
    module.add_submodule(RELEASE_NAME, release)
    graph = module.graph
    order = {node: k for k, node in enumerate(graph.nodes)}
    copies = [n for n in graph.nodes if n.op == "call_module" and n.target == streamer_path]
    lasts = [
        (copy, _last_reader(copy, order, op_types))
        for copy in copies
        if not any(user.op == "output" for user in copy.users)
    ]
    for copy, last in lasts:
        with graph.inserting_after(last):
            kwargs = {"index": copy.kwargs["index"]}
            name = f"release_{copy.name}"
            node = graph.create_node("call_module", RELEASE_NAME, (last,), kwargs, name=name)
        for key in (DEVICE_META, OP_META):
            if key in last.meta:
                node.meta[key] = last.meta[key]
        node.meta[UNTRACEABLE_META] = "releases a streamed weight's window region every run"
    graph.lint()
    module.recompile()
    return release
