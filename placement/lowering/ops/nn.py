"""Neural-network ops: normalisation, losses, depth/space rearranging, ``Col2Im``, ``SwiGLU``.

Convolution is in :mod:`.conv`, pooling in :mod:`.pooling`, resizing and grid sampling
in :mod:`.sampling`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from placement.lowering.ops._registry import (
    FxCall,
    IntsLike,
    Shapes,
    Tensor,
    _axis,
    _ints,
    op,
    torch_dtype,
)
from placement.lowering.ops.training import emit_mode_op

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


def _direct_batch_norm(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if kwargs.get("training_mode") or set(kwargs) - {"epsilon", "momentum", "num_outputs", "training_mode"}:
        return None
    if kwargs.get("num_outputs", 1) != 1 or len(args) != 5:
        return None
    x, scale, bias, mean_, var = args
    if not all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in (mean_, var)):
        return None  # running statistics computed in the graph: the rule detaches them
    eps = kwargs.get("epsilon", 1e-5)
    return "call_function", F.batch_norm, (x, mean_, var, scale, bias, False, 0.0, eps), {}


@op(
    "BatchNormalization",
    buffer_inputs=(3, 4),
    direct=_direct_batch_norm,
    emit=emit_mode_op,
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
    num_outputs: int = 1,
) -> Any:
    """ONNX BatchNormalization: in inference mode with the running statistics; with
    ``training_mode=1`` with the batch's (mean and biased variance over every axis but 1), and
    the outputs ``Y, running_mean, running_var``, the running ones ``input * momentum + batch *
    (1 - momentum)``, as ONNX Runtime's CPU kernel and the reference evaluator compute them."""
    if not training_mode:
        return F.batch_norm(X, input_mean.detach(), input_var.detach(), scale, B, False, 0.0, epsilon)
    axes = [d for d in range(X.dim()) if d != 1]
    mean = X.mean(axes)
    var = X.var(axes, correction=0)
    shape = [1, -1] + [1] * (X.dim() - 2)
    y = (X - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + epsilon) * scale.reshape(shape)
    y = y + B.reshape(shape)
    if num_outputs == 1:
        return y
    running_mean = input_mean * momentum + mean * (1 - momentum)
    running_var = input_var * momentum + var * (1 - momentum)
    return (y, running_mean, running_var)[:num_outputs]


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


# --- more normalisation, losses, rearranging ------------------------------------------------


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


@op("SwiGLU")
def swiglu(A: Tensor, B: Tensor, *, alpha: float = 1.0) -> Tensor:
    """ONNX SwiGLU: ``A * sigmoid(alpha * A) * B``."""
    return A * torch.sigmoid(alpha * A) * B
