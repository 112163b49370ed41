"""Linear algebra: MatMul (fused with a bias Add into ``F.linear``), Gemm, Einsum."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
import torch
import torch.nn.functional as F

from placement.graph.nodes import is_copy_node, node_device
from placement.lowering.ops._registry import (
    FxCall,
    Shapes,
    Tensor,
    op,
)


def _fuse_linear(lowering: Any, node: ir.Node, ins: list[Any], phys: str) -> bool:
    """``MatMul(A, B)`` + ``Add(bias)`` -> ``F.linear(A, B.t(), bias)``, as eager ``nn.Linear``.

    The exporter splits a Linear on n-D inputs into MatMul and Add; fusing them
    back gives eager's single ``addmm`` (same kernel, same numbers). Only when
    the MatMul feeds nothing but that Add on the same device, ``B`` is 2-D and
    the bias is 1-D of ``B``'s width; the MatMul is then deferred to the Add.
    """
    out = node.outputs[0]
    uses = list(out.uses())
    if len(uses) != 1 or out.is_graph_output() or any(v is None for v in ins):
        return False
    add, position = uses[0].node, uses[0].idx
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
        return False
    if node_device(add) != node_device(node) or is_copy_node(add):
        return False
    b_shape = lowering.shape(node.inputs[1])
    bias_shape = lowering.shape(add.inputs[1 - position])
    if b_shape is None or len(b_shape) != 2 or bias_shape != (b_shape[1],):
        return False
    a, b = ins

    def linear(lowering: Any, add_node: ir.Node, add_ins: list[Any], phys: str) -> None:
        bias = add_ins[1 - position]
        b_node = lowering.on(b, phys)
        if b_node.op == "call_method" and b_node.target == "permute" and b_node.args[1:] == (1, 0):
            weight = b_node.args[0]  # B = W.permute(1, 0): use W itself, like nn.Linear
        else:
            weight = lowering.emit("call_method", "t", (b_node,), {}, f"{b.name}_t")
        name = add_node.outputs[0].name or ""
        call = lowering.emit(
            "call_function",
            F.linear,
            (lowering.on(a, phys), weight, lowering.on(bias, phys)),
            {},
            name or "linear",
        )
        lowering.define(name, call, node_device(add_node))

    lowering.defer(add, linear)
    lowering.mark_fused(out.name or "")
    return True


op("MatMul", torch.matmul, emit=_fuse_linear)


def _direct_gemm(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if kwargs != {"transB": 1}:
        return None
    if (
        len(args) == 3
        and args[2] is not None
        and (len(shapes) < 3 or shapes[2] is None or len(shapes[2]) != 1)
    ):
        return None
    return "call_function", F.linear, tuple(args), {}


@op("Gemm", scalar_inputs=(2,), direct=_direct_gemm)
def gemm(
    A: Tensor,
    B: Tensor,
    C: Any = None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    transA: int = 0,
    transB: int = 0,
) -> Tensor:
    """ONNX Gemm: ``alpha * A' @ B' + beta * C``; ``F.linear`` when it is a Linear layer."""
    if transB and not transA and alpha == 1.0 and beta == 1.0 and (C is None or _is_vector(C)):
        return F.linear(A, B, C)
    a = A.t() if transA else A
    b = B.t() if transB else B
    out = a @ b
    if alpha != 1.0:
        out = out * alpha
    if C is not None:
        out = out + (C * beta if beta != 1.0 else C)
    return out


def _is_vector(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1


@op("Einsum")
def einsum(*Inputs: Tensor, equation: str) -> Tensor:
    """ONNX Einsum."""
    return torch.einsum(equation, *Inputs)


@op("Det")
def det(X: Tensor) -> Tensor:
    """ONNX Det: determinants of the trailing square matrices."""
    return torch.linalg.det(X)
