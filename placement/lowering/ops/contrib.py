"""ONNX Runtime's own ops in LLM files: normalisations, 4-bit matmuls, rotary embeddings.

Files built by onnxruntime-genai's model builder (and Olive, ORT's transformer
optimizer) hold ORT's ops: ``SimplifiedLayerNormalization`` in the default domain,
and in ``com.microsoft`` ``SkipSimplifiedLayerNormalization``, ``MatMulNBits`` and
``RotaryEmbedding`` (here) and the attention ops (:mod:`.contrib_attention`). Each
rule computes what ORT's CPU kernel computes (checked against ONNX Runtime by the
tests) and refuses with :class:`~placement.errors.LoweringError` the attribute
combinations it does not implement.

Example:
    >>> import torch
    >>> from placement.lowering.ops import get_rule
    >>> x = torch.tensor([[3.0, 4.0]])
    >>> get_rule("SimplifiedLayerNormalization").fn(x, torch.ones(2), epsilon=0.0)
    tensor([[0.8485, 1.1314]])
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, _axis, op, torch_dtype

__all__ = [
    "simplified_layer_normalization",
    "skip_simplified_layer_normalization",
    "matmul_nbits",
    "dequantize_nbits",
    "rotary_embedding_ms",
    "rotate",
]


def _rms(x: Tensor, dims: tuple[int, ...], epsilon: float) -> Tensor:
    """``sqrt(mean(x^2) + eps)`` over ``dims`` (ORT divides by it, then scales)."""
    return torch.sqrt((x * x).mean(dims, keepdim=True) + epsilon)


@op("SimplifiedLayerNormalization")
def simplified_layer_normalization(
    X: Tensor,
    scale: Tensor,
    *,
    axis: int = -1,
    epsilon: float = 1e-5,
    stash_type: int = 1,
    num_outputs: int = 1,
) -> Any:
    """ORT's SimplifiedLayerNormalization (RMS norm): ``x / sqrt(mean(x^2) + eps) * scale``.

    Computed in the stash type (float32), as ORT's CPU kernel does; the second
    output is ``1 / sqrt(mean(x^2) + eps)``.
    """
    dims = tuple(range(_axis(axis, X.dim()), X.dim()))
    compute = X.to(torch_dtype(stash_type))
    rms = _rms(compute, dims, epsilon)
    y = (compute / rms * scale.to(compute.dtype)).to(X.dtype)
    return y if num_outputs == 1 else (y, 1.0 / rms)


@op("SkipSimplifiedLayerNormalization", domain="com.microsoft")
def skip_simplified_layer_normalization(
    input: Tensor,  # noqa: A002
    skip: Tensor,
    gamma: Tensor,
    bias: Tensor | None = None,
    *,
    epsilon: float = 1e-12,
    num_outputs: int = 1,
) -> Any:
    """ORT's SkipSimplifiedLayerNormalization: RMS norm of ``input + skip (+ bias)``.

    Outputs: the normalised sum, ``mean`` (never computed by ORT for the simplified
    form: zeros), ``inv_std_var`` and the sum itself (``input_skip_bias_sum``).
    """
    dtype = input.dtype
    total = input.float() + skip.float()
    if bias is not None:
        total = total + bias.float()
    rms = _rms(total, (-1,), epsilon)
    y = (total / rms * gamma.float()).to(dtype)
    if num_outputs == 1:
        return y
    inv = 1.0 / rms
    results = (y, torch.zeros_like(inv), inv, total.to(dtype))
    return results[:num_outputs]


def _unpack_codes(packed: Tensor, bits: int) -> Tensor:
    """uint8 bytes -> their ``bits``-wide codes along the last dim, low bits first."""
    if bits == 8:
        return packed.to(torch.int32)
    per_byte = 8 // bits
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def dequantize_nbits(
    B: Tensor, scales: Tensor, zero_points: Tensor | None, *, K: int, N: int, bits: int, block_size: int
) -> Tensor:
    """The float ``(N, K)`` weight of a ``MatMulNBits``: ``(code - zero_point) * scale`` per block.

    ``B`` is ``(N, k_blocks, block_size * bits / 8)`` uint8, codes packed low bits
    first along K; ``scales`` is ``(N, k_blocks)``; ``zero_points`` is packed uint8
    ``(N, ceil(k_blocks * bits / 8))`` or unpacked in the scales' type ``(N, k_blocks)``,
    and defaults to ``2^(bits - 1)``.
    """
    blocks = -(-K // block_size)
    codes = _unpack_codes(B.reshape(N, blocks, -1), bits).reshape(N, blocks, -1)[..., :block_size]
    scale = scales.reshape(N, blocks).float()
    if zero_points is None:
        zero = torch.full((N, blocks), float(1 << (bits - 1)), device=B.device)
    elif zero_points.dtype == torch.uint8:
        zero = _unpack_codes(zero_points.reshape(N, -1), bits)[:, :blocks].float()
    else:
        zero = zero_points.reshape(N, blocks).float()
    weight = (codes.float() - zero.unsqueeze(-1)) * scale.unsqueeze(-1)
    return weight.reshape(N, blocks * block_size)[:, :K]


#: Dequantized weights by their packed tensor: a lowered module's ``B`` is the same parameter
#: every call, so its float weight is made once (while nothing asks for gradients).
#: (Keyed by ``id``: tensors compare elementwise, so they cannot be weak dictionary keys.)
_DEQUANTIZED: dict[int, tuple[Any, ...]] = {}


def _weight(B: Tensor, scales: Tensor, zero_points: Tensor | None, **attrs: int) -> Tensor:
    """:func:`dequantize_nbits`, cached per packed tensor while its inputs are the same tensors,
    unchanged (their versions), and no gradient can flow to the scales or zero points."""
    grads = scales.requires_grad or (zero_points is not None and zero_points.requires_grad)
    if torch.is_grad_enabled() and grads:
        return dequantize_nbits(B, scales, zero_points, **attrs)
    parts = (B, scales) if zero_points is None else (B, scales, zero_points)
    versions = tuple(t._version for t in parts) + tuple(sorted(attrs.items()))
    cached = _DEQUANTIZED.get(id(B))
    if cached is not None:
        refs, seen, weight = cached
        if len(refs) == len(parts) and all(r() is t for r, t in zip(refs, parts)) and seen == versions:
            return weight
    weight = dequantize_nbits(B, scales, zero_points, **attrs)
    if cached is None:  # the entry goes when the packed tensor does
        weakref.finalize(B, _DEQUANTIZED.pop, id(B), None)
    _DEQUANTIZED[id(B)] = (tuple(weakref.ref(t) for t in parts), versions, weight)
    return weight


def _int8_blocks(A: Tensor, block_size: int) -> Tensor:
    """``A`` as ORT's CPU kernel sees it at ``accuracy_level=4``: quantized to int8 per
    block of ``block_size`` along K (symmetric, scale ``max|a| / 127``), dequantized."""
    K = A.shape[-1]
    blocks = -(-K // block_size)
    padded = torch.nn.functional.pad(A.float(), (0, blocks * block_size - K))
    rows = padded.reshape(*A.shape[:-1], blocks, block_size)
    scale = rows.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
    q = torch.round(rows * inverse).clamp(-127, 127)
    return (q * scale).reshape(*A.shape[:-1], blocks * block_size)[..., :K]


def _check_nbits(attrs: dict[str, Any]) -> str | None:
    if attrs.get("bits", 4) not in (2, 4, 8):
        return f"MatMulNBits with bits={attrs.get('bits')} (ONNX Runtime takes 2, 4 and 8)"
    if attrs.get("weight_prepacked", 0):
        return "MatMulNBits with weights prepacked for a CUDA kernel (weight_prepacked != 0)"
    return None


@op("MatMulNBits", domain="com.microsoft", check=_check_nbits)
def matmul_nbits(
    A: Tensor,
    B: Tensor,
    scales: Tensor,
    zero_points: Tensor | None = None,
    g_idx: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    K: int,
    N: int,
    block_size: int,
    bits: int = 4,
    accuracy_level: int = 0,
    weight_prepacked: int = 0,
) -> Tensor:
    """ORT's MatMulNBits: ``A @ dequantize(B)^T (+ bias)`` with block-wise quantized weights.

    At ``accuracy_level=4`` ORT's CPU kernel quantizes ``A`` to int8 per block before
    the product (integer dot products scaled back); this rule computes the same
    values in float (:func:`_int8_blocks`).
    """
    if g_idx is not None and g_idx.numel() > 0:
        raise LoweringError(
            "MatMulNBits with a g_idx input (deprecated in ONNX Runtime) has no torch lowering"
        )
    weight = _weight(B, scales, zero_points, K=K, N=N, bits=bits, block_size=block_size)
    a = _int8_blocks(A, block_size) if accuracy_level == 4 and bits == 4 else A.float()
    out = a @ weight.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(A.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool) -> Tensor:
    """Rotary embedding of ``x`` ``(B, N, S, H)`` with ``cos``/``sin`` ``(B, S, rot/2)``, as
    ORT computes it: the first ``rot`` features rotate (halves, or interleaved pairs),
    the rest pass through."""
    half = cos.shape[-1]
    rot = 2 * half
    head, rest = x[..., :rot], x[..., rot:]
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
    else:
        x1, x2 = head[..., :half], head[..., half:]
    real = x1 * cos - x2 * sin
    imag = x2 * cos + x1 * sin
    if interleaved:
        rotated = torch.stack((real, imag), -1).reshape(head.shape)
    else:
        rotated = torch.cat((real, imag), -1)
    return torch.cat((rotated, rest), -1) if rest.shape[-1] else rotated


def _check_rotary(attrs: dict[str, Any]) -> str | None:
    if attrs.get("is_packed_batching", 0):
        return "com.microsoft RotaryEmbedding with is_packed_batching=1 (ragged batches)"
    return None


@op("RotaryEmbedding", domain="com.microsoft", check=_check_rotary)
def rotary_embedding_ms(
    input: Tensor,  # noqa: A002
    position_ids: Tensor,
    cos_cache: Tensor,
    sin_cache: Tensor,
    *,
    interleaved: int = 0,
    num_heads: int = 0,
    rotary_embedding_dim: int = 0,
    is_packed_batching: int = 0,
    scale: float = 1.0,
) -> Tensor:
    """ORT's com.microsoft RotaryEmbedding (inputs ``input, position_ids, cos_cache, sin_cache``).

    ``input`` is ``(B, S, hidden)`` or ``(B, N, S, H)``; ``position_ids`` is ``(B, S)``
    or one start offset (positions ``start .. start + S - 1``).
    """
    four_d = input.dim() == 4
    batch = input.shape[0]
    seq = input.shape[2] if four_d else input.shape[1]
    if four_d:
        x = input
    else:
        hidden = input.shape[2]
        head = hidden // num_heads if num_heads else cos_cache.shape[1] * 2
        x = input.reshape(batch, seq, hidden // head, head).transpose(1, 2)
    rot = rotary_embedding_dim or x.shape[-1]
    positions = position_ids.long().to(input.device)
    if positions.numel() == 1:
        positions = positions.reshape(1, 1) + torch.arange(seq, device=input.device).reshape(1, seq)
        positions = positions.expand(batch, seq)
    cos = cos_cache[positions][..., : rot // 2]
    sin = sin_cache[positions][..., : rot // 2]
    out = rotate(x, cos, sin, interleaved=bool(interleaved))
    return out if four_d else out.transpose(1, 2).reshape(input.shape)
