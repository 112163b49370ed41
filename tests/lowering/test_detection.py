"""NonMaxSuppression and RoiAlign (placement.lowering.ops.detection) against ONNX Runtime on
random inputs: overlapping boxes with tied scores, flipped corners and center format; rois
partly outside the map, avg and max, both coordinate modes, fixed and adaptive sampling."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import placement as pl


def _run_both(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[list, list]:
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
    module = pl.to_torch(pl.load(model), device_map="cpu")
    got = module(*[torch.from_numpy(v) for v in feeds.values()])
    got = got if isinstance(got, tuple) else (got,)
    return [g.detach().numpy() for g in got], want


@pytest.mark.parametrize("center_point_box", [0, 1])
@pytest.mark.parametrize("score_threshold", [None, 0.3])
def test_non_max_suppression_matches_ort(center_point_box: int, score_threshold: float | None) -> None:
    rng = np.random.default_rng(center_point_box)
    batches, classes, count = 2, 3, 40
    corners = rng.uniform(0, 10, (batches, count, 4)).astype(np.float32)
    if center_point_box:
        corners[..., 2:] = rng.uniform(0.5, 4, (batches, count, 2))
    corners[:, 5] = corners[:, 4]  # identical boxes
    scores = rng.choice(np.linspace(0, 1, 11, dtype=np.float32), (batches, classes, count))  # ties
    inits = [
        numpy_helper.from_array(np.array([7], np.int64), "max_boxes"),
        numpy_helper.from_array(np.array([0.4], np.float32), "iou"),
    ]
    names = ["boxes", "scores", "max_boxes", "iou"]
    if score_threshold is not None:
        inits.append(numpy_helper.from_array(np.array([score_threshold], np.float32), "score"))
        names.append("score")
    node = helper.make_node("NonMaxSuppression", names, ["selected"], center_point_box=center_point_box)
    graph = helper.make_graph(
        [node],
        "nms",
        [
            helper.make_tensor_value_info("boxes", TensorProto.FLOAT, list(corners.shape)),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, list(scores.shape)),
        ],
        [helper.make_tensor_value_info("selected", TensorProto.INT64, [None, 3])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    (got,), (want,) = _run_both(model, {"boxes": corners, "scores": scores})
    assert len(want) > 10
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("sampling_ratio", [0, 2])
def test_roi_align_matches_ort(mode: str, ctm: str, sampling_ratio: int) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 10, 12)).astype(np.float32)
    starts = rng.uniform(-3, 10, (6, 2))
    sizes = rng.uniform(0.2, 9, (6, 2))
    rois = np.concatenate([starts, starts + sizes], 1).astype(np.float32)
    batch = np.array([0, 1, 1, 0, 1, 0], np.int64)
    node = helper.make_node(
        "RoiAlign",
        ["X", "rois", "batch"],
        ["Y"],
        mode=mode,
        coordinate_transformation_mode=ctm,
        output_height=3,
        output_width=4,
        sampling_ratio=sampling_ratio,
        spatial_scale=0.9,
    )
    graph = helper.make_graph(
        [node],
        "roialign",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [6, 3, 3, 4])],
        [numpy_helper.from_array(rois, "rois"), numpy_helper.from_array(batch, "batch")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)], ir_version=8)
    (got,), (want,) = _run_both(model, {"X": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
