"""The op table: one :class:`Rule` per ONNX op type, registered with :func:`op`.

Every op family module (``elementwise``, ``linalg``, ``nn``, ``shape``,
``reduction``, ``random``) registers each of its op types with the one
decorator :func:`op`, which keeps everything the library knows about an op type
in one place: the torch lowering, how constants may be fed to it, the optional
direct (plain torch) form, its analytic FLOP cost and its flags
(nondeterministic, unsigned widening) and an optional custom emitter (fusion
with a consumer, inlined control flow).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import onnx_ir as ir
import torch
from onnx_ir import tensor_adapters

from placement.analysis import NONDETERMINISTIC_OPS
from placement.errors import LoweringError

Tensor = torch.Tensor
IntsLike = Union[Tensor, Sequence[int], int, None]
Shapes = Sequence[Union[tuple[int, ...], None]]
#: ``(fx op, target, args, kwargs)``: one FX node equivalent to a rule call.
FxCall = tuple[str, Any, tuple[Any, ...], dict[str, Any]]
Direct = Callable[[tuple[Any, ...], dict[str, Any], Shapes], Union[FxCall, None]]


@dataclass(frozen=True)
class Rule:
    """Everything known about one ONNX op type.

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
        nondeterministic: outputs differ between runs with the same inputs
            (random ops, :data:`placement.analysis.NONDETERMINISTIC_OPS`): never folded.
        widen_unsigned: torch lacks kernels for uint16/32/64 here; the lowering
            computes in int64 and casts back.
        emit: optional ``emit(lowering, node, inputs, physical_device) -> bool``
            that lowers this instance itself instead of a call to ``fn``: fusing
            it with its consumer (``MatMul`` + bias ``Add`` -> ``F.linear``) or
            inlining the branch an ``If`` takes; True when it took the op.
        params: the attribute names ``fn`` accepts (derived).
    """

    op_type: str
    fn: Callable[..., Any]
    shape_inputs: tuple[int, ...] = ()
    scalar_inputs: tuple[int, ...] = ()
    foldable: bool = True
    check: Callable[[dict[str, Any]], str | None] | None = None
    direct: Direct | None = None
    buffer_inputs: tuple[int, ...] = ()
    nondeterministic: bool = False
    widen_unsigned: bool = False
    emit: Callable[..., bool] | None = None
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
        return dict(_defaults_cached(self.fn))


@functools.cache
def _defaults_cached(fn: Callable[..., Any]) -> tuple[tuple[str, Any], ...]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ()
    return tuple(
        (n, p.default) for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty
    )


def _unsupported(*args: Any, op_type: str = "?", **kwargs: Any) -> Any:
    raise LoweringError(f"ONNX op type {op_type!r} has no torch lowering rule")


#: The rule for op types missing from :data:`RULES`: it raises ``LoweringError``.
DEFAULT_RULE = Rule("<unsupported>", _unsupported, foldable=False)

#: ONNX op type -> :class:`Rule`. Extend it with :func:`op`.
RULES: dict[str, Rule] = {}


def op(
    op_type: str,
    fn: Callable[..., Any] | None = None,
    *,
    shape_inputs: tuple[int, ...] = (),
    scalar_inputs: tuple[int, ...] = (),
    foldable: bool | None = None,
    check: Callable[[dict[str, Any]], str | None] | None = None,
    direct: Direct | None = None,
    buffer_inputs: tuple[int, ...] = (),
    widen_unsigned: bool = False,
    emit: Callable[..., bool] | None = None,
    domain: str = "",
) -> Any:
    """Register the rule for ``op_type`` in :data:`RULES` (see :class:`Rule`).

    Used as a decorator on the torch implementation (``@op("Div")``), or called
    with an existing torch function whose semantics match ONNX
    (``op("Abs", torch.abs)``). Returns the function. ``foldable`` defaults to
    ``not nondeterministic`` (whether the op type is in
    :data:`placement.analysis.NONDETERMINISTIC_OPS`). An op of another ``domain``
    (``"com.microsoft"``) is keyed ``"<domain>::<op_type>"``. A rule whose function takes
    an ``opset`` keyword is given the model's default-domain opset (for defaults that
    changed between opsets).
    """

    nondeterministic = op_type in NONDETERMINISTIC_OPS
    key = op_type if domain in ("", "ai.onnx") else f"{domain}::{op_type}"

    def register(impl: Callable[..., Any]) -> Callable[..., Any]:
        if key in RULES:
            raise ValueError(f"op type {key!r} registered twice")
        RULES[key] = Rule(
            op_type,
            impl,
            shape_inputs=shape_inputs,
            scalar_inputs=scalar_inputs,
            foldable=(not nondeterministic) if foldable is None else foldable,
            check=check,
            direct=direct,
            buffer_inputs=buffer_inputs,
            nondeterministic=nondeterministic,
            widen_unsigned=widen_unsigned,
            emit=emit,
        )
        return impl

    return register if fn is None else register(fn)


def get_rule(op_type: str, domain: str = "") -> Rule:
    """The rule for ``op_type`` in ``domain``, or :data:`DEFAULT_RULE`."""
    if domain not in ("", "ai.onnx"):
        return RULES.get(f"{domain}::{op_type}", DEFAULT_RULE)
    return RULES.get(op_type, DEFAULT_RULE)


def supported_op_types() -> list[str]:
    """Sorted ONNX op types with a rule (other domains as ``"<domain>::<op_type>"``)."""
    return sorted(RULES)


# --- helpers shared by the op families --------------------------------------------------


def torch_dtype(onnx_dtype: int) -> torch.dtype:
    """The torch dtype of an ONNX data type number (``1`` -> ``torch.float32``).

    Raises:
        LoweringError: the type has no torch equivalent (strings, 4-bit types).
    """
    try:
        dtype = tensor_adapters.to_torch_dtype(ir.DataType(int(onnx_dtype)))
    except (KeyError, ValueError, TypeError):
        dtype = None
    if dtype is None or dtype in _NO_KERNELS:
        try:
            name = f"{ir.DataType(int(onnx_dtype)).name} ({int(onnx_dtype)})"
        except ValueError:
            name = str(onnx_dtype)
        raise LoweringError(f"ONNX data type {name} has no torch equivalent with kernels")
    return dtype


#: torch dtypes that exist as names only: no casts or arithmetic (sub-byte integers, e8m0).
_NO_KERNELS = frozenset(
    getattr(torch, name)
    for name in [f"{s}int{b}" for s in ("", "u") for b in range(1, 8)] + ["float8_e8m0fnu"]
    if hasattr(torch, name)
)


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


def _ints_literal(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) for v in value)


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
