"""Precision that is said: TF32 on or off per runtime, and the tolerance each check uses.

No GPU is needed: the CUDA provider options, the tolerance a GPU runner reports and the
demo's wording are checked with faked GPU devices.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import placement as pl
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.ort import sessions
from placement.runtime.precision import (
    FP32_TOLERANCE,
    TF32_TOLERANCE,
    ort_cuda_options,
    tolerance,
    torch_precision,
    torch_uses_tf32,
)

GPU = PhysicalDevice("cuda", 0)


@pytest.mark.parametrize(
    ("precision", "on_gpu", "want"),
    [
        ("fp32", False, FP32_TOLERANCE),
        ("fp32", True, FP32_TOLERANCE),
        ("tf32", False, FP32_TOLERANCE),  # no TF32 on the CPU
        ("tf32", True, TF32_TOLERANCE),
    ],
)
def test_tolerance_follows_precision_and_device(precision, on_gpu, want):
    got = tolerance(precision, on_gpu=on_gpu)
    assert got == want
    assert ("TF32 on the GPU" in str(got)) == (precision == "tf32" and on_gpu)
    assert TF32_TOLERANCE.rtol > FP32_TOLERANCE.rtol


def test_tf32_sized_errors_pass_only_the_tf32_tolerance():
    rng = np.random.default_rng(0)
    exact = rng.standard_normal(1000).astype(np.float32)
    tf32 = exact * (1 + rng.uniform(-1e-3, 1e-3, exact.shape)).astype(np.float32)  # a 10-bit mantissa
    assert TF32_TOLERANCE.allclose(tf32, exact) and not FP32_TOLERANCE.allclose(tf32, exact)
    assert FP32_TOLERANCE.allclose(exact * np.float32(1 + 1e-6), exact)


def test_unknown_precision_is_an_error():
    with pytest.raises(pl.PlacementError, match="fp16"):
        ort_cuda_options("fp16")
    model = pl.from_torch(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    with pytest.raises(pl.PlacementError, match="fp16"):
        pl.Runner(model, device_map="cpu", precision="fp16")


def test_cuda_provider_options_say_tf32_and_quiet_ort(monkeypatch):
    severities = []
    monkeypatch.setattr(ort, "set_default_logger_severity", severities.append)
    strict = sessions.providers(GPU)
    assert strict[1:] == ["CPUExecutionProvider"]
    assert strict[0][0] == "CUDAExecutionProvider"
    assert strict[0][1]["device_id"] == "0" and strict[0][1]["use_tf32"] == "0"
    fast = sessions.providers(PhysicalDevice("cuda", 1), precision="tf32")
    assert fast[0][1]["device_id"] == "1" and fast[0][1]["use_tf32"] == "1"
    assert fast[0][1]["arena_extend_strategy"] == "kSameAsRequested"
    # the plugin-EP warning goes through the default logger: off unless asked, as for sessions
    assert severities == [sessions.ort_log_severity()] * 2
    assert sessions.providers(PhysicalDevice("cpu")) == [("CPUExecutionProvider", {})]
    assert len(severities) == 2  # CPU sessions leave ONNX Runtime's logger alone


def test_runner_tolerance_with_a_faked_gpu(monkeypatch):
    from placement.models import mlp

    model = pl.from_torch(*mlp.build("tiny"))
    strict = pl.Runner(model, device_map="cpu")
    fast = pl.Runner(model, device_map="cpu", precision="tf32")
    assert strict.tolerance == fast.tolerance == FP32_TOLERANCE and not fast.tf32
    for runner in (strict, fast):  # as if the stage had been built on a GPU
        monkeypatch.setattr(runner, "_device_map", {d: GPU for d in runner.device_map})
    assert strict.tolerance == FP32_TOLERANCE and not strict.tf32
    assert fast.tolerance == TF32_TOLERANCE and fast.tf32


def test_torch_precision_sets_and_restores_the_flags():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with torch_precision("tf32"):
        assert torch_uses_tf32() and torch.backends.cuda.matmul.allow_tf32
        with torch_precision("fp32"):
            assert not torch_uses_tf32()
        assert torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_the_suite_compares_in_strict_fp32():
    """tests/conftest.py turns torch's TF32 off for every test (GPU results against the CPU's)."""
    assert not torch_uses_tf32()
