"""``benchmarks/gpu.py`` never reports the CPU as a GPU: ``has_gpu()`` checks that a session
really runs on CUDA, the torch sections need only torch's GPU, and each section's results are
written as soon as it ends (a timeout keeps what was measured)."""

from __future__ import annotations

import json

import onnxruntime as ort
import pytest


@pytest.fixture
def gpu(monkeypatch):
    from benchmarks import gpu

    clear = gpu.ort_gpu.cache_clear  # the probe's answer is cached per process
    clear()
    yield gpu
    clear()


def test_a_cuda_session_that_falls_back_to_the_cpu_is_no_gpu(gpu, monkeypatch):
    """ONNX Runtime lists CUDA, but the session comes back on the CPU (the provider did not load)."""
    real = ort.InferenceSession

    def cpu_only(proto, sess_options=None, providers=None, **kw):
        return real(proto, sess_options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(
        ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    monkeypatch.setattr(ort, "InferenceSession", cpu_only)
    monkeypatch.setattr(gpu, "torch_gpu", lambda: True)
    reason = gpu.ort_gpu()
    assert reason is not None and "runs on CPUExecutionProvider" in reason
    assert not gpu.has_gpu()


def test_no_cuda_provider_at_all_is_no_gpu(gpu, monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert "no CUDA provider" in gpu.ort_gpu()


def test_torch_sections_run_without_onnx_runtime_and_each_is_written_when_it_ends(
    gpu, monkeypatch, tmp_path, capsys
):
    """No usable ONNX Runtime GPU: ``ort`` is skipped (saying why), the torch section ``graphs``
    runs; a later section that never finishes leaves the earlier one written."""
    out = tmp_path / "gpu.json"
    monkeypatch.setattr(gpu, "torch_gpu", lambda: True)
    monkeypatch.setattr(gpu, "ort_gpu", lambda: "a CUDA session runs on CPUExecutionProvider: test")
    monkeypatch.setattr(
        gpu, "section_graphs", lambda models, **kw: [{"model": m, "ratio": 1.0} for m in models]
    )

    def interrupted(*args, **kwargs):
        assert json.loads(out.read_text())["graphs"]  # written before the next section started
        raise KeyboardInterrupt  # a timeout's signal

    monkeypatch.setattr(gpu, "validate_cpu", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gpu.main(["--sections", "ort", "graphs", "validate-cpu", "--out", str(out)])
    written = json.loads(out.read_text())
    assert [r["model"] for r in written["graphs"]] == ["tiny-gpt", "gpt"]
    assert "ort" not in written and "runs on CPUExecutionProvider" in written["skipped"]["ort"]
    assert "section ort skipped" in capsys.readouterr().err
