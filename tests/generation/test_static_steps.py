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


def _decoder_without_mask() -> pl.Model:
    """A one-layer decoder taking only ``input_ids`` and its cache: attention over the whole
    cache, no mask, no positions."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "emb"),
        numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([1], np.int64), "axes1"),
    ]
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["x"]),
        helper.make_node("Unsqueeze", ["x", "axes1"], ["q"]),
        helper.make_node("Concat", ["past_key_values.0.key", "q"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "q"], ["present.0.value"], axis=2),
        helper.make_node("Transpose", ["present.0.key"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "present.0.value"], ["c"]),
        helper.make_node("Squeeze", ["c", "axes1"], ["c2"]),
        helper.make_node("MatMul", ["c2", "w"], ["logits"]),
    ]

    def cache(name: str, length: str) -> Any:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 1, length, 4])

    graph = helper.make_graph(
        nodes,
        "no_mask",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            cache("past_key_values.0.key", "past"),
            cache("past_key_values.0.value", "past"),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 8]),
            cache("present.0.key", "total"),
            cache("present.0.value", "total"),
        ],
        inits,
    )
    return pl.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10))


def test_a_model_without_attention_mask_decodes_with_growing_shapes() -> None:
    """A step over the whole preallocated buffer reads its unwritten positions unless a mask
    hides them: a model that takes no attention_mask (or no position_ids) keeps eager steps,
    its logits those of growing shapes."""
    from placement.generation.prepare import decoder_model

    def logits(static: bool) -> list[np.ndarray]:
        decoder = TorchDecoder(decoder_model(_decoder_without_mask()), device_map="cpu", static_shapes=static)
        assert (decoder.static_steps is None) or not static
        slot = decoder.new_slot(1, 8)
        decoder.start(slot, 1)
        out = [decoder.step(slot, {"input_ids": np.array([[1, 2, 3]])})]
        out += [decoder.step(slot, {"input_ids": np.array([[t]])}) for t in (4, 5)]
        return out

    for got, want in zip(logits(True), logits(False)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
