"""Causal LMs from ``transformers`` (tiny configs): the plain export and the export with a KV cache.

``pl.from_torch`` takes a causal LM with its default config (``use_cache=True``) and exports
the plain forward with one notice; ``pl.from_causal_lm`` exports the cache as
``past_key_values.{i}.key/value`` inputs and ``present.{i}.key/value`` outputs, and its
logits equal the module's with and without a past, for GPT-2, Llama, Qwen2, Mistral, Phi
and Gemma.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import placement as pl
from placement.graph.causal_lm import cache_keyword, is_cache_input, is_cache_output, kv_layers

transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-4, "atol": 2e-5}
LLAMA = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
        return transformers.GPT2LMHeadModel(config).eval()
    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {}),
        "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    }
    config_name, class_name, extra = classes[arch]
    config = getattr(transformers, config_name)(**LLAMA, **extra)
    return getattr(transformers, class_name)(config).eval()


def _run(model: pl.Model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    runner = pl.Runner(model, device_map="cpu")
    return dict(zip(runner.output_names, runner.run(feeds)))


def _check_cached_logits(arch: str) -> None:
    net = _build(arch)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    model = pl.from_causal_lm(net, ids[:, :3])
    layers = kv_layers(model)
    assert [layer.index for layer in layers] == list(range(2))
    with torch.no_grad():
        reference = net(ids, use_cache=False).logits.numpy()
    heads, dim = layers[0].kv_heads, layers[0].head_dim
    empty = {
        name: np.zeros((2, heads, 0, dim), np.float32)
        for layer in layers
        for name in (layer.past_key, layer.past_value)
    }
    positions = np.arange(7)[None].repeat(2, 0)
    first = _run(
        model,
        {
            "input_ids": ids[:, :5].numpy(),
            "attention_mask": np.ones((2, 5), np.int64),
            "position_ids": positions[:, :5],
            **empty,
        },
    )
    np.testing.assert_allclose(first["logits"], reference[:, :5], **TOL)
    past = {name.replace("present", "past_key_values"): v for name, v in first.items() if name != "logits"}
    assert past["past_key_values.1.value"].shape == (2, heads, 5, dim)
    second = _run(
        model,
        {
            "input_ids": ids[:, 5:].numpy(),
            "attention_mask": np.ones((2, 7), np.int64),
            "position_ids": positions[:, 5:],
            **past,
        },
    )
    np.testing.assert_allclose(second["logits"], reference[:, 5:], **TOL)
    assert second["present.0.key"].shape == (2, heads, 7, dim)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_cached_logits_equal_the_module(arch: str) -> None:
    _check_cached_logits(arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "mistral", "phi", "gemma"])
def test_cached_logits_equal_the_module_other_architectures(arch: str) -> None:
    try:
        _check_cached_logits(arch)
    except pl.ExportError as err:
        if arch == "mistral" and "data-dependent" in str(err):  # torch 2.11's export of its sliding window
            pytest.skip(f"this torch's exporter cannot export {arch} with a cache: {str(err)[:200]}")
        raise


@pytest.mark.slow
def test_cache_names_and_dynamic_dims() -> None:
    model = pl.from_causal_lm(_build("llama"), torch.tensor([[1, 2, 3]]))
    inputs = [v.name for v in model.graph.inputs]
    assert inputs[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert all(is_cache_input(name) for name in inputs[3:])
    assert [v.name for v in model.graph.outputs][0] == "logits"
    assert all(is_cache_output(v.name) for v in model.graph.outputs[1:])
    past = model.graph.inputs[3].shape
    assert [str(d) for d in past] == ["batch", "2", "past_sequence", "8"]
    assert kv_layers(model)[0].bytes_for(batch=4, length=10) == 2 * 4 * 2 * 10 * 8 * 4


def test_cache_keyword_is_read_from_the_signature() -> None:
    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, past_key_values=None):  # both: the new one wins
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    assert cache_keyword(New()) == "cache"
    assert cache_keyword(Old()) == "past_key_values"
    with pytest.raises(pl.ExportError, match="takes no KV cache"):
        cache_keyword(torch.nn.Linear(2, 2))


def test_bad_input_ids_are_refused() -> None:
    with pytest.raises(pl.InputError, match="2-D integer"):
        pl.from_causal_lm(_build("gpt2"), torch.zeros(3))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_from_torch_takes_the_default_config_with_one_notice(
    arch: str, caplog: pytest.LogCaptureFixture
) -> None:
    net = _build(arch)
    assert net.config.use_cache is True
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(2))
    with caplog.at_level(logging.WARNING, logger="placement.graph.export_rules"):
        model = pl.from_torch(net, (ids,))
    notices = [r.getMessage() for r in caplog.records if "use_cache" in r.getMessage()]
    assert len(notices) == 1, notices
    assert net.config.use_cache is True  # restored
    assert [v.name for v in model.graph.outputs] == ["logits"] or len(model.graph.outputs) == 1
    (logits,) = pl.Runner(model, device_map="cpu").run([ids.numpy()])
    with torch.no_grad():
        np.testing.assert_allclose(logits, net(ids).logits.numpy(), **TOL)
