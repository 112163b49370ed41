"""The batch axis of every graph input and output: where a batch is cut into micro-batches.

:func:`batch_axes` finds them from the graph's symbolic batch dimension (a model exported with a
dynamic batch), a time-major recurrent op's sequence input, or the caller's overrides; outputs
whose exporter annotations lost the symbol get their shapes inferred again.

Example:
    >>> import torch
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.runtime.schedule.axes import batch_axes
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    >>> batch_axes(model).inputs
    {'input': 0}
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from placement.analysis import copy_origin
from placement.errors import InputError, PlacementError
from placement.graph.model import Model
from placement.runtime.inputs import input_specs

__all__ = ["BatchAxes", "batch_axes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchAxes:
    """Where the batch is in each graph input and output.

    Attributes:
        inputs: graph input name -> batch axis, or None for an input that goes
            whole to every micro-batch (a mask broadcast over the batch, a scalar).
        outputs: graph output name -> batch axis (outputs are concatenated along it).
        symbol: the symbolic dimension recognised as the batch (None when all
            axes were given).
    """

    inputs: dict[str, int | None]
    outputs: dict[str, int]
    symbol: str | None = None


def batch_axes(model: Model, *, overrides: Mapping[str, int | None] | None = None) -> BatchAxes:
    """Find the batch axis of every graph input and output of ``model``.

    The batch is the first symbolic dimension of the first input that has
    one (a model exported with a dynamic batch: ``pl.from_torch(net, args,
    dynamic_shapes=...)``), except that an input read as the sequence of a
    time-major ``RNN``/``GRU``/``LSTM`` (``layout=0``, ``[steps, batch, features]``)
    has its batch on axis 1; each input and output is batched along the axis
    carrying that same symbol. Inputs without it go whole to every
    micro-batch. ``overrides`` (input or output name -> axis, or None for "not
    batched", inputs only) replaces the detection for the names it lists.

    Exporters sometimes annotate an output with fresh symbols of their own
    (``LayerNormalization747_dim_0``, where a window partition reshapes the
    batch away and back): for such outputs the shapes are inferred again from
    the inputs (ONNX's shape inference with data propagation, then ONNX
    Runtime's symbolic shape inference), and the batch symbol found there counts.

    Raises:
        InputError: an override names no graph input/output or an axis out of range.
        PlacementError: no input has a batch axis, or an output has none (the
            message names it): such a model cannot be split into micro-batches.

    Example:
        >>> import torch
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> net, (x,) = mlp.build("tiny")
        >>> model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
        >>> batch_axes(model)
        BatchAxes(inputs={'input': 0}, outputs={'linear_2': 0}, symbol='batch')
    """
    overrides = dict(overrides or {})
    specs = input_specs(model.graph)
    outputs = [(v.name or "", _dims(v.shape)) for v in model.graph.outputs]
    known = {s.name for s in specs} | {name for name, _ in outputs}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise InputError(
            f"batch_axes names {', '.join(map(repr, unknown))}, which is not a graph input or output; "
            f"inputs: {', '.join(repr(s.name) for s in specs)}; "
            f"outputs: {', '.join(repr(n) for n, _ in outputs)}"
        )
    symbol = _batch_symbol(model, specs, overrides)

    def axis_of(name: str, dims: tuple[Any, ...] | None) -> int | None:
        return _axis_of(name, dims, overrides, symbol)

    ins = {spec.name: axis_of(spec.name, spec.shape) for spec in specs}
    if not any(axis is not None for axis in ins.values()):
        shapes = ", ".join(f"{s.name!r}: {s.describe()}" for s in specs)
        raise PlacementError(
            f"cannot split the inputs into micro-batches: no input has a batch axis ({shapes}); "
            "export the model with a dynamic batch dimension, e.g. "
            "pl.from_torch(net, args, dynamic_shapes=({0: torch.export.Dim('batch')},)), "
            "or name the axes with batch_axes={input: axis}"
        )
    if symbol is not None and any(
        name not in overrides and (dims is None or symbol not in dims) for name, dims in outputs
    ):
        inferred = _inferred_output_dims(model, symbol)
        outputs = [(name, dims if name in overrides else inferred.get(name, dims)) for name, dims in outputs]
    outs: dict[str, int] = {}
    for name, dims in outputs:
        axis = axis_of(name, dims)
        if axis is None:
            shown = "unknown shape" if dims is None else f"shape [{', '.join(map(str, dims))}]"
            raise PlacementError(
                f"cannot pipeline over micro-batches: graph output {name!r} ({shown}) has no batch axis"
                f"{f' {symbol!r}' if symbol else ''}, so micro-batch results cannot be concatenated "
                "(an op fixes the batch size or reduces over it); pass batch_axes={output: axis} "
                "if it has one"
            )
        outs[name] = axis
    return BatchAxes(ins, outs, symbol)


def _batch_symbol(model: Model, specs: list[Any], overrides: Mapping[str, int | None]) -> str | None:
    """The symbolic dimension that is the batch: the one an override names, else a time-major
    recurrent op's sequence input's axis 1, else the first symbolic dimension of the first input
    with one (inputs the overrides list are skipped by the last two)."""
    symbol = None
    for spec in specs:  # an override names the batch axis
        axis = overrides.get(spec.name)
        dims = spec.shape or ()
        if axis is not None and -len(dims) <= axis < len(dims) and isinstance(dims[axis], str):
            symbol = dims[axis]
            break
    if symbol is None:  # a time-major recurrent op's input: its batch is on axis 1
        recurrent = _recurrent_batch_axes(model)
        for spec in specs:
            axis = recurrent.get(spec.name)
            dims = spec.shape or ()
            if spec.name not in overrides and axis is not None and axis < len(dims):
                if isinstance(dims[axis], str) and dims[axis]:
                    symbol = dims[axis]
                    break
    if symbol is None:  # else the first symbolic dimension of the first input with one
        for spec in specs:
            if spec.name in overrides:
                continue
            symbol = next((dim for dim in spec.shape or () if isinstance(dim, str) and dim), None)
            if symbol is not None:
                break
    return symbol


def _axis_of(
    name: str, dims: tuple[Any, ...] | None, overrides: Mapping[str, int | None], symbol: str | None
) -> int | None:
    """The batch axis of input or output ``name`` (``dims``): its override, else where ``symbol`` is."""
    if name in overrides:
        axis = overrides[name]
        if axis is not None and dims is not None and not -len(dims) <= axis < len(dims):
            raise InputError(f"batch axis {axis} of {name!r} is out of range for rank {len(dims)}")
        if axis is not None and dims is not None and axis < 0:
            axis += len(dims)
        return axis
    if symbol is None or dims is None:
        return None
    return dims.index(symbol) if symbol in dims else None


#: ONNX's recurrent ops: input 0 is ``[seq, batch, ...]`` with ``layout=0`` (the default), else batch-major.
_RECURRENT = frozenset({"RNN", "GRU", "LSTM"})


def _recurrent_batch_axes(model: Model) -> dict[str, int]:
    """Graph inputs read (directly or through copies) as the sequence input of a recurrent op:
    name -> their batch axis."""
    found: dict[str, int] = {}
    for node in model.graph:
        if node.op_type in _RECURRENT and node.domain in ("", "ai.onnx") and node.inputs:
            x = copy_origin(node.inputs[0]) if node.inputs[0] is not None else None
            if x is not None and x.is_graph_input() and x.name:
                layout = node.attributes.get("layout")
                found.setdefault(x.name, 0 if layout is not None and layout.as_int() == 1 else 1)
    return found


def _inferred_output_dims(model: Model, symbol: str) -> dict[str, tuple[Any, ...]]:
    """Graph outputs' dims inferred again from the inputs' shapes, the outputs' own
    annotations dropped: those that carry ``symbol``.

    Tries ONNX's shape inference (with data propagation) keeping the intermediate
    annotations, then without them, then ONNX Runtime's symbolic shape inference;
    an output keeps the first answer that has the symbol."""
    import onnx

    from placement.graph.weights import split_weights

    proto, _ = split_weights(model)  # big weights as stubs: their shapes are all inference needs
    for value in proto.graph.output:
        value.type.tensor_type.ClearField("shape")
    bare = onnx.ModelProto()
    bare.CopyFrom(proto)
    del bare.graph.value_info[:]

    def onnx_inference(model: onnx.ModelProto) -> onnx.ModelProto:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)

    def symbolic_inference(model: onnx.ModelProto) -> onnx.ModelProto:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        return SymbolicShapeInference.infer_shapes(_tensor_constants(model), auto_merge=True)

    result: dict[str, tuple[Any, ...]] = {}
    for infer, given in ((onnx_inference, proto), (onnx_inference, bare), (symbolic_inference, proto)):
        try:
            inferred = infer(given)
        except Exception as err:  # noqa: BLE001 (a second opinion; the caller reports what stays unknown)
            log.debug("batch axes: %s failed: %s", infer.__name__, err)
            continue
        for value in inferred.graph.output if inferred is not None else ():
            dims = tuple(_dim(d) for d in value.type.tensor_type.shape.dim)
            if symbol in dims:
                result.setdefault(value.name, dims)
        if len(result) == len(proto.graph.output):
            break
    return result


def _tensor_constants(model: Any) -> Any:
    """``model`` (an ONNX ``ModelProto``, edited in place) with every ``Constant`` that holds a
    number or a list of numbers (``value_float``, ``value_ints``, ...) holding it as a tensor
    (``value``), the only form ONNX Runtime's symbolic shape inference reads."""
    from onnx import helper, numpy_helper

    dtypes = {"value_float": np.float32, "value_floats": np.float32}
    dtypes |= {"value_int": np.int64, "value_ints": np.int64}
    for node in model.graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name in dtypes:
            attribute = node.attribute[0]
            tensor = numpy_helper.from_array(
                np.array(helper.get_attribute_value(attribute), dtype=dtypes[attribute.name])
            )
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("value", tensor))
    return model


def _dim(dim: Any) -> Any:
    """An ONNX ``TensorShapeProto.Dimension`` as a symbol, a size or None."""
    return dim.dim_param or (dim.dim_value if dim.HasField("dim_value") else None)


def _dims(shape: Any) -> tuple[Any, ...] | None:
    if shape is None:
        return None
    return tuple(d if isinstance(d, int) else getattr(d, "value", None) for d in shape)
