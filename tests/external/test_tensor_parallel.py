"""split_tensor_parallel on Hugging Face architectures from tiny configs: GPT-2 (fused QKV in a
Conv1D, tied LM head), Llama with grouped-query attention (KV heads split, and replicated where
the degree exceeds them), BERT (attention mask, token types); outputs within 1e-5 of the module."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import placement as pl
from placement.graph.nodes import collective_tag

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # each export takes seconds

SMALL = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "hidden_size": 32,
    "intermediate_size": 64,
    "vocab_size": 100,
    "max_position_embeddings": 64,
}


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))


class _First(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.net(*args)[0]


def _check(net: torch.nn.Module, args: tuple[torch.Tensor, ...], degree: int) -> pl.Model:
    module = _First(net.eval()).eval()
    with torch.no_grad():
        expected = module(*args).numpy()
    model = pl.from_torch(module, args)
    result = pl.split_tensor_parallel(model, devices=list(range(degree)))
    pl.verify(model)
    # an embedding, then 2 all-reduces per block (attention output, MLP down projection)
    assert result.all_reduces == 1 + 2 * SMALL["num_hidden_layers"]
    device_map = dict.fromkeys(range(degree), "cpu")
    out = pl.Runner(model, device_map=device_map, fold=False).run([a.numpy() for a in args])[0]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    return model


def test_gpt2_fused_qkv_and_tied_head_with_ragged_heads() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=32,
        vocab_size=100,
        n_positions=64,
        use_cache=False,
        attn_implementation="eager",
    )
    model = _check(transformers.GPT2LMHeadModel(config), (_ids(),), 3)  # 4 heads on 3 devices
    assert any(collective_tag(n)["kind"] == "all_gather" for n in model.graph if collective_tag(n))


@pytest.mark.parametrize(("kv_heads", "degree"), [(2, 2), (1, 2), (2, 4)])
def test_llama_grouped_query_attention(kv_heads: int, degree: int) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_key_value_heads=kv_heads, attn_implementation="eager", **SMALL)
    _check(transformers.LlamaForCausalLM(config), (_ids(),), degree)


def test_bert_with_an_attention_mask() -> None:
    torch.manual_seed(0)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 6:] = 0
    config = transformers.BertConfig(attn_implementation="eager", **SMALL)
    _check(transformers.BertModel(config), (_ids(), mask), 2)
