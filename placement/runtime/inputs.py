"""Input normalisation and validation shared by the runtimes.

Runtimes accept ``inputs`` as a dict by graph-input name or a sequence in
graph-input order (a single array is accepted for a one-input model), with
numpy arrays or torch tensors as values. :func:`normalize_inputs` turns that
into a list of contiguous numpy arrays in graph-input order and checks names,
dtypes, ranks and static dimensions, raising :class:`placement.InputError`
that names the offending input (expected vs got). A symbolic dimension accepts
any size, the same wherever the graph's inputs share it: ``input_ids [batch, seq]``
and ``attention_mask [batch, seq]`` must agree on ``seq`` (an error names both inputs,
before anything runs).

Integer inputs are widened losslessly: an array of a narrower integer type than the
graph's integer input (``int32`` token ids for an ``int64`` input; any integer type
numpy casts to the graph's without loss, ``np.can_cast(..., "safe")``) is cast to it.
Nothing else is converted: floats stay what they are given as, and a cast that could
lose values (``int64`` to ``int32``, signed to unsigned) is an error.

With ``device_values=True`` (what :class:`placement.Runner` asks for), values that
live on a device stay there: a torch CUDA tensor becomes an ``OrtValue`` over the
same memory (DLPack, no copy; made contiguous on its device first if it is not), and
an ``onnxruntime.OrtValue`` is taken as it is. Both are checked like arrays. A torch
CPU tensor becomes a numpy array over its memory either way (no copy).

Example:
    >>> import numpy as np
    >>> from placement.runtime.inputs import InputSpec, normalize_inputs
    >>> spec = [InputSpec("x", np.dtype("float32"), ("batch", 4))]
    >>> [a.shape for a in normalize_inputs({"x": np.zeros((2, 4), np.float32)}, spec)]
    [(2, 4)]
    >>> normalize_inputs({"y": np.zeros((2, 4), np.float32)}, spec)
    Traceback (most recent call last):
    ...
    placement.errors.InputError: unknown input 'y'; the model's inputs are: 'x'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import onnx_ir as ir

from placement.errors import InputError
from placement.runtime.names import check_names

__all__ = [
    "InputSpec",
    "InputsLike",
    "check_shared_dims",
    "check_value",
    "contiguous",
    "input_specs",
    "is_device_value",
    "normalize_inputs",
    "ortvalue_from_torch",
    "input_to_numpy",
    "value_dtype",
]

#: What runtimes accept as ``inputs``.
InputsLike = Union[Mapping[str, Any], Sequence[Any], Any]

Dim = Union[int, str, None]


@dataclass(frozen=True)
class InputSpec:
    """A graph input: name, numpy dtype (None if unknown) and dims (int, or str/None if symbolic).

    ``kind`` is ``"tensor"``, ``"sequence"`` (a list of arrays), ``"optional"``
    (``None`` or a value) or ``"other"``; non-tensor values are passed through
    as ONNX Runtime takes them (lists of arrays, ``None``), their elements converted
    to numpy.
    """

    name: str
    dtype: np.dtype | None
    shape: tuple[Dim, ...] | None
    kind: str = "tensor"

    def describe(self) -> str:
        """``float32[batch, 4]``-style text."""
        dtype = str(self.dtype) if self.dtype is not None else "?"
        if self.shape is None:
            return f"{dtype}[...]"
        return f"{dtype}[{', '.join('?' if d is None else str(d) for d in self.shape)}]"


def input_specs(graph: ir.Graph) -> list[InputSpec]:
    """The specs of a graph's inputs (initializers excluded), in order."""
    specs = []
    inits = graph.initializers
    for value in graph.inputs:
        if value.name in inits:
            continue
        dtype = None
        if value.dtype is not None:
            try:
                dtype = np.dtype(value.dtype.numpy())
            except Exception:  # types numpy cannot express (e.g. float8): skip the dtype check
                dtype = None
        shape: tuple[Dim, ...] | None = None
        if value.shape is not None:
            shape = tuple(
                d if isinstance(d, int) else (d.value if hasattr(d, "value") else None) for d in value.shape
            )
        specs.append(InputSpec(value.name or "", dtype, shape, _kind(value.type)))
    return specs


def _kind(type_: Any) -> str:
    if type_ is None or isinstance(type_, ir.TensorType):
        return "tensor"
    if isinstance(type_, ir.SequenceType):
        return "sequence"
    if isinstance(type_, ir.OptionalType):
        return "optional"
    return "other"


def _non_tensor(spec: InputSpec, value: Any) -> Any:
    """A sequence, optional or other non-tensor input as ONNX Runtime takes it."""
    if value is None and spec.kind == "optional":
        return None
    if isinstance(value, (list, tuple)) and spec.kind != "other":
        return [contiguous(input_to_numpy(spec.name, v)) for v in value]
    if spec.kind == "sequence":
        raise InputError(
            f"input {spec.name!r} is a sequence: pass a list of arrays, got {type(value).__name__}"
        )
    if spec.kind == "optional" or isinstance(value, np.ndarray):
        return contiguous(input_to_numpy(spec.name, value))
    return value


def input_to_numpy(name: str, value: Any) -> np.ndarray:
    """A numpy array from a numpy array, torch tensor, scalar or nested list.

    Raises:
        InputError: the value cannot be converted (names ``name``).
    """
    if isinstance(value, np.ndarray):
        return value
    module = type(value).__module__ or ""
    if module.startswith("torch") and hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    if module.startswith("onnxruntime") and hasattr(value, "numpy"):
        return value.numpy()
    if isinstance(value, (int, float, bool, np.generic, list, tuple)):
        return np.asarray(value)
    raise InputError(f"input {name!r}: expected a numpy array or torch tensor, got {type(value).__name__}")


def normalize_inputs(
    inputs: InputsLike, specs: Sequence[InputSpec], *, device_values: bool = False
) -> list[Any]:
    """Validated, contiguous numpy arrays in graph-input order.

    Inputs that are not tensors (sequences, optionals) come back as lists of
    arrays or ``None``.

    Args:
        inputs: a dict by input name, a sequence in input order, or one array
            when the model has exactly one input.
        specs: the model's inputs (see :func:`input_specs`).
        device_values: keep torch CUDA tensors and ``OrtValue`` s on their device:
            they come back as ``OrtValue`` s (see the module docstring).

    Raises:
        InputError: an unknown or missing name, a wrong count, dtype, rank or
            static dimension; the message names the input and says expected vs got.
    """
    if type(inputs) is dict or type(inputs) is list:
        ready = _ready(inputs, specs)
        if ready is not None:
            return ready
    names = [s.name for s in specs]
    if isinstance(inputs, Mapping):
        check_names(
            inputs,
            names,
            error=InputError,
            unknown="unknown input {names}; the model's inputs are: {expected}",
            missing="missing input {names}; the model's inputs are: {expected}",
        )
        values = [inputs[n] for n in names]
    elif _is_array(inputs):
        if len(specs) != 1:
            raise InputError(
                f"got one array but the model has {len(specs)} inputs "
                f"({', '.join(map(repr, names))}); pass a dict by name or a sequence"
            )
        values = [inputs]
    elif isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)):
        if len(inputs) != len(specs):
            raise InputError(
                f"got {len(inputs)} inputs but the model has {len(specs)} ({', '.join(map(repr, names))})"
            )
        values = list(inputs)
    else:
        raise InputError(f"inputs must be a dict by name or a sequence in order, got {type(inputs).__name__}")
    arrays = []
    for spec, value in zip(specs, values):
        if spec.kind != "tensor":
            arrays.append(_non_tensor(spec, value))
            continue
        if device_values and is_device_value(value):
            arrays.append(_device_value(spec, value))
            continue
        array = _widen(spec, input_to_numpy(spec.name, value))
        _check(spec, array)
        arrays.append(contiguous(array))
    check_shared_dims(specs, [getattr(a, "shape", None) for a in arrays])
    return arrays


def _widen(spec: InputSpec, array: np.ndarray) -> np.ndarray:
    """``array`` cast to the spec's integer dtype when that loses nothing (see the module docstring)."""
    want = spec.dtype
    if (
        want is not None
        and array.dtype != want
        and array.dtype.kind in "iu"
        and want.kind in "iu"
        and np.can_cast(array.dtype, want, "safe")
    ):
        return array.astype(want)
    return array


def check_shared_dims(specs: Sequence[InputSpec], shapes: Sequence[Any]) -> None:
    """Check that the inputs agree on every symbolic dimension they share.

    ``shapes``: per spec, the given value's shape (None or a callable for values without
    one, which are skipped; an ``OrtValue``'s ``shape`` method is called).

    Raises:
        InputError: two inputs give one symbol different sizes (names both, the symbol and
            the sizes).

    Example:
        >>> ids = InputSpec("ids", np.dtype("int64"), ("b", "s"))
        >>> check_shared_dims([ids, InputSpec("mask", np.dtype("int64"), ("b", "s"))], [(4, 12), (4, 7)])
        Traceback (most recent call last):
        ...
        placement.errors.InputError: input 'mask' has size 7 in dimension 1 ('s'), but input 'ids' gives ...
    """
    seen: dict[str, tuple[str, int, int]] = {}
    for spec, shape in zip(specs, shapes):
        if spec.shape is None or shape is None:
            continue
        if callable(shape):
            shape = shape()
        for axis, (want, have) in enumerate(zip(spec.shape, shape)):
            if type(want) is not str:
                continue
            first = seen.setdefault(want, (spec.name, axis, int(have)))
            if first[2] != int(have):
                name, first_axis, size = first
                other = next(s for s in specs if s.name == name)
                both = spec.describe() if other.describe() == spec.describe() else None
                tail = (
                    f"expected {both} for both"
                    if both
                    else f"expected {other.describe()} and {spec.describe()}"
                )
                raise InputError(
                    f"input {spec.name!r} has size {int(have)} in dimension {axis} ({want!r}), but input "
                    f"{name!r} gives {want!r} size {size} in its dimension {first_axis} ({tail})"
                )


def is_device_value(value: Any) -> bool:
    """True for an ``onnxruntime.OrtValue`` or a torch tensor on a GPU (values that
    :func:`normalize_inputs` keeps on their device with ``device_values=True``)."""
    module = type(value).__module__ or ""
    if module.startswith("onnxruntime"):
        return hasattr(value, "_ortvalue") or hasattr(value, "data_ptr")
    return module.startswith("torch") and getattr(getattr(value, "device", None), "type", "cpu") == "cuda"


def value_dtype(value: Any) -> np.dtype | None:
    """The numpy dtype of an ``OrtValue`` or torch tensor (None where numpy has none, e.g. bfloat16)."""
    if hasattr(value, "data_type"):
        name = value.data_type().removeprefix("tensor(").removesuffix(")")
        return _ONNX_NUMPY.get(name)
    import torch

    try:
        return np.dtype(torch.empty((), dtype=value.dtype).numpy().dtype)
    except (TypeError, RuntimeError):
        return None


#: ONNX tensor element type names (as ``OrtValue.data_type()`` spells them) -> numpy dtypes.
_ONNX_NUMPY = {
    name: np.dtype(dtype)
    for name, dtype in {
        "float": "float32", "double": "float64", "float16": "float16", "int8": "int8", "int16": "int16",
        "int32": "int32", "int64": "int64", "uint8": "uint8", "uint16": "uint16", "uint32": "uint32",
        "uint64": "uint64", "bool": "bool",
    }.items()
}  # fmt: skip


def ortvalue_from_torch(tensor: Any) -> Any:
    """An ``OrtValue`` over a torch tensor's memory (DLPack: no copy; a non-contiguous tensor is
    made contiguous on its device first). Bool tensors go through a ``uint8`` view, which ONNX
    Runtime's DLPack import reads as bool when told. For a CUDA tensor, torch's current stream
    on its device is synchronised first (ONNX Runtime runs on streams of its own).

    Example:
        >>> import torch
        >>> t = torch.arange(6.0).reshape(2, 3)
        >>> ortvalue_from_torch(t).data_ptr() == t.data_ptr()
        True
    """
    import onnxruntime as ort
    import torch
    from onnxruntime.capi import _pybind_state as _C

    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.device.type == "cuda":  # ONNX Runtime reads it on its own stream: let torch's finish first
        torch.cuda.current_stream(tensor.device).synchronize()
    if tensor.dtype == torch.bool:
        return ort.OrtValue(_C.OrtValue.from_dlpack(tensor.view(torch.uint8).__dlpack__(), True))
    return ort.OrtValue(_C.OrtValue.from_dlpack(tensor.__dlpack__(), False))


def _device_value(spec: InputSpec, value: Any) -> Any:
    """A checked device value (an ``OrtValue`` on its device)."""
    if hasattr(value, "data_type"):  # an OrtValue
        if not value.is_tensor():
            raise InputError(f"input {spec.name!r}: expected a tensor OrtValue, got {value.data_type()}")
        check_value(spec, value_dtype(value), tuple(value.shape()))
        return value
    check_value(spec, value_dtype(value), tuple(value.shape))
    return ortvalue_from_torch(value)


def _ready(inputs: dict[str, Any] | list[Any], specs: Sequence[InputSpec]) -> list[np.ndarray] | None:
    """The arrays of ``inputs`` in order if they need nothing done (a dict by name or a list
    in order holding exactly the model's tensor inputs as C-contiguous numpy arrays of the
    right dtype, rank and static sizes), else None (:func:`normalize_inputs` then converts
    and explains).

    The common case of every run, checked with as little Python as it takes.
    """
    if len(inputs) != len(specs):
        return None
    by_name = type(inputs) is dict
    arrays = []
    for n, spec in enumerate(specs):
        array = inputs.get(spec.name) if by_name else inputs[n]  # type: ignore[union-attr,index]
        shape = spec.shape
        if (
            type(array) is not np.ndarray
            or spec.kind != "tensor"
            or array.dtype != spec.dtype
            or shape is None
            or array.ndim != len(shape)
            or not array.flags.c_contiguous
        ):
            return None
        for want, have in zip(shape, array.shape):
            if type(want) is int and want != have:
                return None
        arrays.append(array)
    check_shared_dims(specs, [a.shape for a in arrays])
    return arrays


def _is_array(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return True
    module = type(value).__module__ or ""
    return (module.startswith("torch") and hasattr(value, "detach")) or (
        module.startswith("onnxruntime") and hasattr(value, "data_type")
    )


class _Described:
    """A value's dtype and shape, as an error message says them (``float32[2, 4]``)."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: np.dtype | None, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, shape

    def __str__(self) -> str:
        return f"{self.dtype if self.dtype is not None else '?'}[{', '.join(map(str, self.shape))}]"


def _check(spec: InputSpec, array: np.ndarray) -> None:
    check_value(spec, array.dtype, tuple(array.shape))


def check_value(spec: InputSpec, dtype: np.dtype | None, shape: Sequence[int]) -> None:
    """Check a value's dtype (``None``: not expressible in numpy, unchecked) and shape against
    ``spec``, without touching its data (so it serves torch tensors on any device too).

    Raises:
        InputError: a wrong dtype, rank or static dimension, naming the input, what
            was expected and what was given.

    Example:
        >>> spec = InputSpec("x", np.dtype("float32"), (4,))
        >>> check_value(spec, np.dtype("float32"), (4,))
        >>> check_value(spec, np.dtype("float32"), (2, 4))
        Traceback (most recent call last):
        ...
        placement.errors.InputError: input 'x' has rank 2, expected 1 (expected float32[4], got float32[2, 4])
    """
    shape = tuple(int(d) for d in shape)
    got = _Described(dtype, shape)  # formatted only for an error message
    strings = spec.dtype == np.dtype(object) and dtype is not None and dtype.kind in "OUS"
    if spec.dtype is not None and dtype is not None and dtype != spec.dtype and not strings:
        raise InputError(
            f"input {spec.name!r} has dtype {dtype}, expected {spec.dtype} "
            f"(expected {spec.describe()}, got {got})"
        )
    if spec.shape is None:
        return
    if len(shape) != len(spec.shape):
        raise InputError(
            f"input {spec.name!r} has rank {len(shape)}, expected {len(spec.shape)} "
            f"(expected {spec.describe()}, got {got})"
        )
    for axis, (want, have) in enumerate(zip(spec.shape, shape)):
        if isinstance(want, int) and want != have:
            raise InputError(
                f"input {spec.name!r} has size {have} in dimension {axis}, expected {want} "
                f"(expected {spec.describe()}, got {got})"
            )


def contiguous(value: Any) -> Any:
    """``value`` C-contiguous: a torch tensor on its own device (``Tensor.contiguous``), anything
    else as a numpy array, 0-d arrays kept 0-d (``np.ascontiguousarray`` makes them 1-d).

    Example:
        >>> contiguous(np.float32(3)).shape
        ()
        >>> contiguous(np.ones((3, 2)).T).flags.c_contiguous
        True
    """
    if hasattr(value, "contiguous") and hasattr(value, "__dlpack__"):
        return value.contiguous()
    return np.asarray(value, order="C")
