"""ai.onnx.ml Binarizer, ArrayFeatureExtractor and the tree ensembles against ONNX Runtime."""

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


# --- tree ensembles, hand-built as skl2onnx writes them -----------------------------------------

# Two trees over 3 features: tree 0 splits feature 0 then 2, tree 1 splits feature 1 (LT).
_NODES = dict(
    nodes_treeids=[0, 0, 0, 0, 0, 1, 1, 1],
    nodes_nodeids=[0, 1, 2, 3, 4, 0, 1, 2],
    nodes_featureids=[0, 2, 0, 0, 0, 1, 0, 0],
    nodes_values=[0.25, -0.5, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0],
    nodes_modes=["BRANCH_LEQ", "BRANCH_GT", "LEAF", "LEAF", "LEAF", "BRANCH_LT", "LEAF", "LEAF"],
    nodes_truenodeids=[1, 3, 0, 0, 0, 1, 0, 0],
    nodes_falsenodeids=[2, 4, 0, 0, 0, 2, 0, 0],
    nodes_missing_value_tracks_true=[1, 0, 0, 0, 0, 0, 0, 0],
)
_LEAVES = [(0, 2), (0, 3), (0, 4), (1, 1), (1, 2)]


def _tree_input() -> np.ndarray:
    x = np.random.default_rng(2).standard_normal((12, 3)).astype(np.float32)
    x[0, 0] = 0.25  # on a threshold
    x[1, 0] = np.nan  # missing: tracks the true branch
    x[2, 1] = np.nan  # missing: the false branch
    return x


def _tree_compare(node, outputs: list) -> None:
    x = _tree_input()
    graph = helper.make_graph(
        [node], "trees", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 3])], outputs
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"X": x}
    )
    got = pl.to_torch(pl.load(model), device_map="cpu")(torch.from_numpy(x))
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == torch.from_numpy(w).dtype
        np.testing.assert_allclose(g.detach().numpy(), w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("aggregate", "transform", "targets"),
    [("SUM", "NONE", 1), ("AVERAGE", "NONE", 2), ("SUM", "LOGISTIC", 2), ("SUM", "SOFTMAX", 2)],
)
def test_tree_ensemble_regressor_matches_ort(aggregate: str, transform: str, targets: int) -> None:
    weights = np.random.default_rng(3).standard_normal((len(_LEAVES), targets)).astype(np.float32)
    entries = [(t, n, k, float(weights[i, k])) for i, (t, n) in enumerate(_LEAVES) for k in range(targets)]
    node = helper.make_node(
        "TreeEnsembleRegressor", ["X"], ["Y"], domain="ai.onnx.ml", **_NODES,
        target_treeids=[e[0] for e in entries], target_nodeids=[e[1] for e in entries],
        target_ids=[e[2] for e in entries], target_weights=[e[3] for e in entries],
        n_targets=targets, aggregate_function=aggregate, post_transform=transform,
        base_values=[0.5] * targets,
    )  # fmt: skip
    _tree_compare(node, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, targets])])


@pytest.mark.parametrize("transform", ["NONE", "SOFTMAX", "LOGISTIC"])
def test_tree_ensemble_classifier_matches_ort(transform: str) -> None:
    probs = np.random.default_rng(4).random((len(_LEAVES), 3)).astype(np.float32)
    entries = [(t, n, k, float(probs[i, k])) for i, (t, n) in enumerate(_LEAVES) for k in range(3)]
    node = helper.make_node(
        "TreeEnsembleClassifier", ["X"], ["label", "scores"], domain="ai.onnx.ml", **_NODES,
        class_treeids=[e[0] for e in entries], class_nodeids=[e[1] for e in entries],
        class_ids=[e[2] for e in entries], class_weights=[e[3] for e in entries],
        classlabels_int64s=[7, 8, 9], post_transform=transform,
    )  # fmt: skip
    outputs = [
        helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
        helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 3]),
    ]
    _tree_compare(node, outputs)


def test_tree_ensemble_refusals_name_the_op() -> None:
    node = helper.make_node(
        "TreeEnsembleRegressor", ["X"], ["Y"], domain="ai.onnx.ml", **_NODES, target_treeids=[0],
        target_nodeids=[2], target_ids=[0], target_weights=[1.0], aggregate_function="MIN",
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "trees",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 1])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)]
    model = pl.load(helper.make_model(graph, opset_imports=opsets, ir_version=8))
    with pytest.raises(pl.LoweringError, match="TreeEnsembleRegressor.*MIN"):
        pl.to_torch(model, device_map="cpu")(torch.from_numpy(_tree_input()))


@pytest.mark.parametrize(("aggregate", "transform"), [(1, 0), (0, 0), (1, 2)])
def test_opset5_tree_ensemble_matches_ort(aggregate: int, transform: int) -> None:
    # tree 0: x0 <= 0.25 ? (x2 in {1, 2} ? leaf 0 : leaf 1) : leaf 2; tree 1: x1 < 0.1 ? leaf 3 : leaf 4
    node = helper.make_node(
        "TreeEnsemble", ["X"], ["Y"], domain="ai.onnx.ml",
        nodes_featureids=[0, 2, 1], nodes_modes=numpy_helper.from_array(np.array([0, 6, 1], np.uint8)),
        nodes_splits=numpy_helper.from_array(np.array([0.25, 0.0, 0.1], np.float32)),
        nodes_truenodeids=[1, 0, 3], nodes_trueleafs=[0, 1, 1],
        nodes_falsenodeids=[2, 1, 4], nodes_falseleafs=[1, 1, 1],
        nodes_missing_value_tracks_true=[1, 0, 0],
        membership_values=numpy_helper.from_array(np.array([1.0, 2.0, np.nan], np.float32)),
        tree_roots=[0, 2], leaf_targetids=[0, 1, 0, 1, 0],
        leaf_weights=numpy_helper.from_array(np.array([1.5, -2.0, 0.25, 3.0, -0.5], np.float32)),
        n_targets=2, aggregate_function=aggregate, post_transform=transform,
    )  # fmt: skip
    x = _tree_input()
    x[3:6, 2] = [1.0, 2.0, 3.0]  # members and not
    graph = helper.make_graph(
        [node],
        "trees",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 2])],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("ai.onnx.ml", 5)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 - an ONNX Runtime without ai.onnx.ml opset 5
        pytest.skip(f"ONNX Runtime lacks TreeEnsemble: {err}")
    want = session.run(None, {"X": x})[0]
    if transform:  # ORT reads the codes 1/2 swapped against the specification: refused
        with pytest.raises(pl.LoweringError, match="TreeEnsemble: post_transform=2"):
            pl.to_torch(pl.load(model), device_map="cpu")(torch.from_numpy(x))
        return
    got = pl.to_torch(pl.load(model), device_map="cpu")(torch.from_numpy(x))
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-6, atol=1e-6)
