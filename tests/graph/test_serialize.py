from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import placement as pl
from placement.graph import to_proto
from tests.conftest import MODEL_NAMES
from tests.graph.builders import mlp_graph


def _fingerprint(model: pl.Model):
    return [(op.name, op.op_type, op.inputs, op.outputs, str(op.device), op.scope) for op in model.ops]


def _ort(path_or_bytes, feeds):
    session = ort.InferenceSession(path_or_bytes, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _torch_outputs(net, args):
    import torch

    with torch.no_grad():
        out = net(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o.numpy() for o in outs]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_saved_model_runs_in_plain_ort_with_torch_outputs(name, exported, tmp_path):
    model, net, args = exported(name)
    path = tmp_path / f"{name}.onnx"
    model.save(path)
    proto = onnx.load(path)
    onnx.checker.check_model(proto)
    assert proto.ir_version <= 13
    feeds = {inp: a.numpy() for inp, a in zip(model.inputs, args)}
    for got, want in zip(_ort(str(path), feeds), _torch_outputs(net, args)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_save_load_save_roundtrip_with_several_devices(name, exported, tmp_path):
    model, _, _ = exported(name)
    for i, op in enumerate(model.ops):
        model.set_device(op.name, ["cuda:0", "cuda:1", "cpu", "cuda:3"][i % 4])
    first = tmp_path / "a.onnx"
    model.save(first)
    loaded = pl.load(first)
    assert _fingerprint(loaded) == _fingerprint(model)
    assert loaded.blobs == model.blobs
    second = tmp_path / "b.onnx"
    loaded.save(second)
    assert _fingerprint(pl.load(second)) == _fingerprint(model)
    assert any(op.scope for op in loaded.ops)


def test_multi_device_fields_are_written_and_read(tmp_path):
    model = mlp_graph(2)
    model.set_device("relu1", "cuda:1")
    proto = to_proto(model)
    assert proto.ir_version >= 11
    assert list(proto.configuration[0].device) == ["cuda:0", "cuda:1"]
    stages = [n.device_configurations[0].pipeline_stage for n in proto.graph.node]
    assert stages == [0, 0, 0, 1]
    # a file from another tool: only the ONNX multi-device fields, no metadata mirror
    for node in proto.graph.node:
        kept = [p for p in node.metadata_props if p.key != "placement.device"]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)
    assert pl.load(proto).device_of("relu1") == pl.Device("cuda", 1)


def test_load_accepts_proto_ir_model_and_model():
    model = mlp_graph(1)
    model.set_device("relu0", 2)
    proto = to_proto(model)
    assert pl.load(proto).device_of("relu0") == pl.Device("cuda", 2)
    assert pl.load(model.ir_model.clone()).device_of("relu0") == pl.Device("cuda", 2)
    assert pl.load(model).device_of("relu0") == pl.Device("cuda", 2)
    with pytest.raises(pl.ModelLoadError, match="int"):
        pl.load(42)


def test_external_data_roundtrip(tmp_path):
    model = mlp_graph(2, width=64)
    path = tmp_path / "ext.onnx"
    model.save(path, external_data=True)
    assert len(list(tmp_path.glob("ext.onnx.*.data"))) == 1
    assert os.path.getsize(path) < 16 * 1024
    x = np.ones((2, 64), np.float32)
    want = _ort(to_proto(model).SerializeToString(), {"x": x})
    got = _ort(str(path), {"x": x})
    np.testing.assert_allclose(got[0], want[0])
    loaded = pl.load(path)  # weights stay on disk until read
    assert all(isinstance(v.const_value, ir.ExternalTensor) for v in loaded.graph.initializers.values())
    got = pl.run(loaded, {"x": x}, device_map="cpu")
    np.testing.assert_allclose(got[0], want[0])


def _external_location(path, location):
    proto = onnx.load(path, load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save_model(proto, path)


@pytest.mark.parametrize("location", ["../evil.data", "/etc/passwd", "sub/../../evil.data"])
def test_external_data_traversal_is_refused(tmp_path, location):
    folder = tmp_path / "m"
    folder.mkdir()
    path = folder / "m.onnx"
    mlp_graph(1, width=64).save(path, external_data=True)
    (tmp_path / "evil.data").write_bytes(b"\0" * 100000)
    _external_location(path, location)
    with pytest.raises(pl.ModelLoadError, match="outside"):
        pl.load(path)


def test_missing_and_truncated_external_data(tmp_path):
    path = tmp_path / "m.onnx"
    mlp_graph(1, width=64).save(path, external_data=True)
    (data,) = tmp_path.glob("m.onnx.*.data")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(pl.ModelLoadError, match="truncated"):
        pl.load(path)
    data.unlink()
    with pytest.raises(pl.ModelLoadError, match="missing"):
        pl.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(pl.ModelLoadError, match="no such model file"):
        pl.load(tmp_path / "nope.onnx")
    with pytest.raises(pl.ModelLoadError, match="not a file"):
        pl.load(tmp_path)


@pytest.mark.parametrize("content", [b"", b"garbage bytes \x00\xff\x13 not onnx" * 10, b"\x08\x07"])
def test_garbage_file(tmp_path, content):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(pl.ModelLoadError, match="bad.onnx"):
        pl.load(path)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 0.99])
def test_truncated_file(exported, tmp_path, fraction):
    model, _, _ = exported("mlp")
    good = tmp_path / "good.onnx"
    model.save(good)
    data = good.read_bytes()
    bad = tmp_path / "cut.onnx"
    bad.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(pl.ModelLoadError, match="cut.onnx"):
        pl.load(bad)


def test_failed_save_keeps_existing_file(tmp_path, monkeypatch):
    model = mlp_graph(1)
    path = tmp_path / "keep.onnx"
    path.write_bytes(b"precious")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", boom)
    with pytest.raises(pl.ModelSaveError, match="disk full"):
        model.save(path)
    assert path.read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == ["keep.onnx"]


def test_save_into_missing_folder(tmp_path):
    with pytest.raises(pl.ModelSaveError, match="does not exist"):
        mlp_graph(1).save(tmp_path / "no" / "m.onnx")


def test_save_does_not_modify_the_model(tmp_path):
    model = mlp_graph(2)
    model.set_device("relu1", 1)
    before = (model.ir_model.ir_version, _fingerprint(model), dict(model.ir_model.metadata_props))
    model.save(tmp_path / "m.onnx")
    assert (model.ir_model.ir_version, _fingerprint(model), dict(model.ir_model.metadata_props)) == before
