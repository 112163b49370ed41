"""The sizes of a KV cache that a model file leaves symbolic, from ``genai_config.json`` or given.

Files built by onnxruntime-genai's model builder name their cache's head size with a symbol
(``past_key_values.{i}.key``: ``(batch_size, 2, past_sequence_length, kv_cache_dim)``); the
real value sits in the ``genai_config.json`` beside the file (``model.decoder.head_size``,
``model.decoder.num_key_value_heads``). :func:`placement.load` reads it when it is there
(:func:`apply_genai_config`) and binds those symbols everywhere in the graph, so that the
cache's size is known to generation, the planner and the summary. Where there is no such
file (a model loaded from a proto, a file copied without its config), the sizes can be given
by name (:func:`bind_dims`; ``pl.generate(..., cache_dims={"kv_cache_dim": 16})``).

Example:
    >>> import onnx_ir as ir
    >>> past = ir.Value(name="past_key_values.0.key", type=ir.TensorType(ir.DataType.FLOAT),
    ...                 shape=ir.Shape(["batch", 2, "past", "kv_cache_dim"]))
    >>> graph = ir.Graph([past], [], nodes=[], opset_imports={"": 21})
    >>> bind_dims(ir.Model(graph, ir_version=10), {"kv_cache_dim": 16})
    ['kv_cache_dim']
    >>> past.shape
    Shape([SymbolicDim('batch'), 2, SymbolicDim('past'), 16])
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx_ir as ir

from placement.errors import InputError
from placement.graph.dims import _values
from placement.graph.kv_names import is_cache_input, is_cache_output

__all__ = [
    "GENAI_CONFIG",
    "apply_genai_config",
    "bind_dims",
    "cache_dims_from_config",
    "check_cache_dims",
    "read_genai_config",
]

log = logging.getLogger(__name__)

#: The file onnxruntime-genai writes beside a model it builds.
GENAI_CONFIG = "genai_config.json"

#: Cache axes a config gives: axis -> the ``model.decoder`` key holding its size.
_AXES = {1: "num_key_value_heads", 3: "head_size"}


def _ir(model: Any) -> ir.Model:
    return model.ir_model if hasattr(model, "ir_model") else model


def read_genai_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON of a ``genai_config.json`` (``path``: the file or its folder).

    Raises:
        InputError: the file is missing, not JSON, or has no ``model.decoder`` section.

    Example:
        >>> read_genai_config("no-such-folder")
        Traceback (most recent call last):
        ...
        placement.errors.InputError: no genai_config.json at 'no-such-folder/genai_config.json'
    """
    file = Path(path)
    if file.is_dir() or file.suffix != ".json":
        file = file / GENAI_CONFIG
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError as err:
        raise InputError(f"no {GENAI_CONFIG} at {str(file)!r}") from err
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read {str(file)!r}: {err}") from err
    decoder = config.get("model", {}).get("decoder") if isinstance(config, dict) else None
    if not isinstance(decoder, dict):
        raise InputError(f"{str(file)!r} has no model.decoder section")
    return config


def cache_dims_from_config(model: Any, config: Mapping[str, Any]) -> dict[str, int]:
    """Symbol -> size for the cache axes ``model`` leaves symbolic that ``config`` (a genai
    config's JSON) gives: the head count (axis 1) and the head size (axis 3).

    Raises:
        InputError: the config gives no usable size for a symbolic axis, or one symbol
            would take two sizes.
    """
    decoder = config.get("model", {}).get("decoder", {})
    found: dict[str, int] = {}
    keys: dict[str, str] = {}
    for _, axis, dim in _cache_axes(_ir(model).graph):
        key = _AXES[axis]
        size = decoder.get(key)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InputError(f"{GENAI_CONFIG}: model.decoder.{key} must be a positive integer, got {size!r}")
        symbol = str(dim.value)
        if found.setdefault(symbol, size) != size:
            raise InputError(
                f"{GENAI_CONFIG}: the cache's symbol {symbol!r} would be {found[symbol]} and {size}"
            )
        keys[symbol] = f"{GENAI_CONFIG}'s model.decoder.{key}"
    check_cache_dims(model, found, sources=keys)
    return found


def _cache_axes(graph: ir.Graph) -> list[tuple[ir.Value, int, Any]]:
    """(cache value, axis, symbolic dim) for the symbolic head-count and head-size axes of the
    graph's cache inputs and outputs."""
    found = []
    for value in [*graph.inputs, *graph.outputs]:
        if not (is_cache_input(value.name) or is_cache_output(value.name)) or value.shape is None:
            continue
        dims = list(value.shape)
        for axis in _AXES:
            if len(dims) == 4 and not isinstance(dims[axis], int) and dims[axis].value is not None:
                found.append((value, axis, dims[axis]))
    return found


#: Attention ops that read a cache: op type -> (index of past_key, attribute naming its heads).
_CACHE_READERS = {"GroupQueryAttention": (3, "kv_num_heads"), "MultiHeadAttention": (6, "num_heads")}


def _static_last(value: ir.Value | None) -> int | None:
    if value is None or value.shape is None or len(value.shape) != 3:
        return None
    last = value.shape[-1]
    return last if isinstance(last, int) else None


def _implied_axes(node: ir.Node) -> tuple[dict[int, int], str] | None:
    """The head count (axis 1) and head size (axis 3) that ``node``'s weights give its cache,
    with how they were read; ``None`` where its input widths are not static."""
    index, heads_attr = _CACHE_READERS[node.op_type]
    attrs = node.attributes
    kv = attrs[heads_attr].as_int() if heads_attr in attrs else None
    heads = attrs["num_heads"].as_int() if "num_heads" in attrs else None
    if not kv or not heads:
        return None
    key = node.inputs[1] if len(node.inputs) > 1 else None
    width = _static_last(key)
    if width is not None:
        how = f"its key input {key.name!r} is {width} wide = {kv} heads x {width // kv}"
        return ({1: kv, 3: width // kv}, how) if width % kv == 0 else None
    if node.op_type != "GroupQueryAttention":  # MultiHeadAttention packs Q, K and V otherwise
        return None
    width = _static_last(node.inputs[0])
    if width is None or width % (heads + 2 * kv):
        return None
    head = width // (heads + 2 * kv)
    how = f"its packed QKV input {node.inputs[0].name!r} is {width} wide"
    how += f" = ({heads} + 2 x {kv}) heads x {head}"
    return {1: kv, 3: head}, how


def check_cache_dims(
    model: Any, dims: Mapping[str, int], *, sources: Mapping[str, str] | None = None
) -> None:
    """Check sizes for a cache's symbolic axes against the attention ops that read the cache.

    ``com.microsoft`` ``GroupQueryAttention`` and ``MultiHeadAttention`` say their head counts,
    and their input widths (from the weights) give the head size: a ``genai_config.json`` (or a
    ``cache_dims=``) that contradicts them would make a cache of the wrong size, which fails
    deep in a runtime. ``sources`` names where each symbol's size came from, for the message.

    Raises:
        InputError: a size that contradicts an attention op, naming the op and the symbol.

    Example:
        >>> import onnx_ir as ir
        >>> qkv = ir.Value(name="qkv", shape=ir.Shape(["b", "s", 128]))  # (4 + 2 x 2) heads x 16
        >>> past = [ir.Value(name=f"past_key_values.0.{kind}", shape=ir.Shape(["b", 2, "p", "kv_cache_dim"]))
        ...         for kind in ("key", "value")]
        >>> gqa = ir.Node("com.microsoft", "GroupQueryAttention", [qkv, None, None, *past], name="attn",
        ...               attributes=[ir.AttrInt64("num_heads", 4), ir.AttrInt64("kv_num_heads", 2)])
        >>> model = ir.Model(ir.Graph([qkv, *past], [], nodes=[gqa]), ir_version=10)
        >>> check_cache_dims(model, {"kv_cache_dim": 16})
        >>> check_cache_dims(model, {"kv_cache_dim": 32})
        Traceback (most recent call last):
        ...
        placement.errors.InputError: kv_cache_dim = 32 (given) contradicts the model: ...
    """
    graph = _ir(model).graph
    for node in graph:
        if node.op_type not in _CACHE_READERS or node.domain != "com.microsoft":
            continue
        index = _CACHE_READERS[node.op_type][0]
        past = node.inputs[index] if len(node.inputs) > index else None
        if past is None or past.shape is None or len(past.shape) != 4:
            continue
        implied = _implied_axes(node)
        if implied is None:
            continue
        sizes, how = implied
        for axis, want in sizes.items():
            dim = past.shape[axis]
            symbol = None if isinstance(dim, int) else str(dim.value)
            size = dims.get(symbol) if symbol is not None else None
            if isinstance(size, int) and not isinstance(size, bool) and size > 0 and size != want:
                source = (sources or {}).get(symbol, "given")
                raise InputError(
                    f"{symbol} = {dims[symbol]} ({source}) contradicts the model: "
                    f"{node.op_type} {node.name!r} reads a cache of {want} on that axis ({how})"
                )


def bind_dims(model: Any, dims: Mapping[str, int]) -> list[str]:
    """Replace the symbolic dimensions named in ``dims`` by their sizes, on every value of the
    graph (subgraphs included), in place; the symbols bound, sorted.

    Raises:
        InputError: a size that is not a positive integer.
    """
    for name, size in dims.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InputError(f"the size of dimension {name!r} must be a positive integer, got {size!r}")
    bound: set[str] = set()
    for value in _values(_ir(model).graph):
        shape = value.shape
        if shape is None:
            continue
        names = [None if isinstance(d, int) or d.value is None else str(d.value) for d in shape]
        if not any(n in dims for n in names if n is not None):
            continue
        value.shape = ir.Shape([dims[n] if n in dims else d for n, d in zip(names, shape)])
        bound.update(n for n in names if n in dims)
    return sorted(bound)


def apply_genai_config(model: Any, folder: str | os.PathLike[str]) -> dict[str, int]:
    """Bind the cache sizes ``model`` leaves symbolic from the ``genai_config.json`` in ``folder``,
    when there is one (what :func:`placement.load` does for a file); the sizes bound.

    A config that is missing, a link out of ``folder``, unreadable or without the sizes binds
    nothing: the graph stays valid, and generation says which size it lacks.
    """
    folder = Path(folder)
    file = folder / GENAI_CONFIG
    if not file.is_file():
        return {}
    try:
        if not file.resolve().is_relative_to(folder.resolve()):
            log.warning("%s is a link out of the model's folder: not read", file)
            return {}
        dims = cache_dims_from_config(model, read_genai_config(file))
    except (InputError, OSError) as err:
        log.warning("%s is not used: %s", file, err)
        return {}
    if dims:
        bind_dims(model, dims)
        log.info("cache sizes from %s: %s", file, dims)
    return dims
