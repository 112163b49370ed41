"""The ONNX -> torch rule table: one small torch function per ONNX op type.

In the style of JAX's per-primitive rule tables, :data:`RULES` maps an ONNX op
type (default domain, opset 13 or newer) to a :class:`Rule` whose ``fn`` takes the
op's inputs positionally (``None`` for an omitted optional input) and its
attributes as keyword arguments named exactly like the ONNX attributes, and
returns a tensor (one output) or a tuple of tensors (several outputs). Inputs
are named like the ONNX inputs, so an attribute that became an input in a later
opset (``Squeeze(axes)``, ``Split(split)``, ``Reduce*(axes)``, ``Clip(min, max)``)
works in both forms. Op types without a rule get :data:`DEFAULT_RULE`, which
raises :class:`~placement.errors.LoweringError` naming the op.

A rule also declares how the lowering (``placement.runtime.lowering.lower``) may
feed it constants:

* ``shape_inputs``: positions of shape-like inputs (shapes, axes, pads, sizes,
  repeats). When such an input is a lowering-time constant it is passed as a
  Python int or list, so ``Reshape`` becomes ``reshape(x, [2, 8, 4, 8])`` and
  never syncs a GPU to read a shape. Rules accept tensors there too.
* ``scalar_inputs``: positions where a 0-d constant may be passed as a Python
  number (``x * 0.125`` instead of a 0-d buffer).
* ``buffer_inputs``: positions holding state rather than weights (BatchNorm's
  running statistics): initializers fed there become buffers, not parameters.

and, optionally, a ``direct`` emitter: for instances where plain torch has the
same semantics (``Transpose`` with ``perm`` -> ``x.permute(...)``, ``Gather`` on
axis 0 -> ``w[idx]``, ``Where(c, scalar, y)`` -> ``y.masked_fill(c, scalar)``),
the lowering emits that call instead of the rule. Rules are the reference; the
direct forms are checked against them by the same tests.

Example:
    >>> import torch
    >>> from placement.runtime.lowering.ops import RULES
    >>> RULES["Gemm"].fn(torch.ones(2, 3), torch.ones(4, 3), torch.zeros(4), transB=1).shape
    torch.Size([2, 4])
    >>> RULES["Reshape"].fn(torch.zeros(2, 6), [0, -1, 3]).shape  # 0 copies the input dim
    torch.Size([2, 2, 3])
    >>> "Loop" in RULES
    False
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
import torch.nn.functional as F

from placement.errors import LoweringError

__all__ = [
    "Rule",
    "RULES",
    "DEFAULT_RULE",
    "get_rule",
    "supported_op_types",
    "torch_dtype",
    "rule",
    "direct",
]

Tensor = torch.Tensor
IntsLike = Union[Tensor, Sequence[int], int, None]
Shapes = Sequence[Union[tuple[int, ...], None]]
#: ``(fx op, target, args, kwargs)``: one FX node equivalent to a rule call.
FxCall = tuple[str, Any, tuple[Any, ...], dict[str, Any]]
Direct = Callable[[tuple[Any, ...], dict[str, Any], Shapes], Union[FxCall, None]]


@dataclass(frozen=True)
class Rule:
    """How one ONNX op type lowers to torch.

    Attributes:
        op_type: the ONNX op type.
        fn: the torch implementation (inputs positionally, attributes as keywords).
        shape_inputs: inputs passed as Python ints/lists when constant.
        scalar_inputs: inputs passed as Python numbers when they are 0-d constants.
        foldable: the lowering may evaluate the op once when all inputs are constant.
        check: optional ``check(attributes) -> problem or None``, run at lowering
            time for attribute combinations the rule does not implement.
        direct: optional ``direct(args, kwargs, shapes) -> (fx op, target, args,
            kwargs) or None``: an equivalent plain torch call for this instance
            (``x.permute(0, 2, 1, 3)`` rather than ``transpose(x, perm=...)``), used by
            the lowering for readable, lower-overhead code. ``args`` hold fx nodes or
            inlined constants, ``kwargs`` the attributes that differ from the rule's
            defaults, ``shapes`` the static input shapes (``None`` when unknown).
        buffer_inputs: inputs that are state, not weights (BatchNormalization's
            running statistics): initializers fed there become buffers, not
            trainable parameters.
    """

    op_type: str
    fn: Callable[..., Any]
    shape_inputs: tuple[int, ...] = ()
    scalar_inputs: tuple[int, ...] = ()
    foldable: bool = True
    check: Callable[[dict[str, Any]], str | None] | None = None
    direct: Direct | None = None
    buffer_inputs: tuple[int, ...] = ()
    params: frozenset[str] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):  # builtins: no attributes accepted
            object.__setattr__(self, "params", frozenset())
            return
        names = {
            name for name, p in sig.parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        }
        object.__setattr__(self, "params", frozenset(names))

    def defaults(self) -> dict[str, Any]:
        """Keyword defaults of ``fn`` (used to keep generated code short)."""
        return _defaults(self.fn)


@functools.cache
def _defaults_cached(fn: Callable[..., Any]) -> tuple[tuple[str, Any], ...]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ()
    return tuple(
        (n, p.default) for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty
    )


def _defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    return dict(_defaults_cached(fn))


def _unsupported(*args: Any, op_type: str = "?", **kwargs: Any) -> Any:
    raise LoweringError(f"ONNX op type {op_type!r} has no torch lowering rule")


#: The rule for op types missing from :data:`RULES`: it raises ``LoweringError``.
DEFAULT_RULE = Rule("<unsupported>", _unsupported, foldable=False)

#: ONNX op type -> :class:`Rule`. Extend it with :func:`rule`.
RULES: dict[str, Rule] = {}


def rule(
    op_type: str,
    *,
    shape_inputs: tuple[int, ...] = (),
    scalar_inputs: tuple[int, ...] = (),
    foldable: bool = True,
    check: Callable[[dict[str, Any]], str | None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering ``fn`` as the rule for ``op_type`` in :data:`RULES`."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        RULES[op_type] = Rule(op_type, fn, shape_inputs, scalar_inputs, foldable, check)
        return fn

    return register


def _alias(op_type: str, fn: Callable[..., Any], **kwargs: Any) -> None:
    """Register an existing torch function (same semantics as ONNX) as a rule."""
    RULES[op_type] = Rule(op_type, fn, **kwargs)


def get_rule(op_type: str, domain: str = "") -> Rule:
    """The rule for ``op_type`` in ``domain``, or :data:`DEFAULT_RULE`."""
    if domain not in ("", "ai.onnx"):
        return DEFAULT_RULE
    return RULES.get(op_type, DEFAULT_RULE)


def supported_op_types() -> list[str]:
    """Sorted ONNX op types with a rule."""
    return sorted(RULES)


# --- helpers -----------------------------------------------------------------------

#: ONNX ``TensorProto.DataType`` -> torch dtype.
_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.uint8,
    3: torch.int8,
    4: torch.uint16,
    5: torch.int16,
    6: torch.int32,
    7: torch.int64,
    9: torch.bool,
    10: torch.float16,
    11: torch.float64,
    12: torch.uint32,
    13: torch.uint64,
    14: torch.complex64,
    15: torch.complex128,
    16: torch.bfloat16,
    17: torch.float8_e4m3fn,
    18: torch.float8_e4m3fnuz,
    19: torch.float8_e5m2,
    20: torch.float8_e5m2fnuz,
}


def torch_dtype(onnx_dtype: int) -> torch.dtype:
    """The torch dtype of an ONNX data type number (``1`` -> ``torch.float32``).

    Raises:
        LoweringError: the type has no torch equivalent (strings, 4-bit types).
    """
    try:
        return _DTYPES[int(onnx_dtype)]
    except KeyError:
        raise LoweringError(f"ONNX data type {onnx_dtype} has no torch equivalent") from None


def _ints(value: IntsLike) -> list[int]:
    """A shape-like input as a list of Python ints (a tensor is read once)."""
    if value is None:
        return []
    if isinstance(value, Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _scalar(value: Any) -> Any:
    """A 0-d / 1-element input as a Python number."""
    if isinstance(value, Tensor):
        return value.reshape(-1)[0].item()
    if isinstance(value, (list, tuple)):
        return value[0]
    return value


def _is_int(value: Any) -> bool:
    if isinstance(value, Tensor):
        return not (value.dtype.is_floating_point or value.dtype.is_complex)
    return isinstance(value, (int, bool))


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _torch_pads(pads: Sequence[int], rank: int, axes: Sequence[int] | None = None) -> list[int]:
    """ONNX pads ``[b_1..b_n, e_1..e_n]`` -> F.pad order (last dim first)."""
    n = len(pads) // 2
    axes = [_axis(a, rank) for a in axes] if axes is not None else list(range(rank - n, rank))
    per_dim = {a: (pads[i], pads[i + n]) for i, a in enumerate(axes)}
    first = min(per_dim) if per_dim else rank
    out: list[int] = []
    for d in range(rank - 1, first - 1, -1):
        out.extend(per_dim.get(d, (0, 0)))
    while len(out) > 2 and out[-2:] == [0, 0]:  # leading dims without padding
        del out[-2:]
    return out


# --- elementwise arithmetic ------------------------------------------------------------

_alias("Add", operator.add, scalar_inputs=(0, 1))
_alias("Sub", operator.sub, scalar_inputs=(0, 1))
_alias("Mul", operator.mul, scalar_inputs=(0, 1))


@rule("Div", scalar_inputs=(0, 1))
def div(A: Any, B: Any) -> Tensor:
    """ONNX Div: true division for floats, truncating division for integers."""
    if _is_int(A) and _is_int(B):
        return torch.div(A, B, rounding_mode="trunc")
    return A / B


@rule("Pow", scalar_inputs=(1,))
def pow_(X: Tensor, Y: Any) -> Tensor:
    """ONNX Pow: the result keeps the base's dtype."""
    out = X**Y
    return out if out.dtype == X.dtype else out.to(X.dtype)


@rule("Mod", scalar_inputs=(1,))
def mod(A: Tensor, B: Any, *, fmod: int = 0) -> Tensor:
    """ONNX Mod: the sign of the divisor (``fmod=0``) or of the dividend (``fmod=1``)."""
    return torch.fmod(A, B) if fmod else torch.remainder(A, B)


@rule("Max")
def max_(*data_0: Tensor) -> Tensor:
    """ONNX Max: elementwise maximum of all inputs, broadcasting."""
    return functools.reduce(torch.maximum, data_0)


@rule("Min")
def min_(*data_0: Tensor) -> Tensor:
    """ONNX Min: elementwise minimum of all inputs, broadcasting."""
    return functools.reduce(torch.minimum, data_0)


@rule("Sum")
def sum_(*data_0: Tensor) -> Tensor:
    """ONNX Sum: elementwise sum of all inputs, broadcasting."""
    return functools.reduce(operator.add, data_0)


@rule("Mean")
def mean(*data_0: Tensor) -> Tensor:
    """ONNX Mean: elementwise mean of all inputs, broadcasting."""
    return functools.reduce(operator.add, data_0) / len(data_0)


# --- elementwise unary -------------------------------------------------------------------

for _op, _fn in {
    "Abs": torch.abs,
    "Neg": torch.neg,
    "Exp": torch.exp,
    "Log": torch.log,
    "Sqrt": torch.sqrt,
    "Reciprocal": torch.reciprocal,
    "Floor": torch.floor,
    "Ceil": torch.ceil,
    "Round": torch.round,  # half to even, like ONNX
    "Sign": torch.sign,
    "Sin": torch.sin,
    "Cos": torch.cos,
    "Tan": torch.tan,
    "Asin": torch.asin,
    "Acos": torch.acos,
    "Atan": torch.atan,
    "Sinh": torch.sinh,
    "Cosh": torch.cosh,
    "Asinh": torch.asinh,
    "Acosh": torch.acosh,
    "Atanh": torch.atanh,
    "Tanh": torch.tanh,
    "Erf": torch.erf,
    "Relu": torch.relu,
    "Sigmoid": torch.sigmoid,
    "Softsign": F.softsign,
    "Mish": F.mish,
    "Not": torch.logical_not,
    "IsNaN": torch.isnan,
    "MatMul": torch.matmul,
    "And": torch.logical_and,
    "Or": torch.logical_or,
    "Xor": torch.logical_xor,
    "BitwiseAnd": torch.bitwise_and,
    "BitwiseOr": torch.bitwise_or,
    "BitwiseXor": torch.bitwise_xor,
    "BitwiseNot": torch.bitwise_not,
}.items():
    _alias(_op, _fn)

_alias("Equal", operator.eq, scalar_inputs=(0, 1))
_alias("Less", operator.lt, scalar_inputs=(0, 1))
_alias("LessOrEqual", operator.le, scalar_inputs=(0, 1))
_alias("Greater", operator.gt, scalar_inputs=(0, 1))
_alias("GreaterOrEqual", operator.ge, scalar_inputs=(0, 1))


@rule("Where", scalar_inputs=(1, 2))
def where(condition: Tensor, X: Any, Y: Any) -> Tensor:
    """ONNX Where: ``X`` where ``condition`` else ``Y``, broadcasting."""
    return torch.where(condition, X, Y)


@rule("IsInf")
def is_inf(X: Tensor, *, detect_negative: int = 1, detect_positive: int = 1) -> Tensor:
    """ONNX IsInf, optionally only one sign."""
    if detect_negative and detect_positive:
        return torch.isinf(X)
    if detect_positive:
        return torch.isposinf(X)
    if detect_negative:
        return torch.isneginf(X)
    return torch.zeros_like(X, dtype=torch.bool)


@rule("Clip", scalar_inputs=(1, 2))
def clip(input: Tensor, min: Any = None, max: Any = None) -> Tensor:  # noqa: A002
    """ONNX Clip: ``min``/``max`` are optional inputs (or attributes before opset 11)."""
    if min is None and max is None:
        return input
    return torch.clamp(input, min, max)


@rule("Gelu")
def gelu(X: Tensor, *, approximate: str = "none") -> Tensor:
    """ONNX Gelu (opset 20): exact or ``tanh`` approximation."""
    return F.gelu(X, approximate=approximate)


@rule("LeakyRelu")
def leaky_relu(X: Tensor, *, alpha: float = 0.01) -> Tensor:
    """ONNX LeakyRelu."""
    return F.leaky_relu(X, alpha)


@rule("Elu")
def elu(X: Tensor, *, alpha: float = 1.0) -> Tensor:
    """ONNX Elu."""
    return F.elu(X, alpha)


@rule("Celu")
def celu(X: Tensor, *, alpha: float = 1.0) -> Tensor:
    """ONNX Celu."""
    return F.celu(X, alpha)


@rule("Selu")
def selu(
    X: Tensor, *, alpha: float = 1.67326319217681884765625, gamma: float = 1.05070102214813232421875
) -> Tensor:
    """ONNX Selu with its (float32) default constants."""
    return gamma * torch.where(X > 0, X, alpha * torch.expm1(X))


@rule("HardSigmoid")
def hard_sigmoid(X: Tensor, *, alpha: float = 0.2, beta: float = 0.5) -> Tensor:
    """ONNX HardSigmoid: ``clamp(alpha * x + beta, 0, 1)``."""
    return torch.clamp(alpha * X + beta, 0.0, 1.0)


_alias("HardSwish", F.hardswish)


@rule("ThresholdedRelu")
def thresholded_relu(X: Tensor, *, alpha: float = 1.0) -> Tensor:
    """ONNX ThresholdedRelu: ``x`` where ``x > alpha`` else 0."""
    return torch.where(X > alpha, X, torch.zeros_like(X))


@rule("PRelu")
def prelu(X: Tensor, slope: Tensor) -> Tensor:
    """ONNX PRelu: ``slope`` broadcasts against ``X``."""
    return torch.where(X < 0, X * slope, X)


@rule("Softplus")
def softplus(X: Tensor) -> Tensor:
    """ONNX Softplus: ``log(1 + exp(x))``."""
    return F.softplus(X)


@rule("Softmax")
def softmax(input: Tensor, *, axis: int = -1) -> Tensor:  # noqa: A002
    """ONNX Softmax (opset 13+: along one axis)."""
    return torch.softmax(input, axis)


@rule("LogSoftmax")
def log_softmax(input: Tensor, *, axis: int = -1) -> Tensor:  # noqa: A002
    """ONNX LogSoftmax (opset 13+: along one axis)."""
    return torch.log_softmax(input, axis)


@rule("Cast")
def cast(input: Tensor, *, to: int, saturate: int = 1, round_mode: str = "up") -> Tensor:  # noqa: A002
    """ONNX Cast to the data type number ``to``."""
    return input.to(torch_dtype(to))


@rule("CastLike")
def cast_like(input: Tensor, target_type: Tensor, *, saturate: int = 1, round_mode: str = "up") -> Tensor:  # noqa: A002
    """ONNX CastLike: cast to the dtype of ``target_type``."""
    return input.to(target_type.dtype)


@rule("Identity")
def identity(input: Tensor) -> Tensor:  # noqa: A002
    """ONNX Identity (the lowering aliases it instead of emitting code)."""
    return input


@rule("Dropout", scalar_inputs=(1,))
def dropout(
    data: Tensor, ratio: Any = None, training_mode: Any = None, *, seed: int = 0, num_outputs: int = 1
) -> Any:
    """ONNX Dropout in inference: the identity (plus an all-true mask if asked)."""
    if num_outputs == 1:
        return data
    return data, torch.ones_like(data, dtype=torch.bool)


# --- linear algebra -------------------------------------------------------------------


@rule("Gemm", scalar_inputs=(2,))
def gemm(
    A: Tensor,
    B: Tensor,
    C: Any = None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    transA: int = 0,
    transB: int = 0,
) -> Tensor:
    """ONNX Gemm: ``alpha * A' @ B' + beta * C``; ``F.linear`` when it is a Linear layer."""
    if transB and not transA and alpha == 1.0 and beta == 1.0 and (C is None or _is_vector(C)):
        return F.linear(A, B, C)
    a = A.t() if transA else A
    b = B.t() if transB else B
    out = a @ b
    if alpha != 1.0:
        out = out * alpha
    if C is not None:
        out = out + (C * beta if beta != 1.0 else C)
    return out


def _is_vector(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1


@rule("Einsum")
def einsum(*Inputs: Tensor, equation: str) -> Tensor:
    """ONNX Einsum."""
    return torch.einsum(equation, *Inputs)


# --- normalisation ---------------------------------------------------------------------


@rule("LayerNormalization")
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


RULES["BatchNormalization"] = Rule(
    "BatchNormalization", batch_normalization, check=_inference_only, buffer_inputs=(3, 4)
)


@rule("InstanceNormalization")
def instance_normalization(input: Tensor, scale: Tensor, B: Tensor, *, epsilon: float = 1e-5) -> Tensor:  # noqa: A002
    """ONNX InstanceNormalization (per sample and channel)."""
    return F.instance_norm(input, weight=scale, bias=B, eps=epsilon)


@rule("GroupNormalization")
def group_normalization(
    X: Tensor, scale: Tensor, bias: Tensor, *, num_groups: int, epsilon: float = 1e-5, stash_type: int = 1
) -> Tensor:
    """ONNX GroupNormalization (opset 21 per-channel scale; opset 18 per-group scale too)."""
    channels = X.shape[1]
    if scale.numel() == num_groups and channels != num_groups:
        scale = scale.repeat_interleave(channels // num_groups)
        bias = bias.repeat_interleave(channels // num_groups)
    return F.group_norm(X, num_groups, scale, bias, epsilon)


@rule("LpNormalization")
def lp_normalization(input: Tensor, *, axis: int = -1, p: int = 2) -> Tensor:  # noqa: A002
    """ONNX LpNormalization: ``x / ||x||_p`` along ``axis``."""
    return input / torch.linalg.vector_norm(input, p, dim=axis, keepdim=True)


@rule("LRN")
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


@rule("Conv")
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


@rule("ConvTranspose")
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


@rule("MaxPool", check=_pool_check)
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


@rule("AveragePool")
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


@rule("GlobalAveragePool")
def global_average_pool(X: Tensor) -> Tensor:
    """ONNX GlobalAveragePool: mean over the spatial dims, kept."""
    return X.mean(dim=tuple(range(2, X.dim())), keepdim=True)


@rule("GlobalMaxPool")
def global_max_pool(X: Tensor) -> Tensor:
    """ONNX GlobalMaxPool: max over the spatial dims, kept."""
    return X.amax(dim=tuple(range(2, X.dim())), keepdim=True)


# --- shape and data movement ------------------------------------------------------------


@rule("Reshape", shape_inputs=(1,))
def reshape(data: Tensor, shape: IntsLike, *, allowzero: int = 0) -> Tensor:
    """ONNX Reshape: ``0`` copies the input dim (unless ``allowzero``), ``-1`` is inferred."""
    dims = _ints(shape)
    if not allowzero and 0 in dims:
        dims = [data.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return data.reshape(dims)


@rule("Flatten")
def flatten(input: Tensor, *, axis: int = 1) -> Tensor:  # noqa: A002
    """ONNX Flatten to 2-D at ``axis``."""
    axis = _axis(axis, input.dim())
    return input.reshape(math.prod(input.shape[:axis]), -1)


@rule("Transpose")
def transpose(data: Tensor, *, perm: Sequence[int] | None = None) -> Tensor:
    """ONNX Transpose (default: reverse the dims)."""
    return data.permute(list(perm) if perm is not None else list(range(data.dim() - 1, -1, -1)))


@rule("Squeeze", shape_inputs=(1,))
def squeeze(data: Tensor, axes: IntsLike = None) -> Tensor:
    """ONNX Squeeze: the given axes, or every size-1 dim."""
    if axes is None:
        return data.squeeze()
    return data.squeeze(tuple(_ints(axes)))


@rule("Unsqueeze", shape_inputs=(1,))
def unsqueeze(data: Tensor, axes: IntsLike) -> Tensor:
    """ONNX Unsqueeze: ``axes`` index the output's dims."""
    rank = data.dim() + len(_ints(axes))
    for a in sorted(_axis(a, rank) for a in _ints(axes)):
        data = data.unsqueeze(a)
    return data


@rule("Concat")
def concat(*inputs: Tensor, axis: int) -> Tensor:
    """ONNX Concat along ``axis``."""
    return torch.cat(inputs, axis)


@rule("Split", shape_inputs=(1,))
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


@rule("Slice", shape_inputs=(1, 2, 3, 4))
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


@rule("Gather")
def gather(data: Tensor, indices: Tensor, *, axis: int = 0) -> Tensor:
    """ONNX Gather: index ``data`` along ``axis`` (negative indices allowed)."""
    axis = _axis(axis, data.dim())
    if axis == 0:
        return data[indices]
    return data[(slice(None),) * axis + (indices,)]


@rule("GatherElements")
def gather_elements(data: Tensor, indices: Tensor, *, axis: int = 0) -> Tensor:
    """ONNX GatherElements (``torch.gather``; negative indices allowed)."""
    axis = _axis(axis, data.dim())
    return torch.gather(data, axis, torch.remainder(indices, data.shape[axis]).long())


def _gather_nd_check(attrs: dict[str, Any]) -> str | None:
    return "batch_dims != 0" if attrs.get("batch_dims") else None


@rule("GatherND", check=_gather_nd_check)
def gather_nd(data: Tensor, indices: Tensor, *, batch_dims: int = 0) -> Tensor:
    """ONNX GatherND with ``batch_dims=0``."""
    return data[tuple(indices[..., i] for i in range(indices.shape[-1]))]


@rule("Expand", shape_inputs=(1,))
def expand(input: Tensor, shape: IntsLike) -> Tensor:  # noqa: A002
    """ONNX Expand: broadcast ``input`` and ``shape`` both ways."""
    return input.expand(torch.broadcast_shapes(tuple(input.shape), tuple(_ints(shape))))


@rule("Tile", shape_inputs=(1,))
def tile(input: Tensor, repeats: IntsLike) -> Tensor:  # noqa: A002
    """ONNX Tile."""
    return input.repeat(_ints(repeats))


@rule("Pad", shape_inputs=(1, 3), scalar_inputs=(2,))
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


@rule("Shape")
def shape(data: Tensor, *, start: int = 0, end: int | None = None, device: Any = None) -> Tensor:
    """ONNX Shape (the lowering folds it to a constant when the shape is static)."""
    dims = list(data.shape)[start:end] if end is not None else list(data.shape)[start:]
    return torch.tensor(dims, dtype=torch.int64, device=device)


@rule("Size")
def size(data: Tensor, *, device: Any = None) -> Tensor:
    """ONNX Size: the element count as a 0-d int64 tensor."""
    return torch.tensor(data.numel(), dtype=torch.int64, device=device)


@rule("ConstantOfShape", shape_inputs=(0,))
def constant_of_shape(input: IntsLike, *, value: Tensor | None = None, device: Any = None) -> Tensor:  # noqa: A002
    """ONNX ConstantOfShape (default: float32 zeros)."""
    if value is None:
        return torch.zeros(_ints(input), dtype=torch.float32, device=device)
    return torch.full(_ints(input), value.reshape(-1)[0].item(), dtype=value.dtype, device=device)


@rule("Range", shape_inputs=(0, 1, 2))
def range_(start: Any, limit: Any, delta: Any, *, device: Any = None) -> Tensor:
    """ONNX Range: ``arange(start, limit, delta)`` in the inputs' dtype."""
    tensors = [v for v in (start, limit, delta) if isinstance(v, Tensor)]
    if tensors:
        dtype = tensors[0].dtype
    else:
        dtype = torch.float32 if any(isinstance(v, float) for v in (start, limit, delta)) else torch.int64
    return torch.arange(_scalar(start), _scalar(limit), _scalar(delta), dtype=dtype, device=device)


@rule("Constant")
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


@rule("Trilu", shape_inputs=(1,))
def trilu(input: Tensor, k: Any = None, *, upper: int = 1) -> Tensor:  # noqa: A002
    """ONNX Trilu: upper (``triu``) or lower (``tril``) triangle from diagonal ``k``."""
    diagonal = _scalar(k) if k is not None else 0
    return torch.triu(input, diagonal) if upper else torch.tril(input, diagonal)


@rule("CumSum", shape_inputs=(1,))
def cumsum(x: Tensor, axis: Any, *, exclusive: int = 0, reverse: int = 0) -> Tensor:
    """ONNX CumSum (``exclusive`` and ``reverse`` supported)."""
    dim = _axis(int(_scalar(axis)), x.dim())
    if reverse:
        x = x.flip(dim)
    out = torch.cumsum(x, dim)
    if exclusive:
        out = out - x
    return out.flip(dim) if reverse else out


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


RULES["Resize"] = Rule("Resize", resize, (1, 2, 3), (), True, _resize_check)


# --- reductions ---------------------------------------------------------------------------


def _reduce(fn: Callable[[Tensor, tuple[int, ...], bool], Tensor]) -> Callable[..., Tensor]:
    def reduce(
        data: Tensor, axes: IntsLike = None, *, keepdims: int = 1, noop_with_empty_axes: int = 0
    ) -> Tensor:
        dims = tuple(_ints(axes)) if axes is not None else ()
        if not dims:
            if noop_with_empty_axes:
                return data
            dims = tuple(range(data.dim()))
        return fn(data, dims, bool(keepdims))

    return reduce


def _prod(x: Tensor, dims: tuple[int, ...], keep: bool) -> Tensor:
    for d in sorted((_axis(d, x.dim()) for d in dims), reverse=True):
        x = x.prod(d, keepdim=keep)
    return x


_REDUCTIONS: dict[str, Callable[[Tensor, tuple[int, ...], bool], Tensor]] = {
    "ReduceMean": lambda x, d, k: x.mean(d, keepdim=k),
    "ReduceSum": lambda x, d, k: x.sum(d, keepdim=k),
    "ReduceMax": lambda x, d, k: x.amax(d, keepdim=k),
    "ReduceMin": lambda x, d, k: x.amin(d, keepdim=k),
    "ReduceProd": _prod,
    "ReduceL1": lambda x, d, k: x.abs().sum(d, keepdim=k),
    "ReduceL2": lambda x, d, k: torch.linalg.vector_norm(x, 2, dim=d, keepdim=k),
    "ReduceSumSquare": lambda x, d, k: (x * x).sum(d, keepdim=k),
    "ReduceLogSum": lambda x, d, k: x.sum(d, keepdim=k).log(),
    "ReduceLogSumExp": lambda x, d, k: torch.logsumexp(x, d, keepdim=k),
}

for _name, _impl in _REDUCTIONS.items():
    _fn = _reduce(_impl)
    _fn.__name__ = _fn.__qualname__ = "reduce_" + _name[len("Reduce") :].lower()
    _fn.__doc__ = f"ONNX {_name} over ``axes`` (input, or attribute before opset 18)."
    globals()[_fn.__name__] = _fn
    RULES[_name] = Rule(_name, _fn, shape_inputs=(1,))


def _arg_reduce(largest: bool) -> Callable[..., Tensor]:
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

    return arg


arg_max = _arg_reduce(True)
arg_max.__name__ = arg_max.__qualname__ = "arg_max"
arg_min = _arg_reduce(False)
arg_min.__name__ = arg_min.__qualname__ = "arg_min"
RULES["ArgMax"] = Rule("ArgMax", arg_max)
RULES["ArgMin"] = Rule("ArgMin", arg_min)


@rule("TopK", shape_inputs=(1,))
def top_k(X: Tensor, K: Any, *, axis: int = -1, largest: int = 1, sorted: int = 1) -> tuple[Tensor, Tensor]:  # noqa: A002
    """ONNX TopK: ``(values, int64 indices)``."""
    values, indices = torch.topk(X, int(_scalar(K)), axis, bool(largest), bool(sorted))
    return values, indices


@rule("OneHot", shape_inputs=(1,))
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


@rule("NonZero")
def non_zero(X: Tensor) -> Tensor:
    """ONNX NonZero: indices of non-zero elements, shape ``(rank, count)``."""
    return torch.nonzero(X).t()


# --- direct emission: plain torch calls for common instances ---------------------------


def direct(op_type: str) -> Callable[[Direct], Direct]:
    """Decorator attaching a direct emitter (see :class:`Rule`) to ``op_type``'s rule."""

    def attach(fn: Direct) -> Direct:
        RULES[op_type] = dataclasses.replace(RULES[op_type], direct=fn)
        return fn

    return attach


def _ints_literal(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) for v in value)


@direct("Split")
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


@direct("Transpose")
def _direct_transpose(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    perm = kwargs.get("perm")
    if perm is None or len(kwargs) != 1:
        return None
    return "call_method", "permute", (args[0], *perm), {}


@direct("Reshape")
def _direct_reshape(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if len(args) < 2 or not _ints_literal(args[1]):
        return None
    if 0 in args[1] and not kwargs.get("allowzero", 0):
        return None
    return "call_method", "reshape", (args[0], args[1]), {}


@direct("Softmax")
def _direct_softmax(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    return "call_function", torch.softmax, (args[0], kwargs.get("axis", -1)), {}


@direct("LogSoftmax")
def _direct_log_softmax(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    return "call_function", torch.log_softmax, (args[0], kwargs.get("axis", -1)), {}


@direct("Where")
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


@direct("Gather")
def _direct_gather(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if kwargs.get("axis", 0) != 0:
        return None
    return "call_function", operator.getitem, (args[0], args[1]), {}


@direct("Gemm")
def _direct_gemm(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if kwargs != {"transB": 1}:
        return None
    if (
        len(args) == 3
        and args[2] is not None
        and (len(shapes) < 3 or shapes[2] is None or len(shapes[2]) != 1)
    ):
        return None
    return "call_function", F.linear, tuple(args), {}


@direct("Concat")
def _direct_concat(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    return "call_function", torch.cat, (list(args), kwargs["axis"]), {}


@direct("Unsqueeze")
def _direct_unsqueeze(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if len(args) == 2 and _ints_literal(args[1]) and len(args[1]) == 1:
        return "call_method", "unsqueeze", (args[0], args[1][0]), {}
    return None


@direct("Squeeze")
def _direct_squeeze(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if len(args) == 2 and _ints_literal(args[1]) and args[1]:
        return "call_method", "squeeze", (args[0], tuple(args[1])), {}
    return None


@direct("Gelu")
def _direct_gelu(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    return "call_function", F.gelu, (args[0],), dict(kwargs)


@direct("Cast")
def _direct_cast(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if set(kwargs) != {"to"}:
        return None
    return "call_method", "to", (args[0], torch_dtype(kwargs["to"])), {}


@direct("LayerNormalization")
def _direct_layer_norm(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    scale = shapes[1] if len(shapes) > 1 else None
    bias = shapes[2] if len(shapes) > 2 and len(args) > 2 and args[2] is not None else scale
    if set(kwargs) - {"epsilon"} or scale is None or len(scale) != 1 or bias != scale:
        return None  # axis=-1 (the default) with 1-D scale and bias only
    eps = kwargs.get("epsilon", 1e-5)
    bias_arg = args[2] if len(args) > 2 else None
    return "call_function", F.layer_norm, (args[0], tuple(scale), args[1], bias_arg, eps), {}


@direct("Slice")
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
        index[axis + offset] = slice(start or None, stop, None if step == 1 else step)
    if offset:
        index.insert(0, Ellipsis)
    return "call_function", operator.getitem, (args[0], tuple(index)), {}


_INT64_MAX = 2**63 - 1


@direct("Conv")
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


@direct("BatchNormalization")
def _direct_batch_norm(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Shapes) -> FxCall | None:
    if set(kwargs) - {"epsilon", "momentum"} or len(args) != 5:
        return None
    x, scale, bias, mean_, var = args
    if not all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in (mean_, var)):
        return None  # running statistics computed in the graph: the rule detaches them
    eps = kwargs.get("epsilon", 1e-5)
    return "call_function", F.batch_norm, (x, mean_, var, scale, bias, False, 0.0, eps), {}
