"""Random ops: nondeterministic, so never folded and never load-time values.

The ``seed`` attribute seeds a private generator, so a seeded op repeats its
draw on every call; an unseeded one draws from torch's global generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from placement.lowering.ops._registry import Tensor, op, torch_dtype


def _generator(seed: float | None, device: Any) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device or "cpu")
    gen.manual_seed(int(seed))
    return gen


@op("RandomNormal")
def random_normal(
    *,
    shape: Sequence[int],
    dtype: int = 1,
    mean: float = 0.0,
    scale: float = 1.0,
    seed: float | None = None,
    device: Any = None,
) -> Tensor:
    """ONNX RandomNormal: a fresh ``N(mean, scale^2)`` tensor of ``shape``."""
    out = torch.empty(list(shape), dtype=torch_dtype(dtype), device=device)
    return out.normal_(mean, scale, generator=_generator(seed, device))


@op("RandomUniform")
def random_uniform(
    *,
    shape: Sequence[int],
    dtype: int = 1,
    low: float = 0.0,
    high: float = 1.0,
    seed: float | None = None,
    device: Any = None,
) -> Tensor:
    """ONNX RandomUniform: a fresh ``U[low, high)`` tensor of ``shape``."""
    out = torch.empty(list(shape), dtype=torch_dtype(dtype), device=device)
    return out.uniform_(low, high, generator=_generator(seed, device))


@op("RandomNormalLike")
def random_normal_like(
    input: Tensor,  # noqa: A002
    *,
    dtype: int | None = None,
    mean: float = 0.0,
    scale: float = 1.0,
    seed: float | None = None,
) -> Tensor:
    """ONNX RandomNormalLike: ``RandomNormal`` with ``input``'s shape (and dtype by default)."""
    out = torch.empty_like(input, dtype=input.dtype if dtype is None else torch_dtype(dtype))
    return out.normal_(mean, scale, generator=_generator(seed, input.device))


@op("RandomUniformLike")
def random_uniform_like(
    input: Tensor,  # noqa: A002
    *,
    dtype: int | None = None,
    low: float = 0.0,
    high: float = 1.0,
    seed: float | None = None,
) -> Tensor:
    """ONNX RandomUniformLike: ``RandomUniform`` with ``input``'s shape (and dtype by default)."""
    out = torch.empty_like(input, dtype=input.dtype if dtype is None else torch_dtype(dtype))
    return out.uniform_(low, high, generator=_generator(seed, input.device))


@op("Bernoulli")
def bernoulli(input: Tensor, *, dtype: int | None = None, seed: float | None = None) -> Tensor:  # noqa: A002
    """ONNX Bernoulli: 1 with probability ``input``, else 0."""
    out = torch.bernoulli(input, generator=_generator(seed, input.device))
    return out if dtype is None else out.to(torch_dtype(dtype))


@op("Multinomial")
def multinomial(input: Tensor, *, dtype: int = 6, sample_size: int = 1, seed: float | None = None) -> Tensor:  # noqa: A002
    """ONNX Multinomial: ``sample_size`` class draws per batch row from unnormalised log-probabilities."""
    probs = torch.softmax(input.double(), -1)
    draws = torch.multinomial(probs, sample_size, replacement=True, generator=_generator(seed, input.device))
    return draws.to(torch_dtype(dtype))
