"""``pl.load`` takes files with ONNX Runtime's own ops; ORT's schemas (or a session) decide."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import placement as pl
from placement.graph import ort_ops

GENAI = Path(__file__).resolve().parents[1] / "genai_files"


def _model(
    node: onnx.NodeProto, *, inputs: int = 2, opsets=(("", 22), ("com.microsoft", 1))
) -> onnx.ModelProto:
    values = [
        helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [2, 4] if i == 0 else [4])
        for i in range(inputs)
    ]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    graph = helper.make_graph([node], "g", values, [out])
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=10
    )


def _rms(**attrs) -> onnx.NodeProto:
    return helper.make_node("SimplifiedLayerNormalization", ["x0", "x1"], ["y"], name="rms", **attrs)


@pytest.mark.parametrize("name", ["llama_fp32", "llama_int4"])
def test_genai_file_loads_verifies_and_round_trips(name, tmp_path):
    model = pl.load(GENAI / name / "model.onnx")
    kinds = {(op.node.domain, op.op_type) for op in model.ops}
    assert ("", "SimplifiedLayerNormalization") in kinds
    assert ("com.microsoft", "GroupQueryAttention") in kinds
    assert (name == "llama_int4") == (("com.microsoft", "MatMulNBits") in kinds)
    pl.verify(model)
    model.save(tmp_path / "m.onnx")
    again = pl.load(tmp_path / "m.onnx")
    pl.verify(again)
    assert [op.op_type for op in again.ops] == [op.op_type for op in model.ops]


def test_default_domain_ort_op_is_checked_by_ort_schema():
    proto = _model(_rms(epsilon=1e-5))
    model = pl.load(proto)
    pl.verify(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {
        "x0": rng.standard_normal((2, 4)).astype(np.float32),
        "x1": rng.standard_normal(4).astype(np.float32),
    }
    np.testing.assert_allclose(
        pl.run(model, feeds, device_map="cpu")[0], session.run(None, feeds)[0], rtol=1e-6
    )


def test_op_unknown_to_onnx_and_ort_is_refused_by_name():
    node = helper.make_node("NoSuchNormalization", ["x0", "x1"], ["y"], name="mystery")
    with pytest.raises(pl.ModelLoadError, match="NoSuchNormalization"):
        pl.load(_model(node))


def test_ort_op_with_an_attribute_ort_lacks_is_refused():
    with pytest.raises(pl.ModelLoadError, match=r"'rms'.*'bogus'"):
        pl.load(_model(_rms(bogus=3)))


def test_ort_op_with_too_many_inputs_is_refused():
    node = helper.make_node("SimplifiedLayerNormalization", ["x0", "x1", "x2"], ["y"], name="rms3")
    with pytest.raises(pl.ModelLoadError, match="'rms3'.*3 inputs"):
        pl.load(_model(node, inputs=3))


def test_contrib_op_missing_a_required_attribute_is_refused():
    node = helper.make_node(
        "SkipSimplifiedLayerNormalization", ["x0", "x0", "x1"], ["y"], name="skip", domain="com.microsoft"
    )
    pl.load(_model(node))  # epsilon is optional
    node = helper.make_node(
        "GroupQueryAttention", ["x0"] + ["x1"] * 6, ["y"], name="gqa", domain="com.microsoft", num_heads=2
    )
    with pytest.raises(pl.ModelLoadError, match=r"'gqa'.*kv_num_heads"):
        pl.load(_model(node))


def test_contrib_op_unknown_to_ort_is_refused():
    node = helper.make_node("FlyingAttention", ["x0", "x1"], ["y"], name="fly", domain="com.microsoft")
    with pytest.raises(pl.ModelLoadError, match="'fly'.*FlyingAttention"):
        pl.load(_model(node))


def test_malformed_genai_file_is_still_refused(tmp_path):
    proto = onnx.load(GENAI / "llama_fp32" / "model.onnx", load_external_data=False)
    rms = next(n for n in proto.graph.node if n.op_type == "SimplifiedLayerNormalization")
    rms.input.append(rms.input[0])  # a third input: ORT's schema takes two
    onnx.save(proto, tmp_path / "model.onnx")
    shutil.copy(GENAI / "llama_fp32" / "model.onnx.data", tmp_path / "model.onnx.data")
    with pytest.raises(pl.ModelLoadError, match="SimplifiedLayerNormalization.*3 inputs"):
        pl.load(tmp_path / "model.onnx")


def test_without_ort_registry_a_session_build_decides(monkeypatch):
    monkeypatch.setattr(ort_ops, "_registry", lambda: None)
    assert not ort_ops.has_ort_registry()
    model = pl.load(GENAI / "llama_fp32" / "model.onnx")
    pl.verify(model)
    bad = _model(helper.make_node("SimplifiedLayerNormalization", ["x0"], ["y"], name="rms1"), inputs=1)
    with pytest.raises(pl.ModelLoadError, match="ONNX Runtime refuses"):
        pl.load(bad)


def test_placed_genai_file_runs_like_one_ort_session():
    path = GENAI / "llama_int4" / "model.onnx"
    model = pl.load(path)
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    assert len(model.devices) == 2
    ids = np.array([[5, 17, 33, 2, 90, 41, 7, 64]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in range(2):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, 2, 0, 16), np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)
    placed = pl.Runner(model).run(feeds)
    names = [o.name for o in session.get_outputs()]
    assert names[0] == "logits"
    for want, got in zip(expected, placed):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
