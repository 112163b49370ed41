"""``benchmarks/pipeline.py --fixed-cost``: the schedule's fixed cost, one stage count, one repeat."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.mark.slow
def test_fixed_cost_benchmark_smoke(tmp_path, capsys):
    """Slow (10-40 s on 2 busy cores): an export, three ORT runners, two pipelined torch modules
    warmed up to steady state (traced stages), every contender timed twice."""
    from benchmarks import pipeline

    out = tmp_path / "fixed.json"
    threads = torch.get_num_threads()
    try:
        argv = ["--fixed-cost", "--stages", "2", "--device", "cpu", "--repeats", "2", "--block", "1"]
        assert pipeline.main([*argv, "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    rows = {row["contender"]: row for row in result["rows"]}
    assert set(rows) == {
        "ort run", "ort stream", "torch 1f1b checkpoint=never", "torch gpipe checkpoint=never",
        "torch 1f1b checkpoint=never executor=threads", "torch gpipe checkpoint=never executor=threads",
        "torch 1f1b checkpoint=except_last", "torch gpipe checkpoint=except_last", "torch eager loop (floor)",
    }  # fmt: skip
    for name, row in rows.items():
        assert row["stages"] == 2 and row["k1_ms"] > 0 and row["k16_ms"] > 0
        assert row["recompute"] == ("except_last" in name)
        # the figure is the difference per micro-batch per stage, as documented
        expected = (row["k16_ms"] - row["k1_ms"]) * 1e3 / 16 / 2
        assert abs(row["fixed_us"] - expected) < 0.1 + 1e-3 * abs(expected)
        # ORT rows count the schedule's blocking waits (at most every get of every thread)
        if name.startswith("ort"):
            assert 0 <= row["waits_per_mb_stage"] <= 2
        else:
            assert row["waits_per_mb_stage"] is None
    assert set(result["summary"]["cpu"]) == {"ort_us", "ort_cpu_us", "torch_us", "torch_cpu_us"}
    printed = capsys.readouterr().out
    assert "fixed cost of the pipeline schedule" in printed and "(recompute)" in printed


def test_crossover_rows_say_what_auto_picks(monkeypatch):
    """Two small widths, two calls each: the figures and auto's choice per width."""
    from benchmarks import pipeline_fixed_cost
    from placement.runtime.torch.executor import THREADS_MIN_MACS

    monkeypatch.setattr(pipeline_fixed_cost, "alternate", _two_calls(pipeline_fixed_cost.alternate))
    rows = pipeline_fixed_cost.crossover((8, 16), repeats=1)
    assert [r["width"] for r in rows] == [8, 16]
    for row in rows:
        assert row["macs_per_mb_stage"] == (256 // 16) * 2 * (row["width"] ** 2 + row["width"])
        assert row["auto"] == "inline" and row["threshold"] == THREADS_MIN_MACS
        assert row["inline_ms"] > 0 and row["threads_ms"] > 0


def _two_calls(alternate):
    def fewer(fns, repeats, **options):
        return alternate(fns, repeats, warmup=1, block=1)

    return fewer
