"""``torch.autograd.grad`` for the pipeline's own calls, without its per-call Python checks.

A pipeline runs one ``torch.autograd.grad`` per (stage, micro-batch). Before it
reaches the autograd engine, ``torch.autograd.grad`` normalises its arguments and
checks every gradient it is given against its output (``_make_grads``: shapes
compared as symbolic sizes, dtypes, devices, subclasses), tens of microseconds
of Python per call on a small CPU: as much as the backward of a small stage.
The pipeline's gradients are the next stage's input gradients, made for exactly
these outputs, so :func:`engine_grad` checks only what it relies on (each
gradient is a plain tensor of its output's shape, dtype and device) and calls the
engine as ``torch.autograd.grad`` does (``torch.autograd.graph._engine_run_backward``,
detected when the module is imported); anything else, a torch without that
function, or a ``torch.autograd.grad`` replaced by a wrapper since (a profiler, a
test double) goes through ``torch.autograd.grad`` itself. The engine call is the
same, so the gradients are the same bit for bit.

Example:
    >>> import torch
    >>> w = torch.ones(2, requires_grad=True)
    >>> y = w * 3
    >>> engine_grad([y], [w], [torch.ones(2)])
    (tensor([3., 3.]),)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["engine_grad"]

_graph = getattr(torch.autograd, "graph", None)
_RUN = getattr(_graph, "_engine_run_backward", None)  # what torch.autograd.grad calls (torch >= 2.2)
_GRAD = torch.autograd.grad


def engine_grad(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    *,
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=..., allow_unused=True)``
    (see the module docstring): the gradients of ``inputs``, None for those not reached."""
    if (
        _RUN is None
        or torch.autograd.grad is not _GRAD  # wrapped (a profiler, a test double): go through it
        or not _well_formed(outputs, grad_outputs)
        or _HAS_TORCH_FUNCTION((*outputs, *inputs, *grad_outputs))
    ):
        return torch.autograd.grad(
            list(outputs), list(inputs), list(grad_outputs), retain_graph=retain_graph, allow_unused=True
        )
    return _RUN(tuple(outputs), tuple(grad_outputs), retain_graph, False, tuple(inputs), True, False)


def _well_formed(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
    """Each gradient a tensor with its output's shape, dtype, device and (strided) layout."""
    if len(outputs) != len(grads):
        return False
    for out, grad in zip(outputs, grads):
        if (
            not isinstance(grad, torch.Tensor)
            or out.shape != grad.shape
            or out.dtype != grad.dtype
            or out.device != grad.device
            or out.layout != torch.strided
            or grad.layout != torch.strided
        ):
            return False
    return True


def _any_override(tensors: tuple[Any, ...]) -> bool:
    return any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors)


#: whether any of the tensors overrides torch functions (a subclass): torch's own test
_HAS_TORCH_FUNCTION = getattr(torch._C, "_has_torch_function", _any_override)
