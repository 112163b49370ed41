"""A file built by onnxruntime-genai's model builder loads, places on 2 emulated devices
and generates genai's own greedy tokens, through ``pl.Runner`` and through ``pl.to_torch``.

The files and genai's tokens (``expected.json``) are made by ``scripts/build_genai_files.py``
in a virtual environment of its own (onnxruntime-genai brings plain onnxruntime).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

import placement as pl

GENAI = Path(__file__).resolve().parents[1] / "genai_files"
NAMES = ["llama_fp32", "llama_int4"]


def _expected(name: str) -> dict:
    return json.loads((GENAI / name / "expected.json").read_text())


def _placed(name: str) -> pl.Model:
    """The genai file with its second half of activations shifted to logical device 1."""
    model = pl.load(GENAI / name / "model.onnx")
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    assert len(model.devices) == 2
    return model


def _greedy(step: Callable[[dict[str, np.ndarray]], list[np.ndarray]], inputs: list[str], outputs: list[str],
            prompt: list[int], new_tokens: int) -> list[int]:  # fmt: skip
    """Greedy decoding with a KV cache: ``present.{i}`` fed back as ``past_key_values.{i}``."""
    ids = np.array([prompt], dtype=np.int64)
    past = {n: np.zeros((1, 2, 0, 16), np.float32) for n in inputs if n.startswith("past_key_values.")}
    tokens: list[int] = []
    total = ids.shape[1]
    for _ in range(new_tokens):
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64), **past}
        results = dict(zip(outputs, step({n: feeds[n] for n in inputs})))
        token = int(results["logits"][0, -1].argmax())
        tokens.append(token)
        past = {
            n.replace("present.", "past_key_values."): v
            for n, v in results.items()
            if n.startswith("present.")
        }
        ids = np.array([[token]], dtype=np.int64)
        total += 1
    return tokens


def _names(model: pl.Model) -> tuple[list[str], list[str]]:
    return [v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs]


@pytest.mark.parametrize("name", NAMES)
def test_placed_runner_generates_genais_tokens(name):
    expected = _expected(name)
    model = _placed(name)
    inputs, outputs = _names(model)
    assert "past_key_values.0.key" in inputs and "present.1.value" in outputs
    runner = pl.Runner(model)
    tokens = _greedy(runner.run, inputs, outputs, expected["prompt"], len(expected["new_tokens"]))
    assert tokens == expected["new_tokens"]


@pytest.mark.parametrize("name", NAMES)
def test_to_torch_generates_genais_tokens(name):
    expected = _expected(name)
    model = _placed(name)
    inputs, outputs = _names(model)
    module = pl.to_torch(model)

    def step(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            got = module(*[torch.from_numpy(feeds[n]) for n in inputs])
        return [t.numpy() for t in got]

    tokens = _greedy(step, inputs, outputs, expected["prompt"], len(expected["new_tokens"]))
    assert tokens == expected["new_tokens"]


@pytest.mark.parametrize("name", NAMES)
def test_placed_and_lowered_logits_equal_one_ort_session(name):
    """Prompt then one decode step: placed (2 devices), lowered and one plain session agree."""
    path = GENAI / name / "model.onnx"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    model = _placed(name)
    inputs, outputs = _names(model)
    runner = pl.Runner(model)
    module = pl.to_torch(model)
    prompt = np.array([_expected(name)["prompt"]] * 2, dtype=np.int64)
    feeds = {"input_ids": prompt, "attention_mask": np.ones_like(prompt)}
    feeds |= {n: np.zeros((2, 2, 0, 16), np.float32) for n in inputs if n.startswith("past_key_values.")}
    for _ in range(2):
        want = session.run(outputs, feeds)
        placed = runner.run(feeds)
        with torch.no_grad():
            lowered = [t.numpy() for t in module(*[torch.from_numpy(feeds[n]) for n in inputs])]
        for w, p, t in zip(want, placed, lowered):
            np.testing.assert_allclose(p, w, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(t, w, rtol=1e-4, atol=1e-4)
        results = dict(zip(outputs, want))
        next_ids = results["logits"][:, -1].argmax(-1).reshape(2, 1).astype(np.int64)
        total = feeds["attention_mask"].shape[1] + 1
        feeds = {"input_ids": next_ids, "attention_mask": np.ones((2, total), np.int64)}
        feeds |= {n.replace("present.", "past_key_values."): v for n, v in results.items() if n != "logits"}


@pytest.mark.slow  # the planner profiles the file: about 20 s on 2 busy cores
def test_planner_places_a_genai_file_and_it_still_generates_genais_tokens():
    name = "llama_int4"
    expected = _expected(name)
    model = pl.load(GENAI / name / "model.onnx")
    inputs, outputs = _names(model)
    # a decode step as the sample (the planner takes no dimension of size 0, like an empty cache)
    sample = {"input_ids": np.array([[7]], dtype=np.int64), "attention_mask": np.ones((1, 9), np.int64)}
    sample |= {n: np.zeros((1, 2, 8, 16), np.float32) for n in inputs if n.startswith("past_key_values.")}
    plan = pl.auto_place(model, devices=2, sample_inputs=sample)
    plan.apply(model)
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    assert len(model.devices) == 2
    tokens = _greedy(pl.Runner(model).run, inputs, outputs, expected["prompt"], len(expected["new_tokens"]))
    assert tokens == expected["new_tokens"]
