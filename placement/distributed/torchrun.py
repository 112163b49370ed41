"""torchrun as ``placement launch`` runs it: ``python -m placement.distributed.torchrun [--loopback] ARGS``.

It is ``torchrun ARGS`` with two changes made inside torchrun's own process:

* ``--loopback`` (single-node launches): every ``TCPStore`` server the agent hosts
  listens on ``127.0.0.1`` only (:func:`placement.distributed.loopback.loopback_stores`);
* when a rank fails, the agent stops the others within its ``--shutdown-timeout``
  (torchrun's own rank-failure path waits a fixed 30 seconds for a rank that ignores
  SIGTERM, such as a stopped one, before killing it).

Example:
    >>> "--loopback" in split_flags(["--loopback", "--nproc-per-node=2"])[0]
    True
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence

__all__ = ["main", "bounded_stop", "split_flags"]


def split_flags(argv: Sequence[str]) -> tuple[set[str], list[str]]:
    """Our own leading flags, and the rest (torchrun's arguments)."""
    ours: set[str] = set()
    rest = list(argv)
    while rest and rest[0] in ("--loopback",):
        ours.add(rest.pop(0))
    return ours, rest


@contextlib.contextmanager
def bounded_stop() -> Iterator[None]:
    """While inside, torchrun's agent stops the ranks after a failure within its shutdown timeout."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._stop_workers

    def stop_workers(self: LocalElasticAgent, worker_group: object) -> None:
        self._shutdown(timeout=getattr(self, "_shutdown_timeout", 30))

    LocalElasticAgent._stop_workers = stop_workers  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._stop_workers = original  # type: ignore[method-assign]


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); see the module docstring."""
    from torch.distributed.run import main as torchrun

    from placement.distributed.loopback import loopback_stores

    ours, rest = split_flags(sys.argv[1:] if argv is None else argv)
    with bounded_stop(), loopback_stores() if "--loopback" in ours else contextlib.nullcontext():
        torchrun(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
