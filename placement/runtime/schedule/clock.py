"""GPipe's fill-drain clock: which stage runs which micro-batch when, and what it costs.

At clock tick ``t`` stage ``j`` works on micro-batch ``t - j`` (:func:`clock_cycles`); the idle
share of the stage-time grid, the *bubble*, is ``(N - 1) / (k + N - 1)`` (:func:`bubble_fraction`).
:func:`check_chunks` checks a ``chunks=`` argument the way both runtimes take it.

Example:
    >>> from placement.runtime.schedule.clock import clock_cycles, bubble_fraction
    >>> for tick in clock_cycles(3, 2):
    ...     print(tick)
    [(0, 0)]
    [(1, 0), (0, 1)]
    [(2, 0), (1, 1)]
    [(2, 1)]
    >>> round(bubble_fraction(8, 2), 3)
    0.111
"""

from __future__ import annotations

import os

__all__ = ["CHECKPOINT_MODES", "bubble_fraction", "check_chunks", "clock_cycles", "stage_threads"]

#: Checkpointing modes of the torch pipeline (GPipe's): recompute every, all but the last, or no micro-batch.
CHECKPOINT_MODES = ("always", "except_last", "never")


def clock_cycles(num_microbatches: int, num_stages: int) -> list[list[tuple[int, int]]]:
    """GPipe's fill-drain schedule: per clock tick, the ``(micro-batch, stage)`` pairs that run.

    At tick ``t`` stage ``j`` runs micro-batch ``t - j``; there are
    ``num_microbatches + num_stages - 1`` ticks.

    Example:
        >>> clock_cycles(2, 2)
        [[(0, 0)], [(1, 0), (0, 1)], [(1, 1)]]
    """
    if num_microbatches < 1 or num_stages < 1:
        raise ValueError("a schedule needs at least one micro-batch and one stage")
    ticks = []
    for t in range(num_microbatches + num_stages - 1):
        first = max(0, t - num_microbatches + 1)
        last = min(t, num_stages - 1)
        ticks.append([(t - j, j) for j in range(first, last + 1)])
    return ticks


def bubble_fraction(num_microbatches: int, num_stages: int) -> float:
    """The idle share of the fill-drain schedule with equal stages: ``(N-1) / (k+N-1)``.

    Example:
        >>> bubble_fraction(1, 2)
        0.5
    """
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def stage_threads(num_stages: int, *, cores: int | None = None) -> int:
    """Intra-op threads per stage when ``num_stages`` stages share the CPU: cores / stages, at least 1.

    Example:
        >>> stage_threads(2, cores=8)
        4
    """
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, num_stages))


def check_chunks(chunks: object) -> int:
    """``chunks`` (micro-batches per batch) checked: a positive integer.

    Raises:
        ValueError: ``chunks`` is not a positive integer.

    Example:
        >>> check_chunks(4)
        4
        >>> check_chunks(0)
        Traceback (most recent call last):
        ...
        ValueError: chunks must be a positive integer, got 0
    """
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    return chunks
