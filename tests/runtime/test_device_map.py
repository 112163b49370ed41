"""Device maps: logical devices to physical ones, shared by both runtimes."""

from __future__ import annotations

import logging

import pytest
import torch

import placement as pl
from placement.runtime import device_map as dm
from placement.runtime.device_map import PhysicalDevice, resolve_device_map

D0, D1, CPU = pl.Device("cuda", 0), pl.Device("cuda", 1), pl.Device("cpu")
N_GPUS = torch.cuda.device_count()


def test_single_device_maps_everything():
    dmap = resolve_device_map([D0, D1, CPU], "cpu")
    assert {str(k): str(v) for k, v in dmap.items()} == {"cpu": "cpu", "cuda:0": "cpu", "cuda:1": "cpu"}
    assert dmap[D1].emulated and not dmap[CPU].emulated


def test_dict_map_with_ints_and_strings():
    dmap = resolve_device_map([D0, D1], {0: "cpu", "cuda:1": "cpu"})
    assert set(dmap) == {D0, D1}
    assert all(p == PhysicalDevice("cpu", 0, emulated=True) for p in dmap.values())


def test_unknown_and_missing_logical_devices_are_named():
    with pytest.raises(pl.DeviceError, match="cuda:7"):
        resolve_device_map([D0], {0: "cpu", 7: "cpu"})
    with pytest.raises(pl.DeviceError, match="cuda:1"):
        resolve_device_map([D0, D1], {0: "cpu"})
    with pytest.raises(pl.DeviceError, match="tpu"):
        resolve_device_map([D0], "tpu:0")
    with pytest.raises(pl.DeviceError, match="tpu"):
        resolve_device_map([D0], {0: "tpu"})


def test_unavailable_gpu_is_an_error():
    missing = f"cuda:{N_GPUS}"
    with pytest.raises(pl.DeviceError, match=missing):
        resolve_device_map([D0], {0: missing})


def test_auto_emulates_once_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(dm, "_warned_emulation", False)
    monkeypatch.setattr(dm, "cuda_device_count", lambda runtime="torch": 0)
    with caplog.at_level(logging.WARNING, logger=dm.__name__):
        first = resolve_device_map([D0, D1])
        second = resolve_device_map([D0, D1], None)
    assert first == second
    assert all(p.type == "cpu" and p.emulated for p in first.values())
    warnings = [r for r in caplog.records if "EMULATING" in r.getMessage()]
    assert len(warnings) == 1 and "cuda:1" in warnings[0].getMessage()


def test_auto_uses_real_gpus_when_present(monkeypatch):
    monkeypatch.setattr(dm, "cuda_device_count", lambda runtime="torch": 2)
    dmap = resolve_device_map([D0, D1, CPU])
    assert dmap[D1] == PhysicalDevice("cuda", 1) and dmap[CPU] == PhysicalDevice("cpu", 0)
    assert dmap[D0].ort_provider == ("CUDAExecutionProvider", {"device_id": 0})
    assert dmap[CPU].ort_provider == ("CPUExecutionProvider", {})


@pytest.mark.parametrize(
    ("n_gpus", "expected"),
    [
        (1, ["cuda:0", "cuda:0", "cuda:0", "cuda:0"]),
        (2, ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]),
        (3, ["cuda:0", "cuda:0", "cuda:1", "cuda:2"]),
    ],
)
def test_auto_shares_the_gpus_there_are_in_order(monkeypatch, caplog, n_gpus, expected):
    monkeypatch.setattr(dm, "_warned_sharing", False)
    monkeypatch.setattr(dm, "cuda_device_count", lambda runtime="torch": n_gpus)
    logical = [pl.Device("cuda", k) for k in range(4)]
    with caplog.at_level(logging.WARNING, logger=dm.__name__):
        first = resolve_device_map([*logical, CPU])
        second = resolve_device_map(logical, "auto")
    assert [str(first[d]) for d in logical] == expected
    assert not any(p.emulated for p in first.values()) and first[CPU] == PhysicalDevice("cpu", 0)
    assert [str(second[d]) for d in logical] == expected
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "sharing" in said[0] and f"on {n_gpus} GPU(s)" in said[0]


def test_auto_sharing_follows_the_faked_torch_and_ort_gpu_count(monkeypatch):
    import onnxruntime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    for runtime in ("torch", "ort"):
        dmap = resolve_device_map([D0, D1], runtime=runtime)
        assert dmap == {D0: PhysicalDevice("cuda", 0), D1: PhysicalDevice("cuda", 0)}
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert all(p.emulated for p in resolve_device_map([D0, D1], runtime="ort").values())


def test_physical_device_views():
    assert str(PhysicalDevice("cuda", 1)) == "cuda:1"
    assert PhysicalDevice("cpu").torch_device == torch.device("cpu")


def test_ort_needs_the_cuda_provider(monkeypatch):
    import onnxruntime

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert dm.cuda_device_count("ort") == 0
    assert dm.cuda_device_count("torch") == 2
