"""Pooling ops: ``MaxPool``, ``AveragePool``, ``LpPool``, their global forms, and ``MaxUnpool``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from placement.lowering.ops._registry import (
    IntsLike,
    Tensor,
    _ints,
    _torch_pads,
    op,
)
from placement.lowering.ops.conv import _CONV, _spatial_pads, _symmetric

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _onnx_indices(
    indices: Any, pooled: Sequence[int], spatial: Sequence[int], begins: Sequence[int], storage_order: int
) -> Any:
    """torch's flat indices within each (N, C) plane of the pooled (maybe padded) input ->
    ONNX's: flat over the whole unpadded input ``(N, C, *spatial)``, in row-major order, or
    with the spatial axes column-major (``storage_order=1``)."""
    planes = indices.shape[0] * indices.shape[1]
    plane = math.prod(spatial)
    offset = (torch.arange(planes, device=indices.device) * plane).reshape(
        indices.shape[:2] + (1,) * (indices.dim() - 2)
    )
    coords, rest = [], indices
    for size in reversed(pooled):
        coords.append(rest % size)
        rest = rest // size
    coords = [c - b for c, b in zip(reversed(coords), begins)]
    axes = list(zip(coords, spatial))
    flat = torch.zeros_like(indices)
    for coord, size in reversed(axes) if storage_order else axes:
        flat = flat * size + coord
    return offset + flat


@op("MaxPool")
def max_pool(
    X: Tensor,
    *,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    dilations: Sequence[int] | None = None,
    kernel_shape: Sequence[int],
    pads: Sequence[int] | None = None,
    storage_order: int = 0,
    strides: Sequence[int] | None = None,
    num_outputs: int = 1,
) -> Any:
    """ONNX MaxPool (1-3 spatial dims); ``Indices`` are flat per (N, C) like ONNX."""
    n = len(kernel_shape)
    strides = list(strides or [1] * n)
    dilations = list(dilations or [1] * n)
    p = _spatial_pads(X.shape[2:], kernel_shape, strides, dilations, pads, auto_pad)
    fits = _symmetric(p) and all(v <= k // 2 for v, k in zip(p[:n], kernel_shape))
    spatial = list(X.shape[2:])
    if fits:
        padding: Any = p[:n]
    else:
        X, padding = F.pad(X, _torch_pads(p, X.dim()), value=-math.inf), 0
    out = _MAX_POOL[n](
        X, list(kernel_shape), strides, padding, dilations, bool(ceil_mode), return_indices=num_outputs > 1
    )
    if num_outputs > 1:
        values, indices = out
        begins = [0] * n if fits else p[:n]
        return values, _onnx_indices(indices, list(X.shape[2:]), spatial, begins, storage_order)
    return out


def _dilated_sums(
    values: Tensor,
    X: Tensor,
    kernel_shape: Sequence[int],
    strides: list[int],
    dilations: Sequence[int] | None,
    pads: Sequence[int] | None,
    auto_pad: str,
    ceil_mode: int,
    count_include_pad: int,
) -> tuple[Tensor, Tensor] | None:
    """Window sums of ``values`` and their counts when ``dilations`` are not all 1 (``None``
    otherwise), padded as ``X`` is by ``pads``/``auto_pad``."""
    if not dilations or all(d == 1 for d in dilations):
        return None
    p = _spatial_pads(X.shape[2:], kernel_shape, strides, list(dilations), pads, auto_pad)
    return _dilated_window_sums(
        values, kernel_shape, strides, list(dilations), p, bool(ceil_mode), bool(count_include_pad)
    )


@op("AveragePool")
def average_pool(
    X: Tensor,
    *,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    count_include_pad: int = 0,
    dilations: Sequence[int] | None = None,
    kernel_shape: Sequence[int],
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> Tensor:
    """ONNX AveragePool (1-3 spatial dims, ``count_include_pad``, asymmetric pads, dilations)."""
    n = len(kernel_shape)
    strides = list(strides or [1] * n)
    dilated = _dilated_sums(
        X, X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, count_include_pad
    )
    if dilated is not None:
        return dilated[0] / dilated[1]
    p = _spatial_pads(X.shape[2:], kernel_shape, strides, [1] * n, pads, auto_pad)
    if _symmetric(p) and all(v <= k // 2 for v, k in zip(p[:n], kernel_shape)):
        return _AVG_POOL[n](X, list(kernel_shape), strides, p[:n], bool(ceil_mode), bool(count_include_pad))
    padded = F.pad(X, _torch_pads(p, X.dim()))
    sums = _AVG_POOL[n](padded, list(kernel_shape), strides, 0, bool(ceil_mode), True)
    if count_include_pad:
        return sums
    ones = F.pad(torch.ones_like(X[:1, :1]), _torch_pads(p, X.dim()))
    counts = _AVG_POOL[n](ones, list(kernel_shape), strides, 0, bool(ceil_mode), True)
    return sums / counts


def _dilated_window_sums(
    X: Tensor,
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
) -> tuple[Tensor, Tensor]:
    """Sums of ``X`` over dilated pooling windows and how many elements each average divides by.

    The geometry is ONNX Runtime's: the output length, floor or ceil (a last window must
    start inside the input or its leading padding), then the extra padding a ceiled last
    window needs at the end; padding counts only up to the explicitly padded extent.
    (ONNX's reference splits that extra padding between both ends, which shifts the
    windows when it is 2 or more; ONNX Runtime does not.)
    """
    n = len(kernel)
    begins, ends = list(pads[:n]), []
    for i, (size, k, s, d) in enumerate(zip(X.shape[2:], kernel, strides, dilations)):
        pb, pe = pads[i], pads[n + i]
        length = (size + pb + pe - d * (k - 1) - 1) / s + 1
        out = math.ceil(length) if ceil_mode else math.floor(length)
        if ceil_mode and (out - 1) * s >= size + pb:
            out -= 1
        ends.append(pe + max((out - 1) * s + (k - 1) * d + 1 - size - pb - pe, 0))
    ones = torch.ones((1, 1, *kernel), dtype=X.dtype, device=X.device)
    # the reference reads a window's elements only below the explicitly padded extent
    extent = [size + pads[i] + pads[n + i] for i, size in enumerate(X.shape[2:])]
    kept = torch.ones((1, 1, *extent), dtype=X.dtype, device=X.device)
    kept = F.pad(
        kept,
        _torch_pads(
            [0] * n + [b + e - p - q for b, e, p, q in zip(begins, ends, pads[:n], pads[n:])], X.dim()
        ),
    )
    real = F.pad(
        torch.ones((1, 1, *X.shape[2:]), dtype=X.dtype, device=X.device), _torch_pads(begins + ends, X.dim())
    )
    flat = F.pad(X.reshape(-1, 1, *X.shape[2:]), _torch_pads(begins + ends, X.dim())) * kept
    sums = _CONV[n](flat, ones, None, list(strides), 0, list(dilations))
    sums = sums.reshape(*X.shape[:2], *sums.shape[2:])
    counts = _CONV[n](
        kept if count_include_pad else kept * real, ones, None, list(strides), 0, list(dilations)
    )
    return sums, counts


@op("GlobalAveragePool")
def global_average_pool(X: Tensor) -> Tensor:
    """ONNX GlobalAveragePool: mean over the spatial dims, kept."""
    return X.mean(dim=tuple(range(2, X.dim())), keepdim=True)


@op("GlobalMaxPool")
def global_max_pool(X: Tensor) -> Tensor:
    """ONNX GlobalMaxPool: max over the spatial dims, kept."""
    return X.amax(dim=tuple(range(2, X.dim())), keepdim=True)


@op("LpPool")
def lp_pool(
    X: Tensor,
    *,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    dilations: Sequence[int] | None = None,
    kernel_shape: Sequence[int],
    p: int = 2,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> Tensor:
    """ONNX LpPool: ``(sum |x|^p)^(1/p)`` per window, zero padding, dilations."""
    n = len(kernel_shape)
    strides = list(strides or [1] * n)
    dilated = _dilated_sums(X.abs() ** p, X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, 0)
    if dilated is not None:
        return dilated[0] ** (1.0 / p)
    pad = _spatial_pads(X.shape[2:], kernel_shape, strides, [1] * n, pads, auto_pad)
    padded = F.pad(X.abs() ** p, _torch_pads(pad, X.dim()))
    window = math.prod(kernel_shape)
    sums = _AVG_POOL[n](padded, list(kernel_shape), strides, 0, bool(ceil_mode), True) * window
    return sums ** (1.0 / p)


@op("GlobalLpPool")
def global_lp_pool(X: Tensor, *, p: int = 2) -> Tensor:
    """ONNX GlobalLpPool: the p-norm over the spatial dims, kept."""
    dims = tuple(range(2, X.dim()))
    return (X.abs() ** p).sum(dims, keepdim=True) ** (1.0 / p)


@op("MaxUnpool", shape_inputs=(2,))
def max_unpool(
    X: Tensor,
    I: Tensor,  # noqa: E741
    output_shape: IntsLike = None,
    *,
    kernel_shape: Sequence[int],
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> Tensor:
    """ONNX MaxUnpool: scatter ``X`` to the flat positions ``I`` of the output."""
    n = len(kernel_shape)
    strides = list(strides or [1] * n)
    pad = list(pads or [0] * (2 * n))
    default = [
        (size - 1) * s - pad[i] - pad[i + n] + k
        for i, (size, s, k) in enumerate(zip(X.shape[2:], strides, kernel_shape))
    ]
    shape = _ints(output_shape) if output_shape is not None else [*X.shape[:2], *default]
    # indices address the default-shaped plane: re-address them in the requested one
    flat = I.long().reshape(X.shape[0], X.shape[1], -1) % math.prod(default)
    index = torch.zeros_like(flat)
    stride_have, stride_want = 1, 1
    for size, want in zip(reversed(default), reversed(shape[2:])):
        index = index + (flat // stride_have % size) * stride_want
        stride_have, stride_want = stride_have * size, stride_want * want
    out = torch.zeros(shape[0], shape[1], math.prod(shape[2:]), dtype=X.dtype, device=X.device)
    out = out.scatter(2, index, X.reshape(X.shape[0], X.shape[1], -1))
    return out.reshape(shape)
