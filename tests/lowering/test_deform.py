"""DeformConv (placement.lowering.ops.deform) against ONNX Runtime on random offsets (many
samples past the border), masks, groups, offset groups, strides, dilations and pads."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import placement as pl


@pytest.mark.parametrize(
    "group, offset_group, stride, dilation, with_mask",
    [(1, 1, 1, 1, False), (2, 2, 2, 1, True), (1, 2, 1, 2, True)],
)
def test_deform_conv_matches_ort(
    group: int, offset_group: int, stride: int, dilation: int, with_mask: bool
) -> None:
    rng = np.random.default_rng(group + 2 * offset_group)
    n, c, h, w, oc, k = 2, 4, 7, 6, 6, 3
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    weight = rng.standard_normal((oc, c // group, k, k)).astype(np.float32)
    bias = rng.standard_normal(oc).astype(np.float32)
    pads = [1, 0, 1, 2]
    oh = (h + pads[0] + pads[2] - (dilation * (k - 1) + 1)) // stride + 1
    ow = (w + pads[1] + pads[3] - (dilation * (k - 1) + 1)) // stride + 1
    offset = (rng.standard_normal((n, offset_group * 2 * k * k, oh, ow)) * 2).astype(np.float32)
    feeds = {"X": x, "offset": offset}
    names = ["X", "W", "offset", "B"]
    inputs = [
        helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x.shape)),
        helper.make_tensor_value_info("offset", TensorProto.FLOAT, list(offset.shape)),
    ]
    if with_mask:
        feeds["mask"] = rng.uniform(0, 1, (n, offset_group * k * k, oh, ow)).astype(np.float32)
        names.append("mask")
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, list(feeds["mask"].shape)))
    node = helper.make_node(
        "DeformConv",
        names,
        ["Y"],
        group=group,
        offset_group=offset_group,
        strides=[stride, stride],
        dilations=[dilation, dilation],
        pads=pads,
        kernel_shape=[k, k],
    )
    graph = helper.make_graph(
        [node],
        "deform",
        inputs,
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [n, oc, oh, ow])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    got = pl.to_torch(pl.load(model), device_map="cpu")(*[torch.from_numpy(v) for v in feeds.values()])
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-4, atol=1e-4)
