"""``benchmarks/gpu_diagnose.py --dry-run``: every variant on the CPU provider, in fresh processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import export_once

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_diagnose_dry_run(tmp_path):
    """Slow (15-60 s on 2 busy cores): a subprocess, a fork server importing torch and
    placement, and 18 variant processes; the tiny GPT is exported here once, beforehand."""
    from benchmarks import gpu_diagnose
    from benchmarks.gpu_diagnose_options import CUDA_ONLY
    from benchmarks.gpu_diagnose_variants import VARIANTS

    model, net, (idx,) = export_once("gpt")
    gpu_diagnose.prepare(tmp_path / "work", device="cpu", model="tiny", exported=(model, idx))
    out = tmp_path / "diagnose.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_diagnose.py", "--dry-run", "--repeats", "2",
         "--workdir", str(tmp_path / "work"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout
    assert "ORT sessions in one process" in printed and "estimated GPU run" in printed
    report = json.loads(out.read_text())
    assert set(report) >= {"environment", "device", "model", "variants", "estimate_gpu_s", "wall_s"}
    variants = report["variants"]
    assert list(variants) == list(VARIANTS)
    for name, row in variants.items():
        assert name in printed
        if name in CUDA_ONLY:
            assert "CUDA" in row["skipped"]
            continue
        assert "error" not in row, (name, row)
        assert len(row["run_ms"]) == 2 and row["median_ms"] > 0 and row["build_s"] >= 0
    assert variants["single"]["ratio_to_single"] == 1.0
    assert variants["processes"]["output_shapes"] == [list(net(idx).shape)]  # the logits came through
    for stage in variants["profile:chain+other"]["profile"]:
        assert stage["kernel_ms"] > 0 and stage["run_ms"] >= stage["kernel_ms"]
    assert report["estimate_gpu_s"]["total_s"] > 0
