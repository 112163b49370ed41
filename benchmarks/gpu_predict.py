"""``benchmarks/gpu.py --sections predict``: predicted against measured on one device, and N GPUs.

For 2, 4 and 8 logical stages of the GPT (the big one on a GPU; the tiny one on the
CPU, which stands in for the GPU with ``--dry-run``), every stage on the one device and
kept apart (``Runner(fold=False)`` where the Runner has that option):

* the schedule's fixed cost per micro-batch per stage is measured first on this device
  (:func:`benchmarks.pipeline_fixed_cost.measure`, 2 stages, ORT run and torch 1F1B);
* **ORT**: each stage's time at the micro-batch size (times ``k``) and
  ``Runner(chunks=k).run`` are measured in alternation, round by round; predicted is
  ``simulate_pipeline`` of those stage times with the measured fixed cost, the stages
  sharing the device (a GPU runs one stage's kernels at a time; emulated CPU devices run
  side by side, each on its own thread);
* **torch**: ``pl.train_step`` on ``to_torch(chunks=k)`` measured; predicted from the
  unsplit step at the micro-batch size (``to_torch()``, times ``k``), split over the
  stages in proportion to their ORT forward times, a third forward and two thirds
  backward, with the torch fixed cost and 1F1B;
* ``pl.predict`` of the same stages for 2, 4 and 8 GPUs on NVLink and PCIe (the
  boundary bytes of the placed model over the link).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import placement as pl
from benchmarks.gpu_setup import StageTimer, export
from benchmarks.pipeline_fixed_cost import measure as measure_fixed_cost
from benchmarks.pipeline_fixed_cost import runner_options, summary
from placement.planning.predict import FIXED_COST_S, simulate_pipeline

__all__ = ["section_predict"]

_TORCH_1F1B = "torch 1f1b checkpoint=never"


def fixed_costs(device: str, *, repeats: int) -> dict[str, float]:
    """Seconds per micro-batch per stage on ``device`` (``"cpu"``/``"cuda"``): ``ort``, ``torch``
    (wall time, measured here on 2 stages); :data:`FIXED_COST_S` where a figure is missing."""
    rows = measure_fixed_cost(2, device=device, repeats=repeats, block=max(1, repeats // 4),
                              only=("ort run", _TORCH_1F1B))  # fmt: skip
    found = summary(rows).get(device, {})
    return {key: max(0.0, found.get(f"{key}_us", FIXED_COST_S[key] * 1e6)) * 1e-6 for key in ("ort", "torch")}


def _rounds(runner: Any, timer: Any, feeds: Any, repeats: int) -> tuple[list[float], float]:
    """Stage times (one round of the timer) and the runner's run, alternating; medians."""
    stages: list[list[float]] = []
    runs: list[float] = []
    for r in range(repeats + 2):
        spent = timer.round()
        start = time.perf_counter()
        runner.run(feeds)
        if r >= 2:
            runs.append(time.perf_counter() - start)
            stages.append(spent)
    return timer.by_device([statistics.median(c) for c in zip(*stages)]), statistics.median(runs)


def _torch_step(placed: pl.Model, device_map: Any, x: Any, chunks: int, repeats: int) -> tuple[float, float]:
    """(unsplit step at the micro-batch size, times ``chunks``; the ``chunks`` step), medians."""
    import torch

    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def step(module: Any, inputs: Any) -> None:
        pl.train_step(module, inputs, loss_fn=lambda out: out.float().square().mean())
        module.zero_grad(set_to_none=True)
        sync()

    plain = pl.to_torch(placed, device_map=device_map)
    piped = pl.to_torch(placed, device_map=device_map, chunks=chunks)
    micro = x[: max(1, x.shape[0] // chunks)]
    small: list[float] = []
    whole: list[float] = []
    for r in range(repeats + 3):
        start = time.perf_counter()
        step(plain, micro)
        middle = time.perf_counter()
        step(piped, x)
        if r >= 3:
            small.append((middle - start) * chunks)
            whole.append(time.perf_counter() - middle)
    return statistics.median(small), statistics.median(whole)


def section_predict(
    net: Any, args: tuple[Any, ...], *, device: str, repeats: int, stage_counts: Sequence[int] = (2, 4, 8),
    chunks: Sequence[int] = (1, 4),
) -> list[dict[str, Any]]:  # fmt: skip
    """Rows of predicted against measured on the one device, with N-GPU predictions."""
    fixed = fixed_costs(device, repeats=max(4, repeats // 2))
    model = export(net, args, dynamic=True)
    feeds = {n: a.numpy() for n, a in zip(model.inputs, args)}
    x = args[0].to("cuda:0") if device == "cuda" else args[0]
    rows = []
    shared = device == "cuda"  # a GPU runs one stage's kernels at a time
    for count in stage_counts:
        placed = pl.place_evenly(model.copy(), count)
        device_map: Any = {k: "cuda:0" for k in range(count)} if device == "cuda" else "cpu"
        for k in chunks:
            micro = {n: a[: max(1, a.shape[0] // k)] for n, a in feeds.items()}
            timer = StageTimer(pl.Runner(placed, threads=1, **runner_options(device_map)), micro)
            runner = pl.Runner(placed, chunks=k, threads_per_stage=1, **runner_options(device_map))
            stage_s, measured = _rounds(runner, timer, feeds, repeats)
            times = [t * k for t in stage_s]
            one = simulate_pipeline(times, chunks=k, fixed_cost_s=fixed["ort"], shared_device=shared)
            rows.append(_row(placed, "ort run", count, k, times, one.step_s, measured, fixed["ort"]))
            small, step = _torch_step(placed, device_map, x, k, max(3, repeats // 3))
            share = [t / sum(times) for t in times]
            fwd, bwd = [small * s / 3 for s in share], [small * s * 2 / 3 for s in share]
            one = simulate_pipeline(fwd, backward_times=bwd, chunks=k, schedule="1f1b",
                                    fixed_cost_s=fixed["torch"], shared_device=shared)  # fmt: skip
            rows.append(
                _row(placed, "torch train_step", count, k, fwd, one.step_s, step, fixed["torch"], bwd)
            )
    return rows


def _row(
    placed: pl.Model, runtime: str, count: int, chunks: int, times: list[float], predicted: float,
    measured: float, fixed: float, backward: list[float] | None = None,
) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = {
        "stages": count, "runtime": runtime, "chunks": chunks,
        "stage_ms": [round(t * 1e3, 4) for t in times], "fixed_cost_us": round(fixed * 1e6, 2),
        "one_device_predicted_ms": round(predicted * 1e3, 4),
        "one_device_measured_ms": round(measured * 1e3, 4),
        "one_device_error": round(predicted / measured - 1, 4),
    }  # fmt: skip
    schedule = "1f1b" if backward is not None else "gpipe"
    for links in ("nvlink", "pcie"):
        (p,) = pl.predict(placed, stage_times=times, backward_times=backward, links=links, chunks=chunks,
                          schedule=schedule, fixed_cost_s=fixed)  # fmt: skip
        row[f"{links}_ms"] = round(p.step_s * 1e3, 4)
        row[f"{links}_speedup"] = round(p.speedup, 4)
    return row
