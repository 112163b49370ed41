"""Models nobody here wrote: Hugging Face ``transformers`` architectures, placed and run.

Each architecture is built from a tiny config (random weights, nothing is downloaded),
exported by ``pl.from_torch`` and placed on three logical devices, by ``pl.auto_place``
and by a random op assignment (many cuts, through attention masks, rotary embeddings,
grouped-query attention, relative position buckets, patch embeddings, shifted windows). The placed
model must compute what the original ``transformers`` module computes, in both
runtimes, pipelined over micro-batches, and after a save and a load.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import placement as pl

transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-4, "atol": 1e-5}
SMALL = {
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "vocab_size": 100,
    "max_position_embeddings": 64,
}


def _ids(batch: int = 4) -> torch.Tensor:
    return torch.randint(0, 100, (batch, 8), generator=torch.Generator().manual_seed(1))


def _mask(batch: int = 4) -> torch.Tensor:
    mask = torch.ones(batch, 8, dtype=torch.long)
    mask[0, 6:] = 0  # one padded sequence, so the mask matters
    return mask


def _image(batch: int = 4, side: int = 16) -> torch.Tensor:
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(2))


ARCHITECTURES: dict[str, Callable[[], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]] = {
    "llama": lambda: (
        transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=1, **SMALL)),
        (_ids(),),
    ),
    "qwen2": lambda: (
        transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=1, **SMALL)),
        (_ids(),),
    ),
    "gpt2": lambda: (
        transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64, use_cache=False
            )
        ),
        (_ids(),),
    ),
    "bert": lambda: (transformers.BertModel(transformers.BertConfig(**SMALL)), (_ids(), _mask())),
    "distilbert": lambda: (
        transformers.DistilBertModel(
            transformers.DistilBertConfig(
                n_layers=2, n_heads=2, dim=32, hidden_dim=64, vocab_size=100, max_position_embeddings=64
            )
        ),
        (_ids(), _mask()),
    ),
    "t5": lambda: (
        transformers.T5Model(
            transformers.T5Config(num_layers=2, num_heads=2, d_model=32, d_kv=16, d_ff=64, vocab_size=100)
        ),
        (_ids(), _mask(), _ids()),
    ),
    "vit": lambda: (
        transformers.ViTModel(
            transformers.ViTConfig(
                image_size=16,
                patch_size=4,
                num_hidden_layers=2,
                num_attention_heads=2,
                hidden_size=32,
                intermediate_size=64,
            )
        ),
        (_image(),),
    ),
    "convnext": lambda: (
        transformers.ConvNextModel(
            transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32)
        ),
        (_image(side=32),),
    ),
    # window attention: the TorchScript exporter (dynamo cannot export it with a dynamic
    # batch) annotates the output with fresh symbols; the batch axis is inferred again
    "swin": lambda: (
        transformers.SwinModel(
            transformers.SwinConfig(
                image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4
            )
        ),
        (_image(side=32),),
    ),
}


class FirstOutput(torch.nn.Module):
    """The architecture's first output (logits or last hidden state) from positional inputs."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if isinstance(self.net, transformers.T5Model):
            ids, mask, decoder_ids = args
            return self.net(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)[0]
        return self.net(*args)[0]


Exported = tuple[pl.Model, tuple[torch.Tensor, ...], np.ndarray]


@functools.cache
def _exported(name: str, dynamic_batch: bool) -> Exported:
    torch.manual_seed(0)
    net, args = ARCHITECTURES[name]()
    wrapped = FirstOutput(net.eval()).eval()
    with torch.no_grad():
        expected = wrapped(*args).numpy()
    dynamic = None
    if dynamic_batch:
        batch = torch.export.Dim("batch")
        dynamic = (tuple({0: batch} for _ in args),)  # forward(*args): one entry, a tuple
    return pl.from_torch(wrapped, args, dynamic_shapes=dynamic), args, expected


@pytest.fixture
def exported() -> Callable[..., Exported]:
    """(a fresh copy of the exported model, its inputs, the torch module's output)."""

    def get(name: str, *, dynamic_batch: bool = False) -> Exported:
        model, args, expected = _exported(name, dynamic_batch)
        return model.copy(), args, expected

    return get


def _numpy(args: tuple[torch.Tensor, ...]) -> list[Any]:
    return [a.numpy() for a in args]


def _lowered_output(model: pl.Model, args: tuple[torch.Tensor, ...]) -> np.ndarray:
    module = pl.to_torch(model)
    with torch.no_grad():
        out = module(*args)
    return (out[0] if isinstance(out, (list, tuple)) else out).cpu().numpy()  # auto: maybe a GPU


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_auto_placed_equals_the_original(name: str, exported: Any) -> None:
    model, args, expected = exported(name)
    plan = pl.auto_place(model, devices=3, cost="flops")
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    assert len({op.device for op in model.ops}) == 3, plan
    np.testing.assert_allclose(pl.run(model, _numpy(args))[0], expected, **TOL)
    np.testing.assert_allclose(_lowered_output(model, args), expected, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_randomly_placed_equals_the_original(name: str, exported: Any) -> None:
    model, args, expected = exported(name)
    rng = random.Random(name)
    for op in model.ops:
        model.set_device(op.name, rng.randrange(3))
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    np.testing.assert_allclose(pl.run(model, _numpy(args))[0], expected, **TOL)
    np.testing.assert_allclose(_lowered_output(model, args), expected, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "llama", "vit", "swin"])
def test_pipelined_over_microbatches(name: str, exported: Any) -> None:
    model, args, expected = exported(name, dynamic_batch=True)
    pl.auto_place(model, devices=2, cost="flops")
    pl.inject_cross_device_copies(model)
    runner = pl.Runner(model, device_map="cpu", chunks=2)
    np.testing.assert_allclose(runner.run(_numpy(args))[0], expected, **TOL)
    halves = [[a[:2] for a in _numpy(args)], [a[2:] for a in _numpy(args)]]
    streamed = np.concatenate([out[0] for out in runner.stream(halves)])
    np.testing.assert_allclose(streamed, expected, **TOL)
    module = pl.to_torch(model, chunks=2)
    with torch.no_grad():
        out = module(*args)
    got = (out[0] if isinstance(out, (list, tuple)) else out).cpu().numpy()  # auto: maybe a GPU
    np.testing.assert_allclose(got, expected, **TOL)


@pytest.mark.parametrize("name", ["t5", "qwen2"])
def test_saved_placed_model_runs_after_loading(name: str, exported: Any, tmp_path: Any) -> None:
    model, args, expected = exported(name)
    pl.auto_place(model, devices=2, cost="flops")
    pl.inject_cross_device_copies(model)
    path = tmp_path / f"{name}.onnx"
    model.save(path)
    loaded = pl.load(path)
    assert loaded.device_state() == model.device_state()
    np.testing.assert_allclose(pl.run(loaded, _numpy(args))[0], expected, **TOL)


@pytest.mark.parametrize("name", ["llama", "vit"])
def test_torch_calibrated_pipeline_trains_like_the_unsplit_module(name: str, exported: Any) -> None:
    model, args, expected = exported(name, dynamic_batch=True)
    options = dict(rounds=1, repeats=3, profile_repeats=1, device_map="cpu", sample_inputs=args)
    result = pl.calibrate(model, devices=2, runtime="torch", training=True, **options)
    assert result.plan.runtime == "torch" and result.bottleneck_s <= result.trials[0].bottleneck_s
    pl.inject_cross_device_copies(model)
    plain = pl.to_torch(model, device_map="cpu")
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    for module in (plain, piped):
        out = module(*args)
        y = out[0] if isinstance(out, (list, tuple)) else out
        y.float().square().mean().backward()
        np.testing.assert_allclose(y.detach().numpy(), expected, **TOL)
    grads = {key: p.grad for key, p in plain.named_parameters() if p.grad is not None}
    assert grads and grads.keys() == {key for key, p in piped.named_parameters() if p.grad is not None}
    for key, p in piped.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[key], rtol=1e-4, atol=1e-6)

    # the same step through train_step (1F1B, deferred weight gradients): the same gradients
    piped.zero_grad(set_to_none=True)
    loss = piped.train_step(*args, loss_fn=_first_output_loss)
    torch.testing.assert_close(loss, _first_output_loss(plain(*args)).detach(), rtol=1e-5, atol=1e-6)
    for key, p in piped.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[key], rtol=1e-4, atol=1e-6)


def _first_output_loss(out: Any) -> torch.Tensor:
    y = out[0] if isinstance(out, (list, tuple)) else out
    return y.float().square().mean()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "llama"])
def test_train_step_on_three_devices_with_uneven_microbatches(name: str, exported: Any) -> None:
    """Three stages (the middle one defers its weight gradients), a batch of 4 in 3 micro-batches."""
    model, args, _ = exported(name, dynamic_batch=True)
    pl.auto_place(model, devices=3, cost="flops")
    pl.inject_cross_device_copies(model)
    plain = pl.to_torch(model, device_map="cpu")
    want = _first_output_loss(plain(*args))
    want.backward()
    piped = pl.to_torch(model, device_map="cpu", chunks=3)
    assert len(piped.stages) == 3
    loss = piped.train_step(*args, loss_fn=_first_output_loss)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    grads = {key: p.grad for key, p in plain.named_parameters() if p.grad is not None}
    assert grads and grads.keys() == {key for key, p in piped.named_parameters() if p.grad is not None}
    for key, p in piped.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[key], rtol=1e-4, atol=1e-6)
