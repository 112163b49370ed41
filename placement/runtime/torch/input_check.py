"""Input checks for modules from :func:`placement.to_torch`, as :class:`placement.Runner` does them.

A lowered module is generated ``torch.fx`` code: given a tensor of the wrong rank it
would broadcast silently, and given the wrong dtype it fails deep inside an op with a
raw torch error. :func:`install_input_check` adds a forward pre-hook that checks the
call's tensors against the graph's inputs first (dtype, rank, static dimensions, symbolic
dimensions shared between inputs; no data is read, so tensors stay where they are) and raises
:class:`placement.InputError` naming the input, what it expects and what it got. A narrower
integer tensor than the graph's integer input (``int32`` token ids) is widened losslessly,
on its device, as :class:`placement.Runner` does.

Example:
    >>> import torch
    >>> import placement as pl
    >>> net = torch.nn.Linear(4, 2)
    >>> module = pl.to_torch(pl.from_torch(net, (torch.randn(3, 4),)), device_map="cpu")
    >>> module(torch.randn(4))
    Traceback (most recent call last):
    ...
    placement.errors.InputError: input 'input' has rank 1, expected 2 (expected float32[3, 4], got float32[4])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from placement.errors import InputError
from placement.runtime.inputs import InputSpec, check_shared_dims, check_value

__all__ = ["install_input_check", "check_call"]


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """The numpy dtype of a torch dtype; None for those numpy lacks (bfloat16, float8)."""
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None


def check_call(
    specs: Sequence[InputSpec],
    keywords: Sequence[str],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    float_dtype: np.dtype | str | None = None,
) -> dict[int, Any]:
    """Check a call's positional and keyword tensors against the graph inputs ``specs``
    (``keywords``: the keyword name of each input, in the same order). ``float_dtype``:
    the dtype the module's floating parameters were converted to (``module.double()``),
    which its floating inputs may then have instead of the graph's; ``"any"`` for a module
    without floating parameters, whose floating inputs may have any floating dtype.

    Returns:
        Input index -> the tensor to pass instead: an integer tensor narrower than the
        graph's integer input, widened losslessly as :class:`placement.Runner` does
        (:mod:`placement.runtime.inputs`); empty when nothing changes.

    Raises:
        InputError: too many, unknown, repeated or missing inputs, a value that is not
            a tensor, a wrong dtype, rank or static dimension (naming the input), or two
            inputs giving a shared symbolic dimension different sizes (naming both).
    """
    if len(args) > len(specs):
        raise InputError(f"the module takes {len(specs)} input(s), got {len(args)} positional arguments")
    given: dict[int, Any] = dict(enumerate(args))
    index = {key: i for i, key in enumerate(keywords)}
    index.update({spec.name: i for i, spec in enumerate(specs)})
    for key, value in kwargs.items():
        i = index.get(key)
        if i is None:
            listed = ", ".join(map(repr, keywords))
            raise InputError(f"unknown input {key!r}; the module's inputs are: {listed}")
        if i in given:
            raise InputError(f"input {specs[i].name!r} given twice (by position and by keyword)")
        given[i] = value
    missing = [spec.name for i, spec in enumerate(specs) if i not in given and spec.kind == "tensor"]
    if missing:
        raise InputError(f"missing input(s): {', '.join(map(repr, missing))}")
    widened: dict[int, Any] = {}
    for i, value in given.items():
        spec = specs[i]
        if spec.kind != "tensor":
            continue
        if not isinstance(value, torch.Tensor):
            raise InputError(
                f"input {spec.name!r}: expected a torch tensor {spec.describe()}, got {type(value).__name__}"
            )
        dtype = _numpy_dtype(value.dtype)
        if float_dtype is not None and dtype is not None and dtype.kind == "f":
            if spec.dtype is not None and spec.dtype.kind == "f" and float_dtype in ("any", dtype):
                spec = dataclasses.replace(spec, dtype=dtype)
        if dtype is not None and _widens(dtype, spec.dtype):
            widened[i] = value = value.to(torch.from_numpy(np.zeros((), spec.dtype)).dtype)
            dtype = spec.dtype
        check_value(spec, dtype, tuple(value.shape))
    check_shared_dims(specs, [tuple(given[i].shape) if i in given and hasattr(given[i], "shape") else None
                              for i in range(len(specs))])  # fmt: skip
    return widened


def _widens(given: np.dtype, wanted: np.dtype | None) -> bool:
    """Whether an integer ``given`` dtype casts to the graph's integer ``wanted`` without loss."""
    return (
        wanted is not None
        and given != wanted
        and given.kind in "iu"
        and wanted.kind in "iu"
        and bool(np.can_cast(given, wanted, "safe"))
    )


def _float_dtype(module: torch.nn.Module) -> np.dtype | str | None:
    """The dtype of the module's floating parameters (or buffers); ``"any"`` if it has none."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return _numpy_dtype(tensor.dtype)
    return "any"


class _InputCheck:
    """The forward pre-hook (a class, so that the module still pickles and deep-copies)."""

    def __init__(self, specs: Sequence[InputSpec], keywords: Sequence[str]) -> None:
        self.specs, self.keywords = list(specs), list(keywords)

    def __call__(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        widened = check_call(self.specs, self.keywords, args, kwargs, float_dtype=_float_dtype(module))
        if not widened:
            return None
        new_args = tuple(widened.get(i, a) for i, a in enumerate(args))
        names = {key: i for i, key in enumerate(self.keywords)}
        names.update({spec.name: i for i, spec in enumerate(self.specs)})
        new_kwargs = {key: widened.get(names[key], value) for key, value in kwargs.items()}
        return new_args, new_kwargs


def install_input_check(module: torch.nn.Module, specs: Sequence[InputSpec], keywords: Sequence[str]) -> None:
    """Check every call of ``module`` with :func:`check_call` before its forward runs."""
    module.register_forward_pre_hook(_InputCheck(specs, keywords), with_kwargs=True)
