"""Tests for ``placement.runtime.ort.layout``: a BatchNormalization on a stage input runs as
the equivalent depthwise Conv, only where ONNX Runtime's blocked layout is in play."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import placement as pl
from placement.graph.saving import to_proto
from placement.runtime.ort.layout import batchnorm_as_conv


def _stage(*, reader: str = "Relu", training: int = 0, rank: int = 4) -> ir.Model:
    """x -> BatchNormalization -> reader -> Conv, with random statistics."""
    rng = np.random.default_rng(0)
    c = 3
    stats = {
        "s": rng.random(c, dtype=np.float32) + 0.5,
        "b": rng.standard_normal(c).astype(np.float32),
        "m": rng.standard_normal(c).astype(np.float32),
        "v": rng.random(c, dtype=np.float32) + 0.1,
        "w": rng.standard_normal((c, c) + (1,) * (rank - 2)).astype(np.float32),
    }
    nodes = [
        helper.make_node(
            "BatchNormalization",
            ["x", "s", "b", "m", "v"],
            ["y"],
            name="bn",
            epsilon=1e-3,
            training_mode=training,
        ),
        helper.make_node(reader, ["y"], ["r"], name="reader"),
        helper.make_node("Conv", ["r", "w"], ["z"], name="conv"),
    ]
    shape = [2, c] + [5] * (rank - 2)
    graph = helper.make_graph(
        nodes,
        "stage",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a, n) for n, a in stats.items()],
    )
    return ir.serde.deserialize_model(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=10)
    )


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"x": x})[0]


def test_batchnorm_on_a_stage_input_becomes_an_equal_depthwise_conv():
    model = _stage()
    rewritten = batchnorm_as_conv(model)
    assert [n.op_type for n in rewritten.graph] == ["Conv", "Relu", "Conv"]
    conv = next(iter(rewritten.graph))
    assert conv.name == "bn" and conv.outputs[0].name == "y" and conv.attributes["group"].value == 3
    assert [n.op_type for n in model.graph] == ["BatchNormalization", "Relu", "Conv"]  # not modified
    x = np.random.default_rng(1).standard_normal((2, 3, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(_run(rewritten, x), _run(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [{"reader": "Sigmoid"}, {"training": 1}, {"rank": 3}],
    ids=["read-by-an-op-kept-in-plain-layout", "training-mode", "not-2d"],
)
def test_batchnorm_stays_where_the_rewrite_cannot_help(kwargs):
    model = _stage(**kwargs)
    assert batchnorm_as_conv(model) is model


def test_a_conv_bn_cut_in_resnet_runs_equal_to_the_single_session(exported):
    """The exporter's conv -> bn pair split by a cut: stage 1 starts with the BN, its
    session runs it as a Conv, the outputs equal one session's of the unplaced model."""
    model, _, (x,) = exported("resnet")
    single = ort.InferenceSession(to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    ops = model.ops
    bn = next(op for op in ops[10:] if op.op_type == "BatchNormalization")
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[acts.index(bn.inputs[0]) + 1 :], {0: 1})
    pl.inject_cross_device_copies(model)
    runner = pl.Runner(model, device_map="cpu", fold=False)
    stage = runner.stages[1]
    assert batchnorm_as_conv(stage.model) is not stage.model
    assert bn.name in stage.ops and any(n.op_type == "BatchNormalization" for n in stage.model.graph)
    want = single.run(None, {model.inputs[0]: x.numpy()})[0]
    np.testing.assert_allclose(runner.run([x])[0], want, rtol=1e-4, atol=1e-4)
