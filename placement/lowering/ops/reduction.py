"""Reductions and index-producing ops: Reduce*, ArgMax/ArgMin, TopK, OneHot, NonZero, CumSum."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from placement.lowering.ops._registry import (
    IntsLike,
    Tensor,
    _axis,
    _ints,
    _scalar,
    op,
)

# --- reductions ---------------------------------------------------------------------------


def _reduce(name: str, fn: Callable[[Tensor, tuple[int, ...], bool], Tensor]) -> Callable[..., Tensor]:
    def reduce(
        data: Tensor, axes: IntsLike = None, *, keepdims: int = 1, noop_with_empty_axes: int = 0
    ) -> Tensor:
        dims = tuple(_ints(axes)) if axes is not None else ()
        if not dims:
            if noop_with_empty_axes:
                return data
            dims = tuple(range(data.dim()))
        return fn(data, dims, bool(keepdims))

    reduce.__name__ = reduce.__qualname__ = name
    reduce.__doc__ = f"ONNX {name} over ``axes`` (an input, or an attribute before opset 18)."
    return reduce


def _prod(x: Tensor, dims: tuple[int, ...], keep: bool) -> Tensor:
    for d in sorted((_axis(d, x.dim()) for d in dims), reverse=True):
        x = x.prod(d, keepdim=keep)
    return x


def _extreme(largest: bool) -> Callable[[Tensor, tuple[int, ...], bool], Tensor]:
    """ReduceMax / ReduceMin; over an empty axis the result is the identity (-inf / +inf)."""

    def reduce(x: Tensor, dims: tuple[int, ...], keep: bool) -> Tensor:
        if x.numel() == 0:
            shape = [1 if (i in dims or i - x.dim() in dims) else n for i, n in enumerate(x.shape)]
            if not keep:
                shape = [n for i, n in enumerate(x.shape) if not (i in dims or i - x.dim() in dims)]
            if x.dtype == torch.bool:
                return torch.full(shape, not largest, dtype=torch.bool, device=x.device)
            info = torch.finfo(x.dtype) if x.dtype.is_floating_point else torch.iinfo(x.dtype)
            fill = (
                (-math.inf if largest else math.inf)
                if x.dtype.is_floating_point
                else (info.min if largest else info.max)
            )
            return torch.full(shape, fill, dtype=x.dtype, device=x.device)
        return x.amax(dims, keepdim=keep) if largest else x.amin(dims, keepdim=keep)

    return reduce


reduce_mean = op(
    "ReduceMean", _reduce("reduce_mean", lambda x, d, k: x.mean(d, keepdim=k)), shape_inputs=(1,)
)
reduce_sum = op("ReduceSum", _reduce("reduce_sum", lambda x, d, k: x.sum(d, keepdim=k)), shape_inputs=(1,))
reduce_max = op("ReduceMax", _reduce("reduce_max", _extreme(True)), shape_inputs=(1,))
reduce_min = op("ReduceMin", _reduce("reduce_min", _extreme(False)), shape_inputs=(1,))
reduce_prod = op("ReduceProd", _reduce("reduce_prod", _prod), shape_inputs=(1,))
reduce_l1 = op("ReduceL1", _reduce("reduce_l1", lambda x, d, k: x.abs().sum(d, keepdim=k)), shape_inputs=(1,))
reduce_l2 = op(
    "ReduceL2",
    _reduce("reduce_l2", lambda x, d, k: torch.linalg.vector_norm(x, 2, dim=d, keepdim=k)),
    shape_inputs=(1,),
)
reduce_sum_square = op(
    "ReduceSumSquare",
    _reduce("reduce_sum_square", lambda x, d, k: (x * x).sum(d, keepdim=k)),
    shape_inputs=(1,),
)
reduce_log_sum = op(
    "ReduceLogSum", _reduce("reduce_log_sum", lambda x, d, k: x.sum(d, keepdim=k).log()), shape_inputs=(1,)
)
reduce_log_sum_exp = op(
    "ReduceLogSumExp",
    _reduce("reduce_log_sum_exp", lambda x, d, k: torch.logsumexp(x, d, keepdim=k)),
    shape_inputs=(1,),
)


def _arg_reduce(name: str, largest: bool) -> Callable[..., Tensor]:
    def arg(data: Tensor, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0) -> Tensor:
        axis = _axis(axis, data.dim())
        if select_last_index:
            flipped = data.flip(axis)
            idx = (
                flipped.argmax(axis, keepdim=bool(keepdims))
                if largest
                else flipped.argmin(axis, keepdim=bool(keepdims))
            )
            return data.shape[axis] - 1 - idx
        return (
            data.argmax(axis, keepdim=bool(keepdims))
            if largest
            else data.argmin(axis, keepdim=bool(keepdims))
        )

    arg.__name__ = arg.__qualname__ = name
    return arg


arg_max = op("ArgMax", _arg_reduce("arg_max", True))
arg_min = op("ArgMin", _arg_reduce("arg_min", False))


@op("TopK", shape_inputs=(1,))
def top_k(X: Tensor, K: Any, *, axis: int = -1, largest: int = 1, sorted: int = 1) -> tuple[Tensor, Tensor]:  # noqa: A002
    """ONNX TopK: ``(values, int64 indices)``; among equal values the lower index comes first."""
    k = int(_scalar(K))
    values, indices = torch.sort(X, dim=axis, descending=bool(largest), stable=True)
    return values.narrow(axis, 0, k), indices.narrow(axis, 0, k)


@op("OneHot", shape_inputs=(1,))
def one_hot(indices: Tensor, depth: Any, values: Tensor, *, axis: int = -1) -> Tensor:
    """ONNX OneHot: ``values = [off, on]``; negative indices count from ``depth``."""
    n = int(_scalar(depth))
    idx = indices.long()
    idx = torch.where(idx < 0, idx + n, idx)
    hot = F.one_hot(idx.clamp(0, n - 1), n).bool() & ((idx >= 0) & (idx < n)).unsqueeze(-1)
    rank = hot.dim()
    if _axis(axis, rank) != rank - 1:
        hot = hot.movedim(-1, _axis(axis, rank))
    return torch.where(hot, values[1], values[0])


@op("NonZero")
def non_zero(X: Tensor) -> Tensor:
    """ONNX NonZero: indices of non-zero elements, shape ``(rank, count)``."""
    return torch.nonzero(X).t()


@op("Hardmax")
def hardmax(input: Tensor, *, axis: int = -1) -> Tensor:  # noqa: A002
    """ONNX Hardmax: 1 at the first maximum along ``axis``, 0 elsewhere."""
    dim = _axis(axis, input.dim())
    index = input.argmax(dim, keepdim=True)
    return torch.zeros_like(input).scatter(dim, index, 1)


@op("CumProd", shape_inputs=(1,))
def cumprod(x: Tensor, axis: Any, *, exclusive: int = 0, reverse: int = 0) -> Tensor:
    """ONNX CumProd (``exclusive`` and ``reverse`` supported)."""
    dim = _axis(int(_scalar(axis)), x.dim())
    if reverse:
        x = x.flip(dim)
    if exclusive:
        ones = torch.ones_like(x.narrow(dim, 0, 1))
        x = torch.cat([ones, x.narrow(dim, 0, x.shape[dim] - 1)], dim)
    out = torch.cumprod(x, dim).to(x.dtype)
    return out.flip(dim) if reverse else out


@op("Unique")
def unique(X: Tensor, *, axis: int | None = None, sorted: int = 1, num_outputs: int = 1) -> Any:  # noqa: A002
    """ONNX Unique: ``(Y, indices, inverse_indices, counts)``, sorted or in first-occurrence order."""
    if axis is None:
        rows = X.reshape(-1, 1)
    else:
        axis = _axis(axis, X.dim())
        rows = X.movedim(axis, 0).reshape(X.shape[axis], -1)
    found, inverse, counts = torch.unique(rows.detach(), dim=0, return_inverse=True, return_counts=True)
    positions = torch.arange(rows.shape[0], device=X.device)
    first = torch.full((found.shape[0],), rows.shape[0], dtype=torch.long, device=X.device)
    first = first.scatter_reduce(0, inverse, positions, "amin")
    if not sorted:
        order = torch.argsort(first)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=X.device)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    values = rows.index_select(0, first)  # the first occurrences themselves: differentiable
    if axis is None:
        y = values.reshape(-1)
    else:
        rest = [n for i, n in enumerate(X.shape) if i != axis]
        y = values.reshape(values.shape[0], *rest).movedim(0, axis)
    results = (y, first, inverse.reshape(-1), counts)
    return results[0] if num_outputs == 1 else results[:num_outputs]
