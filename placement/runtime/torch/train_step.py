"""``pl.train_step``: one training step of a lowered module, pipelined or not.

A pipelined module (``pl.to_torch(model, chunks=k)``) trains with 1F1B and deferred
weight gradients (:mod:`placement.runtime.torch.one_f_one_b`); any other module
back-propagates the whole batch's loss, so one training loop serves every ``chunks``.

Example:
    >>> import torch
    >>> import placement as pl
    >>> net = torch.nn.Linear(4, 1)
    >>> loss = pl.train_step(net, torch.ones(2, 4), loss_fn=lambda out: out.sum())
    >>> net.weight.grad.tolist()
    [[2.0, 2.0, 2.0, 2.0]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from placement.runtime.torch.one_f_one_b import LossFn, check_reduction, scalar_loss
from placement.runtime.torch.pipelined import PipelinedModule

__all__ = ["train_step"]


def train_step(
    module: torch.nn.Module,
    *inputs: Any,
    loss_fn: LossFn,
    targets: Sequence[Any] = (),
    reduction: str = "mean",
    defer_weights: bool | str = "auto",
    max_in_flight: int | None = None,
) -> torch.Tensor:
    """One training step of ``module`` on ``inputs``: adds the gradients of ``loss_fn`` to
    ``.grad`` and returns the loss (detached); ``pl.train_step``.

    A pipelined module (``pl.to_torch(model, chunks=k)``) runs
    :meth:`PipelinedModule.train_step` (1F1B with deferred weight gradients, see
    :mod:`placement.runtime.torch.one_f_one_b`); any other module (``pl.to_torch(model)``,
    ``chunks=1``, or the original ``nn.Module``) computes ``loss_fn(module(*inputs), *targets)`` on the whole
    batch and back-propagates it, so one training loop serves every ``chunks``.

    Example:
        >>> import torch
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> net, (x,) = mlp.build("tiny")
        >>> model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
        >>> losses = [pl.train_step(pl.to_torch(model, device_map="cpu", chunks=k), x,
        ...                         loss_fn=lambda out: out.square().mean()) for k in (1, 2)]
        >>> torch.allclose(losses[0], losses[1])
        True
    """
    if isinstance(module, PipelinedModule):
        return module.train_step(
            *inputs,
            loss_fn=loss_fn,
            targets=targets,
            reduction=reduction,
            defer_weights=defer_weights,
            max_in_flight=max_in_flight,
        )
    check_reduction(reduction)
    loss = scalar_loss(loss_fn(module(*inputs), *targets))
    loss.backward()
    return loss.detach().reshape(())
