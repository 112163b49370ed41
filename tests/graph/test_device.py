from __future__ import annotations

import pytest

import placement as pl


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (1, "cuda:1"),
        (0, "cuda:0"),
        ("cuda:1", "cuda:1"),
        ("cpu", "cpu"),
        ("cuda", "cuda:0"),
        ("CUDA:3", "cuda:3"),
        ("gpu:2", "cuda:2"),
        ("2", "cuda:2"),
        ("GPU", "cuda:0"),
        ("cpu:1", "cpu:1"),
        (pl.Device("cuda", 4), "cuda:4"),
    ],
)
def test_parse(spec, expected):
    assert str(pl.Device.parse(spec)) == expected


def test_torch_device():
    import torch

    assert pl.Device.parse(torch.device("cuda", 1)) == pl.Device("cuda", 1)
    assert pl.Device.parse(torch.device("cpu")) == pl.Device("cpu")


@pytest.mark.parametrize(
    "spec",
    [
        "tpu:1",
        "cuda:x",
        "cuda:-1",
        -1,
        1.5,
        None,
        True,
        "",
        "cuda:1:2",
        "cuda:01",
        "01",
        "cuda:\uff11",  # full-width digit one
        "\uff12",
        "cuda:\u0663",  # Arabic-Indic digit three
        " cuda:1",
        "cuda: 1",
        "cuda:1 ",
        "cuda:+1",
        2**70,
        f"cuda:{2**70}",
        str(2**70),
        "cpu:99999999999999999999",
    ],
)
def test_bad_specs_raise_device_error(spec):
    with pytest.raises(pl.DeviceError) as err:
        pl.Device.parse(spec)
    assert isinstance(err.value, pl.PlacementError)


def test_hashable_ordered_printed():
    devices = {pl.Device.parse(s) for s in ["cuda:1", 1, "cuda:0", "cpu"]}
    assert sorted(devices) == [pl.Device("cpu"), pl.Device("cuda", 0), pl.Device("cuda", 1)]
    assert repr(pl.Device("cuda", 1)) == "Device('cuda:1')"
    assert pl.Device("cuda", 1).slug == "cuda_1"


def test_absurd_indices_are_refused_everywhere():
    import numpy as np

    with pytest.raises(pl.DeviceError, match="out of range"):
        pl.Device("cuda", 2**70)
    assert pl.Device.parse(np.int64(3)) == pl.Device("cuda", 3)
    assert pl.Device.parse(65535) == pl.Device("cuda", 65535)
