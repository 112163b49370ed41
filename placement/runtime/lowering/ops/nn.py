"""Neural-network ops: normalisation, convolution, pooling, resizing."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

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
    """ONNX AveragePool (1-3 spatial dims, ``count_include_pad``, asymmetric pads)."""
    n = len(kernel_shape)
    strides = list(strides or [1] * n)
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


@op("GlobalAveragePool")
def global_average_pool(X: Tensor) -> Tensor:
    """ONNX GlobalAveragePool: mean over the spatial dims, kept."""
    return X.mean(dim=tuple(range(2, X.dim())), keepdim=True)


@op("GlobalMaxPool")
def global_max_pool(X: Tensor) -> Tensor:
    """ONNX GlobalMaxPool: max over the spatial dims, kept."""
    return X.amax(dim=tuple(range(2, X.dim())), keepdim=True)


_LINEAR_MODES = {"half_pixel", "pytorch_half_pixel", "align_corners"}


def _resize_check(attrs: dict[str, Any]) -> str | None:
    mode = attrs.get("mode", "nearest")
    ctm = attrs.get("coordinate_transformation_mode", "half_pixel")
    if attrs.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        return f"keep_aspect_ratio_policy={attrs['keep_aspect_ratio_policy']!r}"
    if mode == "nearest":
        if ctm == "tf_crop_and_resize":
            return "coordinate_transformation_mode='tf_crop_and_resize'"
        return None
    if mode not in ("linear", "cubic"):
        return f"mode={mode!r}"
    if ctm not in _LINEAR_MODES:
        return f"mode={mode!r} with coordinate_transformation_mode={ctm!r}"
    if mode == "cubic" and (attrs.get("exclude_outside") or attrs.get("cubic_coeff_a", -0.75) != -0.75):
        return "cubic with exclude_outside or cubic_coeff_a != -0.75"
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
    """ONNX Resize: ``nearest`` (every coordinate mode and rounding), ``linear`` and
    ``cubic`` (through ``F.interpolate``) over the spatial dims."""
    rank = X.dim()
    axes_ = [_axis(a, rank) for a in axes] if axes is not None else list(range(rank))
    scale_list = [
        float(s) for s in (scales.reshape(-1).tolist() if isinstance(scales, Tensor) else scales or [])
    ]
    size_list = _ints(sizes) if sizes is not None else []
    full_scales = [1.0] * rank
    full_sizes = list(X.shape)
    if size_list:
        for a, s in zip(axes_, size_list):
            full_sizes[a] = s
            full_scales[a] = s / X.shape[a]
    else:
        for a, s in zip(axes_, scale_list):
            full_scales[a] = s
            full_sizes[a] = int(math.floor(X.shape[a] * s))
    if mode == "nearest":
        out = X
        for a in range(rank):
            if full_sizes[a] != X.shape[a] or full_scales[a] != 1.0:
                index = _nearest_index(
                    X.shape[a],
                    full_sizes[a],
                    full_scales[a],
                    coordinate_transformation_mode,
                    nearest_mode,
                    X.device,
                )
                out = out.index_select(a, index)
        return out
    if full_sizes[:2] != list(X.shape[:2]):
        raise LoweringError("Resize: linear/cubic modes only resize the spatial dims")
    spatial = rank - 2
    torch_mode = {
        ("linear", 1): "linear",
        ("linear", 2): "bilinear",
        ("linear", 3): "trilinear",
        ("cubic", 2): "bicubic",
    }.get((mode, spatial))
    if torch_mode is None:
        raise LoweringError(f"Resize: mode {mode!r} over {spatial} spatial dims is not supported")
    align = coordinate_transformation_mode == "align_corners"
    if size_list:
        return F.interpolate(
            X, size=full_sizes[2:], mode=torch_mode, align_corners=align, antialias=bool(antialias)
        )
    return F.interpolate(
        X,
        scale_factor=full_scales[2:],
        mode=torch_mode,
        align_corners=align,
        recompute_scale_factor=False,
        antialias=bool(antialias),
    )


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


def _lp_pool_check(attrs: dict[str, Any]) -> str | None:
    dil = attrs.get("dilations")
    return "dilations != 1" if dil and any(d != 1 for d in dil) else None


@op("LpPool", check=_lp_pool_check)
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
    """ONNX LpPool: ``(sum |x|^p)^(1/p)`` per window, zero padding."""
    n = len(kernel_shape)
    strides = list(strides or [1] * n)
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
    """ONNX Col2Im for 2-D images (``F.fold``)."""
    image, block = _ints(image_shape), _ints(block_shape)
    if len(image) != 2:
        raise LoweringError(f"Col2Im: only 2-D images are lowered, got {len(image)}-D")
    pad = list(pads or [0, 0, 0, 0])
    padded = [image[0] + pad[0] + pad[2], image[1] + pad[1] + pad[3]]
    out = F.fold(input, padded, block, list(dilations or [1, 1]), 0, list(strides or [1, 1]))
    return out[..., pad[0] : pad[0] + image[0], pad[1] : pad[1] + image[1]]


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
