"""``placement generate``: a saved causal LM with its cache, or a Hugging Face folder with a tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import placement as pl
from tests.cli.helpers import cli
from tests.generation.conftest import build_llama, greedy_reference

transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_generate_a_saved_model_on_two_devices(tmp_path):
    net = build_llama(layers=2)
    pl.from_causal_lm(net, torch.tensor([[1, 2, 3]])).save(tmp_path / "llama.onnx")
    done = cli(
        "generate",
        "llama.onnx",
        "--input-ids",
        "5,17,33",
        "--max-new-tokens",
        "6",
        "--devices",
        "2",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    printed = [int(t) for t in done.stdout.splitlines()[0].split(",")]
    expected = greedy_reference(net, np.array([[5, 17, 33]]), np.ones((1, 3), np.int64), 6)
    assert printed == expected[0].tolist()
    assert "tokens/s" in done.stdout


@pytest.mark.slow
def test_generate_from_a_hugging_face_folder_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = [f"w{i}" for i in range(96)]  # token i is "wi"
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    core.pre_tokenizer = Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0")
    tokenizer.save_pretrained(tmp_path / "hf")
    net = build_llama(layers=2)
    net.save_pretrained(tmp_path / "hf")
    done = cli(
        "generate",
        "hf",
        "--prompt",
        "w5 w17 w33",
        "--tokenizer",
        "hf",
        "--max-new-tokens",
        "4",
        "--runtime",
        "torch",
        "--device-map",
        "cpu",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    expected = greedy_reference(net, np.array([[5, 17, 33]]), np.ones((1, 3), np.int64), 4)[0]
    assert done.stdout.splitlines()[0].split() == [words[t] for t in expected]


@pytest.mark.slow
def test_generate_refuses_a_model_without_a_cache(tmp_path):
    net = torch.nn.Linear(3, 3)
    pl.from_torch(net, (torch.randn(1, 3),)).save(tmp_path / "linear.onnx")
    done = cli("generate", "linear.onnx", "--input-ids", "1,2", cwd=tmp_path)
    assert done.returncode == 2
    assert "input_ids" in done.stderr
    done = cli("generate", "linear.onnx", cwd=tmp_path)
    assert done.returncode == 2 and "--input-ids" in done.stderr
