"""Input normalisation: the ready-arrays path and the converting, explaining path."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

import placement as pl
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


def _two_inputs(second: str = "seq") -> pl.Model:
    """``y = Add(ids, mask)`` over ``ids [batch, seq]`` and ``mask [batch, <second>]`` (int64)."""
    ids = ir.Value(name="input_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", "seq"]))
    mask = ir.Value(
        name="attention_mask", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", second])
    )
    add = ir.Node("", "Add", [ids, mask], name="add", num_outputs=1)
    add.outputs[0].name = "y"
    graph = ir.Graph([ids, mask], add.outputs, nodes=[add], opset_imports={"": 18})
    return pl.Model(ir.Model(graph, ir_version=10))


def test_shared_symbolic_dims_must_agree_before_anything_runs(capfd):
    ids, mask = np.ones((4, 12), np.int64), np.ones((4, 7), np.int64)
    for inputs in ({"input_ids": ids, "attention_mask": mask}, [torch.from_numpy(ids), mask]):
        with pytest.raises(InputError) as err:
            pl.Runner(_two_inputs(), device_map="cpu").run(inputs)
        text = str(err.value)
        assert "'attention_mask' has size 7 in dimension 1 ('seq')" in text and "'input_ids'" in text
        assert "size 12" in text
    assert pl.run(_two_inputs(), [ids, ids], device_map="cpu")[0].shape == (4, 12)


def test_onnx_runtimes_own_log_stays_off_stderr(capfd):
    """A failure inside ONNX Runtime reaches the caller as one error; its colour-coded log line
    does not reach stderr (unless the ``placement`` logger asks for it)."""
    model = _two_inputs("other")  # seq and other unrelated: ONNX Runtime's Add fails to broadcast
    capfd.readouterr()
    with pytest.raises(pl.PlacementError):
        pl.Runner(model, device_map="cpu").run([np.ones((4, 12), np.int64), np.ones((4, 7), np.int64)])
    err = capfd.readouterr().err
    assert "onnxruntime" not in err and "[E:" not in err, err


def test_narrower_integer_inputs_are_widened_losslessly():
    model = _two_inputs()
    ids = np.arange(24, dtype=np.int32).reshape(2, 12)
    for given in (ids, torch.from_numpy(ids), ids.astype(np.uint8)):
        (y,) = pl.run(model, [given, np.ones((2, 12), np.int64)], device_map="cpu")
        np.testing.assert_array_equal(y, ids.astype(np.int64) + 1)
    narrow = InputSpec("ids", np.dtype("int32"), (2,))
    for lossy in (np.arange(2, dtype=np.int64), np.arange(2, dtype=np.uint32), np.arange(2.0)):
        with pytest.raises(InputError, match="has dtype"):
            normalize_inputs([lossy], [narrow])
