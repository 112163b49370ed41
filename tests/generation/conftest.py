"""Tiny causal LMs exported once per test session, and greedy decoding by full recompute."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import placement as pl

transformers = pytest.importorskip("transformers")

VOCAB = 96


def build_llama(layers: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(config).eval()


def build_gpt2(layers: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=128)
    return transformers.GPT2LMHeadModel(config).eval()


def greedy_reference(net: torch.nn.Module, ids: np.ndarray, mask: np.ndarray, steps: int) -> np.ndarray:
    """Greedy decoding with the original module, the whole sequence recomputed per token, no cache."""
    tokens, attention = torch.tensor(ids), torch.tensor(mask)
    for _ in range(steps):
        positions = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)
        with torch.no_grad():
            logits = net(tokens, attention_mask=attention, position_ids=positions, use_cache=False).logits
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], 1)
        attention = torch.cat([attention, torch.ones(len(tokens), 1, dtype=attention.dtype)], 1)
    return tokens.numpy()


def left_padded() -> tuple[np.ndarray, np.ndarray]:
    """Three prompts of lengths 5, 3 and 1, left padded with token 0."""
    ids = np.array([[11, 12, 13, 14, 15], [0, 0, 21, 22, 23], [0, 0, 0, 0, 31]], np.int64)
    mask = (ids != 0).astype(np.int64)
    return ids, mask


@pytest.fixture(scope="session")
def causal_lm() -> Callable[[str], tuple[torch.nn.Module, pl.Model]]:
    """``(module, exported model with its cache)`` for ``"llama"`` or ``"gpt2"`` (a fresh copy each call)."""
    cache: dict[str, Any] = {}

    def get(arch: str) -> tuple[torch.nn.Module, pl.Model]:
        if arch not in cache:
            net = build_llama() if arch == "llama" else build_gpt2()
            cache[arch] = (net, pl.from_causal_lm(net, torch.tensor([[1, 2, 3]])))
        net, model = cache[arch]
        return net, model.copy()

    return get
