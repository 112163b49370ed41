"""Streamed parameters: the copy kind, its invariants, save/load, idempotence, errors."""

from __future__ import annotations

import json

import pytest

import placement as pl
from placement.graph.nodes import COPY_KEY, STREAM_WINDOW_KEY, STREAMED_KEY
from placement.passes.streaming import streamable_parameters


def _kinds(model: pl.Model) -> dict[str, str]:
    """Copy source -> its kind."""
    return {op.inputs[0]: op.node.metadata_props[COPY_KEY] for op in model.ops if op.is_copy}


def test_streamed_copies_on_gpt(exported):
    model, _, _ = exported("gpt")
    result = pl.stream_parameters(model, ["blocks.0"], window="1MiB")
    assert result.added and all(name.startswith("blocks.0.") for name in result.added)
    assert result.window == 2**20 and not result.copies_updated
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    kinds = _kinds(model)
    assert {kinds[name] for name in result.added} == {"streamed"}
    assert all(kind != "streamed" for name, kind in kinds.items() if name not in result.added)
    for name in result.added:
        assert model.parameters[name].device == pl.Device("cpu")
        assert model.device_of(name) == pl.Device("cpu")
    assert pl.inject_cross_device_copies(model).modified is False  # idempotent


def test_save_load_keeps_streaming(exported, tmp_path):
    model, _, _ = exported("mlp")
    pl.stream_parameters(model, ["fc1.weight", "fc2"], window=4096)
    pl.inject_cross_device_copies(model)
    path = tmp_path / "streamed.onnx"
    model.save(path)
    loaded = pl.load(path)
    pl.verify(loaded)
    assert loaded.streamed == model.streamed
    assert _kinds(loaded) == _kinds(model)
    assert loaded.ir_model.metadata_props[STREAM_WINDOW_KEY] == "4096"
    assert pl.inject_cross_device_copies(loaded).modified is False


def test_streaming_after_injection_reinjects(exported):
    model, _, _ = exported("mlp")
    pl.inject_cross_device_copies(model, output_device="cpu")
    result = pl.stream_parameters(model, ["fc1.weight"])
    assert result.copies_updated
    pl.verify(model)
    assert _kinds(model)["fc1.weight"] == "streamed"
    assert str(model.output_device) == "cpu"
    # and back: no longer streamed, the copy disappears and the weight lives at its reader again
    back = pl.stream_parameters(model, ["fc1.weight"], host=None)
    assert back.removed == ["fc1.weight"] and STREAMED_KEY not in model.ir_model.metadata_props
    pl.verify(model)
    assert "fc1.weight" not in _kinds(model)


def test_host_reader_reads_streamed_weight_directly(exported):
    """A streamed weight also read on the host needs no copy there."""
    model, _, _ = exported("mlp")
    last = model.ops[-1]
    model.set_device(last.name, "cpu")
    pl.stream_parameters(model, ["fc1.weight", "fc3.weight"])
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    kinds = _kinds(model)
    assert kinds["fc1.weight"] == "streamed"
    assert "fc3.weight" not in kinds  # read on the host where it lives


def test_verify_rejects_wrong_kinds(exported):
    model, _, _ = exported("mlp")
    pl.stream_parameters(model, ["fc1.weight"])
    pl.inject_cross_device_copies(model)
    copy = next(op for op in model.ops if op.is_copy and op.inputs[0] == "fc1.weight")
    copy.node.metadata_props[COPY_KEY] = "static"
    with pytest.raises(pl.VerificationError, match="streamed parameter"):
        pl.verify(model)
    copy.node.metadata_props[COPY_KEY] = "sometimes"
    with pytest.raises(pl.VerificationError, match="unknown kind"):
        pl.verify(model)


def test_verify_rejects_direct_read_of_streamed_weight(exported):
    model, _, _ = exported("mlp")
    model.ir_model.metadata_props[STREAMED_KEY] = json.dumps({"fc1.weight": "cpu"})
    with pytest.raises(pl.VerificationError, match="without a copy"):
        pl.verify(model)


def test_errors_leave_model_unchanged(exported):
    model, _, _ = exported("mlp")
    before = dict(model.ir_model.metadata_props)
    with pytest.raises(pl.UnknownBlobError, match="nothing_here"):
        pl.stream_parameters(model, ["fc1.weight", "nothing_here"])
    with pytest.raises(pl.DeviceError, match="host memory"):
        pl.stream_parameters(model, ["fc1.weight"], host="cuda:1")
    with pytest.raises(pl.PlanError):
        pl.stream_parameters(model, ["fc1.weight"], window="lots")
    assert dict(model.ir_model.metadata_props) == before


def test_streamable_parameters_of_op_and_scope(exported):
    model, _, _ = exported("gpt")
    scope = streamable_parameters(model, "blocks.1.mlp")
    assert scope and all(name.startswith("blocks.1.mlp.") for name in scope)
    op = next(op for op in model.ops if op.op_type in ("MatMul", "Gemm") and op.scope == "blocks.1.mlp.c_fc")
    assert set(streamable_parameters(model, op.name)) <= set(scope)
