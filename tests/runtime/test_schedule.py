"""Tests for ``placement.runtime.schedule`` and the pipelined runtimes built on it.

The schedule and the workers (order, overlap, errors, back-pressure, no leaked
threads), then both runtimes on every zoo model placed on two logical devices:
``Runner(chunks=k)`` and ``Runner.stream`` equal the unsplit run, and
``to_torch(chunks=k)`` gives the unsplit module's outputs and gradients in every
checkpoint mode.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time

import numpy as np
import pytest
import torch

import placement as pl
from placement.runtime.schedule import (
    StageWorkers,
    batch_axes,
    bubble_fraction,
    clock_cycles,
    concat_batch,
    run_microbatches,
    split_batch,
    stream_microbatches,
)
from tests.conftest import MODEL_NAMES

ATOL = 1e-5


@pytest.fixture(autouse=True)
def no_thread_leak():
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        extra = [t for t in set(threading.enumerate()) - before if t.name.startswith("placement-pipeline")]
        if not extra:
            return
        time.sleep(0.01)
    raise AssertionError(f"pipeline threads left running: {extra}")


# --- schedule and workers -------------------------------------------------------------------


@pytest.mark.parametrize("k,n", [(1, 1), (1, 3), (4, 1), (4, 2), (8, 3), (3, 5)])
def test_clock_cycles_is_gpipe_fill_drain(k, n):
    ticks = clock_cycles(k, n)
    assert len(ticks) == k + n - 1
    seen = [pair for tick in ticks for pair in tick]
    assert sorted(seen) == sorted((i, j) for i in range(k) for j in range(n))
    for t, tick in enumerate(ticks):
        assert all(i + j == t for i, j in tick)
    busy = sum(len(tick) for tick in ticks)
    assert 1 - busy / (len(ticks) * n) == pytest.approx(bubble_fraction(k, n))


def test_workers_follow_the_schedule_and_overlap():
    trace: list[tuple[int, int]] = []
    lock = threading.Lock()
    first_done = threading.Event()

    def stage(j):
        def fn(i, x):
            if j == 0 and i == 1:
                # Stage 0 may only finish micro-batch 1 once stage 1 is running micro-batch 0:
                # the two stages overlap (this would time out in a sequential executor).
                assert first_done.wait(5), "stages did not overlap"
            if j == 1 and i == 0:
                first_done.set()
            with lock:
                trace.append((i, j))
            return x + [j]

        return fn

    out = run_microbatches([stage(0), stage(1), stage(2)], [[] for _ in range(4)])
    assert out == [[0, 1, 2]] * 4
    position = {pair: n for n, pair in enumerate(trace)}
    for i in range(4):
        for j in range(3):
            if j:
                assert position[(i, j - 1)] < position[(i, j)]
            if i:
                assert position[(i - 1, j)] < position[(i, j)]


def test_error_names_stage_and_microbatch_and_stops_workers():
    def bad(i, x):
        if i == 2:
            raise ValueError("boom")
        return x

    with pytest.raises(
        pl.PipelineError, match=r"stage 1 \(second\) failed on micro-batch 2: ValueError: boom"
    ) as info:
        run_microbatches(
            [lambda i, x: x, bad, lambda i, x: x], list(range(5)), names=["first", "second", "third"]
        )
    assert (info.value.stage, info.value.microbatch) == (1, 2)
    assert isinstance(info.value.__cause__, ValueError)


def test_stream_keeps_order_and_applies_back_pressure():
    pulled = 0
    consumed = 0
    gaps = []

    def source():
        nonlocal pulled
        for n in range(20):
            pulled += 1
            gaps.append(pulled - consumed)
            yield n

    def slow(i, x):
        time.sleep(0.001 * (x % 3))
        return x * x

    for value in stream_microbatches([slow, lambda i, x: x + 1], source(), window=3):
        assert value == consumed**2 + 1
        consumed += 1
    assert consumed == 20
    assert max(gaps) <= 3  # never more than `window` read ahead of the consumer


def test_stream_closed_early_stops_workers():
    gen = stream_microbatches([lambda i, x: x], iter(range(100)), window=4)
    assert next(gen) == 0
    gen.close()  # the autouse fixture checks that the worker is gone


@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_inline_last_stage_runs_on_the_caller_in_order(n_stages):
    caller = threading.get_ident()
    where: list[tuple[int, bool]] = []
    entered: list[int] = []

    @contextlib.contextmanager
    def context(j):
        entered.append(j)
        yield

    def stage(j):
        def fn(i, x):
            if j == n_stages - 1:
                where.append((i, threading.get_ident() == caller))
            return x + [j]

        return fn

    with StageWorkers([stage(j) for j in range(n_stages)], context=context, inline_last=True) as workers:
        assert len(workers._threads) == n_stages - 1
        for i in range(4):
            workers.submit(i, [i])
        assert [workers.result() for _ in range(4)] == [[i, *range(n_stages)] for i in range(4)]
    assert where == [(i, True) for i in range(4)]
    assert entered.count(n_stages - 1) == 4  # the caller enters the last stage's context per call


@pytest.mark.parametrize("failing", [0, 1])
def test_inline_last_stage_errors_name_stage_and_microbatch(failing):
    def stage(j):
        def fn(i, x):
            if j == failing and i == 1:
                raise ValueError("boom")
            return x

        return fn

    with pytest.raises(pl.PipelineError, match=rf"stage {failing} \(s{failing}\) failed on micro-batch 1"):
        with StageWorkers([stage(0), stage(1)], ["s0", "s1"], inline_last=True) as workers:
            for i in range(3):
                workers.submit(i, i)
            [workers.result() for _ in range(3)]  # the autouse fixture checks no worker is left


def test_workers_need_context_manager():
    workers = StageWorkers([lambda i, x: x])
    with pytest.raises(RuntimeError):
        workers.submit(0, 1)


def test_split_and_concat_round_trip():
    x = np.arange(7 * 3).reshape(7, 3)
    mask = np.ones(3)
    parts = split_batch([x, mask], [0, None], 3)
    assert [p[0].shape[0] for p in parts] == [3, 2, 2]
    assert all(p[1] is mask for p in parts)
    (back,) = concat_batch([[p[0]] for p in parts], [0])
    assert np.array_equal(back, x)
    t = torch.arange(10).reshape(2, 5)
    parts = split_batch([t], [1], 2)
    assert torch.equal(concat_batch(parts, [1])[0], t)
    with pytest.raises(pl.InputError, match="disagree"):
        split_batch([x, np.zeros((5, 3))], [0, 0], 2)


# --- the zoo, placed on two devices ------------------------------------------------------------


@functools.cache
def _placed(name: str):
    from placement import models

    net, args = models.build(name, "tiny")
    batch = torch.export.Dim("batch")
    model = pl.from_torch(net, args, dynamic_shapes=tuple({0: batch} for _ in args))
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    # A batch of 5 (not a multiple of the chunk counts used below).
    big = tuple(torch.cat([a, a.flip(0), a, a.flip(0), a])[:5] for a in args)
    return model, net, big


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_runner_chunks_equals_unsplit(name):
    model, net, args = _placed(name)
    arrays = [a.numpy() for a in args]
    (expected,) = pl.Runner(model, device_map="cpu").run(arrays)
    runner = pl.Runner(model, device_map="cpu", chunks=3)
    assert len(runner.stages) == 2
    (got,) = runner.run(arrays)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=ATOL)
    np.testing.assert_allclose(got, net(*args).detach().numpy(), atol=1e-4)
    assert got.flags.owndata


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_stream_equals_runs_in_order(name):
    model, _, args = _placed(name)
    batches = [[a[:n].numpy() for a in args] for n in (5, 1, 3, 2)]
    runner = pl.Runner(model, device_map="cpu", threads_per_stage=1)
    expected = [runner.run(b)[0] for b in batches]
    outs = list(runner.stream(iter(batches), window=2))
    assert len(outs) == len(batches)
    for got, want in zip(outs, expected):
        np.testing.assert_allclose(got[0], want, atol=ATOL)
    chunked = pl.Runner(model, device_map="cpu", chunks=2)
    for got, want in zip(chunked.stream(batches), expected):
        np.testing.assert_allclose(got[0], want, atol=ATOL)


def test_runner_stage_error_names_stage_and_microbatch():
    model, _, (idx,) = _placed("gpt")
    bad = idx.clone()
    bad[3, 0] = 10_000  # out of the vocabulary: the embedding Gather fails, in micro-batch 1
    runner = pl.Runner(model, device_map="cpu", chunks=3)
    with pytest.raises(pl.PipelineError, match=r"stage 0 .* failed on micro-batch 1") as info:
        runner.run([bad])
    assert info.value.microbatch == 1
    # The runner still works after a failed run.
    (out,) = runner.run([idx])
    assert out.shape[0] == 5


def test_static_batch_is_a_clear_error(exported):
    model, _, _ = exported("mlp")
    with pytest.raises(pl.PlacementError, match=r"no input has a batch axis \('input': float32\[4, 16\]\)"):
        pl.Runner(model, device_map="cpu", chunks=2)


def test_batch_axes_override_and_unknown_name():
    model, _, (idx,) = _placed("gpt")
    axes = batch_axes(model, overrides={"idx": 0})
    assert axes.inputs == {"idx": 0}
    with pytest.raises(pl.InputError, match="'nope'"):
        pl.Runner(model, device_map="cpu", chunks=2, batch_axes={"nope": 0})
    # An input declared unbatched goes whole to every micro-batch; then no input is batched.
    with pytest.raises(pl.PlacementError, match="no input has a batch axis"):
        pl.Runner(model, device_map="cpu", chunks=2, batch_axes={"idx": None})


def test_batch_axes_see_through_an_exporters_fresh_output_symbols():
    """An exporter may annotate an output with symbols of its own (Swin's window partition
    reshapes the batch away and back, and the TorchScript exporter names the result
    ``LayerNormalization747_dim_0``): the output's shape is then inferred again from the
    inputs, which finds the batch symbol, in both runtimes."""
    import onnx_ir as ir

    placed, net, args = _placed("gpt")
    model = placed.copy()
    out = model.graph.outputs[0]
    out.shape = ir.Shape(["Reshape_dim_0", "Reshape_dim_1", out.shape[2]])
    assert batch_axes(model).outputs == {out.name: 0}
    want = net(*args).detach().numpy()
    (got,) = pl.Runner(model, device_map="cpu", chunks=2).run([a.numpy() for a in args])
    np.testing.assert_allclose(got, want, atol=1e-4)
    with torch.no_grad():
        got = pl.to_torch(model, device_map="cpu", chunks=2)(*args)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-4)


def test_constants_become_tensors_for_symbolic_shape_inference():
    """ONNX Runtime's symbolic shape inference reads a Constant's ``value`` only (BEiT's
    TorchScript export holds ``value_ints`` ones): they are rewritten first, same values."""
    from onnx import TensorProto, helper, numpy_helper

    from placement.runtime.schedule.axes import _tensor_constants

    nodes = [
        helper.make_node("Constant", [], ["shape"], value_ints=[-1, 2, 2]),
        helper.make_node("Constant", [], ["scale"], value_float=0.5),
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Mul", ["r", "scale"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = _tensor_constants(helper.make_model(graph))
    values = [numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node[:2]]
    assert [n.attribute[0].name for n in model.graph.node[:2]] == ["value", "value"]
    assert values[0].tolist() == [-1, 2, 2] and values[0].dtype == np.int64
    assert values[1].shape == () and values[1].dtype == np.float32 and float(values[1]) == 0.5


# --- torch ------------------------------------------------------------------------------------


def _grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_torch_pipelined_outputs_and_gradients(name):
    model, net, args = _placed(name)
    plain = pl.to_torch(model, device_map="cpu")
    piped = pl.to_torch(model, device_map="cpu", chunks=3, checkpoint="except_last")
    assert len(piped.stages) == 2
    assert [n for n, _ in piped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    piped.load_state_dict(plain.state_dict())
    plain.train()
    piped.train()  # BatchNorm keeps running statistics: splitting the batch changes nothing
    with torch.no_grad():
        torch.testing.assert_close(piped(*args), plain(*args), atol=ATOL, rtol=0)
    (plain(*args).float() ** 2).mean().backward()
    (piped(*args).float() ** 2).mean().backward()
    want, got = _grads(plain), _grads(piped)
    assert want.keys() == got.keys() and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_torch_checkpoint_modes_and_input_grads(checkpoint):
    model, net, (x,) = _placed("mlp")
    plain = pl.to_torch(model, device_map="cpu")
    piped = pl.to_torch(model, device_map="cpu", chunks=2, checkpoint=checkpoint)
    xa = x.clone().requires_grad_(True)
    xb = x.clone().requires_grad_(True)
    loss_a = plain(xa).sin().sum()
    loss_b = piped(xb).sin().sum()
    grads_a = torch.autograd.grad(loss_a, [xa, *plain.parameters()])
    grads_b = torch.autograd.grad(loss_b, [xb, *piped.parameters()])
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_torch_inference_outputs_are_ordinary_tensors():
    """Forward without grad runs the workers in inference mode; what the caller gets is not an
    inference tensor, so it can feed autograd afterwards (a frozen feature extractor)."""
    model, net, (x,) = _placed("mlp")
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    for p in piped.parameters():
        p.requires_grad_(False)
    for _ in range(4):  # past the warm-up: the stages run traced
        with torch.no_grad():
            out = piped(x)
        frozen = piped(x)  # grad mode on, nothing requires grad: the forward-only path too
    assert not out.is_inference() and not frozen.is_inference()
    head = torch.ones(out.shape[-1], requires_grad=True)
    (frozen * head).sum().backward()
    torch.testing.assert_close(head.grad, net(x).detach().sum(0), atol=1e-5, rtol=1e-5)
    out.add_(1)  # in place, outside inference mode


def test_torch_stage_error_propagates():
    model, _, (idx,) = _placed("gpt")
    piped = pl.to_torch(model, device_map="cpu", chunks=3)
    bad = idx.clone()
    bad[4, 0] = 10_000
    with pytest.raises(pl.PipelineError, match="failed on micro-batch 2"):
        piped(bad)
    with pytest.raises(ValueError, match="checkpoint"):
        pl.to_torch(model, device_map="cpu", chunks=2, checkpoint="sometimes")


def test_pipelined_gpt_traced_stages_equal_untraced_for_every_batch():
    model, _, (idx,) = _placed("gpt")
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    plain = pl.to_torch(model, device_map="cpu", chunks=2)
    plain.trace_stages = False
    assert piped.trace_stages and not plain.trace_stages
    with torch.no_grad():
        # micro-batches of 2 + 2, 3 + 2, 2 + 1 and 1: each size is traced on its 3rd call (chunks + 1)
        for batch in (4, 4, 5, 5, 5, 3, 3, 1):
            assert torch.equal(piped(idx[:batch]), plain(idx[:batch]))
    calls = [s.call for s in piped._pl_stages]
    assert all(c.disabled is None for c in calls), [c.disabled for c in calls]
    assert all(c.traced == 3 for c in calls), [c.traced for c in calls]
    assert not any(c.traced for c in (s.call for s in plain._pl_stages))


def test_pipelined_gpt_traced_training_gives_the_same_gradients():
    model, _, (idx,) = _placed("gpt")
    piped = pl.to_torch(model, device_map="cpu", chunks=2, checkpoint="except_last")
    plain = pl.to_torch(model, device_map="cpu", chunks=2, checkpoint="except_last")
    plain.load_state_dict(piped.state_dict())
    plain.trace_stages = False
    for _ in range(3):  # the second step runs traced stages (with grad, and without for checkpointing)
        for module in (piped, plain):
            module.zero_grad(set_to_none=True)
            (module(idx[:4]).float() ** 2).mean().backward()
        want, got = _grads(plain), _grads(piped)
        assert want.keys() == got.keys() and want
        for key in want:
            assert torch.equal(got[key], want[key]), key
    assert all(s.call.traced and s.call.disabled is None for s in piped._pl_stages)


def test_pipelined_traced_stage_error_is_the_modules():
    model, _, (idx,) = _placed("gpt")
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    with torch.no_grad():
        piped(idx[:4])
        piped(idx[:4])
        assert piped._pl_stages[0].call.traced == 1
        bad = idx[:4].clone()
        bad[3, 0] = 10_000  # out of the vocabulary, in micro-batch 1
        with pytest.raises(pl.PipelineError, match=r"stage 0 .* failed on micro-batch 1: IndexError"):
            piped(bad)


def test_train_example_round_trip(tmp_path):
    from examples.train_pipelined import train

    result = train(steps=6, chunks=2, out=tmp_path)
    assert result["last_loss"] < result["first_loss"]
    assert result["max_abs_diff"] < 1e-4
    assert (tmp_path / "trained_placed.onnx").exists()


def test_update_parameters_checks_before_writing():
    model, net, _ = _placed("mlp")
    model = model.copy()
    name = next(iter(model.graph.initializers))
    before = model.graph.initializers[name].const_value.numpy().copy()
    with pytest.raises(pl.PlacementError, match=repr(name)):
        model.update_parameters({name: np.zeros((1, 1), np.float32)})
    with pytest.raises(pl.UnknownBlobError, match="'nope'"):
        model.update_parameters({"nope": np.zeros(1, np.float32)})
    np.testing.assert_array_equal(model.graph.initializers[name].const_value.numpy(), before)


def test_stream_bad_batch_raises_input_error(exported):
    model, _, (x,) = exported("mlp")
    runner = pl.Runner(model, device_map="cpu")
    outputs = runner.stream([x, x[:, :3]], window=1)  # the second batch is read after the first output
    assert next(outputs)[0].shape == (4, 8)
    with pytest.raises(pl.InputError, match="'input'"):
        next(outputs)
