"""The pipeline predictor: bubbles, link times, overlap and schedules on synthetic stages."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import placement as pl
from placement.planning.link_model import Link
from placement.planning.predict import simulate_pipeline
from placement.runtime.schedule import bubble_fraction


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 16), st.floats(0.001, 10.0))
def test_equal_stages_give_the_gpipe_bubble(stages, chunks, t):
    p = simulate_pipeline([t] * stages, chunks=chunks)
    assert math.isclose(p.step_s, (chunks + stages - 1) * t / chunks, rel_tol=1e-9)
    assert math.isclose(p.bubble, bubble_fraction(chunks, stages), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(p.single_s, stages * t)
    assert math.isclose(p.stream_s, t)  # streaming: the slowest stage bounds


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "chunks"), [(2, 4), (4, 4), (4, 8), (8, 2)])
def test_training_bubble_is_the_same_for_both_schedules(schedule, stages, chunks):
    f, b = 1.0, 2.0
    p = simulate_pipeline([f] * stages, backward_times=[b] * stages, chunks=chunks, schedule=schedule)
    assert math.isclose(p.step_s, (chunks + stages - 1) * (f + b) / chunks, rel_tol=1e-9)
    assert math.isclose(p.bubble, bubble_fraction(chunks, stages), rel_tol=1e-9)
    assert p.stream_s == p.step_s and p.training


def test_the_slowest_stage_bounds_a_long_pipeline():
    p = simulate_pipeline([1.0, 3.0, 1.0], chunks=64)
    assert p.stream_s == pytest.approx(3.0)
    assert p.step_s == pytest.approx(3.0 + (1.0 + 1.0) / 64, rel=1e-9)  # fill and drain of the others
    assert p.speedup == pytest.approx(5.0 / p.step_s)


def test_transfers_overlap_or_hold_the_sender():
    c = 0.1
    overlapped = simulate_pipeline([1.0, 1.0], transfer_times=[c], chunks=4)
    held = simulate_pipeline([1.0, 1.0], transfer_times=[c], chunks=4, overlap=False)
    # overlapped: one transfer on the critical path (the fill); held: every micro-batch's on stage 0
    assert overlapped.step_s == pytest.approx(5 * 0.25 + c)
    assert held.step_s == pytest.approx(4 * (0.25 + c) + 0.25)
    assert held.stream_s == pytest.approx(4 * (0.25 + c)) and overlapped.stream_s == pytest.approx(1.0)


def test_a_slow_link_becomes_the_bottleneck():
    p = simulate_pipeline([1.0, 1.0], transfer_times=[0.5], chunks=8)  # 0.5 per micro-batch > 0.125
    assert p.stream_s == pytest.approx(4.0)
    assert p.step_s == pytest.approx(0.125 + 8 * 0.5 + 0.125)


def test_call_overhead_is_paid_per_micro_batch():
    base = simulate_pipeline([1.0, 1.0], chunks=4)
    costly = simulate_pipeline([1.0, 1.0], chunks=4, call_overhead_s=0.01)
    assert costly.step_s - base.step_s == pytest.approx(5 * 0.01)


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
@pytest.mark.parametrize("training", [False, True])
def test_the_fixed_cost_is_host_work_one_stage_at_a_time(stages, training):
    """Near-zero compute: every micro-batch pays the fixed cost on every stage, one after another."""
    c, k = 1e-4, 16
    backward = [0.0] * stages if training else None
    p = simulate_pipeline([0.0] * stages, chunks=k, fixed_cost_s=c, backward_times=backward)
    assert p.step_s == pytest.approx(k * stages * c)
    unsplit = simulate_pipeline([0.0] * stages, chunks=1, fixed_cost_s=c, backward_times=backward)
    assert unsplit.step_s == 0.0 and unsplit.extra["fixed_cost_s"] == 0.0  # no schedule, no fixed cost
    if not training:
        assert p.stream_s == pytest.approx(k * stages * c)


def test_the_fixed_cost_serialises_the_stages_host_work():
    """With compute the host work mostly hides behind the other stage's compute; one host
    makes it cost at least what the same cost paid in parallel (``call_overhead_s``) costs."""
    c = 1e-3
    serial = simulate_pipeline([0.1, 0.1], chunks=4, fixed_cost_s=c)
    parallel = simulate_pipeline([0.1, 0.1], chunks=4, call_overhead_s=c)
    assert parallel.step_s == pytest.approx(5 * (0.025 + c))
    assert parallel.step_s <= serial.step_s <= parallel.step_s + 4 * 2 * c
    assert serial.step_s < 5 * 0.025 + 4 * 2 * c  # far below paying all of it on the critical path


def test_stages_sharing_one_device_compute_one_at_a_time():
    """Logical stages on one GPU: no pipelining of compute, only host work hides behind it."""
    alone = simulate_pipeline([0.1, 0.2], chunks=4, shared_device=True)
    assert alone.step_s == pytest.approx(0.3) and alone.stream_s == pytest.approx(0.3)
    c = 0.001
    hidden = simulate_pipeline([0.1, 0.2], chunks=4, shared_device=True, fixed_cost_s=c)
    assert 0.3 + c <= hidden.step_s < 0.3 + 8 * c  # the first host slot, then mostly behind compute
    exposed = simulate_pipeline([0.0, 0.0], chunks=4, shared_device=True, fixed_cost_s=c)
    assert exposed.step_s == pytest.approx(8 * c)


def test_the_fixed_cost_changes_the_best_chunk_count():
    from placement.models import mlp

    placed = pl.place_evenly(pl.from_torch(*mlp.build("tiny")), 2)

    def best(fixed: float) -> int:
        times = [0.004, 0.004]
        steps = {k: pl.predict(placed, stage_times=times, links=None, chunks=k, fixed_cost_s=fixed)[0]
                 for k in (1, 2, 4, 8, 16, 32, 64)}  # fmt: skip
        return min(steps, key=lambda k: steps[k].step_s)

    assert best(0.0) == 64  # free micro-batches: the more the smaller the bubble
    assert best(50e-6) == 8  # 4 ms stages: the bubble against k x 2 x 50 us of hand-offs
    assert best(400e-6) == 4


def test_predict_defaults_to_the_measured_fixed_cost():
    from placement.planning.predict import FIXED_COST_S

    (run,) = pl.predict(_plan(0), stage_times=[0.002, 0.002], links=None, chunks=4)
    (free,) = pl.predict(_plan(0), stage_times=[0.002, 0.002], links=None, chunks=4, fixed_cost_s=0.0)
    assert run.extra["fixed_cost_s"] == FIXED_COST_S["ort"] and run.step_s > free.step_s
    (step,) = pl.predict(_plan(0), stage_times=[0.002, 0.002], backward_times=[0.004, 0.004], chunks=4)
    assert step.extra["fixed_cost_s"] == FIXED_COST_S["torch"] and step.training
    with pytest.raises(pl.PlanError, match="fixed_cost_s"):
        pl.predict(_plan(0), stage_times=[0.002, 0.002], chunks=4, fixed_cost_s=-1.0)


def test_bad_inputs_are_plan_errors():
    with pytest.raises(pl.PlanError, match="transfer times"):
        simulate_pipeline([1.0, 1.0], transfer_times=[])
    with pytest.raises(pl.PlanError, match="schedule"):
        simulate_pipeline([1.0], schedule="zero-bubble")
    with pytest.raises(pl.PlanError, match="non-negative"):
        simulate_pipeline([1.0, -1.0])


def _plan(cut_bytes: int, devices=("cuda:0", "cuda:1")) -> pl.Plan:
    from placement.planning.plan import DevicePlan

    rows = [DevicePlan(d, 3, "a", "b", 1_000_000, 0, 0, None, 0, 0) for d in devices]
    return pl.Plan({}, rows, "time", "throughput", 1_000_000, 1_000_000, 2_000_000, cut_bytes, [cut_bytes])


def test_link_time_scales_with_bytes_and_bandwidth():
    nbytes = 64 << 20
    (nv,) = pl.predict(_plan(nbytes), links="nvlink", chunks=4)
    (pcie,) = pl.predict(_plan(nbytes), links="pcie", chunks=4)
    link = Link(bandwidth=20e9, latency=10e-6)
    assert pcie.transfer_s == [pytest.approx(link.latency + nbytes / 4 / link.bandwidth, rel=1e-6)]
    assert pcie.transfer_s[0] > nv.transfer_s[0] and pcie.step_s > nv.step_s
    (double,) = pl.predict(_plan(2 * nbytes), links="pcie", chunks=4)
    assert double.transfer_s[0] - link.latency == pytest.approx(2 * (pcie.transfer_s[0] - link.latency))
    (free,) = pl.predict(_plan(nbytes), links=None, chunks=4, fixed_cost_s=0.0)
    assert free.transfer_s == [0.0] and free.step_s == pytest.approx(5 * 1e-3 / 4)


def test_predict_takes_measured_stage_times_over_the_plans_costs():
    (p,) = pl.predict(_plan(0), stage_times=[0.002, 0.004], chunks=2)
    assert p.stage_s == [0.002, 0.004] and p.single_s == pytest.approx(0.006)
    with pytest.raises(pl.PlanError, match="2 stages"):
        pl.predict(_plan(0), stage_times=[0.1])
    with pytest.raises(pl.PlanError, match="gpus"):
        pl.predict(_plan(0), gpus=[2])


def test_predict_a_model_on_several_gpu_counts():
    from placement.models import mlp

    model = pl.from_torch(*mlp.build("tiny"))
    state = model.device_state()
    results = pl.predict(model, gpus=[1, 2, 3], links="pcie", chunks=4)
    assert [p.gpus for p in results] <= [1, 2, 3] and all(p.step_s > 0 for p in results)
    assert model.device_state() == state  # the model is not placed by predicting
    one = results[0]
    assert one.gpus == 1 and one.bubble == pytest.approx(0.0)


def test_predict_a_placed_model_from_its_measured_stages():
    from placement.models import mlp

    placed = pl.place_evenly(pl.from_torch(*mlp.build("tiny")), 2)  # with copies
    (p,) = pl.predict(placed, stage_times=[0.003, 0.001], links="nvlink", chunks=2, fixed_cost_s=0.0)
    assert p.gpus == 2 and p.extra["devices"] == ["cuda:0", "cuda:1"]
    assert p.stream_s == pytest.approx(0.003) and p.transfer_s[0] > 0


def test_gpu_benchmark_validates_the_predictor_on_the_cpu(capsys):
    """``benchmarks/gpu.py``: the CPU validation rows, and a clean exit of the GPU sections without a GPU."""
    from benchmarks import gpu

    rows = gpu.validate_cpu(size="tiny", chunks=(1, 2), repeats=2)
    assert [r["chunks"] for r in rows] == [1, 2]
    assert all(r["predicted_ms"] > 0 and r["measured_ms"] > 0 and math.isfinite(r["error"]) for r in rows)
    if not gpu.has_gpu():
        assert gpu.main(["--sections", "ort", "graphs"]) == 0
        assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_benchmark_predict_section_on_the_cpu():
    """``benchmarks/gpu.py --sections predict`` with the CPU standing in for the GPU: the fixed
    cost measured first, predicted against measured on one device, N-GPU predictions beside.
    Slow (10-40 s on 2 busy cores): two exports, the fixed-cost measurement, pipelined torch steps."""
    from benchmarks import gpu
    from benchmarks.gpu_predict import section_predict

    net, args = gpu.model_and_inputs("tiny-gpt", batch=4)
    rows = section_predict(net, args, device="cpu", repeats=1, stage_counts=(2,), chunks=(2,))
    assert [(r["stages"], r["runtime"], r["chunks"]) for r in rows] == [
        (2, "ort run", 2), (2, "torch train_step", 2)]  # fmt: skip
    for row in rows:
        assert row["one_device_predicted_ms"] > 0 and row["one_device_measured_ms"] > 0
        assert math.isfinite(row["one_device_error"]) and row["fixed_cost_us"] >= 0
        assert row["pcie_ms"] >= row["nvlink_ms"] > 0 and len(row["stage_ms"]) == 2
