"""A multi-layer perceptron: a plain chain of ``Linear`` layers with ``ReLU`` in between.

Architecture (``dims = (d0, d1, ..., dn)``)::

    x (batch, d0) -> fc1 -> relu1 -> fc2 -> relu2 -> ... -> fc<n> -> y (batch, dn)

There is no activation after the last layer. Children are named ``fc1``, ``relu1``, ``fc2``, ...
(1-based, like the classic examples), so ``model.fc2`` works and module scopes in the exported graph
read ``fc2``. Each ``Linear`` exports to one ONNX ``Gemm``; each ``ReLU`` to one ``Relu``: the
simplest chain-shaped graph in the zoo.

Example:
    >>> from placement.models import mlp
    >>> module, (x,) = mlp.build("tiny")
    >>> module(x).shape
    torch.Size([4, 8])
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from placement.models._sizes import lookup_size

__all__ = ["MLP", "SIZES", "Size", "build"]


@dataclass(frozen=True)
class Size:
    """A named size: layer widths (input first, output last) and the example batch size."""

    dims: tuple[int, ...]
    batch: int


SIZES: dict[str, Size] = {
    "tiny": Size(dims=(16, 32, 32, 8), batch=4),
    "bench": Size(dims=(1024, 2048, 2048, 2048, 2048, 1024), batch=64),
}


class MLP(nn.Sequential):
    """``Linear``/``ReLU`` stack with layer widths ``dims`` (input width first).

    Args:
        dims: at least two widths; ``len(dims) - 1`` ``Linear`` layers are created.

    Example:
        >>> import torch
        >>> MLP((4, 8, 2))(torch.zeros(3, 4)).shape
        torch.Size([3, 2])
    """

    def __init__(self, dims: Sequence[int]) -> None:
        dims = tuple(int(d) for d in dims)
        if len(dims) < 2:
            raise ValueError(f"MLP needs at least two widths (input and output), got {dims}")
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for i, (d_in, d_out) in enumerate(itertools.pairwise(dims), start=1):
            if i > 1:
                layers[f"relu{i - 1}"] = nn.ReLU()
            layers[f"fc{i}"] = nn.Linear(d_in, d_out)
        super().__init__(layers)
        self.dims = dims

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Re-initialize weights (Kaiming-uniform) and biases (uniform) from ``generator``."""
        for layer in self:
            if isinstance(layer, nn.Linear):
                nn.init.kaiming_uniform_(layer.weight, nonlinearity="relu", generator=generator)
                bound = layer.in_features**-0.5
                nn.init.uniform_(layer.bias, -bound, bound, generator=generator)


def build(size: str = "tiny", *, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build an :class:`MLP` in eval mode and an example input, deterministically from ``seed``.

    Args:
        size: ``"tiny"`` (tests) or ``"bench"`` (benchmarks), see :data:`SIZES`.
        seed: seeds a local ``torch.Generator``; the global RNG state is left untouched.

    Returns:
        ``(module, (x,))`` with ``x`` of shape ``(batch, dims[0])``, float32.

    Example:
        >>> module, (x,) = build("tiny", seed=1)
        >>> tuple(x.shape)
        (4, 16)
    """
    cfg = _size(size)
    generator = torch.Generator().manual_seed(seed)
    # The constructor's default init must not disturb the global RNG.
    with torch.random.fork_rng(devices=[]):
        module = MLP(cfg.dims)
    module.reset_parameters(generator)
    x = torch.randn(cfg.batch, cfg.dims[0], generator=generator)
    return module.eval(), (x,)


def _size(size: str) -> Size:
    return lookup_size(SIZES, size, "MLP")
