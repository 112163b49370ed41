"""Training a module lowered from an eval-mode export: say once that Dropout and BatchNorm
run in eval mode there.

``pl.from_torch(net, args)`` exports in eval mode: Dropout is gone from the graph and
BatchNorm normalises with the running statistics, whatever ``module.train()`` says. A
module lowered from it whose source had such layers (recorded at export,
:func:`placement.graph.torch_import.mode_modules`) warns, once per module, the first
time it runs in train mode with gradients enabled: export with ``training=True`` for
live Dropout and batch statistics (:mod:`placement.lowering.ops.training`).

Example:
    >>> import warnings, torch
    >>> import placement as pl
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    >>> module = pl.to_torch(pl.from_torch(net, (torch.randn(2, 4),)), device_map="cpu")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = module(torch.randn(2, 4))
    ...     _ = module(torch.randn(2, 4))
    >>> len(caught), "training=True" in str(caught[0].message)
    (1, True)
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

__all__ = ["EvalModeWarning", "install_mode_warning"]

log = logging.getLogger(__name__)


class EvalModeWarning:
    """A forward pre-hook (picklable) that warns once when its module trains in eval mode."""

    def __init__(self, layers: list[str]) -> None:
        self.layers = list(layers)
        self.warned = False

    def __call__(self, module: torch.nn.Module, args: Any = ()) -> None:
        if self.warned or not module.training or not torch.is_grad_enabled():
            return
        self.warned = True
        effects = []
        if any("Dropout" in layer for layer in self.layers):
            effects.append("no dropout")
        if any("BatchNorm" in layer for layer in self.layers):
            effects.append("BatchNorm on running statistics that never update")
        message = (
            f"training a module exported in eval mode: its {', '.join(self.layers)} layers run as in "
            f"eval mode ({', '.join(effects)}); export with pl.from_torch(..., training=True) for "
            "real training mode, or call module.eval() (or torch.no_grad()) for inference"
        )
        log.debug("%s", message)
        warnings.warn(message, UserWarning, stacklevel=3)


def install_mode_warning(module: torch.nn.Module, layers: list[str]) -> torch.nn.Module:
    """Give ``module`` an :class:`EvalModeWarning` for ``layers`` (nothing when there are none);
    it is also ``module.mode_warning`` (``None`` without one). Returns ``module``."""
    hook = EvalModeWarning(layers) if layers else None
    if hook is not None:
        module.register_forward_pre_hook(hook)
    module.mode_warning = hook
    return module
