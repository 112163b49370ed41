"""ai.onnx.ml Binarizer and ArrayFeatureExtractor (placement.lowering.ops.ml) against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import placement as pl


def _compare(node, x: np.ndarray, out_shape: list, inits: list) -> None:
    graph = helper.make_graph(
        [node],
        "ml",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, out_shape)],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"X": x}
    )
    got = pl.to_torch(pl.load(model), device_map="cpu")(torch.from_numpy(x))
    np.testing.assert_array_equal(got.detach().numpy(), want[0])


def test_binarizer_matches_ort() -> None:
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    x[0, 0] = 0.25  # on the threshold: not above it
    _compare(helper.make_node("Binarizer", ["X"], ["Y"], domain="ai.onnx.ml", threshold=0.25), x, [3, 5], [])


@pytest.mark.parametrize("shape", [(6,), (2, 6), (2, 3, 6)])
def test_array_feature_extractor_matches_ort(shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    indices = numpy_helper.from_array(np.array([4, 0, 4, 2], np.int64), "indices")
    node = helper.make_node("ArrayFeatureExtractor", ["X", "indices"], ["Y"], domain="ai.onnx.ml")
    out = [1, 4] if len(shape) == 1 else [*shape[:-1], 4]
    _compare(node, x, out, [indices])
