"""Optimizer steps of ONNX's ``ai.onnx.preview.training`` domain: ``Adagrad``, ``Adam`` and
``Momentum`` (standard and Nesterov), each on one or several tensors at once.

Inputs are the learning rate ``R`` and step count ``T`` (scalars), then the tensors ``X``, their
gradients ``G`` and their accumulators (``H`` for Adagrad, ``V`` for Momentum, ``V`` and ``H``
for Adam), each group listed for every optimized tensor; outputs are the new tensors then
the new accumulators in the same grouping. The arithmetic runs in float64 (as ONNX's
reference promotes its Python-float coefficients) and is cast back to each tensor's type.

Example:
    >>> import torch
    >>> from placement.lowering.ops.optimizers import momentum
    >>> x_new, v_new = momentum(torch.tensor(0.25), torch.tensor(0), torch.tensor([1.0]),
    ...                         torch.tensor([2.0]), torch.tensor([0.0]),
    ...                         alpha=0.9, beta=0.5, mode="standard", norm_coefficient=0.0)
    >>> x_new.tolist(), v_new.tolist()
    ([0.5], [2.0])
"""

from __future__ import annotations

import math
from typing import Any

import torch

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, op

_DOMAIN = "ai.onnx.preview.training"


def _groups(op_type: str, data: tuple[Tensor, ...], per: int) -> tuple[float, int, list[list[Tensor]]]:
    """``(R, T, [group_0, group_1, ...])``: each group the ``per`` inputs of one kind."""
    if len(data) < 2 + per or (len(data) - 2) % per:
        raise LoweringError(f"{op_type}: {len(data)} inputs do not form R, T and groups of {per}")
    n = (len(data) - 2) // per
    rest = data[2:]
    return float(data[0].detach()), int(data[1]), [list(rest[k * n : (k + 1) * n]) for k in range(per)]


def _wide(x: Tensor) -> Tensor:
    return x.to(torch.float64)


@op("Adagrad", domain=_DOMAIN, foldable=False)
def adagrad(
    *data: Tensor, decay_factor: float = 0.0, epsilon: float = 1e-6, norm_coefficient: float = 0.0
) -> Any:
    """Adagrad: ``X - R / (1 + T * decay_factor) * G' / (sqrt(H + G'^2) + epsilon)``,
    ``G' = norm_coefficient * X + G``; outputs the new ``X``s then the new ``H``s."""
    r, t, (xs, gs, hs) = _groups("Adagrad", data, 3)
    rate = r / (1 + t * decay_factor)
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs):
        reg = norm_coefficient * _wide(x) + _wide(g)
        h_new = _wide(h) + reg * reg
        new_x.append((_wide(x) - rate * reg / (torch.sqrt(h_new) + epsilon)).to(x.dtype))
        new_h.append(h_new.to(h.dtype))
    return tuple(new_x + new_h)


@op("Adam", domain=_DOMAIN, foldable=False)
def adam(
    *data: Tensor,
    alpha: float = 0.9,
    beta: float = 0.999,
    epsilon: float = 1e-6,
    norm_coefficient: float = 0.0,
    norm_coefficient_post: float = 0.0,
) -> Any:
    """Adam with optional bias correction (``T > 0``) and post-update decay; outputs the new
    ``X``s, ``V``s and ``H``s."""
    r, t, (xs, gs, vs, hs) = _groups("Adam", data, 4)
    rate = r * math.sqrt(1 - beta**t) / (1 - alpha**t) if t > 0 else r
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        reg = norm_coefficient * _wide(x) + _wide(g)
        v_new = alpha * _wide(v) + (1 - alpha) * reg
        h_new = beta * _wide(h) + (1 - beta) * (reg * reg)
        x_new = _wide(x) - rate * (v_new / (torch.sqrt(h_new) + epsilon))
        new_x.append(((1 - norm_coefficient_post) * x_new).to(x.dtype))
        new_v.append(v_new.to(v.dtype))
        new_h.append(h_new.to(h.dtype))
    return tuple(new_x + new_v + new_h)


@op("Momentum", domain=_DOMAIN, foldable=False)
def momentum(
    *data: Tensor, alpha: float, beta: float, mode: str = "standard", norm_coefficient: float = 0.0
) -> Any:
    """SGD with momentum (``mode="standard"``) or Nesterov momentum (``"nesterov"``); the
    gradient's coefficient is 1 at step 0. Outputs the new ``X``s then the new ``V``s."""
    if mode not in ("standard", "nesterov"):
        raise LoweringError(f"Momentum: mode={mode!r} is not standard or nesterov")
    r, t, (xs, gs, vs) = _groups("Momentum", data, 3)
    coefficient = beta if t > 0 else 1.0
    new_x, new_v = [], []
    for x, g, v in zip(xs, gs, vs):
        reg = norm_coefficient * _wide(x) + _wide(g)
        v_new = alpha * _wide(v) + coefficient * reg
        step = v_new if mode == "standard" else reg + alpha * v_new
        new_x.append((_wide(x) - r * step).to(x.dtype))
        new_v.append(v_new.to(v.dtype))
    return tuple(new_x + new_v)


__all__ = ["adagrad", "adam", "momentum"]
