"""Tests for ``placement.runtime.ort.pipelined``: ``Runner(chunks=k)`` and ``Runner.stream`` on every
zoo model placed on two logical devices equal the unsplit run; errors name the stage and micro-batch."""

from __future__ import annotations

import numpy as np
import pytest

import placement as pl
from tests.conftest import MODEL_NAMES
from tests.runtime.helpers import no_thread_leak  # noqa: F401 (an autouse fixture)
from tests.runtime.helpers import placed_zoo as _placed

ATOL = 1e-5


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


def test_stream_bad_batch_raises_input_error(exported):
    model, _, (x,) = exported("mlp")
    runner = pl.Runner(model, device_map="cpu")
    outputs = runner.stream([x, x[:, :3]], window=1)  # the second batch is read after the first output
    assert next(outputs)[0].shape == (4, 8)
    with pytest.raises(pl.InputError, match="'input'"):
        next(outputs)


def test_stream_last_stage_runs_on_the_consumer(exported):
    """``Runner.stream`` runs the last stage in the consumer's thread (one worker thread fewer
    than stages) and its outputs equal one whole session's; a stopped stream leaves no worker."""
    import threading

    model, _, (x,) = exported("mlp")
    model.set_device(model.ops[-1].name, 1)
    expected = pl.Runner(model, device_map="cpu", fold=True).run([x.numpy()])[0]
    runner = pl.Runner(model, device_map="cpu", fold=False, threads_per_stage=1)
    assert len(runner.stages) == 2
    outs = runner.stream([[x.numpy()]] * 6, window=2)
    np.testing.assert_allclose(next(outs)[0], expected, atol=ATOL)
    workers = [t for t in threading.enumerate() if t.name.startswith("placement-pipeline")]
    assert len(workers) == 1
    rest = list(outs)
    assert len(rest) == 5
    for (got,) in rest:
        np.testing.assert_array_equal(got, expected)
        assert got.flags.owndata
    stopped = runner.stream(iter([[x.numpy()]] * 100))
    np.testing.assert_array_equal(next(stopped)[0], expected)
    stopped.close()  # the autouse fixture checks that its worker is gone


def test_stream_stage_error_names_stage_and_batch():
    model, _, (idx,) = _placed("gpt")
    bad = idx.clone()
    bad[0, 0] = 10_000  # out of the vocabulary: the embedding Gather (stage 0) fails on batch 2
    runner = pl.Runner(model, device_map="cpu")
    outputs = runner.stream([idx, idx, bad, idx])
    with pytest.raises(pl.PipelineError, match=r"stage 0 .* failed on micro-batch 2") as info:
        list(outputs)
    assert (info.value.stage, info.value.microbatch) == (0, 2)
    chunked = pl.Runner(model, device_map="cpu", chunks=2)
    with pytest.raises(pl.PipelineError, match=r"stage 0 .* failed on micro-batch 4"):
        list(chunked.stream([idx, idx, bad]))  # batch 2's first micro-batch is the stream's 5th


@pytest.mark.parametrize("chunks", [1, 2])
def test_stream_errors_yield_answers_every_request(chunks):
    """``stream(..., errors="yield")``: a failed request (a stage failing, or bad inputs) yields its
    error in its place and the stream goes on; the other requests' outputs are the runs' own."""
    model, _, (idx,) = _placed("gpt")
    bad = idx.clone()
    bad[0, 0] = 10_000  # out of the vocabulary: the embedding Gather (stage 0) fails
    wrong = idx.float()  # a float batch for int64 token ids: refused before any stage runs
    runner = pl.Runner(model, device_map="cpu", chunks=chunks)
    expected = runner.run([idx])[0]
    requests = [[idx], [bad], [idx], [wrong], [idx[:3]], [bad], [idx]]
    outs = list(runner.stream(requests, window=2, errors="yield"))
    assert len(outs) == len(requests)
    for k in (0, 2, 6):
        np.testing.assert_allclose(outs[k][0], expected, atol=ATOL)
    np.testing.assert_allclose(outs[4][0], expected[:3], atol=ATOL)
    assert isinstance(outs[1], pl.PipelineError) and outs[1].stage == 0
    assert isinstance(outs[5], pl.PipelineError) and "failed on micro-batch" in str(outs[5])
    assert isinstance(outs[3], pl.InputError) and "'idx'" in str(outs[3])
    # the default still ends the stream at the first failure, and the runner stays usable
    with pytest.raises(pl.PipelineError):
        list(runner.stream([[idx], [bad], [idx]]))
    np.testing.assert_allclose(runner.run([idx])[0], expected, atol=ATOL)
    with pytest.raises(pl.InputError, match="errors must be 'raise' or 'yield'"):
        runner.stream(requests, errors="skip")
