"""Tell which rank failed: error reports and heartbeats in the rendezvous store.

When one rank dies, its peers see only a broken connection ("Connection closed by
peer") or, if it hangs, a timeout. The :class:`Watchdog` makes the survivors name
the rank that failed first:

* each rank bumps a counter ``placement/beat/<rank>`` in the process group's
  store from a daemon thread (every ``interval`` seconds, also while its main
  thread waits inside a collective);
* a rank that fails on its own (an exception in its code) writes
  ``placement/error/<rank>`` = ``own|<message>`` before it exits; a rank that
  fails because a peer went away writes ``peer|<message>``;
* a rank that catches a failure looks for ``own`` reports; failing that, the
  ranks whose heartbeat stopped and that reported nothing are the dead ones
  (killed, out of memory, lost host).

The store is torch.distributed's own (hosted by torchrun's agent, or by rank 0
with a ``tcp://`` / ``env://`` rendezvous outside torchrun). If the store itself
is unreachable, its host went away, and the message says so.

Example:
    >>> from datetime import timedelta
    >>> import torch.distributed as dist
    >>> store = dist.HashStore()
    >>> dog = Watchdog(store, rank=0, world_size=2, interval=0.05)
    >>> dog.report(ValueError("bad input"), own=True)
    >>> Watchdog(store, rank=1, world_size=2).diagnose(grace=0.2)[0]
    [0]
    >>> dog.stop()
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Watchdog", "is_comm_error", "guard"]

log = logging.getLogger(__name__)

_PREFIX = "placement/"
_COMM_WORDS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "gloo",
    "nccl",
    "peer",
    "socket",
    "recv",
    "send",
)


def is_comm_error(exc: BaseException) -> bool:
    """True when ``exc`` looks like a failure of the transport, not of this rank's own code.

    Example:
        >>> is_comm_error(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"))
        True
        >>> is_comm_error(ValueError("shape mismatch"))
        False
    """
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistBackendError", ())) or isinstance(
        exc, getattr(dist, "DistNetworkError", ())
    ):
        return True
    if not isinstance(exc, (RuntimeError, ConnectionError, TimeoutError, OSError)):
        return False
    text = str(exc).lower()
    return any(word in text for word in _COMM_WORDS)


_running: weakref.WeakSet[Watchdog] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Stop heartbeats before the interpreter (and the store client) goes away."""
    for dog in list(_running):
        dog._stop.set()
        if dog._thread is not None:
            dog._thread.join(timeout=1.0)


class Watchdog:
    """Heartbeat and failure reports of one rank in a ``torch.distributed`` store.

    Args:
        store: the process group's store (``torch.distributed.Store``).
        rank: this rank.
        world_size: the number of ranks.
        interval: seconds between heartbeats; 0 starts no heartbeat thread.
        namespace: a key prefix, so several pipelines can share one store.
    """

    def __init__(
        self, store: Any, *, rank: int, world_size: int, interval: float = 0.0, namespace: str = ""
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = f"{_PREFIX}{namespace}"
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval > 0:
            self._thread = threading.Thread(
                target=self._beat, name=f"placement-heartbeat-{rank}", daemon=True
            )
            self._thread.start()
            _running.add(self)

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}{kind}/{rank}"

    def _beat(self) -> None:
        key = self._key("beat", self.rank)
        while not self._stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception:  # the store's host is gone: nothing left to tell
                return
            self._stop.wait(self.interval)

    def stop(self) -> None:
        """Stop the heartbeat and mark this rank done (it is not blamed for going quiet)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
            try:
                self.store.set(self._key("done", self.rank), "1")
            except Exception:  # the store's host is gone
                pass

    def report(self, exc: BaseException, *, own: bool) -> None:
        """Tell the other ranks that this rank fails with ``exc`` (``own``: not caused by a peer)."""
        text = f"{'own' if own else 'peer'}|{type(exc).__name__}: {exc}"
        try:
            self.store.set(self._key("error", self.rank), text[:2000])
        except Exception as err:  # the store is gone too: the caller's error says enough
            log.debug("could not report the failure of rank %d: %s", self.rank, err)

    def _beats(self) -> dict[int, int]:
        counts = {}
        for r in range(self.world_size):
            key = self._key("beat", r)
            counts[r] = int(self.store.add(key, 0))
        return counts

    def _errors(self) -> dict[int, str]:
        found = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = self._key("error", r)
            if self.store.check([key]):
                found[r] = self.store.get(key).decode(errors="replace")
        return found

    def diagnose(self, *, grace: float = 2.0) -> tuple[list[int], str]:
        """``(failed ranks, message)``: who failed, after waiting up to ``grace`` seconds.

        Ranks that reported an error of their own come first; then ranks whose
        heartbeat stopped without a report. Heartbeats are only judged when the
        ranks run a heartbeat thread (``interval > 0``) and ``grace`` spans
        several intervals.
        """
        try:
            start = self._beats()
        except Exception as err:
            return [], f"the rendezvous store is unreachable (its host, torchrun or rank 0, is gone): {err}"
        deadline = time.monotonic() + grace
        errors: dict[int, str] = {}
        while True:
            try:
                errors = self._errors()
            except Exception as err:
                return (
                    [],
                    f"the rendezvous store is unreachable (its host, torchrun or rank 0, is gone): {err}",
                )
            own = {r: text for r, text in errors.items() if text.startswith("own|")}
            if own:
                ranks = sorted(own)
                lines = "; ".join(f"rank {r} failed: {own[r][4:]}" for r in ranks)
                return ranks, lines
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, grace / 4 or 0.05))
        try:
            end = self._beats()
        except Exception as err:
            return [], f"the rendezvous store is unreachable (its host, torchrun or rank 0, is gone): {err}"
        silent = [
            r
            for r in range(self.world_size)
            if r != self.rank
            and r not in errors
            and end[r] == start[r]
            and not self.store.check([self._key("done", r)])
        ]
        if silent:
            named = ", ".join(map(str, silent))
            return silent, (
                f"rank {named} stopped without a report (killed, crashed or its host is lost; "
                "see its own log or torchrun's summary)"
            )
        if errors:
            ranks = sorted(errors)
            return ranks, "; ".join(f"rank {r} failed: {errors[r].split('|', 1)[1]}" for r in ranks)
        return [], "no rank reported a failure (a peer may be too slow: see the timeout)"


@contextmanager
def guard(dog: Watchdog | None, what: str, *, grace: float = 3.0) -> Iterator[None]:
    """Turn a failure inside the block into a report, or into a ``RankFailedError`` naming the peer.

    An error of this rank's own code is reported to the others (``own``) and
    re-raised; a transport error (a peer went away) is reported as ``peer`` and
    becomes :class:`~placement.distributed.errors.RankFailedError` naming the
    rank that failed first (:meth:`Watchdog.diagnose`). Without a watchdog the
    error passes unchanged.

    Example:
        >>> import torch.distributed as dist
        >>> dog = Watchdog(dist.HashStore(), rank=0, world_size=2)
        >>> with guard(dog, "run"):
        ...     raise ValueError("bad input")
        Traceback (most recent call last):
        ...
        ValueError: bad input
    """
    from placement.distributed.errors import RankFailedError

    try:
        yield
    except RankFailedError:
        raise
    except Exception as exc:
        if dog is None:
            raise
        if not is_comm_error(exc):
            dog.report(exc, own=True)
            raise
        dog.report(exc, own=False)
        ranks, message = dog.diagnose(grace=grace)
        raise RankFailedError(
            f"{what} on rank {dog.rank} stopped: {message} (rank {dog.rank} saw: {exc})", ranks=ranks
        ) from exc
