"""placement: split neural networks across devices at the operator-graph level.

Example:
    >>> import placement as pl
    >>> from models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> str(model.devices[0])
    'cuda:0'
"""

from __future__ import annotations

from placement.errors import (
    DeviceError,
    ExportError,
    InfeasiblePlacementError,
    InputError,
    LoweringError,
    ModelLoadError,
    ModelSaveError,
    NotAnActivationError,
    PlacementError,
    PlanError,
    UnknownBlobError,
    UnknownOpError,
    VerificationError,
)
from placement.graph import Device, Model, Op, Parameter, from_torch, load, verify
# ONNX Runtime executor (issue 4)
from placement.runtime.ort import Runner, run
# the Caffe2 pass trio and the pass pipeline (issue 3)
from placement.passes import (
    Pipeline,
    get_activation_blobs,
    inject_cross_device_copies,
    shift_activation_devices,
)

__version__ = "0.1.0"

__all__ = [
    "Device",
    "Model",
    "Op",
    "Parameter",
    "from_torch",
    "load",
    "verify",
    "PlacementError",
    "DeviceError",
    "ExportError",
    "InfeasiblePlacementError",
    "InputError",
    "LoweringError",
    "ModelLoadError",
    "ModelSaveError",
    "NotAnActivationError",
    "PlanError",
    "UnknownBlobError",
    "UnknownOpError",
    "VerificationError",
]

__all__ += ["get_activation_blobs", "shift_activation_devices", "inject_cross_device_copies", "Pipeline"]

__all__ += ["Runner", "run"]
