"""ONNX Runtime's attention ops: ``com.microsoft`` GroupQueryAttention and MultiHeadAttention.

Each rule computes what ORT's CPU kernel computes (tests compare them with ONNX
Runtime on small random inputs, KV caches included) and refuses with
:class:`~placement.errors.LoweringError` what it does not implement (quantized
KV caches, sliding-window cache buffers, packed batches...).

GroupQueryAttention, per sequence ``b`` with ``T_b = seqlens_k[b] + 1`` tokens so far:
the first prompt (``sequence_length == total_sequence_length``) starts at
position 0; later steps append their ``S`` tokens at ``T_b - S``. With
``do_rotary=1`` the queries and keys rotate at those positions first. The present cache is
``max(total_sequence_length, past length)`` long: the first ``T_b - S`` past rows,
then the new keys, then zeros. A query at position ``p`` attends to the keys at
``0..p`` (the last ``local_window_size`` of them with a window).

Example:
    >>> import torch
    >>> from placement.lowering.ops import get_rule
    >>> q = torch.randn(1, 3, 4 * 8 + 2 * 2 * 8)  # packed QKV: 4 query heads, 2 KV heads
    >>> seqlens, total = torch.tensor([2], dtype=torch.int32), torch.tensor(3, dtype=torch.int32)
    >>> out, k, v = get_rule("GroupQueryAttention", "com.microsoft").fn(
    ...     q, None, None, None, None, seqlens, total, num_heads=4, kv_num_heads=2, num_outputs=3)
    >>> out.shape, k.shape
    (torch.Size([1, 3, 32]), torch.Size([1, 2, 3, 8]))
"""

from __future__ import annotations

import math
from typing import Any

import torch

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, _scalar, op
from placement.lowering.ops.contrib import rotate

__all__ = ["group_query_attention", "multi_head_attention"]


def _bnsh(x: Tensor, heads: int) -> Tensor:
    """``(B, S, heads * H)`` -> ``(B, heads, S, H)``."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(1, 2)


def _softmax(scores: Tensor, allowed: Tensor, sink: Tensor | None) -> Tensor:
    """Softmax over the allowed keys (0 elsewhere); a sink logit per head joins the
    denominator (smooth softmax: a sink of 0)."""
    scores = scores.masked_fill(~allowed, -math.inf)
    if sink is not None:
        sinks = sink.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat((scores, sinks), -1)
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    weights = torch.exp(scores - top)
    probs = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    return probs[..., : allowed.shape[-1]] if sink is not None else probs


def _gqa_refusals(attrs: dict[str, Any]) -> str | None:
    quantized = any(attrs.get(k, "NONE") not in ("NONE", b"NONE") for k in ("k_quant_type", "v_quant_type"))
    if quantized or attrs.get("kv_cache_bit_width", 0):
        return "GroupQueryAttention with a quantized KV cache"
    if attrs.get("sliding_window_cache", 0):
        return "GroupQueryAttention with sliding_window_cache=1 (window-sized cache buffers)"
    if attrs.get("causal", 1) != 1:
        return "GroupQueryAttention with causal=0"
    if attrs.get("qk_output", 0):
        return "GroupQueryAttention with qk_output != 0"
    return None


def _gqa_positions(seqlens: Tensor, seq: int, first_prompt: bool) -> tuple[Tensor, Tensor]:
    """Per (batch, step) rotary positions, and per batch where the new tokens start."""
    steps = torch.arange(seq, device=seqlens.device).reshape(1, seq)
    lengths = seqlens.reshape(-1, 1) + 1
    if first_prompt:
        return steps.expand(lengths.shape[0], seq), torch.zeros_like(seqlens)
    start = lengths - seq
    return start + steps, start.reshape(-1)


def _gqa_present(past: Tensor | None, new: Tensor, start: Tensor, length: int) -> Tensor:
    """The present cache: past rows before ``start[b]``, the new rows from it, zeros after."""
    b, heads, seq, size = new.shape
    t = torch.arange(length, device=new.device).reshape(1, length)
    offset = t - start.reshape(b, 1)
    from_new = (offset >= 0) & (offset < seq)
    index = offset.clamp(0, seq - 1).reshape(b, 1, length, 1).expand(b, heads, length, size)
    present = torch.where(
        from_new.reshape(b, 1, length, 1), new.gather(2, index), torch.zeros((), dtype=new.dtype)
    )
    if past is not None and past.shape[2] > 0:
        rows = past[:, :, :length]
        if rows.shape[2] < length:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, length - rows.shape[2]))
        from_past = (offset < 0).reshape(b, 1, length, 1)
        present = torch.where(from_past, rows.to(new.dtype), present)
    return present


@op("GroupQueryAttention", domain="com.microsoft", check=_gqa_refusals)
def group_query_attention(
    query: Tensor,
    key: Tensor | None = None,
    value: Tensor | None = None,
    past_key: Tensor | None = None,
    past_value: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    total_sequence_length: Any = None,
    cos_cache: Tensor | None = None,
    sin_cache: Tensor | None = None,
    position_ids: Tensor | None = None,
    attention_bias: Tensor | None = None,
    head_sink: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None,
    *,
    num_heads: int,
    kv_num_heads: int,
    scale: float = 0.0,
    softcap: float = 0.0,
    do_rotary: int = 0,
    rotary_interleaved: int = 0,
    local_window_size: int = -1,
    smooth_softmax: int = 0,
    num_outputs: int = 3,
    causal: int = 1,
    qk_output: int = 0,
    kv_cache_bit_width: int = 0,
    k_quant_type: str = "NONE",
    v_quant_type: str = "NONE",
    sliding_window_cache: int = 0,
    qk_norm_epsilon: float = 1e-6,
) -> Any:
    """ORT's GroupQueryAttention (see the module docstring for the cache layout)."""
    extra = (position_ids, attention_bias, k_scale, v_scale, q_norm_weight, k_norm_weight)
    if any(t is not None for t in extra):
        raise LoweringError(
            "GroupQueryAttention with position_ids, attention_bias, KV scales or Q/K norm weights "
            "has no torch lowering"
        )
    if seqlens_k is None or total_sequence_length is None:
        raise LoweringError("GroupQueryAttention needs seqlens_k and total_sequence_length")
    batch, seq = query.shape[:2]
    if key is None:
        size = query.shape[2] // (num_heads + 2 * kv_num_heads)
        q, key, value = query.split([num_heads * size, kv_num_heads * size, kv_num_heads * size], dim=2)
    else:
        q = query
    q, k, v = _bnsh(q, num_heads), _bnsh(key, kv_num_heads), _bnsh(value, kv_num_heads)
    total = int(_scalar(total_sequence_length))
    first_prompt = seq == total
    seqlens = seqlens_k.to(torch.int64).to(query.device).reshape(-1)
    positions, start = _gqa_positions(seqlens, seq, first_prompt)
    if do_rotary:
        if cos_cache is None or sin_cache is None:
            raise LoweringError("GroupQueryAttention with do_rotary=1 needs cos_cache and sin_cache")
        cos, sin = cos_cache[positions], sin_cache[positions]
        q = rotate(q, cos, sin, interleaved=bool(rotary_interleaved))
        k = rotate(k, cos, sin, interleaved=bool(rotary_interleaved))
    length = max(total, past_key.shape[2] if past_key is not None else 0)
    present_key = _gqa_present(past_key, k, start, length)
    present_value = _gqa_present(past_value, v, start, length)
    alpha = scale if scale != 0.0 else 1.0 / math.sqrt(q.shape[-1])
    group = num_heads // kv_num_heads
    keys = present_key.float().repeat_interleave(group, 1)
    values = present_value.float().repeat_interleave(group, 1)
    scores = (q.float() @ keys.transpose(-1, -2)) * alpha
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = (start.reshape(batch, 1) + torch.arange(seq, device=query.device)).reshape(batch, 1, seq, 1)
    key_pos = torch.arange(length, device=query.device).reshape(1, 1, 1, length)
    allowed = key_pos <= query_pos
    if local_window_size > 0:
        allowed = allowed & (key_pos > query_pos - local_window_size)
    sink = head_sink if head_sink is not None else (torch.zeros(num_heads) if smooth_softmax else None)
    probs = _softmax(scores, allowed, sink.to(query.device) if sink is not None else None)
    out = (probs @ values).to(query.dtype).transpose(1, 2).reshape(batch, seq, -1)
    return (out, present_key, present_value)[:num_outputs] if num_outputs > 1 else out


def _mha_mask(mask: Tensor, batch: int, seq: int, kv_len: int, total: int, filler: float) -> Tensor:
    """The additive mask of a ``key_padding_mask``, broadcast to ``(B, 1, S, total)``."""
    if mask.dim() == 1:  # key lengths (right padding)
        keep = torch.arange(total, device=mask.device).reshape(1, total) < mask.reshape(-1, 1).long()
        keep = keep.reshape(batch, 1, 1, total)
    elif mask.dim() == 2:
        keep = (mask != 0).reshape(batch, 1, 1, mask.shape[-1])
    elif mask.dim() == 3:
        keep = (mask != 0).reshape(batch, 1, seq, mask.shape[-1])
    else:
        raise LoweringError(f"MultiHeadAttention key_padding_mask of rank {mask.dim()} has no torch lowering")
    if keep.shape[-1] != total:
        raise LoweringError(
            f"MultiHeadAttention key_padding_mask covers {keep.shape[-1]} keys, not {total}: "
            "no torch lowering"
        )
    return torch.zeros(keep.shape, dtype=torch.float32, device=mask.device).masked_fill(~keep, filler)


@op("MultiHeadAttention", domain="com.microsoft")
def multi_head_attention(
    query: Tensor,
    key: Tensor | None = None,
    value: Tensor | None = None,
    bias: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    attention_bias: Tensor | None = None,
    past_key: Tensor | None = None,
    past_value: Tensor | None = None,
    past_sequence_length: Tensor | None = None,
    cache_indirection: Tensor | None = None,
    *,
    num_heads: int,
    unidirectional: int = 0,
    scale: float = 0.0,
    mask_filter_value: float = -10000.0,
    num_outputs: int = 1,
) -> Any:
    """ORT's MultiHeadAttention: separate ``(B, S, D)`` query, key and value (or ``(B, N, L, H)``
    key and value used as they are), optional input-projection bias, key padding mask
    (filled with ``mask_filter_value``), attention bias, past key/value (concatenated)
    and a causal mask (``unidirectional=1``)."""
    if query.dim() != 3 or key is None or value is None or key.dim() == 5:
        raise LoweringError("MultiHeadAttention with packed QKV or KV has no torch lowering")
    if past_sequence_length is not None or cache_indirection is not None:
        raise LoweringError(
            "MultiHeadAttention with a shared KV buffer or beam cache indirection has no torch lowering"
        )
    batch, seq, hidden = query.shape
    size = hidden // num_heads
    if bias is not None:
        q_bias, k_bias, v_bias = bias.split([hidden, hidden, bias.shape[0] - 2 * hidden])
        query = query + q_bias
        if key.dim() == 3:
            key, value = key + k_bias, value + v_bias
    q = _bnsh(query, num_heads)
    k = key if key.dim() == 4 else _bnsh(key, num_heads)
    v = value if value.dim() == 4 else _bnsh(value, num_heads)
    if past_key is not None and key.dim() == 3:
        k, v = torch.cat((past_key, k), 2), torch.cat((past_value, v), 2)
    total = k.shape[2]
    alpha = scale if scale != 0.0 else 1.0 / math.sqrt(size)
    scores = (q.float() @ k.float().transpose(-1, -2)) * alpha
    if key_padding_mask is not None:
        scores = scores + _mha_mask(key_padding_mask, batch, seq, total, total, mask_filter_value)
    if unidirectional:
        past = total - seq
        rows = torch.arange(seq, device=query.device).reshape(seq, 1) + past
        cols = torch.arange(total, device=query.device).reshape(1, total)
        scores = scores.masked_fill(cols > rows, mask_filter_value)
    if attention_bias is not None:
        scores = scores + attention_bias.float()
    probs = torch.softmax(scores, -1)
    out = (probs @ v.float()).to(query.dtype).transpose(1, 2).reshape(batch, seq, -1)
    if num_outputs == 1:
        return out
    return (out, k, v)[:num_outputs]
