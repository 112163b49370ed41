"""TensorScatter (opset 24, placement.lowering.ops.attention) against ONNX Runtime: a KV cache
updated in place per batch row, linear and circular (wrapping), on several axes."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import placement as pl
from placement.errors import LoweringError
from placement.lowering.ops.attention import tensor_scatter


@pytest.mark.parametrize("mode, axis", [("linear", -2), ("circular", -2), ("circular", 1), ("linear", 3)])
def test_tensor_scatter_matches_ort(mode: str, axis: int) -> None:
    rng = np.random.default_rng(0)
    past = rng.standard_normal((3, 4, 6, 5)).astype(np.float32)
    update_shape = list(past.shape)
    update_shape[axis] = 2 if axis != 1 else 3
    update = rng.standard_normal(update_shape).astype(np.float32)
    limit = past.shape[axis] - update_shape[axis] + (3 if mode == "circular" else 1)
    indices = rng.integers(0, limit, 3).astype(np.int64)
    node = helper.make_node("TensorScatter", ["past", "update", "idx"], ["present"], axis=axis, mode=mode)
    inputs = [
        helper.make_tensor_value_info("past", TensorProto.FLOAT, list(past.shape)),
        helper.make_tensor_value_info("update", TensorProto.FLOAT, update_shape),
        helper.make_tensor_value_info("idx", TensorProto.INT64, [3]),
    ]
    out = [helper.make_tensor_value_info("present", TensorProto.FLOAT, list(past.shape))]
    graph = helper.make_graph([node], "scatter", inputs, out)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)
    feeds = {"past": past, "update": update, "idx": indices}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    got = pl.to_torch(pl.load(model), device_map="cpu")(*[torch.from_numpy(v) for v in feeds.values()])
    np.testing.assert_array_equal(got.detach().numpy(), want)
    assert not np.array_equal(want, past)


def test_tensor_scatter_refuses_batch_axis() -> None:
    with pytest.raises(LoweringError, match="batch"):
        tensor_scatter(torch.zeros(2, 3), torch.zeros(2, 1), axis=0)
