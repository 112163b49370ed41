"""Thread counts are validated where sessions are made, so the CLI and the Python API both get it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import placement as pl
from placement.cli import main
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.ort import sessions
from placement.runtime.ort.sessions import session_options
from tests.graph.builders import mlp_graph


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4", True])
def test_bad_thread_counts_are_refused(bad):
    with pytest.raises(pl.InputError, match="threads must be a whole number of at least 1"):
        session_options(PhysicalDevice("cpu"), threads=bad)
    with pytest.raises(pl.InputError):
        pl.Runner(mlp_graph(), device_map="cpu", threads=bad)


def test_huge_thread_counts_are_capped_with_a_warning(caplog):
    cap = sessions.THREADS_PER_CORE_CAP * sessions.usable_cores()
    with caplog.at_level(logging.WARNING, logger="placement"):
        options = session_options(PhysicalDevice("cpu"), threads=10000)
    assert options.intra_op_num_threads == cap
    assert "far above" in caplog.text
    assert sessions.check_threads(cap) == cap and sessions.check_threads(None) is None


#: float32 results of one model run with different intra-op thread counts: the reductions are
#: split (and summed) differently, so they agree to a few ulps, not bit for bit.
THREADS_TOL = {"rtol": 1e-6, "atol": 1e-6}


def test_runner_with_capped_threads_still_runs():
    model = mlp_graph()
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(
        pl.Runner(model, device_map="cpu", threads=10000).run({"x": x})[0],
        pl.run(model, {"x": x}, device_map="cpu")[0],
        **THREADS_TOL,
    )


def test_emulated_cores_reach_both_runtimes():
    """``PLACEMENT_TEST_THREADS=n`` (tests/conftest.py) gives torch and default ORT sessions
    ``n`` threads; unset, nothing changes."""
    import torch

    from tests.conftest import emulated_threads

    n = emulated_threads()
    options = sessions.stage_options(PhysicalDevice("cpu"))
    if n is None:
        assert options.intra_op_num_threads == 0  # ONNX Runtime's own choice
    else:
        assert torch.get_num_threads() == n and options.intra_op_num_threads == n
        assert sessions.usable_cores() == n


def test_cli_refuses_negative_threads(tmp_path, capsys):
    mlp_graph().save(tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", np.ones((2, 4), np.float32))
    assert (
        main(["run", str(tmp_path / "m.onnx"), "--input", f"x={tmp_path / 'x.npy'}", "--threads", "-3"]) == 2
    )
    err = capsys.readouterr().err
    assert (
        "threads must be a whole number of at least 1, got -3" in err and len(err.strip().splitlines()) == 1
    )


@pytest.mark.parametrize(("device_map", "fold"), [("auto", None), ("cpu", False), ("cpu", None)])
def test_a_stream_divides_the_cores_among_stages_whatever_chunks_is(device_map, fold, monkeypatch):
    """``Runner(model).stream(...)`` pipelines even with ``chunks=1``: its stage sessions get the
    cores divided among the stages (as ``chunks > 1`` does), while ``run`` keeps the sessions it has."""
    from placement.runtime.ort import build
    from placement.runtime.schedule import stage_threads

    model = mlp_graph()
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    made: list[int | None] = []
    real = build.stage_session

    def spy(stage, physical, *, threads=None, **kwargs):
        made.append(threads)
        return real(stage, physical, threads=threads, **kwargs)

    monkeypatch.setattr(build, "stage_session", spy)
    runner = pl.Runner(model, device_map=device_map, fold=fold)
    x = np.ones((2, 4), np.float32)
    expected = runner.run({"x": x})[0]
    at_build = list(made)
    outs = list(runner.stream([{"x": x}, {"x": 2 * x}]))
    np.testing.assert_allclose(outs[0][0], expected, **THREADS_TOL)
    streamed = made[len(at_build) :]
    assert streamed and all(t == stage_threads(2) for t in streamed), (at_build, streamed)
    # the pipelined sessions are built once per placement
    list(runner.stream([{"x": x}]))
    assert len(made) == len(at_build) + len(streamed)
    # a budget given wins
    made.clear()
    list(pl.Runner(model, device_map=device_map, fold=fold, threads_per_stage=1).stream([{"x": x}]))
    assert made and set(made) == {1}
