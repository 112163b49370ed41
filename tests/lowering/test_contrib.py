"""``to_torch`` of ONNX Runtime's LLM ops equals ONNX Runtime (its CPU kernels), op by op.

Each case is one node, with random inputs, run by ORT and by the lowered module
(through ``pl.load`` and ``pl.to_torch``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import placement as pl
from placement.lowering.ops import get_rule

RNG = np.random.default_rng(0)
ONNX_TYPE = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int32): TensorProto.INT32,
             np.dtype(np.int64): TensorProto.INT64, np.dtype(np.uint8): TensorProto.UINT8}  # fmt: skip
MS = "com.microsoft"


def _model(op_type: str, inputs: list[tuple[str, np.ndarray | None]], outputs: list[str], *, domain: str = MS,
           initializers: dict[str, np.ndarray] | None = None, **attrs: Any) -> onnx.ModelProto:  # fmt: skip
    """One node; ``inputs`` in the op's order (``None``: an omitted optional input)."""
    initializers = initializers or {}
    names = [name if value is not None or name in initializers else "" for name, value in inputs]
    node = helper.make_node(op_type, names, outputs, name="the_op", domain=domain, **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, ONNX_TYPE[v.dtype], v.shape) for n, v in inputs if v is not None],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs if o],
        [numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    opsets = [helper.make_opsetid("", 22), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _compare(model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, atol: float = 1e-5,
             rows: Any = None) -> list[np.ndarray]:  # fmt: skip
    """ORT's outputs and the lowered module's, equal to ``atol`` (the first output on ``rows`` only)."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    for out, value in zip(model.graph.output, want):  # ORT needs no output shapes; onnx's checker does
        out.type.CopyFrom(helper.make_tensor_type_proto(ONNX_TYPE[value.dtype], value.shape))
    module = pl.to_torch(pl.load(model), device_map="cpu")
    with torch.no_grad():
        got = module(*[torch.from_numpy(v) for v in feeds.values()])
    got = [t.numpy() for t in (got if isinstance(got, tuple) else (got,))]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        if i == 0 and rows is not None:
            g, w = g[rows], w[rows]
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=atol, err_msg=f"output {i}")
    return want


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("axis", [-1, 1])
def test_simplified_layer_normalization(axis):
    x, scale = _f(2, 3, 8), _f(*((8,) if axis == -1 else (3, 8)))
    model = _model("SimplifiedLayerNormalization", [("x", x), ("scale", scale)], ["y", "inv"], domain="",
                   axis=axis, epsilon=1e-3)  # fmt: skip
    _compare(model, {"x": x, "scale": scale})


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_simplified_layer_normalization(with_bias):
    x, skip, gamma = _f(2, 5, 16), _f(2, 5, 16), _f(16)
    bias = _f(16) if with_bias else None
    inputs = [("x", x), ("skip", skip), ("gamma", gamma), ("bias", bias)]
    model = _model("SkipSimplifiedLayerNormalization", inputs, ["y", "", "", "sum"], epsilon=1e-5)
    feeds = {n: v for n, v in inputs if v is not None}
    _compare(model, feeds)


def _nbits_weights(n: int, k: int, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    blocks = -(-k // block)
    packed = RNG.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
    scales = (RNG.random((n, blocks)) * 0.2 + 0.01).astype(np.float32)
    return packed, scales


@pytest.mark.parametrize(
    ("bits", "k", "block", "zero", "accuracy"),
    [(4, 64, 32, "none", 0), (4, 64, 32, "none", 4), (4, 40, 16, "packed", 4), (4, 48, 16, "float", 0),
     (8, 64, 32, "packed", 0), (2, 64, 16, "packed", 0)],
)  # fmt: skip
def test_matmul_nbits(bits, k, block, zero, accuracy):
    n = 24
    packed, scales = _nbits_weights(n, k, bits, block)
    blocks = scales.shape[1]
    zeros = None
    if zero == "packed":
        zeros = RNG.integers(0, 256, (n, -(-blocks * bits // 8)), dtype=np.uint8)
    elif zero == "float":
        zeros = RNG.integers(0, 1 << bits, (n, blocks)).astype(np.float32)
    bias = _f(n)
    a = _f(2, 3, k)
    inits = {"B": packed, "scales": scales, "bias": bias} | ({"zp": zeros} if zeros is not None else {})
    inputs = [("A", a), ("B", None), ("scales", None), ("zp", None), ("g_idx", None), ("bias", None)]
    model = _model("MatMulNBits", inputs, ["y"], initializers=inits, K=k, N=n, bits=bits, block_size=block,
                   accuracy_level=accuracy)  # fmt: skip
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as err:  # an ORT build without this kernel (2-bit) is no reference
        pytest.skip(f"ONNX Runtime has no CPU kernel for this MatMulNBits: {str(err)[:80]}")
    _compare(model, {"A": a}, atol=1e-4)


def test_matmul_nbits_accuracy_level_4_quantizes_a_like_ort():
    """At accuracy level 4 ORT's CPU kernel quantizes A to int8: float dequantization alone differs."""
    n, k, block = 16, 64, 32
    packed, scales = _nbits_weights(n, k, 4, block)
    a = _f(4, k) * 3
    inputs = [("A", a), ("B", None), ("scales", None)]
    inits = {"B": packed, "scales": scales}
    model = _model("MatMulNBits", inputs, ["y"], initializers=inits, K=k, N=n, bits=4, block_size=block,
                   accuracy_level=4)  # fmt: skip
    want = _compare(model, {"A": a}, atol=1e-4)[0]
    rule = get_rule("MatMulNBits", MS).fn
    weights = torch.from_numpy(packed), torch.from_numpy(scales)
    plain = rule(torch.from_numpy(a), *weights, K=k, N=n, block_size=block)
    assert np.abs(plain.numpy() - want).max() > 1e-3  # so the emulation is what matches


def _gqa_case(batch: int, seq: int, past: int, seqlens: list[int], *, packed: bool, rotary: bool,
              **attrs: Any) -> tuple[onnx.ModelProto, dict[str, np.ndarray], Any]:  # fmt: skip
    heads, kv_heads, size = 4, 2, 16
    total = max(seqlens) + 1
    q = _f(batch, seq, heads * size)
    k, v = _f(batch, seq, kv_heads * size), _f(batch, seq, kv_heads * size)
    if packed:
        q, k, v = np.concatenate([q, k, v], axis=2), None, None
    past_k = _f(batch, kv_heads, past, size) if past else np.zeros((batch, kv_heads, 0, size), np.float32)
    past_v = _f(batch, kv_heads, past, size) if past else np.zeros((batch, kv_heads, 0, size), np.float32)
    inits = {}
    if rotary:
        angles = np.arange(32)[:, None] * (1.0 / 10000 ** (np.arange(0, size, 2) / size))[None]
        inits = {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
    inputs = [("q", q), ("k", k), ("v", v), ("past_k", past_k), ("past_v", past_v),
              ("seqlens", np.array(seqlens, np.int32)), ("total", np.array(total, np.int32)),
              ("cos", None), ("sin", None)]  # fmt: skip
    model = _model("GroupQueryAttention", inputs, ["out", "present_k", "present_v"], initializers=inits,
                   num_heads=heads, kv_num_heads=kv_heads, do_rotary=int(rotary), **attrs)  # fmt: skip
    feeds = {n: v for n, v in inputs if v is not None}
    rows = None
    if past == 0 and min(seqlens) + 1 < seq:  # padded prompt rows: ORT leaves them undefined
        rows = (np.arange(batch)[:, None], np.arange(min(seqlens) + 1)[None, :])
    return model, feeds, rows


@pytest.mark.parametrize(
    ("batch", "seq", "past", "seqlens", "packed", "rotary", "attrs"),
    [
        (1, 6, 0, [5], True, True, {}),  # a prompt, packed QKV, rotary inside
        (2, 5, 0, [4, 2], False, True, {"rotary_interleaved": 1}),  # right-padded prompts
        (2, 1, 5, [5, 3], True, True, {}),  # a decode step, sequences of different lengths
        (1, 1, 7, [7], False, False, {"softcap": 2.0}),
        (1, 7, 0, [6], True, False, {"local_window_size": 3}),
        (1, 1, 8, [8], True, True, {"local_window_size": 3, "scale": 0.3}),
        (1, 3, 4, [6], True, True, {}),  # a later prompt chunk on a cache
        (1, 4, 0, [3], False, False, {"smooth_softmax": 1}),
    ],
)
def test_group_query_attention(batch, seq, past, seqlens, packed, rotary, attrs):
    model, feeds, rows = _gqa_case(batch, seq, past, seqlens, packed=packed, rotary=rotary, **attrs)
    _compare(model, feeds, rows=rows)


def test_group_query_attention_refuses_what_it_does_not_implement():
    model, _, _ = _gqa_case(1, 2, 0, [1], packed=True, rotary=False, qk_output=1)
    for out in model.graph.output:
        out.type.CopyFrom(helper.make_tensor_type_proto(TensorProto.FLOAT, [1, 2, 1, 1]))
    with pytest.raises(pl.LoweringError, match="qk_output"):
        pl.to_torch(pl.load(model), device_map="cpu")


@pytest.mark.parametrize(
    ("shape", "positions", "attrs"),
    [((2, 5, 64), "rows", {"num_heads": 4}), ((2, 5, 64), "start", {"interleaved": 1}),
     ((2, 4, 5, 16), "rows", {}), ((2, 5, 64), "rows", {"num_heads": 4, "rotary_embedding_dim": 8})],
)  # fmt: skip
def test_com_microsoft_rotary_embedding(shape, positions, attrs):
    x = _f(*shape)
    seq = shape[2] if len(shape) == 4 else shape[1]
    half = attrs.get("rotary_embedding_dim", 16) // 2
    angles = np.arange(16)[:, None] * (1.0 / 100 ** (np.arange(half) / half))[None]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    pos = np.array([3], np.int64) if positions == "start" else RNG.integers(0, 16, (shape[0], seq))
    inputs = [("x", x), ("pos", pos.astype(np.int64)), ("cos", cos), ("sin", sin)]
    model = _model("RotaryEmbedding", inputs, ["y"], **attrs)
    _compare(model, {n: v for n, v in inputs})


@pytest.mark.parametrize("case", ["plain", "bias_mask", "causal_past", "attention_bias"])
def test_multi_head_attention(case):
    batch, seq, heads, size = 2, 4, 2, 8
    hidden = heads * size
    q, k, v = _f(batch, seq, hidden), _f(batch, seq, hidden), _f(batch, seq, hidden)
    inputs: list[tuple[str, Any]] = [("q", q), ("k", k), ("v", v)]
    attrs: dict[str, Any] = {"num_heads": heads}
    outputs = ["out"]
    if case == "bias_mask":
        mask = np.ones((batch, seq), np.int32)
        mask[1, -2:] = 0
        inputs += [("bias", _f(3 * hidden)), ("mask", mask)]
    elif case == "causal_past":
        inputs += [("bias", None), ("mask", None), ("attn_bias", None),
                   ("past_k", _f(batch, heads, 3, size)), ("past_v", _f(batch, heads, 3, size))]  # fmt: skip
        attrs["unidirectional"] = 1
        outputs = ["out", "present_k", "present_v"]
    elif case == "attention_bias":
        inputs += [("bias", None), ("mask", None), ("attn_bias", _f(1, heads, seq, seq))]
        attrs["scale"] = 0.2
    model = _model("MultiHeadAttention", inputs, outputs, **attrs)
    _compare(model, {n: v for n, v in inputs if v is not None})


def test_matmul_nbits_dequantizes_a_weight_once_and_again_when_it_changes():
    n, k, block = 8, 32, 32
    packed, scales = (torch.from_numpy(t) for t in _nbits_weights(n, k, 4, block))
    a = torch.from_numpy(_f(2, k))
    rule = get_rule("MatMulNBits", MS).fn
    with torch.no_grad():
        first = rule(a, packed, scales, K=k, N=n, block_size=block)
        again = rule(a, packed, scales, K=k, N=n, block_size=block)
        torch.testing.assert_close(again, first)
        scales.mul_(2)  # in place: the cached weight is stale
        doubled = rule(a, packed, scales, K=k, N=n, block_size=block)
    torch.testing.assert_close(doubled, 2 * first)
    trained = torch.nn.Parameter(scales.clone())
    out = rule(a, packed, trained, K=k, N=n, block_size=block)
    out.sum().backward()  # a weight with a gradient path is never cached
    assert trained.grad is not None and trained.grad.abs().sum() > 0
    rule(a, packed, trained, K=k, N=n, block_size=block).sum().backward()
