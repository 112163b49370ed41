"""ONNX Runtime's ``com.microsoft::DynamicQuantizeLSTM``: an LSTM with 8-bit weights whose
inputs are quantized on the fly, computed as ONNX Runtime's CPU kernel computes it.

Semantics (those of ONNX Runtime's ``DynamicQuantizeLSTM`` kernel):

* ``W`` is ``[directions, input_size, 4 * hidden]`` and ``R`` ``[directions, hidden, 4 *
  hidden]`` (already transposed, unlike ONNX ``LSTM``), int8 or uint8, gates ``iofc``.
  ``W_scale``/``R_scale`` are ``[directions]`` (per tensor) or ``[directions, 4 * hidden]``
  (per output column); a direction's zero point is the first element of its row (ORT
  requires them constant within a direction, and zero for int8 weights).
* Each product is a dynamically quantized GEMM: the float operand is quantized to uint8
  as a whole matrix (as ``DynamicQuantizeLinear``: range including 0, scale ``range /
  255``, zero point rounded half to even), multiplied exactly in integers with the
  shifted weights, and the int32 accumulator scaled by ``float32(a_scale * w_scale)``.
  The input projection of all time steps of a direction is one GEMM (one quantization
  over every step and batch row); the recurrence quantizes the hidden state of the whole
  batch once per step (ORT's single-threaded schedule; with several intra-op threads ORT
  may split large batches into chunks quantized separately).
* Gates: ``X W + H R`` (+ peephole terms), then the bias ``Wb + Rb``, ``clip``, and the
  activations (with ``activation_alpha``/``activation_beta``, ``input_forget``), as for
  ONNX ``LSTM``; outputs ``Y``, ``Y_h``, ``Y_c``.

``sequence_lens`` is refused with :class:`~placement.errors.LoweringError`: ORT feeds the
zeroed outputs of finished sequences back into the next step's quantization range, a
schedule detail this rule does not reproduce.

Example:
    >>> import torch
    >>> from placement.lowering.ops.quantized_recurrent import dynamic_quantize_lstm
    >>> x = torch.randn(3, 1, 2)
    >>> w = torch.randint(-127, 128, (1, 2, 8), dtype=torch.int8)
    >>> r = torch.randint(-127, 128, (1, 2, 8), dtype=torch.int8)
    >>> scale, zero = torch.tensor([0.01]), torch.tensor([0], dtype=torch.int8)
    >>> y, y_h, y_c = dynamic_quantize_lstm(x, w, r, None, None, None, None, None,
    ...                                     scale, zero, scale, zero, hidden_size=2)
    >>> y.shape, torch.equal(y[-1], y_h)
    (torch.Size([3, 1, 1, 2]), True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, op
from placement.lowering.ops.quantized import dynamic_quantize_linear
from placement.lowering.ops.recurrent import _activations, _clipped, _lstm_cell, _run

_DIRECTIONS = ("forward", "reverse", "bidirectional")


def _check(attrs: dict[str, Any]) -> str | None:
    direction = attrs.get("direction", "forward")
    if direction not in _DIRECTIONS:
        return f"direction={direction!r}"
    if attrs.get("layout", 0) != 0:
        return f"layout={attrs['layout']}"
    return None


def _quantized_gemm(a: Tensor, weight: Tensor, scale: Tensor, zero_point: Tensor) -> Tensor:
    """``a @ weight`` as ORT's dynamically quantized GEMM: ``a`` (2-D float) quantized to
    uint8 as one matrix, the exact integer product with ``weight - zero_point`` (``zero_point``
    a scalar), scaled per tensor or per column by ``float32(a_scale * scale)``."""
    a_q, a_scale, a_zero = dynamic_quantize_linear(a.float())
    shifted_a = a_q.to(torch.float64) - a_zero.to(torch.float64)
    shifted_w = weight.to(torch.float64) - zero_point.to(torch.float64)
    acc = (shifted_a @ shifted_w).to(torch.float32)
    return acc * (a_scale.float() * scale.float())


def _direction(
    x: Tensor,
    w: tuple[Tensor, Tensor, Tensor],
    r: tuple[Tensor, Tensor, Tensor],
    bias: Tensor | None,
    states: tuple[Tensor, Tensor],
    peephole: Tensor | None,
    acts: list[Any],
    clip: Any,
    input_forget: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """One direction over time-major ``x``: ``(Y (seq, batch, hidden), H, C)``."""
    steps, batch = x.shape[0], x.shape[1]
    xw = _quantized_gemm(x.reshape(steps * batch, -1), *w).reshape(steps, batch, -1)
    chunks = peephole.chunk(3) if peephole is not None else (None, None, None)

    def step(xw_t: Tensor, hc: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        gates = xw_t + _quantized_gemm(hc[0], *r)
        return _lstm_cell(gates, hc[1], chunks, bias, acts, clip, input_forget)

    y, (h, c) = _run(step, xw, states, None)
    return y, h, c


def _weight_params(scale: Tensor, zero_point: Tensor, d: int, name: str, dirs: int) -> tuple[Tensor, Tensor]:
    """Direction ``d``'s scale (scalar or per column) and zero point (the row's first element)."""
    if scale.shape[0] != dirs or zero_point.shape[0] != dirs:
        raise LoweringError(
            f"DynamicQuantizeLSTM: {name} scale/zero point of shapes {tuple(scale.shape)}/"
            f"{tuple(zero_point.shape)} do not have {dirs} direction(s)"
        )
    s = scale[d].float()
    return (s.reshape(()) if s.dim() == 0 else s), zero_point[d].reshape(-1)[0]


@op("DynamicQuantizeLSTM", domain="com.microsoft", check=_check)
def dynamic_quantize_lstm(
    X: Tensor,
    W: Tensor,
    R: Tensor,
    B: Tensor | None = None,
    sequence_lens: Tensor | None = None,
    initial_h: Tensor | None = None,
    initial_c: Tensor | None = None,
    P: Tensor | None = None,
    W_scale: Tensor | None = None,
    W_zero_point: Tensor | None = None,
    R_scale: Tensor | None = None,
    R_zero_point: Tensor | None = None,
    *,
    activation_alpha: Sequence[float] | None = None,
    activation_beta: Sequence[float] | None = None,
    activations: Sequence[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    input_forget: int = 0,
    layout: int = 0,
    num_outputs: int = 3,
) -> Any:
    """ORT's DynamicQuantizeLSTM (see the module docstring): outputs ``Y``, ``Y_h``, ``Y_c``."""
    if sequence_lens is not None:
        raise LoweringError(
            "DynamicQuantizeLSTM: sequence_lens is not supported (ORT's schedule-dependent semantics)"
        )
    if W_scale is None or W_zero_point is None or R_scale is None or R_zero_point is None:
        raise LoweringError(
            "DynamicQuantizeLSTM: W_scale, W_zero_point, R_scale and R_zero_point are required"
        )
    if direction not in _DIRECTIONS or layout != 0:
        raise LoweringError(f"DynamicQuantizeLSTM: direction={direction!r}, layout={layout} is not supported")
    dirs = 2 if direction == "bidirectional" else 1
    size = R.shape[1]
    if W.shape[0] != dirs or R.shape[0] != dirs or W.shape[2] != 4 * size or R.shape[2] != 4 * size:
        raise LoweringError(
            f"DynamicQuantizeLSTM: W {tuple(W.shape)} / R {tuple(R.shape)} do not fit "
            f"direction={direction!r} and hidden size {size}"
        )
    if hidden_size is not None and int(hidden_size) != size:
        raise LoweringError(f"DynamicQuantizeLSTM: hidden_size={hidden_size} but R has hidden size {size}")
    acts = _activations("LSTM", dirs, activations, activation_alpha, activation_beta)
    clipper = _clipped(clip)
    X = X.float()
    batch = X.shape[1]
    ys, hs, cs = [], [], []
    for d in range(dirs):
        w = (W[d], *_weight_params(W_scale, W_zero_point, d, "W", dirs))
        r = (R[d], *_weight_params(R_scale, R_zero_point, d, "R", dirs))
        bias = B[d, : 4 * size] + B[d, 4 * size :] if B is not None else None
        h0 = initial_h[d] if initial_h is not None else X.new_zeros((batch, size))
        c0 = initial_c[d] if initial_c is not None else X.new_zeros((batch, size))
        reverse = direction == "reverse" or d == 1
        x = X.flip(0) if reverse else X
        peephole = P[d] if P is not None else None
        y, h, c = _direction(x, w, r, bias, (h0, c0), peephole, acts[d], clipper, bool(input_forget))
        ys.append(y.flip(0) if reverse else y)
        hs.append(h)
        cs.append(c)
    results = (torch.stack(ys, 1), torch.stack(hs), torch.stack(cs))
    return results[0] if num_outputs == 1 else results[:num_outputs]


__all__ = ["dynamic_quantize_lstm"]
