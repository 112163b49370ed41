"""Shape and data movement: reshape, transpose, slicing, gather/scatter, padding, constants."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from placement.errors import LoweringError
from placement.lowering.ops._registry import (
    FxCall,
    IntsLike,
    Shapes,
    Tensor,
    _axis,
    _ints,
    _ints_literal,
    _scalar,
    _torch_pads,
    op,
    torch_dtype,
)

# --- shape and data movement ------------------------------------------------------------


def _direct_reshape(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if len(args) < 2 or not _ints_literal(args[1]):
        return None
    if 0 in args[1] and not kwargs.get("allowzero", 0):
        return None
    return "call_method", "reshape", (args[0], args[1]), {}


@op("Reshape", shape_inputs=(1,), direct=_direct_reshape)
def reshape(data: Tensor, shape: IntsLike, *, allowzero: int = 0) -> Tensor:
    """ONNX Reshape: ``0`` copies the input dim (unless ``allowzero``), ``-1`` is inferred."""
    dims = _ints(shape)
    if not allowzero and 0 in dims:
        dims = [data.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return data.reshape(dims)


@op("Flatten")
def flatten(input: Tensor, *, axis: int = 1) -> Tensor:  # noqa: A002
    """ONNX Flatten to 2-D at ``axis``."""
    axis = _axis(axis, input.dim())
    return input.reshape(math.prod(input.shape[:axis]), -1)


def _direct_transpose(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    perm = kwargs.get("perm")
    if perm is None or len(kwargs) != 1:
        return None
    return "call_method", "permute", (args[0], *perm), {}


@op("Transpose", direct=_direct_transpose)
def transpose(data: Tensor, *, perm: Sequence[int] | None = None) -> Tensor:
    """ONNX Transpose (default: reverse the dims)."""
    return data.permute(list(perm) if perm is not None else list(range(data.dim() - 1, -1, -1)))


def _direct_squeeze(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if len(args) == 2 and _ints_literal(args[1]) and args[1]:
        return "call_method", "squeeze", (args[0], tuple(args[1])), {}
    return None


@op("Squeeze", shape_inputs=(1,), direct=_direct_squeeze)
def squeeze(data: Tensor, axes: IntsLike = None) -> Tensor:
    """ONNX Squeeze: the given axes, or every size-1 dim."""
    if axes is None:
        return data.squeeze()
    return data.squeeze(tuple(_ints(axes)))


def _direct_unsqueeze(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if len(args) == 2 and _ints_literal(args[1]) and len(args[1]) == 1:
        return "call_method", "unsqueeze", (args[0], args[1][0]), {}
    return None


@op("Unsqueeze", shape_inputs=(1,), direct=_direct_unsqueeze)
def unsqueeze(data: Tensor, axes: IntsLike) -> Tensor:
    """ONNX Unsqueeze: ``axes`` index the output's dims."""
    rank = data.dim() + len(_ints(axes))
    for a in sorted(_axis(a, rank) for a in _ints(axes)):
        data = data.unsqueeze(a)
    return data


def _direct_concat(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    return "call_function", torch.cat, (list(args), kwargs["axis"]), {}


@op("Concat", direct=_direct_concat)
def concat(*inputs: Tensor, axis: int) -> Tensor:
    """ONNX Concat along ``axis``."""
    return torch.cat(inputs, axis)


def _direct_split(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    axis, parts = kwargs.get("axis", 0), kwargs.get("num_outputs", 1)
    if set(kwargs) - {"axis", "num_outputs"} or parts == 1:
        return None  # one output: the rule returns a tensor, torch.split a tuple
    if len(args) > 1 and args[1] is not None:
        return (
            ("call_function", torch.split, (args[0], args[1], axis), {}) if _ints_literal(args[1]) else None
        )
    shape = shapes[0] if shapes else None
    if shape is None:
        return None
    return "call_function", torch.split, (args[0], -(-shape[axis] // parts), axis), {}


@op("Split", shape_inputs=(1,), direct=_direct_split)
def split(
    input: Tensor,  # noqa: A002
    split: IntsLike = None,
    *,
    axis: int = 0,
    num_outputs: int = 1,
) -> Any:
    """ONNX Split by sizes (``split``) or into ``num_outputs`` parts (last one smaller)."""
    if split is not None and len(_ints(split)):
        parts = torch.split(input, _ints(split), axis)
    else:
        size = input.shape[axis]
        parts = torch.split(input, -(-size // num_outputs), axis)
    return tuple(parts) if num_outputs > 1 else parts[0]


def _direct_slice(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if not all(a is None or _ints_literal(a) for a in args[1:]) or len(args) < 3:
        return None
    starts, ends = args[1], args[2]
    axes = args[3] if len(args) > 3 and args[3] is not None else list(range(len(starts)))
    steps = args[4] if len(args) > 4 and args[4] is not None else [1] * len(starts)
    if any(step <= 0 for step in steps) or len(set(axes)) != len(axes):
        return None
    if all(a >= 0 for a in axes):
        index: list[Any] = [slice(None)] * (max(axes) + 1)
        offset = 0
    elif all(a < 0 for a in axes):
        index = [slice(None)] * (-min(axes))
        offset = len(index)
    else:
        return None
    for start, end, axis, step in zip(starts, ends, axes, steps):
        stop = None if end >= _INT64_MAX // 2 else end
        begin = None if start == 0 or start <= -(_INT64_MAX // 2) else start  # INT64_MIN: from the start
        index[axis + offset] = slice(begin, stop, None if step == 1 else step)
    if offset:
        index.insert(0, Ellipsis)
    return "call_function", operator.getitem, (args[0], tuple(index)), {}


_INT64_MAX = 2**63 - 1


@op("Slice", shape_inputs=(1, 2, 3, 4), direct=_direct_slice)
def slice_(
    data: Tensor, starts: IntsLike, ends: IntsLike, axes: IntsLike = None, steps: IntsLike = None
) -> Tensor:
    """ONNX Slice (negative axes, clamped bounds, negative steps)."""
    starts_, ends_ = _ints(starts), _ints(ends)
    axes_ = _ints(axes) if axes is not None else list(range(len(starts_)))
    steps_ = _ints(steps) if steps is not None else [1] * len(starts_)
    index: list[Any] = [slice(None)] * data.dim()
    for start, end, axis, step in zip(starts_, ends_, axes_, steps_):
        axis = _axis(axis, data.dim())
        size = data.shape[axis]
        start = start + size if start < 0 else start
        end = end + size if end < 0 else end
        if step > 0:
            index[axis] = slice(min(max(start, 0), size), min(max(end, 0), size), step)
            continue
        start, end = min(max(start, 0), size - 1), min(max(end, -1), size - 1)
        data = data.flip(axis)
        index[axis] = slice(size - 1 - start, size - 1 - end, -step)
    return data[tuple(index)]


def _direct_gather(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if kwargs.get("axis", 0) != 0:
        return None
    return "call_function", operator.getitem, (args[0], args[1]), {}


@op("Gather", direct=_direct_gather)
def gather(data: Tensor, indices: Tensor, *, axis: int = 0) -> Tensor:
    """ONNX Gather: index ``data`` along ``axis`` (negative indices allowed)."""
    axis = _axis(axis, data.dim())
    if axis == 0:
        return data[indices]
    return data[(slice(None),) * axis + (indices,)]


@op("GatherElements")
def gather_elements(data: Tensor, indices: Tensor, *, axis: int = 0) -> Tensor:
    """ONNX GatherElements (``torch.gather``; negative indices allowed)."""
    axis = _axis(axis, data.dim())
    return torch.gather(data, axis, torch.remainder(indices, data.shape[axis]).long())


@op("GatherND")
def gather_nd(data: Tensor, indices: Tensor, *, batch_dims: int = 0) -> Tensor:
    """ONNX GatherND; with ``batch_dims`` the leading axes of ``data`` and ``indices`` pair up."""
    indices = indices.long()
    if not batch_dims:
        return data[tuple(indices[..., i] for i in range(indices.shape[-1]))]
    batch_shape = data.shape[:batch_dims]
    flat_data = data.reshape(-1, *data.shape[batch_dims:])
    flat_idx = indices.reshape(-1, *indices.shape[batch_dims:])
    rows = torch.arange(flat_data.shape[0], device=data.device).reshape(-1, *[1] * (flat_idx.dim() - 2))
    picked = flat_data[(rows, *(flat_idx[..., i] for i in range(flat_idx.shape[-1])))]
    return picked.reshape(*batch_shape, *picked.shape[1:])


@op("Expand", shape_inputs=(1,))
def expand(input: Tensor, shape: IntsLike) -> Tensor:  # noqa: A002
    """ONNX Expand: broadcast ``input`` and ``shape`` both ways."""
    return input.expand(_broadcast(tuple(input.shape), tuple(_ints(shape))))


def _broadcast(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
    """``torch.broadcast_shapes(a, b)``, in plain Python where both are Python ints (that
    function's symbolic-shape machinery costs tens of microseconds a call)."""
    if not all(type(d) is int for d in (*a, *b)):
        return tuple(torch.broadcast_shapes(a, b))
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + a, (1,) * (rank - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x != y and x != 1 and y != 1:
            return tuple(torch.broadcast_shapes(a, b))  # raises torch's own error
        out.append(y if x == 1 else x)
    return tuple(out)


@op("Tile", shape_inputs=(1,))
def tile(input: Tensor, repeats: IntsLike) -> Tensor:  # noqa: A002
    """ONNX Tile."""
    return input.repeat(_ints(repeats))


@op("Pad", shape_inputs=(1, 3), scalar_inputs=(2,))
def pad(
    data: Tensor,
    pads: IntsLike,
    constant_value: Any = None,
    axes: IntsLike = None,
    *,
    mode: str = "constant",
    value: float = 0.0,
) -> Tensor:
    """ONNX Pad (``constant``, ``reflect``, ``edge``, ``wrap``; negative pads crop)."""
    torch_pads = _torch_pads(_ints(pads), data.dim(), _ints(axes) if axes is not None else None)
    if mode == "constant":
        fill = _scalar(constant_value) if constant_value is not None else value
        return F.pad(data, torch_pads, value=fill)
    return F.pad(data, torch_pads, mode={"reflect": "reflect", "edge": "replicate", "wrap": "circular"}[mode])


@op("Shape")
def shape(data: Tensor, *, start: int = 0, end: int | None = None, device: Any = None) -> Tensor:
    """ONNX Shape (the lowering folds it to a constant when the shape is static)."""
    dims = list(data.shape)[start:end] if end is not None else list(data.shape)[start:]
    return torch.tensor(dims, dtype=torch.int64, device=device)


@op("Size")
def size(data: Tensor, *, device: Any = None) -> Tensor:
    """ONNX Size: the element count as a 0-d int64 tensor."""
    return torch.tensor(data.numel(), dtype=torch.int64, device=device)


@op("ConstantOfShape", shape_inputs=(0,))
def constant_of_shape(input: IntsLike, *, value: Tensor | None = None, device: Any = None) -> Tensor:  # noqa: A002
    """ONNX ConstantOfShape (default: float32 zeros)."""
    if value is None:
        return torch.zeros(_ints(input), dtype=torch.float32, device=device)
    return torch.full(_ints(input), value.reshape(-1)[0].item(), dtype=value.dtype, device=device)


@op("Range", shape_inputs=(0, 1, 2))
def range_(start: Any, limit: Any, delta: Any, *, device: Any = None) -> Tensor:
    """ONNX Range: ``arange(start, limit, delta)`` in the inputs' dtype."""
    tensors = [v for v in (start, limit, delta) if isinstance(v, Tensor)]
    if tensors:
        dtype = tensors[0].dtype
    else:
        dtype = torch.float32 if any(isinstance(v, float) for v in (start, limit, delta)) else torch.int64
    return torch.arange(_scalar(start), _scalar(limit), _scalar(delta), dtype=dtype, device=device)


@op("Constant")
def constant(
    *,
    value: Tensor | None = None,
    value_float: float | None = None,
    value_floats: Sequence[float] | None = None,
    value_int: int | None = None,
    value_ints: Sequence[int] | None = None,
) -> Tensor:
    """ONNX Constant (always folded by the lowering)."""
    if value is not None:
        return value
    if value_float is not None:
        return torch.tensor(value_float, dtype=torch.float32)
    if value_floats is not None:
        return torch.tensor(list(value_floats), dtype=torch.float32)
    if value_int is not None:
        return torch.tensor(value_int, dtype=torch.int64)
    if value_ints is not None:
        return torch.tensor(list(value_ints), dtype=torch.int64)
    raise LoweringError("Constant without a supported value attribute")


@op("Trilu", shape_inputs=(1,))
def trilu(input: Tensor, k: Any = None, *, upper: int = 1) -> Tensor:  # noqa: A002
    """ONNX Trilu: upper (``triu``) or lower (``tril``) triangle from diagonal ``k``."""
    diagonal = _scalar(k) if k is not None else 0
    return torch.triu(input, diagonal) if upper else torch.tril(input, diagonal)


@op("CumSum", shape_inputs=(1,))
def cumsum(x: Tensor, axis: Any, *, exclusive: int = 0, reverse: int = 0) -> Tensor:
    """ONNX CumSum (``exclusive`` and ``reverse`` supported)."""
    dim = _axis(int(_scalar(axis)), x.dim())
    if reverse:
        x = x.flip(dim)
    out = torch.cumsum(x, dim).to(x.dtype)
    if exclusive:
        out = out - x
    return out.flip(dim) if reverse else out


# --- scatter, compress, sequences -----------------------------------------------------------


def _positive(indices: Tensor, size: int) -> Tensor:
    indices = indices.long()
    return torch.where(indices < 0, indices + size, indices)


_SCATTER_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


@op("ScatterElements")
def scatter_elements(
    data: Tensor, indices: Tensor, updates: Tensor, *, axis: int = 0, reduction: str = "none"
) -> Tensor:
    """ONNX ScatterElements (negative indices; reductions add/mul/max/min)."""
    dim = _axis(axis, data.dim())
    idx = _positive(indices, data.shape[dim])
    if reduction == "none":
        return data.scatter(dim, idx, updates)
    return data.scatter_reduce(dim, idx, updates, _SCATTER_REDUCE[reduction], include_self=True)


@op("Scatter")
def scatter(data: Tensor, indices: Tensor, updates: Tensor, *, axis: int = 0) -> Tensor:
    """ONNX Scatter (opset 9-10): ScatterElements without reduction."""
    return scatter_elements(data, indices, updates, axis=axis)


@op("ScatterND")
def scatter_nd(data: Tensor, indices: Tensor, updates: Tensor, *, reduction: str = "none") -> Tensor:
    """ONNX ScatterND (reductions add/mul/max/min)."""
    k = indices.shape[-1]
    idx = indices.long().reshape(-1, k)
    for i in range(k):
        idx[:, i] = torch.where(idx[:, i] < 0, idx[:, i] + data.shape[i], idx[:, i])
    rows = updates.reshape(-1, *data.shape[k:])
    flat_index = torch.zeros(idx.shape[0], dtype=torch.long, device=data.device)
    for i in range(k):
        flat_index = flat_index * data.shape[i] + idx[:, i]
    flat = data.reshape(-1, *data.shape[k:])
    if reduction == "none":
        return flat.index_copy(0, flat_index, rows).reshape(data.shape)
    view = flat_index.reshape(-1, *([1] * (rows.dim() - 1))).expand_as(rows)
    return flat.scatter_reduce(0, view, rows, _SCATTER_REDUCE[reduction], include_self=True).reshape(
        data.shape
    )


@op("Compress")
def compress(input: Tensor, condition: Tensor, *, axis: int | None = None) -> Tensor:  # noqa: A002
    """ONNX Compress: the slices along ``axis`` (or of the flattened input) where ``condition``."""
    if axis is None:
        input = input.reshape(-1)
        axis = 0
    dim = _axis(axis, input.dim())
    keep = torch.nonzero(condition.reshape(-1).bool()).reshape(-1)
    keep = keep[keep < input.shape[dim]]
    return input.index_select(dim, keep)


@op("ReverseSequence")
def reverse_sequence(
    input: Tensor,
    sequence_lens: Tensor,
    *,
    batch_axis: int = 1,
    time_axis: int = 0,  # noqa: A002
) -> Tensor:
    """ONNX ReverseSequence: reverse the first ``sequence_lens[b]`` steps of each batch entry."""
    steps = input.shape[time_axis]
    t = torch.arange(steps, device=input.device).reshape(-1, 1)
    lens = sequence_lens.long().to(input.device).reshape(1, -1)
    source = torch.where(t < lens, lens - 1 - t, t)  # (time, batch)
    if time_axis > batch_axis:
        source = source.t()
    shape = [1] * input.dim()
    shape[time_axis], shape[batch_axis] = input.shape[time_axis], input.shape[batch_axis]
    source = source.reshape(shape).expand(input.shape)
    return input.gather(time_axis, source)


@op("EyeLike")
def eye_like(input: Tensor, *, dtype: int | None = None, k: int = 0) -> Tensor:  # noqa: A002
    """ONNX EyeLike: ones on the ``k``-th diagonal of a 2-D tensor shaped like ``input``."""
    rows, cols = input.shape
    i = torch.arange(rows, device=input.device).reshape(-1, 1)
    j = torch.arange(cols, device=input.device).reshape(1, -1)
    out_dtype = input.dtype if dtype is None else torch_dtype(dtype)
    return (j - i == k).to(out_dtype)


@op("CenterCropPad", shape_inputs=(1,))
def center_crop_pad(input_data: Tensor, shape: IntsLike, *, axes: Sequence[int] | None = None) -> Tensor:
    """ONNX CenterCropPad: crop or zero-pad each of ``axes`` to ``shape``, centred."""
    rank = input_data.dim()
    dims = [_axis(a, rank) for a in axes] if axes is not None else list(range(rank))
    out = input_data
    for a, size in zip(dims, _ints(shape)):
        have = out.shape[a]
        if size < have:
            start = (have - size) // 2
            out = out.narrow(a, start, size)
        elif size > have:
            before = (size - have) // 2
            widths = [0] * (2 * (rank - a))  # F.pad order: last dim first
            widths[-2], widths[-1] = before, size - have - before
            out = F.pad(out, widths)
    return out


@op("BitCast")
def bit_cast(input: Tensor, *, to: int) -> Tensor:  # noqa: A002
    """ONNX BitCast: reinterpret the bits as another type of the same width."""
    return input.view(torch_dtype(to))
