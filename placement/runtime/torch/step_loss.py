"""The loss of a pipelined training step: each micro-batch's, checked, and the step's sum.

``train_step`` computes ``loss_fn`` once per micro-batch; :func:`step_loss` weighs
them (``reduction="mean"``: by the micro-batch's share of the batch) and adds them
in micro-batch order, once for the whole step: one stack, one product, one sum.

Example:
    >>> import torch
    >>> step_loss([torch.tensor(1.0), torch.tensor(3.0)], [0.5, 0.5])
    tensor(2.)
    >>> check_reduction("max")
    Traceback (most recent call last):
    ...
    ValueError: reduction must be one of mean, sum, got 'max'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["REDUCTIONS", "LossFn", "check_reduction", "scalar_loss", "step_loss"]

#: How micro-batch losses combine into the step's loss.
REDUCTIONS = ("mean", "sum")

LossFn = Callable[..., torch.Tensor]


def check_reduction(reduction: str) -> None:
    """Raise ``ValueError`` unless ``reduction`` is one of :data:`REDUCTIONS`."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")


def scalar_loss(loss: Any) -> torch.Tensor:
    """``loss_fn``'s result, checked to be a one-element tensor.

    Example:
        >>> scalar_loss(torch.ones(1)).item()
        1.0
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"loss_fn must return a scalar tensor, got {got}")
    return loss


def step_loss(losses: Sequence[torch.Tensor | None], weights: Sequence[float]) -> torch.Tensor:
    """The micro-batches' ``losses`` (one-element tensors; None: skipped), each times its
    weight, summed in order: a scalar on the first loss's device.

    The products are those of multiplying each loss by its weight (one rounding each),
    and the sum adds them in micro-batch order.
    """
    kept = [(loss, w) for loss, w in zip(losses, weights) if loss is not None]
    device = kept[0][0].device
    stacked = torch.stack([loss if loss.device == device else loss.to(device) for loss, _ in kept])
    factors = torch.tensor([w for _, w in kept], dtype=stacked.dtype, device=device)
    return (stacked.reshape(len(kept)) * factors).sum()
