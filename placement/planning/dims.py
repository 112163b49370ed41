"""The sizes symbolic dimensions are planned at: sample inputs, a stated batch, or one example.

A model exported with a dynamic batch (``x: [batch, 3, 32, 32]``) has no activation sizes
of its own. Everything that counts bytes (the planners' memory budgets, the plan's peak
activations and copies, :func:`placement.summary`, :func:`placement.draw` and
:func:`placement.write_report`) counts them at one binding of the graph inputs' symbols
(``{"batch": 8}``), chosen by :func:`planned_dims`:

1. a symbol the sample inputs give takes their size (``sample_inputs={"x": x}`` with
   ``x.shape[0] == 8`` binds ``batch`` to 8);
2. else the stated ``batch``: an int binds every other symbol, a mapping binds the symbols
   it names (``{"batch": 8, "seq": 128}``; ``--dim batch=8`` on the command line);
3. else the binding stored on the model by the last plan applied to it (a placed model
   saved and loaded again keeps it, under ``placement.dims`` in the file's metadata);
4. else 1: sizes per example.

Example:
    >>> import numpy as np, torch
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    >>> planned_dims(model), planned_dims(model, batch=8)
    ({'batch': 1}, {'batch': 8})
    >>> planned_dims(model, sample_inputs={"input": np.zeros((6, 16), np.float32)}, batch=8)
    {'batch': 6}
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Iterator, Mapping
from typing import Any

import onnx_ir as ir

from placement.errors import PlanError
from placement.graph.model import Model

__all__ = [
    "DIMS_KEY",
    "called_as",
    "caller",
    "describe",
    "input_symbols",
    "planned_dims",
    "store_dims",
    "stored_dims",
]

#: Model metadata key of the binding a plan was made at (a JSON object, symbol -> size).
DIMS_KEY = "placement.dims"

_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("placement_caller", default="profile")


@contextlib.contextmanager
def called_as(name: str) -> Iterator[None]:
    """Name the public function the user called, for messages raised below it (see :func:`caller`)."""
    token = _CALLER.set(name)
    try:
        yield
    finally:
        _CALLER.reset(token)


def caller() -> str:
    """The public function running (``"auto_place"``), as :func:`called_as` set it; ``"profile"`` else."""
    return _CALLER.get()


def _ir(model: Model | ir.Model) -> ir.Model:
    return model.ir_model if isinstance(model, Model) else model


def input_symbols(model: Model | ir.Model) -> dict[str, list[tuple[str, int]]]:
    """Symbol -> the ``(graph input, axis)`` places it sizes, in graph-input order."""
    graph = _ir(model).graph
    inits = graph.initializers
    found: dict[str, list[tuple[str, int]]] = {}
    for value in graph.inputs:
        if value.shape is None or value.name in inits:
            continue
        for axis, dim in enumerate(value.shape):
            if not isinstance(dim, int) and dim.value is not None:
                found.setdefault(str(dim.value), []).append((value.name or "", axis))
    return found


def stored_dims(model: Model | ir.Model) -> dict[str, int]:
    """The binding stored on ``model`` by the last plan applied (``{}`` if none)."""
    text = _ir(model).metadata_props.get(DIMS_KEY)
    if not text:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): int(v) for k, v in data.items() if isinstance(v, int) and v >= 1}


def store_dims(model: Model | ir.Model, dims: Mapping[str, int]) -> None:
    """Store ``dims`` on ``model`` (:data:`DIMS_KEY`); an empty binding clears it."""
    props = _ir(model).metadata_props
    if dims:
        props[DIMS_KEY] = json.dumps(dict(sorted(dims.items())))
    else:
        props.pop(DIMS_KEY, None)


def _check_batch(batch: int | Mapping[str, int] | None, symbols: Mapping[str, Any]) -> None:
    if batch is None:
        return
    if isinstance(batch, Mapping):
        for name, size in batch.items():
            if name not in symbols:
                known = ", ".join(symbols) or "none: every input has a fixed shape"
                raise PlanError(
                    f"{name!r} is not a symbolic dimension of the model's inputs (they have {known})"
                )
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise PlanError(f"the size of {name!r} must be a positive integer, not {size!r}")
        return
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(
            f"{caller()}: batch must be a positive integer (or a mapping symbol -> size), not {batch!r}"
        )


def planned_dims(
    model: Model | ir.Model,
    *,
    sample_inputs: Mapping[str, Any] | None = None,
    batch: int | Mapping[str, int] | None = None,
) -> dict[str, int]:
    """The size of every symbolic dimension of the graph inputs, by the rules of the module docstring.

    Args:
        model: the model.
        sample_inputs: graph input name -> array (anything with ``.shape``).
        batch: an int for every symbol the sample inputs leave unsized, or a mapping
            symbol -> size.

    Raises:
        PlanError: ``batch`` is not a positive int, or names a symbol the inputs lack.
    """
    symbols = input_symbols(model)
    _check_batch(batch, symbols)
    stored = stored_dims(model)
    dims: dict[str, int] = {}
    for symbol, places in symbols.items():
        size = None
        for name, axis in places:
            array = (sample_inputs or {}).get(name)
            shape = getattr(array, "shape", None)
            if shape is not None and axis < len(shape):
                size = int(shape[axis])
                break
        if size is None and isinstance(batch, Mapping):
            size = batch.get(symbol)
        elif size is None and batch is not None:
            size = int(batch)
        if size is None:
            size = stored.get(symbol, 1)
        dims[symbol] = size
    return dims


def describe(dims: Mapping[str, int]) -> str:
    """``{"batch": 8, "seq": 16}`` -> ``"batch=8, seq=16"`` (``""`` for none)."""
    return ", ".join(f"{k}={v}" for k, v in dims.items())
