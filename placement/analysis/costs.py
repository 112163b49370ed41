"""Per-op-type cost rules: the analytic FLOPs of one op, JAX-style (a table and a default).

:data:`FLOP_RULES` maps an ONNX op type to ``rule(node, shapes) -> FLOPs``; op types
not listed cost one FLOP per output element (:func:`default_flops`). ``shapes``
answers static shapes (:class:`ShapeLookup`; the profiler's ``Shapes`` is one).
The planner's ``"flops"`` cost and the profiler's ``flops`` column read this table.
Ops with subgraphs cost their subgraphs: a ``Loop`` its body times a constant trip
count (else :data:`UNKNOWN_TRIPS`, a guess), a ``Scan`` its body times the static
scan length, an ``If`` its dearer branch.

Example:
    >>> import onnx_ir as ir
    >>> from placement.analysis.costs import op_flops
    >>> a = ir.Value(name="a", shape=ir.Shape([4, 8]))
    >>> b = ir.Value(name="b", shape=ir.Shape([8, 2]))
    >>> node = ir.Node("", "MatMul", [a, b])
    >>> node.outputs[0].shape = ir.Shape([4, 2])
    >>> class Static:
    ...     def dims(self, v): return tuple(v.shape) if v is not None and v.shape is not None else None
    ...     def numel(self, v): return 1 if self.dims(v) is None else __import__("math").prod(self.dims(v))
    ...     def out_numel(self, n): return sum(self.numel(v) for v in n.outputs)
    >>> op_flops(node, Static())  # 2 * k * outputs
    128
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import onnx_ir as ir

__all__ = ["FLOP_RULES", "FlopRule", "ShapeLookup", "UNKNOWN_TRIPS", "default_flops", "op_flops"]


class ShapeLookup(Protocol):
    """Static shapes as a FLOP rule sees them."""

    def dims(self, value: ir.Value | None) -> tuple[int, ...] | None: ...

    def numel(self, value: ir.Value | None) -> int: ...

    def out_numel(self, node: ir.Node) -> int: ...


#: ``rule(node, shapes) -> int``: the analytic FLOPs of one op.
FlopRule = Callable[[ir.Node, ShapeLookup], int]


def default_flops(node: ir.Node, shapes: ShapeLookup) -> int:
    """The default rule: one FLOP per output element."""
    return shapes.out_numel(node)


def _scaled(factor: int) -> FlopRule:
    def rule(node: ir.Node, shapes: ShapeLookup) -> int:
        return factor * shapes.out_numel(node)

    return rule


def _zero(node: ir.Node, shapes: ShapeLookup) -> int:
    return 0


def _matmul(node: ir.Node, shapes: ShapeLookup) -> int:
    a = shapes.dims(node.inputs[0])
    k = a[-1] if a else 1
    return 2 * k * shapes.numel(node.outputs[0])


def _gemm(node: ir.Node, shapes: ShapeLookup) -> int:
    a = shapes.dims(node.inputs[0])
    trans_a = node.attributes.get("transA")
    k = 1
    if a and len(a) == 2:
        k = a[0] if trans_a is not None and trans_a.as_int() else a[1]
    out = shapes.numel(node.outputs[0])
    return 2 * k * out + (out if len(node.inputs) > 2 and node.inputs[2] is not None else 0)


def _conv(node: ir.Node, shapes: ShapeLookup) -> int:
    w = shapes.dims(node.inputs[1]) if len(node.inputs) > 1 else None
    per_out = math.prod(w[1:]) if w else 1
    return 2 * per_out * shapes.numel(node.outputs[0])


def _conv_transpose(node: ir.Node, shapes: ShapeLookup) -> int:
    w = shapes.dims(node.inputs[1]) if len(node.inputs) > 1 else None
    per_in = math.prod(w[1:]) if w else 1
    return 2 * per_in * shapes.numel(node.inputs[0])


def _attention(node: ir.Node, shapes: ShapeLookup) -> int:
    q = shapes.dims(node.inputs[0])
    k = shapes.dims(node.inputs[1])
    if not q or not k:
        return shapes.out_numel(node)
    return 4 * math.prod(q) * (k[-2] if len(k) == 4 else k[1])


#: Elementwise FLOPs per hidden unit and step of each recurrent op (gate activations, peepholes, blends).
_RECURRENT_ELEMENTWISE = {"RNN": 6, "GRU": 24, "LSTM": 30}


def _recurrent(node: ir.Node, shapes: ShapeLookup) -> int:
    """RNN/GRU/LSTM: per direction and step, ``X_t W^T`` and ``H R^T`` plus the gate arithmetic."""
    x = shapes.dims(node.inputs[0]) if node.inputs else None
    w = shapes.dims(node.inputs[1]) if len(node.inputs) > 1 else None
    r = shapes.dims(node.inputs[2]) if len(node.inputs) > 2 else None
    if not x or len(x) != 3 or not w or len(w) != 3 or not r or len(r) != 3:
        return shapes.out_numel(node)
    directions, gates_hidden, inputs = w
    hidden = r[-1]
    per_step = 2 * gates_hidden * (inputs + hidden) + _RECURRENT_ELEMENTWISE[node.op_type] * hidden
    return directions * x[0] * x[1] * per_step


def _body_flops(graph: ir.Graph, shapes: ShapeLookup) -> int:
    """FLOPs of one run of a subgraph: the sum of its ops' (nested subgraphs included)."""
    return sum(op_flops(node, shapes) for node in graph)


def _known_int(value: ir.Value | None) -> int | None:
    """A scalar integer input known before running (an initializer or a ``Constant``), or None."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None or tensor.size != 1:
        return None
    return int(tensor.numpy().reshape(-1)[0])


#: Iterations charged to a ``Loop`` whose trip count is not known before running (a guess:
#: its body counts once, a lower bound; ``cost="time"`` measures the real loop instead).
UNKNOWN_TRIPS = 1


def _loop(node: ir.Node, shapes: ShapeLookup) -> int:
    """The body's FLOPs times the trip count when ``M`` is a constant, else :data:`UNKNOWN_TRIPS`
    (a ``cond`` that stops it earlier is not known either)."""
    body = node.attributes["body"].as_graph()
    trips = _known_int(node.inputs[0] if node.inputs else None)
    return _body_flops(body, shapes) * max(trips if trips is not None else UNKNOWN_TRIPS, 0)


def _scan(node: ir.Node, shapes: ShapeLookup) -> int:
    """The body's FLOPs times the scan length (the first scan input's static length on its axis,
    else :data:`UNKNOWN_TRIPS`)."""
    body = node.attributes["body"].as_graph()
    count = node.attributes["num_scan_inputs"].as_int()
    first = node.inputs[len(node.inputs) - count] if count else None
    axes = node.attributes.get("scan_input_axes")
    axis = axes.as_ints()[0] if axes is not None else 0
    dims = shapes.dims(first)
    steps = dims[axis] if dims else UNKNOWN_TRIPS
    return _body_flops(body, shapes) * steps


def _if(node: ir.Node, shapes: ShapeLookup) -> int:
    """The dearer branch (which one runs is known only at run time)."""
    return max(_body_flops(node.attributes[b].as_graph(), shapes) for b in ("then_branch", "else_branch"))


#: ONNX op type -> FLOP rule; op types not listed use :func:`default_flops`.
FLOP_RULES: dict[str, FlopRule] = {
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "Attention": _attention,
    "RNN": _recurrent,
    "GRU": _recurrent,
    "LSTM": _recurrent,
    "Softmax": _scaled(5),
    "LogSoftmax": _scaled(5),
    "LayerNormalization": _scaled(8),
    "InstanceNormalization": _scaled(8),
    "BatchNormalization": _scaled(4),
    "GroupNormalization": _scaled(8),
    "RMSNormalization": _scaled(6),
    "Gelu": _scaled(8),
    "Erf": _scaled(8),
    "Tanh": _scaled(4),
    "Sigmoid": _scaled(4),
    "Exp": _scaled(4),
    "Reshape": _zero,
    "Flatten": _zero,
    "Squeeze": _zero,
    "Unsqueeze": _zero,
    "Shape": _zero,
    "Size": _zero,
    "Constant": _zero,
    "ConstantOfShape": _zero,
    "Identity": _zero,
    "If": _if,
    "Loop": _loop,
    "Scan": _scan,
}


def op_flops(node: ir.Node, shapes: ShapeLookup) -> int:
    """Analytic FLOPs of one op from :data:`FLOP_RULES` (default: one per output element)."""
    rule = FLOP_RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    return int((rule or default_flops)(node, shapes))
