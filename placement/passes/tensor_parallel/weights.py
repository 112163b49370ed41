"""Weights of split ops: a parameter seen through ``Transpose`` s, its shards, and the column
plan (which output columns each device computes) read from the ops after a linear.

The exporter writes ``x @ W.T`` as ``MatMul(x, Transpose(W))``: :func:`weight_view` sees the
parameter through such parameter-only transposes, so a shard slices the stored parameter and
each device transposes its own shard (at load time). Tied parameters (an embedding and the LM
head) share their shards: a shard is one initializer per distinct slice.

:func:`column_plan` chooses the columns of a column-parallel linear in whole heads: it follows
the output through bias adds, activations and gates, a ``Split`` into sections (fused QKV),
to ``Reshape`` s that make heads, and spreads each section's heads over the devices.

Example:
    >>> import placement as pl
    >>> from placement.models import gpt
    >>> model = pl.from_torch(*gpt.build("tiny"))
    >>> matmul = next(n for n in model.graph if n.op_type == "MatMul")
    >>> parts = column_plan(matmul.outputs[0], 96, 2)
    >>> [len(p) for p in parts], parts[0][:3], parts[1][:3]  # q, k, v heads 0 on device 0, heads 1 on 1
    ([48, 48], (0, 1, 2), (16, 17, 18))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from placement.passes.tensor_parallel.layouts import Parts, block_parts
from placement.passes.tensor_parallel.rewriter import Rewriter, attr_value, dims, static_int

__all__ = ["WeightView", "weight_view", "column_plan", "UNARY", "BROADCAST"]

#: Ops applied element by element to one tensor (they keep any layout).
UNARY = frozenset(
    {
        "Relu",
        "Gelu",
        "Sigmoid",
        "Tanh",
        "Erf",
        "Exp",
        "Log",
        "Neg",
        "Sqrt",
        "Reciprocal",
        "Abs",
        "Cast",
        "Identity",
        "Softplus",
        "Softsign",
        "LeakyRelu",
        "Elu",
        "Selu",
        "HardSigmoid",
        "HardSwish",
        "Mish",
        "Celu",
        "Sign",
        "Floor",
        "Ceil",
        "Round",
        "Not",
        "IsNaN",
        "Sin",
        "Cos",
        "Clip",
        "Dropout",
        "ThresholdedRelu",
        "Swish",
    }
)
#: Ops combining tensors element by element with numpy broadcasting.
BROADCAST = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Where",
        "Max",
        "Min",
        "Equal",
        "Less",
        "Greater",
        "LessOrEqual",
        "GreaterOrEqual",
        "And",
        "Or",
        "Xor",
        "PRelu",
        "Mod",
        "BitShift",
    }
)


@dataclass(frozen=True)
class WeightView:
    """A parameter as an op reads it: ``param`` permuted by ``perm`` (None: as stored)."""

    param: ir.Value
    perm: tuple[int, ...] | None

    def stored_axis(self, axis: int) -> int:
        """The parameter's own axis behind the viewed ``axis``."""
        return axis if self.perm is None else self.perm[axis]

    def shard(self, rw: Rewriter, axis: int, index: tuple[int, ...], d: int) -> ir.Value:
        """Device ``d``'s view of the elements ``index`` along the viewed ``axis``."""
        shard = rw.param_shard(self.param, self.stored_axis(axis), index, d)
        if self.perm is None:
            return shard
        node = rw.emit(
            "Transpose",
            [shard],
            d,
            hint=f"{shard.name}.T",
            attributes=[ir.AttrInt64s("perm", list(self.perm))],
        )
        out = node.outputs[0]
        out.type = shard.type
        out.shape = ir.Shape([shard.shape[p] for p in self.perm])
        return out


def weight_view(value: ir.Value | None) -> WeightView | None:
    """The parameter behind ``value`` (itself, or through parameter-only ``Transpose`` s)."""
    if value is None:
        return None
    perm: list[int] | None = None
    while True:
        if value.is_initializer() and value.const_value is not None:
            return WeightView(value, None if perm is None else tuple(perm))
        producer = value.producer()
        if producer is None or producer.op_type != "Transpose" or producer.domain != "":
            return None
        inner = producer.inputs[0]
        if inner is None or inner.shape is None:
            return None
        rank = len(inner.shape)
        own = list(attr_value(producer, "perm", list(range(rank))[::-1]))
        perm = own if perm is None else [own[p] for p in perm]
        value = inner


def column_plan(value: ir.Value, size: int, degree: int) -> Parts:
    """Per device, the output columns (last axis, ``size`` long) of a column-parallel op
    whose output is ``value``: whole heads of every section, spread as evenly as they go.

    Raises:
        InputError: a section's heads cannot be spread over ``degree`` devices.
    """
    sections = _sections(value, 0, size, depth=0, degree=degree) or [(0, size, 1)]
    merged: dict[tuple[int, int], int] = {}
    for off, length, block in sections:
        key = (off, length)
        merged[key] = int(np.lcm(merged.get(key, 1), block))
    parts: list[list[int]] = [[] for _ in range(degree)]
    for (off, length), block in sorted(merged.items()):
        for d, part in enumerate(block_parts(length, degree, block=block)):
            parts[d] += [off + i for i in part]
    return tuple(tuple(sorted(p)) for p in parts)


def _sections(
    value: ir.Value, off: int, length: int, depth: int, degree: int = 1
) -> list[tuple[int, int, int]]:
    """(offset, length, head size) of the sections of the last axis the ops after ``value``
    make heads of (a ``Reshape`` to (..., heads, head size), or an attention op reading it:
    see :func:`~.rules_attention.attention_sections`)."""
    from placement.passes.tensor_parallel.rules_attention import HEAD_OPS, PER_HEAD_OPS, attention_sections

    if depth > 8:
        return []
    found: list[tuple[int, int, int]] = []
    rank = len(value.shape) if value.shape is not None else None
    for use in value.uses():
        node = use.node
        op = node.op_type
        if (node.domain, op) in HEAD_OPS:
            found += attention_sections(node, use.idx, off, length, degree)
        elif (node.domain, op) in PER_HEAD_OPS and use.idx == 0:
            found += _sections(node.outputs[0], off, length, depth + 1, degree)
        elif op in UNARY or op in BROADCAST:
            found += _sections(node.outputs[0], off, length, depth + 1, degree)
        elif op == "Split" and rank is not None and attr_value(node, "axis", 0) % rank == rank - 1:
            sizes = _split_sizes(node, length)
            start = off
            for out, n in zip(node.outputs, sizes or []):
                found += _sections(out, start, n, depth + 1, degree) or [(start, n, 1)]
                start += n
        elif op == "Reshape":
            shape = dims(node.outputs[0])
            last = shape[-1] if shape else None
            if not isinstance(last, int) or not last or rank is None:
                continue
            one_head = last == length and len(shape) >= 2 and shape[-2] == 1  # (..., 1, size)
            if len(shape) > rank and (one_head or (last < length and length % last == 0)):
                found.append((off, length, last))  # heads
            elif last == (dims(value) or [None])[-1]:  # the last axis kept (a flatten of the rows)
                found += _sections(node.outputs[0], off, length, depth + 1, degree)
    return found


def _split_sizes(node: ir.Node, length: int) -> list[int] | None:
    """The section sizes of a ``Split`` of an axis ``length`` long."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        sizes = static_int(node.inputs[1])
        return None if sizes is None else [int(s) for s in sizes]
    n = int(attr_value(node, "num_outputs", len(node.outputs)))
    step = -(-length // n)
    return [min(step, length - i * step) for i in range(n)]
