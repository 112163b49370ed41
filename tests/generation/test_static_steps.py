"""Decode steps with static shapes (what ``cuda_graphs=True`` captures): the same tensors every
step, the cache written in place, the greedy tokens; on a GPU, one captured graph replayed."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

import placement as pl
from placement.generation import torch_decoder
from placement.generation.static_steps import INDEX_ATTRIBUTE
from placement.generation.torch_decoder import TorchDecoder
from tests.generation.conftest import greedy_reference, left_padded

STEPS = 6


@pytest.mark.parametrize("arch", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_static_decode_steps_see_the_same_tensors_and_write_the_cache_in_place(
    causal_lm, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    net, model = causal_lm(arch)
    pl.auto_place(model, devices=2, cost="flops")
    # the decoder a Generator builds, with the static steps cuda_graphs=True runs (without a capture)
    monkeypatch.setattr(torch_decoder, "TorchDecoder", functools.partial(TorchDecoder, static_shapes=True))
    generator = pl.Generator(model, runtime="torch")
    decoder = generator.decoder
    assert decoder.static == 2 * len(decoder.spec.layers)  # every present appended in place
    assert INDEX_ATTRIBUTE not in decoder.module.state_dict()  # the parameters stay the model's
    calls: list[list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = []
    presents: list[list[tuple[int, tuple[int, ...]]]] = []

    def seen(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.append([(a.data_ptr(), tuple(a.shape), a.stride()) for a in args])

    def made(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        cache = [v for name, v in zip(decoder.outputs, out) if name in decoder._present_of]
        presents.append([(v.data_ptr(), tuple(v.shape)) for v in cache])

    decoder.module.register_forward_pre_hook(seen, with_kwargs=True)
    decoder.module.register_forward_hook(made, with_kwargs=True)
    ids, mask = left_padded()
    out = generator.generate(ids, attention_mask=mask, max_new_tokens=STEPS)
    np.testing.assert_array_equal(out, greedy_reference(net, ids, mask, STEPS))
    assert decoder.static_steps.static_steps == STEPS - 1 and len(calls) == STEPS
    decode = calls[1:]
    assert all(step == decode[0] for step in decode)  # one capture would serve every step
    slot = generator._slots[0]
    buffers = {
        (slot.buffers[past].data_ptr(), tuple(slot.buffers[past][: len(ids)].shape))
        for past in decoder._present_of.values()
    }
    assert {ptr for ptr, _ in presents[0]} == {ptr for ptr, _ in buffers}  # the prompt: written in place
    for step in presents[1:]:  # a decode step's present is its whole preallocated buffer
        assert set(step) == buffers
    assert generator.generate(ids, attention_mask=mask, max_new_tokens=STEPS).tolist() == out.tolist()


def test_cuda_graphs_needs_a_gpu(causal_lm) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/generation/test_static_steps.py's gpu test captures")
    _, model = causal_lm("gpt2")
    with pytest.raises(pl.PlacementError, match="cuda_graphs"):
        pl.Generator(model, runtime="torch", cuda_graphs=True)


@pytest.mark.gpu
def test_a_decode_step_is_captured_once_and_replayed(causal_lm) -> None:
    net, model = causal_lm("llama")
    pl.auto_place(model, devices=2, cost="flops")
    device_map = {str(device): "cuda:0" for device in model.devices}
    generator = pl.Generator(model, runtime="torch", device_map=device_map, cuda_graphs=True)
    steps = generator.decoder.static_steps
    assert steps is not None and steps.capture
    ids, mask = left_padded()
    out = generator.generate(ids, attention_mask=mask, max_new_tokens=STEPS)
    np.testing.assert_array_equal(out, greedy_reference(net, ids, mask, STEPS))
    assert steps.captures == 1 and steps.replays == STEPS - 1
    again = generator.generate(ids, attention_mask=mask, max_new_tokens=STEPS)
    np.testing.assert_array_equal(again, out)
    assert steps.captures == 1 and steps.replays == 2 * (STEPS - 1)  # the same slot: no new capture
