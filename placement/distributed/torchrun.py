"""torchrun as ``placement launch`` runs it: ``python -m placement.distributed.torchrun [--loopback] ARGS``.

It is ``torchrun ARGS`` with two changes made inside torchrun's own process:

* ``--loopback`` (single-node launches): every ``TCPStore`` server the agent hosts
  listens on ``127.0.0.1`` only (:func:`placement.distributed.loopback.loopback_stores`);
* when a rank fails, the agent stops the others within its ``--shutdown-timeout``
  (torchrun's own rank-failure path waits a fixed 30 seconds for a rank that ignores
  SIGTERM, such as a stopped one, before killing it).

``--shutdown-timeout`` is detected in the torchrun that runs (its argument parser's
help), not assumed from torch's version: where torchrun lacks the flag (torch 2.11 and
older), it is taken out of torchrun's arguments and its value bounds every stop of the
agent here instead (:func:`bounded_stop`).

Example:
    >>> "--loopback" in split_flags(["--loopback", "--nproc-per-node=2"])[0]
    True
    >>> take_flag(["--nproc-per-node=2", "--shutdown-timeout=3", "-m", "x"], "--shutdown-timeout")
    (['--nproc-per-node=2', '-m', 'x'], '3')
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["main", "bounded_stop", "split_flags", "torchrun_flags", "take_flag"]

SHUTDOWN_FLAG = "--shutdown-timeout"


def split_flags(argv: Sequence[str]) -> tuple[set[str], list[str]]:
    """Our own leading flags, and the rest (torchrun's arguments)."""
    ours: set[str] = set()
    rest = list(argv)
    while rest and rest[0] in ("--loopback",):
        ours.add(rest.pop(0))
    return ours, rest


@functools.cache
def torchrun_flags() -> frozenset[str]:
    """The option flags of the installed torchrun (from its argument parser's help)."""
    from torch.distributed.run import get_args_parser

    return frozenset(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", get_args_parser().format_help()))


def take_flag(args: Sequence[str], flag: str) -> tuple[list[str], str | None]:
    """``args`` without ``flag`` (``--flag=V`` or ``--flag V``, before ``-m``), and its value."""
    rest: list[str] = []
    value = None
    items = iter(args)
    for arg in items:
        if arg in ("-m", "--module", "--"):
            rest += [arg, *items]
            break
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag:
            value = next(items, None)
        else:
            rest.append(arg)
    return rest, value


@contextlib.contextmanager
def bounded_stop(timeout: float | None = None, *, agent_class: type | None = None) -> Iterator[None]:
    """While inside, torchrun's agent stops the ranks after a failure within its shutdown timeout.

    Args:
        timeout: seconds to wait for a stopped rank before killing it, for a torchrun
            without ``--shutdown-timeout`` (None: the agent's own ``_shutdown_timeout``).
        agent_class: the agent class to change (default torch's ``LocalElasticAgent``).

    Where the agent's ``_shutdown`` takes no timeout (torch 2.11 and older), it is wrapped
    so that its process context closes within ``timeout`` seconds on every stop: after a
    rank failure, on a signal, at the end.
    """
    if agent_class is None:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        agent_class = LocalElasticAgent
    original_stop, original_shutdown = agent_class._stop_workers, agent_class._shutdown
    native = "timeout" in inspect.signature(original_shutdown).parameters

    def seconds(agent: Any) -> float:
        return timeout if timeout is not None else getattr(agent, "_shutdown_timeout", 30)

    def stop_workers(self: Any, worker_group: object) -> None:
        self._shutdown(timeout=seconds(self))

    def shutdown(self: Any, death_sig: signal.Signals = signal.SIGTERM, timeout: float | None = None) -> None:
        context = getattr(self, "_pcontext", None)
        if context is None:
            return original_shutdown(self, death_sig)
        wait = seconds(self) if timeout is None else timeout
        close = context.close
        context.close = lambda sig=None, timeout=30: close(sig, timeout=wait)
        try:
            original_shutdown(self, death_sig)
        finally:
            del context.close

    agent_class._stop_workers = stop_workers
    if not native:
        agent_class._shutdown = shutdown
    try:
        yield
    finally:
        agent_class._stop_workers = original_stop
        agent_class._shutdown = original_shutdown


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); see the module docstring."""
    from torch.distributed.run import main as torchrun

    from placement.distributed.loopback import loopback_stores

    ours, rest = split_flags(sys.argv[1:] if argv is None else argv)
    timeout = None
    if SHUTDOWN_FLAG not in torchrun_flags():
        rest, value = take_flag(rest, SHUTDOWN_FLAG)
        timeout = None if value is None else float(value)
    with bounded_stop(timeout), loopback_stores() if "--loopback" in ours else contextlib.nullcontext():
        torchrun(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
