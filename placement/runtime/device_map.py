"""Device maps: send the logical devices of a placed model to physical devices.

Passes talk about logical devices (``cuda:0``, ``cuda:1``, ...). At run time a
*device map* says where each one really runs. Both runtimes (ONNX Runtime and the
torch lowering) resolve their ``device_map`` argument here, so they agree.

Accepted forms of ``device_map``:

* ``"auto"`` (default): logical ``cuda:k`` runs on physical ``cuda:k`` when that
  GPU exists. With fewer GPUs than the model's logical GPUs, the logical GPUs
  share the GPUs there are, in order, in contiguous runs (4 logical GPUs on 2
  GPUs: ``cuda:0, cuda:0, cuda:1, cuda:1``; on one GPU all on ``cuda:0``, so
  neighbouring pipeline stages share a GPU), announced once per process on
  stderr (``logging.warning``). Only with no GPU at all is *every* logical device
  emulated on the CPU (each keeps its own execution context in the runtimes, so
  copies and stage boundaries are exercised as on GPUs: the ONNX Runtime executor
  does not fold them into one session), announced the same way.
  Logical ``cpu`` always runs on the CPU.
* a single device, e.g. ``"cpu"`` or ``"cuda:0"``: every logical device on it (the
  ONNX Runtime executor runs logical devices sharing a physical device as one session,
  see :mod:`placement.runtime.ort.fold`).
* a dict logical -> physical, e.g. ``{0: "cuda:0", 1: "cuda:0"}`` (two logical
  devices sharing one GPU) or ``{"cuda:1": "cpu"}``. Keys and values are
  anything :meth:`placement.Device.parse` accepts (ints are GPU ids). Every
  logical device of the model must be mapped; keys that are not devices of the
  model are errors.

Example:
    >>> from placement import Device
    >>> from placement.runtime.device_map import resolve_device_map
    >>> dmap = resolve_device_map([Device("cuda", 0), Device("cuda", 1)], "cpu")
    >>> {str(k): str(v) for k, v in dmap.items()}
    {'cuda:0': 'cpu', 'cuda:1': 'cpu'}
    >>> dmap[Device("cuda", 1)].emulated
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

from placement.errors import DeviceError
from placement.graph.device import Device, DeviceLike
from placement.runtime.names import check_names

__all__ = [
    "command_line_spelling",
    "device_map_option",
    "PhysicalDevice",
    "DeviceMapLike",
    "resolve_device_map",
    "cuda_device_count",
    "is_auto",
]

_COMMAND_LINE: contextvars.ContextVar[bool] = contextvars.ContextVar("placement_command_line", default=False)


@contextlib.contextmanager
def command_line_spelling() -> Iterator[None]:
    """Within it, messages name the device map as the command line spells it (``--device-map cpu``)."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def device_map_option(value: str | None = None) -> str:
    """How a message tells the user to pass a device map: ``device_map='cpu'`` in Python,
    ``--device-map cpu`` on the command line (:func:`command_line_spelling`); without a value,
    the option's name alone.

    Example:
        >>> device_map_option("cpu")
        "device_map='cpu'"
        >>> with command_line_spelling():
        ...     device_map_option("cpu")
        '--device-map cpu'
    """
    if _COMMAND_LINE.get():
        return "--device-map" + (f" {value}" if value else "")
    return "device_map=" + (repr(value) if value else "")

log = logging.getLogger(__name__)

#: What a runtime's ``device_map`` argument accepts.
DeviceMapLike = Union[str, DeviceLike, Mapping[Any, Any], None]

_warned_emulation = False
_warned_sharing = False


@dataclass(frozen=True)
class PhysicalDevice:
    """A real device a logical device runs on.

    Attributes:
        type: ``"cuda"`` or ``"cpu"``.
        index: the GPU id (0 for the CPU).
        emulated: True when a logical CUDA device is emulated on the CPU.
    """

    type: str
    index: int = 0
    emulated: bool = False

    def __str__(self) -> str:
        return "cpu" if self.type == "cpu" else f"{self.type}:{self.index}"

    @property
    def is_cuda(self) -> bool:
        """True for a real GPU."""
        return self.type == "cuda"

    @property
    def torch_device(self) -> Any:
        """The ``torch.device`` (``cuda:k`` or ``cpu``)."""
        import torch

        return torch.device(str(self))

    @property
    def ort_provider(self) -> tuple[str, dict[str, Any]]:
        """``(provider name, provider options)`` for an ONNX Runtime session."""
        if self.is_cuda:
            return "CUDAExecutionProvider", {"device_id": self.index}
        return "CPUExecutionProvider", {}


def cuda_device_count(runtime: str = "torch") -> int:
    """How many GPUs ``runtime`` (``"torch"`` or ``"ort"``) can use.

    ONNX Runtime lists its CUDA provider whenever it was built with it, GPU or
    not, so for ``"ort"`` the provider must be listed *and* torch must see GPUs.
    """
    try:
        import torch

        count = int(torch.cuda.device_count())
    except Exception:  # no torch, or a broken CUDA install
        count = 0
    if runtime == "ort" and count:
        try:
            import onnxruntime as ort

            if "CUDAExecutionProvider" not in ort.get_available_providers():
                count = 0
        except Exception:
            count = 0
    return count


def is_auto(device_map: DeviceMapLike) -> bool:
    """Whether ``device_map`` asks for the ``"auto"`` map (``"auto"`` or None).

    Example:
        >>> is_auto("auto"), is_auto(None), is_auto("cpu")
        (True, True, False)
    """
    return device_map is None or (isinstance(device_map, str) and device_map.strip().lower() == "auto")


def resolve_device_map(
    model_devices: Iterable[DeviceLike],
    device_map: DeviceMapLike = "auto",
    *,
    runtime: str = "torch",
) -> dict[Device, PhysicalDevice]:
    """Resolve ``device_map`` for the logical devices ``model_devices``.

    Args:
        model_devices: the model's logical devices (e.g. ``model.devices``).
        device_map: ``"auto"``, a single device, or a dict logical -> physical
            (see the module docstring). ``None`` means ``"auto"``.
        runtime: ``"torch"`` or ``"ort"``; decides how GPU availability is checked.

    Returns:
        A dict from every logical device to its :class:`PhysicalDevice`.

    Raises:
        DeviceError: a dict key is not a device of the model, a logical device is
            not mapped, a spec is malformed, or a requested GPU does not exist
            (the message names them).

    Example:
        >>> from placement import Device
        >>> dmap = resolve_device_map([Device("cuda", 0), Device("cuda", 1)], {0: "cpu", 1: "cpu"})
        >>> sorted(str(v) for v in dmap.values())
        ['cpu', 'cpu']
    """
    logical = sorted({Device.parse(d) for d in model_devices})
    n_gpus = cuda_device_count(runtime)
    if is_auto(device_map):
        return _auto(logical, n_gpus)
    if isinstance(device_map, Mapping):
        pairs = _parse_mapping(device_map)
        check_names(
            sorted(pairs),
            logical,
            error=DeviceError,
            unknown="device_map names logical devices the model does not use: {names} "
            "(model devices: {expected})",
            missing="device_map does not map logical devices {names}; "
            "map every device of the model (or use 'auto' / a single device)",
            show=str,
        )
        physical = pairs
    else:
        try:
            target = Device.parse(device_map)
        except DeviceError as err:
            raise DeviceError(
                f"bad device_map {device_map!r}: use 'auto', a device such as 'cpu' or "
                f"'cuda:0', or a dict logical -> physical ({err})"
            ) from None
        physical = {d: target for d in logical}
    unavailable = sorted({p for p in physical.values() if p.is_cuda and p.index >= n_gpus})
    if unavailable:
        raise DeviceError(
            f"physical device(s) {', '.join(map(str, unavailable))} not available to {runtime} "
            f"({n_gpus} GPU(s) found); map them to 'cpu' or use {device_map_option('auto')}"
        )
    return {d: _physical(d, p) for d, p in physical.items()}


def _auto(logical: list[Device], n_gpus: int) -> dict[Device, PhysicalDevice]:
    cuda = [d for d in logical if d.is_cuda]
    if all(d.index < n_gpus for d in cuda):
        return {d: PhysicalDevice(d.type, d.index if d.is_cuda else 0) for d in logical}
    if n_gpus:
        return _shared(logical, cuda, n_gpus)
    global _warned_emulation
    if not _warned_emulation:
        _warned_emulation = True
        log.warning(
            "placement: EMULATING logical devices %s on the CPU (%d GPU(s) available), each in its "
            "own session so that stage boundaries are exercised as on GPUs; outputs are exact but "
            "timings are not GPU timings. Pass %s to run them as one session, or %s to choose.",
            ", ".join(map(str, cuda)),
            n_gpus,
            device_map_option("cpu"),
            device_map_option(),
        )
    return {d: PhysicalDevice("cpu", 0, emulated=d.is_cuda) for d in logical}


def _shared(logical: list[Device], cuda: list[Device], n_gpus: int) -> dict[Device, PhysicalDevice]:
    """More logical GPUs than GPUs: the logical GPUs in index order, in contiguous runs of
    (nearly) equal length, one run per GPU."""
    target = {d: PhysicalDevice("cuda", n * n_gpus // len(cuda)) for n, d in enumerate(cuda)}
    global _warned_sharing
    if not _warned_sharing:
        _warned_sharing = True
        log.warning(
            "placement: %d logical GPU(s) on %d GPU(s), sharing: %s. Pass %s to choose.",
            len(cuda),
            n_gpus,
            ", ".join(f"{d} -> {p}" for d, p in target.items()),
            device_map_option(),
        )
    return {d: target.get(d, PhysicalDevice("cpu", 0)) for d in logical}


def _parse_mapping(device_map: Mapping[Any, Any]) -> dict[Device, Device]:
    pairs: dict[Device, Device] = {}
    for key, value in device_map.items():
        try:
            src, dst = Device.parse(key), Device.parse(value)
        except DeviceError as err:
            raise DeviceError(f"bad device_map entry {key!r}: {value!r} ({err})") from None
        pairs[src] = dst
    return pairs


def _physical(logical: Device, target: Device) -> PhysicalDevice:
    if target.is_cuda:
        return PhysicalDevice("cuda", target.index)
    return PhysicalDevice("cpu", 0, emulated=logical.is_cuda)
