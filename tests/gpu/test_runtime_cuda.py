"""ONNX Runtime on a GPU: ``pl.Runner`` on logical devices sharing one GPU and on GPU + CPU,
outputs against eager within the stated precision, the device-resident hand-off between GPU
stages, ``use_tf32`` as asked, no plugin-EP warning, and calibration on the GPU."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import placement as pl
from placement.runtime.calibrate import calibrate
from placement.runtime.ort.steps import StageStep
from placement.runtime.precision import FP32_TOLERANCE, TF32_TOLERANCE, tolerance
from tests.conftest import MODEL_NAMES
from tests.gpu import needs_ort_cuda, needs_torch_cuda
from tests.runtime.ort.test_runner import place_shift

pytestmark = [pytest.mark.gpu, needs_ort_cuda]

MAPS = {"shared GPU": {0: "cuda:0", 1: "cuda:0"}, "GPU + CPU": {0: "cuda:0", 1: "cpu"}}
#: (device map, fold): one GPU for two logical devices, folded into one session (the default)
#: and with its stages kept apart (their hand-over is the point); GPU + CPU never folds
CASES = {
    "shared GPU, folded": ("shared GPU", None),
    "shared GPU, stages": ("shared GPU", False),
    "GPU + CPU": ("GPU + CPU", None),
}


def _eager(net: torch.nn.Module, args: tuple) -> list[np.ndarray]:
    with torch.no_grad():
        out = net(*args)
    return [t.numpy() for t in (out if isinstance(out, (tuple, list)) else (out,))]


def _close(got: list[np.ndarray], want: list[np.ndarray], tol) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol.rtol, atol=tol.atol, err_msg=str(tol))


def _sessions(runner: pl.Runner) -> list[ort.InferenceSession]:
    """The stage sessions the runner's program runs."""
    return [step.exec.session for step in runner.program.steps if isinstance(step, StageStep)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_runner_on_cuda_equals_eager(exported, name, case):
    where, fold = CASES[case]
    model, net, args = exported(name)
    place_shift(model, 2)
    runner = pl.Runner(model, device_map=MAPS[where], fold=fold)
    assert sorted({str(p) for p in runner.device_map.values()}) == sorted(set(MAPS[where].values()))
    assert len(runner.stages) == (1 if case == "shared GPU, folded" else 2), runner.summary()
    gpu_stages = [s.index for s in runner.stages if runner.device_map[s.device].is_cuda]
    assert gpu_stages and all(runner.stats.providers[i] == "CUDAExecutionProvider" for i in gpu_stages)
    assert runner.tolerance == FP32_TOLERANCE and not runner.tf32
    _close(runner.run(list(args)), _eager(net, args), runner.tolerance)


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_sessions_use_tf32_as_asked_and_say_their_tolerance(exported, precision):
    model, net, args = exported("resnet")
    place_shift(model, 2)
    runner = pl.Runner(model, device_map="cuda:0", precision=precision)
    assert runner.tf32 == (precision == "tf32")
    assert runner.tolerance == (TF32_TOLERANCE if precision == "tf32" else FP32_TOLERANCE)
    assert runner.tolerance == tolerance(precision, on_gpu=True)
    flag = "1" if precision == "tf32" else "0"
    sessions = _sessions(runner)
    assert sessions
    for session in sessions:
        assert session.get_providers()[0] == "CUDAExecutionProvider"
        assert session.get_provider_options()["CUDAExecutionProvider"]["use_tf32"] == flag
    _close(runner.run(list(args)), _eager(net, args), runner.tolerance)


def test_building_cuda_sessions_prints_no_plugin_ep_warning(exported, capfd):
    model, _, args = exported("mlp")
    place_shift(model, 2)
    capfd.readouterr()
    pl.Runner(model, device_map={0: "cuda:0", 1: "cuda:0"}).run(list(args))
    err = capfd.readouterr().err
    assert "No registered plugin EP device" not in err, err


def test_gpu_stages_hand_over_on_the_gpu(exported, monkeypatch):
    """Two logical devices on one GPU: nothing between the stages goes through host memory
    (no transfer moves data, and no ``OrtValue`` is read back to the host during the steps)."""
    model, net, args = exported("gpt")
    place_shift(model, 2)
    runner = pl.Runner(model, device_map={0: "cuda:0", 1: "cuda:0"}, fold=False)  # stages apart
    program = runner.program
    stages = [s for s in program.steps if isinstance(s, StageStep)]
    assert len(stages) == 2 and program.n_handovers >= 1 and program.n_transfers == 0
    read_back: list[str] = []
    real = ort.OrtValue.numpy

    def numpy(self):
        read_back.append(self.device_name())
        return real(self)

    values = program.feed([a.numpy() for a in args])
    monkeypatch.setattr(ort.OrtValue, "numpy", numpy)
    for step in program.steps:
        step.run(values)
    assert read_back == [], f"values read back to the host between stages: {read_back}"
    outputs = [values[key] for key, const in program.outputs if const is None]
    assert outputs and all(v.device_name().lower() == "cuda" for v in outputs)
    monkeypatch.undo()
    _close(program.collect(values), _eager(net, args), runner.tolerance)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_copy_device_to_device(exported):
    model, net, args = exported("gpt")
    place_shift(model, 2)
    runner = pl.Runner(model, device_map={0: "cuda:0", 1: "cuda:1"})
    assert runner.program.n_transfers >= 1
    _close(runner.run(list(args)), _eager(net, args), runner.tolerance)


@pytest.mark.parametrize("runtime", ["ort", pytest.param("torch", marks=needs_torch_cuda)])
def test_calibration_on_cuda(exported, runtime):
    model, net, args = exported("gpt")
    dmap = {0: "cuda:0", 1: "cuda:0"}
    result = calibrate(model, devices=2, rounds=1, repeats=3, device_map=dmap, runtime=runtime)
    assert result.plan.runtime == runtime and result.bottleneck_s > 0
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    runner = pl.Runner(model, device_map=dmap)
    _close(runner.run(list(args)), _eager(net, args), runner.tolerance)
