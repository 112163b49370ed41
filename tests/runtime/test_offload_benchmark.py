"""``benchmarks/offload.py``: the CPU smoke run (``--size tiny``), and on a GPU the 1.23B model."""

from __future__ import annotations

import json

import pytest
import torch

#: fp32 on the CPU, the same ops as eager: what differs is only the order of reductions inside
#: multi-threaded kernels (1.1e-5 was seen with 16 threads at logits of order 1), a few ulps
#: (1.2e-7) per op over a hundred ops, so 1e-4 relative to the logits' scale.
SMOKE_RTOL = 1e-4


def _run(tmp_path, *argv):
    from benchmarks import offload

    out = tmp_path / "offload.json"
    threads = torch.get_num_threads()
    try:
        code = offload.main([*argv, "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return code, json.loads(out.read_text())


@pytest.mark.slow
def test_offload_benchmark_smoke(tmp_path, capsys):
    code, result = _run(tmp_path, "--size", "tiny", "--repeats", "1")
    assert code == 0
    placement = result["rows"]["placement"]
    assert placement["max_abs_diff"] <= SMOKE_RTOL * max(1.0, placement.get("logit_scale") or 1.0)
    assert placement["modes"]["streamed"] > 0 and placement["streamed_bytes"] > 0
    assert placement["window_bytes"] > 0 and placement["plan_gpu_bytes"] <= result["gpu_budget_bytes"]
    assert result["gpu_budget_bytes"] < result["weight_bytes"]
    printed = capsys.readouterr().out
    assert "placement" in printed and "all on the GPU" in printed and "plan's GPU" in printed
    if not torch.cuda.is_available():
        # the copies ran on the emulated engine: bit for bit the module without streaming
        assert placement["same_as_unstreamed"] is True and placement["overflow_copies"] == 0
        assert any("no CUDA GPU" in note for note in result["notes"])


@pytest.mark.gpu
@pytest.mark.slow
def test_offload_benchmark_large_on_a_gpu(tmp_path):
    """Slow (exports and runs the 1.23B fp16 model, minutes): on one GPU under a 1 GiB budget the
    peak stays within the budget and the outputs are as accurate as all-on-GPU fp16's: the
    largest difference from the fp32 model at most twice all-on-GPU fp16's own (a stated
    relative bound: host layers compute in fp32, so the difference from all-on-GPU fp16 itself
    is fp16 rounding of the order of the logits' ulp, not zero)."""
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    code, result = _run(tmp_path, "--size", "large", "--gpu-budget", "1GiB", "--repeats", "3")
    placement, all_gpu = result["rows"]["placement"], result["rows"]["all on the GPU"]
    assert code == 0 and placement["budget_held"] is True
    assert placement["peak_gpu_bytes"] <= result["gpu_budget_bytes"]
    assert placement["max_abs_diff_fp32"] <= 2 * all_gpu["max_abs_diff_fp32"] + 1e-3
    assert placement["modes"]["streamed"] > 0 and placement["overflow_copies"] == 0
