"""The genai column: ``benchmarks/genai_anchor.py`` measures onnxruntime-genai in a Python of its
own (``PLACEMENT_GENAI_PYTHON``), or says why there is no such column."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import placement as pl
from benchmarks.genai_anchor import ENV, genai_tokens_per_s

FOLDER = Path(__file__).resolve().parent / "genai_files" / "llama_fp32"


def test_without_a_genai_python_the_column_says_why(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    result = genai_tokens_per_s(FOLDER)
    assert result["tokens_per_s"] is None and ENV in result["reason"]
    monkeypatch.setenv(ENV, str(FOLDER / "no-such-python"))
    assert "does not exist" in genai_tokens_per_s(FOLDER)["reason"]


@pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} names no Python with onnxruntime-genai")
def test_genai_column_measures_the_tokens_placement_generates():
    result = genai_tokens_per_s(FOLDER, prompt=8, new_tokens=12, batch=2, repeats=1)
    assert result["tokens_per_s"] > 0, result
    ids = (np.arange(2 * 8, dtype=np.int64).reshape(2, 8) * 7 + 3) % 97 + 3  # the anchor's prompt
    model = pl.load(FOLDER / "model.onnx")
    outputs = [v.name for v in model.graph.outputs]
    runner = pl.Runner(model, device_map="cpu")
    past = {v.name: np.zeros((2, 2, 0, 16), np.float32) for v in model.graph.inputs if "past" in v.name}
    tokens, total, step = [], 8, ids
    for _ in range(12):
        out = dict(
            zip(
                outputs,
                runner.run({"input_ids": step, "attention_mask": np.ones((2, total), np.int64), **past}),
            )
        )
        step = out["logits"][:, -1].argmax(-1).reshape(2, 1).astype(np.int64)
        tokens.append(step[:, 0].tolist())
        past = {n.replace("present.", "past_key_values."): v for n, v in out.items() if n != "logits"}
        total += 1
    assert np.array(tokens).T.tolist() == result["tokens"]
