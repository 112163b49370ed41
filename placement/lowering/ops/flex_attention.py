"""``ai.onnx.preview::FlexAttention``: scaled dot-product attention whose scores and
probabilities pass through optional subgraphs (``score_mod``, ``prob_mod``).

As ONNX's reference computes it: ``Q`` and ``K`` are each scaled by ``sqrt(scale)``
(``scale`` defaults to ``1/sqrt(head size)``; the square root in float32, cast to the
input type), multiplied in the input type, cast to the softmax precision
(``softmax_precision``, else float32 for 16-bit inputs), passed through ``score_mod``,
softmaxed over the keys, passed through ``prob_mod``, multiplied with ``V`` in that
precision and cast back to ``V``'s type. Key/value heads are repeated for grouped-query
attention. The subgraphs are lowered like ``Loop`` bodies
(:meth:`~placement.lowering.bodies.Lowering.subgraphs`) and called with the scores (or
probabilities) followed by the enclosing values they read.

Example:
    >>> import torch
    >>> from placement.lowering.ops.flex_attention import flex_attention
    >>> q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    >>> want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    >>> torch.allclose(flex_attention(q, k, v), want, atol=1e-6)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import onnx_ir as ir
import torch

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, op, torch_dtype
from placement.lowering.ops.control import Subgraph, _call, _dynamic, _specs

_MODS = ("score_mod", "prob_mod")


def flex_attention(
    Q: Tensor,
    K: Tensor,
    V: Tensor,
    *,
    scale: float | None = None,
    softmax_precision: int | None = None,
    score_mod: Callable[[Tensor], Tensor] | None = None,
    prob_mod: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """FlexAttention on rank-4 ``(batch, heads, seq, size)`` inputs (see the module docstring)."""
    if Q.dim() != 4 or K.dim() != 4 or V.dim() != 4:
        raise LoweringError("FlexAttention: Q, K and V must be rank 4")
    q_heads, kv_heads = Q.shape[1], K.shape[1]
    if q_heads != kv_heads:
        if q_heads % kv_heads:
            raise LoweringError(f"FlexAttention: {q_heads} query heads for {kv_heads} key/value heads")
        K = K.repeat_interleave(q_heads // kv_heads, dim=1)
        V = V.repeat_interleave(q_heads // kv_heads, dim=1)
    factor = 1.0 / math.sqrt(Q.shape[-1]) if scale is None else float(scale)
    root = torch.sqrt(torch.tensor(factor, dtype=torch.float32)).to(Q.dtype).to(Q.device)
    scores = (Q * root) @ (K * root).transpose(-1, -2)
    if softmax_precision is not None:
        compute = torch_dtype(int(softmax_precision))
    else:
        compute = torch.float32 if Q.dtype in (torch.float16, torch.bfloat16) else Q.dtype
    scores = scores.to(compute)
    if score_mod is not None:
        scores = score_mod(scores).to(compute)
    exp = torch.exp(scores - scores.amax(-1, keepdim=True))
    probs = exp / exp.sum(-1, keepdim=True)
    if prob_mod is not None:
        probs = prob_mod(probs).to(compute)
    return (probs @ V.to(compute)).to(V.dtype)


class FlexAttention(torch.nn.Module):
    """A FlexAttention op with its lowered subgraphs: ``forward(Q, K, V, *captured)``."""

    def __init__(
        self, mods: dict[str, Subgraph], *, scale: float | None, softmax_precision: int | None
    ) -> None:
        super().__init__()
        self.mods = torch.nn.ModuleDict(mods)
        self.scale = scale
        self.softmax_precision = softmax_precision

    def forward(self, Q: Tensor, K: Tensor, V: Tensor, *captured: Tensor) -> tuple[Tensor]:
        calls = {name: (lambda x, m=mod: m(x, *captured)[0]) for name, mod in self.mods.items()}
        out = flex_attention(Q, K, V, scale=self.scale, softmax_precision=self.softmax_precision, **calls)
        return (out,)


def _lower(lowering: Any, node: ir.Node, ins: list[Any], phys: str) -> bool:
    if len(ins) < 3 or any(val is None for val in ins[:3]):
        raise LoweringError(f"op {node.name!r} (FlexAttention): Q, K and V are required")
    names = [name for name in _MODS if name in node.attributes]
    graphs = [node.attributes[name].as_graph() for name in names]
    for name, graph in zip(names, graphs):
        if len(graph.inputs) != 1 or len(graph.outputs) != 1:
            raise LoweringError(f"op {node.name!r} (FlexAttention): {name} must take and return one tensor")
    codes, captured = lowering.subgraphs(node, graphs, phys) if graphs else ([], [])
    mods = {name: Subgraph(code, 1, _specs(graph)) for name, code, graph in zip(names, codes, graphs)}
    attrs = node.attributes
    scale = float(attrs["scale"].value) if "scale" in attrs else None
    precision = int(attrs["softmax_precision"].value) if "softmax_precision" in attrs else None
    module = FlexAttention(mods, scale=scale, softmax_precision=precision)
    args = [lowering.on(val, phys) for val in ins[:3]]
    _call(lowering, node, module, [*args, *captured], _dynamic(graphs) if graphs else None)
    return True


def _rule(
    Q: Tensor,
    K: Tensor,
    V: Tensor,
    *,
    scale: float | None = None,
    softmax_precision: int | None = None,
    score_mod: Callable[[Tensor], Tensor] | None = None,
    prob_mod: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """:func:`flex_attention` with the ONNX attributes (the rule's signature; the lowering
    emits a :class:`FlexAttention` module holding the subgraphs)."""
    return flex_attention(
        Q, K, V, scale=scale, softmax_precision=softmax_precision, score_mod=score_mod, prob_mod=prob_mod
    )


op("FlexAttention", _rule, domain="ai.onnx.preview", foldable=False, emit=_lower)

__all__ = ["FlexAttention", "flex_attention"]
