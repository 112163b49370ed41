"""A second device type on a CPU-only machine, for tests of where tensors end up.

Torch's PrivateUse1 key can be a backend written in Python
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``): here
a device ``"emu"`` whose tensors keep their data in a CPU tensor (``.raw``) and that
implements only what moving tensors needs (allocation, copies to and from the CPU,
slicing along an axis, views). A tensor on it is really somewhere else: CPU
kernels refuse it, ``Tensor.to`` between it and the CPU is a real copy with an
autograd rule, so a test that expects a result on ``"emu"`` fails when a move is
missing.

The backend is registered once per process (PrivateUse1 can be named only once);
:func:`emu_device` returns None where this torch lacks the feature or the key was
already taken by another backend, and callers skip, saying so.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

NAME = "emu"


class _EmuTensor(torch.Tensor):
    """A tensor on ``emu``: torch sees only its metadata; its data is ``self.raw`` (CPU)."""

    raw: torch.Tensor

    @staticmethod
    def __new__(cls, raw: torch.Tensor) -> _EmuTensor:
        res = torch._C._acc.create_empty_tensor(tuple(raw.shape), raw.dtype)
        res.__class__ = cls
        return res

    def __init__(self, raw: torch.Tensor) -> None:
        self.raw = raw


def _wrap(raw: torch.Tensor) -> _EmuTensor:
    return _EmuTensor(raw.contiguous())


def _register(lib: Any) -> None:
    def impl(name: str) -> Any:
        def deco(fn: Any) -> Any:
            lib.impl(name, fn, "PrivateUse1")
            return fn

        return deco

    @impl("empty.memory_format")
    def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return _wrap(torch.empty(size, dtype=dtype or torch.get_default_dtype()))

    @impl("empty_strided")
    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return _wrap(torch.empty(size, dtype=dtype or torch.get_default_dtype()))

    @impl("_copy_from")
    def copy_from(src, dst, non_blocking=False):
        if src.device.type == NAME and dst.device.type == NAME:
            dst.raw = src.raw.clone()
        elif src.device.type == NAME:
            dst.copy_(src.raw)
        else:
            dst.raw = src.detach().to("cpu").clone().reshape(dst.shape)
        return dst

    @impl("view")
    def view(a, size):
        return _wrap(a.raw.reshape(size))

    @impl("detach")
    def detach(a):
        return _wrap(a.raw)

    @impl("alias")
    def alias(a):
        return _wrap(a.raw)

    @impl("slice.Tensor")
    def slice_(a, dim=0, start=None, end=None, step=1):
        return _wrap(torch.ops.aten.slice.Tensor(a.raw, dim, start, end, step).clone())


@functools.cache
def emu_device() -> torch.device | None:
    """``torch.device("emu:0")`` once the backend is registered; None where it cannot be."""
    from torch.utils import backend_registration as registration

    setup = getattr(registration, "_setup_privateuseone_for_python_backend", None)
    acc = getattr(torch._C, "_acc", None)
    if setup is None or acc is None or not hasattr(acc, "create_empty_tensor"):
        return None
    if registration._get_privateuse1_backend_name() not in ("privateuseone", NAME):
        return None
    try:
        if registration._get_privateuse1_backend_name() != NAME:
            setup(NAME)
        lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - kept alive below
        _register(lib)
        emu_device.library = lib  # type: ignore[attr-defined]  # the registrations live as long as it does
        return torch.device(NAME, 0)
    except (RuntimeError, AttributeError, TypeError) as err:  # pragma: no cover - torch without it
        emu_device.error = err  # type: ignore[attr-defined]
        return None


#: Skips a test where :func:`emu_device` cannot register the backend, saying why.
needs_emu = pytest.mark.skipif(
    emu_device() is None, reason="this torch cannot register a Python device backend (PrivateUse1)"
)
