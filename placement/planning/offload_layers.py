"""The layers an offload plan decides about, cut from the graph order, with the bytes they need.

A *layer* is a maximal run of ops of one repeated block (``h.3``, ``model.layers.7``) or of
one top-level module (``lm_head``). The module scope comes from the exporter's metadata,
except names that are metadata accidents rather than modules (a leading ``_``, e.g.
``_empty_nn_module_stack_from_metadata_hook``): those ops join the layer next to them. Ops
without parameters join the layer before them.

Weights belong to layers by **the model's own parameter names**: ``blocks.3.mlp.c_fc.weight``
belongs to the layer ``blocks.3``, wherever it is first read. A weight read by several
layers (a tied embedding: ``lm_head.weight`` read by the embedding lookup and by the LM
head) is *shared*: one parameter wherever it is used, kept on the GPU while any layer on
the GPU reads it, never streamed (a streamed copy of it would occupy the window from its
first reader to its last).

Activation bytes are taken at the batch the plan is made for: symbolic dimensions
(``batch``) are bound from the sample inputs, else to ``batch``.

Example:
    >>> import placement as pl
    >>> from placement.models import gpt
    >>> from placement.planning.graph_info import GraphInfo
    >>> model = pl.from_torch(*gpt.build("tiny"))
    >>> info = GraphInfo(model)
    >>> layers = layers_of(model, info, [0] * len(info), [0] * len(info))
    >>> [layer.name for layer in layers]
    ['wte', 'wpe', 'blocks.0', 'blocks.1', 'ln_f', 'lm_head']
    >>> layers[-1].params, sorted(layers[0].shared)
    (['lm_head.weight'], ['lm_head.weight'])
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from placement.graph.model import Model
from placement.graph.nodes import node_scope
from placement.passes.streaming import is_streamable
from placement.planning.graph_info import GraphInfo

__all__ = ["ALIGN", "aligned", "Layer", "layers_of", "layer_key"]

#: Bytes each streamed weight's region of the device window is aligned to (the runtime's
#: :class:`~placement.runtime.torch.streaming.WeightStreamer` lays the window out so).
ALIGN = 512


def aligned(size: int) -> int:
    """``size`` rounded up to :data:`ALIGN` bytes: a streamed weight's region of the window.

    >>> aligned(1), aligned(512), aligned(513)
    (512, 512, 1024)
    """
    return -(-size // ALIGN) * ALIGN


@dataclass
class Layer:
    """A run of ops in graph order that is offloaded as one.

    Attributes:
        name: the block's module path (``"h.3"``), or the first op's name.
        start, end: its ops are positions ``start .. end-1`` of the graph order.
        params: the weights it owns (by their names), in name order.
        param_bytes: bytes of ``params``.
        gpu_ns, host_ns: predicted compute time on the GPU and on the host.
        in_bytes, out_bytes: activation bytes it reads from earlier layers and that later
            layers read from it.
        weights: every weight it reads (owned or not) -> bytes.
        shared: the weights it reads that other layers read too (never streamed).
        state_bytes: the KV caches its ops hold at the planned batch and length
            (``plan_offload(kv_cache=)``): on the GPU where its ops run there, else on the host.
    """

    name: str
    start: int
    end: int
    params: list[str]
    param_bytes: int
    gpu_ns: int
    host_ns: int
    in_bytes: int
    out_bytes: int
    weights: dict[str, int] = field(default_factory=dict)
    shared: set[str] = field(default_factory=set)
    state_bytes: int = 0

    @property
    def streamable(self) -> dict[str, int]:
        """The weights it would stream: those it reads that no other layer reads."""
        return {name: size for name, size in self.weights.items() if name not in self.shared}


_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def layer_key(scope: str | None) -> str:
    """``h.3.attn.c_attn`` -> ``h.3``; ``model.layers.3.mlp`` -> ``model.layers.3``;
    ``lm_head`` -> itself; a metadata accident (``_empty_nn_module_stack...``) -> ``""``.

    Example:
        >>> layer_key("h.3.attn.c_attn"), layer_key("lm_head"), layer_key("_empty_nn_module_stack_hook")
        ('h.3', 'lm_head', '')
    """
    if not scope or scope.startswith("_"):
        return ""
    match = _BLOCK.match(scope)
    if match:
        return match.group(1)
    return scope.split(".")[0]


def _runs(info: GraphInfo, keys: Sequence[str]) -> list[list[int]]:
    """[start, end] of each run of ops of one key; ops without a key or parameters join the run before."""
    runs: list[list[int]] = []
    for pos in range(len(info)):
        same = bool(keys[pos]) and runs and keys[pos] == keys[runs[-1][0]]
        if runs and (same or not info.op_params[pos]):
            runs[-1][1] = pos + 1
        else:
            runs.append([pos, pos + 1])
    if len(runs) > 1 and not any(info.op_params[p] for p in range(*runs[0])):
        runs[1][0] = runs[0][0]  # a leading run without weights joins the next one
        runs.pop(0)
    return runs


def _name(keys: Sequence[str], info: GraphInfo, start: int, end: int) -> str:
    """A run's name: the key of its first op that has one (with weights first), else its first op's name."""
    with_weights = [keys[p] for p in range(start, end) if keys[p] and info.op_params[p]]
    named = with_weights or [keys[p] for p in range(start, end) if keys[p]]
    return named[0] if named else info.names[start]


def layers_of(model: Model, info: GraphInfo, gpu_ns: Sequence[int], host_ns: Sequence[int]) -> list[Layer]:
    """Cut the graph order into layers (see the module docstring)."""
    keys = [layer_key(node_scope(node)) for node in info.nodes]
    runs = _runs(info, keys)
    names = [_name(keys, info, start, end) for start, end in runs]
    by_name = {name: k for k, name in reversed(list(enumerate(names)))}
    readers: dict[int, set[int]] = {}
    for k, (start, end) in enumerate(runs):
        for pos in range(start, end):
            for p in info.op_params[pos]:
                readers.setdefault(p, set()).add(k)
    owner: dict[int, int] = {}
    for p, ks in readers.items():
        module = layer_key(info.param_names[p].rpartition(".")[0])
        owner[p] = by_name.get(module, min(ks)) if module else min(ks)
    size = dict(zip(info.param_names, info.param_bytes))
    layers: list[Layer] = []
    for k, (start, end) in enumerate(runs):
        owned = sorted(info.param_names[p] for p, o in owner.items() if o == k)
        owned = [name for name in owned if _is_weight(model, name)]
        weights = {
            info.param_names[p]: info.param_bytes[p]
            for pos in range(start, end)
            for p in info.op_params[pos]
            if _is_weight(model, info.param_names[p])
        }
        shared = {info.param_names[p] for p, ks in readers.items() if k in ks and len(ks) > 1}
        layers.append(
            Layer(
                name=names[k],
                start=start,
                end=end,
                params=owned,
                param_bytes=sum(size[n] for n in owned),
                gpu_ns=int(sum(gpu_ns[start:end])),
                host_ns=int(sum(host_ns[start:end])),
                in_bytes=info.segment_in_bytes(start, end),
                out_bytes=0,
                weights=weights,
                shared=shared & set(weights),
                state_bytes=info.segment_state_bytes(start, end),
            )
        )
    for k, layer in enumerate(layers):
        if k + 1 < len(layers):
            layer.out_bytes = layers[k + 1].in_bytes
    seen: dict[str, int] = {}
    for layer in layers:  # unique names (a block read twice, root ops between blocks)
        count = seen.get(layer.name, 0)
        seen[layer.name] = count + 1
        if count:
            layer.name = f"{layer.name}#{count}"
    return layers


def _is_weight(model: Model, name: str) -> bool:
    """A weight the plan counts and may stream: floating point or quantized integers (int8...)."""
    return is_streamable(model.graph.initializers[name])
