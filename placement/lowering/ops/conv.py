"""Convolution ops: ``Conv`` and ``ConvTranspose`` (``F.conv*d``), and the ONNX padding rules they share
with pooling (:func:`_spatial_pads`).

Example:
    >>> _spatial_pads([5], [3], [2], [1], None, "SAME_UPPER")
    [1, 1]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch.nn.functional as F

from placement.lowering.ops._registry import (
    FxCall,
    Shapes,
    Tensor,
    _torch_pads,
    op,
)


def _spatial_pads(
    in_shape: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads: Sequence[int] | None,
    auto_pad: str,
) -> list[int]:
    """ONNX begin/end pads ``[b_1..b_n, e_1..e_n]`` after resolving ``auto_pad``."""
    n = len(kernel)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for size, k, s, d in zip(in_shape, kernel, strides, dilations):
            total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
            small, big = total // 2, total - total // 2
            begins.append(small if auto_pad == "SAME_UPPER" else big)
            ends.append(big if auto_pad == "SAME_UPPER" else small)
        return begins + ends
    if auto_pad == "VALID" or not pads:
        return [0] * (2 * n)
    return list(pads)


def _symmetric(pads: Sequence[int]) -> bool:
    n = len(pads) // 2
    return list(pads[:n]) == list(pads[n:])


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _direct_conv(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    weight = shapes[1] if len(shapes) > 1 else None
    if weight is None or not 3 <= len(weight) <= 5 or kwargs.get("auto_pad", "NOTSET") != "NOTSET":
        return None
    n = len(weight) - 2
    pads = list(kwargs.get("pads") or [0] * (2 * n))
    if not _symmetric(pads):
        return None
    bias = args[2] if len(args) > 2 else None
    call_args = (
        args[0],
        args[1],
        bias,
        tuple(kwargs.get("strides") or [1] * n),
        tuple(pads[:n]),
        tuple(kwargs.get("dilations") or [1] * n),
        kwargs.get("group", 1),
    )
    return "call_function", _CONV[n], call_args, {}


@op("Conv", direct=_direct_conv)
def conv(
    X: Tensor,
    W: Tensor,
    B: Tensor | None = None,
    *,
    auto_pad: str = "NOTSET",
    dilations: Sequence[int] | None = None,
    group: int = 1,
    kernel_shape: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> Tensor:
    """ONNX Conv (1-3 spatial dims, groups, dilations, ``auto_pad``, asymmetric pads)."""
    n = W.dim() - 2
    strides = list(strides or [1] * n)
    dilations = list(dilations or [1] * n)
    p = _spatial_pads(X.shape[2:], W.shape[2:], strides, dilations, pads, auto_pad)
    if _symmetric(p):
        padding: Any = p[:n]
    else:
        X, padding = F.pad(X, _torch_pads(p, X.dim())), 0
    return _CONV[n](X, W, B, strides, padding, dilations, group)


@op("ConvTranspose")
def conv_transpose(
    X: Tensor,
    W: Tensor,
    B: Tensor | None = None,
    *,
    auto_pad: str = "NOTSET",
    dilations: Sequence[int] | None = None,
    group: int = 1,
    kernel_shape: Sequence[int] | None = None,
    output_padding: Sequence[int] | None = None,
    output_shape: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> Tensor:
    """ONNX ConvTranspose (``output_shape``, ``auto_pad``, asymmetric pads by cropping)."""
    n = W.dim() - 2
    strides = list(strides or [1] * n)
    dilations = list(dilations or [1] * n)
    out_pad = list(output_padding or [0] * n)
    kernel = W.shape[2:]
    full = [
        s * (i - 1) + op + (k - 1) * d + 1
        for i, k, s, d, op in zip(X.shape[2:], kernel, strides, dilations, out_pad)
    ]
    if output_shape:
        target = list(output_shape)[-n:]
        totals = [f - t for f, t in zip(full, target)]
        if auto_pad == "SAME_UPPER":
            p = [t // 2 for t in totals] + [t - t // 2 for t in totals]
        else:
            p = [t - t // 2 for t in totals] + [t // 2 for t in totals]
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        totals = [f - i * s for f, i, s in zip(full, X.shape[2:], strides)]
        if auto_pad == "SAME_UPPER":
            p = [t // 2 for t in totals] + [t - t // 2 for t in totals]
        else:
            p = [t - t // 2 for t in totals] + [t // 2 for t in totals]
    else:
        p = list(pads) if pads and auto_pad != "VALID" else [0] * (2 * n)
    fast = _symmetric(p) and min(p, default=0) >= 0
    if fast and all(o < max(s, d) for o, s, d in zip(out_pad, strides, dilations)):
        return _CONV_T[n](X, W, B, strides, p[:n], out_pad, group, dilations)
    # general case: full transposed conv, zero rows for output_padding, crop the pads
    y = _CONV_T[n](X, W, None, strides, 0, 0, group, dilations)
    y = F.pad(y, _torch_pads([0] * n + out_pad, y.dim()))
    y = F.pad(y, _torch_pads([-v for v in p], y.dim()))
    return y if B is None else y + B.reshape(1, -1, *([1] * n))
