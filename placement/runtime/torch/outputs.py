"""Where a lowered module's outputs come back: ``pl.to_torch(model, outputs_on=...)``.

A placed model computes its outputs on the device of its last stage (a GPU, say),
whatever device the caller's inputs were on. ``outputs_on="input"`` (the default)
moves them to the device of the call's *first tensor input*, as accelerate's
dispatched modules do (``io_same_device``): CPU tensors in, CPU tensors out, so
``module(x).numpy()`` and ``torch.allclose(module(x), net(x))`` work the same with
or without GPUs. ``outputs_on="last"`` keeps them where the last stage made them,
for callers that chain more GPU work and would only pay for a round trip.

The move is one ``Tensor.to`` per output, inside autograd: gradients flow back
through it to the last stage's device. It costs nothing when the devices already
agree (``Tensor.to`` returns the tensor itself). A module from ``to_torch`` carries
the choice as ``module.outputs_on``; for every ``chunks`` the move happens after the
forward (a forward hook, :func:`install_outputs_on`), and a pipelined module's
``train_step`` hands ``loss_fn`` its outputs on the input's device too.

Example:
    >>> import torch
    >>> import placement as pl
    >>> net = torch.nn.Linear(4, 2)
    >>> model = pl.from_torch(net, (torch.randn(3, 4),))
    >>> pl.to_torch(model, device_map="cpu")(torch.randn(3, 4)).device
    device(type='cpu')
    >>> pl.to_torch(model, device_map="cpu", outputs_on="first")
    Traceback (most recent call last):
    ...
    placement.errors.DeviceError: outputs_on must be 'input' (...) or 'last' (...), got 'first'
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from placement.errors import DeviceError

__all__ = ["OUTPUTS_ON", "check_outputs_on", "first_tensor_device", "move_outputs", "install_outputs_on"]

log = logging.getLogger(__name__)

#: The values of ``to_torch(outputs_on=...)``, each with what it means.
OUTPUTS_ON: dict[str, str] = {
    "input": "outputs on the device of the first tensor input",
    "last": "on the last stage's device",
}


def check_outputs_on(outputs_on: Any) -> str:
    """``outputs_on`` itself when it is one of :data:`OUTPUTS_ON`.

    Raises:
        DeviceError: any other value, naming it and the choices.

    Example:
        >>> check_outputs_on("last")
        'last'
    """
    if not isinstance(outputs_on, str) or outputs_on not in OUTPUTS_ON:
        choices = " or ".join(f"{key!r} ({what})" for key, what in OUTPUTS_ON.items())
        raise DeviceError(f"outputs_on must be {choices}, got {outputs_on!r}")
    return outputs_on


def first_tensor_device(args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> torch.device | None:
    """The device of the first tensor among ``args`` and then ``kwargs`` (in their order);
    None when the call has no tensor.

    Example:
        >>> first_tensor_device((3, torch.zeros(1)), {})
        device(type='cpu')
        >>> first_tensor_device((), {}) is None
        True
    """
    values: Iterable[Any] = (*args, *(kwargs or {}).values())
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def move_outputs(outputs: Any, device: torch.device | None) -> Any:
    """``outputs`` (a tensor, or a tuple or list of them) with every tensor on ``device``
    (None: unchanged). Differentiable; a tensor already there is returned as it is. A copy to
    the CPU blocks (the caller may read it at once); other copies do not.

    Example:
        >>> out = move_outputs((torch.ones(1), 2), torch.device("cpu"))
        >>> out[0].device, out[1]
        (device(type='cpu'), 2)
    """
    if device is None:
        return outputs
    if isinstance(outputs, torch.Tensor):
        return _to(outputs, device)
    if isinstance(outputs, (tuple, list)):
        return type(outputs)([_to(o, device) if isinstance(o, torch.Tensor) else o for o in outputs])
    return outputs


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:  # the common case, without a trip through the dispatcher
        return tensor
    return tensor.to(device, non_blocking=device.type != "cpu")


class _OutputsOnInput:
    """The forward hook (a class, so that the module still pickles and deep-copies)."""

    def __call__(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Any
    ) -> Any:
        return move_outputs(outputs, first_tensor_device(args, kwargs))


def install_outputs_on(module: torch.nn.Module, outputs_on: str) -> torch.nn.Module:
    """Make ``module``'s calls return their outputs where ``outputs_on`` says (see the module
    docstring); sets ``module.outputs_on``. Returns ``module``.

    Example:
        >>> net = install_outputs_on(torch.nn.Linear(2, 2), "input")
        >>> net.outputs_on, net(torch.zeros(1, 2)).device
        ('input', device(type='cpu'))
    """
    outputs_on = check_outputs_on(outputs_on)
    if outputs_on == "input":
        module.register_forward_hook(_OutputsOnInput(), with_kwargs=True)
    module.outputs_on = outputs_on
    log.debug("%s returns its outputs %s", type(module).__name__, OUTPUTS_ON[outputs_on])
    return module
