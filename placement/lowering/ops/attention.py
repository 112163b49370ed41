"""Attention ops: Attention (opset 23/24), RotaryEmbedding, TensorScatter (opset 24 KV-cache update)."""

from __future__ import annotations

import math
from typing import Any

import torch

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, _axis, op, torch_dtype


def _heads(x: Tensor, heads: int) -> Tensor:
    """``(batch, seq, heads * size)`` -> ``(batch, heads, seq, size)``."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(1, 2)


def _causal_bias(base: Tensor, offset: Any) -> Tensor:
    q, kv = base.shape[-2:]
    i = torch.arange(q, device=base.device).reshape(q, 1)
    j = torch.arange(kv, device=base.device).reshape(1, kv)
    if isinstance(offset, Tensor):
        offsets = offset.reshape(-1, 1, 1).to(base.device)
        allowed = j <= i + offsets
        causal = torch.zeros((), dtype=base.dtype, device=base.device).masked_fill(~allowed, -math.inf)
        return base + causal.reshape(causal.shape[0], 1, q, kv)
    allowed = j <= i + int(offset)
    causal = torch.zeros(allowed.shape, dtype=base.dtype, device=base.device).masked_fill(~allowed, -math.inf)
    return base + causal


def _window_bias(base: Tensor, left: int, right: int, offset: Any) -> Tensor:
    q, kv = base.shape[-2:]
    i = torch.arange(q, device=base.device).reshape(q, 1)
    j = torch.arange(kv, device=base.device).reshape(1, kv)
    per_batch = isinstance(offset, Tensor)
    diff = (i + offset.reshape(-1, 1, 1).to(base.device)) - j if per_batch else (i + int(offset)) - j
    allowed = torch.ones(diff.shape, dtype=torch.bool, device=base.device)
    if left >= 0:
        allowed &= diff <= left
    if right >= 0:
        allowed &= -diff <= right
    window = torch.zeros(allowed.shape, dtype=base.dtype, device=base.device).masked_fill(~allowed, -math.inf)
    if per_batch:
        return base + window.reshape(window.shape[0], 1, q, kv)
    return base + window


@op("Attention")
def attention(
    Q: Tensor,
    K: Tensor,
    V: Tensor,
    attn_mask: Tensor | None = None,
    past_key: Tensor | None = None,
    past_value: Tensor | None = None,
    nonpad_kv_seqlen: Tensor | None = None,
    *,
    is_causal: int = 0,
    kv_num_heads: int | None = None,
    q_num_heads: int | None = None,
    qk_matmul_output_mode: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    softmax_precision: int | None = None,
    left_window_size: int = -1,
    right_window_size: int = -1,
    num_outputs: int = 1,
) -> Any:
    """ONNX Attention: scaled dot-product attention with masks, KV cache, GQA and softcap."""
    rank3 = Q.dim() == 3
    if rank3:
        assert q_num_heads is not None and kv_num_heads is not None
        Q, K, V = _heads(Q, q_num_heads), _heads(K, kv_num_heads), _heads(V, kv_num_heads)
    dtype = Q.dtype
    factor = math.sqrt(1 / math.sqrt(Q.shape[3]) if scale is None else scale)
    present_key = torch.cat((past_key, K), 2) if past_key is not None else K
    present_value = torch.cat((past_value, V), 2) if past_value is not None else V
    K, V = present_key, present_value
    q_len, kv_len = Q.shape[2], K.shape[2]
    bias = torch.zeros((q_len, kv_len), dtype=dtype, device=Q.device)
    mask = attn_mask
    if mask is not None and mask.shape[-1] < kv_len:
        pad = kv_len - mask.shape[-1]
        fill: Any = False if mask.dtype == torch.bool else -math.inf
        mask = torch.nn.functional.pad(mask, (0, pad), value=fill)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=Q.device).masked_fill(~mask, -math.inf)
    if past_key is None and nonpad_kv_seqlen is not None:
        offset: Any = nonpad_kv_seqlen.reshape(-1) - q_len
    else:
        offset = past_key.shape[2] if past_key is not None else 0
    if is_causal:
        base = torch.zeros((q_len, kv_len), dtype=dtype, device=Q.device) if mask is None else mask
        if left_window_size >= 0 or right_window_size >= 0:
            base = torch.zeros((q_len, kv_len), dtype=dtype, device=Q.device) + base
        bias = _causal_bias(base, offset)
    elif mask is not None:
        bias = bias + mask
    if left_window_size >= 0 or right_window_size >= 0:
        bias = _window_bias(bias, left_window_size, right_window_size, offset)
    if nonpad_kv_seqlen is not None:
        keep = torch.arange(kv_len, device=Q.device) < nonpad_kv_seqlen.reshape(-1, 1).to(Q.device)
        padding = torch.zeros(keep.shape, dtype=bias.dtype, device=Q.device).masked_fill(~keep, -math.inf)
        bias = bias + padding.reshape(Q.shape[0], 1, 1, kv_len)
    heads_q = Q.shape[1]
    heads_kv = K.shape[1]
    if heads_q != heads_kv and heads_q % heads_kv == 0 and V.shape[1] == heads_kv:
        K = K.repeat_interleave(heads_q // heads_kv, 1)
        V = V.repeat_interleave(heads_q // heads_kv, 1)
    scale_t = torch.tensor(factor, dtype=dtype)
    scores = (Q * scale_t) @ (K.transpose(-1, -2) * scale_t)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    with_bias = scores + bias
    exposed = scores
    if qk_matmul_output_mode == 2:
        exposed = with_bias
    if softmax_precision is not None:
        with_bias = with_bias.to(torch_dtype(softmax_precision))
    row_max = with_bias.amax(-1, keepdim=True)
    masked_row = torch.isneginf(row_max)
    shifted = torch.exp(with_bias - torch.where(masked_row, torch.zeros_like(row_max), row_max))
    total = shifted.sum(-1, keepdim=True)
    probs = shifted / torch.where(total == 0, torch.ones_like(total), total)
    dead = torch.isneginf(bias.amax(-1, keepdim=True))
    probs = torch.where(dead, torch.zeros((), dtype=probs.dtype, device=probs.device), probs)
    if qk_matmul_output_mode == 3:
        exposed = probs
    out = probs.to(dtype) @ V
    if rank3:
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
    results = (out, present_key, present_value, exposed.to(dtype))
    return results[0] if num_outputs == 1 else results[:num_outputs]


@op("RotaryEmbedding")
def rotary_embedding(
    X: Tensor,
    cos_cache: Tensor,
    sin_cache: Tensor,
    position_ids: Tensor | None = None,
    *,
    interleaved: int = 0,
    num_heads: int = 0,
    rotary_embedding_dim: int = 0,
) -> Tensor:
    """ONNX RotaryEmbedding (opset 23): rotate the first ``rotary_embedding_dim`` features of each head."""
    shape = X.shape
    x = X.transpose(1, 2) if X.dim() == 4 else X.reshape(shape[0], shape[1], num_heads, -1)
    dim = rotary_embedding_dim or x.shape[3]
    rotate, keep = x[..., :dim], x[..., dim:]
    if position_ids is not None:
        cos_cache, sin_cache = cos_cache[position_ids.long()], sin_cache[position_ids.long()]
    cos, sin = cos_cache.unsqueeze(2), sin_cache.unsqueeze(2)
    if interleaved:
        x1, x2 = rotate[..., 0::2], rotate[..., 1::2]
    else:
        x1, x2 = rotate.chunk(2, dim=-1)
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if interleaved:
        rotated = torch.stack((real, imag), -1).reshape(rotate.shape)
    else:
        rotated = torch.cat((real, imag), -1)
    out = torch.cat((rotated, keep), -1)
    return out.reshape(shape) if X.dim() == 3 else out.transpose(1, 2)


@op("TensorScatter")
def tensor_scatter(
    past_cache: Tensor,
    update: Tensor,
    write_indices: Tensor | None = None,
    *,
    axis: int = -2,
    mode: str = "linear",
) -> Tensor:
    """ONNX TensorScatter (opset 24): ``update`` written into ``past_cache`` along ``axis`` from
    each batch row's ``write_indices`` (0 when absent); ``mode="circular"`` wraps around."""
    if mode not in ("linear", "circular"):
        raise LoweringError(f"TensorScatter: mode={mode!r} is not linear or circular")
    axis = _axis(axis, past_cache.dim())
    if axis == 0:
        raise LoweringError("TensorScatter: axis 0 is the batch axis")
    batch, steps, size = update.shape[0], update.shape[axis], past_cache.shape[axis]
    starts = (
        write_indices.to(device=update.device, dtype=torch.int64).reshape(batch, 1)
        if write_indices is not None
        else torch.zeros((batch, 1), dtype=torch.int64, device=update.device)
    )
    positions = starts + torch.arange(steps, device=update.device).reshape(1, steps)
    if mode == "circular":
        positions = positions % size
    shape = [1] * update.dim()
    shape[0], shape[axis] = batch, steps
    index = positions.reshape(shape).expand(update.shape)
    return past_cache.scatter(axis, index, update)
