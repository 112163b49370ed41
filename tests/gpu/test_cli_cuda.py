"""The commands on a GPU: ``placement demo`` (the main job), ``placement run --device-map cuda:0``
and ``placement launch`` with both runtimes, each compared with the CPU within the precision
it states."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import placement as pl
from placement.runtime.precision import FP32_TOLERANCE
from tests.distributed.test_torch_ranks import place
from tests.gpu import needs_ort_cuda, needs_torch_cuda

pytestmark = [pytest.mark.gpu, needs_ort_cuda, needs_torch_cuda]


def _cli(*args: str, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "placement.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_placement_demo_runs_on_the_gpu_and_passes(tmp_path):
    done = _cli("demo", cwd=tmp_path)
    out = done.stdout
    assert "OK" in out and "FAILED" not in out and "EMULATED" not in out
    assert "cuda:0" in out and "precision of onnxruntime: fp32 (TF32 off)" in out
    if torch.cuda.device_count() < 2:  # two logical GPUs on one: said once (the CLI's log handler)
        assert (out + done.stderr).count("sharing") == 1, out + done.stderr


def test_placement_demo_with_tf32_states_its_tolerance(tmp_path):
    out = _cli("demo", "--precision", "tf32", cwd=tmp_path).stdout
    assert "OK" in out and "TF32 on the GPU, rtol=0.005, atol=0.005" in out


def test_placement_run_on_cuda_0(tmp_path):
    model, batch = place("gpt", 2)
    rows = model.graph.inputs[0].shape[0]
    model.save(tmp_path / "placed.onnx")
    np.save(tmp_path / "x.npy", batch[0][:rows])
    name = model.inputs[0]
    out = _cli(
        "run", "placed.onnx", "--input", f"{name}=x.npy", "--output", "out.npz", "--repeat", "2",
        "--device-map", "cuda:0", cwd=tmp_path,
    ).stdout  # fmt: skip
    assert "cuda:0" in out and "precision: fp32 (TF32 off)" in out
    want = pl.run(model, [batch[0][:rows]], device_map="cpu")
    with np.load(tmp_path / "out.npz") as got:
        for key, w in zip(model.outputs, want):
            np.testing.assert_allclose(got[key], w, rtol=FP32_TOLERANCE.rtol, atol=FP32_TOLERANCE.atol)


@pytest.mark.parametrize("runtime", ["torch", "ort"])
def test_placement_launch_on_the_gpus_there_are(tmp_path, runtime):
    """Two ranks: NCCL with two GPUs, else gloo with both ranks on cuda:0 (said once)."""
    model, batch = place("gpt", 2)
    model.save(tmp_path / "placed.onnx")
    np.save(tmp_path / "x.npy", batch[0])
    name = model.inputs[0]
    done = _cli(
        "launch", "placed.onnx", "--runtime", runtime, "--input", f"{name}=x.npy", "--output", "out.npz",
        "--timeout", "60", cwd=tmp_path,
    )  # fmt: skip
    if torch.cuda.device_count() < 2:
        assert done.stderr.count("activations cross ranks through host memory") == 1, done.stderr
    else:
        assert "host memory" not in done.stderr
    rows = model.graph.inputs[0].shape[0]
    parts = [pl.run(model, [batch[0][i : i + rows]], device_map="cpu") for i in range(0, len(batch[0]), rows)]
    with np.load(tmp_path / "out.npz") as got:
        for key, w in zip(model.outputs, (np.concatenate(p) for p in zip(*parts))):
            np.testing.assert_allclose(got[key], w, rtol=FP32_TOLERANCE.rtol, atol=FP32_TOLERANCE.atol)
