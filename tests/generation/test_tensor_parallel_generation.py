"""``pl.generate`` through a tensor-parallel split: the KV cache split on its head axis.

A causal LM split by ``pl.split_tensor_parallel(devices=[0, 1])`` keeps the cache convention
at its graph boundary (whole ``past_key_values.{i}.key/value`` in, ``present.{i}.key/value``
out); the decoder keeps each device's heads of each cache on that device
(:mod:`placement.passes.tensor_parallel.kv_shards`), so a decode step moves activations,
not the cache. Tokens equal greedy decoding with the unsplit module (or genai's own tokens
for the file genai's builder made), in both runtimes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import placement as pl
from placement.graph.causal_lm import kv_layers
from placement.graph.kv_names import is_cache_input, is_cache_output
from placement.graph.nodes import collective_tag
from tests.generation.conftest import VOCAB, greedy_reference, left_padded, transformers

GENAI = Path(__file__).resolve().parents[1] / "genai_files"
STEPS = 6


def _split(model: pl.Model) -> pl.Model:
    whole = [(layer.past_key, layer.kv_heads) for layer in kv_layers(model)]
    pl.split_tensor_parallel(model, devices=[0, 1])
    pl.verify(model)
    assert [
        (layer.past_key, layer.kv_heads) for layer in kv_layers(model)
    ] == whole  # the boundary stays whole
    return model


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_split_causal_lm_generates_the_greedy_tokens(causal_lm, arch: str) -> None:
    net, model = causal_lm(arch)
    _split(model)
    ids, mask = left_padded()
    expected = greedy_reference(net, ids, mask, STEPS)
    for runtime in ("ort", "torch"):
        generator = pl.Generator(model, runtime=runtime)
        heads = [layer.kv_heads for layer in generator.spec.layers]
        assert heads == [1] * (2 * len(kv_layers(model)))  # one cache per device and layer
        out = generator.generate(ids, attention_mask=mask, max_new_tokens=STEPS)
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("runtime", ["ort", "torch"])
def test_a_split_genai_file_generates_genais_tokens(runtime: str) -> None:
    expected = json.loads((GENAI / "llama_fp32" / "expected.json").read_text())
    model = _split(pl.load(GENAI / "llama_fp32" / "model.onnx"))
    attention = [node for node in model.graph if node.op_type == "GroupQueryAttention"]
    assert (
        sorted((n.attributes["num_heads"].value, n.attributes["kv_num_heads"].value) for n in attention)
        == [(2, 1)] * 4
    )  # 2 layers of 4 query / 2 KV heads, on 2 devices
    prompt = np.array([expected["prompt"]] * 2)
    generator = pl.Generator(model, runtime=runtime)
    out = generator.generate(prompt, max_new_tokens=len(expected["new_tokens"]))
    for row in out:
        assert row[prompt.shape[1] :].tolist() == expected["new_tokens"]
    assert [layer.past_key for layer in kv_layers(model)] == [f"past_key_values.{i}.key" for i in (0, 1)]
    if runtime == "ort":  # each device's cache heads stayed on it
        names = generator.copy_stats.names
        assert names and not any(is_cache_input(name) or is_cache_output(name) for name in names)


def _decode_bytes(generator: pl.Generator, ids: np.ndarray) -> tuple[float, set[str]]:
    """Bytes the transfers move per decode step (ten more steps), and the blobs they move."""
    stats = generator.copy_stats
    per_run = []
    for steps in (2, 12):
        stats.reset()
        generator.generate(ids, max_new_tokens=steps)
        per_run.append(stats.bytes)
    return (per_run[1] - per_run[0]) / 10, set(stats.names)


@pytest.mark.parametrize("arch", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_each_device_keeps_its_heads_of_the_cache_between_steps(causal_lm, arch: str) -> None:
    _, model = causal_lm(arch)
    whole = model.copy()
    result = pl.split_tensor_parallel(model, devices=[0, 1])
    assert result.all_reduces == 2 * len(kv_layers(model)) + (
        1 if arch == "llama" else 2
    )  # 2 per block, embeddings
    ids = np.array([[3, 4, 5, 6]])
    decode_bytes, names = _decode_bytes(pl.Generator(model), ids)
    assert not any(is_cache_input(name) or is_cache_output(name) for name in names)
    # Per decode step each all-reduce reads the other device's partial sum (one token's
    # hidden state, 32 float32) and the logits' second half crosses; ids, positions, the
    # mask and the past length are a few int64 more. The cache never crosses: one device's
    # key heads of one layer at 16 tokens is already 2 (batch 1, 1 head, 16 x 8 or 16 floats).
    hidden, vocab = 32 * 4, 96 * 4
    assert decode_bytes <= result.all_reduces * 2 * hidden + vocab // 2 + 256
    # the whole-boundary split moves the shards in and out every step: its bytes grow with the cache
    layer = kv_layers(whole)[0]
    assert decode_bytes < len(kv_layers(whole)) * layer.bytes_for(batch=1, length=16) // 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("heads", "kv", "degree"),
    [(4, 1, 2), (6, 3, 2), (4, 2, 4)],  # one KV head on both devices; ragged 2 + 1; each KV head on 2 of 4
)
def test_grouped_query_llamas_split_their_caches_by_kv_heads(heads: int, kv: int, degree: int) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=8 * heads,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=128,
    )
    net = transformers.LlamaForCausalLM(config).eval()
    model = pl.from_causal_lm(net, torch.tensor([[1, 2, 3]]))
    pl.split_tensor_parallel(model, devices=list(range(degree)))
    ids, mask = left_padded()
    expected = greedy_reference(net, ids, mask, STEPS)
    kv_parts = (
        [max(1, len(p)) for p in np.array_split(np.arange(kv), degree)] if kv >= degree else [1] * degree
    )
    for runtime in ("ort", "torch"):
        generator = pl.Generator(model, runtime=runtime)
        assert [layer.kv_heads for layer in generator.spec.layers] == kv_parts * 2
        out = generator.generate(ids, attention_mask=mask, max_new_tokens=STEPS)
        np.testing.assert_array_equal(out, expected)


@pytest.mark.slow
def test_a_2d_split_llama_generates_the_greedy_tokens(causal_lm) -> None:
    """Tensor inside pipeline: 2 pipeline stages, each split over its own group of 2 devices,
    one sequence group at a time and pipelined."""
    net, model = causal_lm("llama")
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 2})  # stages on 0 and 2
    result = pl.split_tensor_parallel(model, devices=[[0, 1], [2, 3]])
    pl.verify(model)
    assert sorted(str(d) for d in model.devices) == [f"cuda:{d}" for d in range(4)]
    assert {tuple(g) for g in (collective_tag(n)["group"] for n in model.graph if collective_tag(n))} == {
        ("cuda:0", "cuda:1"),
        ("cuda:2", "cuda:3"),
    }  # both stages split
    assert result.all_reduces == 2 * len(kv_layers(model)) + 1
    ids, mask = left_padded()
    expected = greedy_reference(net, ids, mask, STEPS)
    for runtime in ("ort", "torch"):
        generator = pl.Generator(model, runtime=runtime)
        assert [layer.kv_heads for layer in generator.spec.layers] == [1] * (2 * len(kv_layers(model)))
        out = generator.generate(ids, attention_mask=mask, max_new_tokens=STEPS)
        np.testing.assert_array_equal(out, expected)
        if runtime == "ort":  # each device's cache heads stayed on it, in both stages
            names = generator.copy_stats.names
            assert names and not any(is_cache_input(name) or is_cache_output(name) for name in names)
    for runtime in ("ort", "torch"):  # pipelined: 2 groups of sequences in flight through the stages
        out = pl.generate(model, ids, attention_mask=mask, max_new_tokens=STEPS, runtime=runtime, chunks=2)
        np.testing.assert_array_equal(out, expected)
