"""``benchmarks/offload.py --size tiny``: the CPU smoke run of the offload benchmark."""

from __future__ import annotations

import json

import torch


def test_offload_benchmark_smoke(tmp_path, capsys):
    from benchmarks import offload

    out = tmp_path / "offload.json"
    threads = torch.get_num_threads()
    try:
        assert offload.main(["--size", "tiny", "--repeats", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    placement = result["rows"]["placement"]
    assert placement["max_abs_diff"] <= 1e-5  # fp32 on the CPU: the same outputs as eager
    assert placement["modes"]["streamed"] > 0 and placement["streamed_bytes"] > 0
    assert placement["window_bytes"] > 0
    assert result["gpu_budget_bytes"] < result["weight_bytes"]
    printed = capsys.readouterr().out
    assert "placement" in printed and "all on the GPU" in printed
    if not torch.cuda.is_available():
        assert any("no CUDA GPU" in note for note in result["notes"])
