"""placement: split neural networks across devices at the operator-graph level.

The package is layered; imports point down this list only (a test enforces it):

- :mod:`placement.graph`: the IR layer (``Model``, ``Device``, load/save, verify, views, import).
- :mod:`placement.analysis`: facts every layer above shares (data dependence, copy origin,
  load-time values).
- :mod:`placement.passes`: the Caffe2 pass trio on ``onnx_ir`` passes.
- :mod:`placement.planning`: front-ends, profiler, planner.
- :mod:`placement.runtime`: stages, the ONNX Runtime executor, the torch lowering, device maps.
- :mod:`placement.generation`: the decode loop of a causal LM, over both runtimes.
- :mod:`placement.report`: tables for people.
- :mod:`placement.cli`: the ``placement`` command.

``import placement`` is light: every public name (but the errors) is imported on first use, so
onnx_ir, torch and ONNX Runtime load only when a name that needs them is touched.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> str(model.devices[0])
    'cuda:0'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from placement.errors import (
    CUDAGraphError,
    DeviceError,
    ExportError,
    InfeasiblePlacementError,
    InputError,
    LoweringError,
    ModelLoadError,
    ModelSaveError,
    NotAnActivationError,
    PipelineError,
    PlacementError,
    PlanError,
    UnknownBlobError,
    UnknownOpError,
    VerificationError,
)

if TYPE_CHECKING:
    from placement.graph import Device, Model, Op, Parameter, from_torch, load, verify
    from placement.passes import (
        PassSequence,
        get_activation_blobs,
        inject_cross_device_copies,
        shift_activation_devices,
        split_tensor_parallel,
    )
    from placement.planning import (
        Plan,
        Profile,
        StageAssignment,
        assign_modules,
        auto_place,
        balance,
        balance_by_size,
        balance_by_time,
        begin_block,
        get_stage_assignment,
        module_devices,
        place_evenly,
        profile,
        set_stage_assignment,
        spread_experts,
    )
    from placement.report import summary
    from placement.report.draw import draw
    from placement.report.html import write_report
    from placement.runtime.calibrate import Calibration, calibrate
    from placement.runtime.ort import Runner, run
    from placement.runtime.torch import to_torch, train_step

__version__ = "0.1.0"

# Public name -> the module that defines it. Everything but the errors loads on first access,
# so ``import placement`` (and ``placement --help``) does not pay for onnx_ir, torch or ORT.
_LAZY = {
    **dict.fromkeys(
        ["Device", "Model", "Op", "Parameter", "from_torch", "load", "verify"], "placement.graph"
    ),
    **dict.fromkeys(
        [
            "PassSequence",
            "get_activation_blobs",
            "inject_cross_device_copies",
            "shift_activation_devices",
            "split_tensor_parallel",
        ],
        "placement.passes",
    ),
    **dict.fromkeys(
        [
            "Plan",
            "Profile",
            "StageAssignment",
            "assign_modules",
            "auto_place",
            "balance",
            "balance_by_size",
            "balance_by_time",
            "begin_block",
            "place_evenly",
            "get_stage_assignment",
            "module_devices",
            "profile",
            "set_stage_assignment",
            "spread_experts",
        ],
        "placement.planning",
    ),
    "summary": "placement.report",
    "draw": "placement.report.draw",
    "write_report": "placement.report.html",
    "Runner": "placement.runtime.ort",
    "run": "placement.runtime.ort",
    "calibrate": "placement.runtime.calibrate",
    "Calibration": "placement.runtime.calibrate",
    "to_torch": "placement.runtime.torch",
    "train_step": "placement.runtime.torch",
}

__all__ = [
    # graph
    "Device",
    "Model",
    "Op",
    "Parameter",
    "from_torch",
    "load",
    "verify",
    # errors
    "PlacementError",
    "CUDAGraphError",
    "DeviceError",
    "ExportError",
    "InfeasiblePlacementError",
    "InputError",
    "LoweringError",
    "ModelLoadError",
    "ModelSaveError",
    "NotAnActivationError",
    "PlanError",
    "PipelineError",
    "UnknownBlobError",
    "UnknownOpError",
    "VerificationError",
    # passes
    "get_activation_blobs",
    "shift_activation_devices",
    "split_tensor_parallel",
    "inject_cross_device_copies",
    "PassSequence",
    # planning
    "module_devices",
    "assign_modules",
    "spread_experts",
    "begin_block",
    "place_evenly",
    "get_stage_assignment",
    "set_stage_assignment",
    "StageAssignment",
    "balance",
    "balance_by_time",
    "balance_by_size",
    "profile",
    "Profile",
    "auto_place",
    "Plan",
    # runtime
    "Runner",
    "run",
    "calibrate",
    "Calibration",
    "to_torch",
    "train_step",
    # report
    "summary",
    "draw",
    "write_report",
]

_LAZY.update(
    Link="placement.planning.link_model",
    Links="placement.planning.link_model",
    measure_links="placement.runtime.ort.link_probe",
)
__all__ += ["Link", "Links", "measure_links"]  # noqa: E501, E702
_LAZY.update(predict="placement.planning.predict", Prediction="placement.planning.predict")
__all__ += ["predict", "Prediction"]
# host memory as a device: streamed parameters and the offload planner
_LAZY.update(stream_parameters="placement.passes.streaming", plan_offload="placement.planning.offload")
__all__ += ["stream_parameters", "plan_offload"]

# generation: causal LMs with their KV cache, the decode loop over both runtimes
_LAZY.update(
    from_causal_lm="placement.graph.causal_lm",
    generate="placement.generation",
    Generator="placement.generation",
)
__all__ += ["from_causal_lm", "generate", "Generator"]

_SUBPACKAGES = frozenset(
    {
        "analysis", "cli", "distributed", "errors", "generation", "graph",
        "models", "passes", "planning", "report", "runtime",
    }
)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        value = importlib.import_module(f"placement.{name}")
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'placement' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names, the subpackages and the module's dunders: not the tools this file
    imports for itself (``importlib``, ``Any``, ``TYPE_CHECKING``, ``annotations``)."""
    return sorted(set(__all__) | _SUBPACKAGES | {n for n in globals() if n.startswith("__")})
