"""MaxPool's ``Indices`` output, row-major and column-major (``storage_order=1``), against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import placement as pl


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("shape, kernel", [((2, 3, 5, 7), [2, 3]), ((1, 2, 4, 5, 6), [2, 2, 3])])
def test_max_pool_indices_match_ort(storage_order: int, shape: tuple[int, ...], kernel: list[int]) -> None:
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    strides = [1] * (len(shape) - 4) + [2, 2]
    node = helper.make_node(
        "MaxPool", ["X"], ["Y", "I"], kernel_shape=kernel, strides=strides, storage_order=storage_order
    )
    graph = helper.make_graph(
        [node],
        "pool",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(shape))],
        [
            helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None] * len(shape)),
            helper.make_tensor_value_info("I", TensorProto.INT64, [None] * len(shape)),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)], ir_version=8)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"X": x}
    )
    got = pl.to_torch(pl.load(model), device_map="cpu")(torch.from_numpy(x))
    np.testing.assert_array_equal(got[0].detach().numpy(), want[0])
    np.testing.assert_array_equal(got[1].numpy(), want[1])
