"""The GPU scripts run their checks where there is a GPU and exit cleanly where there is none:
``scripts/gpu-acceptance.sh`` skips, and the GPipe check it runs passes on the CPU standing in
for the GPU (so its code is exercised here too)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run its checks")
def test_acceptance_script_skips_without_a_gpu():
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-acceptance.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU here: skipped" in done.stdout


@pytest.mark.slow
def test_gpipe_check_passes_on_the_cpu():
    spec = importlib.util.spec_from_file_location("gpu_gpipe_check", ROOT / "scripts" / "gpu_gpipe_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    check.check({0: "cpu", 1: "cpu"}, chunks=2, size="tiny")
