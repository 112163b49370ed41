"""Input normalisation: the ready-arrays path and the converting, explaining path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from placement.errors import InputError
from placement.runtime.inputs import InputSpec, normalize_inputs

SPECS = [InputSpec("x", np.dtype("float32"), ("batch", 4)), InputSpec("ids", np.dtype("int64"), (2,))]


def test_ready_arrays_come_back_as_they_are():
    x, ids = np.zeros((3, 4), np.float32), np.arange(2)
    got = normalize_inputs({"ids": ids, "x": x}, SPECS)
    assert got[0] is x and got[1] is ids


@pytest.mark.parametrize(
    "inputs",
    [
        {"x": np.zeros((4, 3), np.float32).T, "ids": np.arange(2)},  # not contiguous
        {"x": torch.zeros(3, 4), "ids": np.arange(2)},  # a tensor
        [np.zeros((3, 4), np.float32), np.arange(2)],  # a sequence
    ],
)
def test_other_inputs_are_converted(inputs):
    x, ids = normalize_inputs(inputs, SPECS)
    assert x.flags.c_contiguous and x.shape == (3, 4) and x.dtype == np.float32
    np.testing.assert_array_equal(ids, np.arange(2))


@pytest.mark.parametrize(
    "inputs, match",
    [
        ({"x": np.zeros((3, 4), np.float64), "ids": np.arange(2)}, "input 'x' has dtype float64"),
        ({"x": np.zeros((3, 5), np.float32), "ids": np.arange(2)}, "input 'x' has size 5 in dimension 1"),
        ({"x": np.zeros((3, 4, 1), np.float32), "ids": np.arange(2)}, "input 'x' has rank 3"),
        ({"x": np.zeros((3, 4), np.float32), "idz": np.arange(2)}, "unknown input 'idz'"),
        ({"x": np.zeros((3, 4), np.float32)}, "missing input 'ids'"),
    ],
)
def test_inputs_the_ready_path_refuses_are_explained(inputs, match):
    with pytest.raises(InputError, match=match):
        normalize_inputs(inputs, SPECS)


def test_contiguous_keeps_0d_arrays_and_torch_tensors_where_they_are():
    import torch

    from placement.runtime.inputs import contiguous

    assert contiguous(np.float32(2)).shape == ()
    assert contiguous(np.ones((3, 2)).T).flags.c_contiguous
    tensor = torch.ones(3, 2).T
    out = contiguous(tensor)
    assert isinstance(out, torch.Tensor) and out.is_contiguous() and out.device == tensor.device
