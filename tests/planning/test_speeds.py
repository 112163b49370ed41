"""Device speeds: given, measured here, or the stated default; bad rates are plan errors."""

from __future__ import annotations

import pytest

import placement as pl
from placement.planning.speeds import DEFAULT_FLOPS, device_speeds, measure_flops


def test_given_rates_win_and_the_rest_take_the_default():
    speeds = device_speeds({"cuda": 2e13}, measure=False)
    assert speeds.rates == {"cuda": 2e13, "cpu": DEFAULT_FLOPS["cpu"]}
    assert speeds.sources == {"cuda": "given", "cpu": "default"}
    assert "cuda 20 TFLOP/s (given)" in speeds.describe()


def test_the_default_gpu_is_tens_of_times_the_host():
    assert 10 <= DEFAULT_FLOPS["cuda"] / DEFAULT_FLOPS["cpu"] <= 1000


def test_the_host_is_measured_and_an_absent_gpu_is_not():
    speeds = device_speeds()
    assert speeds.sources["cpu"] == "measured" and speeds.rates["cpu"] > 1e6
    assert speeds.rates["cpu"] == measure_flops("cpu", 0)  # measured once per process
    assert measure_flops("cuda", 10_000) is None  # no such GPU here (nor anywhere)


@pytest.mark.parametrize(
    "bad", [{"tpu": 1e12}, {"cpu": 0}, {"cuda": -1.0}, {"cuda": float("inf")}, {"cpu": True}]
)
def test_bad_rates_are_plan_errors(bad):
    with pytest.raises(pl.PlanError, match="throughput"):
        device_speeds(bad, measure=False)


@pytest.mark.gpu
def test_a_real_gpu_is_measured_faster_than_the_host():
    speeds = device_speeds()
    assert speeds.sources["cuda"] == "measured"
    assert speeds.rates["cuda"] > speeds.rates["cpu"]
