"""Dimensions written as ``-1``: off the ONNX spec, read as dynamic.

The ONNX spec gives a tensor dimension a non-negative ``dim_value``, a
``dim_param`` (a symbol) or neither (unknown). Some exporters write ``-1`` for
"any size", and ONNX Runtime reads it as unknown. :func:`dynamic_negative_dims`
does the same for a whole model (graph inputs and outputs, every value's shape,
subgraphs included), so that nothing takes ``-1`` as a size, and one warning
names what was rewritten. A negative dimension of a graph input becomes a
symbol of its own, named after the input and axis (``x_dim0``), which a given
input binds (the planners size FLOPs and micro-batches by it); every other one
becomes unknown, so shape inference fills it from the inputs instead of
holding it to a symbol nothing else has. :class:`placement.Model` calls it on
every model it wraps, so :func:`placement.load` and every function given an ONNX
model see only valid shapes.

Example:
    >>> import warnings
    >>> import onnx_ir as ir
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([-1, 3]))
    >>> relu = ir.Node("", "Relu", [x], name="relu", num_outputs=1)
    >>> relu.outputs[0].name = "y"
    >>> model = ir.Model(ir.Graph([x], relu.outputs, nodes=[relu], opset_imports={"": 20}), ir_version=10)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     dynamic_negative_dims(model)
    [('x', 0)]
    >>> x.shape, len(caught)
    (Shape([SymbolicDim('x_dim0'), 3]), 1)
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator

import onnx_ir as ir

__all__ = ["dynamic_negative_dims"]

log = logging.getLogger(__name__)

#: How many rewritten dimensions the warning lists by name.
_LISTED = 6


def _graphs(graph: ir.Graph) -> Iterator[ir.Graph]:
    """``graph`` and every subgraph in it (``If`` branches, ``Loop`` / ``Scan`` bodies), nested."""
    yield graph
    for node in graph:
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield from _graphs(attr.as_graph())
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.as_graphs():
                    yield from _graphs(sub)


def _values(graph: ir.Graph) -> Iterator[ir.Value]:
    for g in _graphs(graph):
        yield from g.inputs
        yield from g.outputs
        for node in g:
            yield from node.outputs


def _negative(shape: ir.Shape | None) -> bool:
    return shape is not None and any(isinstance(d, int) and d < 0 for d in shape)


def dynamic_negative_dims(model: ir.Model) -> list[tuple[str, int]]:
    """Make every dimension written as a negative number (``-1``) dynamic, in place.

    One of a main-graph input becomes a symbol ``<input>_dim<axis>`` (made unique
    among the model's symbols), any other an unknown dimension. Warns once
    (``UserWarning``) naming the rewritten dimensions when there are any;
    otherwise the model is untouched.

    Returns:
        ``(value name, axis)`` of every rewritten dimension, in graph order (a value
        listed as a graph output and produced by an op counts once).

    Example:
        >>> import onnx_ir as ir
        >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
        >>> graph = ir.Graph([x], [x], nodes=[], opset_imports={"": 20})
        >>> dynamic_negative_dims(ir.Model(graph, ir_version=10))
        []
    """
    found = list(dict.fromkeys(v for v in _values(model.graph) if _negative(v.shape)))
    if not found:
        return []
    taken = {
        str(d.value)
        for v in _values(model.graph)
        if v.shape is not None
        for d in v.shape
        if isinstance(d, ir.SymbolicDim) and d.value is not None
    }
    inputs = set(model.graph.inputs)
    rewritten: list[tuple[str, int]] = []
    written: list[int] = []
    for value in found:
        shape = value.shape
        assert shape is not None
        dims: list[int | ir.SymbolicDim] = []
        for axis, dim in enumerate(shape):
            if isinstance(dim, int) and dim < 0:
                symbol = None
                if value in inputs:
                    symbol = base = f"{value.name or 'input'}_dim{axis}"
                    k = 1
                    while symbol in taken:
                        k += 1
                        symbol = f"{base}_{k}"
                    taken.add(symbol)
                dims.append(ir.SymbolicDim(symbol))
                rewritten.append((value.name or "", axis))
                written.append(dim)
            else:
                dims.append(dim)
        value.shape = ir.Shape(dims, denotations=[shape.get_denotation(i) for i in range(shape.rank())])
    listed = ", ".join(
        f"{name!r} dimension {axis} = {size}" for (name, axis), size in zip(rewritten[:_LISTED], written)
    )
    more = f" and {len(rewritten) - _LISTED} more" if len(rewritten) > _LISTED else ""
    warnings.warn(
        f"model {model.graph.name or '(unnamed)'!r} is off the ONNX spec, it gives negative sizes: "
        f"{listed}{more}; read as dynamic (any size), as ONNX Runtime reads them",
        UserWarning,
        stacklevel=_outside_the_package(),
    )
    return rewritten


def _outside_the_package() -> int:
    """The ``stacklevel`` that points a warning raised here at the first caller outside ``placement``."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level
