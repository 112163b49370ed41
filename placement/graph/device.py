"""Logical devices: ``Device("cuda", 1)``, parsed from ``1``, ``"cuda:1"`` or ``"cpu"``.

Passes talk about logical devices; runtimes map them to physical ones.

Example:
    >>> from placement.graph.device import Device
    >>> Device.parse(1)
    Device('cuda:1')
    >>> str(Device.parse("cpu")), Device.parse("cuda:0") < Device.parse("cuda:1")
    ('cpu', True)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Union

from placement.errors import DeviceError

__all__ = ["Device", "DeviceLike", "DEVICE_TYPES"]

#: Device types a logical device may have.
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True, order=True)
class Device:
    """A logical device: a type (``"cuda"`` or ``"cpu"``) and an index.

    Hashable and ordered (by type, then index); printed as ``cuda:1`` or ``cpu``.
    """

    type: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.type not in DEVICE_TYPES:
            raise DeviceError(f"unknown device type {self.type!r}; expected one of {', '.join(DEVICE_TYPES)}")
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise DeviceError(f"device index must be a non-negative int, got {self.index!r}")

    def __str__(self) -> str:
        if self.type == "cpu" and self.index == 0:
            return "cpu"
        return f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"Device({str(self)!r})"

    @property
    def is_cuda(self) -> bool:
        """True for CUDA devices."""
        return self.type == "cuda"

    @property
    def slug(self) -> str:
        """A name-safe spelling, ``cuda_1`` or ``cpu_0``, used in copy blob names."""
        return f"{self.type}_{self.index}"

    @staticmethod
    def parse(spec: DeviceLike) -> Device:
        """Parse ``1`` (GPU id, Caffe2 style), ``"cuda:1"``, ``"cuda"``, ``"cpu"``,
        a ``torch.device`` or a ``Device``.

        Raises:
            DeviceError: the spec is malformed; the message quotes it.
        """
        if isinstance(spec, Device):
            return spec
        if isinstance(spec, bool):
            raise DeviceError(f"not a device: {spec!r}")
        if isinstance(spec, int):
            return _parse_int(spec)
        if isinstance(spec, str):
            return _parse_str(spec)
        if type(spec).__name__ == "device" and hasattr(spec, "type"):  # torch.device
            return Device(spec.type, 0 if spec.index is None else spec.index)
        raise DeviceError(f"not a device: {spec!r} (use an int GPU id, 'cuda:N' or 'cpu')")


DeviceLike = Union[Device, int, str, Any]


@functools.lru_cache(maxsize=1024)
def _parse_int(spec: int) -> Device:
    if spec < 0:
        raise DeviceError(f"GPU id must be non-negative, got {spec}")
    return Device("cuda", spec)


@functools.lru_cache(maxsize=1024)
def _parse_str(spec: str) -> Device:
    text = spec.strip().lower()
    if text.isdigit():
        return Device("cuda", int(text))
    kind, sep, index = text.partition(":")
    if kind == "gpu":
        kind = "cuda"
    if kind not in DEVICE_TYPES:
        raise DeviceError(f"bad device string {spec!r}: use 'cuda:N', 'cpu' or a GPU id")
    if not sep:
        return Device(kind, 0)
    if not index.isdigit():
        raise DeviceError(f"bad device string {spec!r}: the index must be a non-negative int")
    return Device(kind, int(index))
