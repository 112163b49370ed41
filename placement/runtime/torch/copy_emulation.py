"""A copy engine emulated on the CPU that makes every missing wait visible.

:class:`EmulatedCopyEngine` keeps the contract of :class:`~.copy_engine.CudaCopyEngine`
(see :mod:`.copy_engine`) with the weakest timing it allows, so a schedule that is right
here is right on a GPU:

* a copy runs on a worker thread, **late** (after a random delay up to ``latency``, or,
  with ``hold=True``, only once a reader waits for it or :meth:`synchronize` is called)
  and **out of order** (the worker picks any copy whose dependencies are done, seeded);
* its destination is **poisoned** (every byte ``0xFF``: NaN in floating point) as soon as
  the copy may start, and holds the source's bytes only when its event completes;
* a copy waits for the events it was told to wait for (``after``), e.g. the release of the
  window's region it refills;
* the compute stream is the calling thread: :meth:`wait` blocks until the event completes,
  and :meth:`record` gives an event that is already complete (the work before it is done).

A read that does not wait for its copy's event sees NaN (or another weight), and a
region refilled before its reader's release is poisoned under that reader.

Wrong numbers show only the hazards that the CPU's timing happens to expose. The device
order is checked too, whatever the timing: the engine keeps a
:class:`~.device_timeline.DeviceTimeline` in which each calling thread's compute stream
and each device's copy stream is a queue with a clock, every event carries the clock of
the point it was recorded at, and every copy, read (:meth:`reads`) and free is checked
against the earlier accesses to the same bytes. A read not ordered after its copy, a copy
into bytes a queued kernel may still read, and a block freed while another stream may
still use it (``record_stream`` missing: the window's blocks, on the copy stream by
:meth:`keep_copying`; fresh copies, on the compute stream by :meth:`keep`) raise
:class:`~.device_timeline.HazardError` (a free in the garbage collector is raised by the
next :meth:`check`, :meth:`synchronize` or :meth:`close`).

Example:
    >>> import torch
    >>> engine = EmulatedCopyEngine(hold=True)
    >>> cpu = torch.device("cpu")
    >>> dst = engine.alloc(cpu, 16).view(torch.float32)
    >>> event = engine.copy(torch.ones(4), dst)
    >>> bool(dst.isnan().all())        # poisoned until the copy completes
    True
    >>> engine.wait(event, cpu); dst.tolist()
    [1.0, 1.0, 1.0, 1.0]
    >>> engine.close()
"""

from __future__ import annotations

import random
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from placement.runtime.torch.device_timeline import DeviceTimeline, HazardError

__all__ = ["EmulatedCopyEngine", "EmulatedEvent", "HazardError"]

POISON = 0xFF  # every byte: NaN in fp16 / bf16 / fp32 / fp64, -1 in integers


class EmulatedEvent:
    """A point on an emulated stream: done once the work before it is done."""

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        if done:
            self._done.set()
        self.demanded = False
        self.job: _Job | None = None
        self.clock: dict[Any, int] | None = None  # the device order (see DeviceTimeline)

    def query(self) -> bool:
        return self._done.is_set()

    def set(self) -> None:
        self._done.set()


@dataclass(eq=False)
class _Job:
    src: torch.Tensor
    dst: torch.Tensor
    after: list[EmulatedEvent]
    event: EmulatedEvent
    poisoned: bool = False
    delay: float = 0.0
    issued: float = field(default_factory=time.monotonic)

    def ready(self) -> bool:
        return all(e.query() for e in self.after)


def _poison(tensor: torch.Tensor) -> None:
    if tensor.numel():
        tensor.view(-1).view(torch.uint8).fill_(POISON)


class EmulatedCopyEngine:
    """Copies on a worker thread, late and out of order, poisoning until done (see the module doc).

    Args:
        latency: the longest delay of a copy after it may start (seconds; each copy draws
            a delay in ``[0, latency]``).
        hold: complete a copy only when a reader waits for it (or at :meth:`synchronize`):
            the latest legal time, so a read that does not wait always sees poison.
        seed: seeds the order and the delays.
    """

    def __init__(self, *, latency: float = 0.002, hold: bool = False, seed: int = 0) -> None:
        self.latency = latency
        self.hold = hold
        self._rng = random.Random(seed)
        self._jobs: list[_Job] = []
        self._cond = threading.Condition()
        self._closed = False
        self.completed = 0  # copies done
        self.out_of_order = 0  # copies done before one issued earlier
        self.error: Exception | None = None  # a copy that failed (raised by the next wait)
        self.timeline = DeviceTimeline()
        self._users: dict[int, list[Any]] = {}  # storage -> its allocation stream and record_stream's
        self._worker = threading.Thread(target=self._run, name="emulated-copy-engine", daemon=True)
        self._worker.start()

    # -- the streams ------------------------------------------------------------------------
    @staticmethod
    def compute_stream(device: torch.device) -> tuple[str, str, int]:
        """The current stream of the calling thread on ``device``."""
        return ("compute", str(device), threading.get_ident())

    @staticmethod
    def copy_stream(device: torch.device) -> tuple[str, str]:
        """The copy stream of ``device``."""
        return ("copy", str(device))

    def _allocated(self, tensor: torch.Tensor, stream: Any, what: str) -> None:
        """``tensor`` was allocated on ``stream``: its free is checked (see DeviceTimeline.free)."""
        key = tensor.untyped_storage().data_ptr()
        users = self._users[key] = [stream, "host"]
        weakref.finalize(tensor, self._freed, key, users, what)

    def _freed(self, key: int, users: list[Any], what: str) -> None:
        if self._users.get(key) is users:
            del self._users[key]
        self.timeline.free(key, users, what)

    def _record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        users = self._users.get(tensor.untyped_storage().data_ptr())
        if users is not None and stream not in users:
            users.append(stream)

    # -- the engine contract ------------------------------------------------------------
    def alloc(self, device: torch.device, nbytes: int) -> torch.Tensor:
        buffer = torch.full((nbytes,), POISON, dtype=torch.uint8, device=device)
        self._allocated(buffer, self.compute_stream(device), f"a window of {nbytes} bytes on {device}")
        return buffer

    def copy(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any] = ()) -> EmulatedEvent:
        deps = [e for e in after if e is not None]
        stream = self.copy_stream(dst.device)
        for dep in deps:
            self.timeline.wait(dep.clock, stream)
        self.timeline.write(dst, stream, f"a copy of {tuple(src.shape)}")
        event = EmulatedEvent()
        event.clock = self.timeline.record(stream)
        job = _Job(src.detach(), dst, deps, event, delay=self._rng.uniform(0.0, self.latency))
        event.job = job
        with self._cond:
            if job.ready():  # the engine may start at once: the destination is garbage from now on
                _poison(dst)
                job.poisoned = True
            self._jobs.append(job)
            self._cond.notify_all()
        return event

    def copy_new(self, src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, EmulatedEvent]:
        stream = self.copy_stream(device)
        fresh = src.to(device, copy=True)  # autograd flows through it
        self._allocated(fresh, stream, f"a fresh copy of {tuple(src.shape)}")
        self.timeline.write(fresh, stream, f"the fresh copy of {tuple(src.shape)}")
        event = EmulatedEvent(done=True)
        event.clock = self.timeline.record(stream)
        return fresh, event

    def wait(self, event: Any, device: torch.device) -> None:
        self.check()
        if event is None:
            return
        self.timeline.wait(event.clock, self.compute_stream(device))
        if event.query():
            return
        with self._cond:
            self._demand(event)
            self._cond.notify_all()
        event._done.wait()
        if self.error is not None:
            raise RuntimeError("an emulated copy failed") from self.error

    def record(self, device: torch.device) -> EmulatedEvent:
        event = EmulatedEvent(done=True)  # the calling thread's work is done: complete for the copies
        event.clock = self.timeline.record(self.compute_stream(device))  # but ordered as on a GPU
        return event

    def reads(self, tensor: torch.Tensor, device: torch.device) -> None:
        self.timeline.read(tensor, self.compute_stream(device), f"a kernel reading {tuple(tensor.shape)}")

    def keep(self, tensor: torch.Tensor, device: torch.device) -> None:
        self._record_stream(tensor, self.compute_stream(device))

    def keep_copying(self, tensor: torch.Tensor, device: torch.device) -> None:
        self._record_stream(tensor, self.copy_stream(device))

    def check(self) -> None:
        """Raise a hazard found in a free the garbage collector made (see DeviceTimeline)."""
        self.timeline.check()

    def synchronize(self) -> None:
        with self._cond:
            pending = [job.event for job in self._jobs]
            for event in pending:
                self._demand(event)
            self._cond.notify_all()
        for event in pending:
            event._done.wait()
        for stream in [s for s in list(self.timeline._clocks) if s != "host"]:
            self.timeline.wait(self.timeline.clock([stream]), "host")  # the host saw it all done
        self.check()

    def close(self) -> None:
        """Finish the copies issued and stop the worker; raise a hazard found on the way."""
        try:
            self.synchronize()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._worker.join(timeout=5)

    # -- the worker ---------------------------------------------------------------------
    def _demand(self, event: EmulatedEvent) -> None:
        """Mark ``event`` (and what its copy waits for) as needed now."""
        stack = [event]
        while stack:
            e = stack.pop()
            if e.demanded or e.query():
                continue
            e.demanded = True
            if e.job is not None:
                stack.extend(e.job.after)

    def _pick(self) -> _Job | None:
        """Under the lock: a copy to run now (a demanded one first, else any ready one), or None."""
        ready = [job for job in self._jobs if job.ready()]
        demanded = [job for job in ready if job.event.demanded]
        if demanded:
            return demanded[0]
        if not ready or self.hold:
            return None
        return self._rng.choice(ready)

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._pick()
                while job is None:
                    if self._closed:
                        return
                    self._cond.wait(timeout=0.05)
                    job = self._pick()
                if not job.poisoned:
                    _poison(job.dst)
                    job.poisoned = True
            if not job.event.demanded and job.delay:
                time.sleep(job.delay)
            try:
                job.dst.copy_(job.src.reshape(job.dst.shape))
            except Exception as exc:  # handed to the reader that waits for it
                self.error = exc
            with self._cond:
                self._jobs.remove(job)
                if any(other.issued < job.issued for other in self._jobs):
                    self.out_of_order += 1
                self.completed += 1
                job.event.set()
                self._cond.notify_all()
