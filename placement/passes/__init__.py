"""The Caffe2 pass trio and the pass infrastructure they share.

Holds :func:`get_activation_blobs` (activation discovery), :func:`shift_activation_devices`
(label-propagation device shifting) and :func:`inject_cross_device_copies` (explicit copies
on cross-device edges), each a thin wrapper over an ``onnx_ir`` in-place pass, plus the pass
sequence (``PassSequence``) of :mod:`placement.passes.base`.

May import: ``placement.errors``, ``placement.graph``, ``placement.analysis``.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> acts = pl.get_activation_blobs(model)
    >>> _ = pl.shift_activation_devices(model, acts[len(acts) // 2:], {0: 1})
    >>> _ = pl.inject_cross_device_copies(model)
    >>> pl.verify(model)
"""

from __future__ import annotations

from placement.passes.activations import activation_values, get_activation_blobs
from placement.passes.base import (
    PassSequence,
    PassSequenceResult,
    PassVerificationError,
    PlacementPass,
    StepResult,
)
from placement.passes.copies import InjectCrossDeviceCopiesPass, inject_cross_device_copies
from placement.passes.copy_making import CopyResult
from placement.passes.shift import ShiftActivationDevicesPass, ShiftResult, shift_activation_devices
from placement.passes.streaming import StreamResult, stream_parameters
from placement.passes.tensor_parallel import TensorParallelResult, split_tensor_parallel

__all__ = [
    "get_activation_blobs",
    "activation_values",
    "shift_activation_devices",
    "ShiftActivationDevicesPass",
    "ShiftResult",
    "inject_cross_device_copies",
    "InjectCrossDeviceCopiesPass",
    "CopyResult",
    "stream_parameters",
    "split_tensor_parallel",
    "TensorParallelResult",
    "StreamResult",
    "PlacementPass",
    "PassSequence",
    "PassSequenceResult",
    "StepResult",
    "PassVerificationError",
]
