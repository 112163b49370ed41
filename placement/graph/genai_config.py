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

__all__ = ["GENAI_CONFIG", "apply_genai_config", "bind_dims", "cache_dims_from_config", "read_genai_config"]

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
    graph = _ir(model).graph
    found: dict[str, int] = {}
    for value in [*graph.inputs, *graph.outputs]:
        if not (is_cache_input(value.name) or is_cache_output(value.name)) or value.shape is None:
            continue
        dims = list(value.shape)
        for axis, key in _AXES.items():
            if len(dims) != 4 or isinstance(dims[axis], int) or dims[axis].value is None:
                continue
            size = decoder.get(key)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise InputError(
                    f"{GENAI_CONFIG}: model.decoder.{key} must be a positive integer, got {size!r}"
                )
            symbol = str(dims[axis].value)
            if found.setdefault(symbol, size) != size:
                raise InputError(
                    f"{GENAI_CONFIG}: the cache's symbol {symbol!r} would be {found[symbol]} and {size}"
                )
    return found


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
