"""Devices with streams and events, emulated on the CPU, that see the ordering a GPU needs.

:class:`StreamEmulator` replaces the CUDA backend of
:mod:`placement.runtime.torch.device_streams` (the one seam through which the torch
executors queue work on streams, record and wait on events, and call ``record_stream``).
Tensors stay CPU tensors; a dispatch mode follows every kernel and gives each tensor a
*tag*: the emulated device and stream that made it, and its position in that stream's
queue. Streams carry vector clocks (how far each other stream's queue is known to have
run), events copy the clock of their stream when recorded, and a wait merges an event's
clock into the waiting stream's. So a kernel that reads a tensor made on another stream
whose work its own stream has not waited for is a race the emulator reports, as is a
tensor read on a stream its maker never told the caching allocator about
(``record_stream``), whose memory the allocator could hand out again while that read is
still queued.

Where kernels run is modelled as CUDA places them:

- a kernel runs on the current stream *of its tensors' device*, not of the current device;
  ops with no device tensor and outside a stage are host work (untracked);
- inside a stage (``on_stream``/``on_device`` entered) kernels run on the stage's device; a
  tensor from another device is first copied by a cross-device copy, which runs on the
  source device's current stream after a two-way barrier with the destination's current
  stream (what ``Tensor.to`` does between GPUs);
- each device has one default stream, every thread's current stream until it picks another.

Tests give a pipelined module's stages emulated devices (:func:`emulate_devices`:
``torch.device("cuda", k)`` objects, never used for real allocation), run it inside the
emulator and call :meth:`StreamEmulator.check`; :attr:`StreamEmulator.log` records each
hand-over (which stream waited on which event, on which device) for tests that assert on
them.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from placement.runtime.torch import device_streams


class Stream:
    """An emulated stream: a queue on ``device`` whose position is ``clock[self]``."""

    _ids = itertools.count()

    def __init__(self, device: torch.device, name: str) -> None:
        self.device = device
        self.name = f"{name}@{device}"
        self.id = next(self._ids)
        self.clock: dict[Stream, int] = {self: 0}

    def tick(self) -> int:
        self.clock[self] += 1
        return self.clock[self]

    def merge(self, clock: dict[Stream, int]) -> None:
        for stream, seq in clock.items():
            if self.clock.get(stream, 0) < seq:
                self.clock[stream] = seq

    def __repr__(self) -> str:
        return self.name

    def __hash__(self) -> int:
        return self.id


@dataclass(eq=False)
class Event:
    """An event recorded on ``stream``: the clock that stream had then."""

    stream: Stream
    clock: dict[Stream, int]


@dataclass(eq=False)
class Tag:
    """Where a tensor (and the views of it) was made: ``stream``, at queue position ``seq``."""

    stream: Stream
    seq: int
    op: str
    readers: set[Stream] = field(default_factory=set)
    recorded: set[Stream] = field(default_factory=set)

    @property
    def device(self) -> torch.device:
        return self.stream.device


class _Tracker(TorchDispatchMode):
    def __init__(self, emulator: StreamEmulator) -> None:
        super().__init__()
        self.emulator = emulator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.emulator._kernel(func, args, kwargs or {}, out)
        return out


class StreamEmulator:
    """The emulated backend (see the module docstring); use as a context manager."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.defaults: dict[torch.device, Stream] = {}
        self.tls = threading.local()
        self.tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.all_tags: list[Tag] = []
        self.hazards: list[str] = []
        #: ("wait", stream, event) / ("record", event, stream) / ("record_stream", tag, stream)
        self.log: list[tuple[str, Any, Any]] = []
        self.streams = itertools.count()

    # --- the backend (placement.runtime.torch.device_streams.CudaStreams' methods) ---------

    def has_streams(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def tensor_device(self, tensor: torch.Tensor) -> torch.device | None:
        tag = self.tags.get(tensor)
        return tag.device if tag is not None else None

    def current_stream(self, device: torch.device | None = None) -> Stream:
        device = self._current_device() if device is None else _norm(device)
        current = self._tls("current", dict)
        return current.get(device) or self.default_stream(device)

    def default_stream(self, device: torch.device) -> Stream:
        device = _norm(device)
        with self.lock:
            if device not in self.defaults:
                self.defaults[device] = Stream(device, "default")
            return self.defaults[device]

    def new_stream(self, device: torch.device) -> Stream:
        return Stream(_norm(device), f"stream{next(self.streams)}")

    def record_event(self, stream: Stream) -> Event:
        with self.lock:
            event = Event(stream, dict(stream.clock))
            self.log.append(("record", event, stream))
            return event

    def wait_event(self, stream: Stream, event: Event) -> None:
        with self.lock:
            stream.merge(event.clock)
            self.log.append(("wait", stream, event))

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        with self.lock:
            tag = self.tags.get(tensor)
            if tag is None:
                self.hazards.append(f"record_stream on {stream} of a tensor on no emulated device")
                return
            if stream.device != tag.device:
                self.hazards.append(
                    f"record_stream of a tensor on {tag.device} with a stream of {stream.device}"
                )
            tag.recorded.add(stream)
            self.log.append(("record_stream", tag, stream))

    @contextlib.contextmanager
    def on_device(self, device: torch.device) -> Iterator[None]:
        with self._within(_norm(device), None):
            yield

    @contextlib.contextmanager
    def on_stream(self, device: torch.device, stream: Stream) -> Iterator[None]:
        with self._within(_norm(device), stream):
            yield

    # --- for tests --------------------------------------------------------------------------

    def place(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Say ``tensor`` lives on ``device``, made by the caller's current stream there."""
        with self.lock:
            stream = self.current_stream(device)
            self._tag(tensor, Tag(stream, stream.tick(), "place"))
        return tensor

    def waits(self, device: torch.device | None = None) -> list[tuple[Stream, Event]]:
        """(waiting stream, event) of every wait, those of streams on ``device`` when given."""
        return [
            (s, e) for kind, s, e in self.log if kind == "wait" and (device is None or s.device == device)
        ]

    def check(self) -> None:
        """Raise AssertionError naming every race seen and every tensor read on a stream that
        neither made it nor was recorded on it."""
        problems = list(self.hazards)
        for tag in self.all_tags:
            for reader in tag.readers - tag.recorded - {tag.stream}:
                problems.append(
                    f"{tag.op} made on {tag.stream} is read on {reader} without record_stream"
                    " (its memory may be reused while that read is queued)"
                )
        assert not problems, "stream hazards:\n" + "\n".join(sorted(set(problems)))

    def __enter__(self) -> StreamEmulator:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(device_streams.swapped(self))
        self._stack.enter_context(self._tracking())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    # --- internals --------------------------------------------------------------------------

    def _tls(self, name: str, default: Any) -> Any:
        value = getattr(self.tls, name, None)
        if value is None:
            value = default()
            setattr(self.tls, name, value)
        return value

    def _current_device(self) -> torch.device:
        return getattr(self.tls, "device", None) or torch.device("cuda", 0)

    @contextlib.contextmanager
    def _tracking(self) -> Iterator[None]:
        depth = getattr(self.tls, "depth", 0)
        if depth:
            self.tls.depth = depth + 1
            try:
                yield
            finally:
                self.tls.depth = depth
            return
        self.tls.depth = 1
        try:
            with _Tracker(self):
                yield
        finally:
            self.tls.depth = 0

    @contextlib.contextmanager
    def _within(self, device: torch.device, stream: Stream | None) -> Iterator[None]:
        current = self._tls("current", dict)
        saved = (getattr(self.tls, "device", None), getattr(self.tls, "stage", None), current.get(device))
        self.tls.device, self.tls.stage = device, device
        if stream is not None:
            current[device] = stream
        try:
            with self._tracking():
                yield
        finally:
            self.tls.device, self.tls.stage = saved[0], saved[1]
            if saved[2] is None:
                current.pop(device, None)
            else:
                current[device] = saved[2]

    def _tag(self, tensor: torch.Tensor, tag: Tag) -> None:
        self.tags[tensor] = tag
        self.all_tags.append(tag)

    def _kernel(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        returns = func._schema.returns
        writes = any(r.alias_info is not None and r.alias_info.is_write for r in returns)
        views = not writes and any(r.alias_info is not None for r in returns)
        with self.lock:
            tags = [self.tags.get(t) for t in inputs]
            if views:  # no kernel: the view shares its base's memory and maker
                if tags and tags[0] is not None:
                    for t in outputs:
                        self.tags[t] = tags[0]
                return
            stage = getattr(self.tls, "stage", None)
            device = stage or next((t.device for t in tags if t is not None), None)
            if device is None:
                return  # host work
            stream = self.current_stream(device)
            for tag in {id(t): t for t in tags if t is not None}.values():
                self._read(func, tag, stream)
            seq = stream.tick()
            if writes and inputs and tags[0] is not None:
                tags[0].stream, tags[0].seq, tags[0].op = stream, seq, str(func)
                tags[0].recorded.clear()
                tags[0].readers.clear()
            for t in outputs:
                if t is not (inputs[0] if writes and inputs else None):
                    self._tag(t, Tag(stream, seq, str(func)))

    def _read(self, func: Any, tag: Tag, stream: Stream) -> None:
        reader = stream
        if tag.device != stream.device:  # a cross-device copy first, on the source's current stream
            reader = self.current_stream(tag.device)
            reader.merge(stream.clock)
        if reader is not tag.stream and reader.clock.get(tag.stream, 0) < tag.seq:
            self.hazards.append(
                f"{func} on {reader} reads {tag.op} made on {tag.stream} (queue position {tag.seq})"
                f" before any wait for it (that stream is known to have run to"
                f" {reader.clock.get(tag.stream, 0)})"
            )
        tag.readers.add(reader)
        if reader is not stream:
            reader.tick()
            stream.merge(reader.clock)


def _norm(device: torch.device) -> torch.device:
    device = torch.device(device)
    return device if device.index is not None else torch.device(device.type, 0)


def emulate_devices(module: Any, devices: Sequence[torch.device | str]) -> None:
    """Give the stages of the pipelined ``module`` (built for the CPU) the emulated ``devices``,
    one per stage in order; they run their kernels on the CPU, queued on emulated streams."""
    stages = module._pl_stages
    assert len(stages) == len(devices), f"{len(stages)} stages, {len(devices)} devices"
    module.trace_stages = False  # the emulator follows eager kernels
    for stage, device in zip(stages, devices):
        stage.device = torch.device(device)
        stage.stream = None
