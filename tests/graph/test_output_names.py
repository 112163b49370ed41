"""Outputs named from the module's output structure (Hugging Face ``ModelOutput`` keys) or by
``from_torch(..., output_names=)``; module scopes free of the exporter's placeholder modules."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import placement as pl
from placement.errors import ExportError

transformers = pytest.importorskip("transformers")


def _config():
    return transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )


@functools.cache
def _bert():
    torch.manual_seed(0)
    net = transformers.BertModel(_config()).eval()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=16)}
    model = pl.from_torch(
        net,
        (),
        {"input_ids": ids, "attention_mask": mask},
        dynamic_shapes={"input_ids": dims, "attention_mask": dims},
    )
    return net, model, ids, mask


def test_hugging_face_outputs_are_named_by_their_keys():
    net, model, ids, mask = _bert()
    assert model.outputs == ["last_hidden_state", "pooler_output"]
    want = net(input_ids=ids, attention_mask=mask)
    got = pl.run(model, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    for name, array in zip(model.outputs, got):
        np.testing.assert_allclose(array, want[name].detach().numpy(), atol=1e-5)
    module = pl.to_torch(model, device_map="cpu")
    assert module.output_names == ["last_hidden_state", "pooler_output"]
    torch.testing.assert_close(module(ids, mask)[1], want.pooler_output, atol=1e-5, rtol=1e-5)


def test_a_classifier_returns_logits():
    torch.manual_seed(0)
    net = transformers.BertForSequenceClassification(_config()).eval()
    ids = torch.randint(0, 50, (2, 7))
    model = pl.from_torch(net, (ids,))
    assert model.outputs == ["logits"]
    np.testing.assert_allclose(
        pl.run(model, {"input_ids": ids.numpy()})[0], net(ids).logits.detach(), atol=1e-5
    )


class _Pair(torch.nn.Module):
    def forward(self, x):
        return x.relu(), x.tanh()


def test_output_names_by_the_caller():
    x = torch.randn(2, 3)
    model = pl.from_torch(_Pair(), (x,), output_names=["pos", "squashed"])
    assert model.outputs == ["pos", "squashed"]
    pos, squashed = pl.run(model, {"x": x.numpy()})
    np.testing.assert_allclose(squashed, x.tanh().numpy(), atol=1e-6)
    swapped = pl.from_torch(_Pair(), (x,), output_names=["tanh", "relu"])  # the exporter's own names, swapped
    assert swapped.outputs == ["tanh", "relu"]
    np.testing.assert_allclose(pl.run(swapped, {"x": x.numpy()})[0], x.relu().numpy(), atol=1e-6)
    assert pl.from_torch(_Pair(), (x,)).outputs == ["relu", "tanh"]  # a tuple keeps the exporter's names


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["one"], "1 output names for 2 outputs"),
        (["a", "a"], "duplicate"),
        (["a", "x"], "'x' is already a blob"),
    ],
)
def test_bad_output_names_are_refused(names, message):
    net = _Pair()
    with pytest.raises(ExportError, match=message):
        pl.from_torch(net, (torch.randn(2, 3),), output_names=names)


def test_scopes_hold_no_exporter_placeholder_modules():
    _, model, _, _ = _bert()
    scopes = {op.scope or "" for op in model.ops}
    assert "encoder.layer.0.attention.self.query" in scopes
    assert not [s for s in scopes if "_empty_nn_module_stack" in s]
