"""Cut a batch into micro-batches along the batch axes, and join the results back.

Example:
    >>> import numpy as np
    >>> from placement.runtime.schedule.split import microbatch_bounds, split_batch
    >>> microbatch_bounds(5, 2)
    [(0, 3), (3, 5)]
    >>> [p[0].shape for p in split_batch([np.zeros((5, 2))], [0], 2)]
    [(3, 2), (2, 2)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from placement.errors import InputError

__all__ = ["concat_batch", "microbatch_bounds", "split_batch"]


def microbatch_bounds(size: int, chunks: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each micro-batch: ``min(chunks, size)`` parts whose sizes differ by at most 1.

    Example:
        >>> microbatch_bounds(10, 4)
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    parts = max(1, min(chunks, size))
    base, extra = divmod(size, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def split_batch(values: Sequence[Any], axes: Sequence[int | None], chunks: int) -> list[list[Any]]:
    """Cut arrays (numpy or torch) into micro-batches along their batch axes.

    ``values[n]`` is cut along ``axes[n]``; a value whose axis is None goes
    whole into every micro-batch. All batched values must agree on the batch
    size. The parts are views (numpy slices / torch ``narrow``).

    Raises:
        InputError: the batched values disagree on the batch size.

    Example:
        >>> import numpy as np
        >>> parts = split_batch([np.arange(6).reshape(3, 2), np.ones(2)], [0, None], 2)
        >>> [[p.shape for p in part] for part in parts]
        [[(2, 2), (2,)], [(1, 2), (2,)]]
    """
    sizes = {int(v.shape[a]) for v, a in zip(values, axes) if a is not None}
    if len(sizes) > 1:
        raise InputError(f"batched inputs disagree on the batch size: {sorted(sizes)}")
    size = sizes.pop() if sizes else 1
    parts: list[list[Any]] = []
    for start, stop in microbatch_bounds(size, chunks):
        part = []
        for value, axis in zip(values, axes):
            if axis is None:
                part.append(value)
            elif hasattr(value, "narrow"):
                part.append(value.narrow(axis, start, stop - start))
            else:
                part.append(value[(slice(None),) * axis + (slice(start, stop),)])
        parts.append(part)
    return parts


def concat_batch(parts: Sequence[Sequence[Any]], axes: Sequence[int]) -> list[Any]:
    """Join per-micro-batch outputs along their batch axes (the inverse of :func:`split_batch`).

    Returns new arrays (numpy ``concatenate`` / ``torch.cat``), which own their memory.

    Example:
        >>> import numpy as np
        >>> concat_batch([[np.zeros((2, 3))], [np.ones((1, 3))]], [0])[0].shape
        (3, 3)
    """
    joined = []
    for n, axis in enumerate(axes):
        pieces = [part[n] for part in parts]
        first = pieces[0]
        if hasattr(first, "narrow"):
            import torch

            joined.append(torch.cat(pieces, dim=axis))
        else:
            joined.append(np.concatenate(pieces, axis=axis))
    return joined
