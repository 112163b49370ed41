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
import operator
import re
from dataclasses import dataclass
from typing import Any, Union

from placement.errors import DeviceError

__all__ = ["Device", "DeviceLike", "DEVICE_TYPES", "MAX_DEVICE_INDEX"]

#: Device types a logical device may have.
DEVICE_TYPES = ("cpu", "cuda")
#: The largest device index accepted (an absurd index is a typo, not a device).
MAX_DEVICE_INDEX = 65535
#: The one spelling of a device string: a type (``gpu`` is an alias of ``cuda``,
#: case is ignored) and an optional ASCII index without leading zeros.
_DEVICE_RE = re.compile(r"(cuda|gpu|cpu)(?::(0|[1-9][0-9]*))?|(0|[1-9][0-9]*)", re.ASCII | re.IGNORECASE)


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
        if self.index > MAX_DEVICE_INDEX:
            raise DeviceError(f"device index {self.index} is out of range (at most {MAX_DEVICE_INDEX})")

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

        Strings are parsed strictly: ``cuda``, ``cpu`` or ``gpu`` (an alias of
        ``cuda``; case is ignored), then optionally ``:`` and an ASCII index
        without leading zeros (``"cuda:01"``, full-width digits, spaces and
        ``"cuda:1:2"`` are errors), or a bare GPU id such as ``"2"``. Indices
        above :data:`MAX_DEVICE_INDEX` are refused.

        Raises:
            DeviceError: the spec is malformed; the message quotes it.
        """
        if isinstance(spec, Device):
            return spec
        if isinstance(spec, bool):
            raise DeviceError(f"not a device: {spec!r}")
        if isinstance(spec, int):
            return _parse_int(spec)
        if hasattr(spec, "__index__") and not isinstance(spec, float):  # numpy integers
            return _parse_int(operator.index(spec))
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
    if spec > MAX_DEVICE_INDEX:
        raise DeviceError(f"GPU id {spec} is out of range (at most {MAX_DEVICE_INDEX})")
    return Device("cuda", spec)


@functools.lru_cache(maxsize=1024)
def _parse_str(spec: str) -> Device:
    match = _DEVICE_RE.fullmatch(spec)
    if match is None:
        raise DeviceError(
            f"bad device string {spec!r}: use 'cuda:N', 'cpu' or a GPU id "
            "(N a plain decimal index without leading zeros)"
        )
    kind, index, bare = match.groups()
    if bare is not None:
        return _parse_int(int(bare))
    kind = "cuda" if kind.lower() in ("cuda", "gpu") else "cpu"
    number = int(index) if index is not None else 0
    if number > MAX_DEVICE_INDEX:
        raise DeviceError(f"bad device string {spec!r}: index out of range (at most {MAX_DEVICE_INDEX})")
    return Device(kind, number)
