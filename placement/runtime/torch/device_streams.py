"""The streams and events the torch executors order their work with: one seam, so it can be emulated.

On a GPU every stage of a pipelined module queues its kernels on a CUDA stream of its
own, and every hand-over of a value between stages, or from a stage back to the caller,
is an event recorded on the producer's stream that the consumer's stream waits on, plus
``record_stream`` so the caching allocator does not reuse the value's memory while the
consumer's queued work may still read it. Which stream waits is the whole point: a
kernel runs on the current stream *of its tensors' device*, so a wait queued on another
device's stream orders nothing.

The executors (:mod:`.stage_exec`, :mod:`.pipelined`, :mod:`.one_f_one_b`) never call
``torch.cuda`` for this themselves; they call the functions here, which go to the
:class:`CudaStreams` backend. A test swaps in another backend (:func:`swapped`) that
emulates devices with streams and events on the CPU and checks each hand-over, so
ordering defects show without a GPU.

Example:
    >>> import torch
    >>> has_streams(torch.device("cpu")), tensor_device(torch.zeros(1)) is None
    (False, True)
    >>> type(backend()).__name__
    'CudaStreams'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "CudaStreams",
    "backend",
    "current_stream",
    "has_streams",
    "new_stream",
    "on_device",
    "on_stream",
    "record_event",
    "record_stream",
    "swapped",
    "tensor_device",
    "wait_event",
]


class CudaStreams:
    """The real thing: CUDA streams and events through ``torch.cuda`` (devices of type ``cuda``)."""

    def has_streams(self, device: torch.device) -> bool:
        """Whether work on ``device`` is queued on streams (else it runs when called)."""
        return device.type == "cuda"

    def tensor_device(self, tensor: torch.Tensor) -> torch.device | None:
        """The stream device ``tensor`` lives on; None for a tensor on a device without streams."""
        return tensor.device if tensor.is_cuda else None

    def current_stream(self, device: torch.device | None = None) -> Any:
        """This thread's current stream on ``device`` (None: the current device)."""
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def record_event(self, stream: Any) -> Any:
        """A new event recorded on ``stream`` (after the work queued there so far)."""
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream``'s later work wait for ``event`` (the host does not wait)."""
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor`` (its memory is not
        reused before ``stream``'s work queued so far has run)."""
        tensor.record_stream(stream)

    def on_device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """``device`` as the current device."""
        return torch.cuda.device(device)

    @contextlib.contextmanager
    def on_stream(self, device: torch.device, stream: Any) -> Iterator[None]:
        """``device`` as the current device and ``stream`` as its current stream."""
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield


_backend: Any = CudaStreams()


def backend() -> Any:
    """The backend in force (:class:`CudaStreams` unless a test swapped in another)."""
    return _backend


@contextlib.contextmanager
def swapped(replacement: Any) -> Iterator[Any]:
    """Use ``replacement`` (an object with :class:`CudaStreams`' methods) while the block runs;
    for emulators that check the executors' ordering without a GPU."""
    global _backend
    previous, _backend = _backend, replacement
    try:
        yield replacement
    finally:
        _backend = previous


def has_streams(device: torch.device) -> bool:
    """Whether work on ``device`` is queued on streams."""
    return _backend.has_streams(device)


def tensor_device(tensor: Any) -> torch.device | None:
    """The stream device a tensor lives on; None for anything else."""
    return _backend.tensor_device(tensor) if isinstance(tensor, torch.Tensor) else None


def current_stream(device: torch.device | None = None) -> Any:
    """This thread's current stream on ``device`` (None: the current device)."""
    return _backend.current_stream(device)


def new_stream(device: torch.device) -> Any:
    """A new stream on ``device``."""
    return _backend.new_stream(device)


def record_event(stream: Any) -> Any:
    """A new event recorded on ``stream``."""
    return _backend.record_event(stream)


def wait_event(stream: Any, event: Any) -> None:
    """``stream`` waits for ``event``."""
    _backend.wait_event(stream, event)


def record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """``tensor``'s memory is kept until ``stream``'s work queued so far has run."""
    _backend.record_stream(tensor, stream)


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` as the current device."""
    return _backend.on_device(device)


def on_stream(device: torch.device, stream: Any) -> contextlib.AbstractContextManager[Any]:
    """``device`` as the current device, ``stream`` its current stream."""
    return _backend.on_stream(device, stream)
