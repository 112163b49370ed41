"""A stage meant for a GPU whose ONNX Runtime session came back on the CPU (the CUDA provider
did not load) is never reported as a GPU stage: the runner refuses it with ``DeviceError``
naming the load error, or, with ``allow_cpu_fallback=True``, runs it on the CPU and says so
in ``summary()`` and ``stats.providers``.

The case is emulated on the CPU: the device map sends the model's device to ``cuda:0`` and
every session is built with the CPU provider only, as ONNX Runtime does when CUDA cannot load.
"""

from __future__ import annotations

import logging

import numpy as np
import onnxruntime as ort
import pytest

import placement as pl
from placement.errors import DeviceError
from placement.models import mlp
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.ort import runner as runner_mod
from placement.runtime.ort import sessions
from placement.runtime.stages import partition

REASON = "its CUDA provider cannot load: libcudnn.so.9: cannot open shared object file"


@pytest.fixture
def cuda_falls_back(monkeypatch):
    """Logical devices on cuda:0; sessions come back CPU-only; the load error is ``REASON``."""

    def resolve(devices, device_map, *, runtime):
        return {d: PhysicalDevice("cuda", 0) for d in devices}

    def cpu_only(model, options, providers):
        return sessions.ort_session(model, options, ["CPUExecutionProvider"])

    monkeypatch.setattr(runner_mod, "resolve_device_map", resolve)
    monkeypatch.setattr(sessions, "session_from_ir", cpu_only)
    monkeypatch.setattr(sessions, "shared_cuda_allocator", lambda physical: False)
    monkeypatch.setattr(sessions, "cuda_provider_error", lambda: REASON)


def _placed():
    net, (x,) = mlp.build("tiny")
    model = pl.from_torch(net, (x,))
    model.set_device(model.ops[-1].name, 1)
    return model, net, x


def test_a_gpu_stage_on_the_cpu_is_refused_naming_the_load_error(cuda_falls_back):
    model, _, _ = _placed()
    before = [op.device for op in model.ops]
    with pytest.raises(DeviceError) as info:
        pl.Runner(model, fold=False)
    message = str(info.value)
    assert "stage 0 (cuda:0)" in message and "cuda:0" in message
    assert "CPUExecutionProvider" in message and REASON in message
    assert "allow_cpu_fallback=True" in message
    assert [op.device for op in model.ops] == before  # the model is unchanged


def test_allowed_fallback_runs_on_the_cpu_and_says_so(cuda_falls_back, caplog):
    model, net, x = _placed()
    with caplog.at_level(logging.WARNING, logger="placement"):
        runner = pl.Runner(model, fold=False, allow_cpu_fallback=True)
    assert runner.stats.providers == {0: "CPUExecutionProvider", 1: "CPUExecutionProvider"}
    summary = runner.summary().splitlines()
    assert len(summary) == 2 and all("on cuda:0 (ORT CPU)" in line for line in summary)
    assert any(REASON in r.getMessage() for r in caplog.records)
    (out,) = runner.run([x])
    np.testing.assert_allclose(out, net(x).detach().numpy(), atol=1e-5, rtol=1e-5)


def test_cpu_stages_report_their_provider():
    model, _, _ = _placed()
    runner = pl.Runner(model, device_map="cpu", fold=False)
    assert runner.stats.providers == {0: "CPUExecutionProvider", 1: "CPUExecutionProvider"}
    assert "(ORT CPU)" in runner.summary()


def test_a_real_cuda_request_without_a_usable_gpu_is_refused():
    """Without emulation: ask ONNX Runtime for CUDA here. Where its CUDA provider really
    loads and a GPU answers, the session is on CUDA and nothing is refused."""
    (stage,) = partition(pl.from_torch(*mlp.build("tiny")))
    try:
        session = sessions.stage_session(stage, PhysicalDevice("cuda", 0))
    except DeviceError as err:
        assert "CUDAExecutionProvider" not in str(err).split("runs on")[1].split(":")[0]
        assert sessions.cuda_provider_error() in str(err)
        return
    assert session.get_providers()[0] == "CUDAExecutionProvider"


def test_cuda_provider_error_names_the_loader_error(monkeypatch, tmp_path):
    import ctypes

    def refuse(path, *args, **kwargs):
        raise OSError("libcublasLt.so.13: cannot open shared object file: No such file or directory")

    capi = tmp_path / "onnxruntime" / "capi"
    capi.mkdir(parents=True)
    (capi / "libonnxruntime_providers_cuda.so").write_bytes(b"")
    monkeypatch.setattr(ort, "__file__", str(tmp_path / "onnxruntime" / "__init__.py"))
    monkeypatch.setattr(ctypes, "CDLL", refuse)
    assert "libcublasLt.so.13" in sessions.cuda_provider_error()
    (capi / "libonnxruntime_providers_cuda.so").unlink()
    assert "no CUDA provider" in sessions.cuda_provider_error()
