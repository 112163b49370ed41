"""Streamed weights in the torch lowering: host-resident parameters copied to the GPU every forward.

A ``streamed`` copy (see :func:`placement.stream_parameters`) lowers to a call of the
module's :class:`WeightStreamer` (``self.weight_streamer(h_3_mlp_c_fc_weight, index=7)``)
instead of a plain ``.to``. On a GPU the streamer

* keeps the parameters in pinned host memory (``pin_memory()``, done when the module
  is built and CUDA is available), so copies run at the link's full rate and asynchronously;
* copies on a dedicated side stream per device (``torch.cuda.Stream``) with
  ``non_blocking=True``, and records an event after each copy; the compute stream
  ``wait_event``\\ s it only when the weight is used, and the weight is
  ``record_stream``\\ ed on the compute stream so the caching allocator reuses its block
  (the device buffers of the window) only once the compute that reads it is done;
* prefetches: handing out weight ``k`` starts the copies of weights ``k+1, k+2, ...``
  (in first-use order, wrapping round to the first ones for the next forward) while
  the bytes copied ahead stay within the prefetch window (``placement.stream_window``;
  unset: room for the largest weight, double-buffering), so the copy of the next
  streamed layer overlaps the compute of the current one. A weight prefetched under
  ``torch.no_grad`` is copied again when it is used with autograd on.

On the CPU (and in CPU emulation of GPUs) the copy is ``.to(device)``, a no-op when
the parameter is already there; the window bookkeeping runs the same way. Autograd
flows through the copies (``.to`` is differentiable), so a streamed parameter's
gradient lands on the host.

Overlap is measurable: with ``streamer.timing = True`` every copy records CUDA
events on the copy stream; :meth:`WeightStreamer.copy_seconds` sums them.

Example:
    >>> import torch
    >>> streamer = WeightStreamer([("cpu", 64), ("cpu", 64)], window=64)
    >>> w, v = torch.ones(4, 4), torch.zeros(4, 4)
    >>> streamer.bind([w, v])
    >>> streamer(w, index=0) is w, streamer.prefetched, streamer(v, index=1) is v
    (True, 1, True)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["WeightStreamer", "STREAMER_NAME"]

log = logging.getLogger(__name__)

#: The attribute of a lowered module holding its streamer.
STREAMER_NAME = "weight_streamer"


class WeightStreamer(torch.nn.Module):
    """Copies streamed parameters to their device in first-use order, prefetching within a window.

    Args:
        order: per streamed copy, in the order the forward reads them: ``(destination
            device, bytes)``.
        window: bytes of device memory for weights copied ahead of their use; ``None``:
            room for the largest weight (double-buffering: the next weight is copied while
            the current one is used).

    The sources are bound after the module is built (:meth:`bind`): the parameter of
    each copy, held in a plain list (not registered again: ``copy.deepcopy`` of the
    module maps them to the copy's own parameters; ``load_state_dict`` and pinning
    change their ``.data`` in place and are seen).
    """

    def __init__(self, order: Sequence[tuple[str, int]], *, window: int | None = None) -> None:
        super().__init__()
        self.devices = [torch.device(device) for device, _ in order]
        self.sizes = [int(size) for _, size in order]
        self._window = int(window) if window is not None else None
        self.timing = False
        self._sources: list[torch.Tensor] = []
        self._pending: dict[int, tuple[torch.Tensor, Any]] = {}  # index -> (copy, ready event)
        self._in_flight = 0  # bytes copied ahead and not yet handed out
        self._streams: dict[torch.device, Any] = {}
        self._events: list[tuple[Any, Any]] = []  # (start, end) per timed copy
        self._lock = threading.Lock()
        self.prefetched = 0  # copies made ahead of their use (since the last reset_stats)
        self.copies = 0  # copies made (since the last reset_stats)

    def add(self, device: str, size: int) -> int:
        """Append a copy to ``device`` of ``size`` bytes; its index."""
        self.devices.append(torch.device(device))
        self.sizes.append(int(size))
        return len(self.sizes) - 1

    def bind(self, sources: Sequence[torch.Tensor]) -> None:
        """Set each copy's source parameter (one per copy, in order)."""
        if len(sources) != len(self.sizes):
            raise ValueError(f"need {len(self.sizes)} sources, got {len(sources)}")
        self._sources = list(sources)

    @property
    def window(self) -> int:
        """Bytes that may be copied ahead (unset: the largest weight, i.e. double-buffering)."""
        return self._window if self._window is not None else max(self.sizes, default=0)

    def extra_repr(self) -> str:
        return f"copies={len(self.sizes)}, bytes={sum(self.sizes)}, window={self.window}"

    def forward(self, weight: torch.Tensor, index: int) -> torch.Tensor:
        """Weight ``index`` on its device (waited for on the current stream), then prefetch ahead."""
        with self._lock:
            hit = self._pending.pop(index, None)
            if hit is not None:
                self._in_flight -= self.sizes[index]
                if hit[0].grad_fn is None and weight.requires_grad and torch.is_grad_enabled():
                    hit = None  # prefetched without autograd (an earlier no_grad call): copy again
            if hit is None:
                tensor, event = self._copy(weight, index)
            else:
                tensor, event = hit
            self._prefetch(index + 1)
        if event is not None:
            current = torch.cuda.current_stream(self.devices[index])
            current.wait_event(event)
            tensor.record_stream(current)
        return tensor

    def reset_stats(self) -> None:
        """Forget the counters and timed events."""
        with self._lock:
            self.prefetched = self.copies = 0
            self._events.clear()

    def copy_seconds(self) -> float:
        """Seconds the timed copies took on their copy streams (synchronises; needs ``timing``)."""
        total = 0.0
        for start, end in self._events:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total

    def drop_prefetched(self) -> None:
        """Release the weights copied ahead (e.g. after a forward that stopped early)."""
        with self._lock:
            self._pending.clear()
            self._in_flight = 0

    # -- internals --------------------------------------------------------------------------

    def _prefetch(self, start: int) -> None:
        """Copy weights ``start, start+1, ...`` ahead while they fit the window; past the last
        weight, the first ones again (for the next forward: serving loops run back to back)."""
        if not self._sources:
            return
        n = len(self.sizes)
        for step in range(n - 1):
            index = (start + step) % n
            if index in self._pending:
                continue
            if self._in_flight + self.sizes[index] > self.window:
                break
            tensor, event = self._copy(self._sources[index], index)
            self._pending[index] = (tensor, event)
            self._in_flight += self.sizes[index]
            self.prefetched += 1

    def _copy(self, weight: torch.Tensor, index: int) -> tuple[torch.Tensor, Any]:
        """Start copying ``weight`` to its device: on the copy stream on a GPU (with its event)."""
        device = self.devices[index]
        self.copies += 1
        if device.type != "cuda" or weight.device == device:
            return weight.to(device, non_blocking=True), None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        if weight.device.type == "cuda":  # a source made on a GPU: copy it once that work is done
            stream.wait_stream(torch.cuda.current_stream(weight.device))
        # (host parameters need no wait: nothing queued on a GPU writes them, so the copy
        # starts at once and overlaps the compute queued before it)
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True) if self.timing else None
            if start is not None:
                start.record(stream)
            tensor = weight.to(device, non_blocking=True)
            event = torch.cuda.Event(enable_timing=self.timing)
            event.record(stream)
            if start is not None:
                self._events.append((start, event))
        return tensor, event


def pin_streamed(module: torch.nn.Module, paths: Sequence[str]) -> int:
    """Pin the host memory of the parameters at ``paths`` (when CUDA is available); bytes pinned."""
    if not torch.cuda.is_available():
        return 0
    pinned = 0
    for path in paths:
        param = module.get_parameter(path) if "." in path or hasattr(module, path) else None
        if param is None or param.device.type != "cpu" or param.is_pinned():
            continue
        param.data = param.data.pin_memory()
        pinned += param.numel() * param.element_size()
    log.info("pinned %d bytes of streamed parameters", pinned)
    return pinned
