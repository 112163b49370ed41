"""The CLI plans one GPU plus host memory from ``--max-memory 0=...,cpu=...``."""

from __future__ import annotations

import placement as pl
from placement.cli import main
from placement.cli.placing import parse_max_memory


def test_parse_max_memory_takes_the_host():
    assert parse_max_memory("0=2GiB,cpu=48GiB") == {"0": "2GiB", "cpu": "48GiB"}


def test_place_with_gpu_and_host_budgets(exported, tmp_path, monkeypatch):
    # a stated host speed (10 GFLOP/s) instead of this machine's measured one, so that the plan does
    # not depend on how loaded the machine is; the GPU is emulated at its stated default
    monkeypatch.setattr(
        "placement.planning.speeds.measure_flops", lambda kind, *a, **k: 1e10 if kind == "cpu" else None
    )
    model, _, _ = exported("gpt")
    source, target = tmp_path / "gpt.onnx", tmp_path / "placed.onnx"
    model.save(source)
    # 60% of the weights, plus room for the activations (28 KiB at the example's batch), which the
    # GPU budget counts
    budget = int(sum(p.nbytes for p in model.parameters.values()) * 0.6) + (32 << 10)
    argv = [
        "place",
        str(source),
        "--max-memory",
        f"0={budget},cpu=48GiB",
        "--cost",
        "flops",
        "-o",
        str(target),
    ]
    assert main(argv) == 0
    placed = pl.load(target)
    pl.verify(placed)
    assert {str(d) for d in placed.devices} == {"cuda:0", "cpu"}
