"""Tests for ``placement.runtime.ort.fold``: logical devices sharing a physical device run as one
session (counted by patching ``onnxruntime.InferenceSession``), with the unplaced outputs, while
the placement itself is untouched; ``"auto"`` emulation and pipelined CPU runs keep stages apart."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import placement as pl
from placement.graph.nodes import is_copy_node
from placement.graph.saving import to_proto
from placement.runtime.device_map import PhysicalDevice, resolve_device_map
from placement.runtime.ort.fold import fold_groups, fold_model, folded_devices
from tests.conftest import ort_cuda_available
from tests.runtime.helpers import no_thread_leak, placed_zoo  # noqa: F401 (an autouse fixture)

ZOO = ["mlp", "resnet", "gpt"]
ATOL = 1e-5


@pytest.fixture
def sessions(monkeypatch):
    """Every ``InferenceSession`` built while the test runs (a list of them)."""
    built = []

    class Counting(ort.InferenceSession):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(ort, "InferenceSession", Counting)
    return built


def _single(model, arrays):
    """The outputs of one plain session of the whole model (its saved form)."""
    session = ort.InferenceSession(to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, dict(zip(names, arrays)))


@pytest.mark.parametrize("name", ZOO)
@pytest.mark.parametrize("device_map", ["cpu", {0: "cpu", 1: "cpu"}])
def test_shared_device_runs_as_one_session_with_the_unplaced_outputs(name, device_map, sessions):
    model, net, args = placed_zoo(name)
    arrays = [a.numpy() for a in args]
    state, n_ops = model.device_state(), len(model.graph)
    expected = _single(model, arrays)
    del sessions[:]
    runner = pl.Runner(model, device_map=device_map)
    assert len(sessions) == runner.stats.sessions_built == 1
    (stage,) = runner.stages
    assert [str(d) for d in stage.folded] == ["cuda:0", "cuda:1"]
    assert runner.folds == {pl.Device("cuda", 1): pl.Device("cuda", 0)}
    assert "(folded)" in runner.summary()
    got = runner.run(arrays)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=ATOL)
    np.testing.assert_allclose(got[0], net(*args).detach().numpy(), atol=1e-4)
    # the placement is untouched: devices, copies, ops
    assert model.device_state() == state and len(model.graph) == n_ops
    assert len(sessions) == 1  # running built nothing more


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_fold_false_keeps_a_session_per_stage(name, sessions):
    model, _, args = placed_zoo(name)
    arrays = [a.numpy() for a in args]
    folded = pl.Runner(model, device_map="cpu").run(arrays)
    del sessions[:]
    apart = pl.Runner(model, device_map="cpu", fold=False)
    assert len(sessions) == 2 and len(apart.stages) == 2 and apart.folds == {}
    assert not any(s.folded for s in apart.stages)
    for a, f in zip(apart.run(arrays), folded):
        np.testing.assert_allclose(a, f, atol=ATOL)


@pytest.mark.skipif(ort_cuda_available(), reason="'auto' emulates only on a machine without GPUs")
def test_auto_emulation_keeps_stage_boundaries(sessions, caplog):
    model, _, args = placed_zoo("mlp")
    runner = pl.Runner(model)  # "auto": no GPU here, every logical device emulated
    assert len(runner.stages) == 2 and len(sessions) == 2 and runner.folds == {}
    assert all(p.emulated for p in runner.device_map.values())
    forced = pl.Runner(model, fold=True)
    assert len(forced.stages) == 1
    for a, b in zip(runner.run([a.numpy() for a in args]), forced.run([a.numpy() for a in args])):
        np.testing.assert_allclose(a, b, atol=ATOL)


def test_emulation_warning_says_stages_stay_apart(monkeypatch, caplog):
    from placement.runtime import device_map as dm

    monkeypatch.setattr(dm, "_warned_emulation", False)
    monkeypatch.setattr(dm, "cuda_device_count", lambda runtime="torch": 0)
    with caplog.at_level("WARNING", logger="placement.runtime.device_map"):
        resolve_device_map([pl.Device("cuda", 0), pl.Device("cuda", 1)], "auto")
    assert "own session" in caplog.text and "device_map='cpu'" in caplog.text


@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_pipelined_cpu_runs_keep_stages_apart(name, sessions):
    """On the CPU, stages overlap on its cores when pipelined: they are not folded there."""
    model, _, args = placed_zoo(name)
    arrays = [a.numpy() for a in args]
    (expected,) = pl.Runner(model, device_map="cpu").run(arrays)
    piped = pl.Runner(model, device_map="cpu", chunks=2)
    assert len(piped.stages) == 2 and piped.folds == {}
    np.testing.assert_allclose(piped.run(arrays)[0], expected, atol=ATOL)
    forced = pl.Runner(model, device_map="cpu", chunks=2, fold=True)
    assert len(forced.stages) == 1
    np.testing.assert_allclose(forced.run(arrays)[0], expected, atol=ATOL)


def test_stream_on_a_folded_cpu_runner_keeps_stages_apart(sessions):
    model, _, args = placed_zoo("mlp")
    batches = [[a[:n].numpy() for a in args] for n in (5, 2, 3)]
    runner = pl.Runner(model, device_map="cpu")
    assert len(runner.stages) == 1
    expected = [runner.run(b)[0] for b in batches]
    del sessions[:]
    outs = [out[0] for out in runner.stream(batches)]
    assert len(sessions) == 2  # the stages of the pipelined program, built on first use
    for got, want in zip(outs, expected):
        np.testing.assert_allclose(got, want, atol=ATOL)
    list(runner.stream(batches[:1]))
    assert len(sessions) == 2  # and kept
    assert len(runner.stages) == 1  # run() keeps its folded program


def test_replacement_rebuilds_the_folded_program(sessions):
    model, _, args = placed_zoo("mlp")
    model = model.copy()
    arrays = [a.numpy() for a in args]
    runner = pl.Runner(model, device_map="cpu")
    before = runner.run(arrays)[0]
    last = [op for op in model.ops if not op.is_copy][-1]
    model.set_device(last.name, 2)
    assert runner.update() and len(runner.stages) == 1
    assert [str(d) for d in runner.stages[0].folded] == ["cuda:0", "cuda:1", "cuda:2"]
    np.testing.assert_allclose(runner.run(arrays)[0], before, atol=ATOL)


# --- fold_groups / fold_model --------------------------------------------------------------


def test_fold_groups_on_gpus():
    gpu0, gpu1 = PhysicalDevice("cuda", 0), PhysicalDevice("cuda", 1)
    d = [pl.Device("cuda", i) for i in range(4)]
    dmap = {d[0]: gpu0, d[1]: gpu0, d[2]: gpu1, d[3]: gpu1}
    folds = fold_groups(dmap)
    assert folds == {d[1]: d[0], d[3]: d[2]}
    assert fold_groups(dmap, pipelined=True) == folds  # nothing to overlap on one GPU
    assert folded_devices(folds) == {d[0]: (d[0], d[1]), d[2]: (d[2], d[3])}
    assert fold_groups({d[0]: gpu0, d[1]: gpu1}) == {}


def test_auto_on_fewer_gpus_folds(monkeypatch):
    from placement.runtime import device_map as dm

    monkeypatch.setattr(dm, "cuda_device_count", lambda runtime="torch": 1)
    logical = [pl.Device("cuda", 0), pl.Device("cuda", 1)]
    dmap = resolve_device_map(logical, "auto", runtime="ort")
    assert fold_groups(dmap, emulating=True) == {logical[1]: logical[0]}


def test_fold_model_removes_copies_and_keeps_output_copies_as_identity():
    model, _, _ = placed_zoo("mlp")
    model = model.copy()
    copies = [op for op in model.ops if op.is_copy]
    assert copies
    outputs = set(model.outputs)
    removed = fold_model(model, {pl.Device("cuda", 1): pl.Device("cuda", 0)})
    assert removed == len(copies)
    assert model.devices == [pl.Device("cuda", 0)]
    assert not any(is_copy_node(n) for n in model.graph)
    assert set(model.outputs) == outputs
    pl.verify(model)


@pytest.mark.gpu
def test_two_logical_devices_on_one_gpu_run_as_one_session(sessions):
    model, net, args = placed_zoo("gpt")
    arrays = [a.numpy() for a in args]
    expected = _single(model, arrays)
    del sessions[:]
    runner = pl.Runner(model, device_map={0: "cuda:0", 1: "cuda:0"})
    assert len(sessions) == 1 and len(runner.stages) == 1
    for g, e in zip(runner.run(arrays), expected):
        assert runner.tolerance.allclose(g, e)
    apart = pl.Runner(model, device_map={0: "cuda:0", 1: "cuda:0"}, fold=False)
    assert len(apart.stages) == 2


def test_a_folded_session_carries_each_weight_once():
    """gpt ties its embedding and output weights: a stage on each device carries it twice (the
    second as a static copy); folded, the one session carries every parameter once."""
    model, _, _ = placed_zoo("gpt")
    params = sum(p.nbytes for p in model.parameters.values())

    def carried(runner):
        inits = [v for s in runner.stages for v in s.model.graph.initializers.values()]
        return sum(v.const_value.nbytes for v in inits if v.const_value is not None)

    assert carried(pl.Runner(model, device_map="cpu", fold=False)) > params
    assert carried(pl.Runner(model, device_map="cpu")) == params


def test_streamed_weights_and_a_host_stage_fold_with_the_gpu_stages(exported):
    """gpt with blocks.0 streamed from the host and blocks.1 on the host, all on the CPU: one
    session; the streamed copies stay per-run transfers; outputs as the module's."""
    from tests.runtime.test_streaming import _streamed_gpt

    model, net, args, result = _streamed_gpt(exported, host_layer=True)
    runner = pl.Runner(model, device_map={"cuda:0": "cpu", "cpu": "cpu"})
    assert len(runner.stages) == 1 and len(runner.stages[0].folded) == 2
    assert set(runner.program.resident) == set(result.streamed)
    (got,) = runner.run([a.numpy() for a in args])
    np.testing.assert_allclose(got, net(*args).detach().numpy(), atol=1e-4)
