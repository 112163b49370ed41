"""Signal-processing ops: ``DFT``, ``STFT``, the window generators and ``MelWeightMatrix``.

ONNX carries complex values as a trailing dimension of size 2 (real, imaginary); a
real signal has a trailing dimension of size 1. The rules view that pair as a
torch complex tensor and use ``torch.fft``, so they differentiate like any other op.

Example:
    >>> import torch
    >>> from placement.lowering.ops.signal import dft
    >>> x = torch.tensor([1.0, 0.0, 0.0, 0.0]).reshape(1, 4, 1)
    >>> dft(x, axis=1)[0, :, 0].tolist()  # the spectrum of an impulse is flat
    [1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, _axis, _scalar, op, torch_dtype


def _complex(x: Tensor) -> Tensor:
    """``[..., 1]`` (real) or ``[..., 2]`` (real, imaginary) as a complex tensor without the pair dim."""
    if x.shape[-1] == 1:
        real = x[..., 0]
        return torch.complex(real, torch.zeros_like(real))
    if x.shape[-1] != 2:
        raise LoweringError(f"DFT: the last dimension holds 1 or 2 components, got {x.shape[-1]}")
    return torch.complex(x[..., 0].contiguous(), x[..., 1].contiguous())


def _pairs(z: Tensor, dtype: torch.dtype) -> Tensor:
    """A complex tensor as ONNX's ``[..., 2]`` real pairs of ``dtype``."""
    return torch.stack([z.real, z.imag], dim=-1).to(dtype)


def _compute(x: Tensor) -> Tensor:
    """``x`` in a precision ``torch.fft`` takes (half precision computes in float32)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


@op("DFT", shape_inputs=(1, 2))
def dft(
    input: Tensor,  # noqa: A002
    dft_length: Any = None,
    axis_input: Any = None,
    *,
    axis: int | None = None,
    inverse: int = 0,
    onesided: int = 0,
    opset: int = 20,
) -> Tensor:
    """ONNX DFT (opset 17 ``axis`` attribute or opset 20 ``axis`` input): forward, inverse
    (normalised by the length), one-sided forward (``rfft``) and one-sided inverse (``irfft``)."""
    if axis_input is not None:
        axis = int(_scalar(axis_input))
    elif axis is None:
        axis = 1 if opset < 20 else -2
    axis = _axis(axis, input.dim())
    if axis == input.dim() - 1:
        raise LoweringError("DFT: the axis must not be the last (real/imaginary) dimension")
    n = None if dft_length is None else int(_scalar(dft_length))
    signal = _complex(_compute(input))
    if inverse and onesided:
        n = n if n is not None else 2 * (input.shape[axis] - 1)
        return torch.fft.irfft(signal, n=n, dim=axis).unsqueeze(-1).to(input.dtype)
    if inverse:
        return _pairs(torch.fft.ifft(signal, n=n, dim=axis), input.dtype)
    out = torch.fft.fft(signal, n=n, dim=axis)
    if onesided:
        out = out.narrow(axis, 0, out.shape[axis] // 2 + 1)
    return _pairs(out, input.dtype)


@op("STFT", shape_inputs=(1, 3))
def stft(
    signal: Tensor,
    frame_step: Any,
    window: Tensor | None = None,
    frame_length: Any = None,
    *,
    onesided: int = 1,
) -> Tensor:
    """ONNX STFT: ``[batch, length, 1|2]`` -> ``[batch, frames, bins, 2]``, frames of
    ``frame_length`` every ``frame_step`` samples, each weighted by ``window``."""
    step = int(_scalar(frame_step))
    if frame_length is not None:
        length = int(_scalar(frame_length))
    elif window is not None:
        length = window.shape[0]
    else:
        length = signal.shape[-2]
    frames = _complex(_compute(signal)).unfold(1, length, step)  # [batch, frames, length]
    if window is not None:
        frames = frames * window.to(frames.real.dtype)
    out = torch.fft.fft(frames, dim=-1)
    if onesided:
        out = out[..., : length // 2 + 1]
    return _pairs(out, signal.dtype)


def _window(size: Any, periodic: int) -> tuple[np.ndarray, int]:
    n = int(_scalar(size))
    return np.arange(n, dtype=np.float64), (n if periodic else n - 1)


def _window_tensor(values: np.ndarray, output_datatype: int, like: Any) -> Tensor:
    device = like.device if isinstance(like, Tensor) else None
    return torch.from_numpy(values).to(device=device, dtype=torch_dtype(output_datatype))


@op("HannWindow", shape_inputs=(0,))
def hann_window(size: Any, *, output_datatype: int = 1, periodic: int = 1) -> Tensor:
    """ONNX HannWindow: ``sin(pi n / N)^2`` (``N`` = size when periodic, else size - 1)."""
    n, denom = _window(size, periodic)
    return _window_tensor(np.sin(n * np.pi / denom) ** 2, output_datatype, size)


@op("HammingWindow", shape_inputs=(0,))
def hamming_window(size: Any, *, output_datatype: int = 1, periodic: int = 1) -> Tensor:
    """ONNX HammingWindow: ``25/46 - 21/46 cos(2 pi n / N)``."""
    n, denom = _window(size, periodic)
    alpha = 25.0 / 46.0
    return _window_tensor(alpha - np.cos(n * np.pi * 2 / denom) * (1 - alpha), output_datatype, size)


@op("BlackmanWindow", shape_inputs=(0,))
def blackman_window(size: Any, *, output_datatype: int = 1, periodic: int = 1) -> Tensor:
    """ONNX BlackmanWindow: ``0.42 - 0.5 cos(2 pi n / N) + 0.08 cos(4 pi n / N)``."""
    n, denom = _window(size, periodic)
    values = np.cos(n * np.pi * 2 / denom) * -0.5 + np.cos(n * np.pi * 4 / denom) * 0.08 + 0.42
    return _window_tensor(values, output_datatype, size)


@op("MelWeightMatrix", shape_inputs=(0, 1, 2), scalar_inputs=(3, 4))
def mel_weight_matrix(
    num_mel_bins: Any,
    dft_length: Any,
    sample_rate: Any,
    lower_edge_hertz: Any,
    upper_edge_hertz: Any,
    *,
    output_datatype: int = 1,
) -> Tensor:
    """ONNX MelWeightMatrix: ``[dft_length // 2 + 1, num_mel_bins]`` triangular mel filters."""
    bins, length, rate = (int(_scalar(v)) for v in (num_mel_bins, dft_length, sample_rate))
    low, high = float(_scalar(lower_edge_hertz)), float(_scalar(upper_edge_hertz))
    points = np.arange(0, bins + 2)
    low_mel = 2595 * np.log1p(low / 700) / np.log(10)
    high_mel = 2595 * np.log1p(high / 700) / np.log(10)
    step = (high_mel - low_mel) / points.shape[0]
    hz = 700 * np.expm1((points * step + low_mel) / 2595 * np.log(10))
    edges = (((length + 1) * hz) // rate).astype(int)
    out = np.zeros((length // 2 + 1, bins))
    for i in range(bins):
        left, center, right = edges[i], edges[i + 1], edges[i + 2]
        if center == left:
            out[center, i] = 1
        else:
            for j in range(left, center + 1):
                out[j, i] = (j - left) / (center - left)
        for j in range(center, right):
            out[j, i] = (right - j) / (right - center)
    return torch.from_numpy(out).to(torch_dtype(output_datatype))


__all__ = ["dft", "stft", "hann_window", "hamming_window", "blackman_window", "mel_weight_matrix"]
