"""The device-side order of an emulated GPU: streams, events, and the hazards between them.

On a GPU the host only *queues* work: a kernel reading a weight, a copy writing it and a
free returning memory to the caching allocator happen later, on their streams, in an
order that only ``wait_event`` / ``record_stream`` fix. A CPU run executes everything at
once, so it cannot see a missing wait by timing. :class:`DeviceTimeline` sees it by order
instead: every stream is a queue with a logical clock (a vector clock, one counter per
stream); an operation queued on a stream takes the next tick of that stream; an event
carries the clock of its stream at the point it was recorded; waiting for an event
merges that clock into the waiting stream's. Operation ``a`` happens before ``b`` when
``b``'s stream clock has reached ``a``'s tick, the only order a GPU guarantees.

Every access to device memory the streamer makes is checked against the earlier ones to
the same bytes:

* a **read** (a kernel reading a weight) must come after the last copy into those bytes
  (*read before its copy's event*);
* a **write** (a copy refilling a window region) must come after every read and write of
  those bytes before it (*a copy into a region a queued kernel still reads*);
* a **free** must come after every access to the block: the caching allocator hands a
  freed block to the next allocation on the stream it was allocated on at once, unless
  ``record_stream`` named the other streams that use it (*freed while another stream
  still uses it*).

Each violation is a :class:`HazardError`, raised where it happens (or, for a free that
the garbage collector makes, at the next check).

Example:
    >>> import torch
    >>> timeline = DeviceTimeline()
    >>> buf = torch.zeros(16, dtype=torch.uint8)
    >>> timeline.write(buf, "copy")                       # a copy on the copy stream...
    >>> timeline.read(buf, "compute")                     # ...read without waiting for it
    Traceback (most recent call last):
    ...
    placement.runtime.torch.device_timeline.HazardError: read before its copy's event: ...
    >>> timeline = DeviceTimeline()
    >>> timeline.write(buf, "copy"); timeline.wait(timeline.record("copy"), "compute")
    >>> timeline.read(buf, "compute")                     # ordered: no hazard
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch

from placement.errors import PlacementError

__all__ = ["DeviceTimeline", "HazardError", "Clock"]

Clock = dict[Hashable, int]


class HazardError(PlacementError, RuntimeError):
    """Two accesses to the same device memory that no stream order separates."""


@dataclass
class _Access:
    kind: str  # "read" | "write"
    start: int
    end: int
    stream: Hashable
    tick: int
    what: str


def _span(tensor: torch.Tensor) -> tuple[int, int, int]:
    """(storage key, first byte, end byte) of ``tensor``'s memory."""
    storage = tensor.untyped_storage()
    start = tensor.data_ptr()
    return storage.data_ptr(), start, start + tensor.numel() * tensor.element_size()


class DeviceTimeline:
    """Streams as queues with vector clocks; checks every access against the earlier ones."""

    def __init__(self) -> None:
        self._clocks: dict[Hashable, Clock] = {}
        self._accesses: dict[int, list[_Access]] = {}  # storage key -> accesses
        self._lock = threading.RLock()
        self.hazards: list[str] = []  # found where raising was impossible (a free in the GC)
        self.checked = 0  # accesses checked

    # -- streams and events ---------------------------------------------------------------
    def _tick(self, stream: Hashable) -> int:
        clock = self._clocks.setdefault(stream, {})
        clock[stream] = clock.get(stream, 0) + 1
        return clock[stream]

    def record(self, stream: Hashable) -> Clock:
        """An event behind the work queued on ``stream`` so far (a copy of its clock)."""
        with self._lock:
            self._tick(stream)
            return dict(self._clocks[stream])

    def wait(self, event: Clock | None, stream: Hashable) -> None:
        """``stream`` runs nothing queued after this until ``event`` completes."""
        if event is None:
            return
        with self._lock:
            clock = self._clocks.setdefault(stream, {})
            for key, tick in event.items():
                if clock.get(key, 0) < tick:
                    clock[key] = tick

    def clock(self, streams: Iterable[Hashable]) -> Clock:
        """The join of the current clocks of ``streams``."""
        joined: Clock = {}
        with self._lock:
            for stream in streams:
                for key, tick in self._clocks.get(stream, {}).items():
                    joined[key] = max(joined.get(key, 0), tick)
        return joined

    # -- accesses ---------------------------------------------------------------------------
    def read(self, tensor: torch.Tensor, stream: Hashable, what: str = "a kernel") -> None:
        """A kernel queued on ``stream`` reads ``tensor``."""
        self._access("read", tensor, stream, what)

    def write(self, tensor: torch.Tensor, stream: Hashable, what: str = "a copy") -> None:
        """A copy queued on ``stream`` writes ``tensor``."""
        self._access("write", tensor, stream, what)

    def _access(self, kind: str, tensor: torch.Tensor, stream: Hashable, what: str) -> None:
        if not tensor.numel():
            return
        key, start, end = _span(tensor)
        with self._lock:
            tick = self._tick(stream)
            clock = self._clocks[stream]
            earlier = self._accesses.setdefault(key, [])
            for old in earlier:
                if old.end <= start or end <= old.start or (kind == "read" and old.kind == "read"):
                    continue
                if clock.get(old.stream, 0) < old.tick:
                    raise HazardError(self._describe(kind, what, stream, old))
            self.checked += 1
            if kind == "write":  # a later access ordered after this one is ordered after those it covers
                earlier[:] = [a for a in earlier if not (start <= a.start and a.end <= end)]
            earlier.append(_Access(kind, start, end, stream, tick, what))

    @staticmethod
    def _describe(kind: str, what: str, stream: Hashable, old: _Access) -> str:
        if kind == "read" and old.kind == "write":
            head = "read before its copy's event"
        elif kind == "write" and old.kind == "read":
            head = "a copy into a region a queued kernel still reads"
        else:
            head = "two copies into one region without an order"
        return (
            f"{head}: {what} on stream {stream!r} {kind}s bytes that {old.what} on stream "
            f"{old.stream!r} {old.kind}s, and no event orders the two"
        )

    def free(self, key: int, streams: Iterable[Hashable], what: str) -> None:
        """The block with storage ``key`` goes back to the allocator; ``streams``: its allocation
        stream and those ``record_stream`` named. Every access must be ordered before the free."""
        streams = list(streams)
        with self._lock:
            accesses = self._accesses.pop(key, [])
            at = self.clock(streams)
            for old in accesses:
                if at.get(old.stream, 0) < old.tick:
                    self.hazards.append(
                        f"freed while another stream still uses it: {what}, reusable on "
                        f"{streams!r}, while {old.what} on stream {old.stream!r} may still "
                        f"{old.kind} it (record_stream missing)"
                    )
                    break

    def check(self) -> None:
        """Raise the first hazard found where raising was impossible (a free in the GC)."""
        with self._lock:
            if self.hazards:
                found, self.hazards = self.hazards, []
                raise HazardError(found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))
