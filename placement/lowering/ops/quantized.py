"""Integer-quantized ops: ``QuantizeLinear``/``DequantizeLinear`` (per tensor, per axis, blocked),
``DynamicQuantizeLinear``, ``MatMulInteger``, ``ConvInteger``, ``QLinearMatMul``, ``QLinearConv``
and ONNX Runtime's ``com.microsoft`` ``MatMulIntegerToFloat`` and ``DynamicQuantizeMatMul``.

Integer products are exact: the shifted operands (at most 16 bits each) are multiplied and
summed in float64, whose 53-bit mantissa holds every partial sum of any realistic reduction
length, then converted to int32 (float64 GEMMs and convolutions run on every device, which
integer ones do not). Rounding is half to even and results saturate to the output type, as
ONNX says; requantization multiplies the int32 accumulator by the float32 factor
``a_scale * b_scale / y_scale`` in float32, as ONNX Runtime does.

Example:
    >>> import torch
    >>> from placement.lowering.ops.quantized import quantize_linear
    >>> quantize_linear(torch.tensor([0.5, 1.5, 2.5, 300.0]), torch.tensor(1.0)).tolist()
    [0, 2, 2, 255]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, _axis, op, torch_dtype
from placement.lowering.ops.conv import conv
from placement.lowering.ops.elementwise import _cast

#: Integer output types QuantizeLinear saturates to (float8 types saturate through their cast).
_INT_RANGES = {
    torch.uint8: (0, 255),
    torch.int8: (-128, 127),
    torch.uint16: (0, 65535),
    torch.int16: (-32768, 32767),
    torch.int32: (-(2**31), 2**31 - 1),
}


def _broadcast_param(param: Tensor, x: Tensor, axis: int, block_size: int) -> Tensor:
    """A scale or zero point, per tensor / per axis / blocked, shaped to broadcast against ``x``."""
    if param.numel() == 1 and param.dim() <= 1:
        return param.reshape(())
    axis = _axis(axis, x.dim())
    if block_size:
        if param.dim() != x.dim():
            raise LoweringError("blocked quantization: the scale has the input's rank")
        return param.repeat_interleave(block_size, dim=axis).narrow(axis, 0, x.shape[axis])
    if param.dim() != 1 or param.shape[0] != x.shape[axis]:
        raise LoweringError(
            f"per-axis quantization: a scale of shape {tuple(param.shape)} does not match axis {axis} "
            f"of an input of shape {tuple(x.shape)}"
        )
    shape = [1] * x.dim()
    shape[axis] = -1
    return param.reshape(shape)


def _saturate(values: Tensor, dtype: torch.dtype) -> Tensor:
    """Rounded values (float) clamped into ``dtype``'s range and cast."""
    if dtype in _INT_RANGES:
        low, high = _INT_RANGES[dtype]
        if dtype in (torch.uint16,):  # no uint16 clamp kernels everywhere: go through int32
            return values.clamp(low, high).to(torch.int32).to(dtype)
        return values.clamp(low, high).to(dtype)
    return values.to(dtype)


@op("QuantizeLinear")
def quantize_linear(
    x: Tensor,
    y_scale: Tensor,
    y_zero_point: Tensor | None = None,
    *,
    axis: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
    precision: int = 0,
    saturate: int = 1,
) -> Tensor:
    """ONNX QuantizeLinear: ``saturate(round_half_even(x / y_scale) + y_zero_point)``, scales per
    tensor, per ``axis`` or in blocks of ``block_size`` along it; output type from the zero point,
    ``output_dtype`` or uint8."""
    if y_zero_point is not None:
        dtype = y_zero_point.dtype
    elif output_dtype:
        dtype = torch_dtype(output_dtype)
    else:
        dtype = torch.uint8
    compute = torch.float32 if x.dtype != torch.float64 else torch.float64
    scale = _broadcast_param(y_scale.to(compute), x, axis, block_size)
    scaled = x.to(compute) / scale
    if dtype.is_floating_point:  # float8: the cast rounds to nearest even
        if y_zero_point is not None:
            zero = _broadcast_param(y_zero_point.to(compute), x, axis, block_size)
            scaled = scaled + zero
        return _cast(scaled, dtype, saturate)
    values = torch.round(scaled)
    if y_zero_point is not None:
        values = values + _broadcast_param(y_zero_point.to(compute), x, axis, block_size)
    return _saturate(values, dtype)


@op("DequantizeLinear")
def dequantize_linear(
    x: Tensor,
    x_scale: Tensor,
    x_zero_point: Tensor | None = None,
    *,
    axis: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
) -> Tensor:
    """ONNX DequantizeLinear: ``(x - x_zero_point) * x_scale`` in the scale's type (or
    ``output_dtype``), scales per tensor, per ``axis`` or in blocks."""
    dtype = torch_dtype(output_dtype) if output_dtype else x_scale.dtype
    scale = _broadcast_param(x_scale, x, axis, block_size)
    if x.dtype.is_floating_point:  # float8
        values = x.to(torch.float32)
        if x_zero_point is not None:
            values = values - _broadcast_param(x_zero_point.to(torch.float32), x, axis, block_size)
    else:
        values = x.to(torch.int64)
        if x_zero_point is not None:
            values = values - _broadcast_param(x_zero_point.to(torch.int64), x, axis, block_size)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (values.to(compute) * scale.to(compute)).to(dtype)


@op("DynamicQuantizeLinear")
def dynamic_quantize_linear(x: Tensor, *, num_outputs: int = 3) -> tuple[Tensor, Tensor, Tensor]:
    """ONNX DynamicQuantizeLinear: uint8 ``y``, the float scale ``(max(x, 0) - min(x, 0)) / 255``
    (1 for an all-zero ``x``, as ONNX Runtime) and the zero point ``saturate(round(-min / scale))``."""
    data = x.detach().float()
    low = torch.clamp(data.min(), max=0.0) if data.numel() else data.new_zeros(())
    high = torch.clamp(data.max(), min=0.0) if data.numel() else data.new_zeros(())
    # ONNX Runtime's choice for an all-zero input, where the formula divides by zero: scale 1
    scale = torch.where(high == low, torch.ones_like(high), (high - low) / 255.0)
    zero = torch.round(torch.clamp(-low / scale, 0.0, 255.0))
    y = torch.clamp(torch.round(x.float() / scale) + zero, 0.0, 255.0).to(torch.uint8)
    return y, scale.to(x.dtype), zero.to(torch.uint8)


def _shifted(value: Tensor, zero_point: Tensor | None, *, rows: bool = False) -> Tensor:
    """``value - zero_point`` in float64 (exact for 8- and 16-bit integers).

    A 1-D zero point is per row of ``value`` (``rows``: the A operand of a matmul, ``[M]``)
    or per column (the B operand, ``[N]``).
    """
    out = value.to(torch.float64)
    if zero_point is None:
        return out
    zero = zero_point.to(torch.float64)
    if rows and zero.dim() >= 1 and zero.numel() > 1:
        zero = zero.unsqueeze(-1)
    return out - zero


def _int_matmul(a: Tensor, b: Tensor, a_zero_point: Tensor | None, b_zero_point: Tensor | None) -> Tensor:
    """The exact int32 product ``(a - a_zero_point) @ (b - b_zero_point)``, in float64."""
    return torch.matmul(_shifted(a, a_zero_point, rows=True), _shifted(b, b_zero_point))


def _requantize(acc: Tensor, factor: Tensor, zero_point: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``saturate(round_half_even(float32(acc) * factor) + zero_point)``: ONNX Runtime's order."""
    values = torch.round(acc.to(torch.float32) * factor.to(torch.float32))
    if zero_point is not None:
        values = values + zero_point.to(torch.float32)
    return _saturate(values, dtype)


@op("MatMulInteger")
def matmul_integer(
    A: Tensor, B: Tensor, a_zero_point: Tensor | None = None, b_zero_point: Tensor | None = None
) -> Tensor:
    """ONNX MatMulInteger: int32 ``(A - a_zero_point) @ (B - b_zero_point)`` (zero points per
    tensor, per row of A or per column of B)."""
    return _int_matmul(A, B, a_zero_point, b_zero_point).to(torch.int32)


@op("QLinearMatMul")
def qlinear_matmul(
    a: Tensor,
    a_scale: Tensor,
    a_zero_point: Tensor,
    b: Tensor,
    b_scale: Tensor,
    b_zero_point: Tensor,
    y_scale: Tensor,
    y_zero_point: Tensor,
) -> Tensor:
    """ONNX QLinearMatMul: the int32 product of the shifted operands requantized with
    ``a_scale * b_scale / y_scale`` to ``y_zero_point``'s type."""
    acc = _int_matmul(a, b, a_zero_point, b_zero_point)
    a_s = a_scale.float().unsqueeze(-1) if a_scale.numel() > 1 else a_scale.float().reshape(())
    factor = a_s * b_scale.float() / y_scale.float()
    return _requantize(acc, factor, y_zero_point, y_zero_point.dtype)


def _conv_int(
    x: Tensor, w: Tensor, x_zero_point: Tensor | None, w_zero_point: Tensor | None, attrs: dict[str, Any]
) -> Tensor:
    """The exact int32 convolution of the shifted operands (padding reads the zero point)."""
    xs = _shifted(x, None if x_zero_point is None else x_zero_point.reshape(()))
    ws = w.to(torch.float64)
    if w_zero_point is not None:
        zero = w_zero_point.to(torch.float64)
        ws = ws - (zero.reshape(-1, *([1] * (w.dim() - 1))) if zero.numel() > 1 else zero.reshape(()))
    return conv(xs, ws, None, **attrs)


@op("ConvInteger")
def conv_integer(
    x: Tensor,
    w: Tensor,
    x_zero_point: Tensor | None = None,
    w_zero_point: Tensor | None = None,
    *,
    auto_pad: str = "NOTSET",
    dilations: Sequence[int] | None = None,
    group: int = 1,
    kernel_shape: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> Tensor:
    """ONNX ConvInteger: int32 convolution of ``x - x_zero_point`` with ``w - w_zero_point``
    (``w_zero_point`` per tensor or per output channel)."""
    attrs = dict(auto_pad=auto_pad, dilations=dilations, group=group, pads=pads, strides=strides)
    return _conv_int(x, w, x_zero_point, w_zero_point, attrs).to(torch.int32)


@op("QLinearConv")
def qlinear_conv(
    x: Tensor,
    x_scale: Tensor,
    x_zero_point: Tensor,
    w: Tensor,
    w_scale: Tensor,
    w_zero_point: Tensor,
    y_scale: Tensor,
    y_zero_point: Tensor,
    B: Tensor | None = None,
    *,
    auto_pad: str = "NOTSET",
    dilations: Sequence[int] | None = None,
    group: int = 1,
    kernel_shape: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> Tensor:
    """ONNX QLinearConv: int32 convolution plus the int32 bias ``B``, requantized with
    ``x_scale * w_scale / y_scale`` (``w_scale`` per tensor or per output channel)."""
    attrs = dict(auto_pad=auto_pad, dilations=dilations, group=group, pads=pads, strides=strides)
    acc = _conv_int(x, w, x_zero_point, w_zero_point, attrs)
    spatial = [1] * (x.dim() - 2)
    if B is not None:
        acc = acc + B.to(torch.float64).reshape(1, -1, *spatial)
    w_s = w_scale.float().reshape(1, -1, *spatial) if w_scale.numel() > 1 else w_scale.float().reshape(())
    factor = x_scale.float().reshape(()) * w_s / y_scale.float().reshape(())
    return _requantize(acc, factor, y_zero_point.reshape(()), y_zero_point.dtype)


# --- ONNX Runtime's com.microsoft quantized ops ----------------------------------------------


@op("MatMulIntegerToFloat", domain="com.microsoft")
def matmul_integer_to_float(
    A: Tensor,
    B: Tensor,
    a_scale: Tensor,
    b_scale: Tensor,
    a_zero_point: Tensor | None = None,
    b_zero_point: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """ORT's MatMulIntegerToFloat: ``float(MatMulInteger(A, B)) * a_scale * b_scale + bias``."""
    acc = _int_matmul(A, B, a_zero_point, b_zero_point).to(torch.float32)
    out = acc * (a_scale.float() * b_scale.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(a_scale.dtype)


@op("DynamicQuantizeMatMul", domain="com.microsoft")
def dynamic_quantize_matmul(
    A: Tensor,
    B: Tensor,
    b_scale: Tensor,
    b_zero_point: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """ORT's DynamicQuantizeMatMul: ``A`` quantized to uint8 as DynamicQuantizeLinear does,
    then MatMulIntegerToFloat with ``B``."""
    a_q, a_scale, a_zero = dynamic_quantize_linear(A)
    return matmul_integer_to_float(a_q, B, a_scale, b_scale, a_zero, b_zero_point, bias).to(A.dtype)


__all__ = [
    "quantize_linear",
    "dequantize_linear",
    "dynamic_quantize_linear",
    "matmul_integer",
    "qlinear_matmul",
    "conv_integer",
    "qlinear_conv",
    "matmul_integer_to_float",
    "dynamic_quantize_matmul",
]
