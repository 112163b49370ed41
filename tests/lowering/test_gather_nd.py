"""GatherND with ``batch_dims`` (placement.lowering.ops.shape) against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import placement as pl


@pytest.mark.parametrize(
    "data_shape, index_shape, batch_dims",
    [((2, 3, 4), (2, 5, 1), 1), ((2, 3, 4, 5), (2, 3, 2, 1), 2), ((2, 3, 4, 5), (2, 2, 2), 1)],
)
def test_gather_nd_batch_dims_matches_ort(data_shape, index_shape, batch_dims) -> None:
    rng = np.random.default_rng(0)
    data = rng.standard_normal(data_shape).astype(np.float32)
    k = index_shape[-1]
    bounds = data_shape[batch_dims : batch_dims + k]
    indices = np.stack([rng.integers(-b, b, index_shape[:-1]) for b in bounds], -1).astype(np.int64)
    out_shape = [*index_shape[:-1], *data_shape[batch_dims + k :]]
    node = helper.make_node("GatherND", ["data", "indices"], ["Y"], batch_dims=batch_dims)
    graph = helper.make_graph(
        [node],
        "gathernd",
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT, list(data_shape)),
            helper.make_tensor_value_info("indices", TensorProto.INT64, list(index_shape)),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, out_shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    feeds = {"data": data, "indices": indices}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
    got = pl.to_torch(pl.load(model), device_map="cpu")(torch.from_numpy(data), torch.from_numpy(indices))
    np.testing.assert_array_equal(got.detach().numpy(), want[0])
