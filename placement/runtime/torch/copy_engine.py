"""The copy engine: where a streamed weight's copy runs and how its readers wait for it.

:class:`~.streaming.WeightStreamer` decides *which* weight is copied *when* and *where*
in its window; a copy engine carries that out on the hardware. The seam is small, so the
same schedule runs against

* :class:`CudaCopyEngine`: a dedicated ``torch.cuda.Stream`` per device for the copies
  (``non_blocking`` from pinned host memory), ``torch.cuda.Event``\\ s recorded after each
  copy and waited for by the compute stream (``wait_event``), and events recorded on the
  compute stream after a weight's last reader, which the copy stream waits for before it
  refills that part of the window;
* :class:`~.copy_emulation.EmulatedCopyEngine`: the same contract on the CPU, with copies
  completing late and out of order on a worker thread and their destinations poisoned
  until they complete, so a missing wait shows as wrong numbers in a test;
* :class:`DirectEngine`: plain ``.to(device)`` with nothing in flight (the CPU default).

Every engine has the same methods:

``alloc(device, nbytes)``
    a byte buffer on ``device`` (the window);
``copy(src, dst, after=())``
    on the copy stream: wait for the events ``after``, copy ``src`` into ``dst``; the
    event recorded after the copy;
``copy_new(src, device)``
    a fresh copy of ``src`` on ``device`` that autograd flows through, and its event;
``wait(event, device)``
    the consuming (current) stream waits for ``event`` before any work queued after;
``record(device)``
    an event on the current stream behind the work queued so far (a reader's release);
``reads(tensor, device)``
    the work queued next on the current stream reads ``tensor`` (nothing to do on a GPU;
    the emulator checks it is ordered after the copy that wrote it);
``keep(tensor, device)``
    the caching allocator may reuse ``tensor``'s memory only after the current stream's
    work queued so far (``record_stream``): a fresh copy, allocated on the copy stream and
    read on the compute stream;
``keep_copying(tensor, device)``
    the same for the copy stream: the window, allocated on the compute stream and written
    by copies, goes back to the allocator only behind the copies queued by its free (the
    end-of-forward prefetch leaves copies in flight);
``synchronize()``
    every copy issued so far is complete.

Example:
    >>> import torch
    >>> engine = DirectEngine()
    >>> buf = engine.alloc(torch.device("cpu"), 16)
    >>> event = engine.copy(torch.ones(4), buf.view(torch.float32))
    >>> engine.wait(event, torch.device("cpu")); buf.view(torch.float32).tolist()
    [1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["CopyEngine", "CudaCopyEngine", "DirectEngine", "engine_for"]


class CopyEngine(Protocol):
    """What the streamer needs from the hardware (see the module docstring)."""

    def alloc(self, device: torch.device, nbytes: int) -> torch.Tensor: ...

    def copy(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any] = ()) -> Any: ...

    def copy_new(self, src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]: ...

    def wait(self, event: Any, device: torch.device) -> None: ...

    def record(self, device: torch.device) -> Any: ...

    def reads(self, tensor: torch.Tensor, device: torch.device) -> None: ...

    def keep(self, tensor: torch.Tensor, device: torch.device) -> None: ...

    def keep_copying(self, tensor: torch.Tensor, device: torch.device) -> None: ...

    def synchronize(self) -> None: ...


class DirectEngine:
    """Copies at once on the calling thread; nothing is ever in flight (events are ``None``)."""

    def alloc(self, device: torch.device, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any] = ()) -> Any:
        dst.copy_(src)
        return None

    def copy_new(self, src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        return src.to(device), None

    def wait(self, event: Any, device: torch.device) -> None:
        return None

    def record(self, device: torch.device) -> Any:
        return None

    def reads(self, tensor: torch.Tensor, device: torch.device) -> None:
        return None

    def keep(self, tensor: torch.Tensor, device: torch.device) -> None:
        return None

    def keep_copying(self, tensor: torch.Tensor, device: torch.device) -> None:
        return None

    def synchronize(self) -> None:
        return None


class CudaCopyEngine:
    """Copies on a side ``torch.cuda.Stream`` per device, ordered by CUDA events.

    With ``timing`` on, every copy is bracketed by timing events; :meth:`copy_seconds`
    sums them (the link's busy time, for the overlap figure).
    """

    def __init__(self) -> None:
        self.timing = False
        self.streams: dict[torch.device, Any] = {}
        self.timed: list[tuple[Any, Any]] = []

    def stream(self, device: torch.device) -> Any:
        """The copy stream of ``device`` (made on first use)."""
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device=device)
        return stream

    def alloc(self, device: torch.device, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _on_copy_stream(self, device: torch.device, src: torch.Tensor, after: Sequence[Any], fn: Any) -> Any:
        stream = self.stream(device)
        for event in after:
            if event is not None:
                stream.wait_event(event)
        if src.device.type == "cuda":  # a source made on a GPU: copy once the work making it is done
            stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True) if self.timing else None
            if start is not None:
                start.record(stream)
            result = fn()
            event = torch.cuda.Event(enable_timing=self.timing)
            event.record(stream)
            if start is not None:
                self.timed.append((start, event))
        return result, event

    def copy(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any] = ()) -> Any:
        _, event = self._on_copy_stream(dst.device, src, after, lambda: dst.copy_(src, non_blocking=True))
        return event

    def copy_new(self, src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        return self._on_copy_stream(device, src, (), lambda: src.to(device, non_blocking=True))

    def wait(self, event: Any, device: torch.device) -> None:
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)

    def record(self, device: torch.device) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def reads(self, tensor: torch.Tensor, device: torch.device) -> None:
        return None  # the stream order is the hardware's

    def keep(self, tensor: torch.Tensor, device: torch.device) -> None:
        tensor.record_stream(torch.cuda.current_stream(device))

    def keep_copying(self, tensor: torch.Tensor, device: torch.device) -> None:
        tensor.record_stream(self.stream(device))

    def synchronize(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()

    def copy_seconds(self) -> float:
        """Seconds the timed copies took on their streams (synchronises)."""
        total = 0.0
        for start, end in self.timed:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total


def engine_for(device: torch.device) -> CudaCopyEngine | DirectEngine:
    """The default engine of a destination device: CUDA streams and events on a GPU, else direct."""
    return CudaCopyEngine() if device.type == "cuda" else DirectEngine()
