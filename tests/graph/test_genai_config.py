"""``genai_config.json`` beside a file built by onnxruntime-genai: the cache sizes it leaves symbolic."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import placement as pl
from placement.graph.causal_lm import kv_layers
from placement.graph.genai_config import (
    apply_genai_config,
    bind_dims,
    cache_dims_from_config,
    read_genai_config,
)

GENAI = Path(__file__).resolve().parents[1] / "genai_files"


def _copy(name: str, folder: Path) -> Path:
    for file in ("model.onnx", "model.onnx.data"):
        shutil.copy(GENAI / name / file, folder / file)
    return folder / "model.onnx"


def test_load_binds_the_head_size_everywhere_and_the_file_still_runs(tmp_path: Path) -> None:
    model = pl.load(GENAI / "llama_fp32" / "model.onnx")
    shapes = [list(v.shape) for v in [*model.graph.inputs, *model.graph.outputs] if "." in v.name]
    assert shapes and all(shape[1] == 2 and shape[3] == 16 for shape in shapes)
    assert all("kv_cache_dim" not in str(v.shape) for node in model.graph for v in node.outputs)
    assert {(layer.kv_heads, layer.head_dim) for layer in kv_layers(model)} == {(2, 16)}
    model.save(tmp_path / "bound.onnx")  # still a file ONNX Runtime runs
    session = ort.InferenceSession(str(tmp_path / "bound.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([[5, 6]]), "attention_mask": np.ones((1, 2), np.int64)}
    feeds |= {v.name: np.zeros((1, 2, 0, 16), np.float32) for v in session.get_inputs() if "past" in v.name}
    assert session.run(["logits"], feeds)[0].shape == (1, 2, 128)


def test_config_read_from_the_file_or_its_folder(tmp_path: Path) -> None:
    folder = GENAI / "llama_int4"
    config = read_genai_config(folder)
    assert read_genai_config(folder / "genai_config.json") == config
    assert config["model"]["decoder"]["head_size"] == 16
    model = pl.load(_copy("llama_int4", tmp_path))  # no config beside it: the symbol stays
    assert cache_dims_from_config(model, config) == {"kv_cache_dim": 16}
    assert cache_dims_from_config(pl.load(folder / "model.onnx"), config) == {}  # bound at load


def test_a_bad_config_is_not_used_and_says_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _copy("llama_int4", tmp_path)
    config = json.loads((GENAI / "llama_int4" / "genai_config.json").read_text())
    config["model"]["decoder"]["head_size"] = "sixteen"
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="placement.graph.genai_config"):
        model = pl.load(path)
    assert "head_size" in caplog.text and kv_layers(model)[0].head_dim is None
    (tmp_path / "genai_config.json").write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="placement.graph.genai_config"):
        assert kv_layers(pl.load(path))[0].head_dim is None
    assert "cannot read" in caplog.text


def test_a_config_linked_from_outside_the_folder_is_not_read(tmp_path: Path, caplog) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    path = _copy("llama_fp32", folder)
    (folder / "genai_config.json").symlink_to(GENAI / "llama_fp32" / "genai_config.json")
    with caplog.at_level(logging.WARNING, logger="placement.graph.genai_config"):
        model = pl.load(path)
    assert "link out of" in caplog.text and kv_layers(model)[0].head_dim is None
    assert apply_genai_config(model, GENAI / "llama_fp32") == {"kv_cache_dim": 16}
    assert kv_layers(model)[0].head_dim == 16


def test_bad_sizes_are_refused(tmp_path: Path) -> None:
    past = ir.Value(name="past_key_values.0.key", type=ir.TensorType(ir.DataType.FLOAT),
                    shape=ir.Shape(["batch", "d", "past", "d"]))  # fmt: skip
    model = ir.Model(ir.Graph([past], [], nodes=[], opset_imports={"": 21}), ir_version=10)
    with pytest.raises(pl.InputError, match="'d' would be 2 and 16"):
        cache_dims_from_config(model, {"model": {"decoder": {"head_size": 16, "num_key_value_heads": 2}}})
    with pytest.raises(pl.InputError, match="positive integer"):
        cache_dims_from_config(model, {"model": {"decoder": {}}})
    with pytest.raises(pl.InputError, match="positive integer"):
        bind_dims(model, {"d": True})
    (tmp_path / "genai_config.json").write_text("{}")
    with pytest.raises(pl.InputError, match="no model.decoder"):
        read_genai_config(tmp_path)
