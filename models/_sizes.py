"""The one size lookup every zoo model uses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

__all__ = ["lookup_size"]

T = TypeVar("T")


def lookup_size(sizes: Mapping[str, T], size: str, model: str) -> T:
    """``sizes[size]``, or a ``ValueError`` naming the model and its known sizes.

    Example:
        >>> lookup_size({"tiny": 1}, "tiny", "MLP")
        1
    """
    try:
        return sizes[size]
    except KeyError:
        raise ValueError(f"unknown {model} size {size!r}; known sizes: {sorted(sizes)}") from None
