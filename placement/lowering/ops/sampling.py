"""Resampling ops: ``Resize`` (nearest, linear, cubic, every coordinate transform), ``GridSample``
and ``AffineGrid``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from placement.errors import LoweringError
from placement.lowering.ops._registry import (
    IntsLike,
    Tensor,
    _axis,
    _ints,
    op,
)


def _resize_check(attrs: dict[str, Any]) -> str | None:
    mode = attrs.get("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic"):
        return f"mode={mode!r}"
    if mode == "nearest" and attrs.get("antialias"):
        return "mode='nearest' with antialias=1"
    return None


@op("Resize", shape_inputs=(1, 2, 3), check=_resize_check)
def resize(
    X: Tensor,
    roi: Any = None,
    scales: Any = None,
    sizes: Any = None,
    *,
    antialias: int = 0,
    axes: Sequence[int] | None = None,
    coordinate_transformation_mode: str = "half_pixel",
    cubic_coeff_a: float = -0.75,
    exclude_outside: int = 0,
    extrapolation_value: float = 0.0,
    keep_aspect_ratio_policy: str = "stretch",
    mode: str = "nearest",
    nearest_mode: str = "round_prefer_floor",
) -> Tensor:
    """ONNX Resize, every mode and attribute: ``F.interpolate`` where its weights equal ONNX's,
    otherwise one interpolation matrix per resized axis (antialias, ``tf_crop_and_resize``, ...)."""
    rank = X.dim()
    size_list = _ints(sizes) if sizes is not None else []
    full_sizes, full_scales, full_roi = _resize_geometry(
        X, roi, scales, size_list, axes, keep_aspect_ratio_policy
    )
    ctm = coordinate_transformation_mode
    changed = [
        a
        for a in range(rank)
        if full_sizes[a] != X.shape[a]
        or full_scales[a] != 1.0
        or (ctm == "tf_crop_and_resize" and (full_roi[a], full_roi[rank + a]) != (0.0, 1.0))
    ]
    if mode == "nearest" and ctm not in ("tf_crop_and_resize", "half_pixel_symmetric"):
        out = X
        for a in changed:
            index = _nearest_index(X.shape[a], full_sizes[a], full_scales[a], ctm, nearest_mode, X.device)
            out = out.index_select(a, index)
        return out
    fast = _interpolate_mode(
        X,
        changed,
        full_sizes,
        full_scales,
        mode,
        ctm,
        antialias,
        cubic_coeff_a,
        exclude_outside,
        bool(size_list),
    )
    if fast is not None:
        align = ctm == "align_corners"
        if size_list:
            return F.interpolate(X, size=full_sizes[2:], mode=fast, align_corners=align)
        return F.interpolate(
            X, scale_factor=full_scales[2:], mode=fast, align_corners=align, recompute_scale_factor=False
        )
    compute = X if X.dtype in (torch.float32, torch.float64) else X.to(torch.float32)
    out = compute
    for a in changed:
        weights, outside = _resize_weights(
            X.shape[a],
            full_sizes[a],
            full_scales[a],
            mode,
            ctm,
            (full_roi[a], full_roi[rank + a]),
            bool(antialias),
            float(cubic_coeff_a),
            bool(exclude_outside),
            nearest_mode,
        )
        w = torch.from_numpy(weights).to(device=X.device, dtype=compute.dtype)
        out = torch.movedim(torch.movedim(out, a, -1) @ w.T, -1, a)
        if outside is not None:
            mask = torch.from_numpy(outside).to(X.device).reshape([-1] + [1] * (rank - 1 - a))
            out = out.masked_fill(mask, extrapolation_value)
    if X.dtype == compute.dtype:
        return out
    if not X.dtype.is_floating_point:
        info = torch.iinfo(X.dtype)
        out = torch.round(out).clamp(info.min, info.max)
    return out.to(X.dtype)


def _resize_geometry(
    X: Tensor, roi: Any, scales: Any, size_list: list[int], axes: Sequence[int] | None, policy: str
) -> tuple[list[int], list[float], list[float]]:
    """Resize's output size, scale and region of interest (``[starts..., ends...]``) of every axis."""
    rank = X.dim()
    axes_ = [_axis(a, rank) for a in axes] if axes is not None else list(range(rank))
    scale_list = [
        float(s) for s in (scales.reshape(-1).tolist() if isinstance(scales, Tensor) else scales or [])
    ]
    roi_list = [float(v) for v in (roi.reshape(-1).tolist() if isinstance(roi, Tensor) else roi or [])]
    full_scales = [1.0] * rank
    full_sizes = list(X.shape)
    if size_list:
        for a, s in zip(axes_, size_list):
            full_sizes[a] = s
            full_scales[a] = s / X.shape[a]
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            common = pick(full_scales[a] for a in axes_)
            for a in axes_:
                full_scales[a] = common
                full_sizes[a] = int(common * X.shape[a] + 0.5)
    else:
        for a, s in zip(axes_, scale_list):
            full_scales[a] = s
            full_sizes[a] = int(math.floor(X.shape[a] * s))
    full_roi = [0.0] * rank + [1.0] * rank
    if roi_list:
        for i, a in enumerate(axes_):
            full_roi[a], full_roi[rank + a] = roi_list[i], roi_list[len(axes_) + i]
    return full_sizes, full_scales, full_roi


def _interpolate_mode(
    X: Tensor,
    changed: list[int],
    sizes: list[int],
    scales: list[float],
    mode: str,
    ctm: str,
    antialias: int,
    cubic_coeff_a: float,
    exclude_outside: int,
    by_size: bool,
) -> str | None:
    """The ``F.interpolate`` mode that weighs pixels exactly as ONNX does here, or None."""
    spatial = X.dim() - 2
    if any(a < 2 for a in changed) or not X.dtype.is_floating_point:
        return None
    if antialias and any(scales[a] < 1 for a in changed):
        return None
    if mode == "cubic" and (exclude_outside or cubic_coeff_a != -0.75):
        return None
    if ctm == "align_corners":  # ONNX divides by scale * in_size - 1, torch by out_size - 1
        if not by_size and any(scales[a] * X.shape[a] != sizes[a] for a in changed):
            return None
    elif ctm == "pytorch_half_pixel":
        if any(sizes[a] == 1 for a in changed):
            return None
    elif ctm != "half_pixel":
        return None
    return {
        ("linear", 1): "linear",
        ("linear", 2): "bilinear",
        ("linear", 3): "trilinear",
        ("cubic", 2): "bicubic",
    }.get((mode, spatial))


def _resize_weights(
    in_size: int,
    out_size: int,
    scale: float,
    mode: str,
    ctm: str,
    roi: tuple[float, float],
    antialias: bool,
    a: float,
    exclude_outside: bool,
    nearest_mode: str,
) -> tuple[np.ndarray, np.ndarray | None]:
    """ONNX's 1-D resize along one axis as an ``(out_size, in_size)`` matrix (float64), plus the
    outputs that take ``extrapolation_value`` (``tf_crop_and_resize``).

    Source coordinates are computed as ONNX Runtime computes them, in float32 and from the
    integer output length (ONNX's reference uses ``scale * in_size`` for ``align_corners`` and
    ``tf_crop_and_resize``); the weights follow the reference's kernels.
    """
    f32 = np.float32
    y = np.arange(out_size, dtype=f32)
    s, n_in, n_out = f32(scale), f32(in_size), f32(out_size)
    outside = None
    if ctm == "align_corners":
        x = np.zeros(out_size, f32) if out_size == 1 else y * ((n_in - 1) / (n_out - 1))
    elif ctm == "asymmetric":
        x = y / s
    elif ctm == "tf_crop_and_resize":
        start, end = f32(roi[0]), f32(roi[1])
        if out_size == 1:
            x = np.full(out_size, (end - start) * (n_in - 1) / 2, f32)
        else:
            x = y * (end - start) * (n_in - 1) / (n_out - 1)
        x = x + start * (n_in - 1)
        outside = (x < 0) | (x > n_in - 1)
    elif ctm == "pytorch_half_pixel":
        x = np.zeros(out_size, f32) if out_size == 1 else (y + f32(0.5)) / s - f32(0.5)
    elif ctm == "half_pixel":
        x = (y + f32(0.5)) / s - f32(0.5)
    elif ctm == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - n_out / (s * n_in))
        x = offset + (y + f32(0.5)) / s - f32(0.5)
    elif ctm == "tf_half_pixel_for_nn":
        x = (y + f32(0.5)) / s
    else:
        raise LoweringError(f"Resize: coordinate_transformation_mode={ctm!r} is not an ONNX mode")
    x = x.astype(np.float64)
    base = np.floor(x)
    ratio = np.where(x == base, 1.0, x - base)[:, None]
    s = min(scale, 1.0)
    if mode == "nearest":
        right = {
            "round_prefer_floor": ratio > 0.5,
            "round_prefer_ceil": ratio >= 0.5,
            "floor": np.zeros_like(ratio, dtype=bool),
            "ceil": np.ones_like(ratio, dtype=bool),
        }[nearest_mode] | (ratio == 1.0)
        coeffs = np.concatenate([~right, right], axis=1).astype(np.float64)
    elif mode == "linear" and antialias:
        first = int(np.floor(-1 / s) + 1)
        args = (np.arange(first, 2 - first)[None, :] - ratio) * s
        coeffs = np.clip(1 - np.abs(args), 0, 1)
        coeffs = coeffs / coeffs.sum(axis=1, keepdims=True)
    elif mode == "linear":
        coeffs = np.concatenate([1 - ratio, ratio], axis=1)
    elif antialias:  # cubic
        first = int(np.floor(-2 / s) + 1)
        coeffs = _cubic_kernel(s * (np.arange(first, 2 - first)[None, :] - ratio), a)
        coeffs = coeffs / coeffs.sum(axis=1, keepdims=True)
    else:
        r = ratio
        coeffs = np.concatenate(
            [
                ((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
                ((a + 2) * r - (a + 3)) * r * r + 1,
                ((a + 2) * (1 - r) - (a + 3)) * (1 - r) * (1 - r) + 1,
                ((a * (2 - r) - 5 * a) * (2 - r) + 8 * a) * (2 - r) - 4 * a,
            ],
            axis=1,
        )
    n = coeffs.shape[1]
    pad = int(np.ceil(n / 2))
    padded = x + pad
    p = np.floor(padded).astype(np.int64)
    frac = padded - p
    if n % 2 == 0:
        offset = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        offset = np.where(frac <= 0.5, -((n - 1) // 2), -((n - 1) // 2) + 1)
    index = (p + offset)[:, None] + np.arange(n)[None, :] - pad
    if exclude_outside:
        coeffs = np.where((index < 0) | (index >= in_size), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    weights = np.zeros((out_size, in_size), dtype=np.float64)
    rows = np.repeat(np.arange(out_size), n)
    np.add.at(weights, (rows, np.clip(index, 0, in_size - 1).reshape(-1)), coeffs.reshape(-1))
    return weights, outside


def _cubic_kernel(x: np.ndarray, a: float) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _nearest_index(
    in_size: int, out_size: int, scale: float, ctm: str, nearest_mode: str, device: Any
) -> Tensor:
    out = torch.arange(out_size, dtype=torch.float64)
    if ctm == "asymmetric":
        x = out / scale
    elif ctm == "align_corners":
        x = out * ((in_size - 1) / (out_size - 1)) if out_size > 1 else torch.zeros_like(out)
    elif ctm == "pytorch_half_pixel":
        x = (out + 0.5) / scale - 0.5 if out_size > 1 else torch.zeros_like(out)
    elif ctm == "tf_half_pixel_for_nn":
        x = (out + 0.5) / scale
    else:  # half_pixel
        x = (out + 0.5) / scale - 0.5
    if nearest_mode == "floor":
        idx = torch.floor(x)
    elif nearest_mode == "ceil":
        idx = torch.ceil(x)
    elif nearest_mode == "round_prefer_ceil":
        idx = torch.floor(x + 0.5)
    else:  # round_prefer_floor
        idx = torch.ceil(x - 0.5)
    return idx.clamp(0, in_size - 1).long().to(device)


_GRID_MODES = {
    "linear": "bilinear",
    "bilinear": "bilinear",
    "nearest": "nearest",
    "cubic": "bicubic",
    "bicubic": "bicubic",
}


def _grid_sample_check(attrs: dict[str, Any]) -> str | None:
    mode = attrs.get("mode", "linear")
    return None if mode in _GRID_MODES else f"mode={mode!r}"


@op("GridSample", check=_grid_sample_check)
def grid_sample(
    X: Tensor, grid: Tensor, *, align_corners: int = 0, mode: str = "linear", padding_mode: str = "zeros"
) -> Tensor:
    """ONNX GridSample (``F.grid_sample``: 4-D all modes, 5-D linear and nearest)."""
    torch_mode = _GRID_MODES[mode]
    if torch_mode == "nearest":  # ONNX rounds half to even, like torch.round
        return _grid_sample_nearest(X, grid, bool(align_corners), padding_mode)
    return F.grid_sample(X, grid, torch_mode, padding_mode, bool(align_corners))


def _grid_sample_nearest(X: Tensor, grid: Tensor, align: bool, padding_mode: str) -> Tensor:
    spatial = X.shape[2:]
    coords = []
    for i, size in enumerate(reversed(spatial)):  # grid's last dim is (x, y[, z])
        g = grid[..., i].to(torch.float64)
        pos = (g + 1) / 2 * (size - 1) if align else ((g + 1) * size - 1) / 2
        if padding_mode == "border":
            pos = pos.clamp(0, size - 1)
        elif padding_mode == "reflection":
            pos = _reflect(pos, size, align)
        coords.append(torch.round(pos))
    coords = coords[::-1]  # (.., z, y, x) order
    inside = torch.ones_like(coords[0], dtype=torch.bool)
    for c, size in zip(coords, spatial):
        inside &= (c >= 0) & (c <= size - 1)
    n, ch = X.shape[:2]
    flat = torch.zeros_like(coords[0], dtype=torch.long)
    for c, size in zip(coords, spatial):
        flat = flat * size + c.clamp(0, size - 1).long()
    out_spatial = flat.shape[1:]
    gathered = X.reshape(n, ch, -1).gather(2, flat.reshape(n, 1, -1).expand(n, ch, -1))
    gathered = gathered.reshape(n, ch, *out_spatial)
    return torch.where(inside.unsqueeze(1), gathered, torch.zeros((), dtype=X.dtype, device=X.device))


def _reflect(pos: Tensor, size: int, align: bool) -> Tensor:
    lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
    span = hi - lo
    if span <= 0:
        return torch.zeros_like(pos)
    x = (pos - lo).abs() % (2 * span)
    x = torch.where(x > span, 2 * span - x, x)
    return (x + lo).clamp(0, size - 1)


@op("AffineGrid", shape_inputs=(1,))
def affine_grid(theta: Tensor, size: IntsLike, *, align_corners: int = 0) -> Tensor:
    """ONNX AffineGrid (``F.affine_grid``, 2-D and 3-D)."""
    return F.affine_grid(theta, _ints(size), align_corners=bool(align_corners))
