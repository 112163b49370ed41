from __future__ import annotations

import os
import shutil
import stat

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import placement as pl
from placement.graph import to_proto
from placement.graph.saving import MULTI_DEVICE_FIELDS
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


@pytest.mark.parametrize("placed", [False, True], ids=["unplaced", "placed"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_saved_files_pass_onnx_tools_and_dynamic_quantization(name, placed, exported, tmp_path):
    """The checker, strict shape inference, ORT's symbolic shape inference and quantize_dynamic
    accept a saved model; the quantized file runs in ORT close to the float one."""
    import logging

    from onnxruntime.quantization import quantize_dynamic
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    model, _, args = exported(name)
    if placed:
        pl.place_evenly(model, 2)  # 2 devices, copies injected
        assert any(op.is_copy for op in model.ops)
    path, quantized = tmp_path / f"{name}.onnx", tmp_path / f"{name}.int8.onnx"
    model.save(path)
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
    # what ORT's quant_pre_process runs first (it reads Constant ops' `value` only)
    assert SymbolicShapeInference.infer_shapes(proto, auto_merge=False) is not None
    initializers = {t.name for t in proto.graph.initializer}
    assert not [v.name for v in proto.graph.value_info if v.name in initializers]  # types stated once
    logging.getLogger().setLevel(logging.ERROR)  # the quantizer logs advice on the root logger
    quantize_dynamic(path, quantized)
    ops = {n.op_type for n in onnx.load(quantized).graph.node}
    assert ops & {"DynamicQuantizeLinear", "DequantizeLinear"}, ops  # int8 weights in the file
    feeds = {inp: a.numpy() for inp, a in zip(model.inputs, args)}
    for got, want in zip(_ort(str(quantized), feeds), _ort(str(path), feeds)):
        assert got.shape == want.shape and np.isfinite(got).all()
        cosine = float((got * want).sum() / (np.linalg.norm(got) * np.linalg.norm(want)))
        assert cosine > 0.95, cosine  # 8-bit weights and activations: close, not equal


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


@pytest.mark.skipif(not MULTI_DEVICE_FIELDS, reason=f"onnx {onnx.__version__} has no multi-device fields")
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


def test_without_multi_device_fields_the_metadata_carries_the_placement(monkeypatch, tmp_path):
    """onnx < 1.18 has no multi-device fields and reads IR versions up to its own only."""
    from placement.graph import saving

    monkeypatch.setattr(saving, "MULTI_DEVICE_FIELDS", False)
    model = mlp_graph(2)
    model.set_device("relu1", "cuda:1")
    pl.inject_cross_device_copies(model)
    proto = to_proto(model)
    assert proto.ir_version <= min(onnx.IR_VERSION, saving.MAX_IR_VERSION)
    if MULTI_DEVICE_FIELDS:  # this onnx has the fields: they stay empty
        assert not any(n.device_configurations for n in proto.graph.node) and not proto.configuration
    onnx.checker.check_model(proto)
    model.save(tmp_path / "m.onnx")
    loaded = pl.load(tmp_path / "m.onnx")
    assert {op.name: op.device for op in loaded.ops} == {op.name: op.device for op in model.ops}
    x = {"x": np.ones((2, 4), np.float32)}
    np.testing.assert_allclose(pl.run(loaded, x)[0], pl.run(model, x)[0], rtol=1e-6)


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


# --- state that must never be lost or corrupted -----------------------------------------


def _mlp_with(seed: int, width: int = 64) -> pl.Model:
    model = mlp_graph(2, width=width)
    rng = np.random.default_rng(seed)
    for value in model.graph.initializers.values():
        shape = tuple(value.const_value.shape)
        value.const_value = ir.tensor(rng.standard_normal(shape).astype(np.float32), name=value.name)
    return model


def _outputs(model_or_path, x):
    model = pl.load(model_or_path) if not isinstance(model_or_path, pl.Model) else model_or_path
    return pl.run(model, {"x": x}, device_map="cpu")[0]


def test_failed_external_save_keeps_the_old_pair(tmp_path, monkeypatch):
    x = np.ones((2, 64), np.float32)
    old, new = _mlp_with(1), _mlp_with(2)
    path = tmp_path / "m.onnx"
    old.save(path, external_data=True)
    before = sorted(os.listdir(tmp_path))
    real_replace = os.replace

    def fail_on_the_switch(src, dst, *args, **kwargs):
        if os.fspath(dst) == os.fspath(path):
            raise OSError("power cut")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", fail_on_the_switch)
    with pytest.raises(pl.ModelSaveError, match="power cut"):
        new.save(path, external_data=True)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == before
    np.testing.assert_allclose(_outputs(path, x), _outputs(old, x))
    new.save(path, external_data=True)  # a good save replaces the pair and removes the old data
    assert len(list(tmp_path.glob("m.onnx.*.data"))) == 1
    np.testing.assert_allclose(_outputs(path, x), _outputs(new, x))


def test_a_model_never_pairs_with_another_saves_weights(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _mlp_with(1).save(tmp_path / "a" / "m.onnx", external_data=True)
    _mlp_with(2).save(tmp_path / "b" / "m.onnx", external_data=True)
    (mine,) = (tmp_path / "a").glob("*.data")
    (theirs,) = (tmp_path / "b").glob("*.data")
    shutil.copyfile(theirs, mine)  # same size, same layout, other weights
    with pytest.raises(pl.ModelLoadError, match="belongs to another save"):
        pl.load(tmp_path / "a" / "m.onnx")


def test_resaving_a_lazily_loaded_model_in_place(tmp_path):
    x = np.ones((2, 64), np.float32)
    path = tmp_path / "m.onnx"
    _mlp_with(1).save(path, external_data=True)
    model = pl.load(path)
    want = _outputs(_mlp_with(1), x)
    model.set_device("relu1", 1)
    model.save(path, external_data=True)  # streams from the old data file into the new one
    assert len(list(tmp_path.glob("m.onnx.*.data"))) == 1
    np.testing.assert_allclose(_outputs(model, x), want)  # still readable: re-pointed
    np.testing.assert_allclose(_outputs(path, x), want)
    model.save(path)  # and back to one self-contained file
    assert not list(tmp_path.glob("m.onnx.*.data"))
    np.testing.assert_allclose(_outputs(path, x), want)
    np.testing.assert_allclose(_outputs(model, x), want)


@pytest.mark.parametrize("kind", ["devnull", "fifo"])
def test_save_refuses_what_is_not_a_regular_file(tmp_path, kind):
    if kind == "devnull":
        target = "/dev/null"
    else:
        target = tmp_path / "pipe.onnx"
        os.mkfifo(target)
    with pytest.raises(pl.ModelSaveError, match="not a regular file"):
        mlp_graph(1).save(target)
    if kind == "devnull":
        assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    else:
        assert stat.S_ISFIFO(os.stat(target).st_mode)
        assert sorted(os.listdir(tmp_path)) == ["pipe.onnx"]


def test_save_through_a_symlink_writes_its_target_when_asked(tmp_path):
    real = tmp_path / "real.onnx"
    real.write_bytes(b"old")
    link = tmp_path / "link.onnx"
    link.symlink_to(real)
    mlp_graph(1).save(link, follow_symlinks=True)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert pl.load(real).ops[0].name == "fc0"


def test_save_keeps_permission_bits(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    mlp_graph(1).save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    mlp_graph(1, width=64).save(path, external_data=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


def _constant_model(width: int = 64) -> pl.Model:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, width]))
    weight = np.arange(width * width, dtype=np.float32).reshape(width, width) / width**2
    const = ir.Node("", "Constant", [], attributes=[ir.AttrTensor("value", ir.tensor(weight))], name="w")
    const.outputs[0].name = "w_out"
    matmul = ir.Node("", "MatMul", [x, const.outputs[0]], name="mm")
    matmul.outputs[0].name = "y"
    matmul.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    matmul.outputs[0].shape = ir.Shape([2, width])
    graph = ir.Graph([x], matmul.outputs, nodes=[const, matmul], opset_imports={"": 20}, name="c")
    return pl.Model(ir.Model(graph, ir_version=10))


def test_constant_attribute_tensors_go_to_external_data(tmp_path):
    model = _constant_model()
    x = np.ones((2, 64), np.float32)
    want = _outputs(model, x)
    path = tmp_path / "c.onnx"
    model.save(path, external_data=True)
    assert os.path.getsize(path) < 4096  # the 16 KiB constant went out
    assert len(list(tmp_path.glob("c.onnx.*.data"))) == 1
    np.testing.assert_allclose(_ort(str(path), {"x": x})[0], want)
    np.testing.assert_allclose(_outputs(path, x), want)


def test_bad_external_data_in_a_subgraph_names_the_op(tmp_path):
    outer = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])
    branch_init = onnx.TensorProto(name="k", data_type=onnx.TensorProto.FLOAT, dims=[4])
    branch_init.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "../../outside.bin"), ("offset", "0"), ("length", "16")):
        entry = branch_init.external_data.add()
        entry.key, entry.value = key, value
    branch = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["k"], ["y_then"])],
        "then",
        [],
        [onnx.helper.make_tensor_value_info("y_then", onnx.TensorProto.FLOAT, [4])],
        [branch_init],
    )
    other = onnx.helper.make_graph(
        [onnx.helper.make_node("Constant", [], ["y_else"], value_floats=[0.0, 0.0, 0.0, 0.0])],
        "else",
        [],
        [onnx.helper.make_tensor_value_info("y_else", onnx.TensorProto.FLOAT, [4])],
    )
    node = onnx.helper.make_node("If", ["c"], ["y"], name="branchy", then_branch=branch, else_branch=other)
    graph = onnx.helper.make_graph(
        [node], "g", [onnx.helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])], [outer]
    )
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    path = tmp_path / "sub.onnx"
    onnx.save_model(proto, path)
    with pytest.raises(pl.ModelLoadError, match="branchy.*outside|outside.*branchy"):
        pl.load(path)
