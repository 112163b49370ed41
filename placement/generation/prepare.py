"""A placed causal LM made ready for a decode loop (on a copy; the caller's model is unchanged).

:func:`decoder_model` checks that the graph has what a decode loop feeds and reads
(``input_ids``, ``logits`` and at least one KV cache layer, see
:mod:`placement.graph.kv_names`), then, on a copy:

* the ``logits`` output becomes the last position's logits only (a ``Slice`` on the
  device that computes them), so a step hands back ``(batch, 1, vocab)``, not the whole
  sequence's;
* cross-device copies are injected (each layer's cache settles on one device: the past
  is fed where it is read and the present stays where it is made).

Example:
    >>> import torch
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> import placement as pl
    >>> net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=40))
    >>> spec = decoder_model(pl.from_causal_lm(net, torch.tensor([[4, 5]])))
    >>> spec.model.ops[-1].op_type, spec.feeds
    ('Slice', ('input_ids', 'attention_mask', 'position_ids'))
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Union

import numpy as np
import onnx_ir as ir

from placement.errors import InputError
from placement.graph.causal_lm import KVLayer, kv_layers
from placement.graph.genai_config import (
    bind_dims,
    cache_dims_from_config,
    check_cache_dims,
    read_genai_config,
)
from placement.graph.model import Model
from placement.graph.nodes import node_device, set_node_device
from placement.passes.copies import inject_cross_device_copies
from placement.passes.tensor_parallel.kv_shards import local_kv_caches

__all__ = ["CacheDims", "DecoderSpec", "FEEDS", "decoder_model"]

#: Sizes of symbolic cache dimensions: by symbol, or a ``genai_config.json`` path (or its folder).
CacheDims = Union[Mapping[str, int], str, os.PathLike, None]

#: Graph inputs a decode loop feeds besides the cache (``input_ids`` is required).
FEEDS = ("input_ids", "attention_mask", "position_ids")


@dataclass(frozen=True)
class DecoderSpec:
    """A decoder-ready copy of a model: the copy, its cache layers and the inputs it takes."""

    model: Model
    layers: tuple[KVLayer, ...]
    feeds: tuple[str, ...]


def decoder_model(model: Model, *, cache_dims: CacheDims = None) -> DecoderSpec:
    """A copy of ``model`` ready for decoding (see the module docstring).

    ``cache_dims``: sizes of cache dimensions the graph leaves symbolic, by symbol
    (``{"kv_cache_dim": 16}``), or the path of a ``genai_config.json`` (or its folder) to read
    them from (:mod:`placement.graph.genai_config`; :func:`placement.load` reads the one beside
    a file by itself). They are bound on the copy.

    Raises:
        InputError: the graph lacks ``input_ids``, ``logits`` or a KV cache, has an input a
            decode loop cannot feed, or its cache's head count / head size is not static.
    """
    if not isinstance(model, Model):
        raise InputError(f"generation needs a placement.Model, got {type(model).__name__}")
    copy = model.copy()
    if cache_dims is not None:
        dims = (
            cache_dims
            if isinstance(cache_dims, Mapping)
            else cache_dims_from_config(copy, read_genai_config(cache_dims))
        )
        check_cache_dims(copy, dims)
        bind_dims(copy, dims)
    layers = kv_layers(copy)
    inputs = [v.name for v in copy.graph.inputs if v.name not in copy.graph.initializers]
    outputs = [v.name for v in copy.graph.outputs]
    if "input_ids" not in inputs or "logits" not in outputs:
        raise InputError(f"a causal LM graph needs an 'input_ids' input and a 'logits' output; got {inputs}")
    if not layers:
        raise InputError(
            "the graph has no KV cache (past_key_values.{i}.key/value inputs, present.{i}.key/value "
            "outputs): export it with pl.from_causal_lm"
        )
    cache = {name for layer in layers for name in (layer.past_key, layer.past_value)}
    unknown = [name for name in inputs if name not in cache and name not in FEEDS]
    if unknown:
        raise InputError(f"graph inputs {unknown} are neither the cache nor one of {FEEDS}")
    for layer in layers:
        if layer.kv_heads is None or layer.head_dim is None:
            shape = copy.value(layer.past_key).shape
            raise InputError(
                f"cache input {layer.past_key!r} {shape} needs a static head count and head size: give "
                "their sizes by name (cache_dims={'kv_cache_dim': 64}) or the genai_config.json that "
                "onnxruntime-genai wrote beside the file (cache_dims='folder/genai_config.json')"
            )
    layers = local_kv_caches(copy, layers)
    _last_position_logits(copy)
    inject_cross_device_copies(copy)
    return DecoderSpec(copy, tuple(layers), tuple(name for name in FEEDS if name in inputs))


def _last_position_logits(model: Model) -> None:
    """Make the ``logits`` output the last position's: ``Slice(logits, -1, max, axis=1)``."""
    graph = model.graph
    slot = [v.name for v in graph.outputs].index("logits")
    logits = graph.outputs[slot]
    producer = logits.producer()
    if producer is None:
        raise InputError("the 'logits' output is not computed by an op")
    bounds = []
    for name, number in (("starts", -1), ("ends", np.iinfo(np.int64).max), ("axes", 1)):
        value = ir.Value(name=f"logits_last_{name}", const_value=ir.tensor(np.array([number], np.int64)))
        value.shape, value.type = ir.Shape([1]), ir.TensorType(ir.DataType.INT64)
        graph.register_initializer(value)
        bounds.append(value)
    node = ir.Node("", "Slice", [logits, *bounds], name="logits_last_position", num_outputs=1)
    set_node_device(node, node_device(producer))
    graph.insert_after(producer, node)
    logits.name = "logits_all_positions"
    out = node.outputs[0]
    out.name, out.dtype = "logits", logits.dtype
    dims = list(logits.shape) if logits.shape is not None else None
    if dims is not None and len(dims) == 3:
        out.shape = ir.Shape([dims[0], 1, dims[2]])
    graph.outputs[slot] = out
