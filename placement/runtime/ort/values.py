"""Values of the ONNX Runtime executor: where an ``OrtValue`` lives, how it moves, how it is handed out.

:func:`transfer_kind` says how a blob moves between two physical devices (share, host copy,
host <-> GPU, GPU -> GPU) and :func:`move` moves it; :func:`place` puts a graph input on its
device; :func:`to_output` and :func:`host_array` hand outputs back owning their memory. Every copy of
a tensor through host memory is counted in :data:`HOST_COPIES`.

Example:
    >>> import numpy as np
    >>> from placement.runtime.device_map import PhysicalDevice
    >>> value = place(np.ones(3, np.float32), PhysicalDevice("cpu"))
    >>> host_array(value).tolist()
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as _C

from placement.errors import PlacementError
from placement.runtime.device_map import PhysicalDevice

__all__ = [
    "ALIAS",
    "GPU_TO_GPU",
    "HOST_COPIES",
    "OUTPUT_KINDS",
    "TO_GPU",
    "TO_HOST",
    "HostCopies",
    "move",
    "ortvalue",
    "place",
    "host_array",
    "to_output",
    "transfer_kind",
    "value_device",
]

log = logging.getLogger(__name__)

#: The host device of native ``OrtValue`` s (:class:`NativeRun`).
_CPU = _C.OrtDevice(_C.OrtDevice.cpu(), _C.OrtDevice.default_memory(), 0)

#: How a blob moves between two physical devices (see :func:`transfer_kind`).
ALIAS, TO_GPU, TO_HOST, GPU_TO_GPU = "alias", "h2d", "d2h", "d2d"
_warned_d2d_fallback = False

#: What :meth:`Program.collect` (and ``Runner.run(outputs=...)``) hands back: host numpy arrays
#: (the default), torch tensors on the outputs' devices (DLPack, no copy), or ``OrtValue`` s.
OUTPUT_KINDS = ("numpy", "torch", "ortvalue")


class HostCopies:
    """A process-wide count of tensor copies through host memory (see the module docstring).

    Example:
        >>> before = HOST_COPIES.count
        >>> HOST_COPIES.add()
        >>> HOST_COPIES.count - before
        1
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self, n: int = 1) -> None:
        """Count ``n`` more copies."""
        with self._lock:
            self.count += n


#: The count of host copies made by runs in this process.
HOST_COPIES = HostCopies()


def transfer_kind(src: PhysicalDevice, dst: PhysicalDevice, *, same_logical: bool) -> str:
    """How a blob moves between two physical devices.

    Values move only between different memories: two logical devices on one real
    device share them (``"alias"``), and so do logical devices emulated on the CPU,
    which all live in host memory; otherwise ``"h2d"``, ``"d2h"`` or ``"d2d"``.
    Sharing is safe: ONNX Runtime never writes into a value it is fed, a run's
    outputs are freshly allocated, and nothing else here writes into a value.
    The torch lowering behaves the same way: ``tensor.to`` the
    device a tensor is already on returns it as is.

    Emulated devices used to copy, to "pay what a real GPU pair pays"; but a host
    memcpy costs nothing like an NVLink or PCIe transfer, so the copy only added
    work this machine does not need (0.2 ms, 1% of bench ResNet, per 1 MiB blob).
    The planner charges transfers through its link model (:mod:`placement.planning.link_model`),
    independently of how the emulation runs them.

    Example:
        >>> cpu, gpu = PhysicalDevice("cpu", 0, emulated=True), PhysicalDevice("cuda", 1)
        >>> transfer_kind(cpu, cpu, same_logical=False), transfer_kind(cpu, gpu, same_logical=False)
        ('alias', 'h2d')
    """
    if same_logical:
        return ALIAS
    if src.is_cuda and dst.is_cuda:
        return ALIAS if src.index == dst.index else GPU_TO_GPU
    if src.is_cuda:
        return TO_HOST
    if dst.is_cuda:
        return TO_GPU
    return ALIAS


def ortvalue(array: np.ndarray, physical: PhysicalDevice) -> ort.OrtValue:
    """``array`` as an ``OrtValue`` on ``physical`` (a host copy when that is a GPU)."""
    if physical.is_cuda:
        HOST_COPIES.add()
        return ort.OrtValue.ortvalue_from_numpy(array, "cuda", physical.index)
    return ort.OrtValue.ortvalue_from_numpy(array)


#: The host, as a physical device (where values of CPU stages and emulated devices live).
_HOST = PhysicalDevice("cpu", 0)


def value_device(value: ort.OrtValue) -> PhysicalDevice:
    """The physical device an ``OrtValue`` lives on."""
    if value.device_name().lower() == "cpu":
        return _HOST
    _, index = value._ortvalue.__dlpack_device__()
    return PhysicalDevice("cuda", int(index))


def place(value: Any, physical: PhysicalDevice) -> Any:
    """A graph input as the value table holds it on ``physical``: numpy arrays become
    ``OrtValue`` s there (a host copy for a GPU), torch tensors ``OrtValue`` s over their
    memory (DLPack), and ``OrtValue`` s on another device are moved
    (:func:`transfer_kind`); host values (lists, ``None``, strings) stay as they are.

    Example:
        >>> import numpy as np
        >>> value = place(np.ones(3, np.float32), PhysicalDevice("cpu"))
        >>> value.device_name().lower(), value.shape()
        ('cpu', [3])
    """
    if _is_tensor(value):
        return ortvalue(value, physical)
    if _is_torch(value):
        from placement.runtime.inputs import ortvalue_from_torch

        value = ortvalue_from_torch(value)  # a CUDA tensor's stream is synchronised there
    if not isinstance(value, ort.OrtValue):
        return value
    here = value_device(value)
    if here.is_cuda == physical.is_cuda and here.index == physical.index:
        return value
    return move(value, transfer_kind(here, physical, same_logical=False), physical)


def to_output(value: Any, kind: str, *, copy: bool = False) -> Any:
    """A graph output handed to the caller as ``kind`` (:data:`OUTPUT_KINDS`), on the device
    it was made on; ``copy``: the value is not the run's own (a graph input passed through),
    so it is copied first. Host values (lists, ``None``) are returned as they are.

    Example:
        >>> import numpy as np
        >>> to_output(np.arange(3), "torch")
        tensor([0, 1, 2])
    """
    if kind == "numpy":
        out = host_array(value)
        return out.copy() if copy and isinstance(out, np.ndarray) else out
    if isinstance(value, np.ndarray) and value.dtype.kind not in "OUS":
        array = np.array(value) if copy else value
        if kind == "torch":
            import torch

            return torch.from_numpy(array)  # the tensor keeps the array alive
        return ort.OrtValue.ortvalue_from_numpy(array)  # the OrtValue keeps the array alive
    if not isinstance(value, ort.OrtValue):
        return value
    if copy:
        value = _copy_value(value)
    if kind == "ortvalue":
        return value
    if kind == "torch":
        import torch

        tensor = torch.from_dlpack(value._ortvalue)
        return tensor.view(torch.bool) if value.data_type() == "tensor(bool)" else tensor
    raise PlacementError(f"unknown output kind {kind!r}; expected one of {', '.join(OUTPUT_KINDS)}")


def _copy_value(value: ort.OrtValue) -> ort.OrtValue:
    """A copy of an ``OrtValue`` on its own device."""
    device = value_device(value)
    if not device.is_cuda:  # memory ONNX Runtime owns (a DLPack view of it stays valid on its own)
        dst = ort.OrtValue.ortvalue_from_shape_and_type(value.shape(), _numpy_dtype(value), "cpu", 0)
        dst.update_inplace(np.ascontiguousarray(value.numpy()))
        return dst
    dst = ort.OrtValue.ortvalue_from_shape_and_type(value.shape(), _numpy_dtype(value), "cuda", device.index)
    ort.copy_tensors([value], [dst])
    return dst


def _is_torch(value: Any) -> bool:
    return (type(value).__module__ or "").startswith("torch") and hasattr(value, "__dlpack__")


def _is_native(value: Any) -> bool:
    return isinstance(value, _C.OrtValue)


def move(value: ort.OrtValue, kind: str, physical: PhysicalDevice) -> ort.OrtValue:
    """``value`` moved to ``physical`` the way ``kind`` says (an alias returns it as is)."""
    if kind == ALIAS:
        return value
    if kind == TO_HOST:
        HOST_COPIES.add()
        return ort.OrtValue.ortvalue_from_numpy(value.numpy())
    if kind == TO_GPU:
        HOST_COPIES.add()
        return ort.OrtValue.ortvalue_from_numpy(value.numpy(), "cuda", physical.index)
    return _gpu_to_gpu(value, physical)


class _KeepAlive:
    """The base of an array viewing an ``OrtValue``'s memory: holds the ``OrtValue``."""

    def __init__(self, value: ort.OrtValue, view: np.ndarray) -> None:
        self.value = value
        self.__array_interface__ = view.__array_interface__


def host_array(value: Any) -> Any:
    """A host array of ``value`` that stays valid after ``value`` is dropped.

    ``OrtValue.numpy()`` on a CPU tensor returns a view of the ``OrtValue``'s buffer
    whose base (a capsule) does not keep that buffer alive: once the ``OrtValue``
    (or the numpy array it was made from) is released, the next allocation can
    overwrite the view. The returned array keeps the ``OrtValue`` alive instead
    (no copy), or is a copy where that is cheaper (up to 64 KiB); arrays that own
    their data (GPU values copied to the host) and host values (lists, ``None``,
    object arrays) are returned as they are.
    """
    if not isinstance(value, ort.OrtValue):
        return value
    if value.device_name().lower() != "cpu":
        HOST_COPIES.add()
    array = value.numpy()
    if not isinstance(array, np.ndarray):
        return array
    return _owned(value, array)


#: Outputs up to this size are copied out of their ``OrtValue`` rather than kept alive
#: with it: a small copy costs less than the array wrapper around a kept value.
_COPY_BELOW = 1 << 16


def _owned(value: Any, array: np.ndarray) -> np.ndarray:
    """``array`` (``value.numpy()``) as an array that stays valid: as it is if it owns its
    memory, copied if small, else a view that keeps ``value`` alive."""
    if array.flags.owndata:
        return array
    if array.nbytes <= _COPY_BELOW:
        return array.copy()
    return np.asarray(_KeepAlive(value, array))


def _is_tensor(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype.kind not in "OUS"


def _host(value: Any) -> Any:
    """A value as ``InferenceSession.run`` takes it (``OrtValue`` s become arrays)."""
    return host_array(value) if isinstance(value, ort.OrtValue) else value


def _host_copy(value: Any) -> Any:
    """A separate copy of a host value (arrays, lists of them, ``None``)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (list, tuple)):
        return [_host_copy(v) for v in value]
    return value


def _gpu_to_gpu(value: ort.OrtValue, physical: PhysicalDevice) -> ort.OrtValue:
    """Device-to-device copy; a host round trip where this onnxruntime build cannot."""
    global _warned_d2d_fallback
    if not _warned_d2d_fallback:
        try:
            dst = ort.OrtValue.ortvalue_from_shape_and_type(
                value.shape(), _numpy_dtype(value), "cuda", physical.index
            )
            ort.copy_tensors([value], [dst])
            return dst
        except Exception as err:  # no registered GPU-GPU data transfer in this build
            _warned_d2d_fallback = True
            log.warning(
                "onnxruntime cannot copy between GPUs directly here (%s); "
                "cross-GPU transfers go through host memory",
                err,
            )
    HOST_COPIES.add(2)
    return ort.OrtValue.ortvalue_from_numpy(value.numpy(), "cuda", physical.index)


def _numpy_dtype(value: ort.OrtValue) -> Any:
    """The numpy dtype of an ``OrtValue`` (ONNX Runtime names types ``tensor(float)``)."""
    import onnx_ir as ir
    from onnx import TensorProto

    name = value.data_type().removeprefix("tensor(").removesuffix(")")
    try:
        return ir.DataType(TensorProto.DataType.Value(name.upper())).numpy()
    except (ValueError, TypeError):
        raise PlacementError(f"cannot move a {value.data_type()} between GPUs") from None
