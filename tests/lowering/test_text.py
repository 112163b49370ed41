"""TfIdfVectorizer (placement.lowering.ops.text) against ONNX Runtime on random token rows:
unigrams to trigrams with skips, TF, IDF and TF-IDF, with and without weights."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import placement as pl


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("min_gram, max_skip", [(1, 0), (1, 2), (2, 3)])
def test_tf_idf_vectorizer_matches_ort(mode: str, weighted: bool, min_gram: int, max_skip: int) -> None:
    rng = np.random.default_rng(5)
    x = rng.integers(0, 4, (3, 12)).astype(np.int64)
    unigrams = [0, 1, 3]
    bigrams = [0, 1, 1, 0, 2, 2, 3, 1]
    trigrams = [0, 1, 0, 1, 1, 2]
    pool = unigrams + bigrams + trigrams
    total = len(unigrams) + len(bigrams) // 2 + len(trigrams) // 3
    indexes = list(rng.permutation(total))
    attrs = dict(
        max_gram_length=3,
        min_gram_length=min_gram,
        max_skip_count=max_skip,
        mode=mode,
        ngram_counts=[0, len(unigrams), len(unigrams) + len(bigrams)],
        ngram_indexes=indexes,
        pool_int64s=pool,
    )
    if weighted:
        attrs["weights"] = list(rng.uniform(0.5, 2.0, total).astype(np.float32))
    node = helper.make_node("TfIdfVectorizer", ["X"], ["Y"], **attrs)
    graph = helper.make_graph(
        [node],
        "tfidf",
        [helper.make_tensor_value_info("X", TensorProto.INT64, list(x.shape))],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, total])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"X": x}
    )
    got = pl.to_torch(pl.load(model), device_map="cpu")(torch.from_numpy(x))
    assert want[0].any()
    np.testing.assert_allclose(got.numpy(), want[0], rtol=1e-6)
