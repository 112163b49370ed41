"""Precision that is said: whether fp32 goes through TF32 on a GPU, and the tolerance a check uses.

On NVIDIA GPUs since Ampere, fp32 matrix products and convolutions may run on
tensor cores in TF32 (10-bit mantissa): ONNX Runtime's CUDA provider does so by
default (provider option ``use_tf32``), and so does cuDNN under torch
(``torch.backends.cudnn.allow_tf32``, default on; ``torch.backends.cuda.matmul.allow_tf32``
is off by default). Results then differ from the CPU's by about ``1e-4`` relative
per layer, more in gradients. A check that compares a GPU result with the CPU or
with eager must know which it gets.

Two precisions:

* ``"fp32"`` (the default of :class:`placement.Runner`): strict IEEE fp32, TF32 off
  (``use_tf32=0`` for ONNX Runtime; :func:`torch_precision` for torch). Compared with
  :data:`FP32_TOLERANCE`.
* ``"tf32"``: TF32 allowed (faster on tensor cores). Compared with :data:`TF32_TOLERANCE`.

On the CPU both are plain fp32 (TF32 does not exist there), compared with the fp32
tolerance.

Example:
    >>> ort_cuda_options("fp32")
    {'use_tf32': '0'}
    >>> tolerance("tf32", on_gpu=False) == FP32_TOLERANCE
    True
    >>> tolerance("tf32", on_gpu=True)
    Tolerance(rtol=0.005, atol=0.005, tf32=True)
    >>> str(tolerance("fp32", on_gpu=True))
    'fp32 (TF32 off), rtol=0.0001, atol=0.0001'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from placement.errors import PlacementError

__all__ = [
    "DEFAULT_PRECISION",
    "FP32_TOLERANCE",
    "PRECISIONS",
    "TF32_TOLERANCE",
    "Tolerance",
    "check_precision",
    "ort_cuda_options",
    "tolerance",
    "torch_precision",
    "torch_uses_tf32",
]

#: The precisions a runtime accepts.
PRECISIONS = ("fp32", "tf32")
#: What :class:`placement.Runner` uses unless told: strict fp32, so GPU outputs match the CPU's.
DEFAULT_PRECISION = "fp32"


@dataclass(frozen=True)
class Tolerance:
    """How close two fp32 results must be (``numpy.allclose`` semantics) and why."""

    rtol: float
    atol: float
    tf32: bool = False

    def __str__(self) -> str:
        mode = "TF32 on the GPU" if self.tf32 else "fp32 (TF32 off)"
        return f"{mode}, rtol={self.rtol:g}, atol={self.atol:g}"

    def allclose(self, got: Any, expected: Any) -> bool:
        """``numpy.allclose(got, expected)`` with this tolerance."""
        import numpy as np

        return bool(np.allclose(got, expected, rtol=self.rtol, atol=self.atol))


#: Strict fp32 on any device against the CPU or eager (different kernels, same precision).
FP32_TOLERANCE = Tolerance(rtol=1e-4, atol=1e-4)
#: fp32 computed through TF32 tensor cores against strict fp32 (a 10-bit mantissa per product).
TF32_TOLERANCE = Tolerance(rtol=5e-3, atol=5e-3, tf32=True)


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else a :class:`PlacementError`.

    Example:
        >>> check_precision("tf32")
        'tf32'
    """
    if precision not in PRECISIONS:
        raise PlacementError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    return precision


def ort_cuda_options(precision: str) -> dict[str, str]:
    """The CUDA execution provider's options for ``precision`` (``use_tf32``)."""
    return {"use_tf32": "1" if check_precision(precision) == "tf32" else "0"}


def tolerance(precision: str, *, on_gpu: bool) -> Tolerance:
    """The tolerance for comparing a result computed in ``precision`` with strict fp32
    (the CPU or eager): :data:`TF32_TOLERANCE` when TF32 was in play on a GPU, else
    :data:`FP32_TOLERANCE`."""
    return TF32_TOLERANCE if on_gpu and check_precision(precision) == "tf32" else FP32_TOLERANCE


def torch_uses_tf32() -> bool:
    """Whether torch currently lets fp32 CUDA matmuls or cuDNN convolutions use TF32.

    Example:
        >>> with torch_precision("fp32"):
        ...     torch_uses_tf32()
        False
    """
    import torch

    return bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)


@contextlib.contextmanager
def torch_precision(precision: str) -> Iterator[None]:
    """Set torch's TF32 flags for ``precision`` (``"fp32"``: both off; ``"tf32"``: both on)
    inside the block, and restore them after it. The flags are process-wide.

    Example:
        >>> import torch
        >>> before = torch.backends.cudnn.allow_tf32
        >>> with torch_precision("fp32"):
        ...     torch.backends.cudnn.allow_tf32
        False
        >>> torch.backends.cudnn.allow_tf32 == before
        True
    """
    import torch

    allow = check_precision(precision) == "tf32"
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
