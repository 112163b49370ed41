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

# the Caffe2 pass trio and the pass pipeline (issue 3)
from placement.passes import (
    Pipeline,
    get_activation_blobs,
    inject_cross_device_copies,
    shift_activation_devices,
)

# placement front-ends, profiler and planner (issue 5)
from placement.passes.balance import balance, balance_by_size, balance_by_time
from placement.passes.blocks import begin_block
from placement.passes.modules import assign_modules, module_devices
from placement.passes.planner import Plan, auto_place
from placement.passes.profile import Profile, profile
from placement.passes.stage_assignment import (
    StageAssignment,
    get_stage_assignment,
    set_stage_assignment,
    summary,
)

# ONNX Runtime executor (issue 4)
from placement.runtime.ort import Runner, run

# torch lowering (issue 4)
from placement.runtime.torch_lower import to_torch

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

__all__ += [
    "module_devices",
    "assign_modules",
    "begin_block",
    "get_stage_assignment",
    "set_stage_assignment",
    "StageAssignment",
    "summary",
    "balance",
    "balance_by_time",
    "balance_by_size",
    "profile",
    "Profile",
    "auto_place",
    "Plan",
]

__all__ += ["Runner", "run"]
__all__ += ["get_activation_blobs", "shift_activation_devices", "inject_cross_device_copies", "Pipeline"]
__all__ += ["to_torch"]
from placement.planning.links import Link, Links; from placement.runtime.links import measure_links; __all__ += ["Link", "Links", "measure_links"]  # noqa: E402, E501, E702, I001
