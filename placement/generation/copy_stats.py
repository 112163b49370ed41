"""What crossed devices during decoding: :class:`CopyStats`, the counter an ONNX Runtime decoder
(:mod:`placement.generation.ort_decoder`) keeps of its transfers between devices.

Example:
    >>> import numpy as np
    >>> stats = CopyStats()
    >>> stats.add("hidden", np.zeros((1, 4), np.float32))
    >>> stats.transfers, stats.bytes, sorted(stats.names)
    (1, 16, ['hidden'])
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import onnxruntime as ort
from onnxruntime.capi import _pybind_state as _C

__all__ = ["CopyStats"]


@dataclass
class CopyStats:
    """What crossed devices: transfers run and their bytes, since the last :meth:`reset`.
    Pipelined generation counts from several worker threads, under one lock."""

    transfers: int = 0
    bytes: int = 0
    largest: int = 0
    names: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, value: Any) -> None:
        """Count one transfer of ``value`` (an ``OrtValue``, native or not, or an array) as ``name``."""
        size = _nbytes(value)
        with self._lock:
            self.transfers += 1
            self.bytes += size
            if size > self.largest:
                self.largest = size
            self.names.add(name)

    def add_all(self, names: frozenset[str], values: list[Any]) -> None:
        """Count one transfer of each of ``values``, named ``names`` (a decode step's aliases
        between emulated devices, counted at once)."""
        sizes = [v.tensor_size_in_bytes() if type(v) is _C.OrtValue else _nbytes(v) for v in values]
        with self._lock:
            self.transfers += len(sizes)
            self.bytes += sum(sizes)
            self.largest = max(self.largest, *sizes)
            self.names |= names

    def reset(self) -> None:
        with self._lock:
            self.transfers = self.bytes = self.largest = 0
            self.names = set()


def _nbytes(value: Any) -> int:
    """Bytes of ``value``: an ``OrtValue`` (native or not) or an array."""
    if type(value) is _C.OrtValue:
        return int(value.tensor_size_in_bytes())
    if isinstance(value, ort.OrtValue):
        return int(value._ortvalue.tensor_size_in_bytes())
    return int(getattr(value, "nbytes", 0))
