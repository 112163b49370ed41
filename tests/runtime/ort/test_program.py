"""The compiled program: its native run against its step walk (placement.runtime.ort.program)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import placement as pl
from placement.runtime.ort.program import NativeRun, Program
from placement.runtime.ort.steps import StageStep, TransferStep
from tests.conftest import MODEL_NAMES
from tests.passes.helpers import churn
from tests.runtime.ort.test_runner import place_random, place_shift


def walk(program: Program, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """A run by the program's steps (what a run does without its native run)."""
    values = program.feed(arrays)
    for step in program.steps:
        step.run(values)
    return program.collect(values)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("place", ["shift4", "random3"])
def test_native_run_equals_the_step_walk_bit_for_bit(exported, name, place):
    model, _, args = exported(name)
    place_shift(model, 4) if place == "shift4" else place_random(model, 3, seed=7)
    runner = pl.Runner(model, device_map="cpu", fold=False)
    program = runner.program
    assert isinstance(program.native, NativeRun)
    assert len(program.native.stages) == sum(isinstance(s, StageStep) for s in program.steps)
    arrays = [a.numpy() for a in args]
    got = runner.run(arrays)
    again = runner.run(arrays)  # a second run allocates anew: the first outputs stay
    churn()
    want = walk(program, arrays)
    for g, a, w in zip(got, again, want):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(a, w)


def test_native_run_resolves_aliases_and_frees_every_key_after_its_last_reader(exported):
    model, _, _ = exported("unet")
    place_shift(model, 4)
    program = pl.Runner(model, device_map="cpu", fold=False).program
    native = program.native
    assert native is not None
    targets = {s.target for s in program.steps if isinstance(s, TransferStep)}
    assert targets  # the placement hands blobs over ...
    read = {key for _, bind, _, _ in native.stages for _, key in bind}
    assert not read & targets  # ... and the native run reads them where they were made
    kept = {key for key, const in native.outputs if const is None}
    freed = [key for *_, free in native.stages for key in free]
    assert len(freed) == len(set(freed))
    assert set(freed) == read - kept
    last = {}
    for i, (_, bind, _, _) in enumerate(native.stages):
        for _, key in bind:
            last[key] = i
    for i, (*_, free) in enumerate(native.stages):
        assert all(last[key] == i for key in free)


def test_small_outputs_are_copied_large_ones_keep_their_value_alive():
    """Both kinds of output stay valid after later runs and allocations."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("ReduceSum", ["r"], ["small"], name="sum", keepdims=0),
            helper.make_node("Neg", ["r"], ["large"], name="neg"),
        ],
        "outs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 128])],
        [
            helper.make_tensor_value_info("small", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("large", TensorProto.FLOAT, [256, 128]),
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=10)
    model = pl.load(proto)
    model.set_device("neg", 1)
    model.set_device("sum", 1)
    pl.inject_cross_device_copies(model)
    runner = pl.Runner(model, device_map="cpu", fold=False)
    assert runner.program.native is not None
    x = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    small, large = runner.run({"x": x})
    assert small.flags.owndata and not large.flags.owndata
    for _ in range(3):
        runner.run({"x": -x})
        churn()
    np.testing.assert_allclose(small, np.maximum(x, 0).sum(), rtol=1e-5)
    np.testing.assert_array_equal(large, -np.maximum(x, 0))


def test_programs_that_need_their_steps_have_no_native_run():
    # a graph output that is a graph input
    graph = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["y"], name="neg")],
        "passthrough",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=10)
    runner = pl.Runner(pl.load(proto), device_map="cpu", fold=False)
    assert runner.program.native is None
    x = np.array([1.0, -2.0], np.float32)
    y, same = runner.run({"x": x})
    np.testing.assert_array_equal(y, -x)
    np.testing.assert_array_equal(same, x)
    # a stage whose boundary carries a sequence runs as a host step
    graph = helper.make_graph(
        [
            helper.make_node("SequenceConstruct", ["x", "x"], ["s"], name="construct"),
            helper.make_node("ConcatFromSequence", ["s"], ["cat"], name="concat", axis=0),
        ],
        "seq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("cat", TensorProto.FLOAT, [4])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=10)
    model = pl.load(proto)
    model.set_device("concat", 1)
    pl.inject_cross_device_copies(model)
    runner = pl.Runner(model, device_map="cpu", fold=False)
    assert runner.program.native is None
    (cat,) = runner.run({"x": x})
    np.testing.assert_array_equal(cat, np.concatenate([x, x]))


def test_native_run_failures_name_the_stage(exported):
    model, _, (x,) = exported("mlp")
    place_shift(model, 2)
    native = pl.Runner(model, device_map="cpu", fold=False).program.native
    assert native is not None
    wrong = np.ascontiguousarray(x.numpy()[..., :1])  # what the runner's checks would refuse
    with pytest.raises(pl.PlacementError, match=r"stage 0 .* failed in ONNX Runtime"):
        native.run([wrong])
