"""Errors of the distributed runtime (both derive from :class:`placement.PlacementError`).

Example:
    >>> from placement.distributed.errors import WorldSizeError
    >>> print(WorldSizeError(world_size=3, expected=2, groups=["cuda:0", "cuda:1"]))
    world size 3 does not match the placement: it has 2 rank(s) (cuda:0 | cuda:1); launch 2 ...
"""

from __future__ import annotations

from collections.abc import Sequence

from placement.errors import PlacementError

__all__ = ["WorldSizeError", "RankFailedError", "NotAPipelineError"]


class WorldSizeError(PlacementError, ValueError):
    """The number of processes differs from the number of ranks the placement asks for."""

    def __init__(self, *, world_size: int, expected: int, groups: Sequence[str] = ()) -> None:
        self.world_size = world_size
        self.expected = expected
        listed = f" ({' | '.join(groups)})" if groups else ""
        super().__init__(
            f"world size {world_size} does not match the placement: it has {expected} rank(s){listed}; "
            f"launch {expected} processes or pass ranks=..."
        )


class NotAPipelineError(PlacementError, ValueError):
    """The placement cannot run as a chain of ranks (a later rank feeds an earlier one)."""


class RankFailedError(PlacementError, RuntimeError):
    """Another rank failed (raised an error, was killed, or stopped answering).

    Attributes:
        rank: the rank that failed first, or None when it could not be told.
        ranks: every rank found failed.
    """

    def __init__(self, message: str, *, ranks: Sequence[int] = ()) -> None:
        self.ranks = list(ranks)
        self.rank = self.ranks[0] if self.ranks else None
        super().__init__(message)
