"""``torch.autograd.grad`` for the pipeline's own calls, without its per-call Python checks.

A pipeline runs one ``torch.autograd.grad`` per (stage, micro-batch). Before it
reaches the autograd engine, ``torch.autograd.grad`` normalises its arguments and
checks every gradient it is given against its output (``_make_grads``: shapes
compared as symbolic sizes, dtypes, devices, subclasses), tens of microseconds
of Python per call on a small CPU: as much as the backward of a small stage.
The pipeline's gradients are the next stage's input gradients, made for exactly
these outputs, so :func:`engine_grad` checks only what it relies on (each
gradient is a plain tensor of its output's shape, dtype and device) and calls the
engine as ``torch.autograd.grad`` does (``torch.autograd.graph._engine_run_backward``).
That function is private: it is used only while its signature takes the arguments
in the order this module passes them (checked with :mod:`inspect` whenever the
function changes) and a one-time probe on a two-element graph gives what
``torch.autograd.grad`` gives. Anything else (a torch without that function or with
another signature, a ``torch.autograd.grad`` replaced by a wrapper since: a profiler, a
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

import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["engine_grad", "engine_run"]

log = logging.getLogger(__name__)

_graph = getattr(torch.autograd, "graph", None)
_GRAD = torch.autograd.grad
#: the parameters, in order, that :func:`engine_grad` passes positionally (torch's own names)
_PARAMETERS = ("t_outputs", "grad_tensors", "keep_graph", "create_graph", "inputs", "allow_unreachable")
_checked: tuple[Any, Callable[..., Any] | None] = (object(), None)  # (function seen, usable or None)
_lock = threading.Lock()


def engine_run() -> Callable[..., Any] | None:
    """torch's ``_engine_run_backward`` when it takes :func:`engine_grad`'s positional call
    (checked once per function object), else None: use ``torch.autograd.grad``.

    Example:
        >>> engine_run() in (None, torch.autograd.graph._engine_run_backward)
        True
    """
    global _checked
    fn = getattr(_graph, "_engine_run_backward", None)  # what torch.autograd.grad calls (torch >= 2.2)
    seen, usable = _checked
    if fn is seen:
        return usable
    with _lock:
        usable = fn if fn is not None and _takes_our_call(fn) and _probe(fn) else None
        if fn is not None and usable is None:
            log.info("torch.autograd.graph._engine_run_backward changed: gradients go through autograd.grad")
        _checked = (fn, usable)
    return usable


def _takes_our_call(fn: Callable[..., Any]) -> bool:
    """Whether ``fn``'s signature takes seven positional arguments meaning what
    :data:`_PARAMETERS` (and ``accumulate_grad``) name: torch's own names in that order, or
    one named first argument followed by ``*args`` handed on to the engine unchanged."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if (
        len(params) >= 2
        and params[0].kind in positional
        and params[1].kind == inspect.Parameter.VAR_POSITIONAL
    ):
        return params[0].name == _PARAMETERS[0]
    names = [p.name for p in params if p.kind in positional]
    return tuple(names[: len(_PARAMETERS)]) == _PARAMETERS and len(names) >= len(_PARAMETERS) + 1


def _probe(fn: Callable[..., Any]) -> bool:
    """Whether ``fn``, called as :func:`engine_grad` calls it, gives ``torch.autograd.grad``'s
    gradients on a tiny graph (an unreached input included)."""
    try:
        with torch.enable_grad():
            w = torch.tensor([1.0, 2.0], requires_grad=True)
            unused = torch.zeros(1, requires_grad=True)
            y = w * torch.tensor([3.0, 5.0])
            got = fn((y,), (torch.ones(2),), False, False, (w, unused), True, False)
    except Exception:  # noqa: BLE001 - any failure means: not the function we know
        return False
    return (
        isinstance(got, tuple)
        and len(got) == 2
        and isinstance(got[0], torch.Tensor)
        and got[0].tolist() == [3.0, 5.0]
        and got[1] is None
    )


def engine_grad(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    *,
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=..., allow_unused=True)``
    (see the module docstring): the gradients of ``inputs``, None for those not reached."""
    run = engine_run()
    if (
        run is None
        or torch.autograd.grad is not _GRAD  # wrapped (a profiler, a test double): go through it
        or not _well_formed(outputs, grad_outputs)
        or _HAS_TORCH_FUNCTION((*outputs, *inputs, *grad_outputs))
    ):
        return torch.autograd.grad(
            list(outputs), list(inputs), list(grad_outputs), retain_graph=retain_graph, allow_unused=True
        )
    return run(tuple(outputs), tuple(grad_outputs), retain_graph, False, tuple(inputs), True, False)


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
