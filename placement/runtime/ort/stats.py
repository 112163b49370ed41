"""What a :class:`~placement.runtime.ort.runner.Runner` counts: sessions built and reused,
partitions, runs, transfers, host copies, and the provider each stage's session really got.

Example:
    >>> stats = RunnerStats()
    >>> stats.sessions_built, stats.providers
    (0, {})
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RunnerStats"]


@dataclass
class RunnerStats:
    """Counters a :class:`Runner` keeps (for tests and reports).

    Attributes:
        sessions_built: ``InferenceSession`` s created so far.
        sessions_reused: stage sessions kept across a re-placement.
        partitions: times the model was partitioned (1 + re-placements seen).
        runs: calls to :meth:`Runner.run`.
        transfers: transfers per run (cross-device copies that move data).
        host_copies: tensor copies through host memory the last :meth:`Runner.run` made
            (inputs fed from numpy to a GPU, host <-> GPU transfers, GPU outputs handed
            back as numpy; see :data:`placement.runtime.ort.values.HOST_COPIES`; a run
            in another thread at the same time counts here too).
        providers: stage index -> the execution provider its session really runs on.
    """

    sessions_built: int = 0
    sessions_reused: int = 0
    partitions: int = 0
    runs: int = 0
    transfers: int = 0
    host_copies: int = 0
    providers: dict[int, str] = field(default_factory=dict)
