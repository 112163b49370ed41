"""Neural-network ops: normalisation, convolution, pooling, resizing."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from placement.errors import LoweringError
from placement.runtime.lowering.ops._registry import (
    FxCall,
    IntsLike,
    Shapes,
    Tensor,
    _axis,
    _ints,
    _torch_pads,
    op,
    torch_dtype,
)

# --- normalisation ---------------------------------------------------------------------


def _direct_layer_norm(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    scale = shapes[1] if len(shapes) > 1 else None
    bias = shapes[2] if len(shapes) > 2 and len(args) > 2 and args[2] is not None else scale
    if set(kwargs) - {"epsilon"} or scale is None or len(scale) != 1 or bias != scale:
        return None  # axis=-1 (the default) with 1-D scale and bias only
    eps = kwargs.get("epsilon", 1e-5)
    bias_arg = args[2] if len(args) > 2 else None
    return "call_function", F.layer_norm, (args[0], tuple(scale), args[1], bias_arg, eps), {}


@op("LayerNormalization", direct=_direct_layer_norm)
def layer_normalization(
    X: Tensor,
    Scale: Tensor,
    B: Tensor | None = None,
    *,
    axis: int = -1,
    epsilon: float = 1e-5,
    stash_type: int = 1,
    num_outputs: int = 1,
) -> Any:
    """ONNX LayerNormalization over the dims from ``axis`` on (``F.layer_norm``)."""
    axis = _axis(axis, X.dim())
    shape = tuple(X.shape[axis:])
    if num_outputs == 1 and tuple(Scale.shape) == shape and (B is None or tuple(B.shape) == shape):
        return F.layer_norm(X, shape, Scale, B, epsilon)
    dims = tuple(range(axis, X.dim()))
    compute = X.float() if stash_type == 1 and X.dtype in (torch.float16, torch.bfloat16) else X
    mean_ = compute.mean(dims, keepdim=True)
    inv_std = torch.rsqrt(compute.var(dims, unbiased=False, keepdim=True) + epsilon)
    y = ((compute - mean_) * inv_std).to(X.dtype) * Scale
    if B is not None:
        y = y + B
    return (y, mean_, inv_std)[:num_outputs] if num_outputs > 1 else y


def _inference_only(attrs: dict[str, Any]) -> str | None:
    return "training_mode=1 (only inference is lowered)" if attrs.get("training_mode") else None


def _direct_batch_norm(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if set(kwargs) - {"epsilon", "momentum"} or len(args) != 5:
        return None
    x, scale, bias, mean_, var = args
    if not all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in (mean_, var)):
        return None  # running statistics computed in the graph: the rule detaches them
    eps = kwargs.get("epsilon", 1e-5)
    return "call_function", F.batch_norm, (x, mean_, var, scale, bias, False, 0.0, eps), {}


@op(
    "BatchNormalization",
    check=_inference_only,
    buffer_inputs=(3, 4),
    direct=_direct_batch_norm,
)
def batch_normalization(
    X: Tensor,
    scale: Tensor,
    B: Tensor,
    input_mean: Tensor,
    input_var: Tensor,
    *,
    epsilon: float = 1e-5,
    momentum: float = 0.9,
    training_mode: int = 0,
) -> Tensor:
    """ONNX BatchNormalization in inference mode (running statistics)."""
    return F.batch_norm(X, input_mean.detach(), input_var.detach(), scale, B, False, 0.0, epsilon)


@op("InstanceNormalization")
def instance_normalization(input: Tensor, scale: Tensor, B: Tensor, *, epsilon: float = 1e-5) -> Tensor:  # noqa: A002
    """ONNX InstanceNormalization (per sample and channel)."""
    return F.instance_norm(input, weight=scale, bias=B, eps=epsilon)


@op("GroupNormalization")
def group_normalization(
    X: Tensor, scale: Tensor, bias: Tensor, *, num_groups: int, epsilon: float = 1e-5, stash_type: int = 1
) -> Tensor:
    """ONNX GroupNormalization (opset 21 per-channel scale; opset 18 per-group scale too)."""
    channels = X.shape[1]
    if scale.numel() == num_groups and channels != num_groups:
        scale = scale.repeat_interleave(channels // num_groups)
        bias = bias.repeat_interleave(channels // num_groups)
    return F.group_norm(X, num_groups, scale, bias, epsilon)


@op("LpNormalization")
def lp_normalization(input: Tensor, *, axis: int = -1, p: int = 2) -> Tensor:  # noqa: A002
    """ONNX LpNormalization: ``x / ||x||_p`` along ``axis`` (0 where the norm is 0)."""
    norm = torch.linalg.vector_norm(input, p, dim=axis, keepdim=True)
    return torch.where(norm == 0, torch.zeros((), dtype=input.dtype, device=input.device), input / norm)


@op("LRN")
def lrn(X: Tensor, *, size: int, alpha: float = 1e-4, beta: float = 0.75, bias: float = 1.0) -> Tensor:
    """ONNX LRN across channels."""
    return F.local_response_norm(X, size, alpha, beta, bias)


# --- convolution and pooling ---------------------------------------------------------


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
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


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


def _pool_check(attrs: dict[str, Any]) -> str | None:
    if attrs.get("storage_order"):
        return "storage_order=1"
    return None


@op("MaxPool", check=_pool_check)
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
    if fits:
        padding: Any = p[:n]
    else:
        X, padding = F.pad(X, _torch_pads(p, X.dim()), value=-math.inf), 0
    out = _MAX_POOL[n](
        X, list(kernel_shape), strides, padding, dilations, bool(ceil_mode), return_indices=num_outputs > 1
    )
    if num_outputs > 1:
        values, indices = out
        return values, indices
    return out


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
    if dilations and any(d != 1 for d in dilations):
        p = _spatial_pads(X.shape[2:], kernel_shape, strides, list(dilations), pads, auto_pad)
        sums, counts = _dilated_window_sums(
            X, kernel_shape, strides, list(dilations), p, bool(ceil_mode), bool(count_include_pad)
        )
        return sums / counts
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
    axes_ = [_axis(a, rank) for a in axes] if axes is not None else list(range(rank))
    scale_list = [
        float(s) for s in (scales.reshape(-1).tolist() if isinstance(scales, Tensor) else scales or [])
    ]
    size_list = _ints(sizes) if sizes is not None else []
    roi_list = [float(v) for v in (roi.reshape(-1).tolist() if isinstance(roi, Tensor) else roi or [])]
    full_scales = [1.0] * rank
    full_sizes = list(X.shape)
    if size_list:
        for a, s in zip(axes_, size_list):
            full_sizes[a] = s
            full_scales[a] = s / X.shape[a]
        if keep_aspect_ratio_policy != "stretch":
            pick = min if keep_aspect_ratio_policy == "not_larger" else max
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


# --- more normalisation, sampling, losses ---------------------------------------------------


@op("RMSNormalization")
def rms_normalization(
    X: Tensor, scale: Tensor, *, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1
) -> Tensor:
    """ONNX RMSNormalization: ``x / sqrt(mean(x^2) + eps) * scale`` over the dims from ``axis``."""
    dims = tuple(range(_axis(axis, X.dim()), X.dim()))
    compute = X.to(torch_dtype(stash_type))
    rms = torch.sqrt((compute * compute).mean(dims, keepdim=True) + epsilon)
    return (compute / rms).to(X.dtype) * scale


@op("MeanVarianceNormalization")
def mean_variance_normalization(X: Tensor, *, axes: Sequence[int] = (0, 2, 3)) -> Tensor:
    """ONNX MeanVarianceNormalization: ``(x - mean) / sqrt(var + 1e-9)`` over ``axes``."""
    dims = tuple(axes)
    mean_ = X.mean(dims, keepdim=True)
    var = (X * X).mean(dims, keepdim=True) - mean_ * mean_
    return (X - mean_) / torch.sqrt(var + 1e-9)


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
    if dilations and any(d != 1 for d in dilations):
        pad = _spatial_pads(X.shape[2:], kernel_shape, strides, list(dilations), pads, auto_pad)
        sums, _ = _dilated_window_sums(
            X.abs() ** p, kernel_shape, strides, list(dilations), pad, bool(ceil_mode), False
        )
        return sums ** (1.0 / p)
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


def _reduce_loss(loss: Tensor, weight: Tensor | None, reduction: str) -> Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if weight is None:
        return loss.mean()
    return loss.sum() / weight.sum()


def _nll(
    log_prob: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int | None, reduction: str
) -> Tensor:
    target = target.long()
    keep = torch.ones_like(target, dtype=torch.bool) if ignore_index is None else target != ignore_index
    safe = torch.where(keep, target, torch.zeros_like(target))
    picked = -log_prob.gather(1, safe.unsqueeze(1)).squeeze(1)
    w = weight[safe] if weight is not None else torch.ones_like(picked)
    w = torch.where(keep, w, torch.zeros_like(w))
    loss = picked * w
    if reduction == "mean" and (weight is not None or ignore_index is not None):
        return loss.sum() / w.sum()
    return _reduce_loss(loss, None, reduction)


@op("NegativeLogLikelihoodLoss")
def negative_log_likelihood_loss(
    input: Tensor,  # noqa: A002
    target: Tensor,
    weight: Tensor | None = None,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> Tensor:
    """ONNX NegativeLogLikelihoodLoss (class weights, ``ignore_index``, none/sum/mean)."""
    return _nll(input, target, weight, ignore_index, reduction)


@op("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(
    scores: Tensor,
    labels: Tensor,
    weights: Tensor | None = None,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
    num_outputs: int = 1,
) -> Any:
    """ONNX SoftmaxCrossEntropyLoss: ``(loss, log_prob)``."""
    log_prob = torch.log_softmax(scores, 1)
    loss = _nll(log_prob, labels, weights, ignore_index, reduction)
    return (loss, log_prob) if num_outputs > 1 else loss


@op("DepthToSpace")
def depth_to_space(input: Tensor, *, blocksize: int, mode: str = "DCR") -> Tensor:  # noqa: A002
    """ONNX DepthToSpace (``DCR`` or ``CRD`` order)."""
    b, c, h, w = input.shape
    bs = blocksize
    if mode == "CRD":
        return F.pixel_shuffle(input, bs)
    x = input.reshape(b, bs, bs, c // (bs * bs), h, w).permute(0, 3, 4, 1, 5, 2)
    return x.reshape(b, c // (bs * bs), h * bs, w * bs)


@op("SpaceToDepth")
def space_to_depth(input: Tensor, *, blocksize: int, mode: str = "DCR") -> Tensor:  # noqa: A002
    """ONNX SpaceToDepth (``DCR`` or ``CRD`` order)."""
    b, c, h, w = input.shape
    bs = blocksize
    if mode == "CRD":
        return F.pixel_unshuffle(input, bs)
    x = input.reshape(b, c, h // bs, bs, w // bs, bs).permute(0, 3, 5, 1, 2, 4)
    return x.reshape(b, c * bs * bs, h // bs, w // bs)


@op("Col2Im", shape_inputs=(1, 2))
def col2im(
    input: Tensor,  # noqa: A002
    image_shape: IntsLike,
    block_shape: IntsLike,
    *,
    dilations: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> Tensor:
    """ONNX Col2Im: ``F.fold`` for 2-D images, a scatter-add of the blocks for other ranks."""
    image, block = _ints(image_shape), _ints(block_shape)
    if len(image) != 2:
        return _col2im_nd(input, image, block, dilations, pads, strides)
    pad = list(pads or [0, 0, 0, 0])
    padded = [image[0] + pad[0] + pad[2], image[1] + pad[1] + pad[3]]
    out = F.fold(input, padded, block, list(dilations or [1, 1]), 0, list(strides or [1, 1]))
    return out[..., pad[0] : pad[0] + image[0], pad[1] : pad[1] + image[1]]


def _col2im_nd(
    input: Tensor,  # noqa: A002
    image: list[int],
    block: list[int],
    dilations: Sequence[int] | None,
    pads: Sequence[int] | None,
    strides: Sequence[int] | None,
) -> Tensor:
    """Col2Im over any number of image dims: each column element added at its image position."""
    n = len(image)
    dil = list(dilations or [1] * n)
    stride = list(strides or [1] * n)
    pad = list(pads or [0] * (2 * n))
    padded = [image[d] + pad[d] + pad[n + d] for d in range(n)]
    counts = [(padded[d] - dil[d] * (block[d] - 1) - 1) // stride[d] + 1 for d in range(n)]
    offsets = np.stack(np.meshgrid(*[np.arange(b) for b in block], indexing="ij"), -1).reshape(-1, n)
    starts = np.stack(np.meshgrid(*[np.arange(c) for c in counts], indexing="ij"), -1).reshape(-1, n)
    positions = offsets[:, None, :] * np.array(dil) + starts[None, :, :] * np.array(stride)
    flat = np.ravel_multi_index(tuple(positions.reshape(-1, n).T), padded)
    index = torch.from_numpy(flat).to(input.device)
    batch, channels = input.shape[0], input.shape[1] // math.prod(block)
    cols = input.reshape(batch, channels, -1)
    out = cols.new_zeros(batch, channels, math.prod(padded)).index_add(2, index, cols)
    out = out.reshape(batch, channels, *padded)
    for d in range(n):
        out = out.narrow(2 + d, pad[d], image[d])
    return out


@op("AffineGrid", shape_inputs=(1,))
def affine_grid(theta: Tensor, size: IntsLike, *, align_corners: int = 0) -> Tensor:
    """ONNX AffineGrid (``F.affine_grid``, 2-D and 3-D)."""
    return F.affine_grid(theta, _ints(size), align_corners=bool(align_corners))


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


@op("SwiGLU")
def swiglu(A: Tensor, B: Tensor, *, alpha: float = 1.0) -> Tensor:
    """ONNX SwiGLU: ``A * sigmoid(alpha * A) * B``."""
    return A * torch.sigmoid(alpha * A) * B
