"""Object-detection ops: ``NonMaxSuppression`` and ``RoiAlign``, in plain torch (no torchvision),
computed as ONNX Runtime's CPU kernels compute them.

``NonMaxSuppression`` selects, per batch and class, boxes in descending score order (ties:
the lower index first), keeping those scoring strictly above ``score_threshold`` and
suppressing a box whose IoU with a kept one is strictly above ``iou_threshold``; boxes
given by corners may have them in any order (``center_point_box=0``) or be centers and
sizes (``center_point_box=1``); a box of zero area never suppresses. Its output has a
data-dependent length: the selection runs on values read into Python.

``RoiAlign`` averages (or, ``mode="max"``, takes the largest of) bilinear samples on a
regular grid in each output bin, as ONNX Runtime: samples beyond a pixel outside the map
are zero, coordinates below 0 clamp to 0, ``sampling_ratio=0`` takes ``ceil(roi size /
output size)`` samples per bin per axis, ``output_half_pixel`` (opset 10's behaviour)
does not shift by half a pixel and enlarges rois to at least one pixel. In max mode each
sample is the largest of its four weighted neighbours, as ORT and ONNX's reference compute.

Example:
    >>> import torch
    >>> from placement.lowering.ops.detection import non_max_suppression
    >>> boxes = torch.tensor([[[0.0, 0.0, 1.0, 1.0], [0.0, 0.1, 1.0, 1.1], [0.0, 2.0, 1.0, 3.0]]])
    >>> scores = torch.tensor([[[0.9, 0.8, 0.7]]])
    >>> non_max_suppression(boxes, scores, torch.tensor(3), torch.tensor(0.5)).tolist()
    [[0, 0, 0], [0, 0, 2]]
"""

from __future__ import annotations

import torch

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, op


def _corners(boxes: Tensor, center_point_box: int) -> Tensor:
    """Boxes as ``(y_min, x_min, y_max, x_max)`` (float64)."""
    b = boxes.to(torch.float64)
    if center_point_box:
        x, y, w, h = b.unbind(-1)
        return torch.stack([y - h / 2, x - w / 2, y + h / 2, x + w / 2], -1)
    y1, x1, y2, x2 = b.unbind(-1)
    return torch.stack(
        [torch.minimum(y1, y2), torch.minimum(x1, x2), torch.maximum(y1, y2), torch.maximum(x1, x2)], -1
    )


def _iou(boxes: Tensor) -> Tensor:
    """Pairwise IoU of corner boxes; 0 where either box or the intersection has no area."""
    y1, x1, y2, x2 = boxes.unbind(-1)
    area = (y2 - y1) * (x2 - x1)
    inter_h = (torch.minimum(y2[:, None], y2[None]) - torch.maximum(y1[:, None], y1[None])).clamp(min=0)
    inter_w = (torch.minimum(x2[:, None], x2[None]) - torch.maximum(x1[:, None], x1[None])).clamp(min=0)
    inter = inter_h * inter_w
    union = area[:, None] + area[None] - inter
    ok = (area[:, None] > 0) & (area[None] > 0) & (inter > 0)
    return torch.where(ok, inter / torch.where(ok, union, torch.ones_like(union)), torch.zeros_like(union))


def _scalar(value: Tensor | None, default: float) -> float:
    return default if value is None or value.numel() == 0 else float(value.detach().reshape(-1)[0])


@op("NonMaxSuppression", foldable=False)
def non_max_suppression(
    boxes: Tensor,
    scores: Tensor,
    max_output_boxes_per_class: Tensor | None = None,
    iou_threshold: Tensor | None = None,
    score_threshold: Tensor | None = None,
    *,
    center_point_box: int = 0,
) -> Tensor:
    """ONNX NonMaxSuppression: int64 ``[selected, 3]`` rows ``(batch, class, box)``."""
    if center_point_box not in (0, 1):
        raise LoweringError(f"NonMaxSuppression: center_point_box={center_point_box} is not 0 or 1")
    limit = int(_scalar(max_output_boxes_per_class, 0))
    iou_limit = _scalar(iou_threshold, 0.0)
    floor = None if score_threshold is None or score_threshold.numel() == 0 else _scalar(score_threshold, 0.0)
    rows: list[tuple[int, int, int]] = []
    for b in range(boxes.shape[0] if limit > 0 else 0):
        corners = _corners(boxes[b].detach().cpu(), center_point_box)
        iou = _iou(corners).tolist()
        for c in range(scores.shape[1]):
            class_scores = scores[b, c].detach().cpu().to(torch.float64)
            order = torch.sort(class_scores, descending=True, stable=True).indices.tolist()
            values = class_scores.tolist()
            kept: list[int] = []
            for i in order:
                if len(kept) == limit:
                    break
                if floor is not None and not values[i] > floor:
                    continue
                if all(not iou[i][k] > iou_limit for k in kept):
                    kept.append(i)
            rows += [(b, c, i) for i in kept]
    return torch.tensor(rows, dtype=torch.int64, device=boxes.device).reshape(-1, 3)


def _axis_samples(
    start: Tensor, bin_size: Tensor, grid: Tensor, pooled: int, samples: int, size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per roi, bin and sample along one axis: low and high pixel, their weights, validity.

    Shapes ``[rois, pooled, samples]``; a sample is invalid past the roi's own grid or more
    than one pixel outside the map.
    """
    device = start.device
    p = torch.arange(pooled, device=device, dtype=start.dtype).reshape(1, -1, 1)
    i = torch.arange(samples, device=device, dtype=start.dtype).reshape(1, 1, -1)
    g = grid.to(start.dtype).clamp(min=1).reshape(-1, 1, 1)
    pos = (
        start.reshape(-1, 1, 1) + p * bin_size.reshape(-1, 1, 1) + (i + 0.5) * bin_size.reshape(-1, 1, 1) / g
    )
    valid = (i < grid.reshape(-1, 1, 1)) & (pos >= -1.0) & (pos <= size)
    pos = pos.clamp(min=0.0)
    low = pos.floor().to(torch.int64)
    at_edge = low >= size - 1
    low = torch.where(at_edge, torch.full_like(low, size - 1), low)
    high = torch.where(at_edge, low, low + 1)
    pos = torch.where(at_edge, low.to(pos.dtype), pos)
    frac = pos - low.to(pos.dtype)
    inside = (i < grid.reshape(-1, 1, 1)).expand_as(valid)
    return low, high, 1.0 - frac, frac, torch.stack([valid, inside])


@op("RoiAlign", foldable=False)
def roi_align(
    X: Tensor,
    rois: Tensor,
    batch_indices: Tensor,
    *,
    coordinate_transformation_mode: str | None = None,
    mode: str = "avg",
    output_height: int = 1,
    output_width: int = 1,
    sampling_ratio: int = 0,
    spatial_scale: float = 1.0,
    opset: int = 22,
) -> Tensor:
    """ONNX RoiAlign (see the module docstring): ``[rois, C, output_height, output_width]``."""
    if mode not in ("avg", "max"):
        raise LoweringError(f"RoiAlign: mode={mode!r} is not avg or max")
    ctm = coordinate_transformation_mode or ("half_pixel" if opset >= 16 else "output_half_pixel")
    if ctm not in ("half_pixel", "output_half_pixel"):
        raise LoweringError(f"RoiAlign: coordinate_transformation_mode={ctm!r}")
    height, width = X.shape[-2], X.shape[-1]
    r = rois.to(X.dtype) * spatial_scale - (0.5 if ctm == "half_pixel" else 0.0)
    start_w, start_h, end_w, end_h = r.unbind(-1)
    roi_w, roi_h = end_w - start_w, end_h - start_h
    if ctm == "output_half_pixel":
        roi_w, roi_h = roi_w.clamp(min=1.0), roi_h.clamp(min=1.0)
    bin_h, bin_w = roi_h / output_height, roi_w / output_width
    if sampling_ratio > 0:
        grid_h = torch.full_like(roi_h, sampling_ratio, dtype=torch.int64)
        grid_w = torch.full_like(roi_w, sampling_ratio, dtype=torch.int64)
    else:
        grid_h, grid_w = torch.ceil(bin_h).to(torch.int64), torch.ceil(bin_w).to(torch.int64)
    samples_h = int(grid_h.max()) if grid_h.numel() else 0
    samples_w = int(grid_w.max()) if grid_w.numel() else 0
    yl, yh, wy_l, wy_h, (vy, iny) = _axis_samples(start_h, bin_h, grid_h, output_height, samples_h, height)
    xl, xh, wx_l, wx_h, (vx, inx) = _axis_samples(start_w, bin_w, grid_w, output_width, samples_w, width)
    # [rois, PH, SH, PW, SW] broadcasting: y terms [R, PH, SH, 1, 1], x terms [R, 1, 1, PW, SW]
    ey = [t[:, :, :, None, None] for t in (yl, yh, wy_l, wy_h, vy, iny)]
    ex = [t[:, None, None, :, :] for t in (xl, xh, wx_l, wx_h, vx, inx)]
    feats = X[batch_indices.to(torch.int64)]  # [R, C, H, W]
    ridx = torch.arange(feats.shape[0], device=X.device).reshape(-1, 1, 1, 1, 1)

    def at(y: Tensor, x: Tensor) -> Tensor:  # [R, PH, SH, PW, SW, C]
        return feats[ridx, :, y, x]

    valid = (ey[4] & ex[4]).unsqueeze(-1)
    terms = [
        (ey[2] * ex[2]).unsqueeze(-1) * at(ey[0], ex[0]),
        (ey[2] * ex[3]).unsqueeze(-1) * at(ey[0], ex[1]),
        (ey[3] * ex[2]).unsqueeze(-1) * at(ey[1], ex[0]),
        (ey[3] * ex[3]).unsqueeze(-1) * at(ey[1], ex[1]),
    ]
    zero = torch.zeros((), dtype=X.dtype, device=X.device)
    inside = (ey[5] & ex[5]).unsqueeze(-1)
    if mode == "avg":
        value = torch.where(valid, terms[0] + terms[1] + terms[2] + terms[3], zero)
        count = (grid_h * grid_w).clamp(min=1).to(X.dtype).reshape(-1, 1, 1, 1)
        out = value.sum(dim=(2, 4)) / count
    else:
        value = torch.where(valid, torch.stack(terms).amax(0), zero)
        lowest = torch.full((), float("-inf"), dtype=X.dtype, device=X.device)
        out = torch.where(inside, value, lowest).amax(dim=(2, 4)) if samples_h and samples_w else None
        if out is None:
            out = X.new_zeros((rois.shape[0], output_height, output_width, X.shape[1]))
        out = torch.where(torch.isinf(out), zero, out)
    return out.permute(0, 3, 1, 2).contiguous()


__all__ = ["non_max_suppression", "roi_align"]
