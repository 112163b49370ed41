"""The exception hierarchy of ``placement``.

Every error the library raises on bad input derives from :class:`PlacementError`
and names the offending op, blob, device or file, so that callers can catch one
type and users can read what went wrong.

Example:
    >>> import placement as pl
    >>> try:
    ...     pl.Device.parse("tpu:3")
    ... except pl.PlacementError as err:
    ...     print(type(err).__name__)
    DeviceError
"""

from __future__ import annotations

__all__ = [
    "PlacementError",
    "DeviceError",
    "UnknownOpError",
    "UnknownBlobError",
    "NotAnActivationError",
    "ModelLoadError",
    "ModelSaveError",
    "ExportError",
    "VerificationError",
    "InfeasiblePlacementError",
    "LoweringError",
    "InputError",
    "PlanError",
    "PipelineError",
    "CUDAGraphError",
]


class PlacementError(Exception):
    """Root of every error raised by ``placement``."""


class DeviceError(PlacementError, ValueError):
    """A device string, index or mapping is malformed or not part of the model."""


class UnknownOpError(PlacementError, KeyError):
    """An op name does not exist in the model."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnknownBlobError(PlacementError, KeyError):
    """A blob (value) name does not exist in the model."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class NotAnActivationError(PlacementError, ValueError):
    """A blob was used as an activation but is a parameter, constant or input."""


class ModelLoadError(PlacementError):
    """A model file or object could not be read (missing, truncated, not ONNX, unsafe)."""


class ModelSaveError(PlacementError):
    """A model could not be written; any existing file at the target is untouched."""


class ExportError(PlacementError):
    """``torch.onnx.export`` failed on the user's module."""


class VerificationError(PlacementError):
    """A placement invariant is broken; the message names the first broken op."""


class InfeasiblePlacementError(PlacementError):
    """No placement satisfies the requested budgets; the message states what would."""


class LoweringError(PlacementError):
    """The model cannot be lowered (for example, unsupported op types)."""


class InputError(PlacementError, ValueError):
    """Inputs given to a runtime have wrong names, shapes or dtypes."""


class PlanError(PlacementError, ValueError):
    """A placement plan or front-end request is malformed."""


class PipelineError(PlacementError):
    """A pipeline stage failed on a micro-batch; ``stage`` and ``microbatch`` say which.

    The original exception is the ``__cause__``.
    """

    def __init__(self, message: str, *, stage: int, microbatch: int) -> None:
        super().__init__(message)
        self.stage = stage
        self.microbatch = microbatch


class CUDAGraphError(PlacementError):
    """CUDA graphs were asked for where they cannot run (no GPU, nothing placed on one,
    or a pipelined module); the message says which."""
