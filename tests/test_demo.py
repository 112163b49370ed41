"""Tests for ``placement.demo``: the main job end to end on tiny models."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

import placement as pl
from placement.demo import run_demo


@pytest.fixture(autouse=True)
def _short_warm_up(monkeypatch):
    """Three warm-up calls, no minimum time: these tests check outputs, not timings."""
    from placement import demo

    monkeypatch.setattr(demo, "_WARMUP_S", 0.0)


def _console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=160, color_system=None, force_terminal=False), buffer


def test_main_job_default_model():
    console, buffer = _console()
    result = run_demo(console=console, repeats=1)
    assert result.ok, result.runtimes
    assert result.model == "gpt" and result.size == "tiny" and result.devices == 2
    assert [logical for _, logical, _, _ in result.stages] == ["cuda:0", "cuda:1"]
    assert result.copies > 0 and result.ops > result.copies
    assert {r.name for r in result.runtimes} == {"torch eager (original)", "onnxruntime", "torch lowered"}
    for name in ("onnxruntime", "torch lowered"):
        runtime = result.runtime(name)
        assert runtime.error is None and runtime.max_abs_diff < 1e-4 and runtime.run_ms > 0
    text = buffer.getvalue()
    for needle in ("placement by device", "ONNX Runtime stages", "onnxruntime", "torch lowered", "OK"):
        assert needle in text
    if result.emulated:
        assert "emulated on the CPU" in text and "EMULATED" not in text
    # the check says its precision and tolerance: strict fp32 by default, on any device
    assert result.precision == "fp32"
    assert "precision of onnxruntime: fp32 (TF32 off), rtol=0.0001, atol=0.0001" in text
    assert "precision of torch lowered: fp32 (TF32 off)" in text


def test_four_devices_and_model_none_means_default(monkeypatch):
    console, buffer = _console()
    result = run_demo("resnet", devices=4, console=console, repeats=1)
    assert result.ok and len({logical for _, logical, _, _ in result.stages}) == 4
    from placement import models

    monkeypatch.setattr(models, "DEFAULT_MODEL", "mlp")  # (the real default, gpt, is tested above)
    default = run_demo(None, devices=1, console=_console()[0], repeats=1)
    assert default.model == "mlp" and default.ok and len(default.stages) == 1


def test_explicit_cpu_device_map():
    result = run_demo("mlp", devices=2, console=_console()[0], repeats=1, device_map="cpu")
    assert result.ok and set(result.device_map.values()) == {"cpu"}


@pytest.mark.parametrize(
    "kwargs, match",
    [({"model_name": "nope"}, "unknown model 'nope'"), ({"size": "huge"}, "unknown size 'huge'")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(pl.PlanError, match=match):
        run_demo(console=_console()[0], **kwargs)
