"""split_tensor_parallel on attention ops: ONNX ``Attention`` and ONNX Runtime's
``MultiHeadAttention`` / ``GroupQueryAttention``, split by heads with their KV caches.

Each graph is a projection (packed or separate QKV), the attention op with a past KV cache,
and an output projection; the split graph's outputs (the projection and the present caches)
equal the unsplit graph's in ONNX Runtime (2 or more emulated devices, one session each) and
through ``pl.to_torch``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

import placement as pl
from placement.graph import to_proto
from placement.graph.nodes import collective_tag
from placement.passes.tensor_parallel.heads import head_plan

E = 16  # the model width
MS = "com.microsoft"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-12))


class _Graph:
    """A tiny graph under construction: inputs, weights, nodes, typed values."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self.infos: list[onnx.ValueInfoProto] = []

    def input(self, name: str, shape: list, dtype: int = TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def weight(self, name: str, shape: tuple[int, ...], scale: float = 0.3) -> str:
        data = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        self.inits.append(onnx.numpy_helper.from_array(data, name))
        return name

    def node(
        self, op: str, inputs: list[str], outputs: list[tuple[str, list]], domain: str = "", **attrs
    ) -> None:
        names = [o for o, _ in outputs]
        node = helper.make_node(op, inputs, names, name=f"{op}_{len(self.nodes)}", domain=domain, **attrs)
        self.nodes.append(node)
        for name, shape in outputs:
            if shape is not None:
                self.infos.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))

    def output(self, name: str, shape: list) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))

    def model(self) -> pl.Model:
        graph = helper.make_graph(self.nodes, "attention", self.inputs, self.outputs, self.inits)
        graph.value_info.extend(i for i in self.infos if i.name not in {o.name for o in self.outputs})
        proto = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(MS, 1)], ir_version=10
        )
        return pl.load(proto)


def _outs(hidden: int, kv: int, size: int) -> list[tuple[str, list]]:
    """The attention output and the present key and value, with their shapes."""
    cache = ["B", kv, "T", size]
    return [("attn", ["B", "S", hidden]), ("present_key", cache), ("present_value", cache)]


def _rotary_caches(g: _Graph, size: int) -> list[str]:
    angles = np.arange(32)[:, None] * (1.0 / 10000 ** (np.arange(size // 2) / (size // 2)))[None]
    for name, fn in (("cos_cache", np.cos), ("sin_cache", np.sin)):
        g.inits.append(onnx.numpy_helper.from_array(fn(angles).astype(np.float32), name))
    return ["cos_cache", "sin_cache"]


def _rotate(g: _Graph, name: str, heads: int, hidden: int, domain: str) -> str:
    """``name`` through a ``RotaryEmbedding`` op (ONNX's or ``com.microsoft``'s) at ``position_ids``."""
    inputs = ([name, "position_ids", "cos_cache", "sin_cache"] if domain == MS
              else [name, "cos_cache", "sin_cache", "position_ids"])  # fmt: skip
    g.node("RotaryEmbedding", inputs, [(f"{name}_rot", ["B", "S", hidden])], domain=domain, num_heads=heads)
    return f"{name}_rot"


def _gqa(
    heads: int, kv: int, size: int = 16, *, packed: bool = True, rotary: bool = True, rotary_op: bool = False
) -> pl.Model:
    g = _Graph()
    x = g.input("x", ["B", "S", E])
    past_k = g.input("past_key", ["B", kv, "P", size])
    past_v = g.input("past_value", ["B", kv, "P", size])
    seqlens = g.input("seqlens_k", ["B"], TensorProto.INT32)
    total = g.input("total_sequence_length", [], TensorProto.INT32)
    qkv = []
    if packed:
        g.node(
            "MatMul",
            [x, g.weight("w_qkv", (E, (heads + 2 * kv) * size))],
            [("qkv", ["B", "S", (heads + 2 * kv) * size])],
        )
        qkv = ["qkv", "", ""]
    else:
        if rotary_op:
            g.input("position_ids", ["B", "S"], TensorProto.INT64)
            _rotary_caches(g, size)
        for name, n in (("q", heads), ("k", kv), ("v", kv)):
            g.node("MatMul", [x, g.weight(f"w_{name}", (E, n * size))], [(name, ["B", "S", n * size])])
            qkv.append(_rotate(g, name, n, n * size, MS) if rotary_op and name != "v" else name)
    cos_sin = ["", ""]
    if rotary and not rotary_op:
        cos_sin = _rotary_caches(g, size)
    g.node(
        "GroupQueryAttention",
        [*qkv, past_k, past_v, seqlens, total, *cos_sin],
        _outs(heads * size, kv, size),
        domain=MS, num_heads=heads, kv_num_heads=kv, do_rotary=int(rotary and not rotary_op),
    )  # fmt: skip
    g.node("MatMul", ["attn", g.weight("w_o", (heads * size, E))], [("y", ["B", "S", E])])
    g.output("y", ["B", "S", E])
    g.output("present_key", ["B", kv, "T", size])
    g.output("present_value", ["B", kv, "T", size])
    return g.model()


def _mha(heads: int, size: int = 16) -> pl.Model:
    g = _Graph(1)
    hidden = heads * size
    x = g.input("x", ["B", "S", E])
    bias4 = g.input("attention_bias", [1, heads, "S", "T"])
    past_k = g.input("past_key", ["B", heads, "P", size])
    past_v = g.input("past_value", ["B", heads, "P", size])
    for name in ("q", "k", "v"):
        g.node("MatMul", [x, g.weight(f"w_{name}", (E, hidden))], [(name, ["B", "S", hidden])])
    bias = g.weight("qkv_bias", (3 * hidden,))
    g.node(
        "MultiHeadAttention",
        ["q", "k", "v", bias, "", bias4, past_k, past_v],
        _outs(hidden, heads, size),
        domain=MS, num_heads=heads, unidirectional=1,
    )  # fmt: skip
    g.node("MatMul", ["attn", g.weight("w_o", (hidden, E))], [("y", ["B", "S", E])])
    g.output("y", ["B", "S", E])
    g.output("present_key", ["B", heads, "T", size])
    g.output("present_value", ["B", heads, "T", size])
    return g.model()


def _onnx_attention(heads: int, kv: int, size: int = 16, *, rotary_op: bool = False) -> pl.Model:
    g = _Graph(2)
    x = g.input("x", ["B", "S", E])
    past_k = g.input("past_key", ["B", kv, "P", size])
    past_v = g.input("past_value", ["B", kv, "P", size])
    if rotary_op:
        g.input("position_ids", ["B", "S"], TensorProto.INT64)
        _rotary_caches(g, size)
    qkv = []
    for name, n in (("q", heads), ("k", kv), ("v", kv)):
        g.node("MatMul", [x, g.weight(f"w_{name}", (E, n * size))], [(name, ["B", "S", n * size])])
        qkv.append(_rotate(g, name, n, n * size, "") if rotary_op and name != "v" else name)
    g.node(
        "Attention",
        [*qkv, "", past_k, past_v],
        _outs(heads * size, kv, size),
        q_num_heads=heads, kv_num_heads=kv, is_causal=1,
    )  # fmt: skip
    g.node("MatMul", ["attn", g.weight("w_o", (heads * size, E))], [("y", ["B", "S", E])])
    g.output("y", ["B", "S", E])
    g.output("present_key", ["B", kv, "T", size])
    g.output("present_value", ["B", kv, "T", size])
    return g.model()


def _onnx_attention_4d(heads: int, kv: int, size: int = 16) -> pl.Model:
    """``Attention`` on (batch, heads, sequence, size) inputs read whole (each device slices its heads)."""
    g = _Graph(3)
    q = g.input("q", ["B", heads, "S", size])
    k = g.input("k", ["B", kv, "S", size])
    v = g.input("v", ["B", kv, "S", size])
    g.node("Attention", [q, k, v], [("y", ["B", heads, "S", size])])
    g.output("y", ["B", heads, "S", size])
    return g.model()


def _feeds(model: pl.Model, batch: int, seq: int, past: int, seed: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.inputs:
        name = value.name
        if name == "seqlens_k":
            feeds[name] = np.full(batch, past + seq - 1, np.int32)
        elif name == "total_sequence_length":
            feeds[name] = np.array(past + seq, np.int32)
        elif name == "position_ids":
            feeds[name] = np.broadcast_to(past + np.arange(seq), (batch, seq)).astype(np.int64).copy()
        else:
            shape = [
                {"B": batch, "S": seq, "P": past, "T": past + seq}.get(getattr(d, "value", d), d)
                for d in value.shape
            ]
            feeds[name] = rng.standard_normal([int(d) for d in shape]).astype(np.float32)
    return feeds


def _check(model: pl.Model, degree: int, steps: list[tuple[int, int, int]]) -> pl.Model:
    """Split ``model`` over ``degree`` devices; outputs equal the unsplit ones (ORT and torch)."""
    whole = model.copy()
    result = pl.split_tensor_parallel(model, devices=list(range(degree)))
    pl.verify(model)
    assert any(op.op_type in ("Attention", "MultiHeadAttention", "GroupQueryAttention") for op in model.ops)
    assert any("Attention" in name for name in result.split)
    runner = pl.Runner(model, device_map={d: "cpu" for d in range(degree)}, fold=False)
    lowered = pl.to_torch(model)
    for batch, seq, past in steps:
        feeds = _feeds(whole, batch, seq, past)
        expected = pl.Runner(whole, device_map="cpu").run(feeds)
        got = runner.run(feeds)
        for a, b in zip(expected, got):
            assert a.shape == b.shape and _rel(a, b) < 1e-5
        with torch.no_grad():
            out = lowered(*[torch.from_numpy(feeds[v.name]) for v in model.graph.inputs])
        out = out if isinstance(out, (tuple, list)) else (out,)
        for a, b in zip(expected, out):
            assert _rel(a, b.numpy()) < 1e-5
    return model


def _attention_ops(model: pl.Model) -> list:
    return [node for node in model.graph if node.op_type.endswith("Attention")]


@pytest.mark.parametrize(
    ("heads", "kv", "degree", "packed"),
    [
        (4, 2, 2, True),  # kv % t == 0
        (4, 2, 2, False),
        (8, 1, 2, True),  # t % kv == 0: the one KV head on both devices
        (4, 2, 4, True),  # each KV head on two devices
        (6, 3, 2, True),  # ragged: 2 and 1 KV heads (4 and 2 query heads)
    ],
)
def test_group_query_attention_splits_by_heads(heads: int, kv: int, degree: int, packed: bool) -> None:
    model = _check(_gqa(heads, kv, packed=packed), degree, [(2, 1, 3), (1, 3, 2), (2, 3, 0)])
    ops = _attention_ops(model)
    q_parts, kv_parts = head_plan("", "", heads, kv, degree)
    assert [op.attributes["num_heads"].value for op in ops] == [len(p) for p in q_parts]
    assert [op.attributes["kv_num_heads"].value for op in ops] == [len(p) for p in kv_parts]
    tags = [collective_tag(node) for node in model.graph]
    reduces = {tag["id"] for tag in tags if tag is not None and tag["kind"] == "all_reduce"}
    gathers = {tag["id"] for tag in tags if tag is not None and tag["kind"] == "all_gather"}
    assert len(reduces) == 1  # the output projection only: q, k, v arrive in whole heads
    assert len(gathers) == 2  # the present key and value, whole at the graph's outputs


@pytest.mark.parametrize(("heads", "degree"), [(4, 2), (3, 2)])  # 3 heads: 2 and 1 (ragged)
def test_multi_head_attention_splits_by_heads(heads: int, degree: int) -> None:
    model = _check(_mha(heads), degree, [(2, 1, 3), (2, 3, 2)])
    q_parts, _ = head_plan("", "", heads, heads, degree)
    assert [op.attributes["num_heads"].value for op in _attention_ops(model)] == [len(p) for p in q_parts]


@pytest.mark.parametrize(("heads", "kv", "degree"), [(4, 2, 2), (4, 1, 2), (6, 6, 3)])
def test_onnx_attention_splits_by_heads(heads: int, kv: int, degree: int) -> None:
    model = _check(_onnx_attention(heads, kv), degree, [(2, 1, 3), (2, 3, 2)])
    ops = _attention_ops(model)
    q_parts, kv_parts = head_plan("", "", heads, kv, degree)
    assert [op.attributes["q_num_heads"].value for op in ops] == [len(p) for p in q_parts]
    assert [op.attributes["kv_num_heads"].value for op in ops] == [len(p) for p in kv_parts]


def test_onnx_attention_on_head_axis_inputs() -> None:
    _check(_onnx_attention_4d(4, 2), 2, [(2, 3, 0)])


@pytest.mark.parametrize(
    ("build", "degree", "match"),
    [
        (lambda: _gqa(4, 2), 3, r"GroupQueryAttention.*4 query heads and 2 KV heads.*3 devices"),
        (lambda: _gqa(6, 2), 4, r"GroupQueryAttention.*6 query heads and 2 KV heads.*4 devices"),
        (lambda: _onnx_attention(6, 3), 4, r"Attention.*6 query heads and 3 KV heads.*4 devices"),
    ],
)
def test_heads_the_degree_cannot_spread_raise_and_leave_the_model_unchanged(build, degree, match) -> None:
    model = build()
    before = to_proto(model).SerializeToString()
    with pytest.raises(pl.InputError, match=match):
        pl.split_tensor_parallel(model, devices=list(range(degree)))
    assert to_proto(model).SerializeToString() == before
    assert len(model.devices) == 1


def test_a_quantized_cache_is_refused_by_name() -> None:
    model = _gqa(4, 2)
    op = _attention_ops(model)[0]
    op.attributes["k_quant_type"] = ir.AttrString("k_quant_type", "PER_TENSOR")
    with pytest.raises(pl.InputError, match=r"GroupQueryAttention.*quantized KV cache"):
        pl.split_tensor_parallel(model, devices=[0, 1])
    assert len(model.devices) == 1


@pytest.mark.parametrize("onnx_op", [False, True])
def test_rotary_embedding_ops_keep_whole_heads(onnx_op: bool) -> None:
    """``RotaryEmbedding`` on the query and key (3-D, ``num_heads``) before the attention."""
    model = _onnx_attention(4, 2, rotary_op=True) if onnx_op else _gqa(4, 2, packed=False, rotary_op=True)
    model = _check(model, 2, [(2, 1, 3), (1, 3, 2)])
    rotary = [node for node in model.graph if node.op_type == "RotaryEmbedding"]
    assert sorted(node.attributes["num_heads"].value for node in rotary) == [1, 1, 2, 2]
    tags = [collective_tag(node) for node in model.graph]
    assert (
        len({tag["id"] for tag in tags if tag is not None and tag["kind"] == "all_gather"}) == 2
    )  # presents


def _shape_const(g: _Graph, name: str, values: list[int]) -> str:
    g.inits.append(onnx.numpy_helper.from_array(np.array(values, np.int64), name))
    return name


def _plain_mqa(heads: int, size: int = 8, *, add_value: bool = False) -> pl.Model:
    """Multi-query attention in plain ONNX ops: one KV head, ``MatMul`` broadcasting the key
    and value's head axis of 1 against the query's heads (Falcon / GPT-BigCode style)."""
    g = _Graph(4)
    hidden = heads * size
    x = g.input("x", ["B", "S", E])
    g.node("MatMul", [x, g.weight("w_q", (E, hidden))], [("q", ["B", "S", hidden])])
    g.node(
        "Reshape", ["q", _shape_const(g, "q_shape", [0, 0, heads, size])], [("q4", ["B", "S", heads, size])]
    )
    g.node("Transpose", ["q4"], [("qh", ["B", heads, "S", size])], perm=[0, 2, 1, 3])
    for name, perm, shape in (
        ("k", [0, 2, 3, 1], ["B", 1, size, "S"]),
        ("v", [0, 2, 1, 3], ["B", 1, "S", size]),
    ):
        g.node("MatMul", [x, g.weight(f"w_{name}", (E, size))], [(name, ["B", "S", size])])
        g.node(
            "Reshape",
            [name, _shape_const(g, f"{name}_shape", [0, 0, 1, size])],
            [(f"{name}4", ["B", "S", 1, size])],
        )
        g.node("Transpose", [f"{name}4"], [(f"{name}h", shape)], perm=perm)
    g.node("MatMul", ["qh", "kh"], [("scores", ["B", heads, "S", "S"])])
    g.node("Softmax", ["scores"], [("probs", ["B", heads, "S", "S"])], axis=-1)
    g.node("MatMul", ["probs", "vh"], [("ctx", ["B", heads, "S", size])])
    if add_value:  # an element-wise op broadcasting the one KV head against the query heads
        g.node("Add", ["ctx", "vh"], [("ctx_v", ["B", heads, "S", size])])
    g.node(
        "Transpose",
        ["ctx_v" if add_value else "ctx"],
        [("ctx_t", ["B", "S", heads, size])],
        perm=[0, 2, 1, 3],
    )
    g.node("Reshape", ["ctx_t", _shape_const(g, "ctx_shape", [0, 0, hidden])], [("attn", ["B", "S", hidden])])
    g.node("MatMul", ["attn", g.weight("w_o", (hidden, E))], [("y", ["B", "S", E])])
    g.output("y", ["B", "S", E])
    return g.model()


@pytest.mark.parametrize("add_value", [False, True])
def test_plain_multi_query_attention_broadcasting_its_one_kv_head(add_value: bool) -> None:
    """A one-KV-head key ``(B, 1, D, S)`` that ``MatMul`` (or an element-wise op) broadcasts
    against the query's heads is read whole on each device (a broadcast), not sliced by the
    query's heads."""
    model = _plain_mqa(4, add_value=add_value)
    whole = model.copy()
    pl.split_tensor_parallel(model, devices=[0, 1])
    pl.verify(model)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 5, E)).astype(np.float32)}
    expected = pl.Runner(whole, device_map="cpu").run(feeds)
    got = pl.Runner(model, device_map={0: "cpu", 1: "cpu"}, fold=False).run(feeds)
    assert _rel(expected[0], got[0]) < 1e-5
    with torch.no_grad():
        lowered = pl.to_torch(model)(torch.from_numpy(feeds["x"]))
    assert _rel(expected[0], lowered.numpy()) < 1e-5


@pytest.mark.parametrize("mask_rank", [3, 4])
def test_onnx_attention_mask_with_a_head_axis_is_sliced_by_heads(mask_rank: int) -> None:
    """ONNX ``Attention``'s ``attn_mask`` broadcasts to (batch, heads, S, T): a 3-D mask has
    its head axis first, a 4-D one second; each device reads its heads' rows of it."""
    heads, kv, size = 4, 2, 8
    g = _Graph(6)
    x = g.input("x", ["B", "S", E])
    mask = g.input("mask", [heads, "S", "S"] if mask_rank == 3 else [1, heads, "S", "S"])
    for name, n in (("q", heads), ("k", kv), ("v", kv)):
        g.node("MatMul", [x, g.weight(f"w_{name}", (E, n * size))], [(name, ["B", "S", n * size])])
    g.node(
        "Attention",
        ["q", "k", "v", mask],
        [("attn", ["B", "S", heads * size])],
        q_num_heads=heads,
        kv_num_heads=kv,
    )
    g.node("MatMul", ["attn", g.weight("w_o", (heads * size, E))], [("y", ["B", "S", E])])
    g.output("y", ["B", "S", E])
    model = g.model()
    whole = model.copy()
    result = pl.split_tensor_parallel(model, devices=[0, 1])
    assert "Attention_3" in result.split
    rng = np.random.default_rng(1)
    mask_shape = [heads, 5, 5] if mask_rank == 3 else [1, heads, 5, 5]
    feeds = {
        "x": rng.standard_normal((2, 5, E)).astype(np.float32),
        "mask": rng.standard_normal(mask_shape).astype(np.float32),
    }
    expected = pl.Runner(whole, device_map="cpu").run(feeds)
    got = pl.Runner(model, device_map={0: "cpu", 1: "cpu"}, fold=False).run(feeds)
    assert _rel(expected[0], got[0]) < 1e-5
