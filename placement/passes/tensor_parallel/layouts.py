"""How a value of a tensor-parallel graph is laid out over the devices of its group.

Every value of the original graph gets one :class:`Layout`:

* ``R`` (replicated): each device holds the whole value;
* ``S`` (sharded): each device holds the elements at its own index list along one axis
  (``parts[d]``, sorted; lists may overlap where heads are replicated, e.g. the KV heads
  of grouped-query attention when the degree exceeds their number);
* ``P`` (partial): each device holds a summand; the value is their sum (an all-reduce makes it
  ``R``).

Index lists are chosen in whole *blocks* (a head's columns), as evenly as the count allows:
the first devices take one block more where the count does not divide (ragged shards).

Example:
    >>> block_parts(5, 2, block=1)
    ((0, 1, 2), (3, 4))
    >>> block_parts(4, 2, block=2)
    ((0, 1), (2, 3))
    >>> block_parts(2, 4, block=1)  # fewer heads than devices: each head on two devices
    ((0,), (0,), (1,), (1,))
"""

from __future__ import annotations

from dataclasses import dataclass

from placement.errors import InputError

__all__ = ["Layout", "REPLICATED", "PARTIAL", "block_parts", "expand_parts", "contiguous"]

Parts = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Layout:
    """``kind`` is ``"R"``, ``"S"`` or ``"P"``; a shard has its ``axis`` (non-negative),
    the full ``size`` along it and each device's index list ``parts``."""

    kind: str
    axis: int = -1
    size: int = 0
    parts: Parts = ()

    @property
    def sharded(self) -> bool:
        return self.kind == "S"

    def moved(self, axis: int) -> Layout:
        """The same shard along another axis."""
        return Layout("S", axis, self.size, self.parts)


REPLICATED = Layout("R")
PARTIAL = Layout("P")


def block_parts(count: int, degree: int, *, block: int = 1) -> Parts:
    """Index lists of ``count`` elements in blocks of ``block`` over ``degree`` devices.

    Whole blocks go to devices, the first ones taking one more when the blocks do not
    divide. With fewer blocks than devices, each block goes whole to ``degree / blocks``
    devices (replicated heads); that needs ``degree % blocks == 0``.

    Raises:
        InputError: ``count`` is not a whole number of blocks, or fewer blocks than devices
            that do not divide the degree.
    """
    if block <= 0 or count % block:
        raise InputError(f"{count} elements are not a whole number of blocks of {block}")
    blocks = count // block
    if blocks >= degree:
        base, extra = divmod(blocks, degree)
        bounds, start = [], 0
        for d in range(degree):
            stop = start + base + (1 if d < extra else 0)
            bounds.append((start, stop))
            start = stop
    elif blocks and degree % blocks == 0:
        bounds = [(d * blocks // degree, d * blocks // degree + 1) for d in range(degree)]
    else:
        raise InputError(f"{blocks} heads cannot be spread over {degree} devices (neither divides the other)")
    return tuple(tuple(range(a * block, b * block)) for a, b in bounds)


def expand_parts(parts: Parts, inner: int) -> Parts:
    """Index lists over an axis merged with ``inner`` trailing elements per index."""
    return tuple(tuple(i * inner + j for i in part for j in range(inner)) for part in parts)


def contiguous(parts: Parts, size: int) -> bool:
    """Whether the lists are consecutive ranges that cover ``0..size-1`` in device order
    (a ``Concat`` in device order then rebuilds the full value)."""
    flat = [i for part in parts for i in part]
    return flat == list(range(size))
