"""Recurrent-state sequence mixers of the newest opset: ``LinearAttention`` and
``CausalConvWithState``, the building blocks of linear-attention / state-space LLM layers.

``LinearAttention`` keeps a per-head state ``S`` (``[batch, kv_heads, d_k, d_v]``) and, step
by step, optionally decays it (``gated``: ``S *= exp(decay_t)``, per head or per key
feature), optionally corrects the value (``delta``: ``v_t = beta_t * (v_t - S^T k_t)``),
writes ``S += k_t v_t^T`` and reads ``o_t = scale * q_t S`` (query heads share their KV
head's state, grouped-query style). Everything is computed in float32 and cast back to
the query's type (the state to ``past_state``'s), as ONNX's reference does. ``chunk_size``
is a tuning hint without effect on the result.

``CausalConvWithState`` is a depthwise causal 1-D convolution whose left context is the
``past_state`` (zeros when absent), optionally followed by SiLU; it returns the output and
the last ``k - 1`` input positions as the next state.

Example:
    >>> import torch
    >>> from placement.lowering.ops.recurrent_state import causal_conv_with_state
    >>> x, w = torch.arange(4.0).reshape(1, 1, 4), torch.ones(1, 1, 2)
    >>> y, state = causal_conv_with_state(x, w)
    >>> y.tolist(), state.tolist()
    ([[[0.0, 1.0, 3.0, 5.0]]], [[[3.0]]])
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, op

_RULES = ("linear", "gated", "delta", "gated_delta")


def _heads(x: Tensor, heads: int) -> Tensor:
    """``(B, T, H*D)`` -> ``(B, H, T, D)`` in float32."""
    b, t, hd = x.shape
    if hd % heads:
        raise LoweringError(f"LinearAttention: last dim {hd} is not divisible by {heads} heads")
    return x.reshape(b, t, heads, hd // heads).transpose(1, 2).float()


def _per_step(
    x: Tensor | None, kv_heads: int, d_k: int, name: str, allowed: tuple[int, ...]
) -> Tensor | None:
    """``decay``/``beta`` ``(B, T, n)`` -> ``(B, heads or 1, T, n // heads or 1)`` float32."""
    if x is None:
        return None
    b, t, last = x.shape
    if last not in allowed:
        raise LoweringError(f"LinearAttention: {name} last dim {last} is not one of {allowed}")
    if last == kv_heads * d_k and last != kv_heads:
        return _heads(x, kv_heads)
    return x.reshape(b, t, last, 1).transpose(1, 2).float()


@op("LinearAttention", foldable=False)
def linear_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    past_state: Tensor | None = None,
    decay: Tensor | None = None,
    beta: Tensor | None = None,
    *,
    chunk_size: int | None = None,
    kv_num_heads: int | None = None,
    q_num_heads: int | None = None,
    scale: float | None = None,
    update_rule: str = "gated_delta",
    num_outputs: int = 2,
) -> Any:
    """ONNX LinearAttention (see the module docstring): ``(output, present_state)``."""
    if update_rule not in _RULES:
        raise LoweringError(f"LinearAttention: update_rule={update_rule!r} is not one of {_RULES}")
    if not q_num_heads or not kv_num_heads or q_num_heads % kv_num_heads:
        raise LoweringError(f"LinearAttention: q_num_heads={q_num_heads}, kv_num_heads={kv_num_heads}")
    gating, delta = update_rule in ("gated", "gated_delta"), update_rule in ("delta", "gated_delta")
    if gating != (decay is not None) or delta != (beta is not None):
        raise LoweringError(
            f"LinearAttention: update_rule={update_rule!r} does not match the decay/beta inputs"
        )
    b, t, _ = query.shape
    q, k, v = _heads(query, q_num_heads), _heads(key, kv_num_heads), _heads(value, kv_num_heads)
    d_k, d_v, group = q.shape[-1], v.shape[-1], q_num_heads // kv_num_heads
    g = _per_step(decay, kv_num_heads, d_k, "decay", (kv_num_heads, kv_num_heads * d_k))
    bt = _per_step(beta, kv_num_heads, d_k, "beta", (kv_num_heads, 1))
    if past_state is not None:
        state = past_state.float()
    else:
        state = torch.zeros((b, kv_num_heads, d_k, d_v), dtype=torch.float32, device=query.device)
    factor = 1.0 / math.sqrt(d_k) if not scale else float(scale)
    outputs = []
    for i in range(t):
        k_t, v_t = k[:, :, i], v[:, :, i]
        if g is not None:
            state = state * torch.exp(g[:, :, i]).unsqueeze(-1)
        if bt is not None:
            v_t = bt[:, :, i] * (v_t - torch.einsum("bhdm,bhd->bhm", state, k_t))
        state = state + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        read = state.repeat_interleave(group, dim=1) if group > 1 else state
        outputs.append(factor * torch.einsum("bhd,bhdm->bhm", q[:, :, i], read))
    out = torch.stack(outputs, 2) if outputs else q.new_zeros((b, q_num_heads, 0, d_v))
    output = out.transpose(1, 2).reshape(b, t, q_num_heads * d_v).to(query.dtype)
    present = state.to(past_state.dtype if past_state is not None else query.dtype)
    return output if num_outputs == 1 else (output, present)


@op("CausalConvWithState")
def causal_conv_with_state(
    input: Tensor,  # noqa: A002 - the ONNX input's name
    weight: Tensor,
    bias: Tensor | None = None,
    past_state: Tensor | None = None,
    *,
    activation: str = "none",
    num_outputs: int = 2,
) -> Any:
    """ONNX CausalConvWithState (see the module docstring): ``(output, present_state)``."""
    if activation not in ("none", "silu", "swish"):
        raise LoweringError(f"CausalConvWithState: activation={activation!r} is not none, silu or swish")
    if input.dim() != 3 or weight.dim() != 3:
        raise LoweringError("CausalConvWithState: input and weight must be rank 3")
    batch, channels, length = input.shape
    k = weight.shape[2]
    pad = past_state if past_state is not None else input.new_zeros((batch, channels, k - 1))
    padded = torch.cat([pad.to(input.dtype), input], 2)
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    out = F.conv1d(
        padded.to(compute), weight.to(compute), None if bias is None else bias.to(compute), groups=channels
    )
    out = out.to(input.dtype)
    if activation != "none":
        wide = out.float()
        out = (wide * torch.sigmoid(wide)).to(input.dtype)
    present = padded[:, :, padded.shape[2] - (k - 1) :]
    return out if num_outputs == 1 else (out, present)


__all__ = ["linear_attention", "causal_conv_with_state"]
