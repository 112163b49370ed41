"""``pl.generate`` on files built by onnxruntime-genai's model builder: genai's own tokens.

The files leave the cache's head size symbolic (``kv_cache_dim``); :func:`placement.load`
reads its size from the ``genai_config.json`` beside the file, or ``cache_dims=`` gives it.
The files and genai's greedy tokens (``expected.json``) come from
``scripts/build_genai_files.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import placement as pl
from placement.graph.causal_lm import kv_layers

GENAI = Path(__file__).resolve().parents[1] / "genai_files"


def _expected(name: str) -> dict:
    return json.loads((GENAI / name / "expected.json").read_text())


def _on_two_devices(model: pl.Model) -> pl.Model:
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    assert len(model.devices) == 2
    return model


@pytest.mark.parametrize("runtime", ["ort", "torch"])
@pytest.mark.parametrize("name", ["llama_fp32", "llama_int4"])
def test_genai_file_generates_genais_tokens_on_two_devices(name: str, runtime: str) -> None:
    expected = _expected(name)
    model = pl.load(GENAI / name / "model.onnx")
    assert [(layer.kv_heads, layer.head_dim) for layer in kv_layers(model)] == [(2, 16), (2, 16)]
    _on_two_devices(model)
    prompt = np.array([expected["prompt"]] * 2)  # a batch of two: genai's tokens in each row
    out = pl.generate(model, prompt, max_new_tokens=len(expected["new_tokens"]), runtime=runtime)
    for row in out:
        assert row[prompt.shape[1] :].tolist() == expected["new_tokens"]


def test_without_its_config_the_sizes_are_given(tmp_path: Path) -> None:
    name = "llama_fp32"
    for file in ("model.onnx", "model.onnx.data"):
        shutil.copy(GENAI / name / file, tmp_path / file)
    model = pl.load(tmp_path / "model.onnx")  # no genai_config.json beside it
    assert kv_layers(model)[0].head_dim is None
    with pytest.raises(pl.InputError, match="kv_cache_dim"):
        pl.Generator(model, device_map="cpu")
    expected = _expected(name)
    steps = len(expected["new_tokens"])
    for dims in ({"kv_cache_dim": 16}, GENAI / name / "genai_config.json", GENAI / name):
        out = pl.generate(model, np.array([expected["prompt"]]), max_new_tokens=steps, cache_dims=dims)
        assert out[0, len(expected["prompt"]) :].tolist() == expected["new_tokens"]
    assert kv_layers(model)[0].head_dim is None  # the caller's model is unchanged
    with pytest.raises(pl.InputError, match="positive integer"):
        pl.Generator(model, cache_dims={"kv_cache_dim": 0})
    with pytest.raises(pl.InputError, match="genai_config.json"):
        pl.Generator(model, cache_dims=tmp_path)


def test_a_config_contradicting_the_model_is_refused_by_name(tmp_path: Path, caplog) -> None:
    for file in ("model.onnx", "model.onnx.data"):
        shutil.copy(GENAI / "llama_fp32" / file, tmp_path / file)
    config = json.loads((GENAI / "llama_fp32" / "genai_config.json").read_text())
    config["model"]["decoder"]["head_size"] = 2 * config["model"]["decoder"]["head_size"]
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    # pl.load takes the file (ONNX Runtime runs it) and says why it does not use the config
    with caplog.at_level("WARNING", logger="placement.graph.genai_config"):
        model = pl.load(tmp_path / "model.onnx")
    assert "model.decoder.head_size" in caplog.text and "GroupQueryAttention" in caplog.text
    assert kv_layers(model)[0].head_dim is None
    # generation then names the size it lacks, and the config, given explicitly, is refused by name
    with pytest.raises(pl.InputError, match="kv_cache_dim"):
        pl.Generator(model, runtime="torch", device_map="cpu")
    refused = r"kv_cache_dim = 32 \(genai_config.json's model.decoder.head_size\)"
    with pytest.raises(pl.InputError, match=refused):
        pl.Generator(model, runtime="torch", device_map="cpu", cache_dims=tmp_path)
    with pytest.raises(pl.InputError, match=r"kv_cache_dim = 8 \(given\) contradicts .*GroupQueryAttention"):
        pl.Generator(model, device_map="cpu", cache_dims={"kv_cache_dim": 8})
