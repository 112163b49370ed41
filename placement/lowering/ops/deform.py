"""``DeformConv`` (opset 19): a 2-D convolution whose kernel taps sample the input at learned
offsets (and, optionally, scale by a learned mask), in plain torch (no torchvision).

Each output position ``(h, w)`` and kernel tap ``(i, j)`` of offset group ``g`` reads the
input at ``(h * stride - pad + i * dilation + dy, w * stride - pad + j * dilation + dx)``
with ``(dy, dx)`` at channels ``g * 2K + 2k`` and ``g * 2K + 2k + 1`` of ``offset`` (``k = i
* kW + j``), bilinearly interpolated with zeros outside the map; the mask (channel ``g * K
+ k``) scales the sample. The sampled columns are then contracted with the (grouped)
weights, plus the bias. Differentiable in the input, the weights, the offsets and the mask.

Example:
    >>> import torch
    >>> from placement.lowering.ops.deform import deform_conv
    >>> x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    >>> offset = torch.zeros(1, 18, 3, 3)            # zero offsets: a plain convolution
    >>> y = deform_conv(x, w, offset)
    >>> torch.allclose(y, torch.nn.functional.conv2d(x, w), atol=1e-5)
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, op


def _bilinear(x: Tensor, y_pos: Tensor, x_pos: Tensor) -> Tensor:
    """Sample ``x`` ``[N, G, Cg, H, W]`` at ``[N, G, P]`` positions -> ``[N, G, Cg, P]``, zeros outside."""
    height, width = x.shape[-2:]
    flat = x.reshape(*x.shape[:3], height * width)
    y0, x0 = torch.floor(y_pos), torch.floor(x_pos)
    ly, lx = y_pos - y0, x_pos - x0
    y0, x0 = y0.to(torch.int64), x0.to(torch.int64)
    out = torch.zeros(flat.shape[:3] + y_pos.shape[-1:], dtype=x.dtype, device=x.device)
    for dy, wy in ((0, 1 - ly), (1, ly)):
        for dx, wx in ((0, 1 - lx), (1, lx)):
            yy, xx = y0 + dy, x0 + dx
            inside = (yy >= 0) & (yy < height) & (xx >= 0) & (xx < width)
            index = torch.where(inside, yy * width + xx, torch.zeros_like(yy))
            values = flat.gather(3, index.unsqueeze(2).expand(-1, -1, flat.shape[2], -1))
            weight = torch.where(inside, wy * wx, torch.zeros_like(wy)).unsqueeze(2)
            out = out + weight * values
    return out


@op("DeformConv")
def deform_conv(
    X: Tensor,
    W: Tensor,
    offset: Tensor,
    B: Tensor | None = None,
    mask: Tensor | None = None,
    *,
    dilations: Sequence[int] | None = None,
    group: int = 1,
    kernel_shape: Sequence[int] | None = None,
    offset_group: int = 1,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> Tensor:
    """ONNX DeformConv, 2-D (see the module docstring): ``[N, oC, oH, oW]``."""
    if X.dim() != 4:
        raise LoweringError(f"DeformConv: only 2-D inputs are supported, got rank {X.dim()}")
    n, channels, height, width = X.shape
    out_channels, kh, kw = W.shape[0], W.shape[2], W.shape[3]
    sh, sw = list(strides or [1, 1])
    dh, dw = list(dilations or [1, 1])
    pt, pl, pb, pr = list(pads or [0, 0, 0, 0])
    oh = (height + pt + pb - (dh * (kh - 1) + 1)) // sh + 1
    ow = (width + pl + pr - (dw * (kw - 1) + 1)) // sw + 1
    taps = kh * kw
    if offset.shape[1] != offset_group * 2 * taps or channels % offset_group or channels % group:
        raise LoweringError(
            f"DeformConv: offset {tuple(offset.shape)} does not fit offset_group={offset_group}, "
            f"kernel {kh}x{kw} and {channels} channels (group={group})"
        )
    dtype = X.dtype
    base_y = (torch.arange(oh, device=X.device, dtype=dtype) * sh - pt).reshape(1, 1, 1, oh, 1)
    base_x = (torch.arange(ow, device=X.device, dtype=dtype) * sw - pl).reshape(1, 1, 1, 1, ow)
    tap_y = (
        (torch.arange(kh, device=X.device, dtype=dtype) * dh).repeat_interleave(kw).reshape(1, 1, -1, 1, 1)
    )
    tap_x = (torch.arange(kw, device=X.device, dtype=dtype) * dw).repeat(kh).reshape(1, 1, -1, 1, 1)
    off = offset.to(dtype).reshape(n, offset_group, taps, 2, oh, ow)
    y_pos = (base_y + tap_y + off[:, :, :, 0]).reshape(n, offset_group, -1)
    x_pos = (base_x + tap_x + off[:, :, :, 1]).reshape(n, offset_group, -1)
    grouped = X.reshape(n, offset_group, channels // offset_group, height, width)
    cols = _bilinear(grouped, y_pos, x_pos).reshape(n, offset_group, -1, taps, oh, ow)
    if mask is not None:
        cols = cols * mask.to(dtype).reshape(n, offset_group, 1, taps, oh, ow)
    cols = cols.reshape(n, group, channels // group, taps, oh, ow)
    weights = W.reshape(group, out_channels // group, channels // group, taps)
    out = torch.einsum("ngcthw,goct->ngohw", cols, weights).reshape(n, out_channels, oh, ow)
    if B is not None:
        out = out + B.reshape(1, -1, 1, 1)
    return out


__all__ = ["deform_conv"]
