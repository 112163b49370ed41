"""``pl.generate`` / ``pl.Generator``: token for token equal to greedy decoding by full recompute.

Both runtimes, 2 and 3 logical devices (emulated, one session per stage), the planner's
placement and a random one, left-padded batches, per-sequence end of sequence, pipelined
groups, and the cache staying on its devices (only the new tokens' activations cross).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import placement as pl
from placement.graph.kv_names import is_cache_input
from tests.generation.conftest import greedy_reference, left_padded

STEPS = 6


def _random_placement(model: pl.Model, devices: int, seed: int) -> None:
    """Each module's ops on a random device (every op of a module together: fewer sessions)."""
    rng = random.Random(seed)
    chosen: dict[str, int] = {}
    for op in model.ops:
        scope = op.scope or op.name
        model.set_device(op.name, chosen.setdefault(scope, rng.randrange(devices)))


# Each runtime meets 2 and 3 devices and both placements (not the whole cross product: time).
@pytest.mark.slow
@pytest.mark.parametrize(("runtime", "devices"), [("ort", 2), ("torch", 3)])
def test_planner_placement_generates_the_greedy_tokens(causal_lm, runtime: str, devices: int) -> None:
    net, model = causal_lm("llama")
    pl.auto_place(model, devices=devices, cost="flops")
    assert len({op.device for op in model.ops}) == devices
    ids, mask = left_padded()
    out = pl.generate(model, ids, attention_mask=mask, max_new_tokens=STEPS, runtime=runtime)
    np.testing.assert_array_equal(out, greedy_reference(net, ids, mask, STEPS))


@pytest.mark.parametrize(("runtime", "devices"), [("ort", 3), ("torch", 2)])
def test_random_placement_generates_the_greedy_tokens(causal_lm, runtime: str, devices: int) -> None:
    net, model = causal_lm("llama")
    _random_placement(model, devices, seed=devices)
    ids, mask = left_padded()
    out = pl.generate(model, ids, attention_mask=mask, max_new_tokens=STEPS, runtime=runtime)
    np.testing.assert_array_equal(out, greedy_reference(net, ids, mask, STEPS))


@pytest.mark.slow
def test_gpt2_folded_and_torch_ids(causal_lm) -> None:
    net, model = causal_lm("gpt2")
    pl.auto_place(model, devices=2, cost="flops")
    ids = torch.tensor([[5, 17, 33], [7, 8, 9]])
    out = pl.generate(model, ids, max_new_tokens=STEPS, device_map="cpu")
    assert isinstance(out, torch.Tensor) and out.shape == (2, 3 + STEPS)
    expected = greedy_reference(net, ids.numpy(), np.ones((2, 3), np.int64), STEPS)
    np.testing.assert_array_equal(out.numpy(), expected)


def test_pipelined_groups_give_the_same_tokens(causal_lm) -> None:
    net, model = causal_lm("llama")
    pl.auto_place(model, devices=2, cost="flops")
    ids, mask = left_padded()
    ids, mask = np.concatenate([ids, ids[::-1]]), np.concatenate([mask, mask[::-1]])
    generator = pl.Generator(model, chunks=2)
    out = generator.generate(ids, attention_mask=mask, max_new_tokens=STEPS)
    np.testing.assert_array_equal(out, greedy_reference(net, ids, mask, STEPS))
    assert len(generator.decoder.parts) >= 2


def test_pipelined_workers_and_thread_budgets(causal_lm) -> None:
    """A stage that only reads shapes gets no worker of its own; each emulated device gets its share
    of the cores in both ``chunks``, and ``threads_per_stage`` sets it for ``chunks=1`` too."""
    from placement.generation.ort_decoder import _shape_only
    from placement.runtime.schedule import stage_threads

    net, model = causal_lm("llama")
    pl.auto_place(model, devices=2, cost="flops")
    ids = np.array([[3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14]])
    piped = pl.Generator(model, chunks=2)
    share = stage_threads(2)
    one = pl.Generator(model, threads_per_stage=share)
    for generator in (piped, one):
        steps = [s for s in generator.decoder.runner.program.steps if hasattr(s, "exec")]
        assert {s.exec.session.get_session_options().intra_op_num_threads for s in steps} == {share}
    decoder = piped.decoder
    workers = decoder.workers
    assert sorted(i for parts in workers for i in parts) == list(range(len(decoder.parts)))
    for parts in workers:  # every worker runs at least one stage that reads tensor data
        assert any(
            kind == "stage" and not _shape_only(item.step) for i in parts for kind, item in decoder.parts[i]
        )
    expected = greedy_reference(net, ids, np.ones_like(ids), STEPS)
    np.testing.assert_array_equal(piped.generate(ids, max_new_tokens=STEPS), expected)
    np.testing.assert_array_equal(one.generate(ids, max_new_tokens=STEPS), expected)
    with pytest.raises(pl.PlacementError, match="threads_per_stage"):
        pl.Generator(model, runtime="torch", threads_per_stage=1)


def test_end_of_sequence_per_sequence(causal_lm) -> None:
    net, model = causal_lm("llama")
    ids, mask = left_padded()
    reference = greedy_reference(net, ids, mask, STEPS)
    eos = int(reference[1, ids.shape[1] + 1])  # the second new token of sequence 1
    out = pl.generate(model, ids, attention_mask=mask, max_new_tokens=STEPS, eos_token_id=eos, pad_token_id=0)
    for row, expected in zip(out, reference):
        new, wanted = row[ids.shape[1] :], expected[ids.shape[1] :]
        hit = np.flatnonzero(wanted == eos)
        end = hit[0] + 1 if hit.size else len(wanted)
        np.testing.assert_array_equal(new[:end], wanted[:end])
        assert (new[end:] == 0).all()
    assert out.shape[1] <= ids.shape[1] + STEPS


@pytest.mark.slow
def test_no_eos_generates_exactly_max_new_tokens(causal_lm) -> None:
    _, model = causal_lm("gpt2")
    out = pl.generate(model, np.array([[1, 2]]), max_new_tokens=9, device_map="cpu")
    assert out.shape == (1, 11)


def test_generator_reuses_sessions_and_caches(causal_lm) -> None:
    net, model = causal_lm("llama")
    pl.auto_place(model, devices=2, cost="flops")
    generator = pl.Generator(model)
    ids = np.array([[3, 4, 5]])
    first = generator.generate(ids, max_new_tokens=4)
    built = generator.decoder.runner.stats.sessions_built
    slots = list(generator._slots)
    second = generator.generate(ids, max_new_tokens=4)
    np.testing.assert_array_equal(first, second)
    assert generator.decoder.runner.stats.sessions_built == built
    assert generator._slots == slots  # the same buffers, not reallocated
    np.testing.assert_array_equal(first, greedy_reference(net, ids, np.ones_like(ids), 4))


def test_sampling_is_seeded(causal_lm) -> None:
    _, model = causal_lm("gpt2")
    generator = pl.Generator(model, device_map="cpu")
    ids = np.array([[1, 2, 3]])
    options = {"max_new_tokens": 8, "do_sample": True, "temperature": 0.9, "top_k": 20, "top_p": 0.9}
    a = generator.generate(ids, seed=3, **options)
    b = generator.generate(ids, seed=3, **options)
    np.testing.assert_array_equal(a, b)
    torch_runtime = pl.generate(model, ids, seed=3, runtime="torch", device_map="cpu", **options)
    np.testing.assert_array_equal(a, torch_runtime)


def test_decode_steps_move_the_new_tokens_not_the_cache(causal_lm) -> None:
    _, model = causal_lm("llama")
    pl.auto_place(model, devices=2, cost="flops")
    generator = pl.Generator(model)
    stats = generator.copy_stats
    per_step = []
    for steps in (2, 12):
        stats.reset()
        generator.generate(np.array([[3, 4, 5, 6]]), max_new_tokens=steps)
        per_step.append(stats.bytes)
    decode_bytes = (per_step[1] - per_step[0]) / 10  # ten more decode steps
    layer = pl.graph.causal_lm.kv_layers(model)[0]
    cache_bytes = layer.bytes_for(batch=1, length=16) // 2  # one key (or value) cache at 16 tokens
    hidden = 32 * 4  # one token's hidden state, float32
    assert stats.names.isdisjoint({name for name in stats.names if is_cache_input(name)})
    assert not any(name.startswith(("present", "past_key_values")) for name in stats.names)
    assert decode_bytes < cache_bytes
    assert decode_bytes <= 8 * hidden  # the hidden state, rotary cos/sin, the mask and shapes: a few rows


def test_streamer_sees_prompt_then_each_token(causal_lm) -> None:
    _, model = causal_lm("gpt2")
    seen: list[np.ndarray] = []

    class Streamer:
        def put(self, value: np.ndarray) -> None:
            seen.append(np.asarray(value))

        def end(self) -> None:
            seen.append(np.array([-1]))

    out = pl.generate(model, np.array([[1, 2]]), max_new_tokens=3, device_map="cpu", streamer=Streamer())
    assert len(seen) == 5 and seen[-1][0] == -1
    np.testing.assert_array_equal(np.concatenate([s.ravel() for s in seen[:-1]]), out.ravel())


def test_bad_input_is_refused(causal_lm) -> None:
    _, model = causal_lm("gpt2")
    with pytest.raises(pl.InputError, match="runtime"):
        pl.Generator(model, runtime="tensorrt")
    generator = pl.Generator(model, device_map="cpu")
    with pytest.raises(pl.InputError, match="max_new_tokens"):
        generator.generate(np.array([[1]]), max_new_tokens=0)
    with pytest.raises(pl.InputError, match="attention_mask"):
        generator.generate(np.array([[1, 2]]), attention_mask=np.ones((1, 3)), max_new_tokens=1)
    with pytest.raises(pl.InputError, match="input_ids"):
        generator.generate(np.array([[0.5]]), max_new_tokens=1)
    with pytest.raises(pl.InputError, match="input_ids"):
        pl.Generator(pl.from_torch(torch.nn.Linear(2, 2), (torch.randn(1, 2),)))


def test_torch_runtime_pipelined_gives_the_tokens_of_one_chunk(causal_lm) -> None:
    net, model = causal_lm("llama")
    pl.auto_place(model, devices=2, cost="flops")
    ids, mask = left_padded()
    ids, mask = np.concatenate([ids, ids[::-1]]), np.concatenate([mask, mask[::-1]])
    one = pl.generate(model, ids, attention_mask=mask, max_new_tokens=STEPS, runtime="torch")
    generator = pl.Generator(model, runtime="torch", chunks=2)
    assert len(generator.decoder.module.stages) >= 2  # split into stages, micro-batches in flight
    np.testing.assert_array_equal(generator.generate(ids, attention_mask=mask, max_new_tokens=STEPS), one)
    np.testing.assert_array_equal(one, greedy_reference(net, ids, mask, STEPS))
