"""Export a causal language model with its KV cache as named graph values.

:func:`from_causal_lm` exports a Hugging Face causal LM (``...ForCausalLM``) so that one
graph serves both the prompt (prefill) and each decode step, in the convention ONNX
Runtime's ecosystem uses (onnxruntime-genai, optimum):

* inputs ``input_ids`` ``(batch, sequence)``, ``attention_mask`` ``(batch, total_sequence)``
  (past and new tokens; 0 marks left padding), ``position_ids`` ``(batch, sequence)``, and
  per layer ``past_key_values.{i}.key`` / ``past_key_values.{i}.value``
  ``(batch, kv_heads, past_sequence, head_dim)``;
* outputs ``logits`` ``(batch, sequence, vocab)`` and per layer ``present.{i}.key`` /
  ``present.{i}.value`` ``(batch, kv_heads, total_sequence, head_dim)``.

Batch, sequence and past length are dynamic; a past of length 0 is the prefill.
Whether the installed ``transformers`` takes the cache as ``cache=`` or
``past_key_values=`` is read from the model's ``forward`` signature (:func:`cache_keyword`).
:func:`kv_layers` finds the cache values of any graph in this convention (files built by
onnxruntime-genai or optimum included).

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> net = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
    >>> model = from_causal_lm(net, torch.tensor([[1, 2, 3]]))
    >>> [layer.past_key for layer in kv_layers(model)]
    ['past_key_values.0.key', 'past_key_values.1.key']
    >>> model.graph.outputs[0].name
    'logits'
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from placement.errors import ExportError, InputError
from placement.graph.device import Device, DeviceLike
from placement.graph.kv_names import PAST, is_cache_input, is_cache_output, past_name, present_name
from placement.graph.model import Model

__all__ = [
    "CACHE_DIMS",
    "KVLayer",
    "cache_keyword",
    "from_causal_lm",
    "is_cache_input",
    "is_cache_output",
    "kv_layers",
    "past_name",
    "present_name",
]

log = logging.getLogger(__name__)

#: Symbolic dimension names of the exported graph's inputs and outputs.
CACHE_DIMS = ("batch", "sequence", "past_sequence", "total_sequence")


@dataclass(frozen=True)
class KVLayer:
    """The cache values of one attention layer: graph input and output names, and shape.

    ``kv_heads`` and ``head_dim`` are None where the graph leaves them symbolic.
    """

    index: int
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    kv_heads: int | None
    head_dim: int | None
    dtype: Any

    def bytes_for(self, batch: int, length: int) -> int:
        """Bytes of this layer's key and value caches at ``batch`` sequences of ``length`` tokens.

        Example:
            >>> KVLayer(0, "a", "b", "c", "d", 2, 8, "float32").bytes_for(1, 4)
            512
        """
        import numpy as np

        heads, dim = self.kv_heads or 0, self.head_dim or 0
        return 2 * batch * heads * length * dim * np.dtype(self.dtype).itemsize


def kv_layers(model: Model | Any) -> list[KVLayer]:
    """The KV cache layers of ``model``'s graph (a Model or an ``onnx_ir`` model), by layer
    index (empty: the graph has no cache).

    A layer counts when all four names exist (``past_key_values.{i}.key/value`` inputs,
    ``present.{i}.key/value`` outputs).
    """
    inputs = {v.name: v for v in model.graph.inputs}
    outputs = {v.name for v in model.graph.outputs}
    found: list[KVLayer] = []
    indices = sorted({int(m.group(1)) for name in inputs if (m := PAST.match(name or ""))})
    for i in indices:
        names = (past_name(i, "key"), past_name(i, "value"), present_name(i, "key"), present_name(i, "value"))
        if names[0] not in inputs or names[1] not in inputs or not {names[2], names[3]} <= outputs:
            continue
        value = inputs[names[0]]
        dims = list(value.shape) if value.shape is not None else []
        heads = dims[1] if len(dims) == 4 and isinstance(dims[1], int) else None
        dim = dims[3] if len(dims) == 4 and isinstance(dims[3], int) else None
        dtype = value.dtype.numpy() if value.dtype is not None else "float32"
        found.append(KVLayer(i, *names, heads, dim, dtype))
    return found


def cache_keyword(module: Any) -> str:
    """The keyword ``module.forward`` takes its KV cache by: ``"cache"`` or ``"past_key_values"``.

    Read from the signature (newer ``transformers`` releases rename ``past_key_values=`` to
    ``cache=``); the newer name wins where both are accepted.

    Raises:
        ExportError: ``forward`` takes neither.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def forward(self, input_ids, past_key_values=None):
        ...         return input_ids
        >>> cache_keyword(Net())
        'past_key_values'
    """
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError) as err:
        raise ExportError(f"cannot read the forward signature of {type(module).__name__}: {err}") from err
    for keyword in ("cache", "past_key_values"):
        if keyword in params:
            return keyword
    raise ExportError(
        f"{type(module).__name__}.forward takes no KV cache (neither cache= nor past_key_values=); "
        "from_causal_lm needs a Hugging Face causal language model"
    )


def _layer_count(module: Any) -> int:
    config = getattr(module, "config", None)
    text = getattr(config, "get_text_config", None)
    config = text() if callable(text) else config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not isinstance(layers, int) or layers < 1:
        raise ExportError(f"{type(module).__name__} has no config.num_hidden_layers; is it a causal LM?")
    return layers


def _cache_shape(module: Any) -> tuple[int, int]:
    """(kv heads, head dim) of the model's attention layers, from its config."""
    config = module.config
    text = getattr(config, "get_text_config", None)
    config = text() if callable(text) else config
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return int(kv_heads), int(head_dim)


def _wrapper(module: Any, layers: int, keyword: str) -> Any:
    import torch
    from transformers import DynamicCache

    try:
        DynamicCache(config=module.config)
        cache_kwargs: dict[str, Any] = {"config": module.config}
    except TypeError:  # a release whose DynamicCache takes no config
        cache_kwargs = {}

    class CausalLMWithCache(torch.nn.Module):
        """``module`` with its cache as flat tensors in and out (keys and values in layer order)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = module

        def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, past: list[Any]) -> Any:
            cache = DynamicCache(**cache_kwargs)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **{keyword: cache},
            )
            present = out.past_key_values
            flat: list[Any] = []
            if hasattr(present, "layers"):
                for layer in present.layers:
                    flat += [layer.keys, layer.values]
            else:  # an older cache layout: per-layer lists
                for i in range(layers):
                    flat += [present.key_cache[i], present.value_cache[i]]
            return (out.logits, *flat)

    return CausalLMWithCache()


def from_causal_lm(
    module: Any,
    input_ids: Any,
    *,
    attention_mask: Any = None,
    past_length: int = 3,
    device: DeviceLike = 0,
) -> Model:
    """Export a Hugging Face causal LM with its KV cache as graph inputs and outputs.

    The graph's inputs are ``input_ids``, ``attention_mask`` (past and new tokens),
    ``position_ids`` and ``past_key_values.{i}.key/value``; its outputs ``logits`` and
    ``present.{i}.key/value`` (see the module docstring). Batch, sequence and past length
    are dynamic. The module is exported in eval mode and left unchanged.

    Args:
        module: a causal LM (``transformers`` ``...ForCausalLM``: Llama, GPT-2, Qwen2,
            Mistral, Phi, Gemma, ...).
        input_ids: example token ids ``(batch, sequence)`` (int64).
        attention_mask: example mask of the new tokens (default all ones).
        past_length: the past length of the example export (any length runs afterwards;
            at least 2 so the exporter keeps it symbolic).
        device: the device every op starts on.

    Raises:
        ExportError: the module is not a causal LM with a cache, or the export failed.
        InputError: ``input_ids`` is not a 2-D integer tensor.

    Example:
        >>> import torch
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=40))
        >>> model = from_causal_lm(net, torch.tensor([[4, 5]]))
        >>> [v.name for v in model.graph.outputs]
        ['logits', 'present.0.key', 'present.0.value']
    """
    import torch

    from placement.graph.torch_import import EXPORTER_KEY, _export, _fold_shape_arithmetic

    dev = Device.parse(device)
    if not isinstance(module, torch.nn.Module):
        raise ExportError(f"from_causal_lm needs a torch.nn.Module, got {type(module).__name__}")
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 2 or ids.dtype.is_floating_point:
        raise InputError(f"input_ids must be a 2-D integer tensor (batch, sequence), got {tuple(ids.shape)}")
    if past_length < 2:
        raise InputError(f"past_length must be at least 2 (the exporter fixes 0 and 1), got {past_length}")
    ids = ids.to(torch.long)
    keyword = cache_keyword(module)
    layers = _layer_count(module)
    heads, head_dim = _cache_shape(module)
    batch, seq = ids.shape
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask).to(torch.long)
    ids, mask = _at_least_two(ids, mask)
    batch, seq = ids.shape
    mask = torch.cat([torch.ones(batch, past_length, dtype=mask.dtype), mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -seq:]
    past = [torch.zeros(batch, heads, past_length, head_dim, dtype=dtype) for _ in range(2 * layers)]
    dynamic = torch.export.Dim.DYNAMIC
    shapes = {
        "input_ids": {0: dynamic, 1: dynamic},
        "attention_mask": {0: dynamic, 1: dynamic},
        "position_ids": {0: dynamic, 1: dynamic},
        "past": [{0: dynamic, 2: dynamic}] * (2 * layers),
    }
    wrapper = _wrapper(module, layers, keyword)
    name = type(module).__name__
    ir_model, used = _export(
        wrapper,
        (ids, mask, positions, past),
        None,
        shapes,
        "dynamo",
        name,
        skip_settings=frozenset({"use_cache"}),
    )
    _name_cache_values(ir_model, layers)
    _fold_shape_arithmetic(ir_model)
    ir_model.metadata_props[EXPORTER_KEY] = used
    from placement.graph.loading import load

    model = load(ir_model, device=dev)
    log.info("exported %s with its KV cache (%d layers, cache keyword %r) on %s", name, layers, keyword, dev)
    return model


def _at_least_two(ids: Any, mask: Any) -> tuple[Any, Any]:
    """The example widened to at least 2 sequences of at least 2 tokens (rows repeated, the last
    token repeated): exporters that specialise sizes 0 and 1 (torch 2.11's) would otherwise fix the
    batch or sequence dimension to the example's 1."""
    import torch

    if ids.shape[0] < 2:
        ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)
    if ids.shape[1] < 2:
        ids = torch.cat([ids, ids[:, -1:]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, -1:])], dim=1)
    return ids, mask


def _name_cache_values(ir_model: Any, layers: int) -> None:
    """Rename the exported graph's inputs, outputs and their dimensions to the cache convention."""
    import onnx_ir as ir

    graph = ir_model.graph
    inputs, outputs = list(graph.inputs), list(graph.outputs)
    if len(inputs) != 3 + 2 * layers or len(outputs) != 1 + 2 * layers:
        raise ExportError(
            f"the export has {len(inputs)} inputs and {len(outputs)} outputs; expected "
            f"{3 + 2 * layers} and {1 + 2 * layers} for {layers} cache layers"
        )
    batch, seq, past, total = (ir.SymbolicDim(d) for d in CACHE_DIMS)
    inputs[0].shape = ir.Shape([batch, seq])
    inputs[1].name = "attention_mask"
    inputs[1].shape = ir.Shape([batch, total])
    inputs[2].shape = ir.Shape([batch, seq])
    outputs[0].name = "logits"
    outputs[0].shape = ir.Shape([batch, seq, *_static(outputs[0].shape, 2)])
    for i in range(2 * layers):
        layer, kind = divmod(i, 2)
        kind_name = ("key", "value")[kind]
        value_in, value_out = inputs[3 + i], outputs[1 + i]
        value_in.name = past_name(layer, kind_name)
        value_out.name = present_name(layer, kind_name)
        heads, dim = _static(value_in.shape, 1)[0], _static(value_in.shape, 3)[0]
        value_in.shape = ir.Shape([batch, heads, past, dim])
        value_out.shape = ir.Shape([batch, heads, total, dim])


def _static(shape: Any, start: int) -> Sequence[Any]:
    dims = list(shape) if shape is not None else []
    return [d if isinstance(d, int) else None for d in dims[start:]] or [None]
