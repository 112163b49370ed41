"""Control flow: ``If`` whose condition is known when lowering (its taken branch is inlined)."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from placement.errors import LoweringError
from placement.graph.model import node_device
from placement.runtime.lowering.ops._registry import op


def _inline_branch(lowering: Any, node: ir.Node, ins: list[Any], phys: str) -> bool:
    condition = lowering.constant(ins[0] if ins else None)
    if condition is None:
        raise LoweringError(
            f"op {node.name!r} (If): the condition is computed at run time; only conditions "
            "known when lowering (shapes, constants) are lowered"
        )
    branch = node.attributes["then_branch" if bool(condition.reshape(-1)[0]) else "else_branch"].as_graph()
    lowering.inline(
        branch,
        node_device(node) if lowering.device_override is None else lowering.device_override,
        list(node.outputs),
    )
    return True


def _never_called(cond: Any, *, then_branch: Any = None, else_branch: Any = None) -> Any:
    raise LoweringError("If is lowered by inlining its taken branch")


op("If", _never_called, foldable=False, emit=_inline_branch)
