"""A blob during lowering (:class:`Val`) and the conversions the lowering applies to names and data.

ONNX attributes become plain Python (:func:`attr_python`), ONNX tensors become CPU torch
tensors (:func:`to_torch_tensor`), blob names become Python identifiers (:func:`identifier`),
and a constant input becomes a literal in the generated code where its rule allows it
(:func:`literal`).

Example:
    >>> identifier("blocks.0/attn"), identifier("1x"), identifier("lambda")
    ('blocks_0_attn', '_1x', 'lambda_')
    >>> import torch
    >>> from placement.lowering.ops import get_rule
    >>> literal(Val("shape", const=torch.tensor([2, 8])), 1, get_rule("Reshape", ""))
    [2, 8]
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
import torch.fx as fx

from placement.graph.device import Device
from placement.lowering.ops import Rule, torch_dtype

__all__ = [
    "MAX_INLINE_NUMEL",
    "NOT_LITERAL",
    "RESERVED",
    "Val",
    "attr_python",
    "identifier",
    "literal",
    "op_label",
    "same_value",
    "static_shape",
    "to_torch_tensor",
]

#: Largest constant inlined as a Python list into a shape-like input.
MAX_INLINE_NUMEL = 64


@dataclass
class Val:
    """A blob during lowering: a runtime fx node, a parameter, or a constant."""

    name: str
    node: fx.Node | None = None
    device: Device | None = None  # logical device of a runtime value / parameter home
    const: torch.Tensor | None = None
    param: str | None = None  # attribute path of an nn.Parameter

    @property
    def is_const(self) -> bool:
        return self.const is not None


def attr_python(attr: ir.Attr) -> Any:
    """An attribute's value as plain Python (tensors as CPU torch tensors)."""
    kind = attr.type
    value = attr.value
    if kind == ir.AttributeType.FLOAT:
        return _short_float(value)
    if kind == ir.AttributeType.FLOATS:
        return [_short_float(v) for v in value]
    if kind == ir.AttributeType.INTS:
        return [int(v) for v in value]
    if kind == ir.AttributeType.TENSOR:
        return to_torch_tensor(value)
    if kind == ir.AttributeType.STRINGS:
        return list(value)
    return value


def _short_float(value: float) -> float:
    """A float32 attribute at its shortest round-trip spelling (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def to_torch_tensor(tensor: Any) -> torch.Tensor:
    """An onnx_ir tensor (or numpy array) as a CPU torch tensor."""
    dtype_enum = getattr(tensor, "dtype", None)
    if isinstance(dtype_enum, ir.DataType):
        dtype = torch_dtype(int(dtype_enum))
        shape = [int(d) for d in tensor.shape]
        raw = tensor.tobytes()
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape).clone()
    return torch.from_numpy(np.array(tensor, copy=True))


_IDENT = re.compile(r"[^0-9a-zA-Z_]")

#: Attribute names a parameter or submodule may not take (they exist on every GraphModule).
RESERVED = frozenset(dir(fx.GraphModule)) | frozenset(vars(torch.nn.Module())) | {
    "graph", "code", "meta", "input_names", "output_names", "device_map", "initializer_paths",
}  # fmt: skip


def identifier(name: str, fallback: str = "v") -> str:
    """A valid Python identifier from a blob name (``blocks.0/x`` -> ``blocks_0_x``)."""
    text = _IDENT.sub("_", name).strip("_") or fallback
    if text[0].isdigit():
        text = f"_{text}"
    if keyword.iskeyword(text):
        text += "_"
    return text


def op_label(node: ir.Node) -> str:
    """A readable name for a multi-output call: the op name without the exporter's ``node_``."""
    name = node.name or node.op_type
    return name[len("node_") :] if name.startswith("node_") and len(name) > 5 else name


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return type(a) is type(b) and a == b


def static_shape(value: ir.Value) -> tuple[int, ...] | None:
    shape = value.shape
    if shape is None:
        return None
    dims = []
    for dim in shape:
        if not isinstance(dim, int):
            return None
        dims.append(int(dim))
    return tuple(dims)


NOT_LITERAL = object()


def literal(val: Val, index: int, rule: Rule) -> Any:
    """A constant input written into the code as a Python literal (a shape list or a
    scalar), or ``NOT_LITERAL`` when it stays a tensor."""
    data = val.const
    assert data is not None
    if index in rule.shape_inputs and data.dim() <= 1 and data.numel() <= MAX_INLINE_NUMEL:
        return data.tolist()
    if index in rule.scalar_inputs and data.dim() == 0:
        return data.item()
    return NOT_LITERAL
