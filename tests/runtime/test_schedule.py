"""Tests for ``placement.runtime.schedule``: the clock and the workers (order, overlap, errors,
back-pressure, no leaked threads), split and concat, and batch axes as both runtimes use them."""

from __future__ import annotations

import contextlib
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
from tests.runtime.helpers import no_thread_leak  # noqa: F401 (an autouse fixture)
from tests.runtime.helpers import placed_zoo as _placed

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


@pytest.mark.parametrize("failing", [0, 1])
def test_a_worker_whose_context_fails_raises_in_the_caller(failing):
    """A worker that cannot enter its context ran no stage: the caller gets a PipelineError
    naming it (it used to wait for ever), and closing joins every worker."""

    @contextlib.contextmanager
    def context(j):
        if j == failing:
            raise RuntimeError("no such device")
        yield

    caught = []

    def run():
        try:
            with StageWorkers([lambda i, x: x] * 3, ["a", "b", "c"], context=context) as workers:
                workers.map([1, 2, 3])
        except pl.PipelineError as err:
            caught.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the caller still waits"
    assert len(caught) == 1 and "no such device" in str(caught[0]), caught


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


def test_stream_refills_a_full_window_in_bursts():
    """A full window drains to half before the next payloads go in, all together: the first
    worker is woken once per burst, and never more than ``window`` are in flight."""
    pulled = consumed = 0
    gaps = []

    def source():
        nonlocal pulled
        for n in range(12):
            pulled += 1
            gaps.append(pulled - consumed)
            yield n

    for value in stream_microbatches([lambda i, x: x + 1, lambda i, x: 2 * x], source(), window=4):
        assert value == 2 * (consumed + 1)
        consumed += 1
    assert consumed == 12
    assert gaps == [1, 2, 3, 4] + [3, 4] * 4


@pytest.mark.parametrize("failing", [0, 2])
def test_stream_inline_last_runs_on_the_consumer_and_errors_name_the_stage(failing):
    consumer = threading.get_ident()
    where = []

    def stage(j):
        def fn(i, x):
            if j == 2:
                where.append(threading.get_ident() == consumer)
            if j == failing and i == 5:
                raise ValueError("boom")
            return x

        return fn

    names = ["s0", "s1", "s2"]
    gen = stream_microbatches(
        [stage(j) for j in range(3)], iter(range(8)), window=2, names=names, inline_last=True
    )
    assert [next(gen) for _ in range(3)] == [0, 1, 2]  # window 2: micro-batch 5 not read yet
    assert sum(t.name.startswith("placement-pipeline") for t in threading.enumerate()) == 2
    with pytest.raises(pl.PipelineError, match=rf"stage {failing} \(s{failing}\) failed on micro-batch 5"):
        list(gen)
    assert where and all(where)  # the autouse fixture checks no worker is left


def test_stream_inline_last_overlaps_the_first_stage():
    """The consumer's last stage on a micro-batch runs while the first stage's worker runs the next
    one (the pipeline keeps its overlap with the last stage inline and refills in bursts)."""
    second_started = threading.Event()
    overlapped = []

    def first(i, x):
        if i == 1:
            second_started.set()
        return x

    def last(i, x):
        if i == 0:  # waits (a bounded time) for the worker to start micro-batch 1 meanwhile
            overlapped.append(second_started.wait(timeout=10))
        return x

    out = list(stream_microbatches([first, last], iter(range(6)), window=2, inline_last=True))
    assert out == list(range(6))
    assert overlapped == [True]
