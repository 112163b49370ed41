"""Elementwise ops: arithmetic, comparisons, logic, activations, casts."""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import torch
import torch.nn.functional as F

from placement.lowering.ops._registry import (
    FxCall,
    Shapes,
    Tensor,
    _is_int,
    _scalar,
    op,
    torch_dtype,
)
from placement.lowering.ops.training import emit_mode_op

# --- elementwise arithmetic ------------------------------------------------------------

op("Add", operator.add, scalar_inputs=(0, 1), widen_unsigned=True)
op("Sub", operator.sub, scalar_inputs=(0, 1), widen_unsigned=True)
op("Mul", operator.mul, scalar_inputs=(0, 1), widen_unsigned=True)


@op("Div", scalar_inputs=(0, 1), widen_unsigned=True)
def div(A: Any, B: Any) -> Tensor:
    """ONNX Div: true division for floats, truncating division for integers."""
    if _is_int(A) and _is_int(B):
        return torch.div(A, B, rounding_mode="trunc")
    return A / B


@op("Pow", scalar_inputs=(1,))
def pow_(X: Tensor, Y: Any) -> Tensor:
    """ONNX Pow: the result keeps the base's dtype."""
    if isinstance(Y, Tensor) and Y.dtype in (torch.uint16, torch.uint32, torch.uint64):
        Y = Y.to(torch.int64)  # torch has no unsigned kernels for pow's backward
    out = X**Y
    return out if out.dtype == X.dtype else out.to(X.dtype)


@op("Mod", scalar_inputs=(1,), widen_unsigned=True)
def mod(A: Tensor, B: Any, *, fmod: int = 0) -> Tensor:
    """ONNX Mod: the sign of the divisor (``fmod=0``) or of the dividend (``fmod=1``)."""
    return torch.fmod(A, B) if fmod else torch.remainder(A, B)


@op("Max", widen_unsigned=True)
def max_(*data_0: Tensor) -> Tensor:
    """ONNX Max: elementwise maximum of all inputs, broadcasting."""
    return functools.reduce(torch.maximum, data_0)


@op("Min", widen_unsigned=True)
def min_(*data_0: Tensor) -> Tensor:
    """ONNX Min: elementwise minimum of all inputs, broadcasting."""
    return functools.reduce(torch.minimum, data_0)


@op("Sum")
def sum_(*data_0: Tensor) -> Tensor:
    """ONNX Sum: elementwise sum of all inputs, broadcasting."""
    return functools.reduce(operator.add, data_0)


@op("Mean")
def mean(*data_0: Tensor) -> Tensor:
    """ONNX Mean: elementwise mean of all inputs, broadcasting."""
    return functools.reduce(operator.add, data_0) / len(data_0)


# --- elementwise unary -------------------------------------------------------------------

op("Abs", torch.abs)
op("Neg", torch.neg)
op("Exp", torch.exp)
op("Log", torch.log)
op("Sqrt", torch.sqrt)
op("Reciprocal", torch.reciprocal)
op("Floor", torch.floor)
op("Ceil", torch.ceil)
op("Round", torch.round)  # half to even, like ONNX
op("Sign", torch.sign)
op("Sin", torch.sin)
op("Cos", torch.cos)
op("Tan", torch.tan)
op("Asin", torch.asin)
op("Acos", torch.acos)
op("Atan", torch.atan)
op("Sinh", torch.sinh)
op("Cosh", torch.cosh)
op("Asinh", torch.asinh)
op("Acosh", torch.acosh)
op("Atanh", torch.atanh)
op("Tanh", torch.tanh)
op("Erf", torch.erf)
op("Relu", torch.relu)
op("Sigmoid", torch.sigmoid)
op("Softsign", F.softsign)
op("Mish", F.mish)
op("Not", torch.logical_not)
op("IsNaN", torch.isnan)
op("And", torch.logical_and)
op("Or", torch.logical_or)
op("Xor", torch.logical_xor)
op("BitwiseAnd", torch.bitwise_and)
op("BitwiseOr", torch.bitwise_or)
op("BitwiseXor", torch.bitwise_xor)
op("BitwiseNot", torch.bitwise_not, widen_unsigned=True)

op("Equal", operator.eq, scalar_inputs=(0, 1), widen_unsigned=True)
op("Less", operator.lt, scalar_inputs=(0, 1), widen_unsigned=True)
op("LessOrEqual", operator.le, scalar_inputs=(0, 1), widen_unsigned=True)
op("Greater", operator.gt, scalar_inputs=(0, 1), widen_unsigned=True)
op("GreaterOrEqual", operator.ge, scalar_inputs=(0, 1), widen_unsigned=True)


def _direct_where(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    condition, x, y = args
    cond_shape, _, y_shape = (list(shapes) + [None] * 3)[:3]
    if (
        isinstance(x, (int, float))
        and isinstance(y, torch.fx.Node)
        and cond_shape is not None
        and y_shape is not None
        and tuple(torch.broadcast_shapes(cond_shape, y_shape)) == tuple(y_shape)
    ):  # the masked_fill idiom (attention masks)
        return "call_method", "masked_fill", (y, condition, x), {}
    return "call_function", torch.where, tuple(args), {}


@op("Where", scalar_inputs=(1, 2), direct=_direct_where)
def where(condition: Tensor, X: Any, Y: Any) -> Tensor:
    """ONNX Where: ``X`` where ``condition`` else ``Y``, broadcasting."""
    return torch.where(condition, X, Y)


@op("IsInf")
def is_inf(X: Tensor, *, detect_negative: int = 1, detect_positive: int = 1) -> Tensor:
    """ONNX IsInf, optionally only one sign."""
    if detect_negative and detect_positive:
        return torch.isinf(X)
    if detect_positive:
        return torch.isposinf(X)
    if detect_negative:
        return torch.isneginf(X)
    return torch.zeros_like(X, dtype=torch.bool)


@op("Clip", scalar_inputs=(1, 2))
def clip(input: Tensor, min: Any = None, max: Any = None) -> Tensor:  # noqa: A002
    """ONNX Clip: ``min``/``max`` are optional inputs (or attributes before opset 11)."""
    if min is None and max is None:
        return input
    return torch.clamp(input, min, max)


def _direct_gelu(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    return "call_function", F.gelu, (args[0],), dict(kwargs)


@op("Gelu", direct=_direct_gelu)
def gelu(X: Tensor, *, approximate: str = "none") -> Tensor:
    """ONNX Gelu (opset 20): exact or ``tanh`` approximation."""
    return F.gelu(X, approximate=approximate)


@op("LeakyRelu")
def leaky_relu(X: Tensor, *, alpha: float = 0.01) -> Tensor:
    """ONNX LeakyRelu."""
    return F.leaky_relu(X, alpha)


@op("Elu")
def elu(X: Tensor, *, alpha: float = 1.0) -> Tensor:
    """ONNX Elu."""
    return F.elu(X, alpha)


@op("Celu")
def celu(X: Tensor, *, alpha: float = 1.0) -> Tensor:
    """ONNX Celu."""
    return F.celu(X, alpha)


@op("Selu")
def selu(
    X: Tensor, *, alpha: float = 1.67326319217681884765625, gamma: float = 1.05070102214813232421875
) -> Tensor:
    """ONNX Selu with its (float32) default constants."""
    return gamma * torch.where(X > 0, X, alpha * torch.expm1(X))


@op("HardSigmoid")
def hard_sigmoid(X: Tensor, *, alpha: float = 0.2, beta: float = 0.5) -> Tensor:
    """ONNX HardSigmoid: ``clamp(alpha * x + beta, 0, 1)``."""
    return torch.clamp(alpha * X + beta, 0.0, 1.0)


op("HardSwish", F.hardswish)


@op("ThresholdedRelu")
def thresholded_relu(X: Tensor, *, alpha: float = 1.0) -> Tensor:
    """ONNX ThresholdedRelu: ``x`` where ``x > alpha`` else 0."""
    return torch.where(X > alpha, X, torch.zeros_like(X))


@op("PRelu")
def prelu(X: Tensor, slope: Tensor) -> Tensor:
    """ONNX PRelu: ``slope`` broadcasts against ``X``."""
    return torch.where(X < 0, X * slope, X)


@op("Softplus")
def softplus(X: Tensor) -> Tensor:
    """ONNX Softplus: ``log(1 + exp(x))``."""
    return F.softplus(X)


def _direct_softmax(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    return "call_function", torch.softmax, (args[0], kwargs.get("axis", -1)), {}


@op("Softmax", direct=_direct_softmax)
def softmax(input: Tensor, *, axis: int = -1) -> Tensor:  # noqa: A002
    """ONNX Softmax (opset 13+: along one axis)."""
    return torch.softmax(input, axis)


def _direct_log_softmax(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    return "call_function", torch.log_softmax, (args[0], kwargs.get("axis", -1)), {}


@op("LogSoftmax", direct=_direct_log_softmax)
def log_softmax(input: Tensor, *, axis: int = -1) -> Tensor:  # noqa: A002
    """ONNX LogSoftmax (opset 13+: along one axis)."""
    return torch.log_softmax(input, axis)


_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


def _direct_cast(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if set(kwargs) != {"to"} or torch_dtype(kwargs["to"]) in _FLOAT8:
        return None
    return "call_method", "to", (args[0], torch_dtype(kwargs["to"])), {}


def _cast(input: Tensor, dtype: torch.dtype, saturate: int) -> Tensor:  # noqa: A002
    """``input.to(dtype)``, with ONNX's overflow rules for float8 targets: with ``saturate``,
    values past the range (infinities too) become the largest finite value; without, NaN
    (infinity for e5m2)."""
    if dtype not in _FLOAT8 or input.dtype in _FLOAT8:
        return input.to(dtype)
    x = input if input.dtype in (torch.float32, torch.float64) else input.float()
    info = torch.finfo(dtype)
    # round to nearest even overflows from halfway between the largest value and the next step
    limit = info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2
    overflow = x.abs() >= limit  # infinities too
    if saturate:
        y = torch.where(overflow, x.clamp(-info.max, info.max), x)
    elif dtype == torch.float8_e5m2:
        y = torch.where(overflow, x.sign() * math.inf, x)
    else:
        y = torch.where(overflow, torch.full_like(x, math.nan), x)
    return y.to(dtype)


@op("Cast", direct=_direct_cast)
def cast(input: Tensor, *, to: int, saturate: int = 1, round_mode: str = "up") -> Tensor:  # noqa: A002
    """ONNX Cast to the data type number ``to`` (float8 targets saturate as ``saturate`` says)."""
    return _cast(input, torch_dtype(to), saturate)


@op("CastLike")
def cast_like(input: Tensor, target_type: Tensor, *, saturate: int = 1, round_mode: str = "up") -> Tensor:  # noqa: A002
    """ONNX CastLike: cast to the dtype of ``target_type``."""
    return _cast(input, target_type.dtype, saturate)


@op("Identity")
def identity(input: Tensor) -> Tensor:  # noqa: A002
    """ONNX Identity (the lowering aliases it instead of emitting code)."""
    return input


@op("Dropout", scalar_inputs=(1,), emit=emit_mode_op)
def dropout(
    data: Tensor,
    ratio: Any = None,
    training_mode: Any = None,
    *,
    seed: int | None = None,
    num_outputs: int = 1,
) -> Any:
    """ONNX Dropout: the identity in inference (plus an all-true mask if asked); with a true
    ``training_mode`` input, a random mask keeps each element with probability ``1 - ratio``."""
    p = 0.5 if ratio is None else float(_scalar(ratio))
    if training_mode is None or not bool(_scalar(training_mode)) or p == 0.0:
        keep = torch.ones_like(data, dtype=torch.bool)
        return data if num_outputs == 1 else (data, keep)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=data.device)
        generator.manual_seed(int(seed))
    keep = torch.rand(data.shape, generator=generator, device=data.device) >= p
    out = data * keep / (1.0 - p)
    return out if num_outputs == 1 else (out, keep)


@op("BitShift", widen_unsigned=True)
def bit_shift(X: Tensor, Y: Tensor, *, direction: str) -> Tensor:
    """ONNX BitShift on unsigned integers (``LEFT`` or ``RIGHT``)."""
    if direction == "LEFT":
        return torch.bitwise_left_shift(X, Y)
    return torch.bitwise_right_shift(X, Y)


@op("Swish")
def swish(X: Tensor, *, alpha: float = 1.0) -> Tensor:
    """ONNX Swish: ``x * sigmoid(alpha * x)``."""
    return X * torch.sigmoid(alpha * X)


@op("Shrink")
def shrink(input: Tensor, *, bias: float = 0.0, lambd: float = 0.5) -> Tensor:  # noqa: A002
    """ONNX Shrink: ``x + bias`` below ``-lambd``, ``x - bias`` above ``lambd``, else 0."""
    zero = torch.zeros((), dtype=input.dtype, device=input.device)
    return torch.where(input < -lambd, input + bias, torch.where(input > lambd, input - bias, zero)).to(
        input.dtype
    )
