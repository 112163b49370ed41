"""ONNX's own LLM ops (opset 23/24 ``Attention``, ``RotaryEmbedding``, ``RMSNormalization``)
lowered as ONNX Runtime computes them: each case runs in ORT and through ``pl.to_torch``.

The node suite's cases of these ops run in ``tests/conformance``; these add random
inputs over the attribute combinations LLM files use, with ORT as the reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

import placement as pl

RNG = np.random.default_rng(1)
TYPES = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(bool): onnx.TensorProto.BOOL,
         np.dtype(np.int64): onnx.TensorProto.INT64}  # fmt: skip
B, HQ, HK, S, L, D = 2, 4, 2, 3, 5, 8


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _same_as_ort(op_type: str, inputs: list[tuple[str, np.ndarray | None]], n_out: int, opset: int,
                 **attrs: Any) -> None:  # fmt: skip
    names = [name if value is not None else "" for name, value in inputs]
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op_type, names, outs, name="the_op", **attrs)
    feeds = {n: v for n, v in inputs if v is not None}
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TYPES[v.dtype], v.shape) for n, v in feeds.items()],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as err:  # an older ONNX Runtime without this opset is no reference
        pytest.skip(f"ONNX Runtime cannot build {op_type}-{opset}: {str(err)[:100]}")
    want = session.run(None, feeds)
    for out, value in zip(model.graph.output, want):
        out.type.CopyFrom(helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, value.shape))
    module = pl.to_torch(pl.load(model), device_map="cpu")
    with torch.no_grad():
        got = module(*[torch.from_numpy(v) for v in feeds.values()])
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis", [-1, 1, 0])
def test_rms_normalization(axis):
    x = _f(2, 3, 8)
    scale = _f(*x.shape[axis:]) if axis >= 0 else _f(8)
    _same_as_ort("RMSNormalization", [("x", x), ("scale", scale)], 1, 23, axis=axis, epsilon=1e-3)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [0, 8])
@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("positions", [True, False])
def test_rotary_embedding(interleaved, rotary_dim, rank, positions):
    half = (rotary_dim or 16) // 2
    x, attrs = (_f(2, 3, 5, 16), {}) if rank == 4 else (_f(2, 5, 48), {"num_heads": 3})
    if positions:
        caches = [("cos", _f(10, half)), ("sin", _f(10, half)), ("pos", RNG.integers(0, 10, (2, 5)))]
    else:
        caches = [("cos", _f(2, 5, half)), ("sin", _f(2, 5, half))]
    _same_as_ort("RotaryEmbedding", [("x", x), *caches], 1, 23, interleaved=interleaved,
                 rotary_embedding_dim=rotary_dim, **attrs)  # fmt: skip


def _qkv() -> list[tuple[str, np.ndarray | None]]:
    return [("q", _f(B, HQ, S, D)), ("k", _f(B, HK, L, D)), ("v", _f(B, HK, L, D))]


def _past(mask: np.ndarray | None) -> list[tuple[str, np.ndarray | None]]:
    return [("mask", mask), ("past_k", _f(B, HK, 2, D)), ("past_v", _f(B, HK, 2, D))]


ATTENTION_CASES = {
    "plain": (23, 1, [], {}),
    "causal": (23, 1, [], {"is_causal": 1}),
    "bool_mask": (23, 1, [("mask", RNG.random((S, L)) > 0.3)], {}),
    "float_mask_4d": (23, 1, [("mask", _f(B, 1, S, L))], {}),
    "fully_masked_row": (23, 1, [("mask", np.zeros((S, L), bool))], {}),
    "kv_cache_causal": (23, 3, _past(None), {"is_causal": 1}),
    "kv_cache_mask": (23, 3, _past(_f(S, L + 2)), {}),
    "softcap": (23, 1, [], {"softcap": 2.0}),
    "scale": (23, 1, [], {"scale": 0.3}),
    "softmax_precision": (23, 1, [], {"softmax_precision": 1}),
    **{f"qk_output_{m}": (23, 4, _past(_f(S, L + 2)), {"qk_matmul_output_mode": m}) for m in range(4)},
    "nonpad_kv_seqlen": (24, 1, [("mask", None), ("pk", None), ("pv", None), ("n", np.array([5, 3]))], {}),
    "nonpad_causal": (24, 1, [("mask", None), ("pk", None), ("pv", None), ("n", np.array([5, 3]))],
                      {"is_causal": 1}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_attention(case):
    opset, n_out, extra, attrs = ATTENTION_CASES[case]
    _same_as_ort("Attention", _qkv() + extra, n_out, opset, **attrs)


@pytest.mark.parametrize("causal", [0, 1])
def test_attention_3d_grouped_query(causal):
    inputs = [("q", _f(B, S, HQ * D)), ("k", _f(B, L, HK * D)), ("v", _f(B, L, HK * D))]
    _same_as_ort("Attention", inputs, 1, 23, q_num_heads=HQ, kv_num_heads=HK, is_causal=causal)
